"""Reasoning in an agent's history: a tiny random-weight Qwen3 with Qwen3's own chat template
(which renders an earlier assistant turn without its reasoning when the client does not send
`reasoning_content` back) in a four-turn tool-calling loop through the OpenAI SDK. Per turn,
the prompt tokens not read from the cache: with the plain template the next turn re-prefills
the whole reply; with the reasoning sent back, or with the next-turn prefill, only the new
tool result (behind --replicas too, on the replica the turn ran on). Each loop's replies equal
the cache-off server's; the dashboard names the rewrite; and an idle-time prefill yields to a
request that arrives during it.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from radixserve import LLM, SamplingParams
from radixserve.engine.background_prefill import BackgroundPrefill, PrefillJob
from radixserve.lint.analysis import LintOptions, lint_log
from radixserve.lint.logs import read_logs
from radixserve.model.loader import load_tokenizer
from radixserve.testing.server import ServerProcess
from tests.support.families import TINY_ENGINE, save_checkpoint
from tests.support.llama_converter import family_chat_template
from tests.support.servers import openai_client, running_server

pytestmark = pytest.mark.model
transformers = pytest.importorskip("transformers")

TOOLS = [{"type": "function", "function": {
    "name": "lookup", "description": "Looks a word up.",
    "parameters": {"type": "object", "properties": {"q": {"type": "string"}},
                   "required": ["q"]}}}]
# Replies forced into Qwen3's own shapes (reasoning, then a call as the template writes one,
# or an answer), so that only the reasoning can differ between generation and history. A regex
# goes with tool_choice "none" only, so the client reads the call from the text itself.
THINK = r"<think>\n[a-z]{2,8}( [a-z]{2,8}){3,5}\n</think>\n\n"
CALL = THINK + r'<tool_call>\n\{"name": "lookup", "arguments": \{"q": "[a-z]{2,6}"\}\}\n</tool_call>'
ANSWER = THINK + r"[A-Z][a-z]{1,8}\."
TURNS = 4
SLACK = 2  # the reply's last token, never run through the model, and its end of turn


@dataclass(frozen=True)
class Loop:
    replies: list[str | None]  # each turn's answer (a call's text, then the final answer)
    uncached: list[int]  # prompt tokens not read from the cache, per turn
    prompts: list[list[dict[str, Any]]]  # each turn's messages


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory: pytest.TempPathFactory, model_path: Path) -> Path:
    torch.manual_seed(0)
    config = transformers.Qwen3Config(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, vocab_size=49152, max_position_embeddings=2048,
        tie_word_embeddings=False, initializer_range=0.1)
    folder = tmp_path_factory.mktemp("qwen3")
    directory = save_checkpoint(transformers.Qwen3ForCausalLM(config).float().eval(),
                                folder / "hf", model_path)
    template = folder / "qwen3.jinja"
    template.write_text(family_chat_template("Qwen-Qwen3-0.6B.jinja"))
    return directory


def _flags(qwen3: Path) -> tuple[str, ...]:
    return ("--model", str(qwen3), "--chat-template", str(qwen3.parent / "qwen3.jinja"),
            "--dtype", "float32")


def _server(tmp_path_factory: pytest.TempPathFactory, qwen3: Path, name: str,
            *flags: str) -> Iterator[ServerProcess]:
    with running_server(tmp_path_factory, *_flags(qwen3), *flags, name=name) as proc:
        yield proc


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory, qwen3: Path) -> Iterator[ServerProcess]:
    yield from _server(tmp_path_factory, qwen3, "plain", "--no-next-turn-prefill")


@pytest.fixture(scope="module")
def prefilling(tmp_path_factory: pytest.TempPathFactory, qwen3: Path) -> Iterator[ServerProcess]:
    yield from _server(tmp_path_factory, qwen3, "prefill")


@pytest.fixture(scope="module")
def replicas(tmp_path_factory: pytest.TempPathFactory, qwen3: Path) -> Iterator[ServerProcess]:
    pytest.importorskip("ray", reason="pip install 'radixserve[ray]' for --replicas")
    yield from _server(tmp_path_factory, qwen3, "replicas", "--replicas", "2",
                       "--cpus-per-replica", "0.25")


@pytest.fixture(scope="module")
def uncached(tmp_path_factory: pytest.TempPathFactory, qwen3: Path) -> dict[bool, Loop]:
    """The loops without a cache, reasoning dropped (False) and kept (True): the replies every
    cached loop must equal."""
    with running_server(tmp_path_factory, *_flags(qwen3), "--prefix-cache", "off",
                        name="off") as proc:
        return {keep: agent_loop(proc, keep, "off") for keep in (False, True)}


def _metric(server: ServerProcess, name: str) -> float:
    """The metric's value, summed over replicas behind --replicas (0 when not reported)."""
    text = httpx.get(server.base_url + "/metrics").text
    found = re.findall(rf"^radixserve:{name}(?:_total)?{{[^}}]*}} ([0-9.e+]+)$", text, re.M)
    return sum(float(value) for value in found)


