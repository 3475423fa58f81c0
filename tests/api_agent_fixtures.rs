//! The real agents' requests (`tests/fixtures/agents`: Claude Code 2.1.328,
//! Codex 0.169.0, pi 0.73.1, hermes-agent 0.19.0, recorded from the CLIs by
//! `tests/e2e/capture_agents.py`) through the codecs and through the proxy
//! against the scripted mocks, without network:
//!
//! - every recorded request decodes, and the engine sees each of the agent's
//!   `system` / `developer` messages as an instruction with its text;
//! - below the threshold the proxy forwards the recorded bytes unchanged
//!   (path and query too) and says so (`x-compactor-action: passthrough`);
//! - a conversation grown from the recording past the window is compacted,
//!   and every request the upstream gets still carries each of the agent's
//!   instruction texts verbatim, in order, as instructions (never summarised,
//!   shortened or dropped), the top-level `system` untouched.

// Test code: a failed unwrap is a failed test (the helpers too).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::path::PathBuf;

use compactor::codec::{Api, ApiRequest};
use serde_json::value::RawValue;
use serde_json::Value;
use support::apis::{ApiMock, ApiSettings};
use support::chat::{action, post_path, start_proxy, ChatMock, Settings};

const AGENTS: [&str; 4] = ["claude-code", "codex", "pi", "hermes-agent"];
const TURNS: usize = 3;
const MODEL: &str = "gemma-3-270m";

/// One recorded request.
struct Fixture {
    agent: &'static str,
    turn: usize,
    /// Path with its query, as the agent sent it.
    path: String,
    headers: Vec<(String, String)>,
    body: String,
}

impl Fixture {
    fn load(agent: &'static str, turn: usize) -> Self {
        let file: PathBuf = [
            env!("CARGO_MANIFEST_DIR"),
            "tests/fixtures/agents",
            agent,
            &format!("turn{turn}.json"),
        ]
        .iter()
        .collect();
        let text = std::fs::read_to_string(&file).unwrap_or_else(|e| panic!("{file:?}: {e}"));
        let doc: Value = serde_json::from_str(&text).unwrap();
        let headers = doc["headers"]
            .as_object()
            .unwrap()
            .iter()
            .map(|(k, v)| (k.clone(), v.as_str().unwrap().to_owned()))
            .collect();
        Self {
            agent,
            turn,
            path: doc["path"].as_str().unwrap().to_owned(),
            headers,
            body: doc["body"].as_str().unwrap().to_owned(),
        }
    }

    fn all() -> Vec<Self> {
        AGENTS
            .iter()
            .flat_map(|a| (1..=TURNS).map(move |t| Self::load(a, t)))
            .collect()
    }

    fn api(&self) -> Api {
        match self.path.split('?').next().unwrap() {
            "/v1/messages" => Api::Messages,
            "/v1/responses" => Api::Responses,
            "/v1/chat/completions" => Api::Chat,
            p => panic!("{}: unexpected path {p}", self.agent),
        }
    }

    fn json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap()
    }

    /// The headers to replay (content headers are the client's business).
    fn header_pairs(&self) -> Vec<(&str, &str)> {
        self.headers
            .iter()
            .filter(|(k, _)| !k.eq_ignore_ascii_case("content-type"))
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .chain([("content-type", "application/json")])
            .collect()
    }

    fn name(&self) -> String {
        format!("{} turn {}", self.agent, self.turn)
    }
}

fn list_key(api: Api) -> &'static str {
    match api {
        Api::Responses => "input",
        _ => "messages",
    }
}

fn is_instruction(m: &Value) -> bool {
    matches!(m["role"].as_str(), Some("system" | "developer"))
}

/// The text parts of a message (a string content is one part).
fn texts(m: &Value) -> Vec<String> {
    match &m["content"] {
        Value::String(s) => vec![s.clone()],
        Value::Array(parts) => parts
            .iter()
            .filter_map(|p| p["text"].as_str().map(str::to_owned))
            .collect(),
        _ => Vec::new(),
    }
}

