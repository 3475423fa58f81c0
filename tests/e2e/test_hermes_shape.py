"""hermes-agent's request shape at n_ctx 2048, direct and through compactor.

hermes-agent itself runs in ``test_hermes_agent.py``; the 270M model never
calls a tool there, so its run has no tool round. This replays one, from
``fixtures/hermes_agent_request.json``: its real system prompt and the
schemas of its ``file`` toolset (about 1.5k tokens before any turn), then its
second request, after a ``read_file`` call whose output the window cannot
also hold.

Directly, llama.cpp rejects the second request with its overflow error;
through compactor, with nothing older to compact, the last resort shortens
the tool output and the request is answered.
"""

from __future__ import annotations

import json
from pathlib import Path

import openai
import pytest

from conftest import openai_client

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "hermes_agent_request.json"
ASK = "Read /home/user/project/deploy.txt and tell me the release tag."
# Output tokens per request: small, the test is about the prompt (hermes
# asks for its configured model.max_tokens, up to the window's rest).
MAX_TOKENS = 16
# How far past the window the second request's prompt is sized to go, and
# the characters per token of the tool output (numbered lines tokenize
# densely: about 2.7 on the test model).
OVERSHOOT_TOKENS = 300
OUTPUT_CHARS_PER_TOKEN = 3


def _hermes() -> dict:
    return json.loads(FIXTURE.read_text())


def _first(h: dict) -> list[dict]:
    return [{"role": "system", "content": h["system"]}, {"role": "user", "content": ASK}]


def _second(h: dict, output_chars: int) -> list[dict]:
    lines, i = [], 0
    while sum(len(l) + 1 for l in lines) < output_chars:
        i += 1
        lines.append(f"{i}|deploy step {i}: sync shard {i % 17} to region eu-{i % 5}, ok")
    lines.insert(2, "3|release tag: REL-42")
    call = {"id": "call_1", "type": "function",
            "function": {"name": "read_file", "arguments": json.dumps({"path": "/home/user/project/deploy.txt"})}}
    return _first(h) + [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "\n".join(lines)},
    ]


def _create(client: openai.OpenAI, h: dict, messages: list[dict]):
    # tool_choice "none": the tools are part of the prompt, the round is
    # scripted and the model's free text is never searched for a call.
    return client.chat.completions.with_raw_response.create(
        model="m", messages=messages, tools=h["tools"], tool_choice="none",
        max_tokens=MAX_TOKENS, temperature=0, seed=7,
    )


def test_hermes_second_request_overflows_directly_and_is_answered_through_compactor(
    llama, llama_direct, compactor
):
    h = _hermes()
    # hermes-agent's first request, through compactor as its run would send
    # it: it fits, and compactor learns how the upstream counts this shape.
    via = compactor(llama.url)
    client = openai_client(via.url)
    first = _create(client, h, _first(h)).parse()
    fixed = first.usage.prompt_tokens
    assert 900 < fixed < llama.n_ctx - MAX_TOKENS, f"fixed part {fixed} tokens"

    # Sized from the fixed part so the whole prompt is past the window.
    second = _second(h, (llama.n_ctx - fixed + OVERSHOOT_TOKENS) * OUTPUT_CHARS_PER_TOKEN)
    with pytest.raises(openai.BadRequestError) as e:
        _create(llama_direct, h, second)
    err = e.value.body if isinstance(e.value.body, dict) else {}
    err = err.get("error", err)
    assert err.get("type") == "exceed_context_size_error", e.value.body
    assert err.get("n_prompt_tokens", 0) >= llama.n_ctx

    raw = _create(client, h, second)
    answer = raw.parse()
    assert raw.headers.get("x-compactor-action") in ("compacted", "retried"), dict(raw.headers)
    assert answer.choices and answer.choices[0].finish_reason in ("stop", "length")
    assert answer.usage.prompt_tokens < llama.n_ctx
    assert answer.usage.prompt_tokens >= fixed, "the system prompt and tools were kept"
