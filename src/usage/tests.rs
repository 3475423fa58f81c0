//! Tests of usage extraction and hiding over vendor-shaped transcripts.

use super::hide::{HideUsageBody, UsageHider};
use super::*;
use crate::upstream::body::tap_tests::MockBody;
use crate::upstream::body::TapBody;
use bytes::{Bytes, BytesMut};
use http_body::{Body, Frame};
use http_body_util::BodyExt;
use memchr::memmem;
use proptest::prelude::*;
use std::sync::{Arc, Mutex};

macro_rules! fixture {
    ($name:literal) => {
        include_bytes!(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/fixtures/",
            $name
        ))
    };
}

fn extract(kind: BodyKind, chunks: &[&[u8]]) -> UsageExtractor {
    let mut e = UsageExtractor::new(kind);
    for c in chunks {
        e.feed(c);
    }
    e.finish();
    e
}

/// What an extractor whose stream start is already decided (the
/// response's tap) reads from `chunks`.
fn extract_decided(chunks: &[&[u8]]) -> (UsageReport, u64, u64) {
    let mut e = UsageExtractor::new(BodyKind::Sse);
    e.start = StreamStart::Content;
    for c in chunks {
        e.feed(c);
    }
    e.finish();
    (e.report(), e.oversized(), e.parse_failures())
}

fn split_every(bytes: &[u8], n: usize) -> Vec<&[u8]> {
    bytes.chunks(n.max(1)).collect()
}

#[test]
fn openai_final_usage_chunk() {
    let s = fixture!("sse/openai_with_usage.sse");
    for n in [1, 7, 4096] {
        let e = extract(BodyKind::Sse, &split_every(s, n));
        let r = e.report();
        assert_eq!(
            r.usage,
            Some(Usage {
                prompt_tokens: Some(9),
                completion_tokens: Some(12),
                total_tokens: Some(21),
                cached_tokens: Some(0)
            })
        );
        assert_eq!(r.prompt_tokens(), Some((9, PromptSource::Usage)));
        assert_eq!(*e.start(), StreamStart::Content);
        assert_eq!(e.parse_failures(), 0);
    }
}

#[test]
fn no_usage_without_include_usage() {
    let e = extract(BodyKind::Sse, &[fixture!("sse/openai_without_usage.sse")]);
    assert_eq!(e.report(), UsageReport::default());
    assert_eq!(e.report().prompt_tokens(), None);
}

#[test]
fn llamacpp_usage_and_timings() {
    let e = extract(BodyKind::Sse, &[fixture!("sse/llamacpp_with_usage.sse")]);
    let r = e.report();
    assert_eq!(r.usage.and_then(|u| u.prompt_tokens), Some(75));
    assert_eq!(r.timings.and_then(|t| t.prompt_n), Some(75));
    assert_eq!(r.prompt_tokens(), Some((75, PromptSource::Usage)));
}

#[test]
fn llamacpp_timings_fallback() {
    let e = extract(BodyKind::Sse, &[fixture!("sse/llamacpp_without_usage.sse")]);
    let r = e.report();
    assert_eq!(r.usage, None);
    assert_eq!(r.prompt_tokens(), Some((75, PromptSource::Timings)));
    assert_eq!(r.completion_tokens(), Some(31));
    let eff = r.effective().unwrap();
    assert_eq!(eff.total_tokens, Some(106));
    // Non-streaming body with timings only: prompt_n + cache_n.
    let e = extract(
        BodyKind::Json,
        &[fixture!("json/llamacpp_response_timings_only.json")],
    );
    assert_eq!(
        e.report().prompt_tokens(),
        Some((237, PromptSource::Timings))
    );
    assert_eq!(e.report().effective().unwrap().cached_tokens, Some(236));
}

#[test]
fn openrouter_crlf_with_comments() {
    let s = fixture!("sse/openrouter_always_usage_crlf.sse");
    for n in [1, 2, 3, 50] {
        let r = extract(BodyKind::Sse, &split_every(s, n)).report();
        assert_eq!(r.usage.and_then(|u| u.prompt_tokens), Some(194));
        assert_eq!(r.usage.and_then(|u| u.cached_tokens), Some(0));
    }
}

#[test]
fn vllm_usage() {
    let r = extract(BodyKind::Sse, &[fixture!("sse/vllm_with_usage.sse")]).report();
    assert_eq!(r.usage.and_then(|u| u.prompt_tokens), Some(42));
    assert_eq!(r.usage.and_then(|u| u.cached_tokens), None);
}

#[test]
fn json_body_usage() {
    let s = fixture!("json/openai_response.json");
    let e = extract(BodyKind::Json, &split_every(s, 10));
    assert_eq!(
        e.report().prompt_tokens(),
        Some((1117, PromptSource::Usage))
    );
    assert_eq!(*e.start(), StreamStart::Content);
}

#[test]
fn last_usage_wins() {
    let s = b"data: {\"choices\":[{\"delta\":{\"content\":\"a\"}}],\"usage\":{\"prompt_tokens\":5}}\n\ndata: {\"choices\":[],\"usage\":{\"prompt_tokens\":7}}\n\n";
    let r = extract(BodyKind::Sse, &[s]).report();
    assert_eq!(r.usage.and_then(|u| u.prompt_tokens), Some(7));
}

