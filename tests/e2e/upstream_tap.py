"""A recording pass-through placed between compactor and llama.cpp.

compactor talks to the upstream on its own (summariser calls, window
discovery, overflow retries), so what the client sees does not show what the
upstream was asked. The tap forwards every request unchanged, streams the
response back frame by frame, and records per request: method, path, status,
request size, message count, whether it streamed, the prompt size llama.cpp
reported (``usage`` or ``timings``) and the error type, if any.

    tap = start_tap("http://127.0.0.1:8080")
    ... point compactor's upstream at tap.url ...
    assert all(r.prompt_tokens < 2048 for r in tap.chat())
"""

from __future__ import annotations

import http.client
import json
import threading
import time
import urllib.parse
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from agent_mock import read_body

CONVERSATION_PATHS = ("/chat/completions", "/v1/messages", "/v1/responses")
HOP_BY_HOP = {
    "connection", "keep-alive", "proxy-connection", "te", "trailer", "transfer-encoding", "upgrade",
}


@dataclass
class Exchange:
    """One request the upstream received, and what it answered."""

    method: str
    path: str
    status: int
    request_bytes: int
    messages: int | None
    stream: bool
    max_tokens: int | None
    prompt_tokens: int | None = None
    cache_n: int | None = None
    error_type: str | None = None
    n_ctx: int | None = None
    done: bool = False
    # The request body and the response headers (lower-case names), for the
    # real-agent tests that check what crossed and what compactor said.
    body: bytes = b""
    started: float = field(default_factory=time.monotonic)
    response_headers: dict[str, str] = field(default_factory=dict)
    error_message: str | None = None

    def json(self) -> Any:
        try:
            return json.loads(self.body) if self.body else None
        except ValueError:
            return None


def _usage_from_json(body: dict[str, Any], ex: Exchange) -> None:
    err = body.get("error")
    if isinstance(err, dict):
        ex.error_type = err.get("type")
        ex.error_message = err.get("message")
        ex.n_ctx = err.get("n_ctx")
        if err.get("n_prompt_tokens") is not None:
            ex.prompt_tokens = err["n_prompt_tokens"]
        return
    # Anthropic's message_start and Responses' response.* events nest theirs.
    for key in ("message", "response"):
        inner = body.get(key)
        if isinstance(inner, dict) and (inner.get("usage") or inner.get("timings")):
            _usage_from_json(inner, ex)
    usage = body.get("usage") or {}
    timings = body.get("timings") or {}
    if usage.get("prompt_tokens") is not None:
        ex.prompt_tokens = usage["prompt_tokens"]
    elif usage.get("input_tokens") is not None:
        # Anthropic splits the prompt into fresh and cached parts.
        ex.prompt_tokens = (
            usage["input_tokens"]
            + (usage.get("cache_read_input_tokens") or 0)
            + (usage.get("cache_creation_input_tokens") or 0)
        )
    elif "prompt_n" in timings:
        ex.prompt_tokens = timings["prompt_n"] + timings.get("cache_n", 0)
    if "cache_n" in timings:
        ex.cache_n = timings["cache_n"]


def _parse_response(ex: Exchange, ctype: str, body: bytes) -> None:
    try:
        if "event-stream" in ctype:
            for line in body.split(b"\n"):
                if line.startswith(b"data: {"):
                    _usage_from_json(json.loads(line[6:]), ex)
        elif body:
            _usage_from_json(json.loads(body), ex)
    except ValueError:
        pass


