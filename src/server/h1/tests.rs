use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use http_body::Frame;
use http_body_util::BodyExt;
use hyper_util::rt::TokioIo;
use proptest::prelude::*;
use tokio::io::duplex;

use super::*;
use crate::error::{full_body, BoxError};

/// A body of given frames, of unknown length (as a streamed upstream body).
struct Frames(VecDeque<Result<Frame<Bytes>, BoxError>>);

impl Body for Frames {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        Poll::Ready(self.0.pop_front())
    }
}

fn frames(parts: Vec<Result<Frame<Bytes>, BoxError>>) -> ProxyBody {
    Frames(parts.into()).boxed_unsync()
}

fn data(s: &'static str) -> Result<Frame<Bytes>, BoxError> {
    Ok(Frame::data(Bytes::from_static(s.as_bytes())))
}

type Respond = Arc<dyn Fn(&http::request::Parts, Bytes) -> Response<ProxyBody> + Send + Sync>;

/// The response as the router hands it over: frames before an error are
/// flushed first (`FlushBeforeError`), for hyper's server as for this one.
fn as_routed(response: Response<ProxyBody>) -> Response<ProxyBody> {
    response.map(|b| crate::upstream::body::FlushBeforeError::new(b).boxed_unsync())
}

/// A request as the handler saw it: method, URI, headers, body.
type Seen = (String, String, Vec<(String, String)>, Bytes);

/// What a served connection wrote and saw.
struct Served {
    wire: Vec<u8>,
    ended: Ended,
    /// Each request: method, URI, headers as (name, value), body.
    seen: Vec<Seen>,
}

/// Writes `input` in pieces of the sizes in `cuts` (the rest in one), then
/// half-closes; serves the other end here.
async fn serve_here(input: &[u8], cuts: &[usize], respond: Respond) -> Served {
    let (client, mut server) = duplex(1 << 20);
    let (mut reader, mut writer) = tokio::io::split(client);
    let input = input.to_vec();
    let cuts = cuts.to_vec();
    let writing = tokio::spawn(async move {
        let mut rest = &input[..];
        for n in cuts {
            let n = n.clamp(1, rest.len().max(1)).min(rest.len());
            writer.write_all(&rest[..n]).await.unwrap();
            rest = &rest[n..];
            tokio::task::yield_now().await;
        }
        writer.write_all(rest).await.unwrap();
        writer.shutdown().await.unwrap();
        writer
    });
    let reading = tokio::spawn(async move {
        let mut wire = Vec::new();
        let _ = reader.read_to_end(&mut wire).await;
        wire
    });
    let seen = Arc::new(Mutex::new(Vec::new()));
    let (_tx, mut shutdown) = watch::channel(());
    let ended = {
        let seen = Arc::clone(&seen);
        let handle = move |req: Request<RequestBody>| {
            let respond = Arc::clone(&respond);
            let seen = Arc::clone(&seen);
            async move {
                let (parts, body) = req.into_parts();
                let body = body.collect().await.unwrap().to_bytes();
                let headers = parts
                    .headers
                    .iter()
                    .map(|(k, v)| (k.to_string(), v.to_str().unwrap().to_owned()))
                    .collect();
                seen.lock().unwrap().push((
                    parts.method.to_string(),
                    parts.uri.to_string(),
                    headers,
                    body.clone(),
                ));
                Ok(as_routed(respond(&parts, body)))
            }
        };
        serve(&mut server, handle, &mut shutdown).await
    };
    drop(server);
    let _writer = writing.await.unwrap();
    let wire = reading.await.unwrap();
    let seen = seen.lock().unwrap().clone();
    Served { wire, ended, seen }
}

