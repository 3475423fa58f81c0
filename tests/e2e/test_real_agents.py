"""The real agent CLIs, unmodified, against real llama.cpp: directly and through compactor.

Claude Code 2.1.328, Codex 0.169.0, pi 0.73.1 (npm, pinned in
``tests/e2e/agents``) and hermes-agent 0.19.0 (PyPI, ``.venv-hermes``) each
hold a multi-turn conversation (``agent_cli.py``: a fresh temporary HOME,
telemetry off, each turn pastes a ~2,000-character deploy log and asks about
it, later turns with the agent's own "continue" flag).

Directly, the conversation outgrows llama.cpp's window and a turn fails
(the test shows that failure). Through compactor the same conversation must
complete, and the test checks what crossed each hop (a tap between the CLI and
compactor, one between compactor and llama.cpp):

* every turn exits 0;
* nothing over the window reaches llama.cpp (no overflow error upstream, every
  answered prompt under ``n_ctx``);
* at least one compaction (``x-compactor-action: compacted``);
* a later turn reuses its record (``x-compactor-replaced`` on a passthrough);
* the agent's own instructions (its ``system`` / ``developer`` messages, and
  the top-level ``system`` / ``instructions``) reach llama.cpp verbatim in
  every request it makes.

Every check runs and the test fails with all that did not hold, so a run states
precisely what is missing. It also prints one row of the issue's table
(direct vs through compactor: turns ok, upstream 400s, compactions, summary
calls, record reuse, instructions kept) and appends it as JSON to
``$E2E_AGENT_REPORT`` when set.

Windows: all four run against ``llama_agents`` (n_ctx 8192, replies ended by
a server grammar / token cap, see conftest.py); hermes-agent at n_ctx 2048 is
``test_hermes_agent.py``'s (see PLANS for why not here).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import pytest

from agent_cli import VERSIONS, Session, missing_binary
from upstream_tap import Exchange, UpstreamTap, start_tap

SUMMARY_PREFIXES = ("You are a summarization agent", "You are a conversation summarization assistant")


@dataclass(frozen=True)
class Plan:
    server: str  # conftest fixture
    turns: int  # at most this many turns directly; through compactor up to the failing turn + 1
    tools: bool  # False: as few tools as the CLI allows (so the server grammar ends replies)


PLANS = {
    "claude-code": Plan(server="llama_agents", turns=8, tools=False),
    "codex": Plan(server="llama_agents", turns=4, tools=False),
    "pi": Plan(server="llama_agents", turns=9, tools=False),
    # At n_ctx 2048 hermes' own instructions (~1.45k tokens with `todo`) leave
    # ~500 tokens, less than one pasted log (~1.15k: Gemma tokenizes digits
    # one by one), so every turn could only be kept by cutting its own paste
    # to a third; its capped 8k server keeps the run to a few minutes too.
    # hermes at 2048 is test_hermes_agent.py's.
    "hermes-agent": Plan(server="llama_agents", turns=8, tools=True),
}


# ---------------------------------------------------------------- request shapes

def _list(body: Any) -> list:
    if not isinstance(body, dict):
        return []
    items = body.get("messages") if "messages" in body else body.get("input")
    return items if isinstance(items, list) else []


def _texts(content: Any) -> list[str]:
    if isinstance(content, str):
        return [content]
    if isinstance(content, list):
        return [p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)]
    return []


def instructions(body: Any) -> list[list[str]]:
    """The text parts of each ``system`` / ``developer`` message inside the list, in order."""
    return [
        _texts(m.get("content"))
        for m in _list(body)
        if isinstance(m, dict) and m.get("role") in ("system", "developer")
    ]


def top_instructions(body: Any) -> Any:
    """The top-level ``system`` (Anthropic) or ``instructions`` (Responses) member."""
    if not isinstance(body, dict):
        return None
    return body.get("system", body.get("instructions"))


IN_CONTEXT_PREFIX = "You are a summarization agent now."


def is_summary_call(body: Any) -> bool:
    """A summary call: one user message opening with the summariser's preamble, or the
    conversation itself with the ask appended to its last user message (asked in context,
    for the prompt cache)."""
    items = _list(body)
    if not items or not isinstance(items[-1], dict) or items[-1].get("role") != "user":
        return False
    texts = _texts(items[-1].get("content"))
    if len(items) == 1 and texts and texts[0].startswith(SUMMARY_PREFIXES):
        return True
    return bool(texts) and any(p.startswith(IN_CONTEXT_PREFIX) for p in texts[-1].split("\n\n"))


def _kept_in_order(want: list[list[str]], have: list[list[str]]) -> bool:
    at = 0
    for w in want:
        try:
            at = have.index(w, at) + 1
        except ValueError:
            return False
    return True


def _sizes(instr: list[list[str]]) -> list[list[int]]:
    return [[len(t) for t in parts] for parts in instr]


# ---------------------------------------------------------------- one run

@dataclass
class Run:
    """What one session did, from the taps' point of view."""

    turns: list[str]
    turns_ok: int
    upstream_400s: int
    compactions: int = 0
    summary_calls: int = 0
    record_reuse: int = 0
    instructions_kept: str = "n/a"
    failed_turn: int | None = None
    failure: str = ""
    problems: list[str] = field(default_factory=list)

    def cell(self) -> str:
        return f"{self.turns_ok}/{len(self.turns)}"


