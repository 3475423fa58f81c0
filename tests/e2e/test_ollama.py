"""compactor in front of Ollama (issue 48), against ``ollama_upstream.py``.

Ollama answers a prompt longer than the window it loaded the model with as
usual, 200, after dropping messages (then tokens) from the front; the only
trace is ``prompt_eval_count``. The upstream here does exactly that, so what
compactor promises can be checked with the real clients: the ``ollama``
Python package (PyPI, pinned in requirements-e2e.txt) and the ``ollama``
JavaScript package (npm, pinned in tests/e2e/agents, driven by
``agents/ollama_chat.mjs``).

The mock itself first (no compactor): the clients parse its answers, its
truncation is Ollama's. Then through compactor:

* ``/api/chat`` replies reach the client unchanged (parsed objects, NDJSON
  bytes, the request forwarded as sent), with ``x-compactor-action`` and
  ``x-compactor-session``;
* the window is learned from ``/api/ps`` after the first answer (4096, not
  the 131072 ``/api/show`` advertises), or is the request's
  ``options.num_ctx``;
* a 30-turn conversation at num_ctx 4096 (both clients, streamed and not,
  with tool calls): nothing truncated upstream (summary calls included), the
  system prompt and the tools verbatim in every request, no tool result
  without its call, at least one compaction, one session;
* a truncation that does happen (the window unknown, the default too big)
  is counted once (``compactor_truncations_total``, the session's
  ``truncations``, one WARN line) and the next request is compacted and not
  truncated;
* the other routes pass through byte for byte, ``/api/pull``'s progress
  lines as they come; a body compactor cannot parse gets the upstream's
  own answer.
"""

from __future__ import annotations

import http.client
import json
import re
import shutil
import subprocess
import time
import urllib.parse
from typing import Any

import ollama
import pytest

from conftest import HERE, Compactor, openai_client
from ollama_costs import SYSTEM, TOOLS, Sent, fact, orphan_tool_results, play, scenario, tool_result
from ollama_upstream import (
    DEFAULT_NUM_CTX, MAX_CONTEXT, MODEL, REPLY, SUMMARY_PREFIXES, OllamaUpstream, fit, start_ollama_upstream,
)

ADMIN_TOKEN = "ollama-e2e-admin"
AGENTS = HERE / "agents"
JS_DRIVER = AGENTS / "ollama_chat.mjs"
WORD = "cobalt"
FACT = fact(WORD)
HEALTHY = [{"role": "system", "content": SYSTEM},
           {"role": "user", "content": "Here is the deploy log of run 1:\nall steps ok\n\nIs this run healthy?"}]
WEATHER = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is the weather in Oslo?"}]


@pytest.fixture
def up():
    u = start_ollama_upstream()
    try:
        yield u
    finally:
        u.close()


# ---------------------------------------------------------------- helpers

def raw(base: str, method: str, path: str, body: bytes | None = None,
        headers: dict[str, str] | None = None, timeout: float = 60.0) -> tuple[int, dict[str, str], bytes, list[tuple[float, bytes]]]:
    """One request with http.client: status, headers (lower-cased), body, and the body's lines
    with the time each arrived (seconds after the response head)."""
    u = urllib.parse.urlsplit(base)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
    try:
        conn.request(method, path, body=body, headers={"Content-Type": "application/json", **(headers or {})})
        resp = conn.getresponse()
        t0 = time.monotonic()
        lines: list[tuple[float, bytes]] = []
        data = b""
        if method != "HEAD":
            while line := resp.readline():
                lines.append((time.monotonic() - t0, line))
                data += line
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, data, lines
    finally:
        conn.close()


def post_json(base: str, path: str, obj: Any, **kw):
    return raw(base, "POST", path, json.dumps(obj).encode(), **kw)


