"""A recording mock upstream that answers the three APIs the agent CLIs speak.

Used by ``capture_agents.py`` to record what Claude Code, Codex, pi and
hermes-agent really send (the fixtures under ``tests/fixtures/agents``): every
request is kept as received (method, path with its query, headers, body
bytes) and answered with a short, complete reply in the shape the client
asked for, so every turn of the agent ends normally:

* ``POST /v1/messages`` (Anthropic Messages): SSE when ``stream`` is set
  (``message_start`` .. ``message_stop``, ``stop_reason: end_turn``), JSON
  otherwise; ``/v1/messages/count_tokens`` answers a token estimate.
* ``POST /v1/responses`` (OpenAI Responses): SSE (``response.created`` ..
  ``response.completed``) or JSON.
* ``POST /v1/chat/completions``: SSE chunks (usage chunk when asked) or JSON.
* ``GET /v1/models`` (and ``/models``): one model.
* anything else: 404 with an OpenAI-shaped error, recorded like the rest.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

REPLY = "The release tag is REL-42."
MODEL = "gemma-3-270m"


@dataclass
class Recorded:
    method: str
    path: str
    headers: list[tuple[str, str]]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body) if self.body else None


@dataclass
class AgentMock:
    server: ThreadingHTTPServer
    thread: threading.Thread
    requests: list[Recorded] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def url(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host}:{port}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)


def _dumps(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def _sse(events: list[tuple[str | None, Any]]) -> bytes:
    out = bytearray()
    for name, data in events:
        if name:
            out += b"event: " + name.encode() + b"\n"
        out += b"data: " + (data if isinstance(data, bytes) else _dumps(data)) + b"\n\n"
    return bytes(out)


def _estimate(body: bytes) -> int:
    return max(1, len(body) // 4)


def anthropic_reply(req: dict, size: int) -> tuple[str, bytes]:
    model = req.get("model", MODEL)
    usage = {"input_tokens": size, "output_tokens": 8}
    msg = {
        "id": "msg_mock_0001", "type": "message", "role": "assistant", "model": model,
        "content": [{"type": "text", "text": REPLY}], "stop_reason": "end_turn",
        "stop_sequence": None, "usage": usage,
    }
    if not req.get("stream"):
        return "application/json", _dumps(msg)
    start = {**msg, "content": [], "stop_reason": None, "usage": {"input_tokens": size, "output_tokens": 0}}
    return "text/event-stream", _sse([
        ("message_start", {"type": "message_start", "message": start}),
        ("content_block_start", {"type": "content_block_start", "index": 0,
                                 "content_block": {"type": "text", "text": ""}}),
        ("content_block_delta", {"type": "content_block_delta", "index": 0,
                                 "delta": {"type": "text_delta", "text": REPLY}}),
        ("content_block_stop", {"type": "content_block_stop", "index": 0}),
        ("message_delta", {"type": "message_delta", "delta": {"stop_reason": "end_turn", "stop_sequence": None},
                           "usage": {"output_tokens": 8}}),
        ("message_stop", {"type": "message_stop"}),
    ])


def responses_reply(req: dict, size: int) -> tuple[str, bytes]:
    model = req.get("model", MODEL)
    item = {"type": "message", "id": "msg_mock_0001", "status": "completed", "role": "assistant",
            "content": [{"type": "output_text", "text": REPLY, "annotations": []}]}
    usage = {"input_tokens": size, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": 8,
             "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": size + 8}
    resp = {"id": "resp_mock_0001", "object": "response", "created_at": 1_760_000_000, "status": "completed",
            "model": model, "output": [item], "usage": usage}
    if not req.get("stream"):
        return "application/json", _dumps(resp)
    part = {"type": "output_text", "text": "", "annotations": []}
    pending = {**resp, "status": "in_progress", "output": [], "usage": None}
    events: list[tuple[str | None, Any]] = [
        ("response.created", {"type": "response.created", "sequence_number": 0, "response": pending}),
        ("response.in_progress", {"type": "response.in_progress", "sequence_number": 1, "response": pending}),
        ("response.output_item.added", {"type": "response.output_item.added", "sequence_number": 2,
                                        "output_index": 0, "item": {**item, "status": "in_progress", "content": []}}),
        ("response.content_part.added", {"type": "response.content_part.added", "sequence_number": 3,
                                         "item_id": item["id"], "output_index": 0, "content_index": 0, "part": part}),
        ("response.output_text.delta", {"type": "response.output_text.delta", "sequence_number": 4,
                                        "item_id": item["id"], "output_index": 0, "content_index": 0, "delta": REPLY}),
        ("response.output_text.done", {"type": "response.output_text.done", "sequence_number": 5,
                                       "item_id": item["id"], "output_index": 0, "content_index": 0, "text": REPLY}),
        ("response.content_part.done", {"type": "response.content_part.done", "sequence_number": 6,
                                        "item_id": item["id"], "output_index": 0, "content_index": 0,
                                        "part": {**part, "text": REPLY}}),
        ("response.output_item.done", {"type": "response.output_item.done", "sequence_number": 7,
                                       "output_index": 0, "item": item}),
        ("response.completed", {"type": "response.completed", "sequence_number": 8, "response": resp}),
    ]
    return "text/event-stream", _sse(events)


def chat_reply(req: dict, size: int) -> tuple[str, bytes]:
    model = req.get("model", MODEL)
    usage = {"prompt_tokens": size, "completion_tokens": 8, "total_tokens": size + 8}
    base = {"id": "chatcmpl-mock-0001", "created": 1_760_000_000, "model": model}
    if not req.get("stream"):
        return "application/json", _dumps({
            **base, "object": "chat.completion", "usage": usage,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": REPLY}, "finish_reason": "stop"}],
        })
    def chunk(delta: dict, finish: str | None = None) -> dict:
        return {**base, "object": "chat.completion.chunk",
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
    events: list[tuple[str | None, Any]] = [
        (None, chunk({"role": "assistant", "content": ""})),
        (None, chunk({"content": REPLY})),
        (None, chunk({}, "stop")),
    ]
    if (req.get("stream_options") or {}).get("include_usage"):
        events.append((None, {**base, "object": "chat.completion.chunk", "choices": [], "usage": usage}))
    events.append((None, b"[DONE]"))
    return "text/event-stream", _sse(events)


def read_body(handler: BaseHTTPRequestHandler) -> bytes:
    """A request's body, chunked or sized (the e2e upstreams' one reader)."""
    if handler.headers.get("Transfer-Encoding", "").lower() == "chunked":
        out = bytearray()
        while size := int(handler.rfile.readline().split(b";")[0].strip() or b"0", 16):
            out += handler.rfile.read(size)
            handler.rfile.readline()
        while handler.rfile.readline() not in (b"\r\n", b"\n", b""):
            pass
        return bytes(out)
    return handler.rfile.read(int(handler.headers.get("Content-Length") or 0))


def send_reply(handler: BaseHTTPRequestHandler, status: int, ctype: str, data: bytes) -> None:
    """One whole response with its length (no body for HEAD)."""
    handler.send_response_only(status)
    handler.send_header("Content-Type", ctype)
    handler.send_header("Content-Length", str(len(data)))
    handler.end_headers()
    if handler.command != "HEAD":
        handler.wfile.write(data)
    handler.wfile.flush()


def _handler(mock: AgentMock):
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
            with mock.lock:
                mock.requests.append(Recorded(self.command, self.path, list(self.headers.items()), body))
            path = self.path.split("?")[0].rstrip("/")
            try:
                req = json.loads(body) if body else {}
            except ValueError:
                req = {}
            if not isinstance(req, dict):
                req = {}
            if self.command == "POST" and path.endswith("/messages/count_tokens"):
                self._send(200, "application/json", _dumps({"input_tokens": _estimate(body)}))
            elif self.command == "POST" and path.endswith("/messages"):
                self._send(200, *anthropic_reply(req, _estimate(body)))
            elif self.command == "POST" and path.endswith("/responses"):
                self._send(200, *responses_reply(req, _estimate(body)))
            elif self.command == "POST" and path.endswith("/chat/completions"):
                self._send(200, *chat_reply(req, _estimate(body)))
            elif self.command == "GET" and path.endswith("/models"):
                self._send(200, "application/json", _dumps({"object": "list", "data": [
                    {"id": MODEL, "object": "model", "created": 1_760_000_000, "owned_by": "mock"}]}))
            else:
                self._send(404, "application/json", _dumps(
                    {"error": {"code": 404, "message": "not served by the agent mock", "type": "not_found_error"}}))

        do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = do_HEAD = _handle

    return Handler


def start_agent_mock() -> AgentMock:
    class Server(ThreadingHTTPServer):
        daemon_threads = True

    server = Server(("127.0.0.1", 0), BaseHTTPRequestHandler)
    thread = threading.Thread(target=lambda: server.serve_forever(poll_interval=0.05), daemon=True)
    mock = AgentMock(server=server, thread=thread)
    server.RequestHandlerClass = _handler(mock)
    thread.start()
    return mock