/// The texts of the `system` / `developer` messages inside the list, in order.
fn instructions(api: Api, body: &Value) -> Vec<Vec<String>> {
    body[list_key(api)]
        .as_array()
        .unwrap()
        .iter()
        .filter(|m| is_instruction(m))
        .map(texts)
        .collect()
}

/// Whether `want` (instruction texts) appear in `got`'s list as
/// instructions, whole and in the same order; else what is missing.
fn instructions_kept(
    what: &str,
    api: Api,
    want: &[Vec<String>],
    got: &Value,
) -> Result<(), String> {
    let have = instructions(api, got);
    let mut at = 0;
    for w in want {
        let found = have[at..].iter().position(|h| h == w);
        let lens: Vec<usize> = w.iter().map(String::len).collect();
        let have_lens: Vec<Vec<usize>> = have
            .iter()
            .map(|h| h.iter().map(String::len).collect())
            .collect();
        let Some(i) = found else {
            return Err(format!(
                "{what}: the agent's instruction of {lens:?} bytes is not in the upstream request \
                 verbatim (instructions there: {have_lens:?})"
            ));
        };
        at += i + 1;
    }
    Ok(())
}

// ---------------------------------------------------------------- codec

#[test]
fn every_recorded_request_decodes_with_its_instructions() {
    let mut failures = Vec::new();
    for f in Fixture::all() {
        let api = f.api();
        let want = instructions(api, &f.json());
        match ApiRequest::parse(api, f.body.clone().into_bytes()) {
            Err(e) => failures.push(format!("{}: does not decode: {e}", f.name())),
            Ok(req) => {
                let engine: Vec<Value> = req
                    .messages()
                    .iter()
                    .map(|m| serde_json::from_str(m.get()).unwrap())
                    .collect();
                let have: Vec<Vec<String>> = engine
                    .iter()
                    .filter(|m| is_instruction(m))
                    .map(texts)
                    .collect();
                for w in &want {
                    if !have.contains(w) {
                        failures.push(format!(
                            "{}: an instruction of {} bytes is not an engine system/developer message",
                            f.name(),
                            w.iter().map(String::len).sum::<usize>()
                        ));
                    }
                }
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn the_recordings_have_the_shapes_the_codecs_must_take() {
    // What makes these requests hard, pinned so a recapture that loses it is noticed.
    let cc = Fixture::load("claude-code", 3).json();
    assert_eq!(
        cc["messages"][1]["role"], "system",
        "Claude Code: system message at index 1"
    );
    assert!(
        cc["system"].is_array()
            && cc["thinking"].is_object()
            && cc["context_management"].is_object()
    );
    assert!(Fixture::load("claude-code", 1).path.ends_with("?beta=true"));
    let cx = Fixture::load("codex", 3).json();
    assert!(
        cx.get("instructions").is_none(),
        "Codex sends no instructions member"
    );
    assert_eq!(cx["input"][0]["role"], "developer");
    assert_eq!(cx["input"][1]["role"], "developer");
    for agent in ["pi", "hermes-agent"] {
        assert_eq!(
            Fixture::load(agent, 3).json()["messages"][0]["role"],
            "system"
        );
    }
}

// ---------------------------------------------------------------- proxy

/// An upstream for `api`: the scripted Anthropic/Responses mock or the chat mock.
enum Upstream {
    Api(ApiMock),
    Chat(ChatMock),
}

impl Upstream {
    async fn start(api: Api) -> Self {
        match api {
            Api::Chat => Upstream::Chat(ChatMock::start(Settings::default()).await),
            _ => Upstream::Api(ApiMock::start(ApiSettings::default()).await),
        }
    }

    fn url(&self) -> String {
        match self {
            Upstream::Api(m) => m.url(),
            Upstream::Chat(m) => m.url(),
        }
    }

    /// The conversation requests (not summary calls) so far: body and query.
    fn conversations(&self) -> Vec<(bytes::Bytes, Option<String>)> {
        match self {
            Upstream::Api(m) => m
                .conversations()
                .into_iter()
                .map(|s| (s.body, s.query))
                .collect(),
            Upstream::Chat(m) => m.chats().into_iter().map(|s| (s.body, None)).collect(),
        }
    }
}

fn model_config(context_length: u64) -> String {
    format!("[models.\"{MODEL}\"]\ncontext_length = {context_length}\n")
}

#[tokio::test]
async fn below_the_window_the_recorded_bytes_pass_unchanged() {
    let mut failures = Vec::new();
    for agent in AGENTS {
        let api = Fixture::load(agent, 1).api();
        let up = Upstream::start(api).await;
        let proxy = start_proxy(&up.url(), &model_config(1_000_000)).await;
        for turn in 1..=TURNS {
            let f = Fixture::load(agent, turn);
            let (status, headers, resp) = post_path(
                &proxy.url(),
                &f.path,
                f.body.clone().into_bytes(),
                &f.header_pairs(),
            )
            .await;
            assert_eq!(
                status,
                200,
                "{}: {}",
                f.name(),
                String::from_utf8_lossy(&resp)
            );
            let (body, query) = up.conversations().pop().expect("forwarded");
            assert!(
                body.as_ref() == f.body.as_bytes(),
                "{}: bytes changed",
                f.name()
            );
            if let Some((_, q)) = f.path.split_once('?') {
                assert_eq!(query.as_deref(), Some(q), "{}: query", f.name());
            }
            // A request compactor understood and left alone says so.
            if action(&headers) != "passthrough" {
                failures.push(format!(
                    "{}: x-compactor-action is {:?}, not \"passthrough\" (the request was not decoded)",
                    f.name(),
                    action(&headers)
                ));
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// The recorded turn 3 with `k` more exchanges of the agent's own shape (its
/// turn-2 assistant reply and user message, renumbered) before the newest
/// user message: what the agent sends `k` turns later. Only the list member
/// changes; every other member keeps the recorded bytes.
fn grown(f: &Fixture, k: usize) -> Vec<u8> {
    let key = list_key(f.api());
    let mut body: indexmap::IndexMap<String, Box<RawValue>> =
        serde_json::from_str(&f.body).unwrap();
    let mut list: Vec<Value> = serde_json::from_str(body[key].get()).unwrap();
    let newest = list.pop().unwrap();
    let n = list.len();
    let (reply, user) = (list[n - 2].clone(), list[n - 1].clone());
    for i in 0..k {
        let tag = format!(" [run {}]", i + 4);
        list.push(renumbered(&reply, &tag));
        list.push(renumbered(&user, &tag));
    }
    list.push(newest);
    body.insert(
        key.to_owned(),
        serde_json::value::to_raw_value(&list).unwrap(),
    );
    serde_json::to_vec(&body).unwrap()
}

fn renumbered(m: &Value, tag: &str) -> Value {
    let mut m = m.clone();
    match &mut m["content"] {
        Value::String(s) => s.push_str(tag),
        Value::Array(parts) => {
            for p in parts.iter_mut() {
                if let Some(Value::String(s)) = p.get_mut("text") {
                    s.push_str(tag);
                }
            }
        }
        _ => {}
    }
    m
}

/// Plays the grown conversation (k = 0, 8, .. 40 extra exchanges) through
/// one proxy whose window the middle of it crosses; returns the failures.
async fn compaction_keeps_instructions(agent: &'static str) -> Vec<String> {
    let f = Fixture::load(agent, TURNS);
    let api = f.api();
    let want = instructions(api, &f.json());
    assert!(!want.is_empty(), "{agent}: no instruction in the recording");
    let top_system = f.json().get("system").cloned();
    // A window the 16-exchange history crosses the trigger of (~4 bytes a token).
    let window = (grown(&f, 16).len() / 4) as u64;
    let up = Upstream::start(api).await;
    let proxy = start_proxy(&up.url(), &model_config(window)).await;
    let mut failures = Vec::new();
    let mut compactions = 0;
    for k in (0..=40).step_by(8) {
        let sent = grown(&f, k);
        let before = up.conversations().len();
        let (status, headers, resp) =
            post_path(&proxy.url(), &f.path, sent.clone(), &f.header_pairs()).await;
        let what = format!("{agent}, {k} more exchanges");
        if status != 200 {
            failures.push(format!(
                "{what}: HTTP {status}: {}",
                String::from_utf8_lossy(&resp)
            ));
            continue;
        }
        compactions += usize::from(action(&headers) == "compacted");
        for (body, _) in up.conversations().into_iter().skip(before) {
            let got: Value = serde_json::from_slice(&body).unwrap();
            if let Err(e) = instructions_kept(&what, api, &want, &got) {
                failures.push(e);
            }
            if got.get("system") != top_system.as_ref() {
                failures.push(format!("{what}: the top-level system member changed"));
            }
        }
    }
    if compactions == 0 {
        failures.push(format!(
            "{agent}: never compacted (x-compactor-action never \"compacted\") with a {window}-token window"
        ));
    }
    failures
}

#[tokio::test]
async fn claude_code_compaction_keeps_its_system_message() {
    let failures = compaction_keeps_instructions("claude-code").await;
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[tokio::test]
async fn codex_compaction_keeps_its_developer_messages() {
    let failures = compaction_keeps_instructions("codex").await;
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[tokio::test]
async fn pi_compaction_keeps_its_system_prompt() {
    let failures = compaction_keeps_instructions("pi").await;
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[tokio::test]
async fn hermes_compaction_keeps_its_system_prompt() {
    let failures = compaction_keeps_instructions("hermes-agent").await;
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// Each agent's recorded turn 3, its conversation's first request, sent
/// through a proxy whose window it fills about three quarters of, in front of
/// an upstream with llama.cpp's tokenizer endpoints: the request is counted
/// by that tokenizer. llama.cpp refuses a whole `/apply-template` call on
/// one tool that is not chat-shaped, and Codex's (Responses) and Claude
/// Code's (Messages) tool lists were sent as they are, so their requests
/// were never counted.
#[tokio::test]
async fn every_agents_first_request_is_counted_by_the_upstream_tokenizer() {
    let mut failures = Vec::new();
    for agent in AGENTS {
        let f = Fixture::load(agent, TURNS);
        let api = f.api();
        let (url, counted): (String, Box<dyn Fn() -> usize>) = match api {
            Api::Chat => {
                let m = ChatMock::start(Settings {
                    tokenizer: true,
                    ..Settings::default()
                })
                .await;
                let url = m.url();
                let n = move || m.seen().iter().filter(|s| s.path == "/tokenize").count();
                (url, Box::new(n))
            }
            _ => {
                let m = ApiMock::start(ApiSettings {
                    tokenizer: true,
                    ..ApiSettings::default()
                })
                .await;
                let url = m.url();
                let n = move || m.seen().iter().filter(|s| s.path == "/tokenize").count();
                (url, Box::new(n))
            }
        };
        let window = (f.body.len() / 3) as u64;
        let proxy = start_proxy(&url, &model_config(window)).await;
        let (status, _, resp) = post_path(
            &proxy.url(),
            &f.path,
            f.body.clone().into_bytes(),
            &f.header_pairs(),
        )
        .await;
        if status != 200 {
            failures.push(format!(
                "{agent}: HTTP {status}: {}",
                String::from_utf8_lossy(&resp)
            ));
        } else if counted() == 0 {
            failures.push(format!("{agent}: never counted by the tokenizer"));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