def _wait_for_background(server: ServerProcess, jobs: int) -> None:
    """Until `jobs` idle-time prefills have started and none is pending (a test's client
    waits as a user reading the reply would)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if (_metric(server, "background_prefill_jobs") >= jobs
                and _metric(server, "background_prefill_pending") == 0):
            return
        time.sleep(0.05)
    raise AssertionError("the background prefill did not run")


def agent_loop(server: ServerProcess, keep_reasoning: bool, salt: str,
               background: bool = False) -> Loop:
    """Four turns: three tool calls, each answered by a tool result, then an answer."""
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a careful agent. Use the tools."},
        {"role": "user", "content": "Find out what the word on the card means."}]
    replies, uncached_tokens, prompts = [], [], []
    with openai_client(server) as client:
        for turn in range(TURNS):
            prompts.append(list(messages))
            last = turn == TURNS - 1
            response = client.chat.completions.create(
                model=client.models.list().data[0].id, messages=messages, tools=TOOLS,
                tool_choice="none", max_tokens=48, temperature=0,
                extra_body={"guided_regex": ANSWER if last else CALL, "cache_salt": salt})
            usage = response.usage
            assert usage is not None and usage.prompt_tokens_details is not None
            uncached_tokens.append(usage.prompt_tokens - usage.prompt_tokens_details.cached_tokens)
            message = response.choices[0].message
            reasoning = getattr(message, "reasoning_content", None) or (
                message.model_extra or {}).get("reasoning_content")
            assert reasoning, message
            replies.append(message.content)
            if last:
                break
            call = json.loads(message.content.removeprefix("<tool_call>\n")
                              .removesuffix("\n</tool_call>"))
            call_id = f"call_{turn}"
            sent: dict[str, Any] = {"role": "assistant", "content": "", "tool_calls": [
                {"id": call_id, "type": "function", "function": {
                    "name": call["name"], "arguments": json.dumps(call["arguments"])}}]}
            if keep_reasoning:
                sent["reasoning_content"] = reasoning
            messages += [sent, {"role": "tool", "tool_call_id": call_id,
                                "content": f"result {turn}: a small grey bird"}]
            if background:
                _wait_for_background(server, turn + 1)
    return Loop(replies, uncached_tokens, prompts)


def _new_text_tokens(qwen3: Path, loop: Loop) -> list[int]:
    """Per turn after the first: the prompt's tokens after the previous reply (the tool
    result and the assistant's opening), counted on the prompt as the template renders it."""
    tokenizer = load_tokenizer(qwen3)
    tokenizer.chat_template = (qwen3.parent / "qwen3.jinja").read_text()
    im_end = tokenizer.encode("<|im_end|>", add_special_tokens=False)
    assert len(im_end) == 1
    counts = []
    for messages in loop.prompts[1:]:
        ids = tokenizer.encode_chat(messages, TOOLS)
        ends = [i for i, t in enumerate(ids) if t == im_end[0]]
        counts.append(len(ids) - ends[-2] - 1)  # after the reply's own end of turn
    return counts


