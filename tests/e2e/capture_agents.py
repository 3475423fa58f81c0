"""Record what the real agent CLIs send: the fixtures under ``tests/fixtures/agents``.

Each agent (``agent_cli.py``: pinned versions, temporary HOME, telemetry off)
runs a three-turn session against ``agent_mock.py``, which records every
request and answers it with a short complete reply. Every chat request is
saved as one JSON file, ``tests/fixtures/agents/<agent>/turn<N>.json``::

    {"agent", "version", "command", "turn", "method", "path", "headers", "body"}

``body`` is the request body as the agent sent it, as a string (so its bytes
are kept: key order, escapes, spacing), with the machine-specific strings
replaced: the temporary HOME and project paths by ``/home/user`` and
``/home/user/project``, the credential by a dummy, per-install identifiers
(Claude Code's ``device_id``, Codex's ``installation_id``) by zeros.
``headers`` are all request headers but the hop/transport ones (``Host``,
``Content-Length``, ``Connection``, ``Accept-Encoding``), same replacements.

    .venv/bin/python tests/e2e/capture_agents.py            # all four agents
    .venv/bin/python tests/e2e/capture_agents.py codex pi   # some
"""

from __future__ import annotations

import json
import re
import shutil
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from agent_cli import VERSIONS, Session, missing_binary  # noqa: E402
from agent_mock import start_agent_mock  # noqa: E402

OUT = HERE.parent / "fixtures" / "agents"
TURNS = 3
# The agents whose requests tests/fixtures/agents holds (any agent of agent_cli.py can be named).
CAPTURED = ["claude-code", "codex", "pi", "hermes-agent"]
CHAT_PATHS = ("/v1/messages", "/v1/responses", "/v1/chat/completions")
DROP_HEADERS = {"host", "content-length", "connection", "accept-encoding"}
HOME = "/home/user"


def _normaliser(session: Session):
    root = str(session.root)
    subs = [
        (str(session.project), f"{HOME}/project"),
        (str(session.home), HOME),
        (str(session.root / "tmp"), "/tmp"),
        (root, HOME),
    ]
    # The same paths as JSON-escaped or URL-ish variants are not expected; the
    # session directory names seen by the agent's own mangling are.
    mangled = str(session.project).replace("/", "-")

    def norm(text: str) -> str:
        for old, new in subs:
            text = text.replace(old, new)
        text = text.replace(mangled, f"{HOME}/project".replace("/", "-"))
        # Per-install identifiers: a device hash (Claude Code), an installation id (Codex).
        text = re.sub(r'(device_id\\?":\\?")[0-9a-f]{64}', lambda m: m.group(1) + "0" * 64, text)
        text = re.sub(
            r'(installation_id\\?":\\?"|x-codex-installation-id\\?":\\?")[0-9a-f-]{36}',
            lambda m: m.group(1) + "00000000-0000-0000-0000-000000000000",
            text,
        )
        return text

    return norm


def capture(agent: str) -> list[Path]:
    if why := missing_binary(agent):
        raise SystemExit(why)
    mock = start_agent_mock()
    root = Path(tempfile.mkdtemp(prefix=f"capture-{agent}-"))
    written: list[Path] = []
    try:
        session = Session(agent, mock.url, root)
        norm = _normaliser(session)
        commands: list[list[str]] = []
        per_turn: list[list] = []
        for _ in range(TURNS):
            before = len(mock.requests)
            turn = session.run_turn()
            if not turn.ok:
                raise SystemExit(f"{agent}: {turn.brief()}")
            commands.append(turn.argv)
            per_turn.append(mock.requests[before:])
        dest = OUT / agent
        if dest.exists():
            shutil.rmtree(dest)
        dest.mkdir(parents=True)
        for index, (argv, requests) in enumerate(zip(commands, per_turn)):
            chats = [r for r in requests if r.path.split("?")[0] in CHAT_PATHS]
            for k, req in enumerate(chats):
                suffix = "" if len(chats) == 1 else f"_{k + 1}"
                doc = {
                    "agent": agent,
                    "version": VERSIONS[agent],
                    # The prompt (the pasted log) is in the body; the command shows the flags.
                    "command": [Path(argv[0]).name, *(a if len(a) < 200 else "<prompt>" for a in argv[1:])],
                    "turn": index + 1,
                    "method": req.method,
                    "path": req.path,
                    "headers": {k2: norm(v) for k2, v in req.headers if k2.lower() not in DROP_HEADERS},
                    "body": norm(req.body.decode()),
                }
                path = dest / f"turn{index + 1}{suffix}.json"
                path.write_text(json.dumps(doc, indent=1, ensure_ascii=False) + "\n")
                written.append(path)
            others = sorted({f"{r.method} {r.path}" for r in requests if r.path.split('?')[0] not in CHAT_PATHS})
            if others:
                print(f"{agent} turn {index + 1}: also {others}")
    finally:
        mock.close()
        shutil.rmtree(root, ignore_errors=True)
    return written


def main(argv: list[str]) -> int:
    for agent in argv or CAPTURED:
        for path in capture(agent):
            print(path.relative_to(HERE.parents[1]), path.stat().st_size)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
