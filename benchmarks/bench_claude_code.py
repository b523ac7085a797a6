"""Claude Code's request shape replayed against `radixserve serve`, strip on vs off: a billing
header first in `system` whose suffix rotates on every request, Claude Code's agent line and a
long system prompt with breakpoints, its environment as a role "system" message, then a
conversation that grows by one turn per request. Per turn: the tokens prefilled (prompt less
cache reads) and the TTFT, with `--strip-preambles` and with `--no-strip-preambles`.

Target: with the strip, every turn after the first takes at most 10% of turn 1's TTFT.

On the default model (8k context) the system prompt stands in at ~6,000 tokens; on Gemma 3
270M (32k context, `--model gemma3-270m`) at Claude Code's full ~29,000, where a strip-off turn
re-prefills everything (minutes on 2 cores): `--off-turns 2` shows it in two.

    python benchmarks/bench_claude_code.py --out results/bench_claude_code.json
    python benchmarks/bench_claude_code.py --system-tokens 3000 --turns 3
    python benchmarks/bench_claude_code.py --model gemma3-270m --system-tokens 29000 \\
        --off-turns 2 --out results/bench_claude_code_29k.json
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import anthropic

from radixserve.bench.textgen import WordBank
from radixserve.model.default_model import default_model_path, gemma3_270m_path
from radixserve.model.loader import load_tokenizer
from radixserve.testing.server import start_server

# The packaged models by name: (path, the name the server answers to).
MODELS = {"default": (default_model_path, "SmolLM2-135M-Instruct"),
          "gemma3-270m": (gemma3_270m_path, "gemma-3-270m")}
AGENT_LINE = "You are a Claude agent, built on Anthropic's Claude Agent SDK."
ENVIRONMENT = ("# Environment\n - Primary working directory: /work/project\n - Platform: linux\n"
               "\nToday's date is 2026-12-04.")


@dataclass
class TurnRow:
    strip: bool
    turn: int
    prompt_tokens: int
    prefill_tokens: int  # prompt tokens not read from the cache
    ttft_s: float


def billing_header(rng: random.Random) -> str:
    return (f"x-anthropic-billing-header: cc_version=2.1.332.{rng.randrange(4096):03x}; "
            "cc_entrypoint=cli;")


def request_shape(header: str, system_prompt: str, turns: list[tuple[str, str]], ask: str
                  ) -> dict[str, Any]:
    """One Claude Code request: `turns` earlier (user, assistant) pairs, then `ask`."""
    messages: list[dict[str, Any]] = []
    for i, (user, assistant) in enumerate(turns):
        messages.append({"role": "user", "content": user})
        if i == 0:
            messages.append({"role": "system", "content": ENVIRONMENT})
        messages.append({"role": "assistant", "content": assistant})
    messages.append({"role": "user", "content": [
        {"type": "text", "text": ask, "cache_control": {"type": "ephemeral"}}]})
    if not turns:
        messages.append({"role": "system", "content": ENVIRONMENT})
    return {"system": [{"type": "text", "text": header},
                       {"type": "text", "text": AGENT_LINE, "cache_control": {"type": "ephemeral"}},
                       {"type": "text", "text": system_prompt,
                        "cache_control": {"type": "ephemeral"}}],
            "messages": messages, "tools": []}


def run_session(client: anthropic.Anthropic, system_prompt: str, args: argparse.Namespace,
                strip: bool) -> list[TurnRow]:
    rng = random.Random(7)
    history: list[tuple[str, str]] = []
    rows = []
    model = MODELS[args.model][1]
    for turn in range(1, (args.turns if strip else args.off_turns or args.turns) + 1):
        ask = f"Step {turn}: what should I check next in the failing test?"
        shape = request_shape(billing_header(rng), system_prompt, history, ask)
        started = time.perf_counter()
        with client.messages.stream(model=model, max_tokens=args.max_tokens,
                                    thinking={"type": "adaptive"}, **shape) as stream:
            first = next(iter(stream))
            ttft = time.perf_counter() - started
            usage = first.message.usage
            final = stream.get_final_message()
        prompt = (usage.input_tokens + usage.cache_read_input_tokens
                  + usage.cache_creation_input_tokens)
        row = TurnRow(strip, turn, prompt, prompt - usage.cache_read_input_tokens, ttft)
        rows.append(row)
        print(f"  strip={'on ' if strip else 'off'} turn {turn}: {row.prompt_tokens} prompt, "
              f"{row.prefill_tokens} prefilled, TTFT {row.ttft_s:.2f} s", flush=True)
        history.append((ask, "".join(b.text for b in final.content if b.type == "text")
                        or "(no answer)"))
    return rows


def table(rows: list[TurnRow]) -> str:
    lines = ["| turn | prompt tokens | prefilled (strip on) | TTFT on (s) | prefilled (strip off) "
             "| TTFT off (s) |", "|---|---|---|---|---|---|"]
    on = [r for r in rows if r.strip]
    off = {r.turn: r for r in rows if not r.strip}
    for r in on:
        o = off.get(r.turn)
        lines.append(f"| {r.turn} | {r.prompt_tokens:,} | {r.prefill_tokens:,} | {r.ttft_s:.2f} "
                     + (f"| {o.prefill_tokens:,} | {o.ttft_s:.2f} |" if o else "| (not run) | |"))
    if len(on) > 1:
        worst = max(r.ttft_s for r in on[1:]) / on[0].ttft_s
        lines.append(f"\nstrip on: turn 2+ TTFT at most {worst:.1%} of turn 1's (target <= 10%)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", choices=sorted(MODELS), default="default",
                   help="a packaged model: the default (8k context) or gemma3-270m (32k)")
    p.add_argument("--system-tokens", type=int, default=5800,
                   help="Claude Code's system prompt, stood in for by this many tokens "
                   "(its real one is ~29,000)")
    p.add_argument("--turns", type=int, default=5)
    p.add_argument("--off-turns", type=int, default=None,
                   help="turns with the strip off (default: --turns)")
    p.add_argument("--max-tokens", type=int, default=16, help="each turn's answer")
    p.add_argument("--num-threads", type=int, default=None, help="server torch threads")
    p.add_argument("--timeout-s", type=float, default=3600,
                   help="per request: a cold 12k-29k-token prefill on a shared 2-core machine "
                   "can pass 15 minutes")
    p.add_argument("--out", type=Path, help="write the results here as JSON")
    args = p.parse_args(argv)
    threads = ["--num-threads", str(args.num_threads)] if args.num_threads else []
    model_path = MODELS[args.model][0]()
    bank = WordBank.from_tokenizer(load_tokenizer(model_path))
    system_prompt = bank.text(random.Random(1), args.system_tokens)
    # Room for the whole session once: the prompt, each turn's ask and answer, a margin.
    pool = args.system_tokens + args.turns * (64 + args.max_tokens) + 2048
    rows: list[TurnRow] = []
    with tempfile.TemporaryDirectory() as tmp:
        for strip in (True, False):
            flag = "--strip-preambles" if strip else "--no-strip-preambles"
            server = start_server(["--model", str(model_path), "--served-model-name",
                                   MODELS[args.model][1], flag, "--kv-cache-tokens",
                                   str(max(pool, 16384)), "--no-access-log", *threads],
                                  Path(tmp) / f"{flag}.log")
            try:
                with anthropic.Anthropic(base_url=server.base_url, api_key="unused",
                                         max_retries=0, timeout=args.timeout_s) as client:
                    rows += run_session(client, system_prompt, args, strip)
            finally:
                server.stop()
    print()
    print(table(rows))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        config = {k: v for k, v in vars(args).items() if k != "out"}
        args.out.write_text(json.dumps({"config": config, "turns": [asdict(r) for r in rows]},
                                       indent=2))
        print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