#[test]
fn early_errors_detected() {
    let e = extract(
        BodyKind::Sse,
        &[fixture!("sse/llamacpp_old_error_field.sse")],
    );
    assert!(
        matches!(e.start(), StreamStart::Error(p) if p.starts_with(b"{\"code\":400")),
        "{:?}",
        e.start()
    );
    let e = extract(
        BodyKind::Sse,
        &[fixture!("sse/openai_responses_error_event.sse")],
    );
    assert!(
        matches!(e.start(), StreamStart::Error(p) if memmem::find(p, b"context_length_exceeded").is_some())
    );
    let e = extract(BodyKind::Json, &[fixture!("json/llamacpp_overflow.json")]);
    assert!(matches!(e.start(), StreamStart::Error(_)));
    let e = extract(
        BodyKind::Sse,
        &[b"data: {\"error\":{\"message\":\"x\"}}\n\n"],
    );
    assert!(matches!(e.start(), StreamStart::Error(_)));
}

#[test]
fn errors_after_content_are_not_early() {
    for f in [
        &fixture!("sse/llamacpp_error_mid_stream.sse")[..],
        &fixture!("sse/openrouter_error_after_tokens.sse")[..],
    ] {
        let e = extract(BodyKind::Sse, &[f]);
        assert_eq!(*e.start(), StreamStart::Content);
    }
    // A role-only first delta is not content yet.
    let mut e = UsageExtractor::new(BodyKind::Sse);
    e.feed(b"data: {\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"\"},\"finish_reason\":null}]}\n\n");
    assert_eq!(*e.start(), StreamStart::Undecided);
    e.feed(b"event: error\ndata: {\"message\":\"boom\"}\n\n");
    assert!(matches!(e.start(), StreamStart::Error(_)));
}

#[test]
fn garbage_never_fails() {
    let e = extract(
        BodyKind::Sse,
        &[b"data: {not json\n\ndata: \"usage\":{\n\n\xff\xfe\n\n"],
    );
    assert_eq!(e.report(), UsageReport::default());
    assert!(e.parse_failures() >= 1);
    let e = extract(BodyKind::Json, &[b"<html>502</html>"]);
    assert_eq!(e.report(), UsageReport::default());
}

#[test]
fn body_kind_from_content_type() {
    assert_eq!(
        BodyKind::from_content_type(Some("text/event-stream; charset=utf-8")),
        BodyKind::Sse
    );
    assert_eq!(
        BodyKind::from_content_type(Some("application/json")),
        BodyKind::Json
    );
    assert_eq!(BodyKind::from_content_type(None), BodyKind::Json);
}

#[tokio::test]
async fn observer_through_tap_delivers_outcome_once() {
    let s = fixture!("sse/llamacpp_with_usage.sse");
    let got: Arc<Mutex<Vec<TapOutcome>>> = Arc::default();
    let sink = got.clone();
    let obs = UsageObserver::new(BodyKind::Sse, move |o| sink.lock().unwrap().push(o));
    let items = split_every(s, 33)
        .into_iter()
        .flat_map(|c| [Some(Ok(Frame::data(Bytes::copy_from_slice(c)))), None])
        .collect();
    let body = TapBody::new(MockBody::new(items), obs);
    let out = body.collect().await.unwrap().to_bytes();
    assert_eq!(&out[..], &s[..]);
    let got = got.lock().unwrap();
    assert_eq!(got.len(), 1);
    assert_eq!(got[0].eos, Eos::Complete);
    assert_eq!(
        got[0].report.prompt_tokens(),
        Some((75, PromptSource::Usage))
    );
    assert_eq!(got[0].bytes, s.len() as u64);
}

/// Feeds `body` to an observer with an `on_usage` hook in `step`-byte
/// pieces; returns (bytes fed when the hook fired, the report it got).
fn early_usage(kind: BodyKind, body: &[u8], step: usize) -> Option<(usize, UsageReport)> {
    let fired: Arc<Mutex<Option<UsageReport>>> = Arc::default();
    let sink = fired.clone();
    let mut obs = UsageObserver::new(kind, |_: TapOutcome| {}).on_usage(Box::new(move |r| {
        assert!(sink.lock().unwrap().replace(r).is_none(), "fired twice");
    }));
    let mut at = None;
    let mut fed = 0;
    for piece in body.chunks(step) {
        obs.on_data(piece);
        fed += piece.len();
        if at.is_none() && fired.lock().unwrap().is_some() {
            at = Some(fed);
        }
    }
    obs.on_eos(Eos::Complete);
    let report = (*fired.lock().unwrap())?;
    Some((at.unwrap_or(body.len() + 1), report))
}

#[test]
fn on_usage_fires_at_the_usage_chunk_before_done() {
    let s = fixture!("sse/openai_with_usage.sse");
    let (at, report) = early_usage(BodyKind::Sse, s, 16).unwrap();
    let done = memmem::find(s, b"data: [DONE]").unwrap();
    assert!(
        at <= done + 16,
        "fired after [DONE]: at {at}, [DONE] at {done}"
    );
    assert_eq!(report.prompt_tokens(), Some((9, PromptSource::Usage)));
}