def test_reasoning_dropped_from_the_history_costs_the_next_turn_the_whole_reply(
        plain: ServerProcess, uncached: dict[bool, Loop], qwen3: Path) -> None:
    dropped = agent_loop(plain, keep_reasoning=False, salt="dropped")
    kept = agent_loop(plain, keep_reasoning=True, salt="kept")
    assert dropped.replies == uncached[False].replies
    assert kept.replies == uncached[True].replies
    new = _new_text_tokens(qwen3, kept)
    # Dropped, the turn's reply (its reasoning and call) is prefilled again: 20+ tokens more.
    for turn, (lost, fresh) in enumerate(zip(dropped.uncached[1:], new, strict=True)):
        assert lost >= fresh + 20, (turn, dropped.uncached, new)
    # Sent back, the reasoning renders as generated, give or take its tokens: the template's
    # text is tokenised canonically, and a reply need not have been (a regex-forced one here
    # often is not), so a turn may still part inside the reasoning (the next-turn prefill
    # covers that too: it prefills the canonical history wherever it parts).
    assert sum(kept.uncached[1:]) < sum(dropped.uncached[1:]), (kept.uncached, dropped.uncached)
    assert min(kept.uncached[1:]) <= new[0] + SLACK, (kept.uncached, new)
    print(f"uncached prompt tokens per turn: dropped {dropped.uncached}, kept {kept.uncached}")


def test_next_turn_prefill_makes_the_next_turn_pay_only_the_new_text(
        prefilling: ServerProcess, uncached: dict[bool, Loop], qwen3: Path) -> None:
    loop = agent_loop(prefilling, keep_reasoning=False, salt="prefilled", background=True)
    assert loop.replies == uncached[False].replies
    # The prefilled history runs into the tool message's opening, so even less than the new
    # text is left; at least its content (a dozen tokens).
    for turn, (paid, fresh) in enumerate(zip(loop.uncached[1:], _new_text_tokens(qwen3, loop),
                                             strict=True)):
        assert 12 <= paid <= fresh, (turn, loop.uncached)
    print(f"uncached prompt tokens per turn with the next-turn prefill: {loop.uncached}")
    assert _metric(prefilling, "background_prefill_yielded") == 0


def test_behind_replicas_the_next_turn_is_prefilled_where_its_turn_ran(
        replicas: ServerProcess, uncached: dict[bool, Loop], qwen3: Path) -> None:
    # The ingress renders the next turn; the replica that served the turn (the prefix router
    # sends the next turn there too) prefills it while idle.
    loop = agent_loop(replicas, keep_reasoning=False, salt="replicas", background=True)
    assert loop.replies == uncached[False].replies
    for turn, (paid, fresh) in enumerate(zip(loop.uncached[1:], _new_text_tokens(qwen3, loop),
                                             strict=True)):
        assert 12 <= paid <= fresh, (turn, loop.uncached)


def test_the_dashboard_says_which_assistant_turn_the_template_rewrote(
        plain: ServerProcess) -> None:
    agent_loop(plain, keep_reasoning=False, salt="dashboard")
    recent = httpx.get(plain.base_url + "/v1/cache/stats").json()["recent"]
    notes = [n for r in recent for n in r["notes"] if "rewrote" in n]
    assert any(n.startswith("the template rewrote assistant turn 3: ") for n in notes), notes
    assert all("re-prefilled; send reasoning_content back" in n for n in notes), notes
    assert _metric(plain, "template_rewrites") >= TURNS - 1


