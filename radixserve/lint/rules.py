"""Lint checks beyond prefix divergence: settings changed within a conversation, breakpoint
misuse (rejected markers, breakpoints below the model minimum, none at all) and concurrent
fan-out of one cold prefix.
"""

from __future__ import annotations

from collections.abc import Callable

from radixserve.lint.corpus import Corpus, LintRequest
from radixserve.lint.findings import Instance
from radixserve.lint.repairs import AddAutomaticCaching, Delay, PinSetting
from radixserve.lint.structure import PrefixStructure
from radixserve.provider_caching.breakpoints import check_breakpoints

# A prefix unused this long is cold again (the default 5-minute TTL).
_COLD_AFTER_S = 300.0


def setting_instances(corpus: Corpus, structure: PrefixStructure) -> list[Instance]:
    """A conversation's next turn with another value of a setting that the vendor renders
    into the prompt loses the cached turns from the tier that setting invalidates."""
    roots: dict[int, int] = {}
    instances = []
    for d in structure.divergences:
        r = corpus.requests[d.request]
        if d.reference is None or not d.extends_reference:
            roots[r.index] = r.index
            continue
        roots[r.index] = roots.get(d.reference, d.reference)
        q, root = corpus.requests[d.reference], corpus.requests[roots[r.index]]
        now, before, first = _settings(r), _settings(q), _settings(root)
        for name in sorted(now.keys() | before.keys() | first.keys()):
            pin = PinSetting(name, first.get(name, (None,))[0])
            if now.get(name, (None,))[0] == before.get(name, (None,))[0]:
                if now.get(name, (None,))[0] != pin.value_json:  # keep the whole conversation pinned
                    instances.append(Instance("setting_change", r.index, r.logged.location,
                                              repair=pin, reported=False))
                continue
            tier = (now.get(name) or before[name])[1]
            shared_end = r.start_of(len(q.rendered.blocks))
            lost = shared_end - r.start_of(r.rendered.tier_start(tier))  # type: ignore[arg-type]
            if lost <= 0:
                continue
            instances.append(Instance(
                "setting_change", r.index, r.logged.location, tier=tier, tokens_lost=lost,
                detail=f"{name}: {_shown(before.get(name))} -> {_shown(now.get(name))}",
                subject=name, repair=pin))
    return instances


def breakpoint_instances(
    corpus: Corpus, structure: PrefixStructure, minimum: Callable[[LintRequest], int]
) -> list[Instance]:
    """Anthropic requests: markers the vendor rejects, breakpoints below the model's minimum
    (silently not cached), and shared prefixes sent with no breakpoint at all."""
    instances = []
    for d in structure.divergences:
        r = corpus.requests[d.request]
        if r.rendered.format != "anthropic":
            continue
        check = check_breakpoints(r.rendered)
        for error in check.errors:
            path = error.message.split(":", 1)[0] if ": " in error.message else None
            instances.append(Instance(
                "breakpoint_error", r.index, r.logged.location, path=path, detail=error.message,
                subject=error.rule, severity="error"))
        least = minimum(r)
        for bp in () if check.errors else check.breakpoints:
            tokens = r.block_ends[bp.block_index]
            if tokens < least:
                instances.append(Instance(
                    "breakpoint_below_minimum", r.index, r.logged.location,
                    tier=r.rendered.blocks[bp.block_index].tier, path=bp.path,
                    detail=f"the prefix there is {tokens:,} tokens, below this model's "
                           f"{least:,} minimum"))
        if not check.breakpoints and not check.errors and d.shared_tokens >= least:
            q = corpus.requests[d.reference] if d.reference is not None else None
            unmarked = q is not None and not check_breakpoints(q.rendered).breakpoints
            instances.append(Instance(
                "no_breakpoint", r.index, r.logged.location, tokens_lost=d.shared_tokens,
                detail=f"{d.shared_tokens:,} tokens shared with an earlier request",
                repair=AddAutomaticCaching(), reference=d.reference,
                reference_repair=AddAutomaticCaching() if unmarked else None))
    return instances


def fan_out_instances(
    corpus: Corpus, structure: PrefixStructure, minimum: Callable[[LintRequest], int],
    window_s: float,
) -> list[Instance]:
    """Requests that share a cold prefix with one sent less than `window_s` earlier (before it
    could have started responding): each pays a full write or miss instead of a read."""
    warm_at: dict[bytes, float] = {}
    last_used: dict[bytes, float] = {}
    instances = []
    for d in structure.divergences:
        r = corpus.requests[d.request]
        depth = min(d.block, len(r.chain))
        if r.logged.timestamp is not None and d.reference is not None and depth > 0:
            ready = warm_at.get(r.chain[depth - 1])
            tokens = r.start_of(depth)
            if ready is not None and r.time < ready and tokens >= minimum(r):
                path = r.rendered.blocks[depth - 1].path
                instances.append(Instance(
                    "fan_out", r.index, r.logged.location, tier=r.rendered.blocks[depth - 1].tier,
                    path=path, tokens_lost=tokens, repair=Delay(ready),
                    detail=f"sent {ready - r.time:.2f} s before the prefix through {path} "
                           "could be read"))
        for h in r.chain:
            if h not in warm_at or r.time - last_used[h] > _COLD_AFTER_S:
                warm_at[h] = r.time + window_s
            last_used[h] = r.time
    return instances


def _settings(r: LintRequest) -> dict[str, tuple[str, str]]:
    return {s.name: (s.value, s.invalidates) for s in r.rendered.settings}


def _shown(setting: tuple[str, str] | None) -> str:
    return "unset" if setting is None else setting[0]
