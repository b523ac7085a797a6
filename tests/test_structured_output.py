"""Structured output in the engine (llguidance): the mask the sampler applies is the grammar's,
constrained rows share steps with free ones without changing them, n samples each follow
their own grammar state, compiled grammars are reused, and the prefix cache is unaffected.
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
from radixserve.server.tool_calls.parsers import ToolCall
from radixserve.server.tool_calls.tools import ToolSpec, call_check

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
