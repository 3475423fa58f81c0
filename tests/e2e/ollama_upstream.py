"""A deterministic upstream that behaves like Ollama, silent truncation included.

Ollama (issue 48) answers a prompt longer than the loaded window with 200 as
usual: it drops whole messages from the front and, when that is not enough,
tokens from the front of the prompt (ollama/ollama#4967, #3839, #14259). The
only trace is ``prompt_eval_count``, the count of what was kept. This server
does the same, so compactor's handling of it can be tested without a model:

* ``POST /api/chat``: ``stream`` defaults to true; streamed replies are
  ``application/x-ndjson`` (chunked, one JSON object a line: content chunks
  with ``"done":false``, then the final object with ``done_reason``, the
  durations, ``prompt_eval_count`` = the tokens KEPT, ``eval_count``), else
  one JSON object (``application/json; charset=utf-8``). A user message
  containing "weather" with ``tools`` given is answered with a tool call in
  Ollama's shape (``id``, ``function.index``, ``name``, ``arguments`` an
  object); a question "What is the X?" is answered from the line
  ``FACT: the X is V`` if that line is in the KEPT prompt (a model can only
  answer from what it saw), else "I do not know the X."; a tool result with
  a fixed sentence quoting it; anything else with :data:`REPLY`.
* compactor's summary calls (the last user message carries its summariser's
  preamble, ``SUMMARY_PREFIXES``) get a checkpoint that repeats, verbatim,
  every line of the kept prompt containing ``FACT:`` (a summariser that
  carries facts); they are recorded, flagged ``summary`` and left out of
  :meth:`OllamaUpstream.turns`.
* Token accounting: the prompt is rendered as a chat template would (the
  tools' JSON, then each message: its role, content, tool calls, tool name),
  one token per 4 characters, plus :data:`IMAGE_TOKENS` per image.
* The loaded window: a model is not loaded before its first ``/api/chat``,
  ``/api/generate``, ``/api/embed`` or ``/v1/chat/completions``; it is loaded
  with ``options.num_ctx`` when the request gives one (native API only:
  ``/v1`` ignores it, as Ollama does) and the constructor's ``num_ctx``
  (4096, Ollama's default under 24 GiB of VRAM) otherwise. A different
  explicit ``num_ctx``, or an automatic one after an explicit one, reloads
  the model at that size (Ollama's scheduler, ``needsReload``). ``GET
  /api/ps`` lists only loaded models, with that ``context_length``.
  ``llama3.2`` and ``llama3.2:latest`` are the same model.
* Truncation as ``server/prompt.go`` ``chatPrompt`` does it: whole messages
  are dropped from the front until the rendered prompt fits ``num_ctx``,
  keeping every system message and the latest message (tool-call/result
  groups are NOT kept together: Ollama drops message by message); then, as
  ``llm/llama_server.go`` does, a prompt still over ``num_ctx - 1`` tokens
  keeps its first ``num_keep + 1`` tokens (4 + BOS) and its last ones, to
  ``num_ctx - (num_ctx - keep) // 2`` tokens in all (2051 at 4096: what
  users measure), tool definitions and system prompt lost. The same applies
  to ``/api/generate`` and ``/v1/chat/completions`` (``usage.prompt_tokens``
  = the kept count; ``stream_options.include_usage`` gives the final usage
  chunk).
* The rest, plausible and deterministic (no ``Date`` header, fixed
  ``created_at``), so bytes through a proxy can be compared with bytes
  fetched directly: ``/api/generate``, ``/api/embed``, ``/api/tags``,
  ``POST /api/show`` (``llama.context_length`` 131072: the model's maximum,
  not the window), ``/api/pull`` (NDJSON progress lines, each written
  :data:`PULL_LINE_DELAY_S` after the one before), ``/api/version``,
  ``GET /v1/models``, ``GET /`` and ``HEAD /`` ("Ollama is running"),
  gin's ``404 page not found`` elsewhere. Errors in Ollama's shape
  (``{"error": "..."}``): 404 ``model "x" not found, try pulling it first``,
  400 for a body that is not JSON (``unexpected EOF`` for a cut one), 400
  ``model is required``.

Every request is recorded (:class:`OllamaRequest`) in arrival order: path,
model, stream, num_ctx used, tokens sent and kept, whether it was truncated,
whether the kept prompt still holds the system prompt, the tools, or any
marker (:meth:`OllamaRequest.kept_contains`), and whether it is a summary call.

    up = start_ollama_upstream()            # num_ctx=4096
    ollama.Client(host=up.url).chat(model="llama3.2", messages=[...])
    [(r.tokens, r.kept, r.truncated) for r in up.turns()]

Self check: ``python tests/e2e/ollama_upstream.py`` (the pytest tests are in
``test_ollama.py``, the ones that need no compactor run first).
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Iterable

from agent_mock import read_body

MODEL = "llama3.2:latest"
EMBED_MODEL = "nomic-embed-text:latest"
DEFAULT_NUM_CTX = 4096
# What /api/show advertises: the model's training maximum, not the window Ollama loads it with.
MAX_CONTEXT = 131072
NUM_KEEP = 4  # api.DefaultOptions().NumKeep
CHARS_PER_TOKEN = 4
IMAGE_TOKENS = 768  # prompt.go: "Clip images are represented as 768 tokens"
CREATED_AT = "2026-01-01T00:00:00.000000001Z"
EXPIRES_AT = "2099-01-01T00:00:00Z"
VERSION = "0.13.5"
PULL_LINE_DELAY_S = 0.15
REPLY = "Noted: the run looks healthy and nothing else needs doing."
SUMMARY_PREFIXES = ("You are a summarization agent", "You are a conversation summarization assistant")
SUMMARY_ASK = re.compile(r"(?:^|\n)\s*(?:" + "|".join(map(re.escape, SUMMARY_PREFIXES)) + ")")
FACT_LINE = re.compile(r"FACT: the (.+?) is (\S+?)[.,;]?(?:\s|$)")
QUESTION = re.compile(r"What is the (.+?)\?", re.IGNORECASE)

DETAILS = {
    MODEL: {"parent_model": "", "format": "gguf", "family": "llama", "families": ["llama"],
            "parameter_size": "3.2B", "quantization_level": "Q4_K_M"},
    EMBED_MODEL: {"parent_model": "", "format": "gguf", "family": "nomic-bert", "families": ["nomic-bert"],
                  "parameter_size": "137M", "quantization_level": "F16"},
}
DIGESTS = {MODEL: "a80c4f17acd55265feec403c7aef86be0c25983ab279d83f3bcd3abbcb5b8b72",
           EMBED_MODEL: "0a109f422b47e3a30ba2b10eca18548e944e8a23073ee3f3e947efcf3c45e59f"}
SIZES = {MODEL: 2019393189, EMBED_MODEL: 274302450}


def _dumps(obj: Any) -> bytes:
    # Go's encoding/json: compact, non-ASCII as is.
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()


def canonical(name: Any) -> str:
    """Ollama's model name with its implicit tag: ``llama3.2`` is ``llama3.2:latest``."""
    name = str(name or "").strip()
    return name if (":" in name.rsplit("/", 1)[-1] or not name) else name + ":latest"