/// hyper's server answering the same bytes with the same responses.
async fn serve_by_hyper(input: &[u8], respond: Respond) -> Vec<u8> {
    let (client, server) = duplex(1 << 20);
    let (mut reader, mut writer) = tokio::io::split(client);
    let input = input.to_vec();
    tokio::spawn(async move {
        writer.write_all(&input).await.unwrap();
        writer.shutdown().await.unwrap();
        // Held open: hyper's half-close setting is compactor's.
        std::future::pending::<()>().await;
        drop(writer);
    });
    let service = hyper::service::service_fn(move |req: Request<hyper::body::Incoming>| {
        let respond = Arc::clone(&respond);
        async move {
            let (parts, body) = req.into_parts();
            let body = body.collect().await.unwrap().to_bytes();
            Ok::<_, std::convert::Infallible>(as_routed(respond(&parts, body)))
        }
    });
    let conn = hyper::server::conn::http1::Builder::new()
        .half_close(true)
        .serve_connection(TokioIo::new(server), service);
    let _ = conn.await;
    let mut wire = Vec::new();
    let _ = reader.read_to_end(&mut wire).await;
    wire
}

/// The wire with each `date:` value blanked (it is the clock's).
fn undated(wire: &[u8]) -> String {
    let text = String::from_utf8_lossy(wire).into_owned();
    let mut out = String::new();
    let mut rest = text.as_str();
    while let Some(at) = rest.find("date: ") {
        out.push_str(&rest[..at + 6]);
        rest = &rest[at + 6..];
        let end = rest.find("\r\n").unwrap_or(rest.len());
        out.push_str("<date>");
        rest = &rest[end..];
    }
    out.push_str(rest);
    out
}

/// Equal texts, or where they part (a short excerpt: bodies can be large).
fn assert_same(name: &str, ours: &str, theirs: &str) {
    if ours == theirs {
        return;
    }
    let at = ours
        .bytes()
        .zip(theirs.bytes())
        .position(|(a, b)| a != b)
        .unwrap_or(ours.len().min(theirs.len()));
    let excerpt = |s: &str| {
        s.get(at.saturating_sub(40)..(at + 40).min(s.len()))
            .unwrap_or("")
            .to_owned()
    };
    panic!(
        "{name}: differs at byte {at} (lengths {} and {}):\nours:   {:?}\nhyper's: {:?}",
        ours.len(),
        theirs.len(),
        excerpt(ours),
        excerpt(theirs)
    );
}

fn respond(
    f: impl Fn(&http::request::Parts, Bytes) -> Response<ProxyBody> + Send + Sync + 'static,
) -> Respond {
    Arc::new(f)
}

fn with_status(status: StatusCode, body: ProxyBody) -> Response<ProxyBody> {
    let mut r = Response::new(body);
    *r.status_mut() = status;
    r
}

fn trailed(_: &http::request::Parts, _: Bytes) -> Response<ProxyBody> {
    let mut t = HeaderMap::new();
    t.insert("x-sum", HeaderValue::from_static("9"));
    t.insert("x-other", HeaderValue::from_static("1"));
    t.insert(header::CONTENT_TYPE, HeaderValue::from_static("text/plain"));
    let mut r = Response::new(frames(vec![data("body"), Ok(Frame::trailers(t))]));
    r.headers_mut().insert(
        header::TRAILER,
        HeaderValue::from_static("x-sum, content-type"),
    );
    r
}

type Case = (&'static str, &'static [u8], Respond);

/// Responses of every framing compactor's handler can produce, with the
/// request (method) they answer.
fn cases() -> Vec<Case> {
    let mut cases = length_cases();
    cases.extend(stream_cases());
    cases.extend(other_cases());
    cases
}

/// Bodies of known length, none, or no body allowed.
fn length_cases() -> Vec<Case> {
    vec![(
        "a whole body without a length header",
        b"GET /a HTTP/1.1\r\nhost: x\r\n\r\n",
        respond(|_, _| Response::new(full_body(Bytes::from_static(b"abc")))),
    )]
}