#[test]
fn on_usage_fires_at_the_end_of_a_json_body_and_never_without_usage() {
    let json = fixture!("json/openai_response.json");
    let (at, report) = early_usage(BodyKind::Json, json, 7).unwrap();
    // A JSON body is parsed whole: only its end can tell.
    assert_eq!(at, json.len() + 1);
    assert!(report.prompt_tokens().is_some());
    assert!(early_usage(BodyKind::Sse, fixture!("sse/openai_without_usage.sse"), 16).is_none());
}

// ---- hiding ----

fn hide(chunks: &[&[u8]]) -> Vec<u8> {
    let mut h = UsageHider::new();
    let mut out = BytesMut::new();
    for c in chunks {
        h.push(c, &mut out);
    }
    h.finish(&mut out);
    out.to_vec()
}

/// What [`HideUsageBody`] releases for `frames` (each a frame of its own).
fn hide_body_sync(frames: &[&[u8]]) -> Vec<u8> {
    let items = frames
        .iter()
        .map(|f| Some(Ok(Frame::data(Bytes::copy_from_slice(f)))))
        .collect();
    let mut body = std::pin::pin!(HideUsageBody::new(MockBody::new(items)));
    let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
    let mut out = Vec::new();
    loop {
        match body.as_mut().poll_frame(&mut cx) {
            std::task::Poll::Ready(Some(Ok(f))) => out.extend_from_slice(&f.into_data().unwrap()),
            std::task::Poll::Ready(None) => return out,
            other => panic!("a ready body polled to {other:?}"),
        }
    }
}

/// Each vendor's stream with forced usage and as it comes without.
const FIXTURE_PAIRS: [(&[u8], &[u8]); 3] = [
    (
        fixture!("sse/openai_with_usage.sse"),
        fixture!("sse/openai_without_usage.sse"),
    ),
    (
        fixture!("sse/llamacpp_with_usage.sse"),
        fixture!("sse/llamacpp_without_usage.sse"),
    ),
    (
        fixture!("sse/vllm_with_usage.sse"),
        fixture!("sse/vllm_without_usage.sse"),
    ),
];

#[test]
fn hidden_fixture_streams_equal_direct_ones() {
    for (with, without) in FIXTURE_PAIRS {
        for n in [1, 2, 5, 64, 100_000] {
            assert_eq!(
                String::from_utf8(hide(&split_every(with, n))).unwrap(),
                String::from_utf8(without.to_vec()).unwrap(),
                "split {n}"
            );
        }
    }
}

/// The stream cut after every `n`th event (a blank line): frames of whole
/// events, as an upstream writing event by event delivers them.
fn split_events(bytes: &[u8], n: usize) -> Vec<&[u8]> {
    let ends: Vec<usize> = memmem::find_iter(bytes, b"\n\n").map(|p| p + 2).collect();
    let cuts: Vec<usize> = ends.iter().copied().skip(n - 1).step_by(n).collect();
    split_at_points(bytes, &cuts)
        .into_iter()
        .filter(|p| !p.is_empty())
        .collect()
}

#[tokio::test]
async fn hide_body_forwards_untouched_frames_as_they_are() {
    for (with, without) in FIXTURE_PAIRS {
        for frames in [
            split_events(with, 1),
            split_events(with, 3),
            split_every(with, 29),
        ] {
            let sent: Vec<Bytes> = frames.iter().map(|f| Bytes::copy_from_slice(f)).collect();
            let items = sent
                .iter()
                .map(|b| Some(Ok(Frame::data(b.clone()))))
                .collect();
            let mut body = HideUsageBody::new(MockBody::new(items));
            let (mut out, mut same_buffer) = (Vec::new(), 0);
            while let Some(frame) = body.frame().await {
                let data = frame.unwrap().into_data().unwrap();
                same_buffer += usize::from(sent.iter().any(|b| b.as_ptr() == data.as_ptr()));
                out.extend_from_slice(&data);
            }
            assert_eq!(
                String::from_utf8(out).unwrap(),
                String::from_utf8(without.to_vec()).unwrap()
            );
            // OpenAI's forced usage puts `"usage":null` on every chunk: each
            // is edited. The others change only the finish (held) and usage
            // (dropped) events; the rest go on without a copy.
            let edits_every_event = memmem::find(with, b"\"usage\":null").is_some();
            let whole_events = frames.iter().all(|f| f.ends_with(b"\n\n"));
            if whole_events && !edits_every_event {
                assert!(
                    same_buffer + 3 >= frames.len(),
                    "{same_buffer} of {}",
                    frames.len()
                );
            }
        }
    }
}

#[tokio::test]
async fn hide_body_sends_the_untouched_front_of_a_frame_without_a_copy() {
    let kept = "data: {\"choices\":[{\"delta\":{\"content\":\"a\"},\"finish_reason\":null}]}\n\n";
    let usage = "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":9}}\n\n";
    let frame = Bytes::from(format!("{kept}{kept}{usage}data: [DONE]\n\n"));
    let items = vec![Some(Ok(Frame::data(frame.clone())))];
    let mut body = HideUsageBody::new(MockBody::new(items));
    let front = body.frame().await.unwrap().unwrap().into_data().unwrap();
    assert_eq!(
        front.as_ptr(),
        frame.as_ptr(),
        "the two kept events, not copied"
    );
    assert_eq!(front.len(), 2 * kept.len());
    let rest = body.collect().await.unwrap().to_bytes();
    assert_eq!(&rest[..], b"data: [DONE]\n\n", "the usage event dropped");
}