@dataclass
class UpstreamTap:
    """A running tap; ``url`` is the base URL to give compactor as its upstream."""

    server: ThreadingHTTPServer
    thread: threading.Thread
    upstream: str
    exchanges: list[Exchange] = field(default_factory=list)
    # Paths answered 404 instead of forwarded, e.g. {"/props", "/v1/models"}
    # to hide the window from compactor's discovery.
    blocked: set[str] = field(default_factory=set)
    lock: threading.Condition = field(default_factory=threading.Condition)

    @property
    def url(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host}:{port}"

    def chat(self, timeout_s: float = 30.0) -> list[Exchange]:
        """The chat-completion exchanges so far, once none is in flight.

        A client can finish reading (``[DONE]``) before the tap has seen the
        end of the upstream body, so wait for the tap to settle first.
        """
        with self.lock:
            self.lock.wait_for(lambda: all(e.done for e in self.exchanges), timeout=timeout_s)
            return [e for e in self.exchanges if e.path.split("?")[0].endswith("/chat/completions")]

    def conversations(self, timeout_s: float = 30.0) -> list[Exchange]:
        """Like :meth:`chat`, over the three conversation APIs (chat completions,
        Anthropic Messages, Responses)."""
        with self.lock:
            self.lock.wait_for(lambda: all(e.done for e in self.exchanges), timeout=timeout_s)
            return [e for e in self.exchanges if e.path.split("?")[0].endswith(CONVERSATION_PATHS)]

    def clear(self) -> None:
        with self.lock:
            self.exchanges.clear()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)


def _handler(tap: UpstreamTap):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: object) -> None:
            pass

        def _body(self) -> bytes:
            return read_body(self)

        def _forward(self) -> None:
            body = self._body()
            req: dict[str, Any] = {}
            if body:
                try:
                    req = json.loads(body)
                except ValueError:
                    req = {}
            msgs = None
            if isinstance(req, dict):
                msgs = req.get("messages") if "messages" in req else req.get("input")
            ex = Exchange(
                method=self.command,
                path=self.path,
                status=0,
                request_bytes=len(body),
                messages=len(msgs) if isinstance(msgs, list) else None,
                stream=bool(isinstance(req, dict) and req.get("stream")),
                max_tokens=(
                    req.get("max_tokens") or req.get("max_completion_tokens") or req.get("max_output_tokens")
                ) if isinstance(req, dict) else None,
                body=body,
            )
            with tap.lock:
                tap.exchanges.append(ex)
            try:
                if self.path.split("?")[0].rstrip("/") in tap.blocked:
                    self._not_found(ex)
                else:
                    self._relay(body, ex)
            finally:
                with tap.lock:
                    ex.done = True
                    tap.lock.notify_all()

        def _not_found(self, ex: Exchange) -> None:
            data = b'{"error":{"code":404,"message":"blocked by the e2e tap","type":"not_found_error"}}'
            ex.status = 404
            self.send_response_only(404)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
            self.wfile.flush()

        def _relay(self, body: bytes, ex: Exchange) -> None:
            # Read per request: a test may point the tap at another upstream between requests.
            up = urllib.parse.urlsplit(tap.upstream)
            conn = http.client.HTTPConnection(up.hostname, up.port, timeout=900)
            headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_BY_HOP | {"host", "content-length"}}
            conn.request(self.command, up.path.rstrip("/") + self.path, body=body or None, headers=headers)
            resp = conn.getresponse()
            ex.status = resp.status
            ex.response_headers = {k.lower(): v for k, v in resp.getheaders()}
            length = resp.getheader("Content-Length")
            self.send_response_only(resp.status, resp.reason)
            for k, v in resp.getheaders():
                if k.lower() not in HOP_BY_HOP:
                    self.send_header(k, v)
            if length is None:
                self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            seen = bytearray()
            while data := resp.read1(65536):
                seen += data
                if length is None:
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                else:
                    self.wfile.write(data)
                self.wfile.flush()
            if length is None:
                self.wfile.write(b"0\r\n\r\n")
                self.wfile.flush()
            conn.close()
            _parse_response(ex, resp.getheader("Content-Type") or "", bytes(seen))

        do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = _forward

    return Handler


def start_tap(upstream: str) -> UpstreamTap:
    """Start a tap in front of ``upstream`` on a free loopback port."""

    class Server(ThreadingHTTPServer):
        daemon_threads = True

    server = Server(("127.0.0.1", 0), BaseHTTPRequestHandler)
    thread = threading.Thread(target=lambda: server.serve_forever(poll_interval=0.05), daemon=True)
    tap = UpstreamTap(server=server, thread=thread, upstream=upstream.rstrip("/"))
    server.RequestHandlerClass = _handler(tap)
    thread.start()
    return tap