/// Bodies of unknown length: chunked, close-delimited, failing, trailed.
fn stream_cases() -> Vec<Case> {
    vec![
        (
            "a streamed body goes chunked",
            b"GET /a HTTP/1.1\r\nhost: x\r\n\r\n",
            respond(|_, _| Response::new(frames(vec![data("abc"), data(""), data("de")]))),
        ),
        (
            "a length header kept for a streamed body",
            b"GET /a HTTP/1.1\r\nhost: x\r\n\r\n",
            respond(|_, _| {
                let mut r = Response::new(frames(vec![data("abc"), data("de")]));
                r.headers_mut()
                    .insert(header::CONTENT_LENGTH, HeaderValue::from_static("5"));
                r.headers_mut()
                    .insert("x-after", HeaderValue::from_static("1"));
                r
            }),
        ),
        (
            "HEAD: the length, no body",
            b"HEAD /a HTTP/1.1\r\nhost: x\r\n\r\n",
            respond(|_, _| Response::new(full_body(Bytes::from_static(b"abc")))),
        ),
        (
            "HEAD with the upstream's length header and no body",
            b"HEAD /a HTTP/1.1\r\nhost: x\r\n\r\n",
            respond(|_, _| {
                let mut r = Response::new(full_body(Bytes::new()));
                r.headers_mut()
                    .insert(header::CONTENT_LENGTH, HeaderValue::from_static("42"));
                r
            }),
        ),
        (
            "204 and 304: no body, no length",
            b"GET /a HTTP/1.1\r\nhost: x\r\n\r\nGET /b HTTP/1.1\r\nhost: x\r\n\r\n",
            respond(|parts, _| {
                let status = if parts.uri.path() == "/a" {
                    StatusCode::NO_CONTENT
                } else {
                    StatusCode::NOT_MODIFIED
                };
                with_status(status, frames(vec![data("x")]))
            }),
        ),
        (
            "an empty body: length 0",
            b"POST /a HTTP/1.1\r\nhost: x\r\ncontent-length: 3\r\n\r\nabc",
            respond(|_, _| with_status(StatusCode::BAD_GATEWAY, full_body(Bytes::new()))),
        ),
        (
            "a reason phrase, a date of the response's own, several values",
            b"GET /a HTTP/1.1\r\nhost: x\r\n\r\n",
            respond(|_, _| {
                let mut r = Response::new(full_body(Bytes::from_static(b"{}")));
                r.extensions_mut()
                    .insert(hyper::ext::ReasonPhrase::from_static(b"Fine Thanks"));
                let h = r.headers_mut();
                h.append("set-cookie", HeaderValue::from_static("a=1"));
                h.append("x-z", HeaderValue::from_static("z"));
                h.append("set-cookie", HeaderValue::from_static("b=2"));
                h.insert(
                    header::DATE,
                    HeaderValue::from_static("Mon, 01 Jan 2024 00:00:00 GMT"),
                );
                r
            }),
        ),
    ]
}

/// Old versions, trailers, failures, pipelining, large frames.
fn other_cases() -> Vec<Case> {
    vec![
        (
            "an HTTP/1.0 response of unknown length ends with the connection",
            b"GET /a HTTP/1.1\r\nhost: x\r\n\r\nGET /b HTTP/1.1\r\nhost: x\r\n\r\n",
            respond(|_, _| {
                let mut r = Response::new(frames(vec![data("old"), data("style")]));
                *r.version_mut() = Version::HTTP_10;
                r
            }),
        ),
        (
            "an HTTP/1.0 response with a length",
            b"GET /a HTTP/1.1\r\nhost: x\r\n\r\nGET /b HTTP/1.1\r\nhost: x\r\n\r\n",
            respond(|_, _| {
                let mut r = Response::new(full_body(Bytes::from_static(b"sized")));
                *r.version_mut() = Version::HTTP_10;
                r
            }),
        ),
        (
            "trailers: none without TE: trailers",
            b"GET /a HTTP/1.1\r\nhost: x\r\n\r\n",
            respond(trailed),
        ),
        (
            "trailers: with TE: trailers, those the Trailer header names and may be trailers",
            b"GET /a HTTP/1.1\r\nhost: x\r\nte: gzip, Trailers\r\n\r\n",
            respond(trailed),
        ),
        (
            "a body that fails after frames: they are written, the message is not ended",
            b"GET /a HTTP/1.1\r\nhost: x\r\n\r\nGET /b HTTP/1.1\r\nhost: x\r\n\r\n",
            respond(|_, _| {
                Response::new(frames(vec![data("part"), Err("upstream reset".into())]))
            }),
        ),
        (
            "pipelined requests, answered in order, bodies echoed",
            b"POST /one HTTP/1.1\r\nhost: x\r\ncontent-length: 5\r\n\r\nhelloGET /two?q=1 HTTP/1.1\r\nhost: x\r\n\r\n",
            respond(|parts, body| {
                let text = format!("{} {} {}", parts.method, parts.uri, body.len());
                Response::new(full_body(Bytes::from(text)))
            }),
        ),
        (
            "a large streamed frame is written from where it is",
            b"GET /a HTTP/1.1\r\nhost: x\r\n\r\n",
            respond(|_, _| {
                let big = Bytes::from(vec![b'z'; COPY_MAX * 3]);
                Response::new(frames(vec![data("head"), Ok(Frame::data(big)), data("tail")]))
            }),
        ),
    ]
}

