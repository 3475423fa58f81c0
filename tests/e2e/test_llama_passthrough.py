"""Through compactor vs direct against the real llama.cpp server.

Greedy decoding (temperature 0, fixed seed) makes llama.cpp's answer a
function of the prompt, so a transparent proxy must yield the same text.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

MESSAGES = [
    {"role": "system", "content": "You are a concise assistant."},
    {"role": "user", "content": "Name three colours of the rainbow."},
]
# cache_prompt off: a prompt served from llama.cpp's cache can yield slightly
# different logits than one evaluated in full, which could flip a greedy token.
PARAMS = {"temperature": 0, "seed": 42, "max_tokens": 24, "extra_body": {"cache_prompt": False}}


def model_id(client) -> str:
    return client.models.list().data[0].id


def test_non_streaming_same_completion(llama_log, llama_direct, llama_via_compactor):
    proxied = llama_via_compactor.client()
    model = model_id(llama_direct)
    a = llama_direct.chat.completions.create(model=model, messages=MESSAGES, **PARAMS)
    b = proxied.chat.completions.create(model=model, messages=MESSAGES, **PARAMS)
    assert a.choices[0].message.content, "llama.cpp produced no text"
    assert b.choices[0].message.content == a.choices[0].message.content
    assert b.choices[0].finish_reason == a.choices[0].finish_reason
    assert b.usage.prompt_tokens == a.usage.prompt_tokens
    assert b.usage.completion_tokens == a.usage.completion_tokens


def test_non_streaming_keeps_llamacpp_extras(llama_log, llama_direct, llama_via_compactor):
    """llama.cpp's own `timings` must survive the trip (compactor reads it, clients may too)."""
    raw = llama_via_compactor.client().chat.completions.with_raw_response.create(
        model=model_id(llama_direct), messages=MESSAGES, **PARAMS
    )
    body = json.loads(raw.content)
    assert set(body["timings"]) >= {"prompt_n", "cache_n", "predicted_n"}
    assert body["usage"]["prompt_tokens"] == body["timings"]["prompt_n"] + body["timings"]["cache_n"]


def _stream(client, model: str, **kw):
    chunks = list(client.chat.completions.create(model=model, messages=MESSAGES, stream=True, **PARAMS, **kw))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return chunks, text


@pytest.mark.parametrize("include_usage", [False, True])
def test_streaming_same_completion(llama_log, llama_direct, llama_via_compactor, include_usage):
    proxied = llama_via_compactor.client()
    model = model_id(llama_direct)
    kw = {"stream_options": {"include_usage": True}} if include_usage else {}
    a_chunks, a_text = _stream(llama_direct, model, **kw)
    b_chunks, b_text = _stream(proxied, model, **kw)
    assert a_text, "llama.cpp streamed no text"
    assert b_text == a_text
    content_chunks = [c for c in b_chunks if c.choices and c.choices[0].delta.content]
    assert len(content_chunks) >= 3, "the stream did not arrive as several events"
    finish = [c.choices[0].finish_reason for c in b_chunks if c.choices and c.choices[0].finish_reason]
    assert finish == [c.choices[0].finish_reason for c in a_chunks if c.choices and c.choices[0].finish_reason]
    # The usage chunk appears exactly when the client asked for it, with or without compactor.
    usage_chunks = [c for c in b_chunks if not c.choices]
    assert len(usage_chunks) == len([c for c in a_chunks if not c.choices]) == (1 if include_usage else 0)
    if include_usage:
        assert usage_chunks[0].usage.prompt_tokens == a_chunks[-1].usage.prompt_tokens
    # llama.cpp puts `timings` on the last chunk; it must survive the proxy.
    assert "timings" in (b_chunks[-1].model_extra or {})


def test_stream_arrives_in_several_network_reads(llama_log, llama_direct, llama_via_compactor):
    """Generation is slow enough that a proxy forwarding frame by frame delivers
    the body in several reads; a buffering proxy delivers it in one."""
    with llama_via_compactor.client().chat.completions.with_streaming_response.create(
        model=model_id(llama_direct), messages=MESSAGES, stream=True, **PARAMS
    ) as r:
        reads = [b for b in r.iter_bytes() if b]
    body = b"".join(reads)
    assert body.rstrip().endswith(b"data: [DONE]")
    assert len(reads) >= 3, f"whole stream arrived in {len(reads)} read(s)"


@pytest.mark.parametrize("stream", [False, True])
def test_one_upstream_request_per_small_request(llama_log, llama_tap, compactor, stream):
    """A request far below the window reaches llama.cpp once, with the client's
    messages, and the upstream's prompt size matches what the client is told."""
    via = compactor(llama_tap.url)
    kw = {"stream": True, "stream_options": {"include_usage": True}} if stream else {}
    out = via.client().chat.completions.create(model="gemma-3-270m", messages=MESSAGES, **PARAMS, **kw)
    usage = [c.usage for c in out if c.usage][-1] if stream else out.usage
    (ex,) = llama_tap.chat()
    assert ex.status == 200
    assert ex.messages == len(MESSAGES)
    assert ex.stream is stream
    assert ex.prompt_tokens == usage.prompt_tokens


def _raw(base: str, method: str, path: str, body: bytes | None = None) -> tuple[int, bytes]:
    req = urllib.request.Request(base + path, data=body, method=method,
                                 headers={"Content-Type": "application/json"} if body else {})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


@pytest.mark.parametrize(
    "method, path, body",
    [
        ("GET", "/props", None),
        ("GET", "/health", None),
        ("POST", "/tokenize", b'{"content":"Hello compactor","with_pieces":true}'),
        ("POST", "/apply-template", json.dumps({"messages": MESSAGES}).encode()),
        # Not JSON: compactor forwards the bytes and llama.cpp answers for itself.
        ("POST", "/v1/chat/completions", b'{"messages": [not json'),
    ],
    ids=["props", "health", "tokenize", "apply-template", "chat-not-json"],
)
def test_llamacpp_endpoints_identical(llama_log, llama_via_compactor, method, path, body):
    direct = _raw(llama_log.url, method, path, body)
    proxied = _raw(llama_via_compactor.url, method, path, body)
    assert proxied == direct
    if path == "/v1/chat/completions":
        assert direct[0] == 400 and b"parse error" in direct[1]
    else:
        assert direct[0] == 200