def tokens_of(text: str) -> int:
    return (len(text) + CHARS_PER_TOKEN - 1) // CHARS_PER_TOKEN


def _canon(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, ensure_ascii=False, separators=(",", ":"))


# ---------------------------------------------------------------- messages and the prompt

def _text(content: Any) -> str:
    """A message's text: Ollama's content is a string; an OpenAI list of parts is joined."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(p if isinstance(p, str) else str(p.get("text", "")) if isinstance(p, dict)
                         and p.get("type") in (None, "text") else "" for p in content)
    return _canon(content)


def from_openai(messages: Any) -> list[dict]:
    """OpenAI chat messages as Ollama's own (what ``openai.FromChatRequest`` builds): text parts
    joined, ``image_url`` parts as images, tool-call arguments parsed to objects, a tool
    result's ``tool_call_id`` resolved to its ``tool_name``."""
    out: list[dict] = []
    names: dict[str, str] = {}
    for m in messages if isinstance(messages, list) else []:
        if not isinstance(m, dict):
            continue
        msg: dict = {"role": str(m.get("role", "")).lower(), "content": _text(m.get("content"))}
        images = [p for p in m.get("content") or [] if isinstance(p, dict) and p.get("type") == "image_url"] \
            if isinstance(m.get("content"), list) else []
        if images:
            msg["images"] = [str((p.get("image_url") or {}).get("url", "")) for p in images]
        calls = []
        for i, tc in enumerate(m.get("tool_calls") or []):
            fn = (tc or {}).get("function") or {}
            try:
                args = json.loads(fn.get("arguments") or "{}")
            except ValueError:
                args = {}
            calls.append({"id": tc.get("id", ""), "function": {"index": i, "name": fn.get("name", ""),
                                                                "arguments": args}})
            names[str(tc.get("id", ""))] = str(fn.get("name", ""))
        if calls:
            msg["tool_calls"] = calls
        if m.get("tool_call_id"):
            msg["tool_call_id"] = m["tool_call_id"]
            msg["tool_name"] = names.get(str(m["tool_call_id"]), "")
        out.append(msg)
    return out


