"""Structured output: a request's constraint (`StructuredOutputsParams`) compiled by the
llguidance grammar engine into a matcher that says, before each token, which tokens keep the
output valid, and follows the tokens sampled.

Why llguidance: it builds a token mask in well under a millisecond on a CPU with no GPU
library behind it (xgrammar needs torch's Triton and transformers installed;
BENCHMARKS.md "Grammar engines" has the figures), and it compiles JSON schemas, regexes, Lark
and GBNF grammars. It is an optional extra (`pip install radixserve[structured]`): without it,
a constrained request is refused, never served unconstrained.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import torch

from radixserve.engine.grammar_bounds import (
    TokenClasses,
    ValueBounds,
    ValueTracker,
    bound_integers,
)
from radixserve.sampling_params import StructuredOutputsParams

if TYPE_CHECKING:
    from radixserve.model.tokenizer import ChatTokenizer

MISSING_ENGINE = ("structured outputs need the grammar engine llguidance, which is not "
                  "installed: pip install 'radixserve[structured]'")


def grammar_engine_installed() -> bool:
    try:
        import llguidance  # noqa: F401
    except ImportError:
        return False
    return True


def _grammar_text(spec: StructuredOutputsParams, bounds: ValueBounds) -> str:
    """llguidance's grammar for a constraint. JSON is compact (no whitespace between tokens
    beyond what the schema's strings hold): a small model wastes tokens on free whitespace."""
    from llguidance import LLMatcher
    from llguidance.gbnf_to_lark import any_to_lark

    if spec.json is not None or spec.json_object:
        schema: Any = spec.json if spec.json is not None else {"type": "object"}
        if bounds.int64_integers:
            try:
                schema = bound_integers(json.loads(schema) if isinstance(schema, str)
                                        else schema)
            except ValueError as exc:
                raise ValueError(f"the JSON schema is not valid JSON: {exc}") from None
        try:
            return LLMatcher.grammar_from_json_schema(
                schema, defaults={"whitespace_flexible": False})
        except ValueError as exc:
            raise ValueError(f"the JSON schema is not valid JSON: {exc}") from None
    if spec.regex is not None:
        return LLMatcher.grammar_from_regex(spec.regex)
    if spec.choice is not None:
        # Each choice as a literal string: regex metacharacters in a choice stay literal.
        alternatives = " | ".join(json.dumps(c) for c in spec.choice)
        return LLMatcher.grammar_from_lark(f"start: {alternatives}")
    try:
        return LLMatcher.grammar_from_lark(any_to_lark(spec.grammar or ""))
    except Exception as exc:  # noqa: BLE001 - the converter raises its own error types
        raise ValueError(f"the grammar is neither GBNF nor Lark: {exc}") from None