def admin_session(c: Compactor, key: str) -> dict:
    status, _, body, _ = raw(c.url, "GET", f"/_compactor/sessions/{urllib.parse.quote(key, safe='')}",
                             headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
    assert status == 200, f"admin API: {status} {body[:300]!r}"
    return json.loads(body)


def metric(c: Compactor, name: str) -> float:
    """The sum of a Prometheus series over its labels (0 when absent)."""
    status, _, body, _ = raw(c.url, "GET", "/_compactor/metrics")
    assert status == 200
    total = 0.0
    for line in body.decode().splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


def truncation_warnings(c: Compactor, key: str) -> list[str]:
    """The conversation's WARN lines about a prompt the upstream cut silently."""
    return [l for l in c.log_path.read_text(errors="replace").splitlines()
            if "WARN" in l and key in l and re.search(r"truncat|cut a prompt|silently", l, re.IGNORECASE)]


def with_compactor(compactor, upstream: OllamaUpstream, **env: str) -> Compactor:
    return compactor(upstream.url, env={"COMPACTOR_ADMIN_TOKEN": ADMIN_TOKEN, **env})


def js_missing() -> str | None:
    if shutil.which("node") is None:
        return "node not found"
    if not (AGENTS / "node_modules" / "ollama" / "package.json").is_file():
        return "the npm package ollama is not installed: run scripts/setup_e2e.sh (npm ci in tests/e2e/agents)"
    return None


def run_js(host: str, turns: list[str], stream: bool, system: str | None = SYSTEM, tools: Any = TOOLS,
           options: dict | None = None, timeout: float = 600.0) -> list[dict]:
    """The conversation through the real ollama JavaScript client; one dict per request."""
    if why := js_missing():
        pytest.fail(why)
    spec = {"host": host, "model": "llama3.2", "system": system, "tools": tools, "turns": turns, "stream": stream}
    if options:
        spec["options"] = options
    p = subprocess.run(["node", str(JS_DRIVER)], input=json.dumps(spec), capture_output=True, text=True,
                       cwd=AGENTS, timeout=timeout)
    out = [json.loads(l) for l in p.stdout.splitlines() if l.strip()]
    assert p.returncode == 0, f"node exited {p.returncode}: {p.stderr[-3000:]}\nlast: {out[-1:]}"
    return out


def sent_from_js(rows: list[dict]) -> list[Sent]:
    return [Sent(r["turn"], r["action"], r["session"], r["status"], r["content"], r["tool_calls"],
                 r["prompt_eval_count"], len(r["chunks"] or [1])) for r in rows]


# ================================================================ the mock itself

def test_mock_python_client_parses_replies(up):
    client = ollama.Client(host=up.url)
    assert client.ps().models == [], "nothing is loaded before the first chat request"
    r = client.chat(model="llama3.2", messages=HEALTHY)
    assert r.message.role == "assistant" and r.message.content == REPLY
    assert r.done and r.done_reason == "stop" and r.prompt_eval_count == up.turns()[-1].kept > 0
    assert r.eval_count and r.total_duration and r.prompt_eval_duration and r.eval_duration
    loaded = client.ps().models
    assert [(m.model, m.context_length) for m in loaded] == [(MODEL, DEFAULT_NUM_CTX)]
    # Streamed: several content chunks, then the final object with the counts.
    parts = list(client.chat(model="llama3.2:latest", messages=HEALTHY, stream=True))
    assert len(parts) > 2 and not any(p.done for p in parts[:-1]) and parts[-1].done
    assert "".join(p.message.content for p in parts) == REPLY
    assert parts[-1].prompt_eval_count == r.prompt_eval_count
    # Tool calls: arguments an object; the tool's result sent back as role "tool" with tool_name.
    for stream in (False, True):
        got = client.chat(model="llama3.2", messages=WEATHER, tools=TOOLS, stream=stream)
        calls = [tc for p in (got if stream else [got]) for tc in (p.message.tool_calls or [])]
        assert [(c.function.name, dict(c.function.arguments)) for c in calls] == [("get_weather", {"city": "Oslo"})]
    follow = WEATHER + [{"role": "assistant", "content": "", "tool_calls": [c.model_dump() for c in calls]},
                        {"role": "tool", "content": tool_result("get_weather", {"city": "Oslo"}),
                         "tool_name": "get_weather"}]
    r = client.chat(model="llama3.2", messages=follow, tools=TOOLS)
    assert r.message.content.startswith("The get_weather tool says:") and not r.message.tool_calls
    # The wire: NDJSON by default, newer Ollama's tool-call id and index.
    status, headers, body, lines = post_json(up.url, "/api/chat", {"model": "llama3.2", "messages": WEATHER,
                                                                   "tools": TOOLS})
    assert status == 200 and headers["content-type"] == "application/x-ndjson"
    objs = [json.loads(l) for _, l in lines]
    call = objs[0]["message"]["tool_calls"][0]
    assert call["id"].startswith("call_") and call["function"]["index"] == 0
    assert objs[-1]["done"] is True and objs[-1]["prompt_eval_count"] > 0
    # Errors in Ollama's shape.
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model="nope", messages=HEALTHY)
    assert e.value.status_code == 404 and e.value.error == 'model "nope" not found, try pulling it first'
    status, _, body, _ = raw(up.url, "POST", "/api/chat", b'{"model":')
    assert (status, json.loads(body)) == (400, {"error": "unexpected EOF"})