#[tokio::test]
async fn hide_body_with_tap_inside() {
    let with = fixture!("sse/openai_with_usage.sse");
    let got: Arc<Mutex<Option<TapOutcome>>> = Arc::default();
    let sink = got.clone();
    let obs = UsageObserver::new(BodyKind::Sse, move |o| *sink.lock().unwrap() = Some(o));
    let items = split_every(with, 17)
        .into_iter()
        .flat_map(|c| [Some(Ok(Frame::data(Bytes::copy_from_slice(c)))), None])
        .collect();
    let body = HideUsageBody::new(TapBody::new(MockBody::new(items), obs));
    let out = body.collect().await.unwrap().to_bytes();
    assert_eq!(&out[..], &fixture!("sse/openai_without_usage.sse")[..]);
    let outcome = got.lock().unwrap().clone().unwrap();
    assert_eq!(
        outcome.report.prompt_tokens(),
        Some((9, PromptSource::Usage))
    );
}

// Generated streams: the same conversation rendered by a vendor with and
// without include_usage; hiding the first must give the second exactly.

#[derive(Debug, Clone, Copy)]
enum Vendor {
    OpenAi,
    LlamaCpp,
    Vllm,
}

#[derive(Debug, Clone)]
struct Gen {
    vendor: Vendor,
    eol: &'static str,
    pieces: Vec<String>,
    ping_every: usize,
    spaced: bool,
    prompt: u64,
}

fn json_str(s: &str) -> String {
    serde_json::to_string(s).unwrap()
}

fn render(g: &Gen, include_usage: bool) -> Vec<u8> {
    let mut events: Vec<String> = Vec::new();
    let sep = if g.spaced { ", " } else { "," };
    let colon = if g.spaced { ": " } else { ":" };
    let timings = format!(
        "{{\"cache_n\":0,\"prompt_n\":{},\"predicted_n\":{}}}",
        g.prompt,
        g.pieces.len()
    );
    let usage = format!(
        "{{\"prompt_tokens\"{colon}{}{sep}\"completion_tokens\"{colon}{}{sep}\"total_tokens\"{colon}{}}}",
        g.prompt,
        g.pieces.len(),
        g.prompt + g.pieces.len() as u64
    );
    let mut deltas: Vec<(String, String)> = vec![(
        "{\"role\":\"assistant\",\"content\":\"\"}".to_owned(),
        "null".to_owned(),
    )];
    for p in &g.pieces {
        deltas.push((
            format!("{{\"content\":{}}}", json_str(p)),
            "null".to_owned(),
        ));
    }
    deltas.push(("{}".to_owned(), "\"stop\"".to_owned()));
    let last = deltas.len() - 1;
    for (i, (delta, finish)) in deltas.iter().enumerate() {
        let choices = format!(
            "[{{\"index\"{colon}0{sep}\"delta\"{colon}{delta}{sep}\"finish_reason\"{colon}{finish}}}]"
        );
        let ev = match g.vendor {
            Vendor::OpenAi => {
                let u = if include_usage {
                    format!("{sep}\"usage\"{colon}null")
                } else {
                    String::new()
                };
                format!("{{\"id\"{colon}\"c\"{sep}\"choices\"{colon}{choices}{u}{sep}\"obfuscation\"{colon}\"x{i}\"}}")
            }
            Vendor::Vllm => format!("{{\"id\"{colon}\"c\"{sep}\"choices\"{colon}{choices}}}"),
            Vendor::LlamaCpp => {
                let t = if i == last && !include_usage {
                    format!("{sep}\"timings\"{colon}{timings}")
                } else {
                    String::new()
                };
                format!("{{\"choices\"{colon}{choices}{sep}\"object\"{colon}\"chat.completion.chunk\"{t}}}")
            }
        };
        events.push(format!("data: {ev}"));
        if g.ping_every > 0 && i % g.ping_every == 0 {
            events.push(": keep-alive".to_owned());
        }
    }
    if include_usage {
        let ev = match g.vendor {
            Vendor::OpenAi | Vendor::Vllm => {
                format!("{{\"id\"{colon}\"c\"{sep}\"choices\"{colon}[]{sep}\"usage\"{colon}{usage}}}")
            }
            Vendor::LlamaCpp => format!(
                "{{\"choices\"{colon}[]{sep}\"object\"{colon}\"chat.completion.chunk\"{sep}\"usage\"{colon}{usage}{sep}\"timings\"{colon}{timings}}}"
            ),
        };
        events.push(format!("data: {ev}"));
    }
    events.push("data: [DONE]".to_owned());
    let mut out = String::new();
    for e in events {
        out.push_str(&e);
        out.push_str(g.eol);
        out.push_str(g.eol);
    }
    out.into_bytes()
}

