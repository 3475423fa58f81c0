"""Without compactor the long agent conversation outgrows llama.cpp's window.

This is the baseline the through-compactor tests improve on: the same
client, the same history, sent straight to llama.cpp (n_ctx 2048, 1 slot),
starts failing with ``exceed_context_size_error`` after a few turns and never
recovers, because the client's history only grows.
"""

from __future__ import annotations

from long_conversation import DEFAULT_TURNS, play, summarize


def _check_overflow(results, n_ctx: int) -> None:
    summary = summarize(results)
    assert results[0].ok, f"first turn failed: {results[0].error_body}"
    assert summary["failed"] > 0, "the conversation never overflowed"
    first = summary["first_failure_turn"]
    assert first >= 2, "overflow came before the history grew"
    assert all(r.ok for r in results[:first])
    assert all(not r.ok for r in results[first:]), "a turn after the first overflow succeeded"
    for r in results[first:]:
        assert r.status == 400
        err = r.error_body["error"]
        assert err["type"] == "exceed_context_size_error"
        assert "exceeds the available context size" in err["message"]
        assert err["n_ctx"] == n_ctx
        assert err["n_prompt_tokens"] >= n_ctx
    # Turns that worked reused the growing prefix from llama.cpp's prompt cache.
    assert all((r.cache_n or 0) > 0 for r in results[1:first])
    assert all(r.prompt_tokens < n_ctx for r in results[:first])


def test_conversation_overflows_directly(llama_log):
    results = play(llama_log.url, stream=False, turns=DEFAULT_TURNS)
    assert len(results) == DEFAULT_TURNS
    _check_overflow(results, llama_log.n_ctx)


def test_streaming_conversation_overflows_directly(llama_log):
    """llama.cpp reports a streaming overflow as a plain HTTP 400 JSON body
    (before any SSE), so the SDK raises at create(). Without include_usage the
    prompt size of the turns that worked comes from llama.cpp's ``timings``."""
    results = play(
        llama_log.url, stream=True, include_usage=False, turns=DEFAULT_TURNS,
        session_id="direct-overflow", stop_after_errors=3,
    )
    assert not results[-1].ok
    _check_overflow(results, llama_log.n_ctx)
    assert all(r.prompt_tokens for r in results if r.ok), "prompt tokens missing from usage/timings"