def test_mock_window_loads_and_reloads(up):
    client = ollama.Client(host=up.url)
    client.chat(model="llama3.2", messages=HEALTHY, options={"num_ctx": 8192})
    assert up.window() == 8192 and client.ps().models[0].context_length == 8192
    # An automatic num_ctx after an explicit one reloads at the default (Ollama's needsReload).
    client.chat(model="llama3.2", messages=HEALTHY)
    assert up.window() == DEFAULT_NUM_CTX
    client.chat(model="llama3.2", messages=HEALTHY, options={"num_ctx": 2048})
    assert up.window() == 2048
    # /v1 ignores options.num_ctx and runs at the default.
    status, _, _, _ = post_json(up.url, "/v1/chat/completions", {"model": "llama3.2", "messages": HEALTHY,
                                                                 "options": {"num_ctx": 16384}})
    assert status == 200 and up.window() == DEFAULT_NUM_CTX and up.turns()[-1].num_ctx == DEFAULT_NUM_CTX
    # /api/show advertises the model's maximum, which is not the window.
    assert client.show("llama3.2").modelinfo["llama.context_length"] == MAX_CONTEXT


def _msgs(n: int, chars: int = 2000) -> list[dict]:
    return [{"role": "user" if i % 2 == 0 else "assistant", "content": f"m{i} " + "x" * chars} for i in range(n)]


def test_mock_truncates_like_ollama():
    sys_msg = {"role": "system", "content": "SYSTEM-PROMPT " * 20}
    # Fits: nothing dropped.
    f = fit([sys_msg] + _msgs(3), TOOLS, 4096)
    assert not f.truncated and f.kept == f.tokens
    # Over: whole messages from the front, the system message and the last message kept.
    msgs = [sys_msg] + _msgs(12)
    f = fit(msgs, TOOLS, 4096)
    assert f.truncated and not f.token_cut and f.dropped_messages > 0
    assert f.kept <= 4096 < f.tokens
    assert sys_msg["content"] in f.kept_prompt and msgs[-1]["content"] in f.kept_prompt
    assert msgs[1]["content"] not in f.kept_prompt
    # Exactly the fewest messages dropped: one more kept would not fit.
    d = f.dropped_messages
    assert fit([sys_msg] + msgs[1 + d:], TOOLS, 4096).kept == f.kept
    assert fit([sys_msg] + msgs[d:], TOOLS, 4096).truncated
    # A tool result is kept while the call it answers is dropped: Ollama drops message by message.
    call = {"role": "assistant", "content": "c" * 2800, "tool_calls": [{"function": {"name": "get_weather",
                                                                            "arguments": {"city": "Oslo"}}}]}
    result = {"role": "tool", "content": "r" * 200, "tool_name": "get_weather"}
    group = [sys_msg, {"role": "user", "content": "u" * 8000}, call, result, {"role": "user", "content": "q" * 13400}]
    f = fit(group, None, 4096)
    assert f.dropped_messages == 2 and "r" * 200 in f.kept_prompt and "Oslo" not in f.kept_prompt
    # Still over with the last message alone: the runner keeps num_keep + 1 tokens and the tail,
    # num_ctx - (num_ctx - 5) // 2 = 2051 tokens at 4096 (what users measure), system and tools lost.
    f = fit([sys_msg, {"role": "user", "content": "y" * 30000}], TOOLS, 4096)
    assert f.token_cut and f.kept == 2051
    assert "SYSTEM-PROMPT" not in f.kept_prompt and "get_weather" not in f.kept_prompt
    assert fit([{"role": "user", "content": "z" * 4096 * 4}], None, 4096).kept == 2051  # exactly num_ctx: cut too
    assert not fit([{"role": "user", "content": "z" * (4095 * 4 - 10)}], None, 4096).truncated
    # Images count a fixed 768 tokens each.
    img = fit([{"role": "user", "content": "see", "images": ["aGk="]}], None, 4096)
    assert img.tokens == (len("<|user|>\n[img-0]see\n") + 3) // 4 + 768


