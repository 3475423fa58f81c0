"""A deterministic upstream that counts prompt tokens and prompt-cache hits like llama.cpp.

The real agent CLIs need no real model to hold a conversation: every request
is answered with a short fixed text (``agent_mock.REPLY``, no tool call), so
each agent turn ends after one request; compactor's summary calls get a short
fixed checkpoint (``SUMMARY``). What this upstream adds to
``agent_mock.py`` is llama.cpp's accounting, so compactor sees a window and a
cache and a harness can measure what compaction costs:

* **Prompt tokens**: the request's prompt is rendered as a chat template would
  render it (``render``: the top-level ``system`` / ``instructions``, the
  ``tools``, then each message or input item, its role and its text; content
  parts are joined as text, ``cache_control`` markers dropped, so a message
  sent once as a list of blocks and once as a string is the same prompt), and
  counted as one token per 4 characters. Reported as ``usage.prompt_tokens``
  (chat completions) or ``usage.input_tokens`` (Messages, Responses), and as
  ``timings.prompt_n + timings.cache_n``.
* **Cache hits**: ``timings.cache_n`` is the longest common prefix, in those
  tokens (common characters / 4), with the previous request of the same
  conversation. A conversation is keyed by its system text (top-level
  ``system`` / ``instructions``, else its first ``system`` / ``developer``
  message), as if llama.cpp had a slot per conversation; a compactor summary
  call (its last message a user message with compactor's summariser preamble
  at a line start: alone, or after the conversation for an in-context summary) is
  compared with the request received just before it, and does not replace
  the conversation's cached prompt.
* **Window**: with ``n_ctx`` set, a prompt of ``n_ctx`` tokens or more is
  answered with llama.cpp's overflow error (400, ``exceed_context_size_error``,
  ``n_prompt_tokens``, ``n_ctx``); ``GET /props`` reports
  ``default_generation_settings.n_ctx`` and ``GET /v1/models`` one model, so
  compactor discovers the window.

Every request is recorded (:class:`Counted`) in arrival order.

    up = start_counting_upstream(n_ctx=6000)
    ... point compactor (or an agent) at up.url ...
    [(r.tokens, r.cache_n, r.summary) for r in up.conversation_requests()]
"""

from __future__ import annotations

import json
import re
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from agent_mock import MODEL, REPLY, _dumps, anthropic_reply, chat_reply, read_body, responses_reply, send_reply

CHARS_PER_TOKEN = 4
SUMMARY_PREFIXES = ("You are a summarization agent", "You are a conversation summarization assistant")
CONVERSATION_PATHS = ("/chat/completions", "/messages", "/responses")
# What a summary call is answered with: a short checkpoint, the same words every time (compactor
# rejects agent_mock.REPLY as a summary and falls back to its deterministic one).
SUMMARY = ("## Checkpoint\nThe conversation so far: deploy logs of several runs were pasted, one per turn, "
           "and the release tag of each run was asked for and answered.")


# ---------------------------------------------------------------- the prompt as a template renders it

def _canon(obj: Any) -> str:
    return json.dumps(_strip(obj), sort_keys=True, ensure_ascii=False, separators=(",", ":"))


def _strip(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _strip(v) for k, v in obj.items() if k != "cache_control"}
    if isinstance(obj, list):
        return [_strip(v) for v in obj]
    return obj


