"""`bench report`: result files -> a markdown report with PNG plots and the exact commands that
reproduce every run. BENCHMARKS.md is written by it.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path

from radixserve.bench import plots
from radixserve.bench.claims import claims_markdown
from radixserve.bench.results import BenchResult


def _num(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def _series(r: BenchResult) -> tuple[str, str]:
    return r.name, r.workload_name


def runs_table(results: Sequence[BenchResult]) -> list[str]:
    header = ["system", "workload", "conc.", "rate", "ok/failed", "req/s", "out tok/s",
              "TTFT med", "TTFT p99", "TPOT med", "ITL p99", "E2EL p99", "hit (usage)",
              "hit (/metrics)", "hit (implied)"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in results:
        s, c = r.summary, r.summary.cache
        rate = r.load.get("request_rate")
        usage = (_pct(c.usage_hit_rate) if c.usage_requests_reported else "not reported")
        lines.append("| " + " | ".join([
            r.name, r.workload_name, str(r.concurrency), "inf" if rate is None else f"{rate:g}",
            f"{s.completed}/{s.failed}", _num(s.request_throughput, 2),
            _num(s.output_throughput), _num(s.ttft.median_ms), _num(s.ttft.p99_ms),
            _num(s.tpot.median_ms), _num(s.itl.p99_ms), _num(s.e2el.p99_ms), usage,
            _pct(c.metrics_hit_rate), _pct(c.ideal_hit_rate),
        ]) + " |")
    return lines


def cache_modes_table(results: Sequence[BenchResult]) -> list[str]:
    modes = ("radix", "hash", "off")
    cells: dict[tuple[str, int], dict[str, BenchResult]] = {}
    for r in results:
        if r.cache_mode is not None:
            cells.setdefault((r.workload_name, r.concurrency), {})[r.cache_mode] = r
    if not cells:
        return ["No radixserve runs with metadata prefix_cache=radix|hash|off."]
    header = ["workload", "conc."] + [f"{m} req/s" for m in modes] + \
        [f"{m} TTFT med" for m in modes] + [f"{m} hit" for m in modes]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for (workload, concurrency), by_mode in sorted(cells.items()):
        row = [workload, str(concurrency)]
        row += [_num(by_mode[m].summary.request_throughput, 2) if m in by_mode else "-"
                for m in modes]
        row += [_num(by_mode[m].summary.ttft.median_ms) if m in by_mode else "-" for m in modes]
        row += [_pct(by_mode[m].hit_rate[0]) if m in by_mode else "-" for m in modes]
        lines.append("| " + " | ".join(row) + " |")
    return lines


def draw_plots(results: Sequence[BenchResult], out: Path) -> list[tuple[str, str]]:
    """Writes the PNGs into `out`; returns (caption, file name) pairs."""
    drawn = []
    ttft: dict[tuple[str, str], list[tuple[float, float]]] = {}
    p99: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for r in results:
        if r.summary.ttft.median_ms is not None:
            ttft.setdefault(_series(r), []).append((r.concurrency, r.summary.ttft.median_ms))
        if r.summary.e2el.p99_ms is not None:
            p99.setdefault(_series(r), []).append((r.concurrency, r.summary.e2el.p99_ms))
    plots.line_panels(out / "latency_vs_concurrency.png",
                      [("median TTFT (ms)", ttft), ("p99 end-to-end latency (ms)", p99)],
                      "concurrent requests", "Latency vs concurrency")
    drawn.append(("TTFT and p99 latency vs concurrency", "latency_vs_concurrency.png"))

    # Per system and workload, its best run: what the system sustains at the loads tried.
    req: dict[str, dict[str, float]] = {}
    tok: dict[str, dict[str, float]] = {}
    hits: dict[str, dict[str, float]] = {}
    implied: dict[str, float] = {}
    for r in results:
        w = r.workload_name
        req.setdefault(w, {})[r.name] = max(req.get(w, {}).get(r.name, 0.0),
                                              r.summary.request_throughput)
        tok.setdefault(w, {})[r.name] = max(tok.get(w, {}).get(r.name, 0.0),
                                              r.summary.output_throughput)
        rate, _ = r.hit_rate
        if rate is not None:
            hits.setdefault(w, {})[r.name] = rate
        if r.summary.cache.ideal_hit_rate is not None:
            implied[w] = max(implied.get(w, 0.0), r.summary.cache.ideal_hit_rate)
    plots.bar_panels(out / "throughput.png",
                     [("requests/s", req), ("output tokens/s", tok)],
                     "Throughput per system (best run per workload)")
    drawn.append(("Throughput per system and workload", "throughput.png"))
    plots.bar_panels(out / "hit_rate.png", [("prefix-cache hit rate (%)", hits)],
                     "Hit rate per workload (dashed: what the workload's tokens allow)",
                     marks=implied, percent=True)
    drawn.append(("Hit rate per workload", "hit_rate.png"))

    modes = [r for r in results if r.cache_mode is not None]
    if modes:
        mode_req: dict[str, dict[str, float]] = {}
        mode_ttft: dict[str, dict[str, float]] = {}
        for r in modes:
            group = f"{r.workload_name} c={r.concurrency}"
            mode_req.setdefault(group, {})[r.cache_mode or ""] = r.summary.request_throughput
            mode_ttft.setdefault(group, {})[r.cache_mode or ""] = r.summary.ttft.median_ms or 0.0
        plots.bar_panels(out / "cache_modes.png",
                         [("requests/s", mode_req), ("median TTFT (ms)", mode_ttft)],
                         "radixserve: radix vs hash vs off")
        drawn.append(("radix vs hash vs off", "cache_modes.png"))
    return drawn


def commands_section(results: Sequence[BenchResult], report_command: str) -> list[str]:
    lines = ["To rerun, start each server as shown, run each bench command, then the report:", ""]
    seen: set[str] = set()
    for r in results:
        server = r.metadata.get("server_command")
        block = ([f"# {r.name}: server"] if server else []) + ([server] if server else [])
        block += [f"# {r.name}: {r.workload_name}", r.command or "(command not recorded)"]
        text = "\n".join(block)
        if text not in seen:
            seen.add(text)
            lines += ["```sh", text, "```"]
    lines += ["```sh", report_command, "```"]
    return lines


def write_report(results: Sequence[BenchResult], out: Path, title: str, command: str,
                 markdown: Path | None = None) -> Path:
    """Plots go into `out`; the markdown to `markdown` (default `out/report.md`), linking the
    plots relative to wherever it is (so BENCHMARKS.md at the repository root works)."""
    out.mkdir(parents=True, exist_ok=True)
    markdown = markdown or out / "report.md"
    markdown.parent.mkdir(parents=True, exist_ok=True)
    drawn = draw_plots(results, out)
    env = results[0].environment if results else {}
    when = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    workloads = {r.workload_name: r.workload.get("description", "") for r in results}
    lines = [
        f"# {title}",
        "",
        f"Written by `radixserve bench report` on {when} from {len(results)} run(s). "
        f"Client machine: {env.get('platform', '?')}, {env.get('cpu_count', '?')} CPUs, "
        f"radixserve {env.get('radixserve', '?')}.",
        "",
        "Latencies in ms, with `vllm bench serve`'s definitions: TTFT to the first generated "
        "text, TPOT = (E2EL - TTFT) / (output tokens - 1), ITL pooled over every chunk gap. "
        "Hit rates are prompt tokens served from the cache over prompt tokens: from each "
        "response's `usage.prompt_tokens_details.cached_tokens` (zeros counted), from the "
        "server's `prefix_cache_hits/queries` counters over the run, and the rate the "
        "workload's tokens allow an unbounded token-granular cache (\"implied\").",
        "",
        "## Runs",
        "",
        *runs_table(results),
        "",
        "## Plots",
        "",
    ]
    for caption, name in drawn:
        link = Path(os.path.relpath(out / name, markdown.parent)).as_posix()
        lines += [f"![{caption}]({link})", ""]
    lines += ["## Prefix cache: radix vs hash vs off", "", *cache_modes_table(results), "",
              "## The claims, re-measured", "", claims_markdown(results), "",
              "## Workloads", ""]
    lines += [f"- `{name}`: {text}" for name, text in sorted(workloads.items())]
    lines += ["", "## Commands", "", *commands_section(results, command), ""]
    markdown.write_text("\n".join(lines))
    return markdown
