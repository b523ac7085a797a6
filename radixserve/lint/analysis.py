"""The whole lint pass over a log: structure, findings, and (optionally) the cost simulation
of the log as it is and as it would be with every proposed fix applied.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, replace

from radixserve.lint.busters import divergence_instances
from radixserve.lint.corpus import Corpus, Encoder, LintRequest, build_corpus
from radixserve.lint.findings import Finding, Instance, group_findings
from radixserve.lint.logs import LogContents, MalformedLine
from radixserve.lint.repairs import LOG_WIDE, Delay, Repair, UnifyTools, repair_body
from radixserve.lint.rules import breakpoint_instances, fan_out_instances, setting_instances
from radixserve.lint.simulate import SimulationResult, corpus_requests, simulate
from radixserve.lint.structure import PrefixStructure, analyse_structure
from radixserve.lint.template_rewrites import template_rewrite_instances
from radixserve.provider_caching.prices import PriceTable, default_prices
from radixserve.provider_caching.profiles import (
    ModelProfile,
    Vendor,
    get_profile,
    profile_for_model,
)


@dataclass(frozen=True)
class LintOptions:
    """`profile` forces one model profile (else per request from its model id);
    `first_token_s` is how long after its start a request's cache writes become readable
    (the fan-out window and the simulator's latency)."""

    simulate: Vendor | None = None
    profile: str | None = None
    first_token_s: float = 1.0
    prices: PriceTable | None = None


@dataclass(frozen=True)
class LintReport:
    files: tuple[str, ...]
    requests: int
    total_tokens: int
    malformed: tuple[MalformedLine, ...]
    structure: PrefixStructure
    findings: tuple[Finding, ...]
    simulation: SimulationResult | None = None
    simulation_fixed: SimulationResult | None = None


def lint_log(contents: LogContents, encoder: Encoder, options: LintOptions) -> LintReport:
    """Renders, tokenises and checks every request of `contents`."""
    corpus = build_corpus(contents, encoder)
    structure = analyse_structure(corpus)
    forced = get_profile(options.profile) if options.profile else None

    def profile_for(model: str | None, vendor: Vendor) -> ModelProfile:
        return forced or profile_for_model(model, vendor)

    def minimum(r: LintRequest) -> int:
        vendor = options.simulate or ("anthropic" if r.rendered.format == "anthropic" else "openai")
        return profile_for(r.rendered.model, vendor).min_cacheable_tokens

    instances: list[Instance] = [
        *divergence_instances(corpus, structure, minimum),
        *setting_instances(corpus, structure),
        *breakpoint_instances(corpus, structure, minimum),
        *fan_out_instances(corpus, structure, minimum, options.first_token_s),
    ]
    # With the model's chat template (a tokenizer loaded from the model), its history rewrites.
    template = getattr(encoder, "chat_template", None)
    if isinstance(template, str) and hasattr(encoder, "apply_chat_template"):
        instances += template_rewrite_instances(corpus, structure, encoder,  # type: ignore[arg-type]
                                                template)
    report = LintReport(contents.files, len(corpus.requests), corpus.total_tokens,
                        corpus.malformed, structure, tuple(group_findings(instances)))
    if options.simulate is None:
        return report
    vendor = options.simulate
    prices = options.prices or default_prices()

    def vendor_profile(model: str | None) -> ModelProfile:
        return profile_for(model, vendor)

    before = simulate(corpus_requests(corpus, vendor, vendor_profile), vendor, prices,
                      options.first_token_s)
    fixed = _repaired(corpus, instances, encoder)
    after = simulate(corpus_requests(fixed, vendor, vendor_profile), vendor, prices,
                     options.first_token_s)
    return replace(report, simulation=before, simulation_fixed=after)


def _repaired(corpus: Corpus, instances: list[Instance], encoder: Encoder) -> Corpus:
    """The corpus with every instance's repair applied to its request."""
    repairs: dict[int, dict[object, Repair]] = defaultdict(dict)
    log_wide = {inst.repair for inst in instances if isinstance(inst.repair, LOG_WIDE)}
    for r in corpus.requests:
        for repair in log_wide:
            if not isinstance(repair, UnifyTools) or repair.format == r.rendered.format:
                repairs[r.index][repair] = repair
    for inst in instances:
        # One edit per block and kind: a request's own repair wins over the one derived
        # from a later request that was compared with it.
        for index, repair in ((inst.request, inst.repair), (inst.reference, inst.reference_repair)):
            if index is not None and repair is not None and not isinstance(repair, LOG_WIDE):
                key = (type(repair), getattr(repair, "path", None), getattr(repair, "name", None))
                repairs[index].setdefault(key, repair)
    logged = []
    for r in corpus.requests:
        mine = list(repairs.get(r.index, {}).values())
        time = max([r.time, *(x.until for x in mine if isinstance(x, Delay))])
        body = repair_body(r.logged.body, mine) if mine else r.logged.body
        logged.append(replace(r.logged, body=body, timestamp=time))
    return build_corpus(LogContents(tuple(logged), (), corpus.files), encoder, corpus.tokenizer)
