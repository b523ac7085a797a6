"""`radixserve.testing`: cache assertions on real `openai` / `anthropic` SDK response objects
(streamed and not) with the likely cause on failure, and the `stable_prefix` fixture."""

from __future__ import annotations

import random
from datetime import date

import anthropic
import openai
import pytest

from radixserve.testing import (
    assert_cache_written,
    assert_cached,
    assert_not_cached,
    assert_stable_prefix,
    cache_report,
)

pytest_plugins = ["pytester"]


def chat_completion(prompt_tokens: int, cached: int | None, model: str = "gpt-4o"):
    usage = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": 3,
        "total_tokens": prompt_tokens + 3,
    }
    if cached is not None:
        usage["prompt_tokens_details"] = {"cached_tokens": cached}
    return openai.types.chat.ChatCompletion.model_validate(
        {
            "id": "chatcmpl-1",
            "object": "chat.completion",
            "created": 0,
            "model": model,
            "choices": [
                {
                    "index": 0,
                    "finish_reason": "stop",
                    "message": {"role": "assistant", "content": "ok"},
                }
            ],
            "usage": usage,
        }
    )


def chunk(usage: dict | None):
    return openai.types.chat.ChatCompletionChunk.model_validate(
        {
            "id": "chatcmpl-1",
            "object": "chat.completion.chunk",
            "created": 0,
            "model": "gpt-4o",
            "choices": []
            if usage
            else [{"index": 0, "delta": {"content": "o"}, "finish_reason": None}],
            "usage": usage,
        }
    )


def message(read: int, written: int, uncached: int = 20, model: str = "claude-sonnet-4-5"):
    return anthropic.types.Message.model_validate(
        {
            "id": "msg_1",
            "type": "message",
            "role": "assistant",
            "model": model,
            "content": [{"type": "text", "text": "ok"}],
            "stop_reason": "end_turn",
            "stop_sequence": None,
            "usage": {
                "input_tokens": uncached,
                "output_tokens": 4,
                "cache_read_input_tokens": read,
                "cache_creation_input_tokens": written,
                "cache_creation": {
                    "ephemeral_5m_input_tokens": written,
                    "ephemeral_1h_input_tokens": 0,
                },
            },
        }
    )


def failure(check, *args, **kwargs) -> str:
    with pytest.raises(AssertionError) as info:
        check(*args, **kwargs)
    return str(info.value)


def test_openai_prompt_below_the_minimum():
    text = failure(assert_cached, chat_completion(812, 0))
    assert text.startswith(
        "0 cached tokens: the prefix is 812 tokens, below this model's 1,024 minimum"
    )


def test_openai_hit_and_partial_hit():
    report = assert_cached(chat_completion(2006, 1920), at_least=1900)
    assert (report.api, report.prompt_tokens, report.cached_tokens) == ("openai", 2006, 1920)
    text = failure(assert_cached, chat_completion(2006, 1024), at_least=1900)
    assert "1,024 cached tokens, expected at least 1,900" in text and "128-token increments" in text
    assert "another prompt_cache_key" in failure(assert_cached, chat_completion(2006, 0))


def test_openai_streams_need_the_final_usage_chunk():
    assert (
        assert_cached(
            chunk(
                {
                    "prompt_tokens": 1500,
                    "completion_tokens": 2,
                    "total_tokens": 1502,
                    "prompt_tokens_details": {"cached_tokens": 1408},
                }
            )
        ).cached_tokens
        == 1408
    )
    assert "include_usage" in failure(assert_cached, chunk(None))


def test_openai_responses_usage_and_plain_dicts():
    usage = openai.types.responses.ResponseUsage.model_validate(
        {
            "input_tokens": 3000,
            "output_tokens": 5,
            "total_tokens": 3005,
            "input_tokens_details": {"cached_tokens": 2944, "cache_write_tokens": 0},
            "output_tokens_details": {"reasoning_tokens": 0},
        }
    )
    assert assert_cached(usage, at_least=2900).cached_tokens == 2944
    assert (
        cache_report({"usage": {"prompt_tokens": 10, "prompt_tokens_details": None}}).cached_tokens
        == 0
    )


def test_anthropic_write_instead_of_read():
    text = failure(assert_cached, message(read=0, written=2000))
    assert text.startswith("0 cached tokens, 2,000 written: this request created the cache entry")
    assert "still in flight" in text
    assert assert_cache_written(message(read=0, written=2000)).cache_write_tokens == 2000


