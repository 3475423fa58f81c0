//! The upstream connector (HTTP or HTTPS via rustls/ring) and URI joining.

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

/// Joins the upstream base with the client's path and query. Only the
/// path and query of the client URI are used: an absolute-form URI cannot
/// redirect the request to another host.
pub(crate) fn join_uri(base: &UpstreamBase, client_uri: &Uri) -> Result<Uri, http::Error> {
    // No prefix to add: the client's path and query as they were parsed (a
    // shared copy), not formatted and parsed again for every request.
    if base.path_prefix.is_empty() {
        if let Some(pq) = client_uri
            .path_and_query()
            .filter(|pq| pq.as_str().starts_with('/'))
        {
            return Uri::builder()
                .scheme(base.scheme.clone())
                .authority(base.authority.clone())
                .path_and_query(pq.clone())
                .build();
        }
    }
    let pq = client_uri
        .path_and_query()
        .map(PathAndQuery::as_str)
        .unwrap_or("/");
    // CONNECT-style authority-form or `*` have no leading slash.
    let pq = if pq.starts_with('/') {
        pq.to_owned()
    } else {
        format!("/{pq}")
    };
    let joined = format!("{}{}", base.path_prefix, pq);
    Uri::builder()
        .scheme(base.scheme.clone())
        .authority(base.authority.clone())
        .path_and_query(joined)
        .build()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn join(base: &str, path: &str) -> String {
        let b = UpstreamBase::parse(base).unwrap();
        join_uri(&b, &path.parse().unwrap()).unwrap().to_string()
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
    }

    #[test]
    fn absolute_form_cannot_choose_host() {
        assert_eq!(
            join("http://up:1/p", "http://evil.example:9/v1/x?q=1"),
            "http://up:1/p/v1/x?q=1"
        );
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
