#!/usr/bin/env python3
"""A Python OpenAI-compatible upstream for scripts/bench_independent.sh.

    python3 scripts/py_upstream.py [ADDR] [--json-chunked]

Standard library only (asyncio, one thread), written the way a Python
model server answers, not the way examples/mock_upstream.rs does:

- POST /v1/chat/completions: a small JSON completion with usage, framed by
  Content-Length (--json-chunked: Transfer-Encoding: chunked, one chunk and
  the last-chunk in separate writes, as a streaming-capable framework sends
  a body it did not measure first).
- with "stream":true in the body: an SSE stream (chunked) of 16 content
  events, a usage event and `data: [DONE]`, each event written with its own
  transport.write (TCP_NODELAY: a segment each), then the last-chunk;
  `?gap_ms=N` sleeps N ms between events (a model's pacing).
- HTTP/1.1 keep-alive; the request is read whole (Content-Length) first.

Prints `listening on <addr>` once bound.
"""

import asyncio
import socket
import sys

JSON = (
    b'{"id":"chatcmpl-py","object":"chat.completion","created":1764460800,'
    b'"model":"bench","choices":[{"index":0,"message":{"role":"assistant",'
    b'"content":"Hello from the Python upstream. This reply is a fixed size."},'
    b'"finish_reason":"stop"}],'
    b'"usage":{"prompt_tokens":42,"completion_tokens":12,"total_tokens":54}}'
)

EVENTS = [
    b'data: {"id":"chatcmpl-py","object":"chat.completion.chunk","created":1764460800,'
    b'"model":"bench","choices":[{"index":0,"delta":{"content":"tok%d "},'
    b'"finish_reason":null}]}\n\n' % i
    for i in range(16)
] + [
    b'data: {"id":"chatcmpl-py","object":"chat.completion.chunk","created":1764460800,'
    b'"model":"bench","choices":[],'
    b'"usage":{"prompt_tokens":42,"completion_tokens":16,"total_tokens":58}}\n\n',
    b"data: [DONE]\n\n",
]
CHUNKS = [b"%x\r\n%s\r\n" % (len(e), e) for e in EVENTS]

JSON_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
    b"content-length: %d\r\n\r\n" % len(JSON)
)
JSON_HEAD_CHUNKED = (
    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
    b"transfer-encoding: chunked\r\n\r\n"
)
SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
    b"cache-control: no-cache\r\ntransfer-encoding: chunked\r\n\r\n"
)
LAST = b"0\r\n\r\n"


class Conn(asyncio.Protocol):
    json_chunked = False

    def connection_made(self, transport):
        self.t = transport
        self.buf = bytearray()
        self.busy = False  # a stream is being written: requests wait
        sock = transport.get_extra_info("socket")
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data):
        self.buf += data
        if not self.busy:
            self.next_request()

    def connection_lost(self, exc):
        self.t = None

    def next_request(self):
        while not self.busy:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = bytes(self.buf[:end]).decode("latin-1")
            length = 0
            for line in head.split("\r\n")[1:]:
                name, _, value = line.partition(":")
                if name.strip().lower() == "content-length":
                    length = int(value)
            if len(self.buf) < end + 4 + length:
                return
            body = bytes(self.buf[end + 4 : end + 4 + length])
            del self.buf[: end + 4 + length]
            target = head.split(" ", 2)[1]
            gap = 0.0
            if "gap_ms=" in target:
                gap = int(target.split("gap_ms=", 1)[1].split("&")[0]) / 1000
            if b'"stream":true' in body or b'"stream": true' in body:
                self.busy = True
                asyncio.ensure_future(self.stream(gap))
            elif self.json_chunked:
                self.t.write(JSON_HEAD_CHUNKED + b"%x\r\n%s\r\n" % (len(JSON), JSON))
                self.t.write(LAST)
            else:
                self.t.write(JSON_HEAD + JSON)

    async def stream(self, gap):
        t = self.t
        t.write(SSE_HEAD)
        for i, c in enumerate(CHUNKS):
            if gap and i:
                await asyncio.sleep(gap)
            if self.t is None:
                return
            t.write(c)
        t.write(LAST)
        self.busy = False
        self.next_request()


async def main():
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    Conn.json_chunked = "--json-chunked" in sys.argv
    host, _, port = (args[0] if args else "127.0.0.1:0").rpartition(":")
    loop = asyncio.get_running_loop()
    server = await loop.create_server(Conn, host, int(port), backlog=1024)
    addr = server.sockets[0].getsockname()
    print(f"listening on {addr[0]}:{addr[1]}", flush=True)
    await server.serve_forever()


if __name__ == "__main__":
    asyncio.run(main())