def test_mock_truncation_on_the_wire(up):
    client = ollama.Client(host=up.url)
    msgs = [{"role": "system", "content": SYSTEM}] + _msgs(12)
    r = client.chat(model="llama3.2", messages=msgs, tools=TOOLS)
    rec = up.turns()[-1]
    assert rec.truncated and r.prompt_eval_count == rec.kept < rec.tokens and rec.has_system and rec.has_tools
    # The token cut: system prompt and tools gone, 200 all the same.
    big = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "FACT: early\n" + "y" * 30000}]
    parts = list(client.chat(model="llama3.2", messages=big, tools=TOOLS, stream=True))
    rec = up.turns()[-1]
    assert parts[-1].prompt_eval_count == 2051 and rec.token_cut
    assert not rec.has_system and not rec.has_tools and not rec.kept_contains("FACT: early")
    # /v1/chat/completions: usage.prompt_tokens is the kept count; the usage chunk when asked.
    oa = openai_client(up.url)
    c = oa.chat.completions.create(model="llama3.2", messages=msgs)
    assert c.usage.prompt_tokens == up.turns()[-1].kept < up.turns()[-1].tokens
    chunks = list(oa.chat.completions.create(model="llama3.2", messages=msgs, stream=True,
                                             stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.prompt_tokens == c.usage.prompt_tokens
    assert all(ch.usage is None for ch in oa.chat.completions.create(model="llama3.2", messages=msgs, stream=True))
    # /api/generate too.
    g = client.generate(model="llama3.2", prompt="w" * 30000, system="GEN-SYSTEM")
    assert g.prompt_eval_count == 2051 and up.turns()[-1].truncated and g.response == REPLY


def test_mock_summary_call_carries_facts(up):
    client = ollama.Client(host=up.url)
    turns = f"[USER]: {FACT}\n[ASSISTANT]: ok\n[USER]: FACT: the region is eu-west.\n"
    ask = {"role": "user", "content": f"{SUMMARY_PREFIXES[0]}: write a checkpoint.\n\nTURNS:\n{turns}"}
    r = client.chat(model="llama3.2", messages=[ask], stream=False)
    assert FACT in r.message.content and "FACT: the region is eu-west." in r.message.content
    assert r.message.content.count("## ") >= 2  # not an echo of the prompt
    # In context: the conversation, then the ask as the last user message.
    conv = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": FACT}, {"role": "assistant",
                                                                                       "content": "ok"}]
    r = client.chat(model="llama3.2", stream=False, messages=conv + [
        {"role": "user", "content": f"{SUMMARY_PREFIXES[0]} now. Write a checkpoint of the conversation above."}])
    assert FACT in r.message.content
    assert [x.summary for x in up.conversation_requests()] == [True, True] and up.turns() == []
    # A question is answered from what was kept, and only from that.
    r = client.chat(model="llama3.2", messages=conv + [{"role": "user", "content": "What is the deploy key?"}])
    assert r.message.content == f"The deploy key is {WORD}."
    r = client.chat(model="llama3.2", messages=[{"role": "user", "content": "What is the deploy key?"}])
    assert r.message.content == "I do not know the deploy key."


def test_mock_other_routes_with_the_client(up):
    client = ollama.Client(host=up.url)
    assert [m.model for m in client.list().models] == [MODEL, "nomic-embed-text:latest"]
    progress = list(client.pull("llama3.2", stream=True))
    assert progress[0].status == "pulling manifest" and progress[-1].status == "success"
    assert any(p.completed for p in progress) and client.pull("llama3.2").status == "success"
    e = client.embed(model="nomic-embed-text", input=["a", "b"])
    assert len(e.embeddings) == 2 and e.embeddings == client.embed(model="nomic-embed-text", input=["a", "b"]).embeddings
    assert sorted(m.model for m in client.ps().models) == ["nomic-embed-text:latest"]
    status, headers, body, _ = raw(up.url, "GET", "/")
    assert (status, body) == (200, b"Ollama is running")
    assert raw(up.url, "HEAD", "/")[0] == 200
    assert raw(up.url, "GET", "/api/version")[0] == 200
    assert raw(up.url, "GET", "/props")[:3:2] == (404, b"404 page not found")


