"""What Ollama's silent truncation costs a long conversation, directly and through compactor.

The conversation (:func:`scenario`): a system prompt, two tools, 30 turns of
~400 tokens each (a pasted deploy log and a question); turn 1 states a fact,
``FACT: the deploy key is <random word>``; every seventh turn asks about the
weather, which the upstream answers with a ``get_weather`` call whose result
the client sends back (a second request in that turn); the last turn asks
"What is the deploy key?". It is played with the real ``ollama`` Python
client (:func:`play`) against ``ollama_upstream.py``, which loads the model
at ``num_ctx`` 4096 and truncates as Ollama does (200, whole messages from
the front, then tokens from the front), and answers the last question only
if the fact line is in what it kept.

Per run, from the upstream's records (summary calls apart): requests
silently truncated; requests that lost the system prompt, the tools, or
the turn-1 fact (among those sent after turn 1); whether the last answer
gave the deploy key; through compactor also compactions
(``x-compactor-action: compacted``), turns per compaction, summary calls.

Command line (prints a markdown table; ``--json FILE`` writes the rows)::

    .venv/bin/python tests/e2e/ollama_costs.py                                      # direct only
    .venv/bin/python tests/e2e/ollama_costs.py --through-compactor target/debug/compactor
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from agent_costs import start_compactor  # noqa: E402
from ollama_upstream import DEFAULT_NUM_CTX, OllamaUpstream, start_ollama_upstream  # noqa: E402

REPO = HERE.parents[1]
MODEL = "llama3.2"
TURNS = 30
TURN_CHARS = 1550  # ~400 tokens with the question and the message's wrapping
WEATHER_EVERY = 7
WORDS = ("amber", "basalt", "cobalt", "dune", "ember", "fjord", "garnet", "harbor", "indigo", "juniper",
         "kestrel", "lagoon", "marble", "nectar", "onyx", "pepper", "quartz", "raven", "saffron", "tundra")

SYSTEM = ("You are DeployBot, the release assistant of the payments team. Answer in one or two short "
          "sentences. Read each pasted deploy log and report whether the run is healthy. Use the tools "
          "when a question needs them; never invent a tool result. Keep every fact the user states: "
          "they will be asked for later.")

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "The current weather of a city (the data centre's site).",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "City name"}},
                       "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "read_log", "description": "Read one deploy log by run number.",
        "parameters": {"type": "object", "properties": {"run": {"type": "integer", "description": "Run number"}},
                       "required": ["run"]}}},
]
CITIES = ("Oslo", "Lisbon", "Tokyo", "Nairobi", "Quito")


def fact(word: str) -> str:
    return f"FACT: the deploy key is {word}."


def deploy_log(turn: int, chars: int = TURN_CHARS) -> str:
    """A distinct, deterministic deploy log of about ``chars`` characters."""
    lines, k = [], 0
    while sum(len(x) + 1 for x in lines) < chars:
        h = hashlib.sha256(f"{turn}:{k}".encode()).hexdigest()
        lines.append(f"12:{turn % 60:02d}:{k % 60:02d} INFO step {k} of run {turn + 1}: layer sha256:{h[:24]} "
                     f"pulled in {int(h[24:28], 16) % 900 + 100} ms")
        k += 1
    return "\n".join(lines)[:chars]


def turn_text(turn: int, turns: int, word: str, paste_tokens: int = 0) -> str:
    """What the user sends at ``turn`` (0-based); with ``paste_tokens``, the middle turn pastes a
    log of that many tokens instead of ~400."""
    if turn == turns - 1:
        return "That was the last run. What is the deploy key?"
    head = f"{fact(word)}\nKeep it for later.\n" if turn == 0 else ""
    ask = (f"Before the next run: what is the weather in {CITIES[turn % len(CITIES)]}?"
           if turn % WEATHER_EVERY == WEATHER_EVERY - 1 else "Is this run healthy?")
    chars = paste_tokens * 4 if paste_tokens and turn == turns // 2 else TURN_CHARS
    return f"{head}Here is the deploy log of run {turn + 1}:\n{deploy_log(turn, chars)}\n\n{ask}"


def scenario(turns: int = TURNS, word: str = "cobalt", paste_tokens: int = 0) -> dict:
    """The conversation as data (what the JavaScript driver receives too)."""
    return {"model": MODEL, "system": SYSTEM, "tools": TOOLS,
            "turns": [turn_text(i, turns, word, paste_tokens) for i in range(turns)]}


def tool_result(name: str, args: Any) -> str:
    """What the client's tool returns (the same in the JavaScript driver)."""
    args = args if isinstance(args, dict) else {}
    if name == "get_weather":
        return json.dumps({"city": args.get("city"), "forecast": "sunny, 21 C"}, separators=(",", ":"))
    return json.dumps({"run": args.get("run"), "status": "ok"}, separators=(",", ":"))


