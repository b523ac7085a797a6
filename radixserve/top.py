"""`radixserve top`: the live cache figures of GET /v1/cache/stats in a terminal, for servers
without a browser. `render_frame` turns one stats document into text (pure, for tests); the
command fetches and redraws it every --interval seconds with plain ANSI, or once with --once.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
import unicodedata
from collections.abc import Iterator
from typing import Any

import httpx

from radixserve.serve import API_KEY_ENV

Stats = dict[str, Any]  # the JSON document of GET /v1/cache/stats (README: "Cache stats")

RECENT_SECONDS = 10  # "now" figures: the last this many one-second buckets
TOP_TENANTS = 5
TREE_LINES = 12
RECENT_LINES = 8
POOL_STATES = (("private", "#"), ("protected", "="), ("pinned", "+"), ("evictable", "-"),
               ("free", "."))
_ESCAPES = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


class TopError(Exception):
    """The stats cannot be fetched; `status` is the exit status (2: refused credentials)."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = subparsers.add_parser(
        "top", help="live prompt-cache figures of a running server, in the terminal",
        description="Show a running server's GET /v1/cache/stats as a terminal view: hit rate, "
                    "requests/s, TTFT, KV pool states, cost saved, tenants, the radix tree's "
                    "top prefixes and recent requests. Ctrl-C quits. Exit status: 1 when the "
                    "server cannot be reached or answers an error, 2 when it refuses the key.")
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the server's base URL (default: %(default)s)")
    p.add_argument("--api-key", default=os.environ.get(API_KEY_ENV), metavar="KEY",
                   help=f"the server's API key; default: ${API_KEY_ENV}")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between redraws (default: %(default)s)")
    p.add_argument("--once", action="store_true", help="print one frame and exit")
    p.set_defaults(func=top)


def top(args: argparse.Namespace) -> int:
    if args.interval <= 0:
        print("error: --interval must be > 0", file=sys.stderr)
        return 2
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    url = args.url.rstrip("/")
    with httpx.Client(base_url=url, headers=headers, timeout=10.0, trust_env=False) as client:
        try:
            if args.once:
                width = shutil.get_terminal_size().columns if sys.stdout.isatty() else None
                print(render_frame(fetch_stats(client), width))
                return 0
            return _live(client, args.interval)
        except TopError as exc:
            print(f"error: {url}: {exc}", file=sys.stderr)
            return exc.status


def fetch_stats(client: httpx.Client) -> Stats:
    try:
        response = client.get("/v1/cache/stats", params={"window": "5m"})
    except httpx.HTTPError as exc:
        raise TopError(f"cannot fetch the stats ({exc or type(exc).__name__})", 1) from exc
    if response.status_code in (401, 403):
        raise TopError(f"{response.status_code}: the server refused the API key (pass "
                       f"--api-key or set ${API_KEY_ENV})", 2)
    if response.status_code == 404:
        raise TopError("404: this server has no /v1/cache/stats (an older radixserve?)", 1)
    if response.status_code != 200:
        raise TopError(f"{response.status_code} from /v1/cache/stats", 1)
    try:
        return dict(response.json())
    except ValueError as exc:
        raise TopError("/v1/cache/stats did not answer JSON", 1) from exc


def _live(client: httpx.Client, interval: float) -> int:
    """Redraws until Ctrl-C (exit 0) or a fetch fails (TopError); the terminal's alternate
    screen keeps the shell's scrollback clean."""
    tty = sys.stdout.isatty()
    if tty:
        sys.stdout.write("\x1b[?1049h\x1b[?25l")  # alternate screen, cursor hidden
    try:
        while True:
            size = shutil.get_terminal_size()
            frame = render_frame(fetch_stats(client), size.columns if tty else None)
            if tty:
                lines = frame.splitlines()[: size.lines - 1]
                sys.stdout.write("\x1b[H" + "".join(line + "\x1b[K\n" for line in lines)
                                 + "\x1b[J")
            else:
                sys.stdout.write(frame + "\n\n")
            sys.stdout.flush()
            time.sleep(interval)
    except KeyboardInterrupt:
        return 0
    finally:
        if tty:
            sys.stdout.write("\x1b[?25h\x1b[?1049l")
            sys.stdout.flush()


def render_frame(stats: Stats, width: int | None = None) -> str:
    """One screen of text from a stats document: lines cut to `width` columns (None: whole);
    server-supplied text (prompt prefixes, namespaces) has its control characters escaped."""
    lines = [*_header(stats), "", *_pool(stats.get("pool", {}), width), "",
             *_tenants(stats.get("tenants", [])), "", *_tree(stats.get("tree", {})), "",
             *_recent(stats.get("recent", []), stats.get("now", 0.0))]
    return "\n".join(line[:width] for line in lines)


def _header(stats: Stats) -> Iterator[str]:
    series, totals, cost = stats.get("series", {}), stats.get("totals", {}), stats.get("cost", {})
    clock = time.strftime("%H:%M:%S", time.localtime(stats.get("now", 0.0)))
    yield (f"radixserve top - {escape(str(stats.get('model', '?')))} - up "
           f"{_duration(stats.get('uptime_s', 0.0))} - {clock}")
    recent = _tail(series, RECENT_SECONDS)
    yield (f"hit rate  now {_pct(_ratio(recent, 'cached_tokens', 'prompt_tokens'))}"
           f"   5 min {_pct(_ratio(series, 'cached_tokens', 'prompt_tokens'))}"
           f"   since start {_pct(totals.get('hit_rate'))}"
           f"   ({totals.get('requests', 0):,} requests, {totals.get('cached_tokens', 0):,} of "
           f"{totals.get('prompt_tokens', 0):,} prompt tokens cached)")
    rate = sum(recent.get("requests", [])) / max(len(recent.get("requests", [])), 1)
    yield (f"requests/s {rate:.1f}   TTFT p50 {_ms(_last(series.get('ttft_p50_s', [])))}"
           f"   p99 {_ms(_last(series.get('ttft_p99_s', [])))}")
    yield (f"cost ({escape(str(cost.get('profile', '?')))})"
           f"  with cache ${cost.get('with_cache_usd', 0.0):.4f}"
           f"   without ${cost.get('without_cache_usd', 0.0):.4f}"
           f"   saved ${cost.get('saved_usd', 0.0):.4f}"
           f" (${cost.get('saved_usd_per_hour', 0.0):.2f}/h)")


