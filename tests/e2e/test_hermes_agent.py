"""hermes-agent itself, at n_ctx 2048: directly its run fails, through compactor it completes.

hermes-agent 0.19.0 (``.venv-hermes``, made by ``scripts/setup_e2e.sh``: it pins
an openai SDK this suite's venv cannot share) runs one non-interactive task,
``hermes -z PROMPT``, against the suite's llama.cpp server: its real system
prompt (about 1.4k tokens here) and ``file`` tools, and a user who pastes a
deploy log (about 1.9k tokens) and asks for the release tag. The first request
is past the 2,048-token window with nothing older to compact; every later one
(hermes asks the model to continue whenever it stops at ``max_tokens``, which
the 270M model always does) carries its growing history.

hermes is configured as a user on a small local model has to: a
``model.context_length`` override (it refuses windows under 64K otherwise),
``model.max_tokens: 256``, its own compression off (so what keeps the run
inside the window is compactor, not hermes reacting to overflow errors) and no
API-level retries (so no failure is hidden by a retry).

Two taps record what crosses each hop: hermes → compactor (what the client
got) and compactor → llama.cpp (what the upstream was asked).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from conftest import REPO
from upstream_tap import start_tap

HERMES = Path(os.environ.get("HERMES_BIN", REPO / ".venv-hermes" / "bin" / "hermes"))
MAX_TOKENS = 256
# One run of hermes: up to five chat requests (the answer and four
# continuations), each up to a 256-token reply and its summary calls.
RUN_TIMEOUT_S = 1500
RELEASE_TAG = "REL-42"


def _prompt() -> str:
    lines = [f"{i:03d} deploy step {i}: sync shard {i % 17} to region eu-{i % 5}, ok" for i in range(1, 90)]
    lines.insert(40, f"041 release tag: {RELEASE_TAG}")
    return "Here is the deploy log:\n" + "\n".join(lines) + "\n\nWhat is the release tag?"


def _run_hermes(home: Path, base_url: str) -> tuple[subprocess.CompletedProcess, dict]:
    """One ``hermes -z`` run against ``base_url``; its output and usage report."""
    if not HERMES.is_file():
        pytest.fail(f"hermes-agent not found at {HERMES}: run `bash scripts/setup_e2e.sh`")
    home.mkdir()
    (home / "config.yaml").write_text(
        "model:\n"
        "  provider: custom\n"
        f"  base_url: {base_url}/v1\n"
        "  default: gemma-3-270m\n"
        "  context_length: 64000\n"
        f"  max_tokens: {MAX_TOKENS}\n"
        "compression:\n"
        "  enabled: false\n"
        "agent:\n"
        "  api_max_retries: 0\n"
    )
    usage = home / "usage.json"
    env = {**os.environ, "HERMES_HOME": str(home), "OPENAI_API_KEY": "sk-e2e-test-key"}
    proc = subprocess.run(
        [str(HERMES), "-z", _prompt(), "-t", "file", "--safe-mode", "--usage-file", str(usage)],
        cwd=home, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True,
        timeout=RUN_TIMEOUT_S,
    )
    report = json.loads(usage.read_text()) if usage.is_file() else {}
    return proc, report


def test_hermes_agent_run_fails_directly_and_completes_through_compactor(
    llama, compactor, tmp_path
):
    # Directly: the first request is past the window and llama.cpp refuses it.
    direct = start_tap(llama.url)
    try:
        proc, report = _run_hermes(tmp_path / "direct", direct.url)
        chats = direct.chat()
    finally:
        direct.close()
    assert report.get("failed") is True, (report, proc.stdout[-2000:], proc.stderr[-2000:])
    assert chats and chats[0].status == 400 and chats[0].error_type == "exceed_context_size_error", chats
    assert chats[0].prompt_tokens > llama.n_ctx
    assert not any(c.status == 200 for c in chats), chats

    # Through compactor: the same run completes.
    upstream = start_tap(llama.url)
    via = compactor(upstream.url)
    client_side = start_tap(via.url)
    try:
        proc, report = _run_hermes(tmp_path / "via", client_side.url)
        got = client_side.chat()
        asked = upstream.chat()
    finally:
        client_side.close()
        upstream.close()
    context = (report, proc.stdout[-2000:], proc.stderr[-2000:], via.log()[-6000:])
    assert proc.returncode == 0, context
    assert report.get("failed") is False, context
    assert proc.stdout.strip(), context
    assert "Context overflow" not in proc.stdout, context
    # Every request hermes made was answered, the first one included.
    assert got and report.get("api_calls") == len(got), (got, context)
    assert all(c.status == 200 for c in got), (got, context)
    # What llama.cpp answered fitted its window; what it refused was
    # compacted and retried, never handed back.
    answered = [c for c in asked if c.status == 200]
    assert len(answered) >= len(got), asked
    assert all(c.prompt_tokens is not None and c.prompt_tokens < llama.n_ctx for c in answered), asked
    assert all(c.status in (200, 400) for c in asked), asked
    # The first request had nothing older to compact: the last resort cut
    # the pasted log (its question, at the end, kept).
    assert "largest messages shortened to fit the window" in via.log_path.read_text(), context
