"""The OpenAI SDK suite: what every deployment serving the OpenAI routes must do (chat and
completions streamed or not, n, stop, seeds, logprobs, tools, errors in OpenAI's shape, client
disconnects), run against a single server (test_server_openai.py) and the replicas
(test_replicas.py) through the `server` and `client` fixtures of the module that subclasses it."""

from __future__ import annotations

import httpx
import openai
import pytest

from radixserve.model.tokenizer import ChatTokenizer
from radixserve.server.openai.protocol import IGNORED_FIELDS
from radixserve.testing.server import ServerProcess, read_metrics, wait_idle

MODEL = "SmolLM2-135M-Instruct"
MAX_REQUEST_BYTES = 1_000_000
HELLO = [{"role": "user", "content": "Say hello."}]


def assert_idle_and_clean(base_url: str) -> dict[str, float]:
    """Nothing running, nothing locked or private, every slot accounted for."""
    m = wait_idle(base_url)
    states = ["free", "evictable", "protected", "pinned", "private"]
    slots = {s: m[f"kv_cache_tokens{{state={s}}}"] for s in states}
    assert slots["protected"] == 0 and slots["private"] == 0, slots
    assert sum(slots.values()) == m["kv_cache_capacity_tokens"], slots
    return m


# ----- errors -----