def _pool(pool: dict[str, int], width: int | None) -> Iterator[str]:
    total = pool.get("total", 0)
    yield f"KV pool  {total:,} tokens"
    bar_width = max(min((width or 100) - 2, 98), 10)
    bar, filled = "", 0.0
    for state, mark in POOL_STATES:
        filled += pool.get(state, 0) / total * bar_width if total else 0.0
        bar += mark * (round(filled) - len(bar))
    yield f"[{bar.ljust(bar_width)}]"
    yield "  ".join(f"{mark} {state} {pool.get(state, 0):,}" for state, mark in POOL_STATES)


def _tenants(tenants: list[dict[str, Any]]) -> Iterator[str]:
    yield f"{'tenant':<28} {'requests':>9} {'hit rate':>9} {'tokens saved':>13}"
    ranked = sorted(tenants, key=lambda t: t.get("requests", 0), reverse=True)
    for tenant in ranked[:TOP_TENANTS]:
        yield (f"{_clip(escape(str(tenant.get('namespace', '?'))), 28):<28} "
               f"{tenant.get('requests', 0):>9,} {_pct(tenant.get('hit_rate')):>9} "
               f"{tenant.get('tokens_saved', 0):>13,}")
    if len(ranked) > TOP_TENANTS:
        yield f"... and {len(ranked) - TOP_TENANTS} more"


def _tree(tree: dict[str, Any]) -> Iterator[str]:
    shown = list(_walk(tree.get("roots", [])))
    yield (f"top prefixes ({tree.get('nodes', 0):,} nodes)"
           f"{' ' * 24}{'tokens':>7} {'hits':>6} {'served':>8} {'idle':>6} {'locks':>5}  pin")
    for level, node in shown[:TREE_LINES]:
        pin = node.get("pinned_for_s")
        text = _clip("  " * level + repr_text(node.get("text", "")), 46)
        idle = _duration(node.get("last_used_s_ago", 0.0))
        yield (f"{text:<46}{node.get('tokens', 0):>7,} {node.get('hits', 0):>6,} "
               f"{node.get('served_tokens', 0):>8,} {idle:>6} "
               f"{node.get('locks', 0):>5}  {'-' if pin is None else _duration(pin)}")
    if not shown:
        yield "  (no cached prefixes to show)"


def _walk(nodes: list[dict[str, Any]], level: int = 0) -> Iterator[tuple[int, dict[str, Any]]]:
    """(nesting level, node), depth first, in the server's order (best first among siblings);
    a node's `depth` counts tokens, not levels."""
    for node in nodes:
        yield level, node
        yield from _walk(node.get("children", []), level + 1)


def _recent(recent: list[dict[str, Any]], now: float) -> Iterator[str]:
    yield (f"recent requests {'ago':>5} {'api':>9} {'prompt':>7} {'cached':>7} {'TTFT':>8} "
           f"{'cost $':>9}  cache missed at")
    newest_first = sorted(recent, key=lambda request: request.get("at", 0.0), reverse=True)
    for request in newest_first[:RECENT_LINES]:
        miss = request.get("miss_at")
        where = ("-" if miss is None
                 else f"token {miss}: {repr_text(request.get('miss_text', ''))}")
        cost = request.get("cost_usd")  # None: not billed
        yield (f"{'':15} {_duration(now - request.get('at', now)):>5} "
               f"{escape(str(request.get('api', '?'))):>9} {request.get('prompt_tokens', 0):>7,} "
               f"{request.get('cached_tokens', 0):>7,} {_ms(request.get('ttft_s')):>8} "
               f"{'-' if cost is None else f'{cost:.5f}':>9}  {where}")
    if not recent:
        yield "  (none yet)"


def escape(text: str) -> str:
    """`text` with control and format characters (newlines, ANSI escapes, bidi overrides) as
    visible escapes, so prompt text cannot move the cursor or recolour the terminal."""
    return "".join(_ESCAPES.get(ch) or (f"\\x{ord(ch):02x}" if ord(ch) < 0x100 else
                                        f"\\u{ord(ch):04x}")
                   if unicodedata.category(ch)[0] == "C" else ch for ch in text)


def repr_text(text: str) -> str:
    return f'"{escape(text)}"'


def _tail(series: dict[str, Any], points: int) -> dict[str, list[Any]]:
    return {key: values[-points:] for key, values in series.items() if isinstance(values, list)}


def _ratio(series: dict[str, Any], part: str, whole: str) -> float | None:
    total = sum(series.get(whole, []))
    return sum(series.get(part, [])) / total if total else None


def _last(values: list[float | None]) -> float | None:
    return next((v for v in reversed(values) if v is not None), None)


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f} ms"


def _duration(seconds: float) -> str:
    whole = max(int(seconds), 0)
    if whole < 60:
        return f"{whole}s"
    if whole < 3600:
        return f"{whole // 60}m{whole % 60:02d}s"
    return f"{whole // 3600}h{whole % 3600 // 60:02d}m"


def _clip(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."

