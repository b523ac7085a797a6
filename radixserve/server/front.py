"""What the server needs of the engine behind it: the local engine thread (`AsyncEngine`) or
replicas on Ray Serve (`replicas.front.ReplicaFront`). The routes see only this."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Hashable
from typing import Any, Protocol

from radixserve.engine.engine import LLMEngine
from radixserve.engine.limits import EngineLimits
from radixserve.engine.structured_output import GrammarCompiler
from radixserve.model.tokenizer import ChatTokenizer
from radixserve.outputs import RequestOutput
from radixserve.sampling_params import SamplingParams


class EngineFront(Protocol):
    @property
    def tokenizer(self) -> ChatTokenizer: ...

    @property
    def grammars(self) -> GrammarCompiler: ...

    @property
    def limits(self) -> EngineLimits: ...

    @property
    def alive(self) -> bool:
        """False once no engine can serve (the thread died, or every replica is gone)."""
        ...

    @property
    def clock(self) -> Callable[[], float]:
        """The engine's clock: TTL pins and vendor cache entries age on it."""
        ...

    def check_prompt(self, ids: list[int], params: SamplingParams) -> None:
        """Raises ValueError naming what the engine would refuse."""
        ...

    def generate(
        self, prompt: str | list[int], params: SamplingParams, request_id: str,
        namespace: Hashable = None, *, replayable: bool = False, affinity: str | None = None,
        **options: Any,
    ) -> AsyncIterator[RequestOutput]:
        """Cumulative outputs until finished; leaving early aborts. `replayable`: the caller
        uses only the final output, so a front may restart the request elsewhere. `affinity`:
        the engine that holds the prompt's prefix (an output's `extra["replica"]`), where a
        front of several sends it while that engine lives."""
        ...

    def abort(self, request_id: str) -> None: ...

    @property
    def background_prefill(self) -> bool:
        """Whether the engines run idle-time prefills (`prefill_in_background`)."""
        ...

    def prefill_in_background(self, token_ids: list[int], namespace: Hashable = None,
                              affinity: str | None = None) -> None:
        """Queues `token_ids` (a conversation's next turn) for an idle-time prefill, on the
        engine `affinity` names where there are several (the one that served the turn)."""
        ...

    async def flush(self) -> None:
        """Returns once every add and abort sent so far has taken effect."""
        ...

    async def run(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """Runs `fn` on the engine thread between steps (local engines only)."""
        ...
