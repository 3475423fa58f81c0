//! The upstream connector (HTTP or HTTPS via rustls/ring) and the
//! request-target a request is sent upstream with.

use std::borrow::Cow;
use std::path::Path;
use std::sync::Arc;

use http::uri::{PathAndQuery, Uri};
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::connect::HttpConnector;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::CertificateDer;
use rustls::RootCertStore;

use crate::config::{Config, UpstreamBase};

/// The client could not be built.
#[derive(Debug, thiserror::Error)]
pub enum UpstreamSetupError {
    /// The extra CA file could not be read.
    #[error("cannot read upstream_ca_file {path}: {source}")]
    CaRead {
        /// The file.
        path: String,
        /// Cause.
        #[source]
        source: std::io::Error,
    },
    /// The extra CA file holds no usable certificate.
    #[error("upstream_ca_file {path}: {message}")]
    CaInvalid {
        /// The file.
        path: String,
        /// What was wrong.
        message: String,
    },
    /// The upstream authority is not a valid Host header value.
    #[error("upstream host header: {0}")]
    Host(String),
    /// rustls rejected the configuration.
    #[error("TLS setup failed: {0}")]
    Tls(#[from] rustls::Error),
}

/// Trusted roots: Mozilla's (webpki-roots, works in scratch images), the
/// platform's (corporate CAs), and an optional extra PEM file.
pub fn root_store(extra_ca: Option<&Path>) -> Result<RootCertStore, UpstreamSetupError> {
    let mut roots = RootCertStore::empty();
    roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned());
    let native = rustls_native_certs::load_native_certs();
    let (added, ignored) = roots.add_parsable_certificates(native.certs);
    tracing::debug!(added, ignored, "native root certificates");
    if let Some(path) = extra_ca {
        let shown = path.display().to_string();
        let pem = std::fs::read(path).map_err(|source| UpstreamSetupError::CaRead {
            path: shown.clone(),
            source,
        })?;
        let mut count = 0usize;
        for cert in CertificateDer::pem_slice_iter(&pem) {
            let cert = cert.map_err(|e| UpstreamSetupError::CaInvalid {
                path: shown.clone(),
                message: format!("bad PEM: {e}"),
            })?;
            roots.add(cert).map_err(|e| UpstreamSetupError::CaInvalid {
                path: shown.clone(),
                message: format!("bad certificate: {e}"),
            })?;
            count += 1;
        }
        if count == 0 {
            return Err(UpstreamSetupError::CaInvalid {
                path: shown,
                message: "no CERTIFICATE found".to_owned(),
            });
        }
    }
    Ok(roots)
}

/// The connector the pool's connections are made with: the configured
/// roots (the ring provider explicitly, so it works whether or not a
/// process default is installed), TCP_NODELAY, the connect timeout, TLS
/// when the URI says `https`.
pub(crate) fn connector(
    config: &Config,
) -> Result<HttpsConnector<HttpConnector>, UpstreamSetupError> {
    let roots = root_store(config.upstream_ca_file.as_deref())?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let tls = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .with_root_certificates(roots)
        .with_no_client_auth();

    let mut http = HttpConnector::new();
    http.enforce_http(false);
    http.set_nodelay(true);
    http.set_connect_timeout(Some(config.timeouts.connect));

    // HTTP/1.1 upstream only: it carries SSE fine everywhere, and keeps the
    // request shape (Host, chunking) identical for every upstream.
    Ok(hyper_rustls::HttpsConnectorBuilder::new()
        .with_tls_config(tls)
        .https_or_http()
        .enable_http1()
        .wrap_connector(http))
}

/// The request-target sent upstream: the base's path prefix, then the
/// client's path and query. Only the path and query of the client URI are
/// used: an absolute-form URI cannot redirect the request to another host.
/// With no prefix it is the client's own text, borrowed: no URI is built or
/// parsed again for a request (the connection's origin is the base's).
pub(crate) fn request_target<'a>(base: &UpstreamBase, client_uri: &'a Uri) -> Cow<'a, str> {
    let pq = client_uri
        .path_and_query()
        .map(PathAndQuery::as_str)
        .unwrap_or("/");
    // CONNECT-style authority-form or `*` have no leading slash.
    let slash = if pq.starts_with('/') { "" } else { "/" };
    if base.path_prefix.is_empty() && slash.is_empty() {
        Cow::Borrowed(pq)
    } else {
        Cow::Owned(format!("{}{slash}{pq}", base.path_prefix))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The URL a request for `path` reaches under `base`.
    fn join(base: &str, path: &str) -> String {
        let b = UpstreamBase::parse(base).unwrap();
        let uri = path.parse().unwrap();
        format!("{}://{}{}", b.scheme, b.authority, request_target(&b, &uri))
    }

    #[test]
    fn joins_prefix_path_and_query() {
        assert_eq!(
            join("https://openrouter.ai/api", "/v1/chat/completions"),
            "https://openrouter.ai/api/v1/chat/completions"
        );
        assert_eq!(
            join("https://openrouter.ai/api/", "/v1/models?x=1&y=%20"),
            "https://openrouter.ai/api/v1/models?x=1&y=%20"
        );
        assert_eq!(join("http://h:8080", "/"), "http://h:8080/");
        assert_eq!(join("http://h:8080", "/health"), "http://h:8080/health");
        assert_eq!(join("http://h:8080", "*"), "http://h:8080/*");
        assert_eq!(join("http://h:8080/p", "*"), "http://h:8080/p/*");
    }

    #[test]
    fn without_a_prefix_the_clients_text_is_borrowed() {
        let b = UpstreamBase::parse("http://h:1").unwrap();
        let uri: Uri = "/v1/chat/completions?x=1".parse().unwrap();
        let target = request_target(&b, &uri);
        assert!(matches!(target, Cow::Borrowed(_)));
        assert_eq!(target, "/v1/chat/completions?x=1");
    }

    #[test]
    fn absolute_form_cannot_choose_host() {
        assert_eq!(
            join("http://up:1/p", "http://evil.example:9/v1/x?q=1"),
            "http://up:1/p/v1/x?q=1"
        );
        assert_eq!(
            join("http://up:1", "http://evil.example:9/v1/x"),
            "http://up:1/v1/x"
        );
        assert_eq!(join("http://up:1", "http://evil.example:9"), "http://up:1/");
    }

    #[test]
    fn missing_ca_file_errors() {
        assert!(matches!(
            root_store(Some(Path::new("/nonexistent.pem"))),
            Err(UpstreamSetupError::CaRead { .. })
        ));
    }

    #[test]
    fn ca_file_without_certificates_errors() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("ca.pem");
        std::fs::write(&p, "not a pem\n").unwrap();
        assert!(matches!(
            root_store(Some(&p)),
            Err(UpstreamSetupError::CaInvalid { .. })
        ));
    }
}
