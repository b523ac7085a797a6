"""The Python heap a process holds once warm, frozen out of the garbage collector's full passes.

What is alive once warm-up has run (modules, the tokenizer's tables, chat templates, the
engine's objects: about 290,000 objects with the default model) stays alive to the end. A full
collection walks every one of them, about 130 ms on an idle core and more under load, and while
it runs the event loop answers nothing (a refusal that takes milliseconds waits) and the engine
thread's Python stops. Frozen, a full pass walks only what requests have made since.
/metrics reports the count (`observability.metrics.FrozenHeapCollector`).
"""

from __future__ import annotations

import gc


def freeze_warm_heap() -> int:
    """Collects what warm-up left behind, then moves every surviving object into the permanent
    generation; returns how many are frozen. Called once a process is warm."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