#[tokio::test]
async fn every_response_is_framed_byte_for_byte_as_hypers_server_frames_it() {
    for (name, input, respond) in cases() {
        let ours = serve_here(input, &[], Arc::clone(&respond)).await;
        let theirs = serve_by_hyper(input, respond).await;
        assert!(matches!(ours.ended, Ended::Closed), "{name}");
        assert!(ours.wire.starts_with(b"HTTP/1."), "{name}");
        assert!(
            undated(&ours.wire).contains("date: <date>\r\n") || name.contains("date"),
            "{name}"
        );
        assert_same(name, &undated(&ours.wire), &undated(&theirs));
    }
}

#[tokio::test]
async fn a_body_shorter_than_its_length_ends_the_connection() {
    let short = || {
        respond(|_, _| {
            let mut r = Response::new(frames(vec![data("abc")]));
            r.headers_mut()
                .insert(header::CONTENT_LENGTH, HeaderValue::from_static("10"));
            r
        })
    };
    let input = b"GET /a HTTP/1.1\r\nhost: x\r\n\r\nGET /b HTTP/1.1\r\nhost: x\r\n\r\n";
    let ours = serve_here(input, &[], short()).await;
    assert_eq!(ours.seen.len(), 1, "the second request is not served");
    assert!(matches!(ours.ended, Ended::Closed));
    let text = undated(&ours.wire);
    assert_eq!(
        text,
        "HTTP/1.1 200 OK\r\ncontent-length: 10\r\ndate: <date>\r\n\r\nabc"
    );
    // hyper ends the connection too; what it flushed before depends on
    // its buffering (here: nothing), never a second response.
    let theirs = undated(&serve_by_hyper(input, short()).await);
    assert!(!theirs.contains("/b"), "{theirs}");
    assert!(theirs.matches("HTTP/1.1").count() <= 1, "{theirs}");
}

#[tokio::test]
async fn the_request_reaches_the_handler_as_it_came() {
    let input = b"POST /v1/chat/completions?x=1 HTTP/1.1\r\nHost: proxy\r\nX-Trace: a\r\ncontent-type: application/json\r\nx-trace: b\r\nContent-Length: 7\r\n\r\n{\"a\":1}";
    let served = serve_here(
        input,
        &[],
        respond(|_, _| Response::new(full_body(Bytes::new()))),
    )
    .await;
    assert_eq!(served.seen.len(), 1);
    let (method, uri, headers, body) = &served.seen[0];
    assert_eq!(method, "POST");
    assert_eq!(uri, "/v1/chat/completions?x=1");
    let pairs: Vec<(&str, &str)> = headers
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect();
    assert_eq!(
        pairs,
        [
            ("host", "proxy"),
            ("x-trace", "a"),
            ("x-trace", "b"),
            ("content-type", "application/json"),
            ("content-length", "7"),
        ]
    );
    assert_eq!(&body[..], b"{\"a\":1}");
}