def render_message(m: dict) -> str:
    """One message as the template renders it: its role, its text, its tool calls / tool name."""
    head = f"<|{m.get('role', '?')}|>\n"
    body = _text(m.get("content"))
    images = m.get("images") or []
    if images:
        body = "".join(f"[img-{i}]" for i in range(len(images))) + body
    extra = {k: m[k] for k in ("tool_calls", "tool_name", "tool_call_id", "thinking") if m.get(k)}
    if extra:
        body += ("\n" if body else "") + _canon(extra)
    return head + body + "\n"


def render_tools(tools: Any) -> str:
    return "<|tools|>\n" + _canon(tools) + "\n" if tools else ""


def message_images(m: dict) -> int:
    return len(m.get("images") or [])


@dataclass
class Fit:
    """What Ollama keeps of a prompt at ``num_ctx``."""

    prompt: str  # the whole prompt as sent
    tokens: int  # its tokens (images included)
    kept_prompt: str  # the text the model sees
    kept: int  # prompt_eval_count
    dropped_messages: int  # messages dropped from the front (prompt.go)
    token_cut: bool  # the front tokens cut as well (llama_server.go)

    @property
    def truncated(self) -> bool:
        return self.dropped_messages > 0 or self.token_cut


def fit(messages: list[dict], tools: Any, num_ctx: int, num_keep: int = NUM_KEEP) -> Fit:
    """``chatPrompt``'s truncation, then the runner's: see the module doc."""
    tools_text = render_tools(tools)
    rendered = [render_message(m) for m in messages]

    def count(idx: list[int]) -> int:
        chars = len(tools_text) + sum(len(rendered[i]) for i in idx)
        return (chars + CHARS_PER_TOKEN - 1) // CHARS_PER_TOKEN + IMAGE_TOKENS * sum(
            message_images(messages[i]) for i in idx)

    last = len(messages) - 1
    start, system = 0, []
    for i in range(len(messages)):
        # The system messages of the part about to be skipped are kept.
        system = [j for j in range(i) if messages[j].get("role") == "system"]
        if count(system + list(range(i, len(messages)))) <= num_ctx:
            start = i
            break
        if i == last:  # at least the last message, always
            start = last
            break
    if start == 0:
        system = []
    kept_idx = system + list(range(start, len(messages)))
    whole = tools_text + "".join(rendered)
    kept_text = tools_text + "".join(rendered[i] for i in kept_idx)
    kept = count(kept_idx)
    token_cut = False
    if kept > num_ctx - 1 and num_ctx > 1:
        keep = min(max(num_keep, 0) + 1, num_ctx - 1)  # num_keep, plus the BOS token
        limit = num_ctx - max((num_ctx - keep) // 2, 1)
        tail = (limit - keep) * CHARS_PER_TOKEN
        kept_text = kept_text[:keep * CHARS_PER_TOKEN] + (kept_text[-tail:] if tail > 0 else "")
        kept, token_cut = limit, True
    return Fit(prompt=whole, tokens=count(list(range(len(messages)))), kept_prompt=kept_text, kept=kept,
               dropped_messages=start - len(system), token_cut=token_cut)


def is_summary_call(messages: list[dict]) -> bool:
    """compactor's summariser call: its last message a user message with the summariser's preamble
    at a line start (alone, or after the conversation for an in-context summary)."""
    if not messages or messages[-1].get("role") != "user":
        return False
    return bool(SUMMARY_ASK.search(_text(messages[-1].get("content"))))


def fact_lines(text: str) -> list[str]:
    """Every line containing ``FACT:``, verbatim, each once, in order."""
    out: list[str] = []
    for line in text.split("\n"):
        line = line.strip()
        if "FACT:" in line and line not in out:
            out.append(line)
    return out


def summary_text(kept_prompt: str) -> str:
    facts = fact_lines(kept_prompt)
    return ("## Checkpoint\nThe user pasted deploy logs turn by turn; the assistant acknowledged each "
            "and called get_weather when asked about the weather.\n\n## Critical Context\n"
            + ("\n".join(facts) if facts else "None.") + "\n")


# ---------------------------------------------------------------- the answer

@dataclass
class Answer:
    content: str = ""
    tool_calls: list[dict] = field(default_factory=list)


def answer(messages: list[dict], tools: Any, fitted: Fit, summary: bool) -> Answer:
    """What the "model" says: a pure function of the request and of what it kept."""
    if summary:
        return Answer(summary_text(fitted.kept_prompt))
    last = messages[-1] if messages else {}
    text = _text(last.get("content"))
    if last.get("role") == "user" and tools and "weather" in text.lower():
        names = [str((t.get("function") or {}).get("name", "")) for t in tools if isinstance(t, dict)]
        name = next((n for n in names if "weather" in n), names[0] if names else "get_weather")
        city = (re.search(r"\bin ([A-Z][A-Za-z]+)", text) or re.search(r"()", "")).group(1) or "Tokyo"
        digest = hashlib.sha256(fitted.prompt.encode()).hexdigest()[:8]
        return Answer("", [{"id": f"call_{digest}", "function": {"index": 0, "name": name,
                                                                  "arguments": {"city": city}}}])
    if last.get("role") == "tool":
        return Answer(f"The {last.get('tool_name') or 'tool'} tool says: {text[:80]}")
    if last.get("role") == "user" and (q := QUESTION.search(text)):
        subject = q.group(1).strip().lower()
        # Only what the model was shown, the question itself aside.
        seen = fitted.kept_prompt[: max(0, len(fitted.kept_prompt) - len(render_message(last)))]
        values = [v for s, v in FACT_LINE.findall(seen) if s.strip().lower() == subject]
        return Answer(f"The {subject} is {values[-1]}." if values else f"I do not know the {subject}.")
    return Answer(REPLY)


def _pieces(text: str) -> list[str]:
    """The streamed content pieces: a few words each."""
    words = re.findall(r"\S+\s*", text)
    return ["".join(words[i:i + 3]) for i in range(0, len(words), 3)] or [""]


# ---------------------------------------------------------------- the record

@dataclass
class OllamaRequest:
    """One request the upstream received."""

    index: int
    method: str
    path: str
    body: bytes
    headers: dict[str, str]
    status: int = 0
    model: str = ""
    stream: bool = False
    num_ctx: int = 0  # the window the model was loaded with for this request
    tokens: int = 0  # the prompt as sent
    kept: int = 0  # the prompt as kept (prompt_eval_count)
    dropped_messages: int = 0
    token_cut: bool = False
    summary: bool = False
    system: list[str] = field(default_factory=list)  # the request's system messages
    tools: str = ""  # the tools as rendered
    messages: int = 0
    kept_prompt: str = ""
    reply: str = ""
    tool_calls: list[dict] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)

    @property
    def route(self) -> str:
        return self.path.split("?")[0].rstrip("/")

    @property
    def conversation(self) -> bool:
        """A prompt the model evaluated (chat, generate, OpenAI chat) that was answered."""
        return self.method == "POST" and self.route in CONVERSATION_ROUTES and self.status == 200

    @property
    def truncated(self) -> bool:
        return self.dropped_messages > 0 or self.token_cut

    @property
    def has_system(self) -> bool:
        """The request has a system prompt and all of it is in what the model saw."""
        return bool(self.system) and all(s in self.kept_prompt for s in self.system)

    @property
    def has_tools(self) -> bool:
        """The request has tools and their whole definition is in what the model saw."""
        return bool(self.tools) and self.tools in self.kept_prompt

    def kept_contains(self, marker: str) -> bool:
        """Whether ``marker`` is in what the model saw."""
        return marker in self.kept_prompt

    def sent_contains(self, marker: str) -> bool:
        """Whether ``marker`` is anywhere in the request's body."""
        return marker.encode() in self.body or json.dumps(marker)[1:-1].encode() in self.body

    def json(self) -> Any:
        try:
            return json.loads(self.body) if self.body else None
        except ValueError:
            return None


