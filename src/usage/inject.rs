//! Request side of usage accounting: ask streaming upstreams for usage and
//! remember whether the client has to be shielded from it.

use crate::request::ChatRequest;

/// What was decided for one request; the response side needs it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UsagePlan {
    /// The request streams.
    pub(crate) stream: bool,
    /// The client asked for usage itself (forward everything as is).
    pub(crate) client_wants_usage: bool,
    /// compactor added `include_usage`; the response must go through
    /// [`super::hide::HideUsageBody`].
    pub forced: bool,
}

impl UsagePlan {
    /// Whether the response stream needs the usage hider.
    pub(crate) fn hide_usage(&self) -> bool {
        self.forced
    }
}

/// Forces `stream_options.include_usage` on a streaming request whose
/// client did not ask for it (merged into existing options; non-streaming
/// requests are never touched).
pub fn plan_usage(req: &mut ChatRequest) -> UsagePlan {
    let stream = req.stream();
    let client_wants_usage = req.client_wants_usage();
    let forced = req.force_include_usage();
    UsagePlan {
        stream,
        client_wants_usage,
        forced,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plans() {
        let mut r = ChatRequest::parse(br#"{"stream":true,"messages":[]}"#.to_vec()).unwrap();
        let p = plan_usage(&mut r);
        assert!(p.forced && p.hide_usage() && p.stream && !p.client_wants_usage);
        assert!(r.is_modified());

        let mut r = ChatRequest::parse(
            br#"{"stream":true,"stream_options":{"include_usage":true},"messages":[]}"#.to_vec(),
        )
        .unwrap();
        let p = plan_usage(&mut r);
        assert!(!p.forced && p.client_wants_usage);
        assert!(!r.is_modified());

        let mut r = ChatRequest::parse(br#"{"messages":[]}"#.to_vec()).unwrap();
        let p = plan_usage(&mut r);
        assert!(!p.forced && !p.stream);
        assert!(!r.is_modified());
    }
}