// A table of cases: its length is the cases, not logic.
#[allow(clippy::too_many_lines)]
#[tokio::test]
async fn what_hyper_answers_is_handed_to_hyper_with_every_byte_read() {
    let big_body = format!(
        "POST /a HTTP/1.1\r\nhost: x\r\ncontent-length: {}\r\n\r\n",
        MAX_MESSAGE + 1
    );
    let many_headers = format!(
        "GET /a HTTP/1.1\r\n{}\r\n",
        (0..MAX_HEADERS + 1)
            .map(|i| format!("x-h{i}: 1\r\n"))
            .collect::<String>()
    );
    let cases: Vec<(&str, Vec<u8>, Handoff)> = vec![
        (
            "HTTP/1.0",
            b"GET /a HTTP/1.0\r\n\r\n".to_vec(),
            Handoff::Http10,
        ),
        (
            "a chunked upload",
            b"POST /a HTTP/1.1\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n".to_vec(),
            Handoff::TransferEncoding,
        ),
        (
            "Expect: 100-continue",
            b"POST /a HTTP/1.1\r\ncontent-length: 3\r\nexpect: 100-continue\r\n\r\n".to_vec(),
            Handoff::Expect,
        ),
        (
            "an upgrade",
            b"GET /a HTTP/1.1\r\nconnection: upgrade\r\nupgrade: websocket\r\n\r\n".to_vec(),
            Handoff::Upgrade,
        ),
        (
            "Connection: close",
            b"GET /a HTTP/1.1\r\nConnection: Close\r\n\r\n".to_vec(),
            Handoff::ConnectionClose,
        ),
        (
            "Connection: close after keep-alive",
            b"GET /a HTTP/1.1\r\nConnection: keep-alive, close\r\n\r\n".to_vec(),
            Handoff::ConnectionClose,
        ),
        (
            "CONNECT",
            b"CONNECT x:443 HTTP/1.1\r\nhost: x:443\r\n\r\n".to_vec(),
            Handoff::Connect,
        ),
        (
            "HTTP/2 prior knowledge",
            b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec(),
            Handoff::H2,
        ),
        (
            "a malformed head",
            b"GET /a HTTP/1.1\r\nbad header\r\n\r\n".to_vec(),
            Handoff::Malformed,
        ),
        (
            "a bad length",
            b"POST /a HTTP/1.1\r\ncontent-length: +3\r\n\r\nabc".to_vec(),
            Handoff::Malformed,
        ),
        (
            "a length past u64",
            b"POST /a HTTP/1.1\r\ncontent-length: 18446744073709551616\r\n\r\nabc".to_vec(),
            Handoff::Malformed,
        ),
        (
            "two lengths",
            b"POST /a HTTP/1.1\r\ncontent-length: 3\r\ncontent-length: 3\r\n\r\nabc".to_vec(),
            Handoff::Malformed,
        ),
        (
            "a head of too many fields",
            many_headers.into_bytes(),
            Handoff::Oversized,
        ),
        (
            "a body over the size read here",
            big_body.into_bytes(),
            Handoff::Oversized,
        ),
    ];
    for (name, input, reason) in cases {
        let served = serve_here(&input, &[], respond(|_, _| unreachable!())).await;
        assert!(served.seen.is_empty(), "{name}");
        assert!(served.wire.is_empty(), "{name}");
        match served.ended {
            Ended::Handoff(prefix, why) => {
                assert_eq!(&prefix[..], &input[..], "{name}");
                assert_eq!(why, reason, "{name}");
            }
            Ended::Closed => panic!("{name}: closed, not handed over"),
        }
    }
}

/// A zero-padded length is a length here as in hyper's server (RFC 9110:
/// 1*DIGIT): served, not handed over (issue 49).
#[tokio::test]
async fn a_zero_padded_length_is_served_here() {
    let input = b"POST /a HTTP/1.1\r\nhost: x\r\ncontent-length: 00000000000000000003\r\n\r\nabc";
    let served = serve_here(
        input,
        &[],
        respond(|_, _| Response::new(full_body(Bytes::new()))),
    )
    .await;
    assert_eq!(served.seen.len(), 1);
    assert!(served.wire.starts_with(b"HTTP/1.1 200 OK\r\n"));
    assert!(matches!(served.ended, Ended::Closed));
}

#[tokio::test]
async fn after_served_requests_the_rest_of_the_connection_goes_to_hyper() {
    let first = b"GET /a HTTP/1.1\r\nhost: x\r\n\r\n".to_vec();
    let second = b"POST /b HTTP/1.1\r\ntransfer-encoding: chunked\r\n\r\n0\r\n\r\n".to_vec();
    let input = [first, second.clone()].concat();
    let served = serve_here(
        &input,
        &[],
        respond(|_, _| Response::new(full_body(Bytes::new()))),
    )
    .await;
    assert_eq!(served.seen.len(), 1);
    assert!(served.wire.starts_with(b"HTTP/1.1 200 OK\r\n"));
    match served.ended {
        Ended::Handoff(prefix, why) => {
            assert_eq!(&prefix[..], &second[..]);
            assert_eq!(why, Handoff::TransferEncoding);
        }
        Ended::Closed => panic!("closed, not handed over"),
    }
}

