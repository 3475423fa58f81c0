"""The real agent CLIs, run the way a user runs them, one turn at a time.

Claude Code, Codex and pi come from npm (``tests/e2e/agents``, pinned by its
``package-lock.json`` and installed by ``scripts/setup_e2e.sh`` with ``npm ci``;
the native binaries of Claude Code and Codex are npm optional dependencies),
hermes-agent from PyPI (``.venv-hermes``). Each session gets a fresh
temporary HOME (config, sessions, caches: nothing of the user's is read or
written) and runs with telemetry, update checks and other nonessential
traffic off, so every request it makes goes to ``base_url``.

A session is a few turns of the agent's own "continue the last
conversation" command:

* Claude Code: ``claude -p PROMPT``, then ``claude -p --continue PROMPT``
  (``ANTHROPIC_BASE_URL``; its own compaction off, ``DISABLE_COMPACT=1``);
* Codex: ``codex exec PROMPT``, then ``codex exec resume --last PROMPT``
  (a ``wire_api = "responses"`` provider, as in the README);
* pi: ``pi -p PROMPT``, then ``pi -c -p PROMPT`` (an ``openai-completions``
  provider in ``models.json``);
* hermes-agent: ``hermes chat -Q -q PROMPT``, then the same with
  ``--continue`` (a ``custom`` provider; its own compression on, ``-t todo``,
  ``context_length: 65536``);
* the agents of ``test_agents_shipped.py`` and ``agent_costs.py``: opencode
  and Kilo (``run``, then ``run -c``), Continue (``cn -p``, then
  ``--resume``), qwen-code on each of its three APIs (``qwen PROMPT``, then
  ``-c``), aider (``--message-file``, then ``--restore-chat-history``); see
  the README for each one's settings.

``tools=False`` runs the agent with as few tools as its CLI allows
(Claude Code ``--tools ""``, pi ``--no-tools``, Codex with its optional tool
features off; hermes keeps ``todo``): a request without tools gets the
server-default grammar of the e2e llama.cpp (see ``test_real_agents.py``).

Also a command line, to try an agent against any base URL::

    .venv/bin/python tests/e2e/agent_cli.py claude-code http://127.0.0.1:4000 --turns 3
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
NPM_BIN = HERE / "agents" / "node_modules" / ".bin"
HERMES_BIN = Path(os.environ.get("HERMES_BIN", REPO / ".venv-hermes" / "bin" / "hermes"))
AIDER_BIN = Path(os.environ.get("AIDER_BIN", REPO / ".venv-aider" / "bin" / "aider"))
MODEL = "gemma-3-270m"
# Dummies: nothing real is ever needed (the upstream is local) and none is read from the host.
ANTHROPIC_KEY = "sk-ant-e2e-dummy"
OPENAI_KEY = "sk-e2e-dummy"
VERSIONS = {
    "claude-code": "2.1.328",
    "codex": "0.169.0",
    "pi": "0.73.1",
    "hermes-agent": "0.19.0",
    "opencode": "1.18.33",
    "continue": "1.5.47",
    "qwen-code": "0.24.4",
    "qwen-code-anthropic": "0.24.4",
    "qwen-code-responses": "0.24.4",
    "kilo": "7.7.7",
    "aider": "0.86.2",
}
# The API each agent speaks in this suite's configuration.
APIS = {
    "claude-code": "messages", "codex": "responses", "pi": "chat", "hermes-agent": "chat",
    "opencode": "chat", "continue": "chat", "qwen-code": "chat", "qwen-code-anthropic": "messages",
    "qwen-code-responses": "responses", "kilo": "chat", "aider": "chat",
}
TURN_TIMEOUT_S = float(os.environ.get("E2E_AGENT_TURN_TIMEOUT_S", "1200"))


def deploy_log(turn: int, chars: int = 2000) -> str:
    """A ~``chars``-character deploy log for ``turn`` (distinct per turn), its release tag inside."""
    lines: list[str] = []
    i = 0
    tag = f"REL-{turn + 1}{turn + 4}"
    while sum(len(line) + 1 for line in lines) < chars:
        i += 1
        if i == 12:
            lines.append(f"2026-11-{turn + 10:02d}T10:{i:02d}:00Z deploy[{4100 + turn}]: release tag {tag}")
            continue
        lines.append(
            f"2026-11-{turn + 10:02d}T10:{i:02d}:00Z deploy[{4100 + turn}]: step {i} sync shard "
            f"{(i * 7 + turn) % 17} to eu-{i % 5} ok ({(i * 37 + turn * 11) % 900 + 100} ms)"
        )
    return "\n".join(lines)


def turn_prompt(turn: int) -> str:
    """What the user types at ``turn``: a pasted log (~2,000 characters) and a question."""
    return f"Here is the deploy log of run {turn + 1}:\n{deploy_log(turn)}\n\nWhat is the release tag of this run?"


@dataclass
class Turn:
    index: int
    argv: list[str]
    returncode: int
    stdout: str
    stderr: str
    seconds: float

    @property
    def ok(self) -> bool:
        return self.returncode == 0

    def brief(self) -> str:
        tail = (self.stderr.strip() or self.stdout.strip())[-600:]
        return f"turn {self.index + 1}: exit {self.returncode} in {self.seconds:.0f}s: {tail}"


@dataclass
class Session:
    """One agent conversation in its own temporary HOME, pointed at ``base_url``."""

    agent: str
    base_url: str
    root: Path
    tools: bool = True
    turns: list[Turn] = field(default_factory=list)
    # Longest turn; the agents against a mock upstream need far less than a CPU model does.
    timeout_s: float = TURN_TIMEOUT_S

    @property
    def home(self) -> Path:
        return self.root / "home"

    @property
    def project(self) -> Path:
        return self.root / "project"

    def __post_init__(self) -> None:
        self.base_url = self.base_url.rstrip("/")
        self.home.mkdir(parents=True, exist_ok=True)
        self.project.mkdir(parents=True, exist_ok=True)
        SETUP[self.agent](self)

    def env(self) -> dict[str, str]:
        base = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": str(self.home),
            "TERM": "dumb",
            "LANG": "C.UTF-8",
            "TMPDIR": str(self.root / "tmp"),
            "NO_COLOR": "1",
        }
        (self.root / "tmp").mkdir(exist_ok=True)
        return {**base, **ENV[self.agent](self)}

    def argv(self, turn: int, prompt: str) -> list[str]:
        return ARGV[self.agent](self, turn, prompt)

    def run_turn(self, prompt: str | None = None) -> Turn:
        index = len(self.turns)
        argv = self.argv(index, prompt if prompt is not None else turn_prompt(index))
        started = time.monotonic()
        try:
            proc = subprocess.run(
                argv, cwd=self.project, env=self.env(), stdin=subprocess.DEVNULL,
                capture_output=True, text=True, timeout=self.timeout_s,
            )
            turn = Turn(index, argv, proc.returncode, proc.stdout, proc.stderr, time.monotonic() - started)
        except subprocess.TimeoutExpired as e:
            out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
            err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
            turn = Turn(index, argv, -9, out, err + f"\n<timeout after {self.timeout_s:.0f}s>",
                        time.monotonic() - started)
        self.turns.append(turn)
        return turn

    def run(self, turns: int, stop_on_failure: bool = True) -> list[Turn]:
        for _ in range(turns):
            if not self.run_turn().ok and stop_on_failure:
                break
        return self.turns


def missing_binary(agent: str) -> str | None:
    """Why ``agent`` cannot run here, or None."""
    path = {"hermes-agent": HERMES_BIN, "aider": AIDER_BIN}.get(agent, NPM_BIN / BINARY[agent])
    if not path.exists():
        return f"{agent} not installed at {path}: run `bash scripts/setup_e2e.sh`"
    return None


# ---------------------------------------------------------------- Claude Code

def _claude_setup(s: Session) -> None:
    pass


def _claude_env(s: Session) -> dict[str, str]:
    return {
        "ANTHROPIC_BASE_URL": s.base_url,
        "ANTHROPIC_API_KEY": ANTHROPIC_KEY,
        # Its own compaction off: what keeps the conversation inside the window is compactor.
        "DISABLE_COMPACT": "1",
        "DISABLE_AUTO_COMPACT": "1",
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_TELEMETRY": "1",
        "DISABLE_AUTOUPDATER": "1",
        "DISABLE_ERROR_REPORTING": "1",
        "DISABLE_BUG_COMMAND": "1",
        # One attempt per request: a failure is never hidden by a retry.
        "CLAUDE_CODE_MAX_RETRIES": "0",
        "API_TIMEOUT_MS": str(int(TURN_TIMEOUT_S * 1000)),
    }


def _claude_argv(s: Session, turn: int, prompt: str) -> list[str]:
    argv = [str(NPM_BIN / "claude"), "-p"]
    if turn > 0:
        argv.append("--continue")
    argv += [prompt, "--model", MODEL]
    if not s.tools:
        argv += ["--tools", ""]
    return argv


# ---------------------------------------------------------------- Codex

CODEX_FEATURES_OFF = [
    "shell_tool", "unified_exec", "multi_agent", "goals", "view_image", "image_generation",
    "apps", "plugins", "sleep_tool", "tool_suggest",
]


def _codex_setup(s: Session) -> None:
    codex_home = s.home / ".codex"
    codex_home.mkdir(parents=True, exist_ok=True)
    lines = [
        f'model = "{MODEL}"',
        'model_provider = "compactor"',
        "[model_providers.compactor]",
        'name = "compactor"',
        f'base_url = "{s.base_url}/v1"',
        'wire_api = "responses"',
        'env_key = "OPENAI_API_KEY"',
        # One attempt per request; a slow CPU prompt takes minutes before the first event.
        "request_max_retries = 0",
        "stream_max_retries = 0",
        f"stream_idle_timeout_ms = {int(TURN_TIMEOUT_S * 1000)}",
        "[analytics]",
        "enabled = false",
        "[feedback]",
        "enabled = false",
    ]
    if not s.tools:
        lines.insert(2, 'web_search = "disabled"')
        lines += ["[features]", *(f"{f} = false" for f in CODEX_FEATURES_OFF)]
    (codex_home / "config.toml").write_text("\n".join(lines) + "\n")


def _codex_env(s: Session) -> dict[str, str]:
    return {"CODEX_HOME": str(s.home / ".codex"), "OPENAI_API_KEY": OPENAI_KEY}


def _codex_argv(s: Session, turn: int, prompt: str) -> list[str]:
    argv = [str(NPM_BIN / "codex"), "exec", "--skip-git-repo-check"]
    if turn > 0:
        argv += ["resume", "--last"]
    return argv + [prompt]


# ---------------------------------------------------------------- pi

def _pi_setup(s: Session) -> None:
    agent_dir = s.home / ".pi" / "agent"
    agent_dir.mkdir(parents=True, exist_ok=True)
    provider = {
        "baseUrl": f"{s.base_url}/v1",
        "api": "openai-completions",
        "apiKey": OPENAI_KEY,
        "models": [{"id": MODEL}],
    }
    (agent_dir / "models.json").write_text(json.dumps({"providers": {"compactor": provider}}, indent=2))
    # No agent-level retry (a failure is never hidden by a retry), and its own compaction off
    # (it would otherwise summarise and retry on an overflow error: what keeps the
    # conversation inside the window must be compactor).
    (agent_dir / "settings.json").write_text(json.dumps({
        "enableInstallTelemetry": False,
        "compaction": {"enabled": False},
        "retry": {"enabled": False, "provider": {"maxRetries": 0, "timeoutMs": int(TURN_TIMEOUT_S * 1000)}},
    }, indent=2))


def _pi_env(s: Session) -> dict[str, str]:
    return {
        "PI_CODING_AGENT_DIR": str(s.home / ".pi" / "agent"),
        "PI_OFFLINE": "1",
        "PI_TELEMETRY": "0",
        "PI_SKIP_VERSION_CHECK": "1",
    }


def _pi_argv(s: Session, turn: int, prompt: str) -> list[str]:
    argv = [str(NPM_BIN / "pi"), "--provider", "compactor", "--model", MODEL]
    if not s.tools:
        argv.append("--no-tools")
    if turn > 0:
        argv.append("-c")
    return argv + ["-p", prompt]


# ---------------------------------------------------------------- hermes-agent

# Small: every reply of the 270M model runs to it (it calls no tool and never ends), and
# hermes asks it to continue; a short reply keeps a turn quick on 2 cores.
HERMES_MAX_TOKENS = 64


def _hermes_setup(s: Session) -> None:
    hermes_home = s.home / ".hermes"
    hermes_home.mkdir(parents=True, exist_ok=True)
    (hermes_home / "config.yaml").write_text(
        "model:\n"
        "  provider: custom\n"
        f"  base_url: {s.base_url}/v1\n"
        f"  default: {MODEL}\n"
        # hermes refuses windows under 64K; its own compression is sized on this number.
        "  context_length: 65536\n"
        f"  max_tokens: {HERMES_MAX_TOKENS}\n"
        "compression:\n"
        "  enabled: true\n"
        "agent:\n"
        "  api_max_retries: 0\n"
    )


def _hermes_env(s: Session) -> dict[str, str]:
    return {"HERMES_HOME": str(s.home / ".hermes"), "OPENAI_API_KEY": OPENAI_KEY}


def _hermes_argv(s: Session, turn: int, prompt: str) -> list[str]:
    argv = [str(HERMES_BIN), "chat", "-Q", "-q", prompt, "-t", "todo"]
    if turn > 0:
        argv.append("--continue")
    return argv


# ---------------------------------------------------------------- opencode and Kilo CLI (its fork)

# Both read an `@ai-sdk/openai-compatible` provider from their JSON config; `*_PURE` keeps them
# from installing their plugin package from npm at run time, `enabled_providers` from fetching
# the model lists of their built-in providers.
def _opencode_config(s: Session) -> dict:
    return {
        "provider": {"compactor": {
            "npm": "@ai-sdk/openai-compatible",
            "name": "compactor",
            "options": {"baseURL": f"{s.base_url}/v1", "apiKey": OPENAI_KEY},
            "models": {MODEL: {"name": MODEL, "limit": {"context": 1_000_000, "output": 256}}},
        }},
        "enabled_providers": ["compactor"],
        "model": f"compactor/{MODEL}",
        "small_model": f"compactor/{MODEL}",
        "autoupdate": False,
        "share": "disabled",
    }


def _opencode_setup(s: Session) -> None:
    conf = s.home / ".config" / "opencode"
    conf.mkdir(parents=True, exist_ok=True)
    (conf / "opencode.json").write_text(json.dumps(_opencode_config(s), indent=2))


def _opencode_family_env(prefix: str, config: Path) -> dict[str, str]:
    # Its own compaction and pruning of old tool outputs off: what keeps the conversation
    # inside the window is compactor.
    flags = ["DISABLE_AUTOUPDATE", "DISABLE_MODELS_FETCH", "DISABLE_LSP_DOWNLOAD", "DISABLE_SHARE",
             "DISABLE_AUTOCOMPACT", "DISABLE_PRUNE", "DISABLE_DEFAULT_PLUGINS", "DISABLE_CLAUDE_CODE", "PURE"]
    return {"OPENAI_API_KEY": OPENAI_KEY, f"{prefix}_CONFIG": str(config), **{f"{prefix}_{f}": "1" for f in flags}}


def _opencode_env(s: Session) -> dict[str, str]:
    return _opencode_family_env("OPENCODE", s.home / ".config" / "opencode" / "opencode.json")


def _opencode_argv(s: Session, turn: int, prompt: str) -> list[str]:
    argv = [str(NPM_BIN / BINARY[s.agent]), "run", "-m", f"compactor/{MODEL}"]
    if turn > 0:
        argv.append("-c")
    return argv + [prompt]


def _kilo_setup(s: Session) -> None:
    conf = s.home / ".config" / "kilo"
    conf.mkdir(parents=True, exist_ok=True)
    (conf / "kilo.json").write_text(json.dumps(_opencode_config(s), indent=2))


def _kilo_env(s: Session) -> dict[str, str]:
    return {
        **_opencode_family_env("KILO", s.home / ".config" / "kilo" / "kilo.json"),
        "KILO_TELEMETRY_LEVEL": "off",
        "KILO_DISABLE_SESSION_INGEST": "1",
        "KILO_DISABLE_PRESENCE": "1",
        "KILO_DISABLE_CODEBASE_INDEXING": "1",
        "KILO_NO_DAEMON": "1",
    }


# ---------------------------------------------------------------- Continue CLI

def _continue_setup(s: Session) -> None:
    conf = s.home / ".continue"
    conf.mkdir(parents=True, exist_ok=True)
    (conf / "config.yaml").write_text(
        "name: e2e\nversion: 1.0.0\nschema: v1\nmodels:\n"
        f"  - name: {MODEL}\n    provider: openai\n    model: {MODEL}\n"
        f"    apiBase: {s.base_url}/v1\n    apiKey: {OPENAI_KEY}\n    roles: [chat]\n"
    )


def _continue_env(s: Session) -> dict[str, str]:
    # Headless (-p) runs never check for updates.
    return {"CONTINUE_GLOBAL_DIR": str(s.home / ".continue"), "CONTINUE_CLI_ENABLE_TELEMETRY": "0",
            "CONTINUE_METRICS_ENABLED": "0"}


def _continue_argv(s: Session, turn: int, prompt: str) -> list[str]:
    argv = [str(NPM_BIN / "cn"), "--config", str(s.home / ".continue" / "config.yaml"), "-p"]
    if turn > 0:
        argv.append("--resume")
    return argv + [prompt]


# ---------------------------------------------------------------- qwen-code

QWEN_AUTH = {"qwen-code": "openai", "qwen-code-anthropic": "anthropic", "qwen-code-responses": "openai-responses"}


def _qwen_setup(s: Session) -> None:
    conf = s.home / ".qwen"
    conf.mkdir(parents=True, exist_ok=True)
    (conf / "settings.json").write_text(json.dumps({
        "privacy": {"usageStatisticsEnabled": False},
        "telemetry": {"enabled": False},
        "general": {"enableAutoUpdate": False},
        # Its background memory/skill subagents off: one request per turn.
        "memory": {"enableManagedAutoMemory": False, "enableManagedAutoDream": False, "enableAutoSkill": False},
        # A window it never compacts in itself (what keeps the conversation inside the real
        # window is compactor), one attempt per request.
        "model": {"generationConfig": {"maxRetries": 0, "contextWindowSize": 1_000_000}},
    }, indent=2))


def _qwen_env(s: Session) -> dict[str, str]:
    return {
        "QWEN_TELEMETRY_ENABLED": "0",
        "QWEN_USAGE_STATISTICS_ENABLED": "0",
        "OPENAI_API_KEY": OPENAI_KEY,
        "OPENAI_BASE_URL": f"{s.base_url}/v1",
        "OPENAI_MODEL": MODEL,
        "ANTHROPIC_API_KEY": ANTHROPIC_KEY,
        "ANTHROPIC_BASE_URL": s.base_url,
        "ANTHROPIC_MODEL": MODEL,
    }


def _qwen_argv(s: Session, turn: int, prompt: str) -> list[str]:
    argv = [str(NPM_BIN / "qwen"), "--auth-type", QWEN_AUTH[s.agent], "-m", MODEL]
    if turn > 0:
        argv.append("-c")
    return argv + [prompt]


# ---------------------------------------------------------------- aider

def _aider_setup(s: Session) -> None:
    # Its model-metadata cache, fresh and empty: otherwise it downloads litellm's price list.
    caches = s.home / ".aider" / "caches"
    caches.mkdir(parents=True, exist_ok=True)
    (caches / "model_prices_and_context_window.json").write_text("{}")


def _aider_env(s: Session) -> dict[str, str]:
    return {"OPENAI_API_BASE": f"{s.base_url}/v1", "OPENAI_API_KEY": OPENAI_KEY,
            "LITELLM_LOCAL_MODEL_COST_MAP": "True"}


def _aider_argv(s: Session, turn: int, prompt: str) -> list[str]:
    # No git (no repo map, no commits), no analytics or update checks; its own chat-history
    # summarising off (a limit it never reaches); later turns restore the chat history file.
    argv = [str(AIDER_BIN), "--model", f"openai/{MODEL}", "--yes-always", "--no-git", "--analytics-disable",
            "--no-check-update", "--no-show-release-notes", "--no-show-model-warnings", "--no-pretty",
            "--max-chat-history-tokens", "1000000"]
    if turn > 0:
        argv.append("--restore-chat-history")
    # From a file: aider writes its own command line into the chat history it restores, so a
    # prompt passed with --message would come back as a second copy on every later turn.
    message = s.root / "tmp" / f"aider-turn{turn + 1}.txt"
    message.parent.mkdir(parents=True, exist_ok=True)
    message.write_text(prompt)
    return argv + ["--message-file", str(message)]


SETUP = {"claude-code": _claude_setup, "codex": _codex_setup, "pi": _pi_setup, "hermes-agent": _hermes_setup,
         "opencode": _opencode_setup, "continue": _continue_setup, "qwen-code": _qwen_setup,
         "qwen-code-anthropic": _qwen_setup, "qwen-code-responses": _qwen_setup, "kilo": _kilo_setup,
         "aider": _aider_setup}
ENV = {"claude-code": _claude_env, "codex": _codex_env, "pi": _pi_env, "hermes-agent": _hermes_env,
       "opencode": _opencode_env, "continue": _continue_env, "qwen-code": _qwen_env,
       "qwen-code-anthropic": _qwen_env, "qwen-code-responses": _qwen_env, "kilo": _kilo_env,
       "aider": _aider_env}
ARGV = {"claude-code": _claude_argv, "codex": _codex_argv, "pi": _pi_argv, "hermes-agent": _hermes_argv,
        "opencode": _opencode_argv, "continue": _continue_argv, "qwen-code": _qwen_argv,
        "qwen-code-anthropic": _qwen_argv, "qwen-code-responses": _qwen_argv, "kilo": _opencode_argv,
        "aider": _aider_argv}
BINARY = {"claude-code": "claude", "codex": "codex", "pi": "pi", "hermes-agent": "hermes",
          "opencode": "opencode", "continue": "cn", "qwen-code": "qwen", "qwen-code-anthropic": "qwen",
          "qwen-code-responses": "qwen", "kilo": "kilo", "aider": "aider"}
AGENTS = list(SETUP)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("agent", choices=AGENTS)
    ap.add_argument("base_url")
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--no-tools", action="store_true")
    ap.add_argument("--keep", action="store_true", help="keep the temporary HOME")
    args = ap.parse_args(argv)
    if why := missing_binary(args.agent):
        print(why, file=sys.stderr)
        return 2
    root = Path(tempfile.mkdtemp(prefix=f"e2e-{args.agent}-"))
    try:
        session = Session(args.agent, args.base_url, root, tools=not args.no_tools)
        for turn in session.run(args.turns):
            print(turn.brief())
        return 0 if all(t.ok for t in session.turns) else 1
    finally:
        if args.keep:
            print(f"HOME kept in {root}", file=sys.stderr)
        else:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
