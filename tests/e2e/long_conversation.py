"""A deterministic 40-turn agent conversation and a driver that plays it.

The conversation is what a coding agent sends: a system prompt, one task, then
per turn the assistant's tool call and the tool's (large, 1-3 KB) output,
with a user follow-up every few turns. The assistant tool-call messages are
scripted, standing in for the model's reply to the previous request, so the
history depends on nothing but the seed: two runs (direct, through compactor,
streaming or not) send the same client-side history turn after turn, and
each request extends the previous one exactly, as agent histories do.

With Gemma 3 (~4 characters per token) the history passes 2048 tokens after
about four turns and ends around 25k tokens.

Use as a module (``build_conversation``, ``play``, ``summarize``) or from the
command line against any base URL::

    .venv/bin/python tests/e2e/long_conversation.py --base-url http://127.0.0.1:4000 --stream
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import openai

DEFAULT_TURNS = 40
DEFAULT_SEED = 20261130
API_KEY = "sk-e2e-test-key"

SYSTEM_PROMPT = (
    "You are Forge, a careful coding agent working in the repository of a small "
    "inventory service. Use the tools to inspect files, run commands and edit code. "
    "Explain briefly what you found after each tool result."
)
TASK = (
    "The nightly job reports that stock levels drift after bulk imports. Find the "
    "cause in the inventory service, fix it, and make sure the tests pass."
)

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": desc,
            "parameters": {
                "type": "object",
                "properties": {arg: {"type": "string", "description": arg_desc}},
                "required": [arg],
            },
        },
    }
    for name, desc, arg, arg_desc in [
        ("read_file", "Read a file from the repository.", "path", "path relative to the repository root"),
        ("run_command", "Run a shell command in the repository.", "command", "the command line"),
        ("search_code", "Search the code base with a regular expression.", "pattern", "the pattern"),
        ("list_dir", "List a directory.", "path", "directory path"),
    ]
]

_NOUNS = [
    "stock", "item", "warehouse", "batch", "import", "ledger", "order", "supplier", "sku",
    "reservation", "count", "delta", "snapshot", "audit", "location", "shipment", "record",
    "quantity", "threshold", "cache", "queue", "event", "report", "price", "unit",
]
_VERBS = [
    "load", "apply", "merge", "compute", "update", "validate", "reserve", "release", "sync",
    "parse", "flush", "reconcile", "emit", "fetch", "store", "round", "adjust", "check",
]
_MODULES = ["imports", "ledger", "stock", "reports", "api", "models", "sync", "audit", "jobs"]
_WORDS = [
    "the", "value", "is", "stored", "after", "each", "bulk", "import", "but", "rounding",
    "happens", "before", "merge", "so", "small", "errors", "accumulate", "over", "time",
    "when", "two", "workers", "write", "same", "row", "without", "lock", "and", "retry",
]


def _ident(rng: random.Random) -> str:
    return f"{rng.choice(_VERBS)}_{rng.choice(_NOUNS)}"


def _sentence(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(n))


def _function_block(rng: random.Random) -> list[str]:
    fn = _ident(rng)
    a, b = rng.sample(_NOUNS, 2)
    return [
        "",
        f"def {fn}({a}, {b}, *, strict=False):",
        f'    """{_sentence(rng, rng.randint(6, 12)).capitalize()}."""',
        f"    if {a} is None:",
        f"        raise ValueError('{a} missing for {fn}')",
        f"    total = Decimal({a}.quantity) + Decimal({b}.delta)",
        f"    if strict and total < {rng.randint(0, 50)}:",
        f"        return {_ident(rng)}(total, {b})",
        f"    return round(total, {rng.randint(0, 3)})",
    ]


def _tool_output(rng: random.Random, tool: str, arg: str, size: int) -> str:
    out: list[str] = []
    if tool == "read_file":
        out += [f'"""{arg}: {_sentence(rng, 8)}."""', "", "from decimal import Decimal", ""]
        while sum(len(l) + 1 for l in out) < size:
            out += _function_block(rng)
    elif tool == "run_command":
        out.append(f"$ {arg}")
        while sum(len(l) + 1 for l in out) < size:
            mod = rng.choice(_MODULES)
            passed = rng.random() > 0.15
            out.append(f"tests/test_{mod}.py::test_{_ident(rng)} {'PASSED' if passed else 'FAILED'}")
            if not passed:
                out.append(f"    AssertionError: {_sentence(rng, rng.randint(8, 14))}")
    elif tool == "search_code":
        while sum(len(l) + 1 for l in out) < size:
            mod = rng.choice(_MODULES)
            out.append(
                f"src/inventory/{mod}.py:{rng.randint(10, 99)}: {_ident(rng)}({rng.choice(_NOUNS)}) # {_sentence(rng, 5)}"
            )
    else:  # list_dir, as `find` prints it
        while sum(len(l) + 1 for l in out) < size:
            sub = rng.choice(_MODULES)
            out.append(f"{arg.rstrip('/')}/{sub}/{_ident(rng)}.py")
    text = "\n".join(out)
    return text[: text.rfind("\n", 0, size)] if len(text) > size else text


@dataclass(frozen=True)
class Turn:
    """One request: the messages appended to the history before it is sent."""

    index: int
    new_messages: list[dict[str, Any]]


def build_conversation(turns: int = DEFAULT_TURNS, seed: int = DEFAULT_SEED) -> list[Turn]:
    """The scripted conversation; identical for identical arguments."""
    rng = random.Random(seed)
    out = [
        Turn(0, [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": TASK}])
    ]
    for t in range(1, turns):
        tool = ["list_dir", "read_file", "search_code", "run_command"][rng.randrange(4)] if t > 1 else "list_dir"
        arg = {
            "list_dir": lambda: f"src/inventory/{rng.choice(_MODULES)}" if t > 1 else "src/inventory",
            "read_file": lambda: f"src/inventory/{rng.choice(_MODULES)}.py",
            "search_code": lambda: f"{_ident(rng)}\\(",
            "run_command": lambda: f"pytest -q tests/test_{rng.choice(_MODULES)}.py",
        }[tool]()
        arg_name = TOOLS[[t_["function"]["name"] for t_ in TOOLS].index(tool)]["function"]["parameters"]["required"][0]
        call_id = f"call_{t:03d}_{rng.randrange(16**8):08x}"
        note = f"Step {t}: I will {tool.replace('_', ' ')} to check {_sentence(rng, 4)}."
        msgs: list[dict[str, Any]] = [
            {
                "role": "assistant",
                "content": note,
                "tool_calls": [
                    {
                        "id": call_id,
                        "type": "function",
                        "function": {"name": tool, "arguments": json.dumps({arg_name: arg})},
                    }
                ],
            },
            {
                "role": "tool",
                "tool_call_id": call_id,
                "content": _tool_output(rng, tool, arg, rng.randint(1000, 3000)),
            },
        ]
        if t % 6 == 0:
            msgs.append(
                {"role": "user", "content": f"Follow-up {t // 6}: also keep an eye on {_sentence(rng, 6)}."}
            )
        out.append(Turn(t, msgs))
    return out


def history_through(conversation: list[Turn], turn: int) -> list[dict[str, Any]]:
    """The full client-side history sent at ``turn``."""
    return [m for t in conversation[: turn + 1] for m in t.new_messages]


@dataclass
class TurnResult:
    """What one request of the conversation got back."""

    turn: int
    ok: bool
    status: int | None
    messages_sent: int
    chars_sent: int
    wall_s: float
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cache_n: int | None = None
    prompt_n: int | None = None
    finish_reason: str | None = None
    completion: str = ""
    error_type: str | None = None
    error_body: Any = None
    compactor_action: str | None = None
    headers: dict[str, str] = field(default_factory=dict)


def _error_result(base: dict, e: openai.APIError) -> TurnResult:
    status = getattr(e, "status_code", None)
    body: Any = e.body
    response = getattr(e, "response", None)
    if response is not None:
        try:
            body = response.json()
        except ValueError:
            body = response.text
    err = body.get("error", body) if isinstance(body, dict) else {}
    headers = dict(response.headers) if response is not None else {}
    return TurnResult(
        **base,
        ok=False,
        status=status,
        error_type=err.get("type") if isinstance(err, dict) else None,
        error_body=body,
        compactor_action=headers.get("x-compactor-action"),
        headers=headers,
    )


def play(
    base_url: str,
    *,
    stream: bool = False,
    session_id: str | None = None,
    session_header: str = "x-session-id",
    turns: int = DEFAULT_TURNS,
    seed: int = DEFAULT_SEED,
    model: str | None = None,
    max_tokens: int = 16,
    include_usage: bool = True,
    send_tools: bool = True,
    api_key: str = API_KEY,
    timeout_s: float = 600.0,
    stop_after_errors: int | None = None,
    on_turn: Callable[[TurnResult], None] | None = None,
) -> list[TurnResult]:
    """Play the conversation turn by turn against ``base_url`` (no ``/v1``).

    Every turn is sent even after failures (the client keeps its history), up
    to ``stop_after_errors`` failed turns. ``include_usage`` asks for the usage
    chunk on streams; without it prompt tokens come from llama.cpp ``timings``.
    ``send_tools`` sends the tool definitions with ``tool_choice: "none"``: the
    tools are part of the prompt, and the base model's free text is never
    searched for tool calls (the turns' calls are scripted).
    """
    client = openai.OpenAI(
        base_url=base_url.rstrip("/") + "/v1", api_key=api_key, max_retries=0, timeout=timeout_s
    )
    if model is None:
        model = client.models.list().data[0].id
    conversation = build_conversation(turns, seed)
    extra_headers = {session_header: session_id} if session_id else None
    results: list[TurnResult] = []
    errors = 0
    for turn in conversation:
        messages = history_through(conversation, turn.index)
        kwargs: dict[str, Any] = {
            "model": model,
            "messages": messages,
            "max_tokens": max_tokens,
            "temperature": 0,
            "seed": 7,
            "extra_headers": extra_headers,
        }
        if send_tools:
            kwargs.update(tools=TOOLS, tool_choice="none")
        if stream:
            kwargs["stream"] = True
            if include_usage:
                kwargs["stream_options"] = {"include_usage": True}
        base = {
            "turn": turn.index,
            "messages_sent": len(messages),
            "chars_sent": len(json.dumps(messages)),
        }
        started = time.monotonic()
        try:
            raw = client.chat.completions.with_raw_response.create(**kwargs)
            headers = dict(raw.headers)
            r = TurnResult(
                **base, ok=True, status=raw.status_code, wall_s=0.0,
                compactor_action=headers.get("x-compactor-action"), headers=headers,
            )
            if stream:
                _read_stream(raw.parse(), r)
            else:
                _read_completion(json.loads(raw.content), r)
        except openai.APIError as e:
            r = _error_result({**base, "wall_s": 0.0}, e)
        except Exception as e:  # noqa: BLE001 - a dropped stream is a failed turn, not a crash
            r = TurnResult(**base, ok=False, status=None, wall_s=0.0, error_type=type(e).__name__,
                           error_body=str(e))
        r.wall_s = time.monotonic() - started
        results.append(r)
        if on_turn:
            on_turn(r)
        if not r.ok:
            errors += 1
            if stop_after_errors is not None and errors >= stop_after_errors:
                break
    return results


def _read_timings(timings: dict | None, r: TurnResult) -> None:
    if timings:
        r.cache_n = timings.get("cache_n")
        r.prompt_n = timings.get("prompt_n")
        if r.prompt_tokens is None and r.prompt_n is not None:
            r.prompt_tokens = r.prompt_n + (r.cache_n or 0)


def _read_completion(body: dict, r: TurnResult) -> None:
    choice = body["choices"][0]
    r.completion = choice["message"].get("content") or ""
    r.finish_reason = choice.get("finish_reason")
    usage = body.get("usage") or {}
    r.prompt_tokens = usage.get("prompt_tokens")
    r.completion_tokens = usage.get("completion_tokens")
    _read_timings(body.get("timings"), r)


def _read_stream(stream, r: TurnResult) -> None:
    parts: list[str] = []
    timings = None
    for chunk in stream:
        if chunk.choices:
            delta = chunk.choices[0].delta
            parts.append(delta.content or "")
            r.finish_reason = chunk.choices[0].finish_reason or r.finish_reason
        if chunk.usage is not None:
            r.prompt_tokens = chunk.usage.prompt_tokens
            r.completion_tokens = chunk.usage.completion_tokens
        extra = chunk.model_extra or {}
        if extra.get("timings"):
            timings = extra["timings"]
    r.completion = "".join(parts)
    _read_timings(timings, r)


def summarize(results: list[TurnResult]) -> dict[str, Any]:
    """Content-free numbers for a report."""
    ok = [r for r in results if r.ok]
    failed = [r for r in results if not r.ok]
    prompts = [r.prompt_tokens for r in ok if r.prompt_tokens is not None]
    return {
        "turns": len(results),
        "ok": len(ok),
        "failed": len(failed),
        "first_failure_turn": failed[0].turn if failed else None,
        "failure_types": sorted({r.error_type or f"status {r.status}" for r in failed}),
        "max_prompt_tokens": max(prompts) if prompts else None,
        "prompt_tokens_per_turn": [r.prompt_tokens for r in results],
        "turns_with_cache_hit": sum(1 for r in ok if (r.cache_n or 0) > 0),
        "actions": {a: sum(1 for r in results if r.compactor_action == a)
                    for a in sorted({r.compactor_action for r in results if r.compactor_action})},
        "wall_s": round(sum(r.wall_s for r in results), 2),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Play the long agent conversation against a server.")
    ap.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:4000 (no /v1)")
    ap.add_argument("--stream", action="store_true")
    ap.add_argument("--session", default=None, help="value of the session header")
    ap.add_argument("--turns", type=int, default=DEFAULT_TURNS)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--no-usage", action="store_true", help="streams without include_usage")
    ap.add_argument("--json", action="store_true", help="print every turn as JSON")
    args = ap.parse_args(argv)

    def show(r: TurnResult) -> None:
        if args.json:
            print(json.dumps({k: v for k, v in asdict(r).items() if k not in ("headers", "completion")}))
        else:
            print(
                f"turn {r.turn:2d} {'ok ' if r.ok else 'ERR'} msgs={r.messages_sent:3d} "
                f"chars={r.chars_sent:6d} prompt={r.prompt_tokens} cache_n={r.cache_n} "
                f"action={r.compactor_action} {r.error_type or ''} {r.wall_s:.2f}s",
                flush=True,
            )

    results = play(
        args.base_url, stream=args.stream, session_id=args.session, turns=args.turns,
        max_tokens=args.max_tokens, include_usage=not args.no_usage, on_turn=show,
    )
    print(json.dumps(summarize(results)))
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
