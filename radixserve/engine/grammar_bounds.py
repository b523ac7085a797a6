"""Bounds on how far a grammar lets one value grow, so that a degenerate generation (a small
model at temperature 0 writing `"population": 1111111...` until max_tokens) ends as a valid
output instead of eating capacity.

Three bounds, on by default (`ValueBounds`): a JSON schema's integers without a range get the
int64 range; a JSON number's text (outside strings) is at most `max_number_chars` long, enough
for every float64 in its shortest form; and a run of whitespace, in any grammar, is at most
`max_whitespace_run` characters. The last two act on the token mask: once a run is at its
bound, tokens that would extend it are masked out, unless nothing else is allowed (a grammar
that requires the longer run still gets it).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

# llguidance compiles an integer range through float64, so its bound must be a float64 value
# inside int64: the largest below 2**63.
INT64_BOUND = 2**63 - 1024
NUMBER_CHARS = frozenset("0123456789+-.eE")
WHITESPACE = frozenset(" \t\n\r")
_RANGE_KEYS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")


@dataclass(frozen=True)
class ValueBounds:
    int64_integers: bool = True
    # "-2.2250738585072014e-308" (24 characters) is the longest shortest-form float64.
    max_number_chars: int = 24  # 0: unbounded
    max_whitespace_run: int = 64  # 0: unbounded

    def __post_init__(self) -> None:
        if self.max_number_chars < 0 or self.max_whitespace_run < 0:
            raise ValueError("grammar value bounds must be >= 0 (0: unbounded)")


def bound_integers(schema: Any) -> Any:
    """`schema` with the int64 range on every integer that has no range of its own."""
    bounded = copy.deepcopy(schema)
    _walk(bounded)
    return bounded


def _walk(node: Any) -> None:
    if isinstance(node, list):
        for item in node:
            _walk(item)
    elif isinstance(node, dict):
        if node.get("type") == "integer" and not any(k in node for k in _RANGE_KEYS):
            node["minimum"], node["maximum"] = -INT64_BOUND, INT64_BOUND
        for value in node.values():
            _walk(value)


def _bits(flags: torch.Tensor, words: int) -> torch.Tensor:
    """Token flags (bool [vocab]) as a mask's int32 words (bit i % 32 of word i // 32)."""
    padded = torch.zeros(words * 32, dtype=torch.int64)
    padded[: flags.numel()] = flags.to(torch.int64)
    weights = torch.tensor([1 << b for b in range(32)], dtype=torch.int64)
    packed = (padded.view(words, 32) * weights).sum(dim=1)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


class TokenClasses:
    """Per token of one vocabulary: its text, and whether it starts with a number character or
    with whitespace (as mask words). Built once per tokenizer."""

    def __init__(self, texts: list[str], words: int) -> None:
        self.texts = texts
        starts_number = torch.tensor([bool(t) and t[0] in NUMBER_CHARS for t in texts])
        starts_space = torch.tensor([bool(t) and t[0] in WHITESPACE for t in texts])
        self.number_bits = ~_bits(starts_number, words)  # allowed: tokens that do not
        self.space_bits = ~_bits(starts_space, words)

    @classmethod
    def build(cls, decode: Callable[[int], str], vocab_size: int) -> TokenClasses:
        return cls([decode(i) for i in range(vocab_size)], (vocab_size + 31) // 32)


class ValueTracker:
    """One output's runs: the current number's length (outside JSON strings, when `json`) and
    the current whitespace run; restricts a mask once either is at its bound."""

    def __init__(self, classes: TokenClasses, bounds: ValueBounds, json: bool) -> None:
        self.classes = classes
        self.bounds = bounds
        self.json = json
        self.in_string = False
        self.escaped = False
        self.number_run = 0
        self.space_run = 0

    def state(self) -> tuple[bool, bool, int, int]:
        """What `restore` puts back (a draft's masks are computed as if it were taken)."""
        return self.in_string, self.escaped, self.number_run, self.space_run

    def restore(self, state: tuple[bool, bool, int, int]) -> None:
        self.in_string, self.escaped, self.number_run, self.space_run = state

    def accept(self, token: int) -> None:
        for ch in self.classes.texts[token] if token < len(self.classes.texts) else "":
            self._char(ch)

    def _char(self, ch: str) -> None:
        self.space_run = self.space_run + 1 if ch in WHITESPACE else 0
        if self.json:
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
                return
            if ch == '"':
                self.in_string = True
        self.number_run = self.number_run + 1 if self.json and ch in NUMBER_CHARS else 0

    def restrict(self, mask: torch.Tensor) -> None:
        """Masks out (in place) tokens that would extend a run at its bound, unless that
        would leave no token allowed."""
        b = self.bounds
        if b.max_number_chars and self.number_run >= b.max_number_chars:
            self._and(mask, self.classes.number_bits)
        if b.max_whitespace_run and self.space_run >= b.max_whitespace_run:
            self._and(mask, self.classes.space_bits)

    @staticmethod
    def _and(mask: torch.Tensor, allowed: torch.Tensor) -> None:
        narrowed = mask & allowed
        if bool(narrowed.any()):
            mask.copy_(narrowed)