fn arb_gen() -> impl Strategy<Value = Gen> {
    (
        prop_oneof![
            Just(Vendor::OpenAi),
            Just(Vendor::LlamaCpp),
            Just(Vendor::Vllm)
        ],
        prop_oneof![Just("\n"), Just("\r\n"), Just("\r")],
        proptest::collection::vec("[a-z \"{}\\\\:,usage\n]{0,8}", 0..6),
        0usize..4,
        any::<bool>(),
        1u64..100_000,
    )
        .prop_map(|(vendor, eol, pieces, ping_every, spaced, prompt)| Gen {
            vendor,
            eol,
            pieces,
            ping_every,
            spaced,
            prompt,
        })
}

proptest! {
    #[test]
    fn hide_with_usage_equals_without(g in arb_gen(), cuts in proptest::collection::vec(0usize..2000, 0..10)) {
        let with = render(&g, true);
        let without = render(&g, false);
        let mut points: Vec<usize> = cuts.into_iter().map(|c| c.min(with.len())).collect();
        points.sort_unstable();
        let mut parts: Vec<&[u8]> = Vec::new();
        let mut last = 0;
        for p in points { parts.push(&with[last..p]); last = p; }
        parts.push(&with[last..]);
        prop_assert_eq!(String::from_utf8(hide(&parts)).unwrap(), String::from_utf8(without).unwrap());
        // And the tap still reads the real usage from the forced stream.
        let r = extract(BodyKind::Sse, &parts).report();
        prop_assert_eq!(r.prompt_tokens(), Some((g.prompt, PromptSource::Usage)));
    }

    /// The body's frame path (the untouched front of a frame sent as it
    /// is, the rest pushed) gives what pushing every byte gives, for the
    /// generated streams with and without forced usage and for bytes of
    /// any shape.
    #[test]
    fn hide_body_frames_equal_pushed_bytes(
        g in arb_gen(),
        forced in any::<bool>(),
        noise in proptest::collection::vec(any::<u8>(), 0..120),
        cuts in proptest::collection::vec(0usize..2000, 0..10),
    ) {
        let mut stream = render(&g, forced);
        stream.extend_from_slice(&noise);
        let parts = split_at_points(&stream, &cuts);
        prop_assert_eq!(hide_body_sync(&parts), hide(&parts));
    }

    /// The same for streams made of the pieces the frame path reads
    /// (line ends of each kind, the keys, `null` and values around them)
    /// in any order and framing.
    #[test]
    fn hide_body_frames_equal_pushed_bytes_for_any_token_soup(
        tokens in proptest::collection::vec(prop_oneof![
            Just(&b"data: "[..]), Just(&b"\n"[..]), Just(&b"\r"[..]), Just(&b"\r\n"[..]),
            Just(&b"\"usage\""[..]), Just(&b"\"finish_reason\""[..]), Just(&b":"[..]),
            Just(&b"null"[..]), Just(&b" "[..]), Just(&b"\t"[..]), Just(&b"{"[..]),
            Just(&b"}"[..]), Just(&b","[..]), Just(&b"\"stop\""[..]), Just(&b"[]"[..]),
            Just(&b"\"choices\":"[..]), Just(&b"g"[..]), Just(&b": ping"[..]),
        ], 0..60),
        cuts in proptest::collection::vec(0usize..400, 0..6),
    ) {
        let stream = tokens.concat();
        let parts = split_at_points(&stream, &cuts);
        prop_assert_eq!(hide_body_sync(&parts), hide(&parts));
    }

    /// A decided extractor leaves out whole events without a `g` when a
    /// frame holds them; fed a byte at a time it leaves out none (no event
    /// fits a byte). What it reads must not depend on that.
    #[test]
    fn events_left_out_whole_change_nothing_read(
        g in arb_gen(),
        forced in any::<bool>(),
        tokens in proptest::collection::vec(prop_oneof![
            Just(&b"data: "[..]), Just(&b"\n"[..]), Just(&b"\r"[..]), Just(&b"\r\n"[..]),
            Just(&b"event: x"[..]), Just(&b"{\"usage\":{\"prompt_tokens\":7}}"[..]),
            Just(&b"{\"timings\":{\"prompt_n\":3}}"[..]), Just(&b"{\"a\":1}"[..]),
            Just(&b": ping"[..]), Just(&b"g"[..]), Just(&b"data: [DONE]"[..]),
            Just(&b"\"usage\""[..]), Just(&b"\"timings\""[..]), Just(&b":null"[..]),
            Just(&b" : "[..]), Just(&b"{\"prompt_tokens\":5}"[..]),
            Just(&b"\"fingerprint\":\"fp\","[..]), Just(&b"data: {\"usage\":null,"[..]),
        ], 0..40),
        cuts in proptest::collection::vec(0usize..2000, 0..10),
    ) {
        let mut stream = render(&g, forced);
        stream.extend_from_slice(&tokens.concat());
        let whole = extract_decided(&split_every(&stream, 1));
        prop_assert_eq!(extract_decided(&split_at_points(&stream, &cuts)), whole);
        prop_assert_eq!(extract_decided(&[&stream]), whole);
    }

    #[test]
    fn scanner_usage_is_split_invariant(g in arb_gen(), n in 1usize..64) {
        let with = render(&g, true);
        let whole = extract(BodyKind::Sse, &[&with]).report();
        let split = extract(BodyKind::Sse, &split_every(&with, n)).report();
        prop_assert_eq!(whole, split);
    }
}

