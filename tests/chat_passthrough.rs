//! Passthrough, headers and usage hiding through compactor's chat path.

mod support;

use serde_json::json;
use support::chat::*;

const TOKEN: &str = "admin-secret";

fn short_history() -> Vec<serde_json::Value> {
    vec![
        json!({"role":"system","content":SYSTEM_PROMPT}),
        json!({"role":"user","content":"hello"}),
    ]
}

#[tokio::test]
async fn short_conversation_is_forwarded_byte_identically() {
    let mock = ChatMock::start(Settings::default()).await;
    let proxy = start_proxy(&mock.url(), "").await;
    // Odd spacing and key order: a re-serialisation would show.
    let body = br#"{ "model" : "m", "temperature":0.70, "messages":[{"role":"system","content":"be brief"},{"role":"user","content":"hi \u00e9"}], "zeta":{"b":1,"a":2} }"#.to_vec();
    let (status, headers, resp) = post_chat(
        &proxy.url(),
        body.clone(),
        &[("authorization", "Bearer k1")],
    )
    .await;
    assert_eq!(status, 200);
    assert_eq!(mock.last_chat().body.as_ref(), body.as_slice());
    assert_eq!(action(&headers), "passthrough");
    assert!(!session_of(&headers).is_empty());
    let deltas = Settings::default().deltas;
    let expected = render_json(
        "m",
        &deltas.concat(),
        mock.last_chat().prompt_tokens,
        completion_tokens(&deltas),
        false,
    );
    assert_eq!(resp.as_ref(), expected.as_slice());
}

#[tokio::test]
async fn headers_can_be_turned_off() {
    let mock = ChatMock::start(Settings::default()).await;
    let proxy = start_proxy(&mock.url(), "[headers]\nexpose = false\n").await;
    let (status, headers, _) =
        post_chat(&proxy.url(), chat_body("m", &short_history(), false), &[]).await;
    assert_eq!(status, 200);
    assert!(headers.get("x-compactor-action").is_none());
    assert!(headers.get("x-compactor-session").is_none());
}

#[tokio::test]
async fn stream_without_include_usage_hides_the_forced_usage() {
    for (timings, frame_bytes) in [
        (false, None),
        (true, None),
        (false, Some(7)),
        (true, Some(13)),
    ] {
        let mock = ChatMock::start(Settings {
            timings,
            frame_bytes,
            ..Settings::default()
        })
        .await;
        let proxy = start_proxy(&mock.url(), &format!("[admin]\ntoken = \"{TOKEN}\"\n")).await;
        let (status, headers, resp) = post_chat(
            &proxy.url(),
            chat_body("m", &short_history(), true),
            &[("authorization", "Bearer k")],
        )
        .await;
        assert_eq!(status, 200);
        let seen = mock.last_chat();
        assert_eq!(seen.json()["stream_options"]["include_usage"], json!(true));
        let expected = render_sse(
            "m",
            &Settings::default().deltas,
            false,
            seen.prompt_tokens,
            timings,
        );
        assert_eq!(
            String::from_utf8_lossy(&resp),
            String::from_utf8_lossy(&expected),
            "timings={timings} frames={frame_bytes:?}"
        );
        let (st, view) = admin_view(&proxy.url(), TOKEN, &session_of(&headers)).await;
        assert_eq!(st, 200);
        assert_eq!(
            view["last_real_prompt_tokens"],
            json!(seen.prompt_tokens),
            "{view}"
        );
    }
}

#[tokio::test]
async fn stream_with_include_usage_is_untouched() {
    let mock = ChatMock::start(Settings {
        timings: true,
        ..Settings::default()
    })
    .await;
    let proxy = start_proxy(&mock.url(), &format!("[admin]\ntoken = \"{TOKEN}\"\n")).await;
    let body = serde_json::to_vec(&json!({
        "model":"m","messages":short_history(),"stream":true,
        "stream_options":{"include_usage":true}
    }))
    .unwrap();
    let (status, headers, resp) = post_chat(&proxy.url(), body.clone(), &[]).await;
    assert_eq!(status, 200);
    let seen = mock.last_chat();
    assert_eq!(seen.body.as_ref(), body.as_slice());
    let expected = render_sse(
        "m",
        &Settings::default().deltas,
        true,
        seen.prompt_tokens,
        true,
    );
    assert_eq!(resp.as_ref(), expected.as_slice());
    let (_, view) = admin_view(&proxy.url(), TOKEN, &session_of(&headers)).await;
    assert_eq!(view["last_real_prompt_tokens"], json!(seen.prompt_tokens));
}

#[tokio::test]
async fn non_streaming_request_gets_no_stream_options() {
    let mock = ChatMock::start(Settings::default()).await;
    let proxy = start_proxy(&mock.url(), &format!("[admin]\ntoken = \"{TOKEN}\"\n")).await;
    let (_, headers, _) =
        post_chat(&proxy.url(), chat_body("m", &short_history(), false), &[]).await;
    assert!(mock.last_chat().json().get("stream_options").is_none());
    let (_, view) = admin_view(&proxy.url(), TOKEN, &session_of(&headers)).await;
    assert_eq!(
        view["last_real_prompt_tokens"],
        json!(mock.last_chat().prompt_tokens)
    );
}

#[tokio::test]
async fn upstream_is_asked_for_an_uncompressed_body() {
    let mock = ChatMock::start(Settings::default()).await;
    let proxy = start_proxy(&mock.url(), "").await;
    for stream in [false, true] {
        let (status, _, _) = post_chat(
            &proxy.url(),
            chat_body("m", &short_history(), stream),
            &[("accept-encoding", "gzip, deflate, br")],
        )
        .await;
        assert_eq!(status, 200);
        let seen = mock.last_chat();
        let ae: Vec<_> = seen.headers.get_all("accept-encoding").iter().collect();
        assert_eq!(ae, ["identity"], "stream={stream}");
    }
}
