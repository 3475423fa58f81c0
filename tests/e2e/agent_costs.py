"""What compaction costs each real agent: a session through compactor against a counting upstream.

For each agent (``agent_cli.py``: pinned CLI, temporary HOME, telemetry and
updates off) one session of ``--turns`` turns, each pasting ~1.5k tokens of
distinct log text (``turn_prompt``), runs through compactor against
``counting_upstream.py`` (deterministic answers; llama.cpp's token and cache
accounting at 4 characters a token; its overflow error over ``n_ctx``).

The window is the agent's fixed part plus ~3.5 turns. The fixed part is
measured, not assumed: turn 1 runs with no window (its largest request minus
the pasted prompt is the agent's own system prompt, tools and wrapping), then
the upstream gets ``n_ctx = fixed + 3.5 turns`` and the session continues
through a fresh compactor that discovers that window (``/props``) before its
first request. The agent's base URL never changes: it talks to a recording
tap whose upstream is switched from the first compactor to the second.

Measured per session (``Costs``):

* compactions (``x-compactor-action: compacted`` on the client side) and the
  turns they happened in; back-to-back compactions (a compaction on the turn
  right after one); turns per compaction; summary calls the upstream saw;
* prefix-stable share: of the upstream requests of the agent's conversation
  (keyed by its system text; summary calls excluded), the share whose prompt
  starts with the previous request's whole prompt;
* prefill: the prompt tokens the upstream evaluated without a cache hit, each
  request's tokens after its common prefix with the conversation's previous
  request (a summary call: with the request received before it), answered
  requests only;
* added: the tokens the agent itself added, computed from the client's
  requests as compactor received them (before compaction): over the session,
  the growth of each request over the previous one of its conversation (the
  first request counts whole);
* amplification = prefill / added. An agent that never compacts and whose
  requests extend each other scores 1.0; ``alone`` is the same ratio for the
  client's own requests sent straight to such an upstream (how prefix-stable
  the agent itself is).

Command line (prints a markdown table; ``--json FILE`` writes the rows)::

    .venv/bin/python tests/e2e/agent_costs.py                      # every installed agent
    .venv/bin/python tests/e2e/agent_costs.py opencode aider --turns 10
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from agent_cli import APIS, REPO, VERSIONS, Session, Turn, deploy_log, missing_binary  # noqa: E402
from counting_upstream import (  # noqa: E402
    conversation_items,
    CHARS_PER_TOKEN, Counted, common_prefix, render, start_counting_upstream, system_text, tokens_of,
)
from counting_upstream import is_summary_call  # noqa: E402,F401  (re-exported for the tests)
from upstream_tap import Exchange, start_tap  # noqa: E402

PASTE_CHARS = 6000  # ~1.5k tokens at 4 characters a token
WINDOW_TURNS = 3.5
REPLY_TOKENS = 16  # the fixed answer and its wrapping, per turn
ANSWER = "REL-42"  # in agent_mock.REPLY: a turn that printed it got the upstream's answer
TURN_TIMEOUT_S = float(os.environ.get("E2E_SHIPPED_TURN_TIMEOUT_S", "180"))
CONVERSATION_PATHS = ("/chat/completions", "/messages", "/responses")

# Every agent agent_cli.py drives, in table order; hermes-agent is left out by default (slow:
# a Python start and several requests per turn).
DEFAULT_AGENTS = ["claude-code", "codex", "pi", "opencode", "continue", "qwen-code", "qwen-code-anthropic",
                  "qwen-code-responses", "kilo", "aider"]


def turn_prompt(turn: int) -> str:
    """What the user types at ``turn``: a pasted ~6,000-character log (~1.5k tokens) and a question."""
    return (f"Here is the deploy log of run {turn + 1}:\n{deploy_log(turn, PASTE_CHARS)}\n\n"
            "What is the release tag of this run? Answer in one line.")


def turn_tokens(turn: int = 0) -> int:
    return tokens_of(turn_prompt(turn)) + REPLY_TOKENS


# ---------------------------------------------------------------- compactor outside pytest

@dataclass
class Process:
    """A compactor started by :func:`start_compactor` (the pytest fixture's equivalent)."""

    proc: subprocess.Popen
    url: str
    log_path: Path

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)


def compactor_bin() -> Path:
    return Path(os.environ.get("COMPACTOR_BIN", REPO / "target" / "debug" / "compactor"))