def _overflowed(e: Exchange) -> bool:
    text = f"{e.error_type} {e.error_message}".lower()
    return e.status == 400 and ("exceed" in text or "context" in text or "too long" in text)


def _play(agent: str, plan: Plan, base_url: str, root: Path, turns: int) -> Session:
    session = Session(agent, base_url, root, tools=plan.tools)
    session.run(turns)
    return session


def run_direct(agent: str, plan: Plan, llama_url: str, root: Path) -> tuple[Run, list[Exchange]]:
    tap = start_tap(llama_url)
    try:
        session = _play(agent, plan, tap.url, root, plan.turns)
        asked = tap.conversations()
    finally:
        tap.close()
    run = Run(
        turns=[t.brief() for t in session.turns],
        turns_ok=sum(t.ok for t in session.turns),
        upstream_400s=sum(e.status == 400 for e in asked),
    )
    failed = next((t for t in session.turns if not t.ok), None)
    if failed is not None:
        run.failed_turn = failed.index + 1
        run.failure = failed.brief()
    return run, asked


def _client_request_of(up: Exchange, client: list[Exchange]) -> Exchange | None:
    """The client request in flight when compactor sent ``up``."""
    before = [c for c in client if c.started <= up.started]
    return before[-1] if before else None


def _check_instructions(run: Run, client: list[Exchange], asked: list[Exchange]) -> None:
    lost: list[str] = []
    agent_requests = [e for e in asked if not is_summary_call(e.json())]
    for n, up in enumerate(agent_requests, 1):
        sent = _client_request_of(up, client)
        if sent is None:
            continue
        want, got = sent.json(), up.json()
        if not _kept_in_order(instructions(want), instructions(got)):
            lost.append(
                f"upstream request {n} ({up.status}): the agent's system/developer messages "
                f"{_sizes(instructions(want))} arrived as {_sizes(instructions(got))} (bytes per text part)"
            )
        if top_instructions(got) != top_instructions(want):
            lost.append(f"upstream request {n}: the top-level system/instructions member changed")
    run.instructions_kept = "yes" if not lost else f"no ({len(lost)} of {len(agent_requests)} requests)"
    run.problems += lost