#[test]
fn llamacpp_timings_keep_upstream_separators() {
    // Found by the property test: a spaced JSON style must be reproduced
    // when `timings` moves from the usage chunk to the finish chunk.
    let g = Gen {
        vendor: Vendor::LlamaCpp,
        eol: "\n",
        pieces: vec![],
        ping_every: 0,
        spaced: true,
        prompt: 1,
    };
    assert_eq!(hide(&[&render(&g, true)]), render(&g, false));
}

#[test]
fn comment_between_finish_and_usage_chunk_stays_in_place() {
    let g = Gen {
        vendor: Vendor::LlamaCpp,
        eol: "\n",
        pieces: vec![],
        ping_every: 1,
        spaced: false,
        prompt: 1,
    };
    assert_eq!(hide(&[&render(&g, true)]), render(&g, false));
}

#[tokio::test]
async fn held_bytes_are_released_before_an_upstream_error() {
    let finish: &[u8] = b"data: {\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"stop\"}],\"usage\":null}\n\ndata: {\"partial";
    let body = MockBody::new(vec![
        Some(Ok(Frame::data(Bytes::from_static(finish)))),
        Some(Err(std::io::Error::other("reset"))),
    ]);
    let mut hidden = HideUsageBody::new(body);
    let first = hidden.frame().await.unwrap().unwrap().into_data().unwrap();
    assert_eq!(
        &first[..],
        &b"data: {\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"stop\"}]}\n\ndata: {\"partial"[..]
    );
    assert!(hidden.frame().await.unwrap().is_err());
    assert!(hidden.frame().await.is_none());
}

fn split_at_points<'a>(s: &'a [u8], cuts: &[usize]) -> Vec<&'a [u8]> {
    let mut points: Vec<usize> = cuts.iter().map(|c| (*c).min(s.len())).collect();
    points.sort_unstable();
    let mut parts = Vec::new();
    let mut last = 0;
    for p in points {
        parts.push(&s[last..p]);
        last = p;
    }
    parts.push(&s[last..]);
    parts
}

proptest! {
    /// Streams without a `"usage"` key pass through byte for byte, whatever
    /// their framing or content.
    #[test]
    fn hider_is_identity_without_usage(
        bytes in proptest::collection::vec(prop_oneof![
            Just(b'\n'), Just(b'\r'), Just(b'{'), Just(b'}'), Just(b'"'), Just(b':'),
            Just(b','), Just(b'['), Just(b']'), Just(b' '), any::<u8>()
        ], 0..400),
        prefix in prop_oneof![Just(&b""[..]), Just(&b"data: "[..]), Just(&b"data:{\"finish_reason\":\"x\""[..])],
        cuts in proptest::collection::vec(0usize..500, 0..6),
    ) {
        let mut s = prefix.to_vec();
        s.extend_from_slice(&bytes);
        prop_assume!(memmem::find(&s, b"\"usage\"").is_none());
        prop_assert_eq!(hide(&split_at_points(&s, &cuts)), s);
    }

    /// Arbitrary bytes never panic the hider or the extractor, and the hider
    /// output never depends on the framing.
    #[test]
    fn arbitrary_bytes_are_split_invariant(
        bytes in proptest::collection::vec(any::<u8>(), 0..300),
        cuts in proptest::collection::vec(0usize..300, 0..6),
    ) {
        let whole = hide(&[&bytes]);
        prop_assert_eq!(hide(&split_at_points(&bytes, &cuts)), whole);
        let _ = extract(BodyKind::Sse, &split_at_points(&bytes, &cuts)).report();
        let _ = extract(BodyKind::Json, &[&bytes]).report();
    }
}

#[test]
fn anthropic_stream_prompt_is_input_plus_cache_and_survives_message_delta() {
    // Captured from llama.cpp's /v1/messages: `message_start` carries the
    // input side, `message_delta` only the output count.
    let s = fixture!("sse/llamacpp_messages.sse");
    for n in [1, 9, 4096] {
        let e = extract(BodyKind::Sse, &split_every(s, n));
        let u = e.report().usage.unwrap();
        assert_eq!(u.prompt_tokens, Some(11), "5 input + 6 cache read");
        assert_eq!(u.completion_tokens, Some(3));
        assert_eq!(u.cached_tokens, Some(6));
        assert_eq!(e.start(), &StreamStart::Content);
    }
    let body = br#"{"type":"message","content":[],"usage":{"input_tokens":10,"cache_creation_input_tokens":200,"cache_read_input_tokens":3000,"output_tokens":7}}"#;
    let e = extract(BodyKind::Json, &[body]);
    assert_eq!(
        e.report().prompt_tokens(),
        Some((3210, PromptSource::Usage))
    );
}