CONVERSATION_ROUTES = ("/api/chat", "/api/generate", "/v1/chat/completions")


@dataclass
class Loaded:
    num_ctx: int
    auto: bool  # loaded without an explicit num_ctx


@dataclass
class OllamaUpstream:
    server: ThreadingHTTPServer
    thread: threading.Thread
    num_ctx: int = DEFAULT_NUM_CTX
    models: tuple[str, ...] = (MODEL, EMBED_MODEL)
    # Paths answered with gin's 404 as if Ollama did not serve them (e.g. {"/api/ps"}: no discovery).
    hidden: set[str] = field(default_factory=set)
    pull_delay_s: float = PULL_LINE_DELAY_S
    requests: list[OllamaRequest] = field(default_factory=list)
    loaded: dict[str, Loaded] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def url(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host}:{port}"

    def conversation_requests(self) -> list[OllamaRequest]:
        """Every answered chat / generate request, summary calls included."""
        with self.lock:
            return [r for r in self.requests if r.conversation]

    def turns(self) -> list[OllamaRequest]:
        """The conversation's own requests: summary calls left out."""
        return [r for r in self.conversation_requests() if not r.summary]

    def summary_calls(self) -> list[OllamaRequest]:
        return [r for r in self.conversation_requests() if r.summary]

    def paths(self) -> list[tuple[str, str]]:
        with self.lock:
            return [(r.method, r.route) for r in self.requests]

    def window(self, model: str = MODEL) -> int | None:
        """The context length ``model`` is loaded with now (None: not loaded)."""
        with self.lock:
            entry = self.loaded.get(canonical(model))
            return entry.num_ctx if entry else None

    def unload(self, model: str | None = None) -> None:
        with self.lock:
            if model is None:
                self.loaded.clear()
            else:
                self.loaded.pop(canonical(model), None)

    def clear(self) -> None:
        with self.lock:
            self.requests.clear()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)

    def load(self, model: str, options: Any, native: bool) -> int:
        """The window the request runs with, loading or reloading the model (under the lock)."""
        requested = None
        if native and isinstance(options, dict) and isinstance(options.get("num_ctx"), (int, float)) \
                and not isinstance(options.get("num_ctx"), bool):
            requested = min(max(int(options["num_ctx"]), 4), MAX_CONTEXT)
        entry = self.loaded.get(model)
        if entry is not None and requested is None and entry.auto:
            return entry.num_ctx
        target = requested if requested is not None else self.num_ctx
        if entry is None or entry.num_ctx != target or entry.auto != (requested is None):
            self.loaded[model] = Loaded(target, requested is None)
        return target