def test_a_background_prefill_yields_to_a_request_within_one_step(qwen3: Path) -> None:
    llm = LLM(str(qwen3), **{**TINY_ENGINE, "max_num_batched_tokens": 16})
    engine = llm.engine
    namespace = (engine.config.model, None)
    background = BackgroundPrefill(engine)
    history = list(range(1000, 1100))
    background.submit(PrefillJob(tuple(history), None))
    assert background.start_if_idle()
    engine.step()  # the first 16-token chunk of the background prefill
    background.yield_now()  # a request arrives
    engine.add_request([7, 8, 9, 10], SamplingParams(max_tokens=1, temperature=0), "real")
    assert not background.start_if_idle()  # not while the request is in
    outputs = engine.step()
    assert [o.request_id for o in outputs if o.finished] == ["real"]  # served the next step
    assert background.stats.yielded == 1 and background.snapshot().pending == 1
    # What it computed stayed cached (16 tokens), first to go: evicting a token takes it, and
    # not the request's, which is older. (A match would refresh it: none before the evict.)
    assert engine.cache.stats().cached_tokens >= 16 + 3
    assert engine.cache.evict(1) == 16
    assert engine.cache.match_prefix(namespace, history).length == 0
    assert engine.cache.match_prefix(namespace, [7, 8, 9, 10]).length >= 3
    # Idle again: it resumes and finishes; the history is cached, demoted whole.
    assert background.start_if_idle()
    while engine.has_unfinished_requests():
        background.after_step(engine.step())
    assert background.snapshot() == replace(background.stats, pending=0)
    assert (background.stats.finished, background.stats.tokens) == (1, 100)
    assert engine.cache.evict(100) == 100
    assert engine.cache.match_prefix(namespace, history).length == 0
    assert engine.cache.match_prefix(namespace, [7, 8, 9, 10]).length >= 3


def test_the_linter_names_the_rewritten_turn_and_what_it_costs(
        tmp_path: Path, qwen3: Path) -> None:
    tokenizer = load_tokenizer(qwen3)
    tokenizer.chat_template = (qwen3.parent / "qwen3.jinja").read_text()
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are an agent."},
                                      {"role": "user", "content": "Find x."}]
    lines = []
    for turn in range(TURNS):
        lines.append(json.dumps({"model": "qwen3", "messages": list(messages), "tools": TOOLS}))
        call = {"id": f"call_{turn}", "type": "function", "function": {
            "name": "lookup", "arguments": json.dumps({"q": f"word number {turn}"})}}
        messages += [{"role": "assistant", "content": "", "tool_calls": [call]},
                     {"role": "tool", "tool_call_id": f"call_{turn}", "content": "a grey bird"}]
    log = tmp_path / "agent.jsonl"
    log.write_text("\n".join(lines) + "\n")
    report = lint_log(read_logs([str(log)]), tokenizer, LintOptions())
    [finding] = [f for f in report.findings if f.kind == "template_rewrite"]
    assert finding.requests == TURNS - 1
    assert finding.detail.startswith("the template rewrote assistant turn 1: ")
    # The call as the history renders it: everything from the assistant's opening on.
    call_text = '<tool_call>\n{"name": "lookup", "arguments": {"q": "word number 0"}}\n</tool_call>'
    assert finding.tokens_lost_per_request >= len(tokenizer.encode(call_text,
                                                                   add_special_tokens=False))
    assert "reasoning_content" in finding.fix and "--next-turn-prefill" in finding.fix
    # Sent back, the reasoning renders as generated: nothing to report.
    kept = [json.loads(line) for line in lines]
    for body in kept:
        for message in body["messages"]:
            if message["role"] == "assistant":
                message["reasoning_content"] = "thinking"
    log.write_text("".join(json.dumps(body) + "\n" for body in kept))
    report = lint_log(read_logs([str(log)]), tokenizer, LintOptions())
    assert not [f for f in report.findings if f.kind == "template_rewrite"]
