#!/usr/bin/env python3
"""Record llama.cpp wire fixtures into tests/fixtures/llamacpp/.

Starts its own llama.cpp server (scripts/llama_server.py, n_ctx 2048, 1 slot)
unless --url points at a running one, sends a few requests with the standard
library's http.client and stores the response bodies exactly as received
(after HTTP/1.1 de-chunking), with status and headers in ``responses.json``
and the request bodies in ``requests.json``.

    .venv/bin/python scripts/record_llamacpp_fixtures.py
"""

from __future__ import annotations

import argparse
import http.client
import json
import subprocess
import sys
import time
import urllib.parse
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "tests" / "fixtures" / "llamacpp"
sys.path.insert(0, str(REPO / "tests" / "e2e"))

SHORT = [
    {"role": "system", "content": "You are a concise assistant."},
    {"role": "user", "content": "Name three colours of the rainbow."},
]
GREEDY = {"temperature": 0, "seed": 42, "max_tokens": 12}


def requests_to_record() -> dict[str, tuple[str, str, dict | None]]:
    """name -> (method, path, JSON body)."""
    from long_conversation import TOOLS, build_conversation, history_through

    long_history = history_through(build_conversation(), 12)
    return {
        "props": ("GET", "/props", None),
        "models": ("GET", "/v1/models", None),
        "chat_completion": (
            "POST", "/v1/chat/completions", {"model": "gemma-3-270m", "messages": SHORT, **GREEDY},
        ),
        "chat_stream": (
            "POST", "/v1/chat/completions",
            {"model": "gemma-3-270m", "messages": SHORT, "stream": True, **GREEDY},
        ),
        "chat_stream_include_usage": (
            "POST", "/v1/chat/completions",
            {"model": "gemma-3-270m", "messages": SHORT, "stream": True,
             "stream_options": {"include_usage": True}, **GREEDY},
        ),
        "chat_tool_history": (
            "POST", "/v1/chat/completions",
            {"model": "gemma-3-270m", "messages": history_through(build_conversation(), 2),
             "tools": TOOLS, "tool_choice": "none", **GREEDY},
        ),
        "tools_auto_error": (
            "POST", "/v1/chat/completions",
            {"model": "gemma-3-270m", "messages": SHORT, "tools": TOOLS, **GREEDY},
        ),
        "overflow_error": (
            "POST", "/v1/chat/completions",
            {"model": "gemma-3-270m", "messages": long_history, **GREEDY},
        ),
        "overflow_error_stream": (
            "POST", "/v1/chat/completions",
            {"model": "gemma-3-270m", "messages": long_history, "stream": True,
             "stream_options": {"include_usage": True}, **GREEDY},
        ),
    }


def fetch(base: str, method: str, path: str, body: dict | None) -> tuple[int, list, bytes, int]:
    """Return status, headers, body bytes and the number of reads it took."""
    u = urllib.parse.urlsplit(base)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=600)
    data = json.dumps(body).encode() if body is not None else None
    conn.request(method, path, body=data, headers={"Content-Type": "application/json"} if data else {})
    r = conn.getresponse()
    parts = []
    while chunk := r.read1(65536):
        parts.append(chunk)
    conn.close()
    return r.status, r.getheaders(), b"".join(parts), len(parts)


def suffix(headers: list, body: bytes) -> str:
    ctype = dict((k.lower(), v) for k, v in headers).get("content-type", "")
    return ".sse" if "event-stream" in ctype else ".json"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--url", help="use a running llama.cpp server instead of starting one")
    args = ap.parse_args()

    proc = None
    base = args.url
    if base is None:
        proc = subprocess.Popen(
            [sys.executable, str(REPO / "scripts" / "llama_server.py"), "--port", "0"],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        )
        line = proc.stdout.readline()
        if not line.startswith("llama-server ready "):
            print("llama server failed to start", file=sys.stderr)
            return 1
        base = line.split()[-1]
    try:
        OUT.mkdir(parents=True, exist_ok=True)
        meta, reqs = {}, {}
        for name, (method, path, body) in requests_to_record().items():
            started = time.monotonic()
            status, headers, data, reads = fetch(base, method, path, body)
            fname = name + suffix(headers, data)
            (OUT / fname).write_bytes(data)
            meta[name] = {
                "file": fname, "method": method, "path": path, "status": status,
                "headers": [[k, v] for k, v in headers], "reads": reads,
                "seconds": round(time.monotonic() - started, 2),
            }
            if body is not None:
                reqs[name] = body
            print(f"{name}: {status} {len(data)} bytes in {reads} reads -> {fname}")
        (OUT / "responses.json").write_text(json.dumps(meta, indent=1) + "\n")
        (OUT / "requests.json").write_text(json.dumps(reqs, indent=1, ensure_ascii=False) + "\n")
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