def _content(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for part in content:
            if isinstance(part, str):
                out.append(part)
            elif isinstance(part, dict) and isinstance(part.get("text"), str) and set(part) <= {
                    "type", "text", "cache_control", "annotations"}:
                out.append(part["text"])
            elif isinstance(part, dict) and part.get("type") == "tool_result":
                out.append(f"[tool_result {part.get('tool_use_id')}] {_content(part.get('content'))}")
            else:
                out.append(_canon(part))
        return "\n".join(out)
    return _canon(content)


def _item(m: Any) -> str:
    if not isinstance(m, dict):
        return _content(m)
    role = m.get("role") or m.get("type") or "?"
    head = f"<|{role}|>\n"
    rest = {k: v for k, v in m.items() if k not in ("role", "content", "type", "cache_control")}
    body = _content(m.get("content"))
    if rest:
        body += ("\n" if body else "") + _canon(rest)
    return head + body + "\n"


def conversation_items(req: dict) -> list:
    items = req.get("messages") if "messages" in req else req.get("input")
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    return items if isinstance(items, list) else []


def system_text(req: dict) -> str:
    """The conversation's key: its top-level system/instructions, else its first system/developer message."""
    top = req.get("system", req.get("instructions"))
    if top:
        return _content(top)
    for m in conversation_items(req):
        if isinstance(m, dict) and m.get("role") in ("system", "developer"):
            return _content(m.get("content"))
    return ""


def render(req: dict) -> str:
    """The prompt text of a conversation request (what the token count and the cache compare)."""
    out = []
    top = req.get("system", req.get("instructions"))
    if top:
        out.append("<|system|>\n" + _content(top) + "\n")
    if req.get("tools"):
        out.append("<|tools|>\n" + _canon(req["tools"]) + "\n")
    out += [_item(m) for m in conversation_items(req)]
    return "".join(out)


def tokens_of(text: str) -> int:
    return (len(text) + CHARS_PER_TOKEN - 1) // CHARS_PER_TOKEN


def common_prefix(a: str, b: str) -> int:
    """Length of the longest common prefix of ``a`` and ``b``, in characters."""
    n = min(len(a), len(b))
    lo, step = 0, 1 << 16
    # Compare in blocks first (fast on long equal prefixes), then character by character.
    while step:
        while lo + step <= n and a[lo:lo + step] == b[lo:lo + step]:
            lo += step
        step >>= 1
    return lo


SUMMARY_ASK = re.compile(r"(?:^|\n)\s*(?:" + "|".join(map(re.escape, SUMMARY_PREFIXES)) + ")")


def is_summary_call(req: Any) -> bool:
    """compactor's own summariser call: its last message a user message with the summariser's
    preamble at the start of a line (alone; or after the conversation itself, an in-context
    summary, whose ask compactor merges into the conversation's last user message)."""
    if not isinstance(req, dict):
        return False
    items = conversation_items(req)
    if not items or not isinstance(items[-1], dict) or items[-1].get("role") != "user":
        return False
    return bool(SUMMARY_ASK.search(_content(items[-1].get("content"))))


# ---------------------------------------------------------------- the server

@dataclass
class Counted:
    """One request the upstream received."""

    index: int
    method: str
    path: str
    body: bytes
    headers: dict[str, str]
    status: int = 0
    prompt: str = ""
    tokens: int = 0
    cache_n: int = 0  # tokens of the prompt found in the cache (common prefix with the previous request)
    summary: bool = False
    key: str = ""
    stream: bool = False
    started: float = field(default_factory=time.monotonic)

    @property
    def conversation(self) -> bool:
        return self.method == "POST" and self.path.split("?")[0].rstrip("/").endswith(CONVERSATION_PATHS) \
            and not self.path.split("?")[0].rstrip("/").endswith("/count_tokens")

    @property
    def uncached(self) -> int:
        """Prompt tokens the server had to evaluate (not found in its cache)."""
        return self.tokens - self.cache_n

    def json(self) -> Any:
        try:
            return json.loads(self.body) if self.body else None
        except ValueError:
            return None


@dataclass
class CountingUpstream:
    server: ThreadingHTTPServer
    thread: threading.Thread
    n_ctx: int | None
    requests: list[Counted] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    # Per conversation key, the last prompt evaluated (the cache of its slot).
    cache: dict[str, str] = field(default_factory=dict)
    last_prompt: str = ""

    @property
    def url(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host}:{port}"

    def conversation_requests(self) -> list[Counted]:
        with self.lock:
            return [r for r in self.requests if r.conversation]

    def clear(self) -> None:
        with self.lock:
            self.requests.clear()
            self.cache.clear()
            self.last_prompt = ""

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)

    def account(self, rec: Counted, req: dict) -> None:
        """Fill the record's prompt, tokens, cache hit and summary flag (under the lock)."""
        rec.prompt = render(req)
        rec.tokens = max(1, tokens_of(rec.prompt))
        rec.summary = is_summary_call(req)
        rec.stream = bool(req.get("stream"))
        if rec.summary:
            rec.key = "\0summary"
            rec.cache_n = common_prefix(self.last_prompt, rec.prompt) // CHARS_PER_TOKEN
        else:
            rec.key = system_text(req)
            rec.cache_n = common_prefix(self.cache.get(rec.key, ""), rec.prompt) // CHARS_PER_TOKEN
        over = self.n_ctx is not None and rec.tokens >= self.n_ctx
        if not over and not rec.summary:
            self.cache[rec.key] = rec.prompt
        if not over:
            self.last_prompt = rec.prompt


