"""The lint report as terminal text (optionally coloured) or as JSON-ready data."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from radixserve.lint.analysis import LintReport
from radixserve.lint.simulate import SimulationResult

_COLOURS = {"bold": "1", "red": "31", "yellow": "33", "green": "32", "dim": "2"}


def render_text(report: LintReport, colour: bool = False) -> str:
    def paint(text: str, style: str) -> str:
        return f"\033[{_COLOURS[style]}m{text}\033[0m" if colour else text

    lines = []
    files = len(report.files)
    skipped = f" ({len(report.malformed)} malformed lines skipped)" if report.malformed else ""
    lines.append(paint(
        f"radixserve lint: {report.requests} requests in {files} file{'s' * (files != 1)}, "
        f"{report.total_tokens:,} prompt tokens{skipped}", "bold"))
    s = report.structure
    lines += ["", paint("Prefix sharing", "bold"),
              f"  distinct prefixes (tools + system): {s.distinct_prefixes}",
              f"  reusable: {s.reusable_tokens:,} of {s.total_tokens:,} tokens "
              f"({s.reusable_fraction:.1%}) are shared with an earlier request"]
    if s.divergence_points:
        lines.append("  where requests diverge from their nearest earlier request:")
        for p in s.divergence_points:
            lines.append(f"    {p.requests:>5} × {p.path} ({p.tier}) at char {p.char_offset}")
    errors = sum(1 for f in report.findings if f.severity == "error")
    lines += ["", paint(f"Findings: {len(report.findings)}"
                        + (f" ({errors} error{'s' * (errors != 1)})" if errors else ""), "bold")]
    if not report.findings:
        lines.append("  none: no cache-busters found")
    for f in report.findings:
        tag = paint("ERROR", "red") if f.severity == "error" else paint("WARN ", "yellow")
        where = ", ".join(x for x in (
            f.location, f.path and (f"{f.path} line {f.line_in_block}" if f.line_in_block else f.path),
            f"char {f.char_offset}" if f.char_offset is not None else None) if x)
        cost = f", {f.tokens_lost_per_request:,} tokens lost per request" if f.tokens_lost_per_request else ""
        lines.append(f"  {tag} {f.kind}: {f.title}")
        lines.append(f"        at {where}; {f.requests} request{'s' * (f.requests != 1)}{cost}")
        if f.detail:
            lines.append(paint(f"        seen: {f.detail!r}", "dim"))
        lines.append("        fix: " + paint(f.fix, "green"))
    if report.malformed:
        lines += ["", paint("Malformed lines (skipped)", "bold")]
        lines += [f"  {m.location}: {m.reason}" for m in report.malformed]
    if report.simulation is not None:
        lines += ["", *_simulation_lines(report.simulation, report.simulation_fixed, paint)]
    return "\n".join(lines) + "\n"


def _simulation_lines(sim: SimulationResult, fixed: SimulationResult | None, paint: Any) -> list[str]:
    lines = [paint(f"Simulation ({sim.vendor}; profiles: {', '.join(sim.profiles) or '-'})", "bold"),
             f"  requests: {sim.requests} ({sim.rejected} rejected by the vendor), "
             f"{sim.requests_with_hits} with cache hits",
             f"  prompt tokens: {sim.prompt_tokens:,}; read from cache {sim.cache_read_tokens:,} "
             f"({sim.hit_rate:.1%}); written to cache {sim.cache_write_tokens:,}",
             f"  cost: {_dollars(sim.cost.with_cache)} with caching, "
             f"{_dollars(sim.cost.without_cache)} without ("
             + (f"saves {_dollars(sim.cost.saved)})" if sim.cost.saved >= 0
                else f"costs {_dollars(-sim.cost.saved)} more)")]
    if sim.unmarked:
        lines.append(f"  {sim.unmarked} request{'s' * (sim.unmarked != 1)} carry no cache_control "
                     "(or are in OpenAI format): Anthropic caches nothing for them")
    if fixed is not None:
        gain = sim.cost.with_cache - fixed.cost.with_cache
        effect = f"save a further {_dollars(gain)}" if gain >= 0 else f"cost {_dollars(-gain)} more"
        lines.append(f"  with every fix applied: {_dollars(fixed.cost.with_cache)}, hit rate "
                     f"{fixed.hit_rate:.1%} (the fixes {effect})")
    if sim.break_even_5m is not None:
        lines.append(f"  break-even: a 5m write pays off after {sim.break_even_5m} read(s), "
                     f"a 1h write after {sim.break_even_1h}")
    return lines


def _dollars(value: float) -> str:
    return f"${value:,.4f}" if abs(value) < 100 else f"${value:,.2f}"


def to_json(report: LintReport) -> dict[str, Any]:
    s = report.structure
    data: dict[str, Any] = {
        "files": list(report.files),
        "requests": report.requests,
        "prompt_tokens": report.total_tokens,
        "malformed": [{"source": m.source, "line": m.line, "reason": m.reason}
                      for m in report.malformed],
        "structure": {
            "distinct_prefixes": s.distinct_prefixes,
            "reusable_tokens": s.reusable_tokens,
            "reusable_fraction": round(s.reusable_fraction, 4),
            "divergence_points": [p.__dict__ for p in s.divergence_points],
        },
        "findings": [f.to_json() for f in report.findings],
    }
    if report.simulation is not None:
        data["simulation"] = _simulation_json(report.simulation)
        if report.simulation_fixed is not None:
            data["simulation_fixed"] = _simulation_json(report.simulation_fixed)
    return data


def _simulation_json(sim: SimulationResult) -> dict[str, Any]:
    return {
        "vendor": sim.vendor, "profiles": list(sim.profiles), "requests": sim.requests,
        "rejected": sim.rejected, "unmarked": sim.unmarked, "requests_with_hits": sim.requests_with_hits,
        "prompt_tokens": sim.prompt_tokens, "cache_read_tokens": sim.cache_read_tokens,
        "cache_write_tokens": sim.cache_write_tokens, "hit_rate": round(sim.hit_rate, 4),
        "cost_with_cache": sim.cost.with_cache, "cost_without_cache": sim.cost.without_cache,
        "break_even_reuses": {"5m": sim.break_even_5m, "1h": sim.break_even_1h},
        "usage": [asdict(u) if u else None for u in sim.usages],
    }
