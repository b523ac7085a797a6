"""A stored response outlives its server: after SIGTERM and a new process on the same store and
disk KV tier, continuing it by id reads the stored prefix from the tier (cached_tokens says
so) and answers what a cold run of the same tokens answers."""

from __future__ import annotations

from pathlib import Path

import pytest

from radixserve import LLM, SamplingParams
from radixserve.model.loader import load_tokenizer
from radixserve.server.openai.protocol import ChatMessage
from radixserve.server.openai.responses_render import continuation
from radixserve.server.response_store import ResponseStore
from tests.support.servers import openai_client, running_server

pytestmark = [pytest.mark.model, pytest.mark.server]

MODEL = "SmolLM2-135M-Instruct"
INSTRUCTIONS = ("You are the night-desk assistant of a small hotel. Answer guests politely and "
                "briefly. ") * 20
FOLLOW_UP = "And is breakfast included?"


def test_a_stored_response_continues_after_a_restart_from_the_disk_tier(
        model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    tier, store = tmp_path_factory.mktemp("tier"), tmp_path_factory.mktemp("responses")
    flags = ("--kv-offload-dir", str(tier), "--responses-dir", str(store))
    with running_server(tmp_path_factory, *flags, name="before") as server, \
            openai_client(server) as client:
        first = client.responses.create(model=MODEL, instructions=INSTRUCTIONS, temperature=0,
                                        input="What time is check-out?", max_output_tokens=16)
    assert first.usage is not None and first.usage.input_tokens > 256
    with running_server(tmp_path_factory, *flags, name="after") as server, \
            openai_client(server) as client:
        second = client.responses.create(model=MODEL, input=FOLLOW_UP, temperature=0,
                                         previous_response_id=first.id, max_output_tokens=16)
    assert second.usage is not None
    # The first prompt was pinned, so written through to the tier; the new process read it.
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens // 2

    saved = ResponseStore(store, 2**30, 3600.0, lambda: 0.0).get(first.id, "")
    assert saved is not None
    tokenizer = load_tokenizer(model_path)
    prompt = continuation(tokenizer, saved, [ChatMessage(role="user", content=FOLLOW_UP)])
    assert len(prompt) == second.usage.input_tokens
    cold = LLM(str(model_path), dtype="float32", prefix_cache="off", kv_cache_tokens=2048,
               show_progress=False)
    expected = cold.generate([{"prompt_token_ids": prompt}],
                             SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)[0]
    assert second.output_text == expected.outputs[0].text
