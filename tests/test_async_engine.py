"""The engine thread: it builds the engine as well as stepping it, so that one thread runs
the model's parallel regions (`async_engine` says why a second OpenMP team slows every step);
a failed build raises in the caller and leaves no thread."""

from __future__ import annotations

import asyncio
import threading

import pytest

from radixserve import SamplingParams
from radixserve.config import EngineConfig
from radixserve.engine.async_engine import AsyncEngine
from radixserve.engine.engine import LLMEngine
from tests.support.engine import SMALL_ENGINE

pytestmark = [pytest.mark.model]


def _engine_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "radixserve-engine"]


def test_the_engine_is_built_and_stepped_on_its_own_thread(model_path):
    built_on: list[int] = []

    def build() -> LLMEngine:
        built_on.append(threading.get_ident())
        return LLMEngine(EngineConfig(model=str(model_path), dtype="float32", **SMALL_ENGINE))

    aengine = AsyncEngine(build)
    try:
        async def serve() -> tuple[int, list[int]]:
            stepped_on = await aengine.run(lambda engine: threading.get_ident())
            final = None
            async for output in aengine.generate(
                    "Hello", SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), "r1"):
                final = output
            return stepped_on, final.outputs[0].token_ids

        stepped_on, tokens = asyncio.run(serve())
        assert built_on == [stepped_on] and stepped_on != threading.get_ident()
        assert len(tokens) == 4
    finally:
        aengine.shutdown()
        aengine.engine.close()
    assert not _engine_threads()


def test_a_failed_build_raises_in_the_caller_and_leaves_no_thread():
    def build() -> LLMEngine:
        raise ValueError("no such model: nowhere.gguf")

    with pytest.raises(ValueError, match="no such model"):
        AsyncEngine(build)
    assert not _engine_threads()
