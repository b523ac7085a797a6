"""Structured output's value bounds on the default model's tokenizer: an integer stops at
int64's digits, a JSON number's text at 24 characters, a whitespace run at its bound; digits
inside a JSON string and grammars that need the longer run are left alone."""

from __future__ import annotations

import pytest
import torch

from radixserve.engine.grammar_bounds import INT64_BOUND, ValueBounds, bound_integers
from radixserve.engine.structured_output import GrammarCompiler, GrammarMatcher
from radixserve.model.tokenizer import ChatTokenizer
from radixserve.sampling_params import StructuredOutputsParams

pytestmark = [pytest.mark.model]


def _allowed(matcher: GrammarMatcher, token: int) -> bool:
    mask = torch.zeros(matcher.words, dtype=torch.int32)
    matcher.fill_mask(mask)
    return bool((int(mask[token // 32]) >> (token % 32)) & 1)


def _token(tokenizer: ChatTokenizer, text: str) -> int:
    (token,) = tokenizer.encode(text, add_special_tokens=False)
    return token


def _feed(tokenizer: ChatTokenizer, matcher: GrammarMatcher, text: str) -> None:
    for token in tokenizer.encode(text, add_special_tokens=False):
        assert matcher.accept(token), text


def _run(tokenizer: ChatTokenizer, matcher: GrammarMatcher, token: int, limit: int = 400) -> int:
    """How many times `token` may follow itself (it stays allowed)."""
    for n in range(limit):
        if not _allowed(matcher, token):
            return n
        assert matcher.accept(token)
    return limit


@pytest.fixture(scope="module")
def grammars(tokenizer: ChatTokenizer) -> GrammarCompiler:
    return GrammarCompiler(tokenizer)


def _json(schema: dict[str, object]) -> StructuredOutputsParams:
    return StructuredOutputsParams(json={"type": "object", "properties": schema,
                                         "required": list(schema)})


def test_an_integer_stops_at_int64s_digits(grammars: GrammarCompiler,
                                           tokenizer: ChatTokenizer) -> None:
    matcher = grammars.matcher(_json({"population": {"type": "integer"}}))
    _feed(tokenizer, matcher, '{"population":')
    assert _run(tokenizer, matcher, _token(tokenizer, "1")) == 19
    assert _allowed(matcher, _token(tokenizer, "}"))
    assert len(str(INT64_BOUND)) == 19
    # A schema's own range is kept.
    assert bound_integers({"type": "integer", "maximum": 5}) == {"type": "integer", "maximum": 5}


def test_a_number_stops_at_24_characters_and_ends_as_valid_json(
    grammars: GrammarCompiler, tokenizer: ChatTokenizer,
) -> None:
    matcher = grammars.matcher(_json({"area": {"type": "number"}}))
    _feed(tokenizer, matcher, '{"area":1.')
    assert _run(tokenizer, matcher, _token(tokenizer, "1")) == 22  # "1." + 22 digits
    assert matcher.accept(_token(tokenizer, "}")) and matcher.finished


def test_digits_inside_a_string_are_not_bounded(grammars: GrammarCompiler,
                                                tokenizer: ChatTokenizer) -> None:
    matcher = grammars.matcher(_json({"phone": {"type": "string"}}))
    _feed(tokenizer, matcher, '{"phone":"')
    assert _run(tokenizer, matcher, _token(tokenizer, "1"), limit=60) == 60


def test_a_whitespace_run_stops_at_its_bound_unless_the_grammar_needs_more(
    tokenizer: ChatTokenizer,
) -> None:
    grammars = GrammarCompiler(tokenizer, bounds=ValueBounds(max_whitespace_run=8))
    space = _token(tokenizer, " ")
    free = grammars.matcher(StructuredOutputsParams(regex="a *b"))
    _feed(tokenizer, free, "a")
    assert _run(tokenizer, free, space) == 8
    # A grammar that needs a longer run gets it: where nothing else is allowed, the bound yields.
    unbounded = GrammarCompiler(tokenizer, bounds=ValueBounds(max_whitespace_run=0))
    forced = [g.matcher(StructuredOutputsParams(regex="a {12}b")) for g in (grammars, unbounded)]
    for matcher in forced:
        _feed(tokenizer, matcher, "a" + " " * 11)
    masks = [torch.zeros(m.words, dtype=torch.int32) for m in forced]
    for matcher, mask in zip(forced, masks, strict=True):
        matcher.fill_mask(mask)
    assert bool(masks[0].any()) and torch.equal(masks[0], masks[1])


def test_bounds_can_be_turned_off(tokenizer: ChatTokenizer) -> None:
    grammars = GrammarCompiler(tokenizer, bounds=ValueBounds(int64_integers=False,
                                                             max_number_chars=0))
    matcher = grammars.matcher(_json({"population": {"type": "integer"}}))
    _feed(tokenizer, matcher, '{"population":')
    assert _run(tokenizer, matcher, _token(tokenizer, "1"), limit=40) == 40