# ---------------------------------------------------------------- the Python driver

@dataclass
class Sent:
    """One request the client made and what came back."""

    turn: int
    action: str | None
    session: str | None
    status: int
    content: str
    tool_calls: list[dict]
    prompt_eval_count: int | None
    chunks: int


def play(host: str, scene: dict, stream: bool, options: dict | None = None,
         timeout: float = 300.0) -> list[Sent]:
    """The conversation through the real ``ollama`` client, tool calls answered; the compactor
    headers of every response are kept (an httpx response hook)."""
    import ollama

    heads: list[Any] = []
    client = ollama.Client(host=host, timeout=timeout,
                           event_hooks={"response": [lambda r: heads.append(r)]})
    messages: list[dict] = [{"role": "system", "content": scene["system"]}]
    out: list[Sent] = []
    for turn, text in enumerate(scene["turns"]):
        messages.append({"role": "user", "content": text})
        for _round in range(4):
            kw = dict(model=scene["model"], messages=messages, tools=scene["tools"], stream=stream)
            if options:
                kw["options"] = options
            if stream:
                content, calls, last, n = "", [], None, 0
                for part in client.chat(**kw):
                    n += 1
                    content += part.message.content or ""
                    calls += [tc.model_dump() for tc in part.message.tool_calls or []]
                    last = part
            else:
                last = client.chat(**kw)
                content, n = last.message.content or "", 1
                calls = [tc.model_dump() for tc in last.message.tool_calls or []]
            r = heads[-1]
            out.append(Sent(turn, r.headers.get("x-compactor-action"), r.headers.get("x-compactor-session"),
                            r.status_code, content, calls, last.prompt_eval_count if last else None, n))
            reply: dict = {"role": "assistant", "content": content}
            if calls:
                reply["tool_calls"] = calls
            messages.append(reply)
            if not calls:
                break
            for c in calls:
                fn = c["function"]
                messages.append({"role": "tool", "content": tool_result(fn["name"], fn["arguments"]),
                                 "tool_name": fn["name"]})
    client.close()
    return out


# ---------------------------------------------------------------- the figures

@dataclass
class Row:
    route: str
    stream: bool
    turns: int
    requests: int  # the conversation's requests upstream (summary calls apart)
    truncated: int
    lost_system: int
    lost_tools: int
    lost_fact: int  # of the requests sent after turn 1
    after_turn1: int
    max_kept: int
    max_sent: int
    answered: bool  # the last answer gave the deploy key
    compactions: int = 0
    summary_calls: int = 0
    orphan_tool_results: int = 0
    errors: int = 0
    answer: str = ""

    @property
    def turns_per_compaction(self) -> float | None:
        return self.turns / self.compactions if self.compactions else None


def orphan_tool_results(body: Any) -> int:
    """Tool results the upstream got without an assistant tool call before them."""
    n, open_calls = 0, 0
    for m in (body or {}).get("messages") or []:
        if m.get("role") == "assistant":
            open_calls = len(m.get("tool_calls") or [])
        elif m.get("role") == "tool":
            if open_calls <= 0:
                n += 1
            open_calls -= 1
        else:
            open_calls = 0
    return n