class GrammarMatcher:
    """One request's position in its grammar: the next token's mask, and the tokens taken."""

    def __init__(self, matcher: Any, vocab_size: int, values: ValueTracker | None = None
                 ) -> None:
        self._matcher = matcher
        self.words = (vocab_size + 31) // 32
        self._values = values  # the value bounds (`grammar_bounds`); None: unbounded

    def fill_mask(self, out: torch.Tensor) -> None:
        """Writes the allowed next tokens into `out` (int32 [words], contiguous, CPU)."""
        self._matcher.unsafe_compute_mask_ptr(out.data_ptr(), out.numel() * 4)
        if self._values is not None:
            self._values.restrict(out)

    def accept(self, token: int) -> bool:
        """Follows a sampled token; False when the grammar does not allow it."""
        accepted = bool(self._matcher.consume_token(token))
        if accepted and self._values is not None:
            self._values.accept(token)
        return accepted

    def forced_tokens(self) -> list[int]:
        """The tokens the grammar allows as the only way on from here (a forced call's
        `<tool_call>{"name": "...", "arguments": ` say), in the tokenizer's own tokenization,
        stopping short of a token the next free text could merge into. Not yet taken. (The
        value bounds never refuse text the grammar requires, so they need no say here.)"""
        return list(self._matcher.compute_ff_tokens())

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many leading `tokens` the grammar allows from here; the matcher does not move."""
        return int(self._matcher.validate_tokens(tokens))

    def fill_draft_masks(self, draft: list[int], out: torch.Tensor) -> None:
        """Row j of `out` ([len(draft) + 1, words]): the mask after the draft's first j tokens,
        as if they were taken (a speculative row samples each position under its own mask).
        The matcher and the value bounds end where they began."""
        saved = self._values.state() if self._values is not None else None
        taken = 0
        for j in range(len(draft) + 1):
            self.fill_mask(out[j])
            if j < len(draft):
                if not self.accept(draft[j]):
                    # (Drafts are cut to their valid prefix first.) Row j refuses draft[j],
                    # so no later row is read: they repeat it.
                    out[j + 1:] = out[j]
                    break
                taken += 1
        self._matcher.rollback(taken)
        if saved is not None and self._values is not None:
            self._values.restore(saved)

    def accepts_whole(self, tokens: list[int]) -> bool:
        """Whether `tokens` are a complete output of the grammar (the matcher follows them)."""
        return bool(self._matcher.consume_tokens(tokens)) and bool(self._matcher.is_accepting())

    @property
    def finished(self) -> bool:
        """The output is complete: the grammar allows no more tokens (not even optional ones)."""
        return bool(self._matcher.is_stopped())

    @property
    def error(self) -> str:
        return str(self._matcher.get_error())


class GrammarCompiler:
    """Compiles constraints for one tokenizer, keeping the last `capacity` compiled grammars:
    an agent's schema or tool list is the same every turn, so it compiles once. Thread-safe
    (servers validate on their own threads, the engine creates matchers on its own)."""

    def __init__(self, tokenizer: ChatTokenizer, capacity: int = 128,
                 bounds: ValueBounds | None = None) -> None:
        self._tokenizer = tokenizer
        self._capacity = capacity
        self.bounds = bounds or ValueBounds()
        self._classes: TokenClasses | None = None
        self._ll_tokenizer: Any = None
        self._compiled: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self._lock = threading.Lock()
        self.compiles = 0  # grammars compiled (cache misses), for tests and benchmarks

    def _tokenizer_for_engine(self) -> Any:
        # Built on first use (it reads the whole vocabulary), never for servers that get no
        # constrained request.
        if self._ll_tokenizer is None:
            from llguidance import LLTokenizer

            tok = self._tokenizer
            self._ll_tokenizer = LLTokenizer(tok.backend.to_str(), n_vocab=tok.vocab_size,
                                             eos_token=sorted(tok.stop_token_ids))
        return self._ll_tokenizer

    def _template(self, spec: StructuredOutputsParams) -> Any:
        if not grammar_engine_installed():
            raise ValueError(MISSING_ENGINE)
        from llguidance import LLMatcher

        key = spec.key
        with self._lock:
            matcher = self._compiled.get(key)
            if matcher is not None:
                self._compiled.move_to_end(key)
                return matcher
            matcher = LLMatcher(self._tokenizer_for_engine(), _grammar_text(spec, self.bounds),
                                log_level=0)
            if matcher.is_error():
                raise ValueError(f"the {key[0]} constraint cannot be compiled: "
                                 f"{matcher.get_error().strip()}")
            self.compiles += 1
            self._compiled[key] = matcher
            if len(self._compiled) > self._capacity:
                self._compiled.popitem(last=False)
            return matcher

    def check(self, spec: StructuredOutputsParams) -> None:
        """Raises ValueError saying why `spec` cannot be enforced; compiles it (and caches the
        result) when it can."""
        self._template(spec)

    def matches(self, spec: StructuredOutputsParams, text: str) -> bool:
        """Whether `text` is a complete output of `spec` (a tool call's arguments against its
        strict schema, say)."""
        tokens = self._tokenizer.encode(text, add_special_tokens=False)
        return self.matcher(spec).accepts_whole(tokens)

    def matcher(self, spec: StructuredOutputsParams) -> GrammarMatcher:
        """A fresh matcher at the grammar's start."""
        template = self._template(spec)
        with self._lock:
            copy = template.deep_copy()
            values = None
            if self.bounds.max_number_chars or self.bounds.max_whitespace_run:
                if self._classes is None:  # once per tokenizer: every token's text
                    engine_tokenizer = self._tokenizer_for_engine()
                    self._classes = TokenClasses.build(
                        lambda i: engine_tokenizer.decode_bytes([i]).decode("utf-8", "replace"),
                        self._tokenizer.vocab_size)
                is_json = spec.json is not None or spec.json_object
                values = ValueTracker(self._classes, self.bounds, json=is_json)
        return GrammarMatcher(copy, self._tokenizer.vocab_size, values)


def fill_masks(matchers: list[GrammarMatcher]) -> torch.Tensor:
    """The masks of several requests, one row each (int32 [len, words])."""
    words = matchers[0].words if matchers else 0
    masks = torch.empty((len(matchers), words), dtype=torch.int32)
    for row, matcher in enumerate(matchers):
        matcher.fill_mask(masks[row])
    return masks


def fill_draft_masks(drafts: list[tuple[GrammarMatcher, list[int]]]) -> list[torch.Tensor]:
    """The masks of speculative rows: per draft, one row per position ([len(draft) + 1,
    words], `GrammarMatcher.fill_draft_masks`)."""
    out = []
    for matcher, draft in drafts:
        rows = torch.empty((len(draft) + 1, matcher.words), dtype=torch.int32)
        matcher.fill_draft_masks(draft, rows)
        out.append(rows)
    return out
