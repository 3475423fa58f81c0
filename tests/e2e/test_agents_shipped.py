"""The agents as they ship, each a session through compactor against a deterministic upstream.

opencode, Continue CLI, qwen-code (on chat completions, Anthropic Messages and
Responses), Kilo CLI (npm, pinned in ``tests/e2e/agents``) and aider (PyPI,
``.venv-aider``), each run unmodified in a temporary HOME with telemetry and
updates off (``agent_cli.py``), hold a session of six turns,
each pasting ~1.5k tokens of distinct log text (``agent_costs.turn_prompt``).
The upstream is ``counting_upstream.py``: a fixed short answer (no tool
call, so every turn ends after one request), llama.cpp's token and cache
accounting, and its overflow error over ``n_ctx``, where ``n_ctx`` is the
agent's fixed part (measured from its first turn) plus ~3.5 turns
(``agent_costs.run_session``). So a session outgrows the window around its
fourth turn, and compactor must keep it inside.

Checked per agent, every check run and all failures reported together:

* every turn's CLI exits 0 and prints the upstream's answer;
* no request over the window reaches the upstream (no overflow error, every
  answered prompt under ``n_ctx``);
* at least one compaction (``x-compactor-action: compacted``, a summary call,
  or fewer messages upstream than the agent sent);
* the agent's own system/developer texts and its top-level ``system`` /
  ``instructions`` reach the upstream byte-identical in every request;
* tool-call pairing: every tool result the upstream sees follows its call.

Each test prints its row of ``agent_costs.py``'s table.
"""

from __future__ import annotations

from typing import Any

import pytest

from agent_cli import missing_binary
from agent_costs import ANSWER, SessionRun, costs, is_summary_call, table_row, HEADER, run_session
from counting_upstream import conversation_items
from test_real_agents import _kept_in_order, _sizes, instructions, top_instructions

AGENTS = ["opencode", "continue", "qwen-code", "qwen-code-anthropic", "qwen-code-responses", "kilo", "aider"]
TURNS = 6


def tool_pairing_problems(body: Any) -> list[str]:
    """Tool results whose call is not before them in the same request (chat, Messages, Responses)."""
    if not isinstance(body, dict):
        return []
    calls: set[Any] = set()
    out = []
    for i, m in enumerate(conversation_items(body)):
        if not isinstance(m, dict):
            continue
        for tc in m.get("tool_calls") or []:
            if isinstance(tc, dict):
                calls.add(tc.get("id"))
        if m.get("role") == "tool" and m.get("tool_call_id") not in calls:
            out.append(f"item {i}: tool result {m.get('tool_call_id')!r} before/without its call")
        content = m.get("content")
        for part in content if isinstance(content, list) else []:
            if not isinstance(part, dict):
                continue
            if part.get("type") == "tool_use":
                calls.add(part.get("id"))
            elif part.get("type") == "tool_result" and part.get("tool_use_id") not in calls:
                out.append(f"item {i}: tool_result {part.get('tool_use_id')!r} before/without its tool_use")
        if m.get("type") == "function_call":
            calls.add(m.get("call_id"))
        elif m.get("type") == "function_call_output" and m.get("call_id") not in calls:
            out.append(f"item {i}: function_call_output {m.get('call_id')!r} before/without its function_call")
    return out


def problems(run: SessionRun, turns: int) -> list[str]:
    out: list[str] = []
    for t in run.turns:
        if not t.ok:
            out.append(f"exits non-zero: {t.brief()}")
        elif ANSWER not in t.stdout + t.stderr:
            out.append(f"turn {t.index + 1}: no answer printed: {(t.stdout + t.stderr)[-400:]!r}")
    if len(run.turns) < turns:
        out.append(f"stopped after {len(run.turns)} of {turns} turns")
    if run.n_ctx <= 0:
        out.append("no window: turn 1 made no answered request to measure the fixed part from")
        return out
    windowed = [r for t, r in run.upstream if t >= 1]
    over = [r for r in windowed if r.status == 400]
    if over:
        out.append(f"{len(over)} request(s) over the window n_ctx {run.n_ctx} reached the upstream: "
                   f"{[r.tokens for r in over]}")
    big = [r.tokens for r in windowed if r.status == 200 and r.tokens >= run.n_ctx]
    if big:
        out.append(f"answered prompts at or over n_ctx {run.n_ctx}: {big}")
    # A compaction, seen from either side.
    client = [e for _, e in run.client]
    compacted = sum(e.response_headers.get("x-compactor-action") == "compacted" for e in client)
    summaries = sum(r.summary for _, r in run.upstream)
    fewer = 0
    for _, up in run.upstream:
        sent = _client_request_of(up.started, client)
        if sent is not None and not up.summary:
            a, b = conversation_items(up.json() or {}), conversation_items(sent.json() or {})
            fewer += len(a) < len(b)
    if not (compacted or summaries or fewer):
        actions = sorted({str(e.response_headers.get("x-compactor-action")) for e in client})
        out.append(f"no compaction: x-compactor-action {actions}, no summary call, no shortened request")
    # The agent's own instructions, verbatim, in every request; tool pairing.
    agent_requests = [r for _, r in run.upstream if not r.summary]
    for n, up in enumerate(agent_requests, 1):
        sent = _client_request_of(up.started, client)
        want, got = (sent.json() if sent else None), up.json()
        if want is not None:
            if not _kept_in_order(instructions(want), instructions(got)):
                out.append(f"upstream request {n}: the agent's system/developer messages "
                           f"{_sizes(instructions(want))} arrived as {_sizes(instructions(got))} (bytes per part)")
            if top_instructions(got) != top_instructions(want):
                out.append(f"upstream request {n}: the top-level system/instructions member changed")
        for p in tool_pairing_problems(got):
            out.append(f"upstream request {n}: {p}")
    return out


def _client_request_of(started: float, client: list) -> Any:
    """The client request in flight when the upstream request started."""
    before = [c for c in client if c.started <= started and not is_summary_call(c.json())]
    return before[-1] if before else None


@pytest.mark.parametrize("agent", AGENTS)
def test_agent_session_through_compactor(agent, compactor, tmp_path):
    if why := missing_binary(agent):
        pytest.fail(why)
    run = run_session(agent, TURNS, tmp_path, start=lambda url, _workdir: compactor(url))
    print(f"\n{HEADER}\n{table_row(costs(run))}")
    found = problems(run, TURNS)
    assert not found, f"{agent} through compactor:\n- " + "\n- ".join(found)