def test_mock_js_client(up):
    rows = run_js(up.url, scenario(8, WORD)["turns"], stream=True)
    assert [r["status"] for r in rows] == [200] * len(rows) and len(rows) == 9
    call = rows[6]["tool_calls"][0]
    assert call["function"] == {"index": 0, "name": "get_weather", "arguments": {"city": "Lisbon"}}
    assert rows[7]["content"].startswith("The get_weather tool says:")
    assert rows[-1]["content"] == f"The deploy key is {WORD}."
    assert up.turns()[7].json()["messages"][-1]["tool_call_id"] == call["id"]
    assert [r["prompt_eval_count"] for r in rows] == [r.kept for r in up.turns()]
    plain = run_js(up.url, ["hello"], stream=False, system=None, tools=None)
    assert plain[0]["response"]["message"] == {"role": "assistant", "content": REPLY}


# ================================================================ through compactor

def test_chat_passthrough_bytes_and_headers(up, compactor):
    c = with_compactor(compactor, up)
    for body in ({"model": "llama3.2", "messages": HEALTHY},
                 {"model": "llama3.2", "messages": HEALTHY, "stream": False},
                 {"model": "llama3.2", "messages": WEATHER, "tools": TOOLS},
                 {"model": "llama3.2", "messages": WEATHER, "tools": TOOLS, "stream": False,
                  "options": {"temperature": 0}}):
        data = json.dumps(body).encode()
        d_status, d_headers, d_body, _ = raw(up.url, "POST", "/api/chat", data)
        direct_req = up.requests[-1].body
        p_status, p_headers, p_body, p_lines = raw(c.url, "POST", "/api/chat", data)
        forwarded = [r for r in up.requests if r.route == "/api/chat"][-1]
        assert (p_status, p_body) == (d_status, d_body) == (200, d_body)
        assert p_headers["content-type"] == d_headers["content-type"]
        assert p_headers.get("x-compactor-action") == "passthrough", p_headers
        assert p_headers.get("x-compactor-session")
        assert forwarded.body == direct_req == data, "an unchanged request is forwarded as its bytes"
        if body.get("stream") is not False:
            assert d_headers["content-type"] == "application/x-ndjson" and len(p_lines) >= 2
            assert all(json.loads(l) for _, l in p_lines)


@pytest.mark.parametrize("stream", [False, True], ids=["json", "ndjson"])
def test_python_client_through_compactor_same_as_direct(up, compactor, stream):
    c = with_compactor(compactor, up)
    heads: list = []
    direct = ollama.Client(host=up.url)
    proxied = ollama.Client(host=c.url, event_hooks={"response": [heads.append]})
    for messages, tools in ((HEALTHY, None), (WEATHER, TOOLS)):
        a = direct.chat(model="llama3.2", messages=messages, tools=tools, stream=stream)
        b = proxied.chat(model="llama3.2", messages=messages, tools=tools, stream=stream)
        a, b = ([x.model_dump() for x in a], [x.model_dump() for x in b]) if stream else (a.model_dump(), b.model_dump())
        assert b == a
        assert heads[-1].headers.get("x-compactor-action") == "passthrough"
        assert heads[-1].headers.get("x-compactor-session")
    calls = (b[0] if stream else b)["message"]["tool_calls"]
    assert calls[0]["function"] == {"name": "get_weather", "arguments": {"city": "Oslo"}}


@pytest.mark.parametrize("stream", [False, True], ids=["json", "ndjson"])
def test_js_client_through_compactor_same_as_direct(up, compactor, stream):
    c = with_compactor(compactor, up)
    turns = scenario(8, WORD)["turns"][5:]  # a weather turn among them
    a = run_js(up.url, turns, stream)
    b = run_js(c.url, turns, stream)
    strip = ("action", "session")
    assert [{k: v for k, v in r.items() if k not in strip} for r in b] == \
           [{k: v for k, v in r.items() if k not in strip} for r in a]
    assert any(r["tool_calls"] for r in b)
    assert {r["action"] for r in b} == {"passthrough"} and len({r["session"] for r in b}) == 1
    assert b[0]["session"]


