"""The long agent conversation through compactor (issue 5), against real llama.cpp.

Skipped unless ``E2E_COMPACTION=1``: this module asserts the finished product
(compaction wired into the proxy) and is switched on when that lands.

compactor's upstream is an ``upstream_tap`` in front of llama.cpp, so the
assertions cover every request compactor itself sends (summariser calls and
retries included), not just what the client sees.
"""

from __future__ import annotations

import os

import pytest

from long_conversation import DEFAULT_TURNS, play, summarize

pytestmark = pytest.mark.skipif(
    os.environ.get("E2E_COMPACTION") != "1",
    reason="set E2E_COMPACTION=1 once compaction is wired into the proxy",
)

# Below this share of the prompt served from llama.cpp's cache, a turn counts as a cache miss.
CACHE_REUSE_MIN = 0.5


@pytest.mark.parametrize(
    "stream, session",
    [(False, None), (True, None), (False, "e2e-conv-a"), (True, "e2e-conv-b")],
    ids=["json", "sse", "json-session", "sse-session"],
)
def test_long_conversation_keeps_working(llama_log, llama_tap, compactor, stream, session):
    via = compactor(llama_tap.url)
    results = play(via.url, stream=stream, session_id=session, turns=DEFAULT_TURNS)
    summary = summarize(results)
    print("summary:", summary)

    failed = [(r.turn, r.status, r.error_type) for r in results if not r.ok]
    assert not failed, f"turns failed through compactor: {failed}"

    n_ctx = llama_log.n_ctx
    upstream = llama_tap.chat()
    too_big = [(e.messages, e.prompt_tokens, e.error_type) for e in upstream
               if e.error_type == "exceed_context_size_error" or (e.prompt_tokens or 0) >= n_ctx]
    assert not too_big, f"upstream requests over the window: {too_big}"
    assert all(r.prompt_tokens < n_ctx for r in results)

    compacted = [r.turn for r in results if r.compactor_action == "compacted"]
    assert compacted, "the conversation outgrew the window but nothing was compacted"
    # Summariser calls are extra upstream chat requests.
    assert len(upstream) > len(results)

    # Between compactions the compacted prefix is sent byte-identical, so
    # llama.cpp serves most of each prompt from its cache.
    steady = [r for prev, r in zip(results, results[1:])
              if r.compactor_action not in ("compacted", "retried") and prev.turn >= compacted[0]]
    assert steady, "no turn followed a compaction without compacting again"
    misses = [(r.turn, r.cache_n, r.prompt_tokens) for r in steady
              if (r.cache_n or 0) < CACHE_REUSE_MIN * r.prompt_tokens]
    assert not misses, f"turns that did not reuse the cached prefix: {misses}"
