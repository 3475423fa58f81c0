"""Fixtures for the end-to-end suite.

* ``llama`` (session): ONE real llama.cpp server (``scripts/llama_server.py``
  in a subprocess, free loopback port, n_ctx 2048, 1 slot, 2 threads). Set
  ``E2E_LLAMA_URL`` to reuse a server that is already running instead.
* ``compactor`` (function): a factory that starts the compactor binary
  (``COMPACTOR_BIN`` or ``target/debug/compactor``) on a free port in front of
  a given upstream, waits for its health endpoint and stops it on teardown;
  its stderr is kept and printed when the test fails.
* ``mock_upstream``: the deterministic mock of ``mock_upstream.py``.
* openai clients: ``llama_direct`` and ``llama_via_compactor``.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import openai
import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from mock_upstream import MockUpstream, start_mock  # noqa: E402
from upstream_tap import UpstreamTap, start_tap  # noqa: E402

REPO = HERE.parents[1]
LLAMA_SCRIPT = REPO / "scripts" / "llama_server.py"
LLAMA_N_CTX = 2048
API_KEY = "sk-e2e-test-key"
HEALTH_PATH = "/_compactor/health"
# Model loading takes a couple of seconds here; leave room for a slow CI disk.
LLAMA_START_TIMEOUT_S = 300.0
COMPACTOR_START_TIMEOUT_S = 30.0
CLIENT_TIMEOUT_S = 300.0


def free_port() -> int:
    """A loopback port that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_get(url: str, timeout: float = 5.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def openai_client(base_url: str, **kw) -> openai.OpenAI:
    """An SDK client with retries off, so every test sees exactly one attempt."""
    return openai.OpenAI(
        base_url=base_url.rstrip("/") + "/v1",
        api_key=kw.pop("api_key", API_KEY),
        max_retries=0,
        timeout=kw.pop("timeout", CLIENT_TIMEOUT_S),
        **kw,
    )


def _tail(path: Path, lines: int = 60) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "<no log>"


# ---------------------------------------------------------------- reporting

@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    setattr(item, "rep_" + rep.when, rep)


def _failed(request: pytest.FixtureRequest) -> bool:
    rep = getattr(request.node, "rep_call", None)
    return rep is None or rep.failed


# ---------------------------------------------------------------- llama.cpp

@dataclass
class LlamaServer:
    """A llama.cpp server reachable at ``url``."""

    url: str
    n_ctx: int
    proc: subprocess.Popen | None = None
    log_path: Path | None = None

    def log(self) -> str:
        return _tail(self.log_path) if self.log_path else "<external server>"


def slot_n_ctx(url: str) -> int:
    """The per-slot window llama.cpp enforces (what its overflow error reports)."""
    status, body = http_get(url + "/props")
    assert status == 200, f"GET {url}/props -> {status}"
    return int(json.loads(body)["default_generation_settings"]["n_ctx"])


def _start_llama(log_path: Path, n_ctx: int = LLAMA_N_CTX, extra: list[str] | None = None) -> LlamaServer:
    cmd = [
        sys.executable,
        str(LLAMA_SCRIPT),
        "--host", "127.0.0.1",
        "--port", "0",
        "--n-ctx", str(n_ctx),
        "--slots", "1",
        "--threads", "2",
        "--exit-with-parent",
        *(extra or []),
    ]
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=log, stdin=subprocess.DEVNULL, text=True,
            start_new_session=True,
        )
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(
        target=lambda: [lines.put(l) for l in iter(proc.stdout.readline, "")], daemon=True
    ).start()
    deadline = time.monotonic() + LLAMA_START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"llama_server.py exited ({proc.returncode}):\n{_tail(log_path)}")
        try:
            line = lines.get(timeout=0.2)
        except queue.Empty:
            continue
        if line.startswith("llama-server ready "):
            url = line.split()[-1].rstrip("/")
            status, _ = http_get(url + "/health")
            if status == 200:
                return LlamaServer(url=url, n_ctx=slot_n_ctx(url), proc=proc, log_path=log_path)
    _stop(proc)
    raise RuntimeError(f"llama.cpp not ready in {LLAMA_START_TIMEOUT_S}s:\n{_tail(log_path)}")