def test_window_learned_from_api_ps(up, compactor):
    c = with_compactor(compactor, up)
    assert up.window() is None, "the model is not loaded before the first request"
    heads: list = []
    client = ollama.Client(host=c.url, event_hooks={"response": [heads.append]})
    messages = list(HEALTHY)
    for _ in range(2):
        r = client.chat(model="llama3.2", messages=messages)
        messages += [{"role": "assistant", "content": r.message.content}, {"role": "user", "content": "And now?"}]
    view = admin_session(c, heads[-1].headers["x-compactor-session"])
    assert view["window"] == DEFAULT_NUM_CTX, f"the loaded window, not {view['window']} (/api/show: {MAX_CONTEXT})"
    assert view["turn_figures"][-1]["window"] == DEFAULT_NUM_CTX, view["turn_figures"]
    # Asked after the first answer loaded the model (before it /api/ps lists nothing).
    paths = up.paths()
    chats = [i for i, p in enumerate(paths) if p == ("POST", "/api/chat")]
    assert ("GET", "/api/ps") in paths[chats[0] + 1:chats[1]], paths
    assert ("POST", "/api/show") not in paths or view["window"] != MAX_CONTEXT


def test_window_is_the_requests_num_ctx(up, compactor):
    c = with_compactor(compactor, up)
    heads: list = []
    client = ollama.Client(host=c.url, event_hooks={"response": [heads.append]})
    client.chat(model="llama3.2", messages=HEALTHY, options={"num_ctx": 2048})
    assert up.window() == 2048
    client.chat(model="llama3.2", messages=HEALTHY + [{"role": "assistant", "content": REPLY},
                                                      {"role": "user", "content": "And now?"}],
                options={"num_ctx": 2048})
    assert admin_session(c, heads[-1].headers["x-compactor-session"])["window"] == 2048


def check_long_conversation(up: OllamaUpstream, sent: list[Sent], turns: int) -> None:
    problems = []
    if bad := [(s.turn, s.status) for s in sent if s.status != 200]:
        problems.append(f"failed requests: {bad}")
    reqs = up.turns()
    if bad := [(r.index, r.tokens, r.kept, r.num_ctx) for r in reqs if r.truncated or r.tokens > r.num_ctx]:
        problems.append(f"requests truncated upstream (index, sent, kept, num_ctx): {bad}")
    if bad := [r.index for r in up.summary_calls() if r.truncated]:
        problems.append(f"summary calls truncated upstream: {bad}")
    if bad := [r.index for r in reqs if not r.has_system or r.json()["messages"][0] != {"role": "system",
                                                                                          "content": SYSTEM}]:
        problems.append(f"system prompt not first and verbatim in requests {bad}")
    if bad := [r.index for r in reqs if not r.has_tools or r.json().get("tools") != TOOLS]:
        problems.append(f"tools missing or changed in requests {bad}")
    if bad := [r.index for r in reqs if orphan_tool_results(r.json())]:
        problems.append(f"tool results without their call in requests {bad}")
    if not any(s.action == "compacted" for s in sent):
        problems.append("no compaction")
    if len({s.session for s in sent}) != 1 or not sent[0].session:
        problems.append(f"sessions: {sorted({str(s.session) for s in sent})}")
    assert len({s.turn for s in sent}) == turns
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("stream", [False, True], ids=["json", "ndjson"])
def test_long_conversation_python_client(up, compactor, stream):
    c = with_compactor(compactor, up)
    sent = play(c.url, scenario(30, WORD), stream)
    check_long_conversation(up, sent, 30)
    assert up.window() == DEFAULT_NUM_CTX and {r.num_ctx for r in up.turns()} == {DEFAULT_NUM_CTX}


