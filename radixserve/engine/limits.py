"""What a request must satisfy to be served by an engine: one check, shared by the engine and
by fronts that validate before the engine sees the request (the replicas' ingress)."""

from __future__ import annotations

from dataclasses import dataclass

from radixserve.engine.structured_output import GrammarCompiler
from radixserve.sampling_params import SamplingParams


@dataclass(frozen=True)
class EngineLimits:
    """An engine's fixed limits: its vocabulary, its context and its KV pool, in tokens; and
    the family of its model, whose reply formats the server reads."""

    vocab_size: int
    max_model_len: int
    kv_capacity: int
    family: str = "llama"  # the model's family (radixserve/model/families.py)

    def check(self, ids: list[int], params: SamplingParams, grammars: GrammarCompiler) -> None:
        """Sampling params, output constraint and prompt (not empty, ids in the vocabulary,
        fits the context and the pool with its completion). Raises ValueError naming the
        problem."""
        params.validate(self.vocab_size)
        if params.structured_outputs is not None:
            grammars.check(params.structured_outputs)
        if not ids:
            raise ValueError("the prompt is empty")
        vocab = self.vocab_size
        if any((not isinstance(t, int)) or t < 0 or t >= vocab for t in ids):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"the prompt has {len(ids)} tokens; this model's context is {self.max_model_len}"
            )
        need = len(ids) + params.max_tokens
        if need > self.kv_capacity:
            raise ValueError(
                f"prompt ({len(ids)} tokens) plus max_tokens ({params.max_tokens}) exceeds the "
                f"KV pool ({self.kv_capacity} tokens); lower max_tokens or raise kv_cache_tokens"
            )
