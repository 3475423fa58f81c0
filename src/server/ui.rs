//! `GET /_compactor/ui`: the inspector page, embedded in the binary (no CDN,
//! no build step). The page and its assets hold no data and are served
//! without the token; the page asks the admin API for everything it shows,
//! with the token the user types into it (kept in the tab's
//! `sessionStorage`, sent as `Authorization: Bearer`, never in a URL).
//! Without an admin token configured the page says the inspector is off and
//! how to turn it on.

use bytes::Bytes;
use http::{header, HeaderValue, Response, StatusCode};

use crate::error::{error_response, full_body, ProxyBody};

/// Path of the page.
pub const UI_PATH: &str = "/_compactor/ui";

const INDEX: &str = include_str!("../../assets/ui/index.html");
const DISABLED: &str = include_str!("../../assets/ui/disabled.html");
const APP_JS: &str = include_str!("../../assets/ui/app.js");
const APP_CSS: &str = include_str!("../../assets/ui/app.css");
/// uPlot 1.6.32 (MIT), vendored unchanged: see `assets/ui/vendor/`.
const UPLOT_JS: &str = include_str!("../../assets/ui/vendor/uPlot.iife.min.js");
const UPLOT_CSS: &str = include_str!("../../assets/ui/vendor/uPlot.min.css");
const UPLOT_LICENSE: &str = include_str!("../../assets/ui/vendor/uPlot.LICENSE");

/// The asset at `path` (under [`UI_PATH`]) and its content type.
fn asset(path: &str, enabled: bool) -> Option<(&'static str, &'static str)> {
    let html = "text/html; charset=utf-8";
    Some(match path.strip_prefix(UI_PATH)? {
        "" | "/" if enabled => (INDEX, html),
        "" | "/" => (DISABLED, html),
        "/app.js" => (APP_JS, "text/javascript; charset=utf-8"),
        "/app.css" => (APP_CSS, "text/css; charset=utf-8"),
        "/vendor/uPlot.iife.min.js" => (UPLOT_JS, "text/javascript; charset=utf-8"),
        "/vendor/uPlot.min.css" => (UPLOT_CSS, "text/css; charset=utf-8"),
        "/vendor/uPlot.LICENSE" => (UPLOT_LICENSE, "text/plain; charset=utf-8"),
        _ => return None,
    })
}

/// Serves the page (or the "disabled" page when `enabled` is false) and
/// its assets.
pub fn serve(path: &str, enabled: bool) -> Response<ProxyBody> {
    let Some((body, ctype)) = asset(path, enabled) else {
        return error_response(
            StatusCode::NOT_FOUND,
            "unknown inspector asset",
            "invalid_request_error",
            "not_found",
        );
    };
    let mut resp = Response::new(full_body(Bytes::from_static(body.as_bytes())));
    resp.headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static(ctype));
    resp
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_page_and_its_assets_are_embedded() {
        for p in [
            "/_compactor/ui",
            "/_compactor/ui/",
            "/_compactor/ui/app.js",
            "/_compactor/ui/app.css",
            "/_compactor/ui/vendor/uPlot.iife.min.js",
            "/_compactor/ui/vendor/uPlot.min.css",
            "/_compactor/ui/vendor/uPlot.LICENSE",
        ] {
            assert_eq!(serve(p, true).status(), StatusCode::OK, "{p}");
        }
        assert_eq!(
            serve("/_compactor/ui/x.js", true).status(),
            StatusCode::NOT_FOUND
        );
        assert_eq!(
            serve("/_compactor/uix", true).status(),
            StatusCode::NOT_FOUND
        );
    }

    #[test]
    fn without_a_token_the_page_says_how_to_enable_it() {
        let (body, _) = asset(UI_PATH, false).unwrap();
        assert!(body.contains("disabled") && body.contains("[admin]"));
        assert!(!body.contains("app.js"));
        let (body, _) = asset(UI_PATH, true).unwrap();
        assert!(body.contains("app.js"));
    }

    #[test]
    fn the_page_loads_nothing_from_elsewhere_and_runs_no_inline_script() {
        for body in [INDEX, DISABLED] {
            assert!(!body.contains("http://") && !body.contains("https://"));
            // Every <script> is an external file of the page's origin.
            for tag in body.split("<script").skip(1) {
                assert!(
                    tag.trim_start().starts_with("src=\"/_compactor/ui/"),
                    "{tag}"
                );
            }
            assert!(
                !body.contains("style=\""),
                "inline styles are refused by the CSP"
            );
            assert!(!body.contains("onclick") && !body.contains("onload"));
        }
        assert!(
            !APP_JS.contains("innerHTML"),
            "text only, never markup from data"
        );
        assert!(UPLOT_LICENSE.contains("MIT"));
    }
}
