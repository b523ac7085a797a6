"""Prompt caching through the Anthropic API, as a bill and as latency, against `radixserve serve`.

(a) Break-even from the ledger: in vendor accounting, one request writes a --system-tokens
    system prompt at a 5m (then a 1h) breakpoint and later requests read it; the cost headers
    of each response give the cumulative bill with and without caching, and the reuse count
    where caching starts to pay (5m: after one reuse, 1.25 + 0.1 = 1.35 < 2; 1h: after two).
(b) TTL pins under eviction pressure: in engine accounting with a small KV pool, a pinned
    (cache_control) and an unpinned system prompt are asked again after unrelated traffic
    has filled the pool; the pinned one keeps its warm TTFT, the unpinned one falls back to cold.

    python benchmarks/bench_anthropic.py --out results/bench_anthropic.json
    python benchmarks/bench_anthropic.py --system-tokens 300 --pressure-tokens 300 --rounds 1
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import anthropic

from radixserve.bench.textgen import WordBank
from radixserve.model.default_model import default_model_path
from radixserve.model.loader import load_tokenizer
from radixserve.provider_caching import break_even_reuses, default_prices, get_profile
from radixserve.testing.server import start_server

MODEL = "claude-sonnet-4-6"  # profile anthropic-1024: $3/MTok input
USER = [{"role": "user", "content": "Answer in one word: ready?"}]


@dataclass
class LedgerRow:
    ttl: str
    reuses: int  # reads after the one write
    cached_usd: float  # cumulative, as billed with caching
    uncached_usd: float  # cumulative, as if nothing were cached
    cached_units: float  # cumulative cost in units of one uncached prompt
    uncached_units: float
    pays_off: bool


@dataclass
class PressureRow:
    prefix: str  # "pinned" or "unpinned"
    phase: str  # "warm" (just used) or "after pressure"
    ttft_s: float
    cached_tokens: int


def _ask(client: anthropic.Anthropic, system: list[dict[str, Any]], max_tokens: int) -> Any:
    return client.messages.with_raw_response.create(model=MODEL, max_tokens=max_tokens,
                                                    system=system, messages=USER)


def break_even(args: argparse.Namespace, bank: WordBank, log_dir: Path) -> list[LedgerRow]:
    server = start_server(["--cache-accounting", "vendor", "--kv-cache-tokens",
                           str(args.system_tokens * 3 + 1024), *args.server_args],
                          log_dir / "vendor.log")
    rows: list[LedgerRow] = []
    try:
        with anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0,
                                 timeout=600) as client:
            for ttl, seed in (("5m", 1), ("1h", 2)):
                system = [{"type": "text", "text": bank.text(random.Random(seed),
                                                             args.system_tokens),
                           "cache_control": {"type": "ephemeral", "ttl": ttl}}]
                cached = uncached = 0.0
                unit = None
                for reuses in range(args.max_reuses + 1):
                    # max_tokens 0 (a pre-warm) bills no output: the ledger is the prompt's.
                    raw = _ask(client, system, 0)
                    usage = raw.parse().usage
                    if reuses == 0:
                        assert usage.cache_creation_input_tokens > 0, usage
                    else:
                        assert usage.cache_read_input_tokens > 0, usage
                    cached += float(raw.headers["x-radixserve-cost-usd"])
                    step = float(raw.headers["x-radixserve-uncached-cost-usd"])
                    uncached += step
                    unit = unit or step
                    rows.append(LedgerRow(ttl, reuses, cached, uncached, cached / unit,
                                          uncached / unit, cached < uncached))
                    print(f"  {ttl} reuses={reuses}: {cached / unit:.3f} vs "
                          f"{uncached / unit:.3f} uncached prompts", flush=True)
    finally:
        server.stop()
    return rows


def _ttft(client: anthropic.Anthropic, system: list[dict[str, Any]]) -> tuple[float, int]:
    """Seconds to the first event (the server sends message_start with the first token)."""
    started = time.perf_counter()
    with client.messages.stream(model=MODEL, max_tokens=1, system=system,
                                messages=USER) as stream:
        first = next(iter(stream))
        elapsed = time.perf_counter() - started
        assert first.type == "message_start"
        cached = first.message.usage.cache_read_input_tokens
        for _ in stream:
            pass
    return elapsed, cached


def pressure(args: argparse.Namespace, bank: WordBank, log_dir: Path) -> list[PressureRow]:
    pool = int(args.system_tokens * 2.2) + 256
    server = start_server(["--kv-cache-tokens", str(pool), "--max-pinned-fraction", "0.6",
                           *args.server_args], log_dir / "engine.log")
    rng = random.Random(3)
    pinned_text, unpinned_text = bank.distinct_texts(rng, 2, args.system_tokens)
    systems = {
        "pinned": [{"type": "text", "text": pinned_text,
                    "cache_control": {"type": "ephemeral", "ttl": "1h"}}],
        "unpinned": [{"type": "text", "text": unpinned_text}],
    }
    per_round = math.ceil(pool / args.pressure_tokens) + 1
    rows: list[PressureRow] = []
    try:
        with anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0,
                                 timeout=600) as client:
            for name, system in systems.items():
                _ttft(client, system)  # cold: fills the cache
                rows.append(PressureRow(name, "warm", *_ttft(client, system)))
            for round_index in range(args.rounds):
                for name, system in systems.items():
                    for _ in range(per_round):  # unrelated traffic that fills the pool
                        text = bank.text(rng, args.pressure_tokens)
                        client.messages.create(model=MODEL, max_tokens=1,
                                               messages=[{"role": "user", "content": text}])
                    rows.append(PressureRow(name, "after pressure", *_ttft(client, system)))
                print(f"  round {round_index + 1}/{args.rounds} done", flush=True)
    finally:
        server.stop()
    return rows


def ledger_table(rows: list[LedgerRow]) -> str:
    lines = ["ttl  reuses  cached (prompts)  uncached (prompts)  pays off",
             "---  ------  ----------------  ------------------  --------"]
    lines += [f"{r.ttl:<4} {r.reuses:>6}  {r.cached_units:>16.3f}  {r.uncached_units:>18.3f}  "
              f"{'yes' if r.pays_off else 'no':>8}" for r in rows]
    price = default_prices().lookup(MODEL, get_profile("anthropic-1024"))
    for ttl in ("5m", "1h"):
        measured = next((r.reuses for r in rows if r.ttl == ttl and r.pays_off), None)
        lines.append(f"{ttl}: pays off after {measured} reuse(s) on the ledger; "
                     f"{break_even_reuses(price, ttl)} by the price multipliers")
    return "\n".join(lines)


def pressure_table(rows: list[PressureRow]) -> str:
    lines = ["prefix    phase           TTFT p50 (s)  cached tokens (min)",
             "--------  --------------  ------------  -------------------"]
    for prefix in ("pinned", "unpinned"):
        for phase in ("warm", "after pressure"):
            chosen = [r for r in rows if r.prefix == prefix and r.phase == phase]
            ttft = statistics.median(r.ttft_s for r in chosen)
            cached = min(r.cached_tokens for r in chosen)
            lines.append(f"{prefix:<8}  {phase:<14}  {ttft:>12.3f}  {cached:>19}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--system-tokens", type=int, default=2000, help="system prompt length")
    p.add_argument("--max-reuses", type=int, default=3, help="reads after the write, in (a)")
    p.add_argument("--pressure-tokens", type=int, default=1500,
                   help="length of each unrelated prompt in (b)")
    p.add_argument("--rounds", type=int, default=3, help="pressure rounds in (b)")
    p.add_argument("--num-threads", type=int, default=None, help="server torch threads")
    p.add_argument("--out", type=Path, help="write the results here as JSON")
    args = p.parse_args(argv)
    args.server_args = ["--no-access-log"] + (
        ["--num-threads", str(args.num_threads)] if args.num_threads else [])
    bank = WordBank.from_tokenizer(load_tokenizer(default_model_path()))
    with tempfile.TemporaryDirectory() as tmp:
        print("(a) break-even from the ledger (vendor accounting)", flush=True)
        ledger = break_even(args, bank, Path(tmp))
        print("(b) TTL pins under eviction pressure (engine accounting)", flush=True)
        latency = pressure(args, bank, Path(tmp))
    print()
    print(ledger_table(ledger))
    print()
    print(pressure_table(latency))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        config = {k: v for k, v in vars(args).items() if k not in ("out", "server_args")}
        args.out.write_text(json.dumps({"config": config,
                                        "break_even": [asdict(r) for r in ledger],
                                        "pressure": [asdict(r) for r in latency]}, indent=2))
        print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
