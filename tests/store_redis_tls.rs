//! `rediss://`: the Redis store over TLS (rustls), against a real
//! `redis-server` with a TLS port and a certificate made by the test. The
//! test trusts that certificate through `SSL_CERT_FILE` (read with the
//! system roots), so it has this binary to itself.

// Test code: a failed unwrap is a failed test. clippy.toml allows that in
// #[test] functions only, not in the helpers they share.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::time::Duration;

use compactor::store::redis::RedisStore;
use compactor::store::{Store, StoredRecord};
use support::redis::RedisServer;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rediss_urls_speak_tls_and_check_the_certificate() {
    let dir = tempfile::tempdir().unwrap();
    let rcgen::CertifiedKey { cert, signing_key } =
        rcgen::generate_simple_self_signed(vec!["localhost".to_owned()]).unwrap();
    let (cert_path, key_path) = (dir.path().join("cert.pem"), dir.path().join("key.pem"));
    std::fs::write(&cert_path, cert.pem()).unwrap();
    std::fs::write(&key_path, signing_key.serialize_pem()).unwrap();
    let cert_arg = cert_path.to_str().unwrap();
    let key_arg = key_path.to_str().unwrap();

    let redis = RedisServer::start_tls(cert_arg, key_arg);
    let url = format!("rediss://localhost:{}/0", redis.port);
    let ttl = Duration::from_secs(60);

    // Not trusted yet: the handshake fails, the store answers nothing.
    let untrusted = RedisStore::open(&url, ttl, 1 << 20).unwrap();
    assert_eq!(untrusted.keyer_secret(), None);

    std::env::set_var("SSL_CERT_FILE", &cert_path);
    let s = RedisStore::open(&url, ttl, 1 << 20).unwrap();
    assert!(s.keyer_secret().is_some(), "TLS handshake and boot");
    let rec = StoredRecord {
        k: 1,
        prefix_hash: 5,
        replacement: vec!["{\"role\":\"user\",\"content\":\"x\"}".into()],
        original_tokens: 3,
        replacement_tokens: 1,
        summary_rows: None,
    };
    s.put(1, rec.clone()).await.unwrap();
    assert_eq!(s.find(1, &[5]).await.unwrap(), Some(rec));
    // Plain redis:// to a TLS port does not get an answer.
    let plain = RedisStore::open(&format!("redis://localhost:{}/0", redis.port), ttl, 1 << 20);
    assert!(plain.unwrap().keyer_secret().is_none());
}