# ---------------------------------------------------------------- wire shapes

def _metrics(kept: int, evaluated: int) -> dict:
    prompt_ns, eval_ns, load_ns = kept * 100_000, evaluated * 20_000_000, 12_000_000
    return {"total_duration": prompt_ns + eval_ns + load_ns, "load_duration": load_ns,
            "prompt_eval_count": kept, "prompt_eval_duration": prompt_ns,
            "eval_count": evaluated, "eval_duration": eval_ns}


def chat_lines(model: str, ans: Answer, kept: int, stream: bool) -> list[bytes]:
    """The /api/chat reply: NDJSON lines when streamed, else one object (no newline)."""
    evaluated = max(1, tokens_of(ans.content) + 10 * len(ans.tool_calls))

    def msg(content: str, calls: list[dict] | None = None) -> dict:
        m: dict = {"role": "assistant", "content": content}
        if calls:
            m["tool_calls"] = calls
        return m

    final = {"model": model, "created_at": CREATED_AT}
    if not stream:
        return [_dumps({**final, "message": msg(ans.content, ans.tool_calls), "done": True,
                        "done_reason": "stop", **_metrics(kept, evaluated)})]
    lines = []
    if ans.tool_calls:
        lines.append({**final, "message": msg("", ans.tool_calls), "done": False})
    else:
        lines += [{**final, "message": msg(p), "done": False} for p in _pieces(ans.content)]
    lines.append({**final, "message": msg(""), "done": True, "done_reason": "stop", **_metrics(kept, evaluated)})
    return [_dumps(x) + b"\n" for x in lines]


def generate_lines(model: str, ans: Answer, kept: int, stream: bool) -> list[bytes]:
    evaluated = max(1, tokens_of(ans.content))
    base = {"model": model, "created_at": CREATED_AT}
    context = [128006, 882, 128007, 271, 9906, 128009]
    if not stream:
        return [_dumps({**base, "response": ans.content, "done": True, "done_reason": "stop",
                        "context": context, **_metrics(kept, evaluated)})]
    lines = [{**base, "response": p, "done": False} for p in _pieces(ans.content)]
    lines.append({**base, "response": "", "done": True, "done_reason": "stop", "context": context,
                  **_metrics(kept, evaluated)})
    return [_dumps(x) + b"\n" for x in lines]


def openai_body(model: str, ans: Answer, kept: int, req: dict, digest: str) -> tuple[str, list[bytes]]:
    """/v1/chat/completions as Ollama's middleware writes it."""
    cid = f"chatcmpl-{int(digest[:6], 16) % 1000}"
    created = 1_767_225_600
    calls = [{"id": c["id"], "index": c["function"]["index"], "type": "function",
              "function": {"name": c["function"]["name"], "arguments": json.dumps(
                  c["function"]["arguments"], separators=(",", ":"))}} for c in ans.tool_calls]
    evaluated = max(1, tokens_of(ans.content) + 10 * len(ans.tool_calls))
    usage = {"prompt_tokens": kept, "completion_tokens": evaluated, "total_tokens": kept + evaluated}
    finish = "tool_calls" if calls else "stop"
    base = {"id": cid, "object": "chat.completion", "created": created, "model": model,
            "system_fingerprint": "fp_ollama"}
    if not req.get("stream"):
        message: dict = {"role": "assistant", "content": ans.content}
        if calls:
            message["tool_calls"] = calls
        return "application/json", [_dumps({**base, "choices": [
            {"index": 0, "message": message, "finish_reason": finish}], "usage": usage}) + b"\n"]
    chunk = {**base, "object": "chat.completion.chunk"}
    events = []
    if calls:
        events.append({**chunk, "choices": [{"index": 0, "delta": {"role": "assistant", "content": "",
                                                                   "tool_calls": calls}, "finish_reason": None}]})
    else:
        for i, p in enumerate(_pieces(ans.content)):
            delta = {"role": "assistant", "content": p} if i == 0 else {"content": p}
            events.append({**chunk, "choices": [{"index": 0, "delta": delta, "finish_reason": None}]})
    events.append({**chunk, "choices": [{"index": 0, "delta": {}, "finish_reason": finish}]})
    if (req.get("stream_options") or {}).get("include_usage"):
        events.append({**chunk, "choices": [], "usage": usage})
    return "text/event-stream", [b"data: " + _dumps(e) + b"\n\n" for e in events] + [b"data: [DONE]\n\n"]