#[test]
fn responses_stream_usage_is_in_response_completed() {
    // Captured from llama.cpp's /v1/responses.
    let s = fixture!("sse/llamacpp_responses.sse");
    for n in [1, 9, 4096] {
        let e = extract(BodyKind::Sse, &split_every(s, n));
        let u = e.report().usage.unwrap();
        assert_eq!(u.prompt_tokens, Some(11));
        assert_eq!(u.completion_tokens, Some(3));
        assert_eq!(e.start(), &StreamStart::Content);
    }
    let body = br#"{"object":"response","status":"completed","output":[],"usage":{"input_tokens":40,"output_tokens":2,"total_tokens":42,"input_tokens_details":{"cached_tokens":30}}}"#;
    let e = extract(BodyKind::Json, &[body]);
    let u = e.report().usage.unwrap();
    assert_eq!((u.prompt_tokens, u.cached_tokens), (Some(40), Some(30)));
}

#[test]
fn responses_failed_event_is_an_error_start() {
    let s = b"event: response.created\ndata: {\"type\":\"response.created\",\"response\":{\"id\":\"r\",\"status\":\"in_progress\"}}\n\nevent: response.failed\ndata: {\"type\":\"response.failed\",\"response\":{\"status\":\"failed\",\"error\":{\"code\":\"context_length_exceeded\",\"message\":\"Your input exceeds the context window of this model.\"}}}\n\n";
    let e = extract(BodyKind::Sse, &[s]);
    let StreamStart::Error(payload) = e.start() else {
        panic!("{:?}", e.start());
    };
    assert!(crate::window::overflow::parse_overflow_event(payload).is_some());
}

/// The fields of a chunk as text, to compare two reads of it.
fn chunk_fields(c: &ChunkLite<'_>) -> [Option<String>; 7] {
    [
        c.usage, c.timings, c.error, c.choices, c.kind, c.message, c.response,
    ]
    .map(|f| f.map(|r| r.get().to_owned()))
}

#[test]
fn a_skimmed_chunk_reads_as_serde_json_reads_it() {
    let payloads: &[&[u8]] = &[
        br#"{"id":"x","choices":[{"delta":{"content":"hi"}}],"usage":null}"#,
        br#"{"usage":null,"message":{"usage":{"input_tokens":3}}}"#,
        br#"{"type":"message_start","message":{"id":"m"},"usage":{"prompt_tokens":1}}"#,
        br#"{"error":{"message":"too long"},"timings":{"prompt_n":4}}"#,
        br#" { "response" : {"usage":{"input_tokens":2}} , "extra":[1,{"a":null}] } "#,
        // Left to serde_json: a repeated key, an escaped key, a repeated
        // unknown key, text that is not UTF-8 inside an ignored member,
        // not an object at all.
        br#"{"usage":{"prompt_tokens":1},"usage":{"prompt_tokens":2}}"#,
        br#"{"\u0075sage":{"prompt_tokens":1}}"#,
        br#"{"x":1,"x":2,"usage":{"prompt_tokens":1}}"#,
        b"{\"x\":\"\xff\",\"usage\":{\"prompt_tokens\":1}}",
        br#"[null,null]"#,
        br#"{"usage":{"prompt_tokens":1}"#,
    ];
    for p in payloads {
        let theirs = serde_json::from_slice::<ChunkLite<'_>>(p).map(|c| chunk_fields(&c));
        let ours = ChunkLite::read(p).map(|c| chunk_fields(&c));
        assert_eq!(ours.ok(), theirs.ok(), "{}", String::from_utf8_lossy(p));
    }
}

#[test]
fn an_observer_ignoring_the_start_still_finds_the_usage() {
    let sse: &[u8] = b"data: {\"choices\":[{\"delta\":{\"content\":\"hi\"}}]}\n\ndata: {\"choices\":[],\"usage\":{\"prompt_tokens\":7,\"completion_tokens\":1}}\n\ndata: [DONE]\n\n";
    let json: &[u8] = br#"{"choices":[{"message":{"content":"hi"}}],"usage":{"prompt_tokens":9}}"#;
    for (kind, body, prompt) in [(BodyKind::Sse, sse, 7), (BodyKind::Json, json, 9)] {
        let got = Arc::new(Mutex::new(None));
        let seen = Arc::clone(&got);
        let mut o = UsageObserver::new(kind, |_| {})
            .ignoring_start()
            .on_usage(Box::new(move |r| *seen.lock().unwrap() = r.prompt_tokens()));
        for piece in body.chunks(5) {
            o.on_data(piece);
        }
        o.on_eos(Eos::Complete);
        assert_eq!(*got.lock().unwrap(), Some((prompt, PromptSource::Usage)));
    }
}

/// A JSON value as a usage object may carry one.
fn usage_value() -> impl Strategy<Value = String> {
    prop_oneof![
        any::<u32>().prop_map(|n| n.to_string()),
        Just("18446744073709551616".to_owned()),
        Just("-3".to_owned()),
        Just("-0".to_owned()),
        Just("2.9".to_owned()),
        Just("1e3".to_owned()),
        Just("-1.5E-2".to_owned()),
        Just("null".to_owned()),
        Just("true".to_owned()),
        Just("\"12\"".to_owned()),
        Just("[1]".to_owned()),
        Just("{}".to_owned()),
        Just("{\"cached_tokens\":4}".to_owned()),
        Just("{\"cached_tokens\":null,\"x\":1}".to_owned()),
        Just("{\"cached_tokens\":7,\"cached_tokens\":8}".to_owned()),
    ]
}