@pytest.mark.parametrize("stream", [False, True], ids=["json", "ndjson"])
def test_long_conversation_js_client(up, compactor, stream):
    c = with_compactor(compactor, up)
    scene = scenario(30, WORD)
    rows = run_js(c.url, scene["turns"], stream, options={"num_ctx": 4096})
    check_long_conversation(up, sent_from_js(rows), 30)
    assert {r.num_ctx for r in up.turns()} == {4096}
    ids = [r.json()["messages"][-1].get("tool_call_id") for r in up.turns()
           if r.json()["messages"][-1]["role"] == "tool"]
    assert ids and all(i and i.startswith("call_") for i in ids), "the JS client's tool_call_id passes"


# ---------------------------------------------------------------- silent truncation detected

def _turn_chat(client, messages: list[dict], stream: bool, heads: list) -> tuple[str, list[dict]]:
    if stream:
        content, calls = "", []
        for p in client.chat(model="llama3.2", messages=messages, tools=TOOLS, stream=True):
            content += p.message.content or ""
            calls += [tc.model_dump() for tc in p.message.tool_calls or []]
    else:
        r = client.chat(model="llama3.2", messages=messages, tools=TOOLS)
        content, calls = r.message.content or "", [tc.model_dump() for tc in r.message.tool_calls or []]
    return content, calls


def _turn_openai(client, messages: list[dict], stream: bool, heads: list) -> tuple[str, list[dict]]:
    raw_resp = client.chat.completions.with_raw_response.create(
        model="llama3.2", messages=messages, tools=TOOLS, stream=stream)
    heads.append(raw_resp)
    out = raw_resp.parse()
    if not stream:
        m = out.choices[0].message
        return m.content or "", [tc.model_dump() for tc in m.tool_calls or []]
    content, calls = "", []
    for ch in out:
        for choice in ch.choices:
            content += choice.delta.content or ""
            calls += [tc.model_dump(exclude_none=True) for tc in choice.delta.tool_calls or []]
    return content, calls


@pytest.mark.parametrize("api,stream", [("chat", False), ("chat", True), ("openai", False), ("openai", True)])
@pytest.mark.parametrize("outgrown", ["by-a-paste", "turn-by-turn"])
def test_silent_truncation_is_detected_then_avoided(compactor, api, stream, outgrown):
    """The window cannot be discovered (no /api/ps) and the default is four times too big: compactor
    lets the conversation outgrow Ollama's 4096, which truncates silently. It must notice, once.

    ``by-a-paste``: turn 6 pastes 6,000 tokens; Ollama keeps 2,051 (its token cut), fewer than the
    turn before. ``turn-by-turn``: ~400-token turns; Ollama drops the fewest old messages that
    make the prompt fit, so the count it reports stays just under 4,096 and never drops below the
    previous one (4,044, then 4,050, 4,050, 4,051, ...) while each turn added ~420 tokens."""
    up = start_ollama_upstream(hidden={"/api/ps"})
    try:
        c = with_compactor(compactor, up, COMPACTOR_DEFAULT_CONTEXT_LENGTH="16384")
        heads: list = []
        if api == "chat":
            client = ollama.Client(host=c.url, event_hooks={"response": [heads.append]})
            turn = _turn_chat
        else:
            client = openai_client(c.url)
            turn = _turn_openai
        before = metric(c, "compactor_truncations_total")
        messages: list[dict] = [{"role": "system", "content": SYSTEM}]
        texts = scenario(10, WORD, paste_tokens=6000)["turns"] if outgrown == "by-a-paste" \
            else scenario(30, WORD)["turns"]
        first_truncated = None
        after: list[tuple[list[str | None], Any]] = []
        for i, text in enumerate(texts):
            messages.append({"role": "user", "content": text})
            n_before, n_heads = len(up.turns()), len(heads)
            for _ in range(3):
                content, calls = turn(client, messages, stream, heads)
                if api == "chat":
                    messages.append({"role": "assistant", "content": content, **({"tool_calls": calls} if calls else {})})
                    messages += [{"role": "tool", "content": tool_result(tc["function"]["name"], tc["function"]["arguments"]),
                                  "tool_name": tc["function"]["name"]} for tc in calls]
                else:
                    messages.append({"role": "assistant", "content": content or None,
                                     **({"tool_calls": calls} if calls else {})})
                    messages += [{"role": "tool", "tool_call_id": tc["id"], "content": tool_result(
                        tc["function"]["name"], json.loads(tc["function"]["arguments"]))} for tc in calls]
                if not calls:
                    break
            new = up.turns()[n_before:]
            if first_truncated is None and any(r.truncated for r in new):
                first_truncated = i
            elif first_truncated is not None:
                after.append(([h.headers.get("x-compactor-action") for h in heads[n_heads:]], new))
                if len(after) == 4:
                    break
        assert first_truncated is not None, "the conversation never outgrew the upstream's window"
        assert after, "no turn after the truncation"
        key = heads[-1].headers["x-compactor-session"]
        truncated = [r.index for r in up.turns() if r.truncated]
        assert len(truncated) == 1, f"only the first request over the window is truncated: {truncated}"
        assert metric(c, "compactor_truncations_total") - before == 1
        view = admin_session(c, key)
        assert view.get("truncations") == 1, {k: view.get(k) for k in ("truncations", "window", "compactions")}
        assert len(truncation_warnings(c, key)) == 1, truncation_warnings(c, key)
        actions, reqs = after[0]
        assert actions[0] == "compacted", f"the turn after the truncation: {actions}"
        assert reqs and not any(r.truncated for r in reqs)
        assert all(not r.truncated for _, rs in after for r in rs)
    finally:
        up.close()