#[tokio::test(start_paused = true)]
async fn a_message_whose_rest_is_late_goes_to_hyper() {
    let (mut client, mut server) = duplex(1 << 16);
    let head = b"POST /a HTTP/1.1\r\ncontent-length: 5\r\n\r\nhe";
    client.write_all(head).await.unwrap();
    let (_tx, mut shutdown) = watch::channel(());
    let handle = |_req: Request<RequestBody>| async { unreachable!() };
    let ended = serve(&mut server, handle, &mut shutdown).await;
    match ended {
        Ended::Handoff(prefix, why) => {
            assert_eq!(&prefix[..], &head[..]);
            assert_eq!(why, Handoff::Slow);
        }
        Ended::Closed => panic!("closed, not handed over"),
    }
}

#[tokio::test]
async fn a_shutdown_closes_an_idle_connection_and_ends_the_response_in_flight() {
    // Idle: closed at once.
    let (_client, mut server) = duplex(1 << 16);
    let (tx, mut shutdown) = watch::channel(());
    let handle = |_req: Request<RequestBody>| async { unreachable!() };
    let serving = serve(&mut server, handle, &mut shutdown);
    tx.send_replace(());
    assert!(matches!(serving.await, Ended::Closed));

    // In flight: answered, with `connection: close`, then closed, though
    // another request waits.
    let (mut client, mut server) = duplex(1 << 16);
    let (tx, mut shutdown) = watch::channel(());
    client
        .write_all(b"GET /a HTTP/1.1\r\nhost: x\r\n\r\nGET /b HTTP/1.1\r\nhost: x\r\n\r\n")
        .await
        .unwrap();
    let tx = Arc::new(tx);
    let handle = {
        let tx = Arc::clone(&tx);
        move |_req: Request<RequestBody>| {
            tx.send_replace(());
            async { Ok(Response::new(full_body(Bytes::from_static(b"ok")))) }
        }
    };
    let ended = serve(&mut server, handle, &mut shutdown).await;
    assert!(matches!(ended, Ended::Closed));
    drop(server);
    let mut wire = Vec::new();
    client.read_to_end(&mut wire).await.unwrap();
    let text = String::from_utf8(wire).unwrap();
    assert_eq!(text.matches("HTTP/1.1 200 OK").count(), 1, "{text}");
    assert!(text.contains("connection: close\r\n"), "{text}");
    assert!(text.ends_with("\r\n\r\nok"), "{text}");
}

fn echo() -> Respond {
    respond(|parts, body| {
        let text = format!(
            "{} {}:{}",
            parts.uri,
            body.len(),
            String::from_utf8_lossy(&body)
        );
        Response::new(full_body(Bytes::from(text)))
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// However the client's writes cut pipelined requests, each is served
    /// here, whole, and answered as when they came in one write.
    #[test]
    fn requests_cut_anywhere_are_served_whole(
        cuts in proptest::collection::vec(1usize..40, 0..12),
        body in "[a-z]{0,30}",
    ) {
        let input = format!(
            "POST /one HTTP/1.1\r\nhost: x\r\ncontent-length: {}\r\n\r\n{body}GET /two HTTP/1.1\r\nhost: x\r\n\r\n",
            body.len()
        );
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let (cut, whole) = rt.block_on(async {
            let cut = serve_here(input.as_bytes(), &cuts, echo()).await;
            let whole = serve_here(input.as_bytes(), &[], echo()).await;
            (cut, whole)
        });
        prop_assert!(matches!(cut.ended, Ended::Closed));
        prop_assert_eq!(cut.seen.len(), 2);
        prop_assert_eq!(&cut.seen[0].3[..], body.as_bytes());
        prop_assert_eq!(undated(&cut.wire), undated(&whole.wire));
    }
}