def _stop(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=grace_s)


@pytest.fixture(scope="session")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LlamaServer]:
    external = os.environ.get("E2E_LLAMA_URL")
    if external:
        url = external.rstrip("/")
        yield LlamaServer(url=url, n_ctx=slot_n_ctx(url))
        return
    server = _start_llama(tmp_path_factory.mktemp("llama") / "llama.log")
    try:
        yield server
    finally:
        if server.proc is not None:
            _stop(server.proc)


# The real-agent tests' server (test_real_agents.py), started only when one of
# them runs. Why a second server: Codex's own instructions (its base prompt and
# permissions, ~6k tokens with its one remaining tool) do not fit the suite's
# 2,048-token window at all, so an 8,192-token window is the smallest in which
# its instructions are kept and a conversation still has room; Claude Code
# (~2.5k tokens of its own) and pi run in it too. Its replies end: a
# server-default grammar (one short line, then end of turn) for requests
# without tools, and a cap on generated tokens for the rest, because the
# 270M model never ends a turn and Claude Code treats a reply cut at
# max_tokens as an error.
AGENT_N_CTX = 8192
AGENT_N_PREDICT = 24
AGENT_GRAMMAR = HERE / "agents" / "short_reply.gbnf"


@pytest.fixture(scope="session")
def llama_agents(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LlamaServer]:
    external = os.environ.get("E2E_LLAMA_AGENTS_URL")
    if external:
        url = external.rstrip("/")
        yield LlamaServer(url=url, n_ctx=slot_n_ctx(url))
        return
    server = _start_llama(
        tmp_path_factory.mktemp("llama-agents") / "llama.log",
        n_ctx=AGENT_N_CTX,
        extra=["--grammar", str(AGENT_GRAMMAR), "--n-predict", str(AGENT_N_PREDICT)],
    )
    try:
        yield server
    finally:
        if server.proc is not None:
            _stop(server.proc)


@pytest.fixture(scope="session")
def llama_direct(llama: LlamaServer) -> openai.OpenAI:
    return openai_client(llama.url)


# ---------------------------------------------------------------- compactor

def compactor_bin() -> Path:
    return Path(os.environ.get("COMPACTOR_BIN", REPO / "target" / "debug" / "compactor"))


@dataclass
class Compactor:
    """A running compactor process."""

    proc: subprocess.Popen
    url: str
    upstream: str
    log_path: Path

    def log(self) -> str:
        return _tail(self.log_path, 200)

    def client(self, **kw) -> openai.OpenAI:
        return openai_client(self.url, **kw)

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            _tally_fast_path(self.url)
        _stop(self.proc)
        return self.proc.returncode


# What compactor's HTTP/1.1 fast path handed to hyper's server over the whole run, by reason
# (compactor_h1_handoffs_total), next to the requests served: read from each compactor the
# `compactor` fixture started, just before it stops, and printed at the end of the session
# (and written to target/e2e-handoffs.json).
FAST_PATH: dict[str, float] = {"requests": 0.0}


def _tally_fast_path(url: str) -> None:
    try:
        status, body = http_get(url + "/_compactor/metrics", timeout=2.0)
    except OSError:
        return
    if status != 200:
        return
    FAST_PATH["compactors"] = FAST_PATH.get("compactors", 0.0) + 1
    for line in body.decode(errors="replace").splitlines():
        name, _, value = line.rpartition(" ")
        try:
            n = float(value)
        except ValueError:
            continue
        if name.startswith("compactor_h1_handoffs_total{"):
            reason = name.split('reason="', 1)[-1].split('"', 1)[0]
            FAST_PATH[reason] = FAST_PATH.get(reason, 0.0) + n
        elif name.startswith("compactor_requests_total{"):
            FAST_PATH["requests"] += n