def start_compactor(upstream: str, workdir: Path, binary: Path | None = None,
                    env: dict[str, str] | None = None) -> Process:
    """The pytest fixture's equivalent: a free port, its own store file, healthy before it returns."""
    workdir.mkdir(parents=True, exist_ok=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    full = {**os.environ, "RUST_LOG": os.environ.get("RUST_LOG", "info"),
            "COMPACTOR_LISTEN": f"127.0.0.1:{port}", "COMPACTOR_UPSTREAM": upstream,
            "COMPACTOR_STORE_PATH": str(workdir / "state.log"), **(env or {})}
    log_path = workdir / "stderr.log"
    with log_path.open("ab") as log:
        proc = subprocess.Popen([str(binary or compactor_bin())], cwd=workdir, env=full, stdin=subprocess.DEVNULL,
                                stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            with urllib.request.urlopen(url + "/_compactor/health", timeout=1) as r:
                if r.status == 200:
                    return Process(proc, url, log_path)
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"compactor did not start:\n{log_path.read_text(errors='replace')[-2000:]}")


# ---------------------------------------------------------------- one session

@dataclass
class SessionRun:
    """What one session did: the agent's turns and both hops' requests, each with its turn (0-based)."""

    agent: str
    turns: list[Turn]
    fixed: int
    n_ctx: int
    client: list[tuple[int, Exchange]]
    upstream: list[tuple[int, Counted]]
    compactor_log: str = ""


def _is_conversation(path: str) -> bool:
    p = path.split("?")[0].rstrip("/")
    return p.endswith(CONVERSATION_PATHS) and not p.endswith("/count_tokens")


def run_session(agent: str, turns: int, root: Path,
                start: Callable[[str, Path], Any] | None = None) -> SessionRun:
    """``turns`` turns of ``agent`` through compactor (``start(upstream_url, workdir)`` starts one;
    default :func:`start_compactor`) against a counting upstream, the window set after turn 1."""
    start = start or start_compactor
    up = start_counting_upstream(None)
    first = start(up.url, root / "compactor1")
    tap = start_tap(first.url)
    second = None
    marks_client: list[int] = []
    marks_up: list[int] = []

    def mark() -> None:
        with tap.lock:
            marks_client.append(len(tap.exchanges))
        with up.lock:
            marks_up.append(len(up.requests))

    try:
        session = Session(agent, tap.url, root / "agent", tools=True, timeout_s=TURN_TIMEOUT_S)
        mark()
        t1 = session.run_turn(turn_prompt(0))
        main = [r for r in up.conversation_requests() if not r.summary and r.status == 200]
        if not t1.ok or not main:
            fixed = 0
            n_ctx = 0
        else:
            fixed = max(r.tokens for r in main) - tokens_of(turn_prompt(0))
            n_ctx = fixed + math.ceil(WINDOW_TURNS * turn_tokens())
            up.n_ctx = n_ctx
            second = start(up.url, root / "compactor2")
            tap.upstream = second.url
            for n in range(1, turns):
                mark()
                if not session.run_turn(turn_prompt(n)).ok:
                    break
        client = tap.conversations()
        with up.lock:
            counted = list(up.requests)
    finally:
        tap.close()
        up.close()

    def turn_of(i: int, marks: list[int]) -> int:
        return max(n for n, m in enumerate(marks) if m <= i)

    position = {id(e): i for i, e in enumerate(tap.exchanges)}
    run = SessionRun(
        agent=agent, turns=session.turns, fixed=fixed, n_ctx=n_ctx,
        client=[(turn_of(position[id(e)], marks_client), e) for e in client],
        upstream=[(turn_of(r.index, marks_up), r) for r in counted if r.conversation],
    )
    logs = [c.log() for c in (first, second) if c is not None]
    run.compactor_log = "\n".join(logs)
    if start is start_compactor:
        for c in (first, second):
            if c is not None:
                c.stop()
    return run


# ---------------------------------------------------------------- what it cost

@dataclass
class Costs:
    agent: str
    version: str
    api: str
    fixed: int
    n_ctx: int
    turns: int
    turns_ok: int
    compaction_turns: list[int] = field(default_factory=list)  # 1-based, one entry per compaction
    back_to_back: int = 0
    summary_calls: int = 0
    prefix_stable: float = 1.0
    prefill: int = 0
    added: int = 0
    alone: float = 1.0
    upstream_400s: int = 0
    seconds: float = 0.0

    @property
    def compactions(self) -> int:
        return len(self.compaction_turns)

    @property
    def amplification(self) -> float:
        return self.prefill / self.added if self.added else float("nan")

    @property
    def turns_per_compaction(self) -> float | None:
        return self.turns / self.compactions if self.compactions else None

    def row(self) -> dict:
        return {**asdict(self), "compactions": self.compactions, "amplification": round(self.amplification, 3),
                "turns_per_compaction": self.turns_per_compaction}


def _prompt_of(body: bytes) -> tuple[str, str, bool] | None:
    try:
        req = json.loads(body) if body else None
    except ValueError:
        return None
    if not isinstance(req, dict):
        return None
    return system_text(req), render(req), is_summary_call(req)


def costs(run: SessionRun) -> Costs:
    c = Costs(agent=run.agent, version=VERSIONS.get(run.agent, "?"), api=APIS.get(run.agent, "?"),
              fixed=run.fixed, n_ctx=run.n_ctx, turns=len(run.turns), turns_ok=sum(t.ok for t in run.turns),
              seconds=sum(t.seconds for t in run.turns))
    # Compactions, by turn.
    c.compaction_turns = sorted(t + 1 for t, e in run.client
                                if e.response_headers.get("x-compactor-action") == "compacted")
    turns_with = sorted(set(c.compaction_turns))
    c.back_to_back = sum(1 for t in turns_with if t - 1 in turns_with)
    # The upstream side: summary calls, prefix stability, prefill.
    ups = [r for _, r in run.upstream]
    c.summary_calls = sum(r.summary for r in ups)
    c.upstream_400s = sum(r.status == 400 for r in ups)
    c.prefill = sum(r.uncached for r in ups if r.status == 200)
    last: dict[str, str] = {}
    stable = compared = 0
    for r in ups:
        if r.summary or r.status != 200:
            continue
        if r.key in last:
            compared += 1
            stable += r.prompt.startswith(last[r.key])
        last[r.key] = r.prompt
    c.prefix_stable = stable / compared if compared else 1.0
    # The client side: what the agent added, and what it would cost sent straight upstream.
    size: dict[str, int] = {}
    prev: dict[str, str] = {}
    alone = 0
    for _, e in run.client:
        if e.method != "POST" or not _is_conversation(e.path) or e.status != 200:
            continue
        parsed = _prompt_of(e.body)
        if parsed is None:
            continue
        key, prompt, _summary = parsed
        tok = tokens_of(prompt)
        c.added += max(0, tok - size.get(key, 0))
        alone += tok - common_prefix(prev.get(key, ""), prompt) // CHARS_PER_TOKEN
        size[key] = tok
        prev[key] = prompt
    c.alone = alone / c.added if c.added else float("nan")
    return c


HEADER = ("| agent | API | fixed | n_ctx | turns ok | compactions (at turns) | back-to-back | turns/compaction "
          "| summary calls | prefix-stable | prefill | added | amplification | alone | s |\n"
          "|---|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")


def table_row(c: Costs) -> str:
    tpc = f"{c.turns_per_compaction:.1f}" if c.turns_per_compaction else "-"
    at = ",".join(map(str, c.compaction_turns)) or "-"
    return (f"| {c.agent} {c.version} | {c.api} | {c.fixed} | {c.n_ctx} | {c.turns_ok}/{c.turns} | "
            f"{c.compactions} ({at}) | {c.back_to_back} | {tpc} | {c.summary_calls} | {c.prefix_stable:.0%} | "
            f"{c.prefill} | {c.added} | {c.amplification:.2f} | {c.alone:.2f} | {c.seconds:.0f} |")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("agents", nargs="*", help=f"default: {' '.join(DEFAULT_AGENTS)}")
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--json", help="write the rows (and each session's turns) to this file")
    ap.add_argument("--keep", action="store_true", help="keep the temporary directories")
    args = ap.parse_args(argv)
    agents = args.agents or DEFAULT_AGENTS
    if not compactor_bin().is_file():
        print(f"compactor binary not found at {compactor_bin()}: set COMPACTOR_BIN", file=sys.stderr)
        return 2
    rows = []
    print(HEADER, flush=True)
    for agent in agents:
        if why := missing_binary(agent):
            print(f"| {agent} | not installed: {why} |", flush=True)
            continue
        root = Path(tempfile.mkdtemp(prefix=f"costs-{agent}-"))
        try:
            run = run_session(agent, args.turns, root)
            c = costs(run)
            print(table_row(c), flush=True)
            failed = [t.brief() for t in run.turns if not t.ok]
            if failed:
                print(f"<!-- {agent}: {failed[0][:400]} -->", flush=True)
            rows.append({**c.row(), "failed": failed})
        finally:
            if args.keep:
                print(f"<!-- {agent}: kept {root} -->", file=sys.stderr)
            else:
                shutil.rmtree(root, ignore_errors=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0 if all(r["turns_ok"] == r["turns"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
