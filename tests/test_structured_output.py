"""Structured output in the engine (llguidance): the mask the sampler applies is the grammar's,
constrained rows share steps with free ones without changing them, n samples each follow
their own grammar state, compiled grammars are reused, and the prefix cache is unaffected;
text the grammar forces is taken at once (jump forward), and what is sampled after it comes
from the K/V its extend chunk computed.
"""

from __future__ import annotations

import json
import re

import pytest
import torch

from radixserve import LLM
from radixserve.engine.sampler import SamplerKernels, allowed_tokens, sample
from radixserve.engine.sampling_rows import SampleRow
from radixserve.kernels import token_bitmask_op
from radixserve.sampling_params import SamplingParams, StructuredOutputsParams
from radixserve.server.tool_calls.parsers import ToolCall, family_for_template
from radixserve.server.tool_calls.tools import (
    ToolChoice,
    ToolSpec,
    call_check,
    forced_call_grammar,
)

pytestmark = [pytest.mark.model]

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "age": {"type": "integer", "minimum": 0, "maximum": 99},
    "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
    "required": ["name", "age", "tags"], "additionalProperties": False}
ASK = [{"role": "user", "content": "Describe a person as JSON."}]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(num_threads=2, kv_cache_tokens=4096)


def _valid(text: str) -> bool:
    value = json.loads(text)
    return (set(value) == {"name", "age", "tags"} and len(value["name"]) <= 12
            and 0 <= value["age"] <= 99 and set(value["tags"]) <= {"a", "b"})