def figures(route: str, stream: bool, up: OllamaUpstream, sent: list[Sent], word: str, turns: int) -> Row:
    reqs = up.turns()
    marker = fact(word)
    after = reqs[1:]  # turn 1 is the first request: the fact is in it by construction
    last = sent[-1] if sent else None
    return Row(
        route=route, stream=stream, turns=turns, requests=len(reqs),
        truncated=sum(r.truncated for r in reqs),
        lost_system=sum(not r.has_system for r in reqs),
        lost_tools=sum(not r.has_tools for r in reqs),
        lost_fact=sum(not r.kept_contains(marker) for r in after), after_turn1=len(after),
        max_kept=max((r.kept for r in reqs), default=0), max_sent=max((r.tokens for r in reqs), default=0),
        answered=bool(last and f"is {word}" in last.content),
        compactions=sum(s.action == "compacted" for s in sent),
        summary_calls=len(up.summary_calls()),
        orphan_tool_results=sum(orphan_tool_results(r.json()) for r in reqs if r.route == "/api/chat"),
        errors=sum(s.status != 200 for s in sent),
        answer=last.content if last else "",
    )


def run(route: str, stream: bool, turns: int, word: str, num_ctx: int = DEFAULT_NUM_CTX,
        binary: Path | None = None, workdir: Path | None = None, paste_tokens: int = 0) -> Row:
    up = start_ollama_upstream(num_ctx=num_ctx)
    proc = None
    try:
        host = up.url
        if binary is not None:
            proc = start_compactor(up.url, workdir or Path(tempfile.mkdtemp(prefix="ollama-costs-")), binary)
            host = proc.url
        sent = play(host, scenario(turns, word, paste_tokens), stream)
        return figures(route, stream, up, sent, word, turns)
    finally:
        if proc is not None:
            proc.stop()
        up.close()


HEADER = ("| route | stream | turns | requests | truncated | lost system | lost tools | lost turn-1 fact | "
          "largest kept / sent | deploy key answered | compactions | turns per compaction | summary calls |\n"
          "|---|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|")


def table_row(r: Row) -> str:
    tpc = f"{r.turns_per_compaction:.1f}" if r.turns_per_compaction else "–"
    comp = str(r.compactions) if r.route != "direct" else "–"
    summ = str(r.summary_calls) if r.route != "direct" else "–"
    return (f"| {r.route} | {'yes' if r.stream else 'no'} | {r.turns} | {r.requests} | {r.truncated} | "
            f"{r.lost_system} | {r.lost_tools} | {r.lost_fact} of {r.after_turn1} | {r.max_kept} / {r.max_sent} | "
            f"{'yes' if r.answered else 'no'} | {comp} | {tpc if r.route != 'direct' else '–'} | {summ} |")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--through-compactor", metavar="BIN", type=Path,
                    help="also run the conversation through this compactor binary")
    ap.add_argument("--turns", type=int, default=TURNS)
    ap.add_argument("--num-ctx", type=int, default=DEFAULT_NUM_CTX)
    ap.add_argument("--word", help="the deploy key (default: a random word)")
    ap.add_argument("--paste-tokens", type=int, default=0, metavar="N",
                    help="the middle turn pastes a log of N tokens (a paste over the window: Ollama's token cut)")
    ap.add_argument("--json", type=Path, help="write the rows here")
    args = ap.parse_args(argv)
    word = args.word or random.SystemRandom().choice(WORDS)
    rows = []
    for stream in (False, True):
        rows.append(run("direct", stream, args.turns, word, args.num_ctx, paste_tokens=args.paste_tokens))
    if args.through_compactor:
        if not args.through_compactor.is_file():
            print(f"compactor binary not found at {args.through_compactor}", file=sys.stderr)
            return 2
        for stream in (False, True):
            with tempfile.TemporaryDirectory(prefix="ollama-costs-") as tmp:
                rows.append(run("compactor", stream, args.turns, word, args.num_ctx,
                                args.through_compactor.resolve(), Path(tmp), args.paste_tokens))
    paste = f", turn {args.turns // 2 + 1} pastes {args.paste_tokens} tokens" if args.paste_tokens else ""
    print(f"{args.turns} turns, num_ctx {args.num_ctx}{paste}, deploy key {word!r}, Ollama-like upstream "
          f"(tests/e2e/ollama_upstream.py), ollama Python client\n")
    print(HEADER)
    for r in rows:
        print(table_row(r))
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in rows], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
