//! A request's tools in chat-completions shape, for counting its tokens
//! with an upstream tokenizer that speaks chat completions (llama.cpp's
//! `/apply-template`, vLLM's `/tokenize`): both refuse the whole count on
//! a Responses-shaped tool (`{"type":"function","name":…}`, "Missing tool
//! function") or an Anthropic one (`{"name":…,"input_schema":…}`), so
//! Codex's and Claude Code's requests were never counted and their
//! estimate near the window's edge stood on chars/4 alone.
//!
//! Only what a template renders matters here: name, description and
//! parameters. Built-in tools with no schema (`web_search`, Anthropic's
//! versioned server tools) become functions with empty parameters when
//! they have a name, and are left out when they have none; a Responses
//! `namespace` contributes the tools inside it.

use serde_json::value::RawValue;
use serde_json::{json, Map, Value};

use super::Api;

/// `tools` of an `api` request in chat-completions shape; `None` when the
/// member is absent or not a list.
pub(super) fn chat_tools(api: Api, raw: &RawValue) -> Option<Box<RawValue>> {
    let Ok(Value::Array(tools)) = serde_json::from_str::<Value>(raw.get()) else {
        return None;
    };
    let mut out = Vec::with_capacity(tools.len());
    for t in tools {
        push_tool(api, t, &mut out);
    }
    serde_json::value::to_raw_value(&out).ok()
}

fn push_tool(api: Api, tool: Value, out: &mut Vec<Value>) {
    let Value::Object(mut o) = tool else {
        return;
    };
    // Already chat-shaped (a client mixing shapes, or chat itself).
    if o.get("function").is_some_and(Value::is_object) {
        o.insert("type".to_owned(), Value::String("function".to_owned()));
        out.push(Value::Object(o));
        return;
    }
    if let Some(Value::Array(inner)) = o.remove("tools") {
        for t in inner {
            push_tool(api, t, out);
        }
        return;
    }
    let Some(Value::String(name)) = o.remove("name") else {
        return;
    };
    let schema_key = match api {
        Api::Messages => "input_schema",
        Api::Chat | Api::Responses | Api::Ollama => "parameters",
    };
    let parameters = match o.remove(schema_key) {
        Some(p @ Value::Object(_)) => p,
        _ => json!({"type": "object", "properties": {}}),
    };
    let mut function = Map::new();
    function.insert("name".to_owned(), Value::String(name));
    if let Some(d @ Value::String(_)) = o.remove("description") {
        function.insert("description".to_owned(), d);
    }
    function.insert("parameters".to_owned(), parameters);
    out.push(json!({"type": "function", "function": function}));
}

#[cfg(test)]
mod tests {
    use super::*;

    fn convert(api: Api, tools: Value) -> Value {
        let raw = serde_json::value::to_raw_value(&tools).unwrap();
        serde_json::from_str(chat_tools(api, &raw).unwrap().get()).unwrap()
    }

    #[test]
    fn responses_functions_namespaces_and_builtins() {
        let got = convert(
            Api::Responses,
            json!([
                {"type": "function", "name": "exec", "description": "Runs", "strict": false,
                 "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}}},
                {"type": "namespace", "name": "agents", "tools": [
                    {"type": "function", "name": "spawn", "parameters": {"type": "object"}}]},
                {"type": "web_search", "external_web_access": false},
                {"type": "custom", "name": "apply_patch", "description": "Patch", "format": {}}
            ]),
        );
        assert_eq!(
            got,
            json!([
                {"type": "function", "function": {"name": "exec", "description": "Runs",
                 "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}}}},
                {"type": "function", "function": {"name": "spawn", "parameters": {"type": "object"}}},
                {"type": "function", "function": {"name": "apply_patch", "description": "Patch",
                 "parameters": {"type": "object", "properties": {}}}}
            ])
        );
    }

    #[test]
    fn anthropic_tools_and_server_tools() {
        let got = convert(
            Api::Messages,
            json!([
                {"name": "Read", "description": "Reads a file",
                 "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}},
                 "cache_control": {"type": "ephemeral"}},
                {"type": "web_search_20250305", "name": "web_search", "max_uses": 5}
            ]),
        );
        assert_eq!(
            got,
            json!([
                {"type": "function", "function": {"name": "Read", "description": "Reads a file",
                 "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}},
                {"type": "function", "function": {"name": "web_search",
                 "parameters": {"type": "object", "properties": {}}}}
            ])
        );
    }

    #[test]
    fn chat_shaped_tools_stay_and_non_lists_are_none() {
        let chat = json!([{"type": "function", "function": {"name": "f", "parameters": {}}}]);
        assert_eq!(convert(Api::Responses, chat.clone()), chat);
        let raw = serde_json::value::to_raw_value(&json!({"a": 1})).unwrap();
        assert!(chat_tools(Api::Responses, &raw).is_none());
    }
}
