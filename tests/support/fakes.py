"""Stand-ins for tests that drive the HTTP app without an engine."""

from __future__ import annotations

import time
from typing import Any


class IdleEngine:
    """Enough of an engine front (server.front.EngineFront) for routes that refuse before
    generating."""

    alive = True
    clock = staticmethod(time.monotonic)
    background_prefill = False

    async def run(self, fn: Any) -> None:
        return None

    async def flush(self) -> None:
        return None
