"""Driving a scheduler without a model: a step's plan is "computed" by advancing its requests
as the engine would."""

from __future__ import annotations

from radixserve.engine.request import Request
from radixserve.engine.scheduler import Scheduler


def step(scheduler: Scheduler) -> list[Request]:
    """Schedules one step and applies it as the engine does: returns the admitted order."""
    plan = scheduler.schedule()
    sampled = [*plan.decodes, *[c.request for c in plan.prefills if c.completes_prompt]]
    scheduler.advance(plan)
    for request in sampled:
        request.append_output(7)
        if len(request.output_token_ids) >= request.params.max_tokens:
            scheduler.finish(request, "length")
    return [c.request for c in plan.prefills]
