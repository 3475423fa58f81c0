//! The cheapest possible hyper reverse proxy: the yardstick for what any
//! proxy hop costs on this machine, so the load benchmark can tell
//! compactor's own overhead apart from the price of a hop.
//!
//! `cargo run --example naive_proxy -- LISTEN UPSTREAM_ADDR [WORKERS]`
//!
//! Forwards every request to `http://UPSTREAM_ADDR` with the same
//! hyper-util server and pooled client compactor uses, and nothing else: no
//! header work, no body wrappers, no parsing. Prints `listening on <addr>`.

use std::convert::Infallible;

use http::{Request, Response, Uri};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::net::TcpListener;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

fn main() -> Result<(), BoxError> {
    let mut args = std::env::args().skip(1);
    let listen = args.next().unwrap_or_else(|| "127.0.0.1:0".to_owned());
    let upstream = args
        .next()
        .ok_or("usage: naive_proxy LISTEN UPSTREAM_ADDR [WORKERS]")?;
    let mut rt = tokio::runtime::Builder::new_multi_thread();
    if let Some(n) = args.next().and_then(|w| w.parse().ok()) {
        rt.worker_threads(n);
    }
    rt.enable_all().build()?.block_on(async move {
        let mut http = HttpConnector::new();
        http.set_nodelay(true);
        let client: Client<_, Incoming> = Client::builder(TokioExecutor::new()).build(http);
        let listener = TcpListener::bind(&listen).await?;
        println!("listening on {}", listener.local_addr()?);
        loop {
            let (stream, _) = listener.accept().await?;
            stream.set_nodelay(true)?;
            let client = client.clone();
            let upstream = upstream.clone();
            tokio::spawn(async move {
                let svc = service_fn(move |mut req: Request<Incoming>| {
                    let client = client.clone();
                    let pq = req.uri().path_and_query().map_or("/", |p| p.as_str());
                    let uri: Result<Uri, _> = format!("http://{upstream}{pq}").parse();
                    async move {
                        let Ok(uri) = uri else {
                            return Ok::<_, Infallible>(bad_gateway());
                        };
                        *req.uri_mut() = uri;
                        Ok(match client.request(req).await {
                            Ok(resp) => resp.map(either_body),
                            Err(_) => bad_gateway(),
                        })
                    }
                });
                let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                    .serve_connection(TokioIo::new(stream), svc)
                    .await;
            });
        }
    })
}

type Out = http_body_util::Either<Incoming, http_body_util::Empty<bytes::Bytes>>;

fn either_body(b: Incoming) -> Out {
    http_body_util::Either::Left(b)
}

fn bad_gateway() -> Response<Out> {
    let mut r = Response::new(http_body_util::Either::Right(http_body_util::Empty::new()));
    *r.status_mut() = http::StatusCode::BAD_GATEWAY;
    r
}
