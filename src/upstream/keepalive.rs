//! The upstream's own keep-alive, honoured.
//!
//! An upstream closes a connection it has kept idle for its keep-alive
//! timeout (gunicorn: 2 s, uvicorn and cpp-httplib: 5 s). A request sent on
//! a pooled connection at that moment meets a closed socket: the race a
//! replay covers only when the request's body can be sent again. So the
//! pool drops idle connections before the upstream does: after
//! `timeouts.upstream_pool_idle_secs` (1 s by default, below the common
//! defaults), and, once an upstream says `Keep-Alive: timeout=N` on a
//! response, after a little less than `N` when that is shorter still.
//!
//! The pool ([`super::pool::Pool::learn`]) lowers its idle timeout the
//! first time an announcement asks for it; it applies to every idle
//! connection from then on.

use std::time::Duration;

use http::{HeaderMap, HeaderName};

static KEEP_ALIVE: HeaderName = HeaderName::from_static("keep-alive");

/// The `timeout=N` of a `Keep-Alive` response header (RFC 2068 §19.7.1,
/// still sent by Apache, Node and cpp-httplib), if any.
pub(crate) fn announced_timeout(headers: &HeaderMap) -> Option<Duration> {
    headers.get_all(&KEEP_ALIVE).iter().find_map(|v| {
        v.to_str().ok()?.split(',').find_map(|param| {
            let (name, value) = param.split_once('=')?;
            if !name.trim().eq_ignore_ascii_case("timeout") {
                return None;
            }
            let secs: u64 = value.trim().trim_matches('"').parse().ok()?;
            Some(Duration::from_secs(secs))
        })
    })
}

/// How long a connection may idle in the pool when the upstream closes it
/// after `announced`: half a second less (the upstream's clock starts when
/// it wrote its response, ours when we read the end of it), but never less
/// than half of it.
pub(crate) fn idle_within(announced: Duration) -> Duration {
    announced
        .saturating_sub(Duration::from_millis(500))
        .max(announced / 2)
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    fn headers(values: &[&'static str]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for v in values {
            h.append(&KEEP_ALIVE, HeaderValue::from_static(v));
        }
        h
    }

    #[test]
    fn the_timeout_parameter_is_read_wherever_it_stands() {
        let secs = |v: &[&'static str]| announced_timeout(&headers(v)).map(|d| d.as_secs());
        assert_eq!(secs(&["timeout=5, max=100"]), Some(5));
        assert_eq!(secs(&["max=100, Timeout = 2"]), Some(2));
        assert_eq!(secs(&["timeout=\"3\""]), Some(3));
        assert_eq!(secs(&["max=5", "timeout=7"]), Some(7));
        assert_eq!(secs(&["max=100"]), None);
        assert_eq!(secs(&["timeout=soon"]), None);
        assert_eq!(secs(&[]), None);
    }

    #[test]
    fn the_pool_idles_less_than_the_upstream_waits() {
        let ms = |s: u64| idle_within(Duration::from_secs(s)).as_millis();
        assert_eq!(ms(1), 500);
        assert_eq!(ms(2), 1500);
        assert_eq!(ms(5), 4500);
        assert_eq!(ms(0), 0);
    }
}