def test_allowed_tokens_unpacks_the_bitmask() -> None:
    rng = torch.Generator().manual_seed(0)
    mask = torch.randint(-(2**31), 2**31 - 1, (5,), dtype=torch.int32, generator=rng)
    bits = allowed_tokens(mask, 150)  # 160 bits in the mask; the rest beyond 150 cut
    expected = [bool((int(mask[t // 32]) >> (t % 32)) & 1) for t in range(150)]
    assert bits.tolist() == expected
    wider = allowed_tokens(mask, 170)  # a model vocabulary past the tokenizer's: never allowed
    assert wider[:150].tolist() == expected and not wider[160:].any()


def test_the_kernel_masks_exactly_as_the_pytorch_path() -> None:
    op = token_bitmask_op()
    if op is None:
        pytest.skip("the C++ kernels cannot be built here (the sampler uses the PyTorch path)")
    rng = torch.Generator().manual_seed(1)
    masks = torch.randint(-(2**31), 2**31 - 1, (3, 40), dtype=torch.int32, generator=rng)
    masks[1] = 0
    masks[1, 7] = -1  # whole words forbidden or allowed, as grammars mostly make them
    logits = torch.randn(4, 1300, generator=rng)  # 1,300 > 40 * 32: ids past the mask
    rows = torch.tensor([2, 0, 3])
    expected = logits.clone()
    expected[rows] = expected[rows].masked_fill(~allowed_tokens(masks, 1300), float("-inf"))
    op(logits, masks, rows)
    assert torch.equal(logits, expected)


def test_sampling_follows_the_mask_and_the_grammar_outlasts_min_tokens() -> None:
    logits = torch.randn(2, 64)
    mask = torch.zeros(2, dtype=torch.int32)
    mask[1] = 1 << 3  # token 35 only
    rows = [SampleRow(SamplingParams(temperature=1.0), None, allowed=mask),
            SampleRow(SamplingParams(temperature=0), None, banned={35}, allowed=mask)]
    for mask_op in (None, token_bitmask_op()):  # PyTorch's path, then the kernel's
        result = sample(logits, rows, SamplerKernels(mask=mask_op))
        assert result.token_ids == [35, 35]  # row 2: min_tokens bans the grammar's only token


def test_json_schema_output_is_valid_and_stops(llm: LLM) -> None:
    spec = StructuredOutputsParams(json=SCHEMA)
    outputs = llm.chat([ASK] * 2, [SamplingParams(max_tokens=80, temperature=1.0, seed=s,
                                                  structured_outputs=spec) for s in range(2)])
    for out in outputs:
        assert out.outputs[0].finish_reason == "stop" and _valid(out.outputs[0].text)


def test_n_samples_each_follow_their_grammar(llm: LLM) -> None:
    spec = StructuredOutputsParams(json=SCHEMA)
    out = llm.chat([ASK], SamplingParams(max_tokens=80, temperature=1.0, seed=5, n=3,
                                         structured_outputs=spec))[0]
    assert len(out.outputs) == 3 and all(_valid(o.text) for o in out.outputs)


def test_constrained_and_free_rows_in_one_batch(llm: LLM) -> None:
    free = SamplingParams(max_tokens=12, temperature=0)
    alone = llm.chat([ASK], free)[0].outputs[0].text
    choice = SamplingParams(max_tokens=12, temperature=0,
                            structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
    regex = SamplingParams(max_tokens=12, temperature=0,
                           structured_outputs=StructuredOutputsParams(regex=r"[0-9]{2}-[a-z]{3}"))
    outs = llm.chat([ASK, ASK, ASK], [choice, free, regex])
    assert outs[0].outputs[0].text in ("yes", "no")
    assert outs[1].outputs[0].text == alone  # the other rows' masks never touch it
    assert re.fullmatch(r"[0-9]{2}-[a-z]{3}", outs[2].outputs[0].text)
    assert outs[2].outputs[0].finish_reason == "stop"


def test_grammars_compile_once_and_the_cache_still_hits(llm: LLM) -> None:
    schema = {**SCHEMA, "title": "compile-once"}  # a key no other test compiled
    spec = StructuredOutputsParams(json=schema)
    before = llm.engine.grammars.compiles
    params = SamplingParams(max_tokens=60, temperature=0, structured_outputs=spec)
    first = llm.chat([ASK], params)[0]
    second = llm.chat([ASK], params)[0]
    assert llm.engine.grammars.compiles == before + 1
    assert second.outputs[0].text == first.outputs[0].text
    # The grammar does not change which KV is reused: the prompt is cached for the second.
    assert second.num_cached_tokens >= len(second.prompt_token_ids) - 1


def test_bad_constraints_are_refused_before_running(llm: LLM) -> None:
    for spec, words in ((StructuredOutputsParams(regex="(a"), "regex"),
                        (StructuredOutputsParams(json={"type": "objectx"}), "json"),
                        (StructuredOutputsParams(grammar="root ::= ("), "grammar")):
        with pytest.raises(ValueError, match=words):
            llm.engine.add_request("hi", SamplingParams(structured_outputs=spec))
    assert not llm.engine.has_unfinished_requests()


def test_free_calls_count_when_the_tool_exists_and_a_strict_schema_holds(llm: LLM) -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string"}},
              "required": ["city"]}
    tools = [ToolSpec("weather", schema, strict=True), ToolSpec("note", schema)]
    accept = call_check(tools, llm.engine.grammars)
    assert accept(ToolCall("weather", '{"city": "Paris"}'))  # the model's own spacing is fine
    assert not accept(ToolCall("weather", '{"city": 7}'))  # wrong type
    assert not accept(ToolCall("weather", '{"city": "Paris", "when": "now"}'))  # undeclared
    assert not accept(ToolCall("weather", "{}"))  # required property missing
    assert accept(ToolCall("note", '{"city": 7, "extra": true}'))  # not strict: any object
    assert not accept(ToolCall("forecast", '{"city": "Paris"}'))  # no such tool


# ----- jump forward -----

WEATHER = [ToolSpec("get_weather", {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 20}}, "required": ["city"]})]
CALL_PROMPT = [{"role": "user", "content": "What is the weather in Lisbon today?"}]


def _forced_call(llm: LLM) -> StructuredOutputsParams:
    family = family_for_template(llm.engine.tokenizer.chat_template)
    return forced_call_grammar(WEATHER, ToolChoice("required", "get_weather", False), family)


def _call_request(llm: LLM) -> tuple[StructuredOutputsParams, list[int]]:
    """The forced weather call's grammar and the question's prompt."""
    return _forced_call(llm), llm.engine.tokenizer.encode_chat(CALL_PROMPT)


def _stepped(llm: LLM, prompt: list[int], params: SamplingParams) -> list[list[int]]:
    """Runs one request alone; returns the output tokens each engine step added."""
    engine = llm.engine
    request_id = engine.add_request(prompt, params)
    steps: list[list[int]] = []
    have = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == request_id:
                ids = out.outputs[0].token_ids
                steps.append(ids[have:])
                have = len(ids)
    return steps


def test_forced_text_is_taken_at_once_and_each_sampled_token_is_the_greedy_choice(
    llm: LLM,
) -> None:
    engine = llm.engine
    spec, prompt = _call_request(llm)
    params = SamplingParams(max_tokens=60, temperature=0, structured_outputs=spec)
    before = engine.scheduler.counters.computed_prompt_tokens
    steps = _stepped(llm, prompt, params)
    output = [t for step in steps for t in step]
    text = engine.tokenizer.decode(output)
    assert engine.grammars.matches(spec, text), text
    # The call's opening and name are forced: the prefill's step already has them, and the
    # whole call took far fewer steps than tokens.
    assert '"name":"get_weather"' in engine.tokenizer.decode(steps[0]), steps[0]
    assert len(steps) < len(output) / 2, (len(steps), len(output))
    # Forced tokens are output, not prompt: the prefill computed the prompt alone (the
    # extends after it count nothing).
    assert engine.scheduler.counters.computed_prompt_tokens - before <= len(prompt)
    # Each step's first token was sampled from logits the extend chunks' K/V produced: it is
    # the greedy choice under the grammar, by an uncached forward of everything before it.
    matcher = engine.grammars.matcher(spec)
    done: list[int] = []
    for step in steps:
        mask = torch.zeros(matcher.words, dtype=torch.int32)
        matcher.fill_mask(mask)
        logits = engine.prompt_logits(prompt + done)
        allowed = allowed_tokens(mask, logits.shape[-1])
        assert step[0] == int(logits.masked_fill(~allowed, float("-inf")).argmax())
        for token in step:
            assert matcher.accept(token)
        done += step


def test_jump_forward_off_samples_every_token_and_logprobs_turn_it_off(llm: LLM) -> None:
    engine = llm.engine
    spec, prompt = _call_request(llm)
    with_logprobs = _stepped(llm, prompt, SamplingParams(max_tokens=12, temperature=0,
                                                         logprobs=0, structured_outputs=spec))
    # A forced token has no sampled distribution: with logprobs asked, each is sampled.
    assert [len(s) for s in with_logprobs] == [1] * 12
    engine.postprocessor.jump_forward = False  # as --no-grammar-jump-forward sets it
    try:
        plain = _stepped(llm, prompt, SamplingParams(max_tokens=12, temperature=0,
                                                     structured_outputs=spec))
    finally:
        engine.postprocessor.jump_forward = True
    assert [len(s) for s in plain] == [1] * 12


def test_forced_text_still_meets_max_tokens_and_a_fully_forced_output_ends_at_once(
    llm: LLM,
) -> None:
    engine = llm.engine
    spec, prompt = _call_request(llm)
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(
        max_tokens=5, temperature=0, structured_outputs=spec))[0].outputs[0]
    assert len(out.token_ids) == 5 and out.finish_reason == "length"
    literal = StructuredOutputsParams(regex=r"ferry-timetable-2026")
    steps = _stepped(llm, prompt, SamplingParams(max_tokens=40, temperature=0,
                                                 structured_outputs=literal))
    assert len(steps) == 1  # one sampled token, the rest forced; then the grammar is done
    assert engine.tokenizer.decode(steps[0]) == "ferry-timetable-2026"
    assert not engine.has_unfinished_requests()
    stats = engine.pool_stats()
    assert stats.private == 0 and stats.protected == 0


def test_a_forced_tail_is_computed_after_the_finish_so_the_next_turn_reads_it(
    llm: LLM,
) -> None:
    engine = llm.engine
    spec = _forced_call(llm)
    prompt = engine.tokenizer.encode_chat(
        [{"role": "user", "content": "And the weather in Porto, tomorrow?"}])
    page = engine.pool.page_size

    def cached_after(jump_forward: bool, salt: str) -> tuple[int, int]:
        engine.postprocessor.jump_forward = jump_forward
        try:
            out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(
                max_tokens=60, temperature=0, structured_outputs=spec), cache_salt=salt)[0]
        finally:
            engine.postprocessor.jump_forward = True
        sequence = prompt + out.outputs[0].token_ids
        assert out.outputs[0].finish_reason == "stop"
        return (engine.cache.match_prefix((engine.config.model, salt), sequence).length,
                len(sequence))

    # The call ends in forced text (`"}}</tool_call>`) that no step computed before the
    # finish: the request settles it, and the cache holds the whole sequence, as an agent's
    # next turn replays it.
    cached, whole = cached_after(True, "forced-tail-on")
    assert cached == whole // page * page, (cached, whole)
    # Decoded one token a step, the last sampled token is all that lacks K/V (and is left).
    cached, whole = cached_after(False, "forced-tail-off")
    assert cached == (whole - 1) // page * page, (cached, whole)
    assert not engine.has_unfinished_requests() and engine.pool_stats().private == 0


def test_a_drafts_masks_are_each_positions_and_leave_the_matcher_where_it_was(llm: LLM) -> None:
    grammars = llm.engine.grammars
    spec = StructuredOutputsParams(json=SCHEMA)
    text = '{"name":"Ann","age":42,"tags":["a"]}'
    tokens = llm.engine.tokenizer.encode(text, add_special_tokens=False)
    matcher = grammars.matcher(spec)
    assert matcher.valid_prefix(tokens) == len(tokens)
    head = llm.engine.tokenizer.encode('{"name":', add_special_tokens=False)
    bad = head + llm.engine.tokenizer.encode('7,"age":7}', add_special_tokens=False)
    assert matcher.valid_prefix(bad) == len(head)  # cut at the first refused token (a number)
    rows = torch.empty((len(tokens) + 1, matcher.words), dtype=torch.int32)
    matcher.fill_draft_masks(tokens, rows)
    for j in range(len(tokens) + 1):  # each row: a fresh matcher after the first j tokens
        fresh = grammars.matcher(spec)
        for token in tokens[:j]:
            assert fresh.accept(token)
        expected = torch.empty(matcher.words, dtype=torch.int32)
        fresh.fill_mask(expected)
        assert torch.equal(rows[j], expected), j
    # Rolled back: the matcher (and its value bounds) take the same tokens again.
    again = torch.empty(matcher.words, dtype=torch.int32)
    matcher.fill_mask(again)
    assert torch.equal(again, rows[0])
    assert matcher.accepts_whole(tokens)


def test_a_settling_request_whose_step_fails_lets_go_of_everything(llm: LLM, monkeypatch) -> None:
    engine = llm.engine
    spec, prompt = _call_request(llm)
    request_id = engine.add_request(prompt, SamplingParams(max_tokens=60, temperature=0,
                                                           structured_outputs=spec))
    while not any(o.request_id == request_id and o.finished for o in engine.step()):
        pass
    assert engine.scheduler.settling  # answered; its forced tail still to compute

    def broken(*args, **kwargs):
        raise RuntimeError("injected: the forward pass failed")

    monkeypatch.setattr(engine.runner, "run", broken)
    assert engine.step() == []  # nothing to tell: its client has its answer
    monkeypatch.undo()
    assert not engine.has_unfinished_requests()
    stats = engine.pool_stats()
    assert stats.balanced and stats.private == 0 and stats.protected == 0, stats
    # What it had computed before the failed step (the prompt, at least) stays cached.
    cached = engine.cache.match_prefix((engine.config.model, None), prompt).length
    assert cached >= (len(prompt) - 1) // engine.pool.page_size * engine.pool.page_size
