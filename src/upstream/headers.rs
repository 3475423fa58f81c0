//! Hop-by-hop header policy (RFC 9110 §7.6.1), applied in both directions.

use http::header::{self, HeaderMap, HeaderName};

/// Headers that describe one connection, never forwarded.
const HOP_BY_HOP: &[HeaderName] = &[
    header::CONNECTION,
    header::TE,
    header::TRAILER,
    header::TRANSFER_ENCODING,
    header::UPGRADE,
    header::PROXY_AUTHENTICATE,
    header::PROXY_AUTHORIZATION,
];

/// Removes hop-by-hop headers: the fixed set, `Keep-Alive`, any `Proxy-*`,
/// and every header named in `Connection`.
pub(crate) fn strip_hop_by_hop(headers: &mut HeaderMap) {
    // One look at the names present instead of a hashed `remove` per
    // candidate: most messages carry none of them, and then nothing is
    // allocated or removed. Runs on every request and every response.
    let mut doomed: Vec<HeaderName> = headers
        .keys()
        .filter(|k| {
            HOP_BY_HOP.contains(k)
                || k.as_str() == "keep-alive"
                // Proxy-Connection and friends concern this hop only.
                || k.as_str().starts_with("proxy-")
        })
        .cloned()
        .collect();
    if doomed.is_empty() {
        return;
    }
    // Names listed in Connection, read before Connection itself goes.
    doomed.extend(
        headers
            .get_all(header::CONNECTION)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(','))
            .filter_map(|n| HeaderName::from_bytes(n.trim().as_bytes()).ok()),
    );
    for name in doomed {
        headers.remove(name);
    }
}

/// Prepares client request headers for the upstream: hop-by-hop removed and
/// the client's Host replaced (the upstream's is set by the caller).
pub(crate) fn prepare_request_headers(headers: &mut HeaderMap) {
    strip_hop_by_hop(headers);
    headers.remove(header::HOST);
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    #[test]
    fn table() {
        // (header, value, kept?)
        let cases: &[(&str, &str, bool)] = &[
            ("connection", "keep-alive, x-drop-me", false),
            ("keep-alive", "timeout=5", false),
            ("te", "trailers", false),
            ("trailer", "x-t", false),
            ("transfer-encoding", "chunked", false),
            ("upgrade", "h2c", false),
            ("proxy-authorization", "Basic x", false),
            ("proxy-authenticate", "Basic", false),
            ("proxy-connection", "keep-alive", false),
            ("x-drop-me", "1", false),
            ("authorization", "Bearer k", true),
            ("content-type", "application/json", true),
            ("content-length", "12", true),
            ("x-keep", "1", true),
            ("host", "client.example", true),
        ];
        let mut h = HeaderMap::new();
        for (k, v, _) in cases {
            h.append(HeaderName::from_static(k), HeaderValue::from_static(v));
        }
        h.append("x-keep", HeaderValue::from_static("2"));
        strip_hop_by_hop(&mut h);
        for (k, _, kept) in cases {
            assert_eq!(h.contains_key(*k), *kept, "{k}");
        }
        let multi: Vec<_> = h.get_all("x-keep").iter().collect();
        assert_eq!(multi, vec!["1", "2"]);
    }

    #[test]
    fn connection_tokens_across_multiple_headers() {
        let mut h = HeaderMap::new();
        h.append("connection", HeaderValue::from_static("x-a"));
        h.append("connection", HeaderValue::from_static(" X-B ,close"));
        h.insert("x-a", HeaderValue::from_static("1"));
        h.insert("x-b", HeaderValue::from_static("1"));
        h.insert("x-c", HeaderValue::from_static("1"));
        strip_hop_by_hop(&mut h);
        assert!(!h.contains_key("x-a"));
        assert!(!h.contains_key("x-b"));
        assert!(h.contains_key("x-c"));
    }

    #[test]
    fn request_host_removed() {
        let mut h = HeaderMap::new();
        h.insert("host", HeaderValue::from_static("evil.example"));
        prepare_request_headers(&mut h);
        assert!(!h.contains_key("host"));
    }
}
