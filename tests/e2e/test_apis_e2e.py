"""Anthropic Messages and OpenAI Responses through compactor against the real
llama.cpp server (n_ctx 2048), with the official ``anthropic`` and ``openai``
SDKs.

llama.cpp serves both APIs natively (``/v1/messages``, ``/v1/responses``). The
270M model never writes a tool call of its own, so the tool-use rounds are
histories the client sends: ``tool_use``/``tool_result`` blocks and
``function_call``/``function_call_output`` items, without tool definitions.

Each long history is built up front (no model call per turn) and is over the
window: sent directly it fails with llama.cpp's ``exceed_context_size_error``;
through compactor it is compacted before it is sent and answered. Answers are
capped at a few tokens, so the wall time is mostly the summary calls.
"""

from __future__ import annotations

import anthropic
import openai
import pytest

from conftest import API_KEY, CLIENT_TIMEOUT_S

MAX_OUT = 8


def anthropic_client(base_url: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(
        base_url=base_url, api_key=API_KEY, max_retries=0, timeout=CLIENT_TIMEOUT_S
    )


def tool_output(i: int, size: int = 1500) -> str:
    line = f"line {i}: fn item_{i}(value: u32) -> u32 {{ value * {i} + 1 }}\n"
    return (line * (size // len(line) + 1))[:size]


def anthropic_history(rounds: int) -> list[dict]:
    """User ask → assistant text + tool_use → user tool_result → assistant text."""
    msgs: list[dict] = []
    for i in range(1, rounds + 1):
        msgs.append({"role": "user", "content": f"Step {i}: read src/file_{i}.rs and tell me what it defines."})
        msgs.append({"role": "assistant", "content": [
            {"type": "text", "text": f"I will read src/file_{i}.rs."},
            {"type": "tool_use", "id": f"toolu_{i}", "name": "read_file", "input": {"path": f"src/file_{i}.rs"}},
        ]})
        msgs.append({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": f"toolu_{i}", "content": tool_output(i)},
        ]})
        msgs.append({"role": "assistant", "content": f"src/file_{i}.rs defines item_{i}."})
    return msgs


def responses_history(rounds: int) -> list[dict]:
    items: list[dict] = []
    for i in range(1, rounds + 1):
        items.append({"type": "message", "role": "user", "content": f"Step {i}: read src/file_{i}.rs and tell me what it defines."})
        items.append({"type": "function_call", "call_id": f"call_{i}", "name": "read_file",
                      "arguments": f'{{"path":"src/file_{i}.rs"}}'})
        items.append({"type": "function_call_output", "call_id": f"call_{i}", "output": tool_output(i)})
        items.append({"type": "message", "role": "assistant",
                      "content": [{"type": "output_text", "text": f"src/file_{i}.rs defines item_{i}."}]})
    return items


LONG_ROUNDS = 3
QUESTION = "Which file defines item_3? Answer in one word."


def test_messages_small_request_matches_direct(llama_log, llama_via_compactor):
    """A small request, plain and streamed, answers the same through compactor."""
    direct = anthropic_client(llama_log.url)
    via = anthropic_client(llama_via_compactor.url)
    kw = dict(model="m", max_tokens=MAX_OUT, system="Be brief.",
              messages=[{"role": "user", "content": "Say hi"}],
              # Greedy, so direct and through compactor give the same text.
              extra_body={"temperature": 0.0})
    want = direct.messages.create(**kw)
    raw = via.messages.with_raw_response.create(**kw)
    got = raw.parse()
    assert raw.headers["x-compactor-action"] == "passthrough"
    assert [b.text for b in got.content] == [b.text for b in want.content]
    # The same prompt (llama.cpp's cache splits it differently each time).
    prompt = lambda u: u.input_tokens + (u.cache_read_input_tokens or 0)  # noqa: E731
    assert prompt(got.usage) == prompt(want.usage)
    with via.messages.stream(**kw) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert text == want.content[0].text
    assert final.usage.output_tokens > 0


def test_messages_tool_use_round(llama_log, llama_via_compactor):
    """A tool_use / tool_result round in the history goes through as sent."""
    history = anthropic_history(1)[:3]
    history[-1]["content"].append({"type": "text", "text": "What does it define?"})
    via = anthropic_client(llama_via_compactor.url)
    raw = via.messages.with_raw_response.create(model="m", max_tokens=MAX_OUT, messages=history)
    assert raw.headers["x-compactor-action"] == "passthrough"
    assert raw.parse().stop_reason in ("end_turn", "max_tokens")


def test_long_messages_conversation_overflows_direct_and_succeeds_through_compactor(
    llama_log, llama_via_compactor
):
    history = anthropic_history(LONG_ROUNDS) + [{"role": "user", "content": QUESTION}]
    with pytest.raises(anthropic.BadRequestError) as e:
        anthropic_client(llama_log.url).messages.create(model="m", max_tokens=MAX_OUT, messages=history)
    assert e.value.status_code == 400
    assert "exceeds the available context size" in str(e.value)

    via = anthropic_client(llama_via_compactor.url)
    raw = via.messages.with_raw_response.create(model="m", max_tokens=MAX_OUT, messages=history)
    assert raw.headers["x-compactor-action"] in ("compacted", "retried")
    msg = raw.parse()
    assert msg.usage.input_tokens + (msg.usage.cache_read_input_tokens or 0) < llama_log.n_ctx
    # The next turn, streamed, reuses the recorded compaction.
    history += [{"role": "assistant", "content": msg.content[0].text or "ok"},
                {"role": "user", "content": "And item_5?"}]
    with via.messages.with_streaming_response.create(
        model="m", max_tokens=MAX_OUT, messages=history, stream=True
    ) as resp:
        assert int(resp.headers.get("x-compactor-replaced", "0")) > 0 or \
            resp.headers["x-compactor-action"] == "compacted"
        body = resp.read().decode()
    assert "event: message_stop" in body


def test_long_responses_conversation_overflows_direct_and_succeeds_through_compactor(
    llama_log, llama_via_compactor
):
    items = responses_history(LONG_ROUNDS) + [{"type": "message", "role": "user", "content": QUESTION}]
    direct = openai.OpenAI(base_url=llama_log.url + "/v1", api_key=API_KEY, max_retries=0,
                           timeout=CLIENT_TIMEOUT_S)
    with pytest.raises(openai.BadRequestError) as e:
        direct.responses.create(model="m", input=items, max_output_tokens=MAX_OUT,
                                instructions="Be brief.")
    assert "exceeds the available context size" in str(e.value)

    via = llama_via_compactor.client()
    raw = via.responses.with_raw_response.create(
        model="m", input=items, max_output_tokens=MAX_OUT, instructions="Be brief."
    )
    assert raw.headers["x-compactor-action"] in ("compacted", "retried")
    resp = raw.parse()
    assert resp.status == "completed"
    assert resp.usage.input_tokens < llama_log.n_ctx
    # Streamed, the next turn: usage arrives in response.completed.
    items += [{"type": "message", "role": "user", "content": "And item_5?"}]
    stream = via.responses.create(model="m", input=items, max_output_tokens=MAX_OUT,
                                  instructions="Be brief.", stream=True)
    done = [ev for ev in stream if ev.type == "response.completed"]
    assert len(done) == 1 and done[0].response.usage.input_tokens < llama_log.n_ctx