def test_anthropic_hit_and_its_stream_events():
    assert assert_cached(message(read=1800, written=0), at_least=1800).prompt_tokens == 1820
    start = anthropic.types.RawMessageStartEvent.model_validate(
        {"type": "message_start", "message": message(read=1800, written=0).model_dump()}
    )
    assert cache_report(start).cached_tokens == 1800
    delta = anthropic.types.RawMessageDeltaEvent.model_validate(
        {
            "type": "message_delta",
            "delta": {"stop_reason": "end_turn", "stop_sequence": None},
            "usage": {
                "output_tokens": 9,
                "input_tokens": 20,
                "cache_read_input_tokens": 1800,
                "cache_creation_input_tokens": 0,
            },
        }
    )
    assert cache_report(delta).cached_tokens == 1800
    assert "1,800 were read instead" in failure(assert_cache_written, message(read=1800, written=0))


def test_anthropic_without_a_breakpoint_and_below_a_model_minimum():
    assert "no cache_control breakpoint" in failure(assert_cached, message(0, 0, uncached=3000))
    text = failure(assert_cached, message(0, 0, uncached=3000, model="claude-haiku-4-5"))
    assert "the prefix is 3,000 tokens, below this model's 4,096 minimum" in text
    assert "below this model's 5,000" in failure(
        assert_cached, message(0, 0, uncached=3000), min_cacheable_tokens=5000
    )


def test_assert_not_cached():
    assert_not_cached(message(0, 2000))
    assert "1,800 of 1,820" in failure(assert_not_cached, message(1800, 0))


SYSTEM = "You are the support assistant. " * 40


def build(
    question: str = "Where is my parcel?", system: str = SYSTEM, tool_keys=("name", "input_schema")
):
    tool = {"name": "lookup", "input_schema": {"type": "object"}}
    return {
        "model": "claude-sonnet-4-5",
        "max_tokens": 64,
        "tools": [{k: tool[k] for k in tool_keys}],
        "system": [{"type": "text", "text": system, "cache_control": {"type": "ephemeral"}}],
        "messages": [{"role": "user", "content": question}],
    }


def test_a_deterministic_builder_passes():
    prefix = assert_stable_prefix(build)
    assert "You are the support assistant." in prefix and "Where is my parcel?" not in prefix
    # What comes after the last breakpoint may change freely.
    assert_stable_prefix(
        lambda: build(question=random.choice(["a", "b", "c"]) + str(random.random()))
    )


def test_stable_prefix_names_where_two_builds_differ():
    # Two fixed ids that differ in their first character, so the position the
    # message names is known (random ones share a leading digit one time in 16).
    ids = iter(["3f2a9c1e-5b7d-4e8a-9c0f-1d2e3f4a5b6c", "a81c4e07-92d3-4f6b-8e1a-7c5d9b0e2f43"])
    text = failure(assert_stable_prefix, lambda: build(system=f"Session {next(ids)}\n{SYSTEM}"))
    assert "not byte-identical" in text and "[system.0] line 1, char 8" in text
    assert "looks like a request id" in text
    keys = iter([("name", "input_schema"), ("input_schema", "name")])
    assert "[tools.0]" in failure(assert_stable_prefix, lambda: build(tool_keys=next(keys)))


def test_stable_prefix_flags_todays_date_even_when_two_calls_agree():
    today = date.today().isoformat()
    text = failure(assert_stable_prefix, lambda: build(system=f"Today is {today}.\n{SYSTEM}"))
    assert f"today's date ({today})" in text
    assert_stable_prefix(lambda: build(system=f"Today is {today}.\n{SYSTEM}"), allow_volatile=True)


def test_openai_bodies_and_strings():
    body = {
        "model": "gpt-4o",
        "messages": [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": str(random.random())},
        ],
    }
    assert SYSTEM in assert_stable_prefix(lambda: body)
    assert assert_stable_prefix(lambda: "plain prompt") == "plain prompt"


def test_the_fixture_works_as_an_installed_plugin(pytester):
    # radixserve registers radixserve.testing under pytest's `pytest11` entry point, so any
    # project with radixserve installed has the fixture without a conftest line.
    pytester.makepyfile(
        "import time\n"
        "def test_stable(stable_prefix):\n"
        "    stable_prefix(lambda: 'fixed')\n"
        "def test_unstable(stable_prefix):\n"
        "    stable_prefix(lambda: f'now {time.perf_counter_ns()}')\n"
    )
    result = pytester.runpytest(
        "-p",
        "no:cacheprovider",
        "-p",
        "no:hypothesispytest",
        "-W",
        "ignore::pytest.PytestAssertRewriteWarning",
    )
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*not byte-identical*"])