def pytest_terminal_summary(terminalreporter) -> None:
    if FAST_PATH.get("compactors"):
        counts = {k: int(v) for k, v in sorted(FAST_PATH.items())}
        terminalreporter.write_line(f"compactor fast path over this run (hand-offs to hyper by reason): {counts}")
        try:
            (REPO / "target").mkdir(exist_ok=True)
            (REPO / "target" / "e2e-handoffs.json").write_text(json.dumps(counts, indent=1) + "\n")
        except OSError:
            pass


StartCompactor = Callable[..., Compactor]


@pytest.fixture
def compactor(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[StartCompactor]:
    """Factory: ``compactor(upstream, env=None, config=None, args=None) -> Compactor``.

    ``config`` is TOML text written to a file and passed with ``--config``.
    Without it the process runs in an empty directory, so a ``proxy.toml``
    lying in the repository never leaks into a test.
    """
    started: list[Compactor] = []

    def start(
        upstream: str,
        env: dict[str, str] | None = None,
        config: str | None = None,
        args: list[str] | None = None,
    ) -> Compactor:
        binary = compactor_bin()
        if not binary.is_file():
            pytest.fail(f"compactor binary not found at {binary}: run `cargo build` or set COMPACTOR_BIN")
        n = len(started)
        workdir = tmp_path / f"compactor{n}"
        workdir.mkdir()
        cmd = [str(binary), *(args or [])]
        if config is not None:
            cfg = workdir / "proxy.toml"
            cfg.write_text(config)
            cmd += ["--config", str(cfg)]
        log_path = workdir / "stderr.log"
        # A port picked here can be taken before compactor binds it; retry then.
        for _attempt in range(3):
            port = free_port()
            full_env = {
                **os.environ,
                "RUST_LOG": os.environ.get("RUST_LOG", "info"),
                "COMPACTOR_LISTEN": f"127.0.0.1:{port}",
                "COMPACTOR_UPSTREAM": upstream,
                # Each compactor its own store file, never the user's state directory.
                "COMPACTOR_STORE_PATH": str(workdir / "state.log"),
                **(env or {}),
            }
            with log_path.open("ab") as log:
                proc = subprocess.Popen(
                    cmd, cwd=workdir, env=full_env, stdin=subprocess.DEVNULL,
                    stdout=log, stderr=subprocess.STDOUT,
                )
            url = f"http://127.0.0.1:{port}"
            proc_c = Compactor(proc=proc, url=url, upstream=upstream, log_path=log_path)
            started.append(proc_c)
            deadline = time.monotonic() + COMPACTOR_START_TIMEOUT_S
            while time.monotonic() < deadline and proc.poll() is None:
                try:
                    status, _ = http_get(url + HEALTH_PATH, timeout=1.0)
                    if status == 200:
                        return proc_c
                except OSError:
                    pass
                time.sleep(0.05)
            if proc.poll() is None:
                break
        pytest.fail(f"compactor did not become healthy; log:\n{_tail(log_path)}")

    yield start

    failed = _failed(request)
    for c in started:
        c.stop()
        if failed:
            print(f"---- compactor {c.url} -> {c.upstream} log ----\n{c.log()}")


@pytest.fixture
def mock_upstream() -> Iterator[MockUpstream]:
    mock = start_mock()
    try:
        yield mock
    finally:
        mock.close()


@pytest.fixture
def mock_via_compactor(mock_upstream: MockUpstream, compactor: StartCompactor) -> Compactor:
    return compactor(mock_upstream.url)


@pytest.fixture
def llama_via_compactor(llama: LlamaServer, compactor: StartCompactor) -> Compactor:
    return compactor(llama.url)


@pytest.fixture
def llama_log(request: pytest.FixtureRequest, llama: LlamaServer) -> Iterator[LlamaServer]:
    """Use instead of ``llama`` to get the server log printed when a test fails."""
    yield llama
    if _failed(request):
        print(f"---- llama.cpp log ----\n{llama.log()}")


@pytest.fixture
def llama_tap(llama: LlamaServer) -> Iterator[UpstreamTap]:
    """A recording pass-through in front of llama.cpp: give ``llama_tap.url`` to compactor
    as its upstream to see every request compactor itself sends."""
    tap = start_tap(llama.url)
    try:
        yield tap
    finally:
        tap.close()
