//! Hop-by-hop header policy (RFC 9110 §7.6.1), applied in both directions.

use http::header::{self, HeaderMap, HeaderName, HeaderValue};

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

/// Whether a request field never goes upstream whatever its value: the
/// hop-by-hop ones [`strip_hop_by_hop`] removes by name, and Host and
/// Expect, which belong to this hop (the upstream's Host is sent instead;
/// compactor's server already answered any `100-continue`).
fn dropped(name: &HeaderName) -> bool {
    HOP_BY_HOP.contains(name)
        || name == header::HOST
        || name == header::EXPECT
        || name.as_str() == "keep-alive"
        || name.as_str().starts_with("proxy-")
}

static HOST: HeaderName = header::HOST;

/// A request's header fields as they go upstream, written from the client's
/// map without copying it: the upstream's Host first, then the client's
/// fields in their order less the hop-by-hop ones (and those its
/// `Connection` names), Host and Expect, with each of `set` in place of the
/// client's fields of that name (where the first was, as `HeaderMap::insert`
/// puts it; after them when the client sent none).
///
/// The chat path used to clone the client's map for each attempt and edit
/// the copy (a hashed remove or insert per change): ~1,500 of a small
/// request's 60k instructions.
pub(crate) struct RequestHeaders<'a> {
    /// The client's fields.
    pub(crate) fields: &'a HeaderMap,
    /// Fields that replace the client's of the same name (at most 32).
    pub(crate) set: &'a [(HeaderName, HeaderValue)],
    /// The Host header to send (none: no Host at all).
    pub(crate) host: Option<&'a HeaderValue>,
    /// Whether the client's fields whose name has an `_` go too (`[server]
    /// underscores_in_headers`). Off, as nginx: an upstream behind a CGI-
    /// style layer reads `Content_Length` as `Content-Length`, a second
    /// framing next to the one written here.
    pub(crate) underscores: bool,
}

impl<'a> RequestHeaders<'a> {
    /// The fields in the order they are written.
    pub(crate) fn iter(&self) -> Fields<'a> {
        debug_assert!(self.set.len() <= 32);
        // Names listed in Connection are this hop's too (one allocation,
        // only for a request that has the header).
        let listed = self
            .fields
            .get_all(header::CONNECTION)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(','))
            .filter_map(|n| HeaderName::from_bytes(n.trim().as_bytes()).ok())
            .collect();
        Fields {
            fields: self.fields.iter(),
            set: self.set,
            host: self.host,
            underscores: self.underscores,
            listed,
            written: 0,
            rest: 0,
        }
    }
}

/// The iterator of [`RequestHeaders::iter`].
pub(crate) struct Fields<'a> {
    fields: header::Iter<'a, HeaderValue>,
    set: &'a [(HeaderName, HeaderValue)],
    host: Option<&'a HeaderValue>,
    underscores: bool,
    listed: Vec<HeaderName>,
    /// Which of `set` went out (bit `i` for `set[i]`).
    written: u32,
    /// The next of `set` to look at once the client's fields are done.
    rest: usize,
}

impl<'a> Iterator for Fields<'a> {
    type Item = (&'a HeaderName, &'a HeaderValue);

    fn next(&mut self) -> Option<Self::Item> {
        if let Some(host) = self.host.take() {
            return Some((&HOST, host));
        }
        for (name, value) in self.fields.by_ref() {
            if let Some(i) = self.set.iter().position(|(k, _)| k == name) {
                if self.written & (1 << i) != 0 {
                    continue;
                }
                self.written |= 1 << i;
                let (k, v) = &self.set[i];
                return Some((k, v));
            }
            if dropped(name)
                || (!self.underscores && name.as_str().as_bytes().contains(&b'_'))
                || self.listed.contains(name)
            {
                continue;
            }
            return Some((name, value));
        }
        while let Some((k, v)) = self.set.get(self.rest) {
            let i = self.rest;
            self.rest += 1;
            if self.written & (1 << i) == 0 {
                return Some((k, v));
            }
        }
        None
    }
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