def _error(message: str) -> bytes:
    return _dumps({"error": message})


def _openai_error(message: str, status: int) -> bytes:
    kind = {400: "invalid_request_error", 404: "not_found_error"}.get(status, "api_error")
    return _dumps({"error": {"message": message, "type": kind, "param": None, "code": None}})


def _json_error(body: bytes) -> str:
    """Go's encoding/json message for a body that does not parse."""
    if not body.strip():
        return "missing request body"
    try:
        json.loads(body)
    except json.JSONDecodeError as e:
        if e.pos >= len(body.decode(errors="replace").rstrip()):
            return "unexpected EOF"
        return f"invalid character {body.decode(errors='replace')[e.pos]!r} looking for beginning of value"
    return "json: cannot unmarshal into Go value"


def _embedding(text: str, dims: int = 8) -> list[float]:
    h = hashlib.sha256(text.encode()).digest()
    return [round((b - 128) / 128, 6) for b in h[:dims]]


def _model_entry(name: str) -> dict:
    return {"name": name, "model": name, "modified_at": "2025-12-01T10:00:00.000000001Z",
            "size": SIZES.get(name, 1 << 30), "digest": DIGESTS.get(name, "0" * 64),
            "details": DETAILS.get(name, DETAILS[MODEL])}


def _show(name: str) -> dict:
    info = {"general.architecture": "llama", "general.basename": "Llama-3.2", "general.file_type": 15,
            "general.parameter_count": 3212749888, "general.quantization_version": 2,
            "llama.attention.head_count": 24, "llama.attention.head_count_kv": 8,
            "llama.block_count": 28, "llama.context_length": MAX_CONTEXT, "llama.embedding_length": 3072,
            "llama.feed_forward_length": 8192, "llama.rope.freq_base": 500000,
            "tokenizer.ggml.model": "gpt2"}
    return {"license": "LLAMA 3.2 COMMUNITY LICENSE AGREEMENT", "modelfile": f"# Modelfile generated by \"ollama show\"\nFROM {name}\n",
            "parameters": "stop                           \"<|eot_id|>\"",
            "template": "<|start_header_id|>system<|end_header_id|>\n\n{{ .System }}<|eot_id|>",
            "details": DETAILS.get(name, DETAILS[MODEL]), "model_info": info,
            "capabilities": ["completion", "tools"], "modified_at": "2025-12-01T10:00:00.000000001Z"}


# ---------------------------------------------------------------- the server

