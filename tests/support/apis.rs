//! A scripted upstream for the other two conversation APIs on
//! `127.0.0.1:0`: Anthropic `POST /v1/messages` (and `count_tokens`) and
//! OpenAI `POST /v1/responses`, JSON or SSE in each API's own shapes.
//!
//! The prompt size it reports is the bytes of the conversation JSON
//! (`system` + `messages`, or `instructions` + `input`) / 4; for Anthropic
//! it is split into `input_tokens`, `cache_read_input_tokens` (a third) and
//! `cache_creation_input_tokens` (a sixth), so only their sum is the prompt.
//! Summary calls (one user message starting with the summariser preamble)
//! get the scripted summary. An optional window is enforced with the API's
//! overflow error: Anthropic's `prompt is too long: N tokens > M maximum`
//! (HTTP 400), and for Responses either HTTP 400 `context_length_exceeded`
//! or, streaming, a `response.failed` event after `response.created`.

#![allow(clippy::unwrap_used, clippy::expect_used)]
#![allow(dead_code)]

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use http::{HeaderMap, Request, Response, StatusCode};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use serde_json::{json, Value};
use tokio::net::TcpListener;

use super::chat::{default_summary, MICRO_PROMPT_START, SUMMARY_PROMPT_START};

type MockBody = UnsyncBoxBody<Bytes, Infallible>;

/// What the mock does; changeable while it runs.
#[derive(Debug, Clone)]
pub struct ApiSettings {
    /// Enforced context window (prompt >= window → overflow error).
    pub window: Option<u64>,
    /// Responses streams: overflow as a `response.failed` event.
    pub failed_event: bool,
    /// Summary text.
    pub summary: String,
    /// Serve llama.cpp's `/apply-template` and `/tokenize`, refusing tools
    /// that are not chat-shaped as llama.cpp does ("Missing tool function").
    pub tokenizer: bool,
}