    /// Issue 49: `Transfer_Encoding` and `Content_Length` went upstream
    /// next to the framing written there. Dropped unless the config keeps
    /// them; a set field and the Host are never affected.
    #[test]
    fn fields_named_with_an_underscore_are_dropped_unless_kept() {
        let mut h = HeaderMap::new();
        h.append("transfer_encoding", HeaderValue::from_static("chunked"));
        h.append("x-a", HeaderValue::from_static("1"));
        h.append("content_length", HeaderValue::from_static("92"));
        h.append("x_session_id", HeaderValue::from_static("s"));
        let host = HeaderValue::from_static("up:1");
        let names = |underscores| {
            let out = RequestHeaders {
                fields: &h,
                set: &[],
                host: Some(&host),
                underscores,
            };
            written(&out)
                .into_iter()
                .map(|(k, _)| k)
                .collect::<Vec<_>>()
        };
        assert_eq!(names(false), vec!["host", "x-a"]);
        assert_eq!(
            names(true),
            vec![
                "host",
                "transfer_encoding",
                "x-a",
                "content_length",
                "x_session_id"
            ]
        );
    }

    fn written(h: &RequestHeaders<'_>) -> Vec<(String, String)> {
        h.iter()
            .map(|(k, v)| (k.to_string(), v.to_str().unwrap().to_owned()))
            .collect()
    }

    /// `out` writes the fields of the edited `copy`, order aside.
    fn same_fields_as(out: &RequestHeaders<'_>, copy: &HeaderMap) {
        let mut expected: Vec<_> = copy
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_str().unwrap().to_owned()))
            .collect();
        let mut got = written(out);
        expected.sort();
        got.sort();
        assert_eq!(got, expected);
    }

    #[test]
    fn request_fields_go_out_as_stripping_a_copy_left_them() {
        let mut h = HeaderMap::new();
        h.append("x-first", HeaderValue::from_static("1"));
        h.append("host", HeaderValue::from_static("evil.example"));
        h.append("connection", HeaderValue::from_static("keep-alive, X-Drop"));
        h.append("x-drop", HeaderValue::from_static("1"));
        h.append("expect", HeaderValue::from_static("100-continue"));
        h.append("te", HeaderValue::from_static("trailers"));
        h.append("proxy-connection", HeaderValue::from_static("keep-alive"));
        h.append("keep-alive", HeaderValue::from_static("timeout=5"));
        h.append("authorization", HeaderValue::from_static("Bearer k"));
        h.append("x-first", HeaderValue::from_static("2"));
        let host = HeaderValue::from_static("up:1");
        let out = RequestHeaders {
            fields: &h,
            set: &[],
            host: Some(&host),
            underscores: false,
        };
        // The upstream's Host first, then the client's fields in order (a
        // repeated name's values together, as the map holds them).
        assert_eq!(
            written(&out),
            [
                ("host", "up:1"),
                ("x-first", "1"),
                ("x-first", "2"),
                ("authorization", "Bearer k"),
            ]
            .map(|(k, v)| (k.to_owned(), v.to_owned()))
        );
        // The same fields as the copy the hop used to edit.
        let mut copy = h.clone();
        strip_hop_by_hop(&mut copy);
        copy.remove(header::HOST);
        copy.remove(header::EXPECT);
        copy.insert(header::HOST, host.clone());
        same_fields_as(&out, &copy);
        // Without a Host to send, none goes.
        let bare = RequestHeaders {
            fields: &h,
            set: &[],
            host: None,
            underscores: false,
        };
        assert!(written(&bare).iter().all(|(k, _)| k != "host"));
    }

    #[test]
    fn set_fields_replace_the_clients_where_they_were() {
        let mut h = HeaderMap::new();
        h.append("accept-encoding", HeaderValue::from_static("gzip"));
        h.append("x-a", HeaderValue::from_static("1"));
        h.append("accept-encoding", HeaderValue::from_static("br"));
        h.append("transfer-encoding", HeaderValue::from_static("chunked"));
        let set = [
            (header::CONTENT_LENGTH, HeaderValue::from_static("12")),
            (
                header::ACCEPT_ENCODING,
                HeaderValue::from_static("identity"),
            ),
        ];
        let out = RequestHeaders {
            fields: &h,
            set: &set,
            host: None,
            underscores: false,
        };
        // Accept-Encoding where the client's first was, once; the length
        // the client did not send after its fields.
        assert_eq!(
            written(&out),
            [
                ("accept-encoding", "identity"),
                ("x-a", "1"),
                ("content-length", "12"),
            ]
            .map(|(k, v)| (k.to_owned(), v.to_owned()))
        );
        // What inserting into a copy of the map gave.
        let mut copy = h.clone();
        strip_hop_by_hop(&mut copy);
        for (k, v) in &set {
            copy.insert(k.clone(), v.clone());
        }
        same_fields_as(&out, &copy);
    }
}