def _with_accounting(kind: str, data: bytes, rec: Counted, ctype: str) -> bytes:
    """Add llama.cpp's ``timings`` (and the cache split) to an agent_mock reply."""
    timings = {"cache_n": rec.cache_n, "prompt_n": rec.uncached, "predicted_n": 8}

    def patch(obj: dict) -> dict:
        if kind == "chat" and isinstance(obj.get("usage"), dict):
            obj["usage"]["prompt_tokens_details"] = {"cached_tokens": rec.cache_n}
        if kind == "responses":
            resp = obj.get("response") if "response" in obj else obj
            if isinstance(resp, dict) and isinstance(resp.get("usage"), dict):
                resp["usage"]["input_tokens_details"] = {"cached_tokens": rec.cache_n}
                resp["timings"] = timings
        if kind == "chat" and (obj.get("object") == "chat.completion" or obj.get("usage")
                               or (obj.get("choices") and obj["choices"][0].get("finish_reason"))):
            obj["timings"] = timings
        if kind == "messages" and obj.get("type") in ("message", "message_delta"):
            obj["timings"] = timings
        return obj

    if "event-stream" not in ctype:
        return _dumps(patch(json.loads(data)))
    out = []
    for line in data.split(b"\n"):
        if line.startswith(b"data: {"):
            line = b"data: " + _dumps(patch(json.loads(line[6:])))
        out.append(line)
    return b"\n".join(out)


def _overflow(rec: Counted, n_ctx: int) -> bytes:
    return _dumps({"error": {
        "code": 400,
        "message": f"request ({rec.tokens} tokens) exceeds the available context size ({n_ctx} tokens), "
                   "try increasing it",
        "type": "exceed_context_size_error",
        "n_prompt_tokens": rec.tokens,
        "n_ctx": n_ctx,
    }})


def _handler(up: CountingUpstream):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: object) -> None:
            pass

        def _read(self) -> bytes:
            return read_body(self)

        def _send(self, status: int, ctype: str, data: bytes) -> None:
            send_reply(self, status, ctype, data)

        def _handle(self) -> None:
            body = self._read()
            path = self.path.split("?")[0].rstrip("/")
            try:
                req = json.loads(body) if body else {}
            except ValueError:
                req = {}
            if not isinstance(req, dict):
                req = {}
            with up.lock:
                rec = Counted(len(up.requests), self.command, self.path, body,
                              {k.lower(): v for k, v in self.headers.items()})
                up.requests.append(rec)
                if rec.conversation:
                    up.account(rec, req)
            status, ctype, data = self._answer(path, req, body, rec)
            rec.status = status
            self._send(status, ctype, data)

        def _answer(self, path: str, req: dict, body: bytes, rec: Counted) -> tuple[int, str, bytes]:
            js = "application/json"
            if self.command == "POST" and path.endswith("/count_tokens"):
                return 200, js, _dumps({"input_tokens": max(1, tokens_of(render(req)))})
            if rec.conversation:
                if up.n_ctx is not None and rec.tokens >= up.n_ctx:
                    return 400, js, _overflow(rec, up.n_ctx)
                if path.endswith("/messages"):
                    kind, (ctype, data) = "messages", anthropic_reply(req, rec.tokens)
                elif path.endswith("/responses"):
                    kind, (ctype, data) = "responses", responses_reply(req, rec.tokens)
                else:
                    kind, (ctype, data) = "chat", chat_reply(req, rec.tokens)
                data = _with_accounting(kind, data, rec, ctype)
                if rec.summary:
                    data = data.replace(REPLY.encode(), json.dumps(SUMMARY)[1:-1].encode())
                return 200, ctype, data
            if self.command in ("GET", "HEAD") and path == "/props":
                n = up.n_ctx or 1_000_000
                return 200, js, _dumps({"default_generation_settings": {"n_ctx": n}, "total_slots": 1})
            if self.command in ("GET", "HEAD") and path.endswith("/models"):
                meta = {"n_ctx_train": up.n_ctx or 1_000_000}
                return 200, js, _dumps({"object": "list", "data": [
                    {"id": MODEL, "object": "model", "created": 1_760_000_000, "owned_by": "counting", "meta": meta}]})
            return 404, js, _dumps(
                {"error": {"code": 404, "message": "not served by the counting upstream", "type": "not_found_error"}})

        do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = do_HEAD = _handle

    return Handler


def start_counting_upstream(n_ctx: int | None = None) -> CountingUpstream:
    """Start one on a free loopback port; ``n_ctx=None``: no window (nothing is refused)."""

    class Server(ThreadingHTTPServer):
        daemon_threads = True

    server = Server(("127.0.0.1", 0), BaseHTTPRequestHandler)
    thread = threading.Thread(target=lambda: server.serve_forever(poll_interval=0.05), daemon=True)
    up = CountingUpstream(server=server, thread=thread, n_ctx=n_ctx)
    server.RequestHandlerClass = _handler(up)
    thread.start()
    return up