BAD_CHAT = [
    (dict(max_tokens="5"), openai.BadRequestError, "max_tokens"),
    (dict(temperature=3.5), openai.BadRequestError, "temperature"),
    (dict(n=0), openai.BadRequestError, "n"),
    (dict(top_p=0), openai.BadRequestError, "top_p"),
    (dict(stream_options={"include_usage": True}), openai.BadRequestError, "stream_options"),
    (dict(messages=[]), openai.BadRequestError, "messages"),
    (dict(messages=[{"role": "wizard", "content": "hi"}]), openai.BadRequestError, "messages.0.role"),
    (dict(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
     openai.BadRequestError, "messages.0.content.0"),
    (dict(max_tokens=9000), openai.BadRequestError, "messages"),
    (dict(stop=[""]), openai.BadRequestError, "stop"),
    (dict(top_logprobs=2), openai.BadRequestError, "top_logprobs"),
    (dict(model="gpt-4o"), openai.NotFoundError, "model"),
]


class OpenAISuite:
    """Subclassed as Test... by a module that provides `server` (a ServerProcess started with
    --max-request-bytes MAX_REQUEST_BYTES) and `client` (an OpenAI client of it)."""

    # ----- basics -----


    def test_models(self, client: openai.OpenAI) -> None:
        assert [m.id for m in client.models.list()] == [MODEL]
        assert client.models.retrieve(MODEL).owned_by == "radixserve"
        with pytest.raises(openai.NotFoundError):
            client.models.retrieve("gpt-4o")


    def test_chat_completion_shape_and_usage(self, client: openai.OpenAI) -> None:
        r = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=3, temperature=0,
                                           extra_body={"ignore_eos": True})
        assert r.object == "chat.completion" and r.model == MODEL
        assert r.choices[0].message.role == "assistant" and r.choices[0].message.content
        assert r.choices[0].finish_reason == "length"
        u = r.usage
        assert u is not None and u.completion_tokens == 3
        assert u.total_tokens == u.prompt_tokens + u.completion_tokens
        assert u.prompt_tokens_details is not None and u.prompt_tokens_details.cached_tokens is not None
        assert 0 <= u.prompt_tokens_details.cached_tokens < u.prompt_tokens


    def test_chat_stream_matches_non_stream(self, client: openai.OpenAI) -> None:
        kwargs = dict(model=MODEL, messages=HELLO, max_tokens=5, temperature=0)
        full = client.chat.completions.create(**kwargs)  # type: ignore[call-overload]
        chunks = list(client.chat.completions.create(
            **kwargs, stream=True, stream_options={"include_usage": True}))  # type: ignore[call-overload]
        *body, last = chunks
        assert last.choices == [] and last.usage is not None
        assert all(c.usage is None for c in body)
        assert body[0].choices[0].delta.role == "assistant"
        text = "".join(c.choices[0].delta.content or "" for c in body)
        assert text == full.choices[0].message.content
        assert body[-1].choices[0].finish_reason == full.choices[0].finish_reason
        assert last.usage.completion_tokens == full.usage.completion_tokens  # type: ignore[union-attr]
        assert last.usage.prompt_tokens == full.usage.prompt_tokens  # type: ignore[union-attr]
        # Without include_usage, no chunk carries usage.
        plain = list(client.chat.completions.create(**kwargs, stream=True))  # type: ignore[call-overload]
        assert all(c.usage is None for c in plain) and plain[-1].choices


    def test_completions_prompt_forms(
            self, client: openai.OpenAI, tokenizer: ChatTokenizer) -> None:
        prompt = "The capital of France is"
        text = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0)
        assert text.object == "text_completion" and text.usage.completion_tokens <= 3  # type: ignore[union-attr]
        batch = client.completions.create(model=MODEL, prompt=["One, two,", "Red, green,"],
                                          max_tokens=2, temperature=0, n=2)
        assert [c.index for c in batch.choices] == [0, 1, 2, 3]
        assert batch.choices[0].text == batch.choices[1].text  # greedy samples of one prompt agree
        ids = tokenizer.encode(prompt)
        by_ids = client.completions.create(model=MODEL, prompt=[ids, [504, 314]], max_tokens=3,
                                           temperature=0)
        assert by_ids.choices[0].text == text.choices[0].text
        assert by_ids.usage.prompt_tokens == len(ids) + 2  # type: ignore[union-attr]
        streamed = client.completions.create(model=MODEL, prompt="The capital of France is",
                                             max_tokens=3, temperature=0, stream=True)
        assert "".join(c.choices[0].text for c in streamed if c.choices) == text.choices[0].text
        echo = client.completions.create(model=MODEL, prompt="Hi there", max_tokens=1, echo=True)
        assert echo.choices[0].text.startswith("Hi there")


    def test_n_samples(self, client: openai.OpenAI) -> None:
        r = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=4, n=2, seed=7,
                                           temperature=1.0)
        assert sorted(c.index for c in r.choices) == [0, 1]
        assert 2 <= r.usage.completion_tokens <= 8  # type: ignore[union-attr]
        stream = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=3, n=2,
                                                stream=True)
        finished = {c.choices[0].index for c in stream if c.choices and c.choices[0].finish_reason}
        assert finished == {0, 1}


    def test_stop_cuts_output_in_both_modes(self, client: openai.OpenAI) -> None:
        kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "Count: 1, 2, 3, 4, 5"}],
                      max_tokens=12, temperature=0)
        free = client.chat.completions.create(**kwargs).choices[0].message.content or ""  # type: ignore[call-overload]
        words = free.split()
        assert len(words) >= 3, free
        stop = words[2]  # a stop string in the middle of the output, possibly several tokens
        cut = client.chat.completions.create(**kwargs, stop=[stop])  # type: ignore[call-overload]
        assert cut.choices[0].finish_reason == "stop"
        assert cut.choices[0].message.content == free[: free.index(stop)]
        streamed = client.chat.completions.create(**kwargs, stop=stop, stream=True)  # type: ignore[call-overload]
        assert "".join(c.choices[0].delta.content or "" for c in streamed
                       if c.choices) == cut.choices[0].message.content


    def test_seed_reproducible(self, client: openai.OpenAI) -> None:
        def sample(seed: int) -> str:
            r = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=6,
                                               temperature=1.0, seed=seed)
            return r.choices[0].message.content or ""

        assert sample(1234) == sample(1234)


    def test_min_tokens(self, client: openai.OpenAI) -> None:
        # Greedy, this prompt ends on its own; min_tokens keeps the end-of-turn token out longer.
        free = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=60, temperature=0)
        assert free.choices[0].finish_reason == "stop"
        least = free.usage.completion_tokens + 5  # type: ignore[union-attr]
        r = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=least + 10,
                                           temperature=0, extra_body={"min_tokens": least})
        assert r.usage.completion_tokens >= least  # type: ignore[union-attr]


    def test_logprobs(self, client: openai.OpenAI) -> None:
        r = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=3, temperature=0,
                                           logprobs=True, top_logprobs=2)
        content = r.choices[0].logprobs.content  # type: ignore[union-attr]
        assert content is not None and len(content) == r.usage.completion_tokens  # type: ignore[union-attr]
        for entry in content:
            assert entry.logprob <= 0 and len(entry.top_logprobs) == 2
            # Greedy: the chosen token is the most likely one.
            assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob, abs=1e-4)
        c = client.completions.create(model=MODEL, prompt="Hello", max_tokens=2, logprobs=1)
        assert len(c.choices[0].logprobs.token_logprobs) == 2  # type: ignore[union-attr,arg-type]


    def test_tools_render_deterministically(self, client: openai.OpenAI) -> None:
        tool = {"type": "function", "function": {
            "name": "get_weather", "description": "Weather for a city.",
            "parameters": {"type": "object", "required": ["city"],
                           "properties": {"city": {"type": "string"}, "unit": {"type": "string"}}}}}
        reordered = {"function": {"parameters": {"properties": {"unit": {"type": "string"},
                                                                "city": {"type": "string"}},
                                                 "required": ["city"], "type": "object"},
                                  "description": "Weather for a city.", "name": "get_weather"},
                     "type": "function"}
        messages = [{"role": "user", "content": "Weather in Paris?"}]
        first = client.chat.completions.create(model=MODEL, messages=messages, tools=[tool],  # type: ignore[list-item]
                                               max_tokens=1, tool_choice="auto")
        second = client.chat.completions.create(model=MODEL, messages=messages, tools=[reordered],  # type: ignore[list-item]
                                                max_tokens=1)
        assert first.usage.prompt_tokens == second.usage.prompt_tokens  # type: ignore[union-attr]
        # Same tokens despite reordered keys: all but the last prompt token come from the cache.
        assert second.usage.prompt_tokens_details.cached_tokens == second.usage.prompt_tokens - 1  # type: ignore[union-attr]


    def test_accepts_fields_it_does_not_act_on(self, client: openai.OpenAI) -> None:
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL, messages=[{"role": "developer", "content": "Be brief."}, *HELLO],
            max_completion_tokens=2, prompt_cache_key="conversation-42", prompt_cache_retention="24h",
            safety_identifier="user-1", user="user-1", metadata={"k": "v"}, store=False,
            parallel_tool_calls=True, response_format={"type": "text"}, service_tier="auto",
            extra_body={"prompt_cache_options": {"mode": "implicit", "ttl": "30m"},
                        "some_future_field": [1, 2, 3]})
        r = raw.parse()
        assert r.usage.completion_tokens <= 2  # type: ignore[union-attr]
        # Accepted, not silently: the response names each field it did not act on (those it
        # acted on, parallel_tool_calls and response_format here, are not named).
        assert raw.headers["x-radixserve-not-applied"].split(", ") == [
            "prompt_cache_key", "prompt_cache_retention", "prompt_cache_options",
            "safety_identifier", "user", "metadata", "store", "service_tier",
            "some_future_field"]
        plain = client.completions.with_raw_response.create(
            model=MODEL, prompt="Hi", max_tokens=1, extra_body={"future_knob": 1})
        assert plain.headers["x-radixserve-not-applied"] == "future_knob"
        clean = client.completions.with_raw_response.create(model=MODEL, prompt="Hi",
                                                             max_tokens=1)
        assert "x-radixserve-not-applied" not in clean.headers
        assert {"prompt_cache_key", "prompt_cache_retention", "safety_identifier"} <= set(IGNORED_FIELDS)
        # Acted on now (test_server_sampling.py): no longer among the ignored.
        assert not {"frequency_penalty", "presence_penalty", "logit_bias"} & set(IGNORED_FIELDS)


    @pytest.mark.parametrize(("override", "error", "param"), BAD_CHAT,
                             ids=[f"{p}-{e.__name__}" for _, e, p in BAD_CHAT])
    def test_chat_errors(self, client: openai.OpenAI, override: dict[str, object],
                         error: type[openai.APIStatusError], param: str) -> None:
        body: dict[str, object] = {"model": MODEL, "messages": HELLO, "max_tokens": 2, **override}
        with pytest.raises(error) as caught:
            client.post("/chat/completions", body=body, cast_to=object)
        assert caught.value.body["param"] == param  # type: ignore[index]
        assert caught.value.body["type"] and len(caught.value.message) > 20  # type: ignore[index]


    def test_prompt_beyond_context(self, client: openai.OpenAI) -> None:
        with pytest.raises(openai.BadRequestError) as caught:
            client.completions.create(model=MODEL, prompt=[42] * 8200, max_tokens=1)
        assert caught.value.code == "context_length_exceeded"
        assert "8200" in caught.value.message


    def test_http_level_errors(self, server: ServerProcess, client: openai.OpenAI) -> None:
        url = server.base_url + "/v1/chat/completions"
        for raw in (b"{not json", b"", b"[1, 2]", b'"text"', b"\xff\xfe"):
            r = httpx.post(url, content=raw, headers={"content-type": "application/json"})
            assert r.status_code == 400, raw
            assert set(r.json()["error"]) == {"message", "type", "param", "code"}
        big = httpx.post(url, content=b"{" + b" " * MAX_REQUEST_BYTES + b"}")
        assert big.status_code == 413 and big.json()["error"]["code"] == "request_too_large"
        with pytest.raises(openai.NotFoundError):
            client.get("/no/such/route", cast_to=object)
        assert httpx.get(server.base_url + "/health").json() == {"status": "ok"}


    # ----- disconnects -----


    def test_disconnects_abort_and_release_everything(self, client: openai.OpenAI,
                                                      server: ServerProcess) -> None:
        # Greedy, so that the same request after the disconnects must answer the same (sampled at
        # the default temperature, two tokens may be half of one character and decode to '').
        greedy = dict(model=MODEL, messages=HELLO, max_tokens=2, temperature=0)
        reference = client.chat.completions.create(**greedy)  # type: ignore[call-overload]
        before = read_metrics(server.base_url)
        long = dict(model=MODEL, messages=HELLO, max_tokens=400, extra_body={"ignore_eos": True})
        # Closed after the first chunk (the role chunk: the request may not be in the engine yet).
        stream = client.chat.completions.create(**long, stream=True)  # type: ignore[call-overload]
        next(iter(stream))
        stream.close()
        # Closed after the first generated token.
        stream = client.chat.completions.create(**long, stream=True)  # type: ignore[call-overload]
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                break
        stream.close()
        # A non-streaming client that gives up.
        with pytest.raises(openai.APITimeoutError):
            client.with_options(timeout=1.0).chat.completions.create(**long)  # type: ignore[call-overload]
        after = assert_idle_and_clean(server.base_url)
        aborted = "request_success_total{finished_reason=abort}"
        # The first may have closed before its request reached the engine; then nothing ran.
        assert 2 <= after.get(aborted, 0) - before.get(aborted, 0) <= 3
        # Far fewer tokens than three full generations: each stopped soon after its client left.
        assert after["generation_tokens_total"] - before["generation_tokens_total"] < 3 * 400
        r = client.chat.completions.create(**greedy)  # type: ignore[call-overload]
        assert r.usage is not None and r.usage.completion_tokens == 2
        assert r.choices[0].message.content == reference.choices[0].message.content