impl Default for ApiSettings {
    fn default() -> Self {
        Self {
            window: None,
            failed_event: false,
            summary: default_summary(),
            tokenizer: false,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ApiKind {
    Conversation,
    Summary,
    Other,
}

/// One recorded request.
#[derive(Debug, Clone)]
pub struct ApiSeen {
    pub path: String,
    /// The query string, if any (Claude Code sends `?beta=true`).
    pub query: Option<String>,
    pub headers: HeaderMap,
    pub body: Bytes,
    pub kind: ApiKind,
    pub prompt_tokens: u64,
    pub overflowed: bool,
}

impl ApiSeen {
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap()
    }
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
}

struct Shared {
    settings: Mutex<ApiSettings>,
    seen: Mutex<Vec<ApiSeen>>,
}

/// A running mock.
pub struct ApiMock {
    pub addr: SocketAddr,
    shared: Arc<Shared>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for ApiMock {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl ApiMock {
    pub async fn start(settings: ApiSettings) -> ApiMock {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let shared = Arc::new(Shared {
            settings: Mutex::new(settings),
            seen: Mutex::default(),
        });
        let task = super::serve_mock(listener, Arc::clone(&shared), serve);
        ApiMock { addr, shared, task }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn update(&self, f: impl FnOnce(&mut ApiSettings)) {
        f(&mut self.shared.settings.lock().unwrap());
    }

    pub fn seen(&self) -> Vec<ApiSeen> {
        self.shared.seen.lock().unwrap().clone()
    }

    /// Conversation requests (not summary calls).
    pub fn conversations(&self) -> Vec<ApiSeen> {
        self.seen()
            .into_iter()
            .filter(|s| s.kind == ApiKind::Conversation)
            .collect()
    }

    pub fn summaries(&self) -> Vec<ApiSeen> {
        self.seen()
            .into_iter()
            .filter(|s| s.kind == ApiKind::Summary)
            .collect()
    }

    pub fn last(&self) -> ApiSeen {
        self.conversations().pop().expect("no conversation request")
    }
}

/// llama.cpp's tokenizer endpoints: the "template" is the messages' JSON,
/// counted at 4 bytes a token; a tool without a `function` object fails the
/// whole call, as `common_chat_tools_parse_oaicompat` does.
fn tokenizer_reply(path: &str, v: &Value) -> Response<MockBody> {
    if path == "/tokenize" {
        let n = v["content"].as_str().map_or(0, str::len) / 4;
        return reply(
            200,
            "application/json",
            json!({ "tokens": vec![0; n] }).to_string(),
        );
    }
    let tools = v["tools"].as_array().map_or(&[][..], Vec::as_slice);
    if let Some(bad) = tools.iter().find(|t| !t["function"].is_object()) {
        let e = json!({"error":{"code":500,"message":format!("Failed to parse tools: Missing tool function: {bad}")}});
        return reply(500, "application/json", e.to_string());
    }
    let prompt = serde_json::to_string(&v["messages"]).unwrap_or_default();
    reply(
        200,
        "application/json",
        json!({ "prompt": prompt }).to_string(),
    )
}

fn json_len(v: Option<&Value>) -> usize {
    v.map_or(0, |v| serde_json::to_string(v).unwrap().len())
}

fn summary_prompt(list: Option<&Value>) -> bool {
    let Some(items) = list.and_then(Value::as_array) else {
        return false;
    };
    items.len() == 1
        && items[0]["role"] == "user"
        && items[0]["content"].as_str().is_some_and(|c| {
            c.starts_with(SUMMARY_PROMPT_START) || c.starts_with(MICRO_PROMPT_START)
        })
}

// One match over every scripted path of the mock, like the chat mock's.
#[allow(clippy::too_many_lines)]
async fn serve(
    shared: Arc<Shared>,
    req: Request<Incoming>,
) -> Result<Response<MockBody>, Infallible> {
    let (parts, body) = req.into_parts();
    let body = body
        .collect()
        .await
        .map(|c| c.to_bytes())
        .unwrap_or_default();
    let path = parts.uri.path().to_owned();
    let settings = shared.settings.lock().unwrap().clone();
    let record = |kind, prompt_tokens, overflowed| {
        shared.seen.lock().unwrap().push(ApiSeen {
            path: path.clone(),
            query: parts.uri.query().map(str::to_owned),
            headers: parts.headers.clone(),
            body: body.clone(),
            kind,
            prompt_tokens,
            overflowed,
        });
    };
    let Ok(v) = serde_json::from_slice::<Value>(&body) else {
        record(ApiKind::Other, 0, false);
        return Ok(reply(
            400,
            "application/json",
            "{\"error\":\"bad json\"}".into(),
        ));
    };
    if settings.tokenizer && (path == "/apply-template" || path == "/tokenize") {
        record(ApiKind::Other, 0, false);
        return Ok(tokenizer_reply(&path, &v));
    }
    let anthropic = path.starts_with("/v1/messages");
    let (system, list) = if anthropic {
        (v.get("system"), v.get("messages"))
    } else {
        (v.get("instructions"), v.get("input"))
    };
    let prompt = ((json_len(system) + json_len(list)) / 4) as u64;
    if path == "/v1/messages/count_tokens" {
        record(ApiKind::Other, prompt, false);
        return Ok(reply(
            200,
            "application/json",
            format!("{{\"input_tokens\":{prompt}}}"),
        ));
    }
    if path != "/v1/messages" && path != "/v1/responses" {
        record(ApiKind::Other, 0, false);
        return Ok(reply(
            404,
            "application/json",
            "{\"error\":\"not found\"}".into(),
        ));
    }
    let stream = v["stream"].as_bool().unwrap_or(false);
    if summary_prompt(list) {
        record(ApiKind::Summary, prompt, false);
        let body = if anthropic {
            json!({"id":"msg_sum","type":"message","role":"assistant","model":v["model"],
                "content":[{"type":"text","text":settings.summary}],"stop_reason":"end_turn",
                "usage":{"input_tokens":prompt,"output_tokens":50}})
        } else {
            json!({"id":"resp_sum","object":"response","status":"completed","model":v["model"],
                "output":[{"type":"message","role":"assistant","content":[{"type":"output_text","text":settings.summary}]}],
                "usage":{"input_tokens":prompt,"output_tokens":50}})
        };
        return Ok(reply(200, "application/json", body.to_string()));
    }
    if let Some(n) = settings.window.filter(|n| prompt >= *n) {
        record(ApiKind::Conversation, prompt, true);
        if anthropic {
            let e = json!({"type":"error","error":{"type":"invalid_request_error",
                "message":format!("prompt is too long: {prompt} tokens > {n} maximum")}});
            return Ok(reply(400, "application/json", e.to_string()));
        }
        let err = json!({"type":"invalid_request_error","code":"context_length_exceeded",
            "message":"Your input exceeds the context window of this model. Please adjust your input and try again.","param":"input"});
        if stream && settings.failed_event {
            let created = json!({"type":"response.created","response":{"id":"resp_1","status":"in_progress"}});
            let failed = json!({"type":"response.failed","response":{"id":"resp_1","status":"failed","error":err}});
            let sse = format!("event: response.created\ndata: {created}\n\nevent: response.failed\ndata: {failed}\n\n");
            return Ok(reply(200, "text/event-stream", sse));
        }
        return Ok(reply(
            400,
            "application/json",
            json!({"error": err}).to_string(),
        ));
    }
    record(ApiKind::Conversation, prompt, false);
    let text = if anthropic {
        anthropic_answer(prompt, stream)
    } else {
        responses_answer(prompt, stream)
    };
    let ct = if stream {
        "text/event-stream"
    } else {
        "application/json"
    };
    Ok(reply(200, ct, text))
}

/// Anthropic's split of a prompt: (input, cache creation, cache read).
pub fn anthropic_split(prompt: u64) -> (u64, u64, u64) {
    let read = prompt / 3;
    let creation = prompt / 6;
    (prompt - read - creation, creation, read)
}

fn anthropic_answer(prompt: u64, stream: bool) -> String {
    let (input, creation, read) = anthropic_split(prompt);
    let usage = json!({"input_tokens":input,"cache_creation_input_tokens":creation,
        "cache_read_input_tokens":read,"output_tokens":3});
    if !stream {
        return json!({"id":"msg_1","type":"message","role":"assistant","model":"m",
            "content":[{"type":"text","text":"Hello there"}],"stop_reason":"end_turn",
            "stop_sequence":null,"usage":usage})
        .to_string();
    }
    let mut start_usage = usage.clone();
    start_usage["output_tokens"] = json!(1);
    let events = [
        (
            "message_start",
            json!({"type":"message_start","message":{"id":"msg_1","type":"message",
            "role":"assistant","model":"m","content":[],"stop_reason":null,"usage":start_usage}}),
        ),
        (
            "content_block_start",
            json!({"type":"content_block_start","index":0,"content_block":{"type":"text","text":""}}),
        ),
        ("ping", json!({"type":"ping"})),
        (
            "content_block_delta",
            json!({"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"Hello"}}),
        ),
        (
            "content_block_delta",
            json!({"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":" there"}}),
        ),
        (
            "content_block_stop",
            json!({"type":"content_block_stop","index":0}),
        ),
        (
            "message_delta",
            json!({"type":"message_delta","delta":{"stop_reason":"end_turn"},"usage":{"output_tokens":3}}),
        ),
        ("message_stop", json!({"type":"message_stop"})),
    ];
    events
        .iter()
        .map(|(e, d)| format!("event: {e}\ndata: {d}\n\n"))
        .collect()
}

fn responses_answer(prompt: u64, stream: bool) -> String {
    let usage = json!({"input_tokens":prompt,"output_tokens":3,"total_tokens":prompt + 3,
        "input_tokens_details":{"cached_tokens":prompt / 2}});
    let output = json!([{"type":"message","id":"msg_1","status":"completed","role":"assistant",
        "content":[{"type":"output_text","text":"Hello there","annotations":[]}]}]);
    if !stream {
        return json!({"id":"resp_1","object":"response","status":"completed","model":"m",
            "output":output,"usage":usage})
        .to_string();
    }
    let events = [
        (
            "response.created",
            json!({"type":"response.created","response":{"id":"resp_1","status":"in_progress"}}),
        ),
        (
            "response.in_progress",
            json!({"type":"response.in_progress","response":{"id":"resp_1","status":"in_progress"}}),
        ),
        (
            "response.output_item.added",
            json!({"type":"response.output_item.added","item":{"type":"message","id":"msg_1","role":"assistant","content":[]}}),
        ),
        (
            "response.output_text.delta",
            json!({"type":"response.output_text.delta","item_id":"msg_1","delta":"Hello"}),
        ),
        (
            "response.output_text.delta",
            json!({"type":"response.output_text.delta","item_id":"msg_1","delta":" there"}),
        ),
        (
            "response.completed",
            json!({"type":"response.completed","response":{"id":"resp_1","status":"completed","output":output,"usage":usage}}),
        ),
    ];
    events
        .iter()
        .map(|(e, d)| format!("event: {e}\ndata: {d}\n\n"))
        .collect()
}

fn reply(status: u16, ct: &str, body: String) -> Response<MockBody> {
    let mut resp = Response::new(Full::new(Bytes::from(body)).boxed_unsync());
    *resp.status_mut() = StatusCode::from_u16(status).unwrap();
    resp.headers_mut()
        .insert("content-type", ct.parse().unwrap());
    resp
}
