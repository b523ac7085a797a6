"""What every route reaches through `request.app.state.radixserve`: the engine, the settings,
the metrics and the submission service of one app (no module-level state)."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Protocol

from fastapi import Request

from radixserve.model.families import family_named
from radixserve.model.tokenizer import ChatTokenizer
from radixserve.server.errors import model_not_found
from radixserve.server.front import EngineFront
from radixserve.server.next_turn import NextTurnLedger
from radixserve.server.observability.metrics import EngineSnapshot, ServerMetrics
from radixserve.server.reasoning import ReasoningFormat, format_for, reasoning_format
from radixserve.server.serving import EngineService, Lifecycle
from radixserve.server.settings import ServerSettings
from radixserve.server.tool_calls.parsers import family_for_template


class ReplicaView(Protocol):
    """The engines behind a replica ingress, as /metrics and /health see them."""

    async def snapshots(self) -> dict[str, EngineSnapshot]:
        """Each live replica's engine snapshot, by replica id."""
        ...


@dataclass
class ServerContext:
    aengine: EngineFront
    settings: ServerSettings
    metrics: ServerMetrics
    lifecycle: Lifecycle
    service: EngineService
    created: int = 0  # unix time the app was made: the models' `created`
    # Behind a replica ingress: per-replica engine snapshots for /metrics (None: one engine).
    replicas: ReplicaView | None = None
    # Chat turns whose next turn the template rewrites (notes; the background prefill).
    next_turn: NextTurnLedger = field(default_factory=lambda: NextTurnLedger(None))
    _token_text: dict[int, str] = field(default_factory=dict)

    @property
    def engine(self) -> EngineFront:
        """The engine's front, for what is fixed once it is built (limits, tokenizer, checks);
        everything that changes goes through `service`."""
        return self.aengine

    @property
    def tokenizer(self) -> ChatTokenizer:
        return self.aengine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.aengine.limits.max_model_len

    @property
    def kv_capacity(self) -> int:
        return self.aengine.limits.kv_capacity

    @property
    def vocab_size(self) -> int:
        return self.aengine.limits.vocab_size

    @functools.cached_property
    def tool_call_parser(self) -> str:
        """The tool-call format this model writes: the --tool-call-parser setting, else the
        one its chat template asks for; templates without tools get the tools in a system
        section that asks for hermes (`prompts.tools_section`)."""
        template = self.tokenizer.chat_template or ""
        if self.settings.tool_call_parser is not None:
            return self.settings.tool_call_parser
        if (own := family_named(self.aengine.limits.family).tool_call_parser) is not None:
            return own
        return family_for_template(template) if "tools" in template else "hermes"

    @functools.cached_property
    def reasoning_parser(self) -> str:
        """The reasoning format this model writes ("none" or "think"): --reasoning-parser,
        else its family's (`reasoning.format_for`)."""
        if self.settings.reasoning_parser != "auto":
            return self.settings.reasoning_parser
        return format_for(family_named(self.aengine.limits.family).reasoning_parser,
                          self.tokenizer.chat_template)

    def reasoning_format(self, prompt_ids: list[int], constrained: bool) -> ReasoningFormat:
        """The reasoning format of a reply to `prompt_ids`, told whether the prompt left
        reasoning open (the template wrote the opening tag). A `constrained` reply (a grammar
        writes it from its first token: a forced call, a response format) is the answer even
        where the prompt opened reasoning, unless it opens a think block itself."""
        tail = "" if constrained else self.tokenizer.decode(prompt_ids[-16:],
                                                            skip_special_tokens=False)
        return reasoning_format(self.reasoning_parser, tail)

    @functools.cached_property
    def template_takes_thinking(self) -> bool:
        """Whether the chat template reads `enable_thinking` (Qwen3, SmolLM3)."""
        return "enable_thinking" in (self.tokenizer.chat_template or "")

    def check_model(self, name: str | None) -> str:
        """The served name a request addresses; 404 for any other."""
        if name is None:
            return self.settings.model_name
        if name not in self.settings.served_model_names:
            raise model_not_found(name)
        return name

    def token_text(self, token_id: int) -> str:
        """A single token's text (special tokens included), memoised: logprobs need many."""
        text = self._token_text.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            self._token_text[token_id] = text
        return text


def context_of(request: Request) -> ServerContext:
    return request.app.state.radixserve
