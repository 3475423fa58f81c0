"""The long agent conversation through compactor (issue 5), against real llama.cpp.

compactor's upstream is an ``upstream_tap`` in front of llama.cpp, so the
assertions cover every request compactor itself sends (summariser calls and
retries included), not just what the client sees.
"""

from __future__ import annotations

import os

import pytest

from conftest import free_port
from long_conversation import build_conversation, history_through, play, summarize


# Turns per run of the long conversation through compactor. At n_ctx 2048 a
# compaction makes two to four summary calls of up to ~350 tokens each (the
# summary budget follows the threshold), about 15 s on the 270M model on two
# cores; 20 turns (about ten compactions, a conversation six times the window)
# keep the four variants within a few minutes each.
COMPACTION_TURNS = 20

# A turn reuses the cached prefix when llama.cpp serves at least this share of
# the previous turn's prompt from its cache (the new turn's own messages are
# new, so they cannot be cached).
CACHE_REUSE_MIN = 0.9


@pytest.mark.parametrize(
    "stream, session",
    [(False, None), (True, None), (False, "e2e-conv-a"), (True, "e2e-conv-b")],
    ids=["json", "sse", "json-session", "sse-session"],
)
def test_long_conversation_keeps_working(llama_log, llama_tap, compactor, stream, session):
    via = compactor(llama_tap.url)
    results = play(via.url, stream=stream, session_id=session, turns=COMPACTION_TURNS)
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
    steady = [(prev, r) for prev, r in zip(results, results[1:])
              if r.compactor_action not in ("compacted", "retried") and prev.turn >= compacted[0]]
    assert steady, "no turn followed a compaction without compacting again"
    misses = [(r.turn, r.cache_n, prev.prompt_tokens) for prev, r in steady
              if (r.cache_n or 0) < CACHE_REUSE_MIN * prev.prompt_tokens]
    assert not misses, f"turns that did not reuse the cached prefix: {misses}"


# ------------------------------------------------------------ resumed conversations

def _history(turn: int) -> list[dict]:
    return history_through(build_conversation(), turn)


def _ask(client, messages, model="gemma-3-270m", **kw):
    return client.chat.completions.with_raw_response.create(
        model=model, messages=messages, max_tokens=16, temperature=0, **kw
    )


# Turn 12 of the conversation is ~8.4k tokens: four times llama.cpp's window.
RESUMED_TURN = 12
# Turn 8 (~4.7k tokens): over llama.cpp's 2048 window but under the trigger
# of compactor's default window (8192), so with discovery hidden compactor
# forwards it and learns the window from the overflow error.
UNKNOWN_WINDOW_TURN = 8
# Turn 3 (~1.7k tokens) fits the 2048 window; with the trigger capped at
# TRIGGER_CAP tokens it is over the threshold, so a compaction is attempted,
# and forwarding it unchanged (abort) still gets a real answer.
OVER_THRESHOLD_TURN = 3
TRIGGER_CAP = "threshold_tokens = 1000\n"


def test_resumed_history_over_window_compacted_proactively(llama_log, llama_tap, compactor):
    """No earlier state, window discoverable (/props): compacted before sending."""
    via = compactor(llama_tap.url)
    messages = _history(RESUMED_TURN)
    raw = _ask(via.client(), messages)
    assert raw.status_code == 200
    assert raw.headers.get("x-compactor-action") == "compacted"
    final = llama_tap.chat()[-1]
    assert final.status == 200 and final.messages < len(messages)
    assert not [e for e in llama_tap.chat() if e.error_type == "exceed_context_size_error"]


def test_resumed_history_window_unknown_uses_retry(llama_log, llama_tap, compactor):
    """Window hidden from discovery: the first attempt overflows, compactor
    learns n_ctx from the error, compacts with force and retries once."""
    llama_tap.blocked |= {"/props", "/v1/models", "/models", "/slots"}
    via = compactor(llama_tap.url)
    raw = _ask(via.client(), _history(UNKNOWN_WINDOW_TURN))
    assert raw.status_code == 200
    assert raw.headers.get("x-compactor-action") == "retried"
    chats = llama_tap.chat()
    overflows = [e for e in chats if e.error_type == "exceed_context_size_error"]
    assert len(overflows) == 1 and chats[0] is overflows[0]
    assert chats[-1].status == 200


# ------------------------------------------------------------ summariser failures

def test_unreachable_summariser_aborts(llama_log, llama_tap, compactor):
    """Network failure of the summariser: the original messages go upstream
    unchanged and the client gets the upstream's own answer."""
    closed = f"http://127.0.0.1:{free_port()}"  # bound, then closed: nothing listens
    via = compactor(
        llama_tap.url, config=f'[compaction]\n{TRIGGER_CAP}summary_endpoint = "{closed}"\n'
        'summary_api_key = "sk-summary"\n'
    )
    messages = _history(OVER_THRESHOLD_TURN)
    raw = _ask(via.client(), messages)
    assert raw.status_code == 200
    assert raw.headers.get("x-compactor-action") == "aborted"
    sent = llama_tap.chat()
    assert [e.messages for e in sent] == [len(messages)]


@pytest.mark.parametrize("summary_model", ["mock-error-500", "mock-empty"])
@pytest.mark.parametrize("abort", [False, True])
def test_failing_summariser_falls_back_or_aborts(
    llama_log, llama_tap, mock_upstream, compactor, summary_model, abort
):
    """A summariser that answers errors or nothing: deterministic fallback
    summary (request compacted anyway), or abort when configured.

    Summaries go to the mock with the request's own model. The request names
    the mock's failing model: llama.cpp serves any model name, and with no
    distinct summary model configured there is no retry on a main model
    (the reference's fallback-to-main applies only to a separate summary
    model, and would succeed here)."""
    config = (
        "[compaction]\n"
        + TRIGGER_CAP
        + f'summary_endpoint = "{mock_upstream.url}"\n'
        # Another host (port) than the upstream: it gets its own key, never
        # the client's.
        'summary_api_key = "sk-summary"\n'
        f"abort_on_summary_failure = {'true' if abort else 'false'}\n"
    )
    via = compactor(llama_tap.url, config=config)
    messages = _history(OVER_THRESHOLD_TURN)
    raw = _ask(via.client(), messages, model=summary_model)
    assert raw.status_code == 200
    assert mock_upstream.chat_requests(), "the summariser was never called"
    (sent,) = llama_tap.chat()
    if abort:
        assert raw.headers.get("x-compactor-action") == "aborted"
        assert sent.messages == len(messages)
    else:
        assert raw.headers.get("x-compactor-action") == "compacted"
        assert sent.messages < len(messages)