def run_via(agent: str, plan: Plan, llama_url: str, n_ctx: int, compactor, root: Path, turns: int) -> Run:
    upstream = start_tap(llama_url)
    via = compactor(upstream.url)
    client_side = start_tap(via.url)
    try:
        session = _play(agent, plan, client_side.url, root, turns)
        client = client_side.conversations()
        asked = upstream.conversations()
    finally:
        client_side.close()
        upstream.close()
    run = Run(
        turns=[t.brief() for t in session.turns],
        turns_ok=sum(t.ok for t in session.turns),
        upstream_400s=sum(e.status == 400 for e in asked),
        summary_calls=sum(is_summary_call(e.json()) for e in asked),
    )
    for t in session.turns:
        if not t.ok:
            run.problems.append(f"exits non-zero: {t.brief()}")
    if len(session.turns) < turns:
        run.problems.append(f"stopped after {len(session.turns)} of {turns} turns")
    over = [e for e in asked if _overflowed(e)]
    if over:
        run.problems.append(
            f"{len(over)} request(s) over the window reached llama.cpp: "
            + "; ".join(f"{e.prompt_tokens} tokens, {e.error_message}" for e in over[:3])
        )
    big = [e for e in asked if e.status == 200 and e.prompt_tokens is not None and e.prompt_tokens >= n_ctx]
    if big:
        run.problems.append(f"answered prompts at or over n_ctx {n_ctx}: {[e.prompt_tokens for e in big]}")
    actions = [(e.response_headers.get("x-compactor-action"), int(e.response_headers.get("x-compactor-replaced") or 0)) for e in client]
    run.compactions = sum(a == "compacted" for a, _ in actions)
    first = next((i for i, (a, _) in enumerate(actions) if a == "compacted"), None)
    if first is not None:
        run.record_reuse = sum(a == "passthrough" and r > 0 for a, r in actions[first + 1:])
    if run.compactions == 0:
        seen = sorted({str(a) for a, _ in actions})
        run.problems.append(f"no compaction: x-compactor-action on the client side was {seen}")
    elif run.record_reuse == 0:
        run.problems.append(
            f"no later turn reused the record: after the first compaction the client saw {actions[first + 1:]} "
            "(action, x-compactor-replaced)"
        )
    _check_instructions(run, client, asked)
    if run.problems:
        run.problems.append(f"compactor log tail:\n{via.log()[-3000:]}")
    return run


def _report(agent: str, n_ctx: int, direct: Run, through: Run, minutes: float) -> dict:
    row = {
        "agent": f"{agent} {VERSIONS[agent]}",
        "n_ctx": n_ctx,
        "direct": {k: v for k, v in asdict(direct).items() if k not in ("problems", "turns")},
        "compactor": {k: v for k, v in asdict(through).items() if k not in ("problems", "turns")},
        "minutes": round(minutes, 1),
    }
    print(
        f"\n| {row['agent']} | n_ctx {n_ctx} | direct: {direct.cell()} turns ok, {direct.upstream_400s} upstream 400s, "
        f"failed at turn {direct.failed_turn} | compactor: {through.cell()} turns ok, {through.upstream_400s} upstream 400s, "
        f"{through.compactions} compactions, {through.summary_calls} summary calls, record reuse {through.record_reuse}, "
        f"instructions kept: {through.instructions_kept} | {minutes:.1f} min |"
    )
    if path := os.environ.get("E2E_AGENT_REPORT"):
        with open(path, "a") as f:
            f.write(json.dumps(row) + "\n")
    return row


@pytest.mark.parametrize("agent", list(PLANS))
def test_agent_fails_directly_and_completes_through_compactor(agent, request, compactor, tmp_path):
    if why := missing_binary(agent):
        pytest.fail(why)
    import time

    started = time.monotonic()
    plan = PLANS[agent]
    llama = request.getfixturevalue(plan.server)

    direct, asked = run_direct(agent, plan, llama.url, tmp_path / "direct")
    # Directly, a turn fails because llama.cpp refuses a prompt over its window.
    assert direct.failed_turn is not None, ("the conversation never failed directly", direct.turns)
    assert any(_overflowed(e) for e in asked), (
        "no overflow error from llama.cpp", [(e.status, e.prompt_tokens, e.error_message) for e in asked])

    # Through compactor: the same conversation, one turn past the direct failure
    # (the turn after a compaction is where its record is reused).
    turns = min(direct.failed_turn + 1, plan.turns + 1)
    through = run_via(agent, plan, llama.url, llama.n_ctx, compactor, tmp_path / "via", turns)
    _report(agent, llama.n_ctx, direct, through, (time.monotonic() - started) / 60)
    assert not through.problems, f"{agent} through compactor:\n- " + "\n- ".join(through.problems)