def _handler(up: OllamaUpstream):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: object) -> None:
            pass

        def _head(self, status: int, ctype: str, length: int | None) -> None:
            self.send_response_only(status)
            self.send_header("Content-Type", ctype)
            if length is None:
                self.send_header("Transfer-Encoding", "chunked")
            else:
                self.send_header("Content-Length", str(length))
            self.end_headers()

        def _send(self, status: int, ctype: str, data: bytes) -> None:
            self._head(status, ctype, len(data))
            if self.command != "HEAD":
                self.wfile.write(data)
            self.wfile.flush()

        def _stream(self, ctype: str, parts: Iterable[bytes], delay: float = 0.0) -> None:
            """A chunked 200, each part its own chunk, flushed (gin's c.Stream)."""
            self._head(200, ctype, None)
            for i, part in enumerate(parts):
                if delay and i:
                    time.sleep(delay)
                self.wfile.write(b"%x\r\n%s\r\n" % (len(part), part))
                self.wfile.flush()
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()

        def _not_found(self) -> None:
            self._send(404, "text/plain", b"404 page not found")

        def _handle(self) -> None:
            body = read_body(self)
            route = self.path.split("?")[0].rstrip("/") or "/"
            with up.lock:
                rec = OllamaRequest(len(up.requests), self.command, self.path, body,
                                    {k.lower(): v for k, v in self.headers.items()})
                up.requests.append(rec)
            try:
                self._route(route, body, rec)
            finally:
                if not rec.status:
                    rec.status = -1

        def _route(self, route: str, body: bytes, rec: OllamaRequest) -> None:
            js = "application/json; charset=utf-8"
            get = self.command in ("GET", "HEAD")
            if route in up.hidden:
                rec.status = 404
                return self._not_found()
            if route == "/" and get:
                rec.status = 200
                return self._send(200, "text/plain; charset=utf-8", b"Ollama is running")
            if route == "/api/version" and get:
                rec.status = 200
                return self._send(200, js, _dumps({"version": VERSION}))
            if route == "/api/tags" and get:
                rec.status = 200
                return self._send(200, js, _dumps({"models": [_model_entry(m) for m in up.models]}))
            if route == "/api/ps" and get:
                with up.lock:
                    entries = [{"name": n, "model": n, "size": SIZES.get(n, 1 << 30) + ld.num_ctx * 114_688,
                                "digest": DIGESTS.get(n, "0" * 64), "details": DETAILS.get(n, DETAILS[MODEL]),
                                "expires_at": EXPIRES_AT,
                                "size_vram": SIZES.get(n, 1 << 30) + ld.num_ctx * 114_688,
                                "context_length": ld.num_ctx} for n, ld in up.loaded.items()]
                rec.status = 200
                return self._send(200, js, _dumps({"models": entries}))
            if route == "/v1/models" and get:
                rec.status = 200
                return self._send(200, "application/json", _dumps({"object": "list", "data": [
                    {"id": m, "object": "model", "created": 1_764_583_200, "owned_by": "library"}
                    for m in up.models]}))
            if self.command != "POST" or route not in (
                    "/api/chat", "/api/generate", "/api/embed", "/api/show", "/api/pull", "/v1/chat/completions"):
                rec.status = 404
                return self._not_found()
            openai = route.startswith("/v1/")
            try:
                req = json.loads(body)
                if not isinstance(req, dict):
                    raise ValueError("json: cannot unmarshal into Go value of type api.ChatRequest")
            except ValueError as e:
                rec.status = 400
                msg = _json_error(body) if isinstance(e, json.JSONDecodeError) or not body.strip() else str(e)
                return self._send(400, "application/json" if openai else js,
                                  _openai_error(msg, 400) if openai else _error(msg))
            name = canonical(req.get("model") or req.get("name"))
            rec.model = name
            if not name:
                rec.status = 400
                return self._send(400, js, _error("model is required"))
            if name not in up.models:
                rec.status = 404
                if route == "/api/show":
                    return self._send(404, js, _error(f"model '{req.get('model')}' not found"))
                if route == "/api/pull":
                    return self._pull(req, rec)
                msg = f"model {json.dumps(str(req.get('model')))} not found, try pulling it first"
                return self._send(404, "application/json" if openai else js,
                                  _openai_error(msg, 404) if openai else _error(msg))
            if route == "/api/show":
                rec.status = 200
                return self._send(200, js, _dumps(_show(name)))
            if route == "/api/pull":
                return self._pull(req, rec)
            if route == "/api/embed":
                return self._embed(req, rec)
            self._conversation(route, req, rec)

        def _pull(self, req: dict, rec: OllamaRequest) -> None:
            name = canonical(req.get("model") or req.get("name"))
            digest = DIGESTS.get(name, hashlib.sha256(name.encode()).hexdigest())
            total = SIZES.get(name, 1 << 30)
            lines = [{"status": "pulling manifest"}]
            lines += [{"status": f"pulling {digest[:12]}", "digest": f"sha256:{digest}", "total": total,
                       **({"completed": total * k // 4} if k else {})} for k in range(5)]
            lines += [{"status": "verifying sha256 digest"}, {"status": "writing manifest"}, {"status": "success"}]
            rec.status = 200
            rec.model = name
            if req.get("stream") is False:
                return self._send(200, "application/json; charset=utf-8", _dumps({"status": "success"}))
            self._stream("application/x-ndjson", [_dumps(x) + b"\n" for x in lines], up.pull_delay_s)

        def _embed(self, req: dict, rec: OllamaRequest) -> None:
            inputs = req.get("input")
            inputs = [inputs] if isinstance(inputs, str) else [str(x) for x in inputs or []]
            with up.lock:
                rec.num_ctx = up.load(rec.model, req.get("options"), native=True)
            rec.tokens = rec.kept = sum(tokens_of(x) for x in inputs)
            rec.status = 200
            self._send(200, "application/json; charset=utf-8", _dumps({
                "model": req.get("model"), "embeddings": [_embedding(x) for x in inputs],
                "total_duration": 14_000_000, "load_duration": 1_000_000, "prompt_eval_count": rec.kept}))

        def _conversation(self, route: str, req: dict, rec: OllamaRequest) -> None:
            openai = route == "/v1/chat/completions"
            model_out = req.get("model")
            if route == "/api/generate":
                messages = ([{"role": "system", "content": str(req["system"])}] if req.get("system") else [])
                if req.get("prompt") or req.get("images"):
                    messages.append({"role": "user", "content": str(req.get("prompt") or ""),
                                     **({"images": req["images"]} if req.get("images") else {})})
                tools = None
            elif openai:
                messages, tools = from_openai(req.get("messages")), req.get("tools")
            else:
                messages = [m for m in req.get("messages") or [] if isinstance(m, dict)]
                for m in messages:
                    m["role"] = str(m.get("role", "")).lower()
                tools = req.get("tools")
            options = req.get("options") if isinstance(req.get("options"), dict) else {}
            stream = bool(req.get("stream")) if openai else req.get("stream") is not False
            with up.lock:
                num_ctx = up.load(rec.model, options, native=not openai)
            rec.num_ctx, rec.stream = num_ctx, stream
            if not messages:  # Ollama's "load" answer
                rec.status = 200
                out = {"model": model_out, "created_at": CREATED_AT,
                       **({"message": {"role": "assistant", "content": ""}} if route == "/api/chat"
                          else {"response": ""}), "done": True, "done_reason": "load"}
                return self._send(200, "application/json; charset=utf-8", _dumps(out))
            num_keep = options.get("num_keep") if isinstance(options.get("num_keep"), int) else NUM_KEEP
            fitted = fit(messages, tools, num_ctx, num_keep)
            rec.tokens, rec.kept = fitted.tokens, fitted.kept
            rec.dropped_messages, rec.token_cut = fitted.dropped_messages, fitted.token_cut
            rec.kept_prompt = fitted.kept_prompt
            rec.summary = is_summary_call(messages)
            rec.system = [_text(m.get("content")) for m in messages if m.get("role") == "system"]
            rec.tools = render_tools(tools).removeprefix("<|tools|>\n").removesuffix("\n")
            rec.messages = len(messages)
            ans = answer(messages, tools, fitted, rec.summary)
            rec.reply, rec.tool_calls = ans.content, ans.tool_calls
            rec.status = 200
            if openai:
                ctype, parts = openai_body(model_out, ans, fitted.kept, req,
                                           hashlib.sha256(fitted.prompt.encode()).hexdigest())
            elif route == "/api/generate":
                parts = generate_lines(model_out, ans, fitted.kept, stream)
                ctype = "application/x-ndjson" if stream else "application/json; charset=utf-8"
            else:
                parts = chat_lines(model_out, ans, fitted.kept, stream)
                ctype = "application/x-ndjson" if stream else "application/json; charset=utf-8"
            if stream:
                self._stream(ctype, parts)
            else:
                self._send(200, ctype, b"".join(parts))

        do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = do_HEAD = _handle

    return Handler


def start_ollama_upstream(num_ctx: int = DEFAULT_NUM_CTX, hidden: Iterable[str] = (),
                          pull_delay_s: float = PULL_LINE_DELAY_S) -> OllamaUpstream:
    """Start one on a free loopback port. ``num_ctx``: the window a model is loaded with when a
    request gives none; ``hidden``: paths answered 404 (``{"/api/ps"}``: nothing to discover)."""

    class Server(ThreadingHTTPServer):
        daemon_threads = True

    server = Server(("127.0.0.1", 0), BaseHTTPRequestHandler)
    thread = threading.Thread(target=lambda: server.serve_forever(poll_interval=0.05), name="ollama-upstream",
                              daemon=True)
    up = OllamaUpstream(server=server, thread=thread, num_ctx=num_ctx, hidden=set(hidden),
                        pull_delay_s=pull_delay_s)
    server.RequestHandlerClass = _handler(up)
    thread.start()
    return up


def _self_check() -> None:
    """The real ``ollama`` client against the mock, and the truncation rule."""
    import ollama

    up = start_ollama_upstream()
    try:
        client = ollama.Client(host=up.url)
        assert client.ps().models == []
        r = client.chat(model="llama3.2", messages=[{"role": "user", "content": "hi"}])
        assert r.message.content == REPLY and r.done and r.prompt_eval_count == up.turns()[-1].kept
        assert client.ps().models[0].context_length == DEFAULT_NUM_CTX
        tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                                   "parameters": {"type": "object", "properties": {
                                                       "city": {"type": "string"}}, "required": ["city"]}}}]
        parts = list(client.chat(model="llama3.2", stream=True, tools=tools,
                                 messages=[{"role": "user", "content": "What is the weather in Tokyo?"}]))
        call = [tc for p in parts for tc in (p.message.tool_calls or [])][0]
        assert call.function.name == "get_weather" and call.function.arguments == {"city": "Tokyo"}
        big = [{"role": "system", "content": "S" * 400}] + [
            {"role": "user" if i % 2 == 0 else "assistant", "content": f"m{i} " + "x" * 4000} for i in range(9)]
        r = client.chat(model="llama3.2", messages=big)
        rec = up.turns()[-1]
        assert rec.truncated and rec.dropped_messages > 0 and rec.has_system and rec.kept <= DEFAULT_NUM_CTX
        assert r.prompt_eval_count == rec.kept < rec.tokens
        print(f"ok: {len(up.requests)} requests; truncated {rec.tokens} -> {rec.kept} tokens")
    finally:
        up.close()


if __name__ == "__main__":
    _self_check()