# ---------------------------------------------------------------- the rest of the API

def test_other_routes_pass_through_bytes(up, compactor):
    c = with_compactor(compactor, up)
    gen = {"model": "llama3.2", "prompt": "Why is the sky blue?"}
    cases = [
        ("GET", "/", None), ("HEAD", "/", None), ("GET", "/api/version", None), ("GET", "/api/tags", None),
        ("POST", "/api/show", {"model": "llama3.2"}), ("POST", "/api/show", {"model": "missing"}),
        ("POST", "/api/generate", gen), ("POST", "/api/generate", {**gen, "stream": False}),
        ("POST", "/api/embed", {"model": "nomic-embed-text", "input": ["a", "b"]}),
        ("GET", "/api/ps", None), ("GET", "/v1/models", None), ("GET", "/api/nothing", None),
        ("POST", "/api/pull", {"model": "llama3.2", "stream": False}),
    ]
    for method, path, body in cases:
        data = json.dumps(body).encode() if body is not None else None
        d = raw(up.url, method, path, data)
        p = raw(c.url, method, path, data)
        assert (p[0], p[2]) == (d[0], d[2]), f"{method} {path}"
        assert p[1].get("content-type") == d[1].get("content-type"), f"{method} {path}"
        if method == "HEAD":
            assert p[1].get("content-length") == d[1].get("content-length")
    ps = json.loads(raw(c.url, "GET", "/api/ps")[2])
    assert {m["model"] for m in ps["models"]} == {MODEL, "nomic-embed-text:latest"}


def test_pull_progress_is_streamed(up, compactor):
    c = with_compactor(compactor, up)
    body = json.dumps({"model": "llama3.2"}).encode()
    d = raw(up.url, "POST", "/api/pull", body)
    p = raw(c.url, "POST", "/api/pull", body)
    assert (p[0], p[2], p[1]["content-type"]) == (d[0], d[2], "application/x-ndjson")
    times = [t for t, _ in p[3]]
    assert len(times) == 9
    gaps = [b - a for a, b in zip(times, times[1:])]
    # Written 0.15 s apart: each line must arrive on its own, not all at the end.
    assert times[-1] - times[0] > 0.9, times
    assert sum(g > 0.08 for g in gaps) >= 6, gaps


def test_unparseable_and_refused_requests_get_the_upstreams_answer(up, compactor):
    c = with_compactor(compactor, up)
    for body in (b'{"model":', b'{"model": "llama3.2", "messages": [', b"",
                 json.dumps({"model": "nope", "messages": HEALTHY}).encode(),
                 json.dumps({"messages": HEALTHY}).encode()):
        d = raw(up.url, "POST", "/api/chat", body)
        p = raw(c.url, "POST", "/api/chat", body)
        assert (p[0], p[2]) == (d[0], d[2]), body
        assert d[0] in (400, 404) and json.loads(d[2])["error"]
    assert raw(c.url, "POST", "/api/chat", b'{"model":')[2] == b'{"error":"unexpected EOF"}'
