"""A small OpenAI-compatible mock upstream for SDK-level tests.

It answers deterministically so that a response fetched directly and one
fetched through compactor can be compared byte for byte:

* ``POST /v1/chat/completions`` with ``stream`` false: a fixed JSON completion
  (``Content-Length`` framing).
* the same with ``stream`` true: a chunked SSE stream of several events, each
  written and flushed separately, ending with ``data: [DONE]``. Like llama.cpp
  and OpenAI, the ``choices: []`` usage event is sent only when the request
  sets ``stream_options.include_usage``.
* model ``mock-error-<status>``: that status with an OpenAI-shaped error body.
* model ``mock-empty``: a completion whose content is the empty string (a
  summariser that answers nothing).
* model ``mock-gated``: a stream that stops after its first content event until the
  test calls :meth:`MockUpstream.release` (or a safety timeout passes), which
  proves the first event crossed the proxy while the upstream was still busy.
* ``GET /v1/models``: a fixed model list.

No ``Date`` header is sent, so every response is a pure function of the
request. Each request received is recorded (method, path, headers, body).
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

MODEL = "mock-model"
CREATED = 1_760_000_000
COMPLETION_ID = "chatcmpl-mock-0001"

# Compact separators, as llama.cpp and OpenAI write their JSON.
def _dumps(obj: object) -> bytes:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()


COMPLETION = {
    "id": COMPLETION_ID,
    "object": "chat.completion",
    "created": CREATED,
    "model": MODEL,
    "choices": [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "Hello from the mock upstream. ünïcødé ✓"},
            "logprobs": None,
            "finish_reason": "stop",
        }
    ],
    "usage": {"prompt_tokens": 17, "completion_tokens": 9, "total_tokens": 26},
    "system_fingerprint": "fp_mock",
}

STREAM_PIECES = ["Hello", ",", " streaming", " wörld", "!"]
USAGE = {"prompt_tokens": 17, "completion_tokens": 5, "total_tokens": 22}


def _chunk(delta: dict, finish_reason: str | None = None, **extra: object) -> dict:
    base = {
        "id": COMPLETION_ID,
        "object": "chat.completion.chunk",
        "created": CREATED,
        "model": MODEL,
        "system_fingerprint": "fp_mock",
        "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}],
    }
    base.update(extra)
    return base


def stream_events(include_usage: bool) -> list[bytes]:
    """The SSE events (each a complete ``data: ...\\n\\n`` block) of the mock stream."""
    usage_null = {"usage": None} if include_usage else {}
    chunks = [_chunk({"role": "assistant", "content": ""}, **usage_null)]
    chunks += [_chunk({"content": p}, **usage_null) for p in STREAM_PIECES]
    chunks.append(_chunk({}, "stop", **usage_null))
    if include_usage:
        chunks.append(
            {
                "id": COMPLETION_ID,
                "object": "chat.completion.chunk",
                "created": CREATED,
                "model": MODEL,
                "system_fingerprint": "fp_mock",
                "choices": [],
                "usage": USAGE,
            }
        )
    events = [b"data: " + _dumps(c) + b"\n\n" for c in chunks]
    events.append(b"data: [DONE]\n\n")
    return events


def error_body(status: int) -> bytes:
    kinds = {
        400: ("invalid_request_error", "mock: the request was rejected"),
        401: ("authentication_error", "mock: invalid api key"),
        404: ("not_found_error", "mock: no such model"),
        429: ("rate_limit_error", "mock: slow down"),
        500: ("server_error", "mock: internal failure"),
    }
    kind, message = kinds.get(status, ("server_error", f"mock: status {status}"))
    return _dumps({"error": {"message": message, "type": kind, "param": None, "code": status}})


MODELS = {
    "object": "list",
    "data": [{"id": MODEL, "object": "model", "created": CREATED, "owned_by": "mock"}],
}


@dataclass
class Recorded:
    """One request as the mock received it."""

    method: str
    path: str
    headers: list[tuple[str, str]]
    body: bytes

    def json(self) -> dict:
        return json.loads(self.body)


@dataclass
class MockUpstream:
    """A running mock; ``url`` is its base URL (no trailing slash)."""

    server: ThreadingHTTPServer
    thread: threading.Thread
    requests: list[Recorded] = field(default_factory=list)
    gate: threading.Event = field(default_factory=threading.Event)
    gate_timed_out: bool = False
    gate_timeout_s: float = 20.0

    @property
    def url(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host}:{port}"

    def release(self) -> None:
        """Let a ``mock-gated`` stream continue after its first event."""
        self.gate.set()

    def chat_requests(self) -> list[Recorded]:
        return [r for r in self.requests if r.path.endswith("/chat/completions")]

    def close(self) -> None:
        self.gate.set()
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)


def _handler(mock: "MockUpstream"):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: object) -> None:  # keep test output quiet
            pass

        def _read_body(self) -> bytes:
            if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                out = bytearray()
                while True:
                    size = int(self.rfile.readline().split(b";")[0].strip(), 16)
                    if size == 0:
                        # trailers end with an empty line
                        while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                            pass
                        return bytes(out)
                    out += self.rfile.read(size)
                    self.rfile.readline()
            return self.rfile.read(int(self.headers.get("Content-Length") or 0))

        def _record(self, body: bytes) -> None:
            mock.requests.append(
                Recorded(self.command, self.path, list(self.headers.items()), body)
            )

        def _head(self, status: int, ctype: str, length: int | None) -> None:
            self.send_response_only(status)
            self.send_header("Server", "mock-upstream")
            self.send_header("Content-Type", ctype)
            # A repeated header: a proxy must keep both values.
            self.send_header("X-Mock-Multi", "one")
            self.send_header("X-Mock-Multi", "two")
            if length is None:
                self.send_header("Transfer-Encoding", "chunked")
                self.send_header("Cache-Control", "no-cache")
            else:
                self.send_header("Content-Length", str(length))
            self.end_headers()

        def _send(self, status: int, body: bytes, ctype: str = "application/json") -> None:
            self._head(status, ctype, len(body))
            self.wfile.write(body)
            self.wfile.flush()

        def _chunk(self, data: bytes) -> None:
            self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
            self.wfile.flush()

        def do_GET(self) -> None:  # noqa: N802 (http.server API)
            self._record(b"")
            if self.path.rstrip("/").endswith("/models"):
                self._send(200, _dumps(MODELS))
            else:
                self._send(404, error_body(404))

        def do_POST(self) -> None:  # noqa: N802
            body = self._read_body()
            self._record(body)
            if not self.path.endswith("/chat/completions"):
                self._send(404, error_body(404))
                return
            try:
                req = json.loads(body)
            except ValueError:
                self._send(400, error_body(400))
                return
            model = str(req.get("model", ""))
            if model.startswith("mock-error-"):
                self._send(int(model.rsplit("-", 1)[1]), error_body(int(model.rsplit("-", 1)[1])))
                return
            if not req.get("stream"):
                if model == "mock-empty":
                    empty = json.loads(_dumps(COMPLETION))
                    empty["choices"][0]["message"]["content"] = ""
                    self._send(200, _dumps(empty))
                else:
                    self._send(200, _dumps(COMPLETION))
                return
            opts = req.get("stream_options") or {}
            events = stream_events(include_usage=opts.get("include_usage") is True)
            self._head(200, "text/event-stream", None)
            for i, event in enumerate(events):
                self._chunk(event)
                # Gate after the first content delta, not the role chunk: a proxy
                # may legitimately hold the role chunk until real content arrives.
                if model == "mock-gated" and i == 1:
                    if not mock.gate.wait(mock.gate_timeout_s):
                        mock.gate_timed_out = True
                else:
                    # Small gaps keep the events in separate frames on the wire.
                    time.sleep(0.003)
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()

    return Handler


def start_mock() -> MockUpstream:
    """Start a mock upstream on a free loopback port, serving in a daemon thread."""
    class Server(ThreadingHTTPServer):
        daemon_threads = True

    # The handler needs the MockUpstream; build it after the socket exists.
    server = Server(("127.0.0.1", 0), BaseHTTPRequestHandler)
    thread = threading.Thread(target=lambda: server.serve_forever(poll_interval=0.05), name="mock-upstream", daemon=True)
    mock = MockUpstream(server=server, thread=thread)
    server.RequestHandlerClass = _handler(mock)
    thread.start()
    return mock