proptest! {
    /// The skim reads a usage object exactly as serde_json reads it into
    /// `UsageLite`, or leaves it to serde_json.
    #[test]
    fn skimmed_usage_agrees_with_serde_json(
        members in proptest::collection::vec((prop_oneof![
            Just("prompt_tokens"), Just("completion_tokens"), Just("total_tokens"),
            Just("input_tokens"), Just("output_tokens"), Just("cache_creation_input_tokens"),
            Just("cache_read_input_tokens"), Just("prompt_tokens_details"),
            Just("input_tokens_details"), Just("other"), Just("prompt\\u005ftokens"),
        ], usage_value()), 0..8),
        spaced in any::<bool>(),
    ) {
        let sep = if spaced { ", " } else { "," };
        let body: Vec<String> = members.iter().map(|(k, v)| format!("\"{k}\":{v}")).collect();
        let text = format!("{{{}}}", body.join(sep));
        let serde = parse_usage_serde(&text);
        if let Some(skimmed) = skimmed_usage(&text) {
            prop_assert_eq!(skimmed, serde, "{}", text);
        }
        let raw = serde_json::value::RawValue::from_string(text).unwrap();
        prop_assert_eq!(parse_usage(&raw), serde);
    }
}

#[test]
fn the_usage_skim_reads_the_common_shapes_itself() {
    for text in [
        r#"{"prompt_tokens":42,"completion_tokens":12,"total_tokens":54}"#,
        r#"{"prompt_tokens":9,"prompt_tokens_details":{"cached_tokens":4}}"#,
        r#"{"input_tokens":3,"cache_read_input_tokens":100,"output_tokens":7}"#,
    ] {
        let skimmed = skimmed_usage(text).expect("no fallback to serde_json");
        assert_eq!(skimmed, parse_usage_serde(text), "{text}");
        assert!(skimmed.is_some());
    }
}

/// An Ollama `/api/chat` stream: NDJSON lines, the counts on the last.
const OLLAMA_STREAM: &[u8] = b"{\"model\":\"llama3.2\",\"created_at\":\"2026-12-07T10:00:00Z\",\"message\":{\"role\":\"assistant\",\"content\":\"The\"},\"done\":false}\n\
{\"model\":\"llama3.2\",\"created_at\":\"2026-12-07T10:00:00Z\",\"message\":{\"role\":\"assistant\",\"content\":\" sky\"},\"done\":false}\n\
{\"model\":\"llama3.2\",\"created_at\":\"2026-12-07T10:00:01Z\",\"message\":{\"role\":\"assistant\",\"content\":\"\"},\"done_reason\":\"stop\",\"done\":true,\"total_duration\":4883583458,\"load_duration\":1334875,\"prompt_eval_count\":26,\"prompt_eval_duration\":342546000,\"eval_count\":282,\"eval_duration\":4535599000}\n";

#[test]
fn ollama_ndjson_counts_from_the_last_line_however_it_is_split() {
    assert_eq!(
        BodyKind::from_content_type(Some("application/x-ndjson")),
        BodyKind::Ndjson
    );
    for n in [1, 7, 64, OLLAMA_STREAM.len()] {
        let e = extract(BodyKind::Ndjson, &split_every(OLLAMA_STREAM, n));
        let u = e.report().usage.unwrap();
        assert_eq!(u.prompt_tokens, Some(26), "split {n}");
        assert_eq!(u.completion_tokens, Some(282));
        assert_eq!(u.total_tokens, Some(308));
        assert_eq!(*e.start(), StreamStart::Content);
        assert_eq!(e.parse_failures(), 0);
    }
    // The last line without its line feed still counts.
    let cut = &OLLAMA_STREAM[..OLLAMA_STREAM.len() - 1];
    let e = extract(BodyKind::Ndjson, &[cut]);
    assert_eq!(e.report().prompt_tokens(), Some((26, PromptSource::Usage)));
}

#[test]
fn ollama_json_reply_and_error_line() {
    let body = br#"{"model":"llama3.2","message":{"role":"assistant","content":"Hi"},"done":true,"prompt_eval_count":169,"eval_count":18}"#;
    let e = extract(BodyKind::Json, &[body]);
    assert_eq!(e.report().prompt_tokens(), Some((169, PromptSource::Usage)));
    // An error before any content is the stream's start.
    let e = extract(BodyKind::Ndjson, &[b"{\"error\":\"model is loading\"}\n"]);
    assert!(matches!(e.start(), StreamStart::Error(_)));
    assert_eq!(e.report().usage, None);
}

#[test]
fn an_ndjson_line_over_the_cap_is_skipped_not_buffered() {
    let mut big = b"{\"message\":{\"content\":\"".to_vec();
    big.extend(std::iter::repeat_n(b'x', sse::MAX_EVENT_BYTES + 10));
    big.extend_from_slice(b"\"},\"done\":false}\n");
    big.extend_from_slice(OLLAMA_STREAM);
    let e = extract(BodyKind::Ndjson, &split_every(&big, 4096));
    assert_eq!(e.oversized(), 1);
    // The lines after it are read as before.
    assert_eq!(e.report().prompt_tokens(), Some((26, PromptSource::Usage)));
}
