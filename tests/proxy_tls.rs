//! HTTPS upstream through rustls, trusting a test CA via `upstream_ca_file`.

// Test code: a failed unwrap is a failed test. clippy.toml allows that in
// #[test] functions only, not in the helpers they share.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::sync::Arc;

use bytes::Bytes;
use support::*;

struct TlsUpstream {
    mock: MockUpstream,
    ca_file: tempfile::NamedTempFile,
}

async fn tls_upstream() -> TlsUpstream {
    install_crypto();
    let rcgen::CertifiedKey { cert, signing_key } =
        rcgen::generate_simple_self_signed(vec!["localhost".to_owned()]).unwrap();
    let key = rustls::pki_types::PrivateKeyDer::Pkcs8(signing_key.serialize_der().into());
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let server = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(vec![cert.der().clone()], key)
        .unwrap();
    let mock = MockUpstream::builder()
        .route(
            "/prefix/v1/models",
            Reply::Full {
                status: 200,
                headers: vec![("content-type", "application/json".into())],
                body: Bytes::from_static(br#"{"data":[]}"#),
            },
        )
        .route(
            "/prefix/v1/chat/completions",
            Reply::Chunks {
                status: 200,
                headers: vec![("content-type", "text/event-stream".into())],
                chunks: vec![
                    (
                        Default::default(),
                        Bytes::from_static(b"data: {\"a\":1}\n\n"),
                    ),
                    (Default::default(), Bytes::from_static(b"data: [DONE]\n\n")),
                ],
            },
        )
        .tls(server)
        .run()
        .await;
    let ca_file = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(ca_file.path(), cert.pem()).unwrap();
    TlsUpstream { mock, ca_file }
}

#[tokio::test]
async fn https_upstream_with_test_ca() {
    let up = tls_upstream().await;
    let extra = format!(
        "upstream_ca_file = {:?}\n",
        up.ca_file.path().display().to_string()
    );
    let proxy = start_proxy(&format!("{}/prefix", up.mock.url()), &extra).await;

    let (status, _, body) = get(&format!("{}/v1/models", proxy.url())).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    assert_eq!(body, r#"{"data":[]}"#);

    let (status, _, body) = fetch(request(
        "POST",
        &format!("{}/v1/chat/completions", proxy.url()),
        full("{}"),
    ))
    .await;
    assert_eq!(status, 200);
    assert_eq!(body, "data: {\"a\":1}\n\ndata: [DONE]\n\n");
    let seen = up.mock.last_request();
    assert_eq!(
        seen.headers["host"],
        format!("localhost:{}", up.mock.addr.port())
    );
}

#[tokio::test]
async fn https_upstream_untrusted_cert_is_502() {
    let up = tls_upstream().await;
    // Same upstream, but the test CA is not configured: the handshake must fail.
    let proxy = start_proxy(&format!("{}/prefix", up.mock.url()), "").await;
    let (status, _, body) = get(&format!("{}/v1/models", proxy.url())).await;
    assert_eq!(status, 502);
    let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(v["error"]["code"], "upstream_unreachable");
    assert!(up.mock.requests().is_empty());
}
