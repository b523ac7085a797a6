"""What agent clients send, through the official `anthropic` SDK against a real server: Claude
Code's per-request billing header taken out before rendering (block and string forms, the
cache_control after it, count_tokens = usage), context editing (each edit type and parameter
against a hand-edited body, applied_edits whole and streamed, cache on == cache off after an
edit, unknown types refused), the not-applied header, --max-tokens-policy clamp (reported on
the Anthropic and OpenAI routes) and HEAD /.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import pytest

from radixserve.server.anthropic.context_editing import CLEARED_RESULT
from radixserve.server.anthropic.messages import CONTEXT_EDIT_HEADER, PREAMBLE_HEADER
from radixserve.server.validation import MAX_TOKENS_HEADER
from radixserve.testing.server import ServerProcess, read_metrics
from tests.support.servers import anthropic_client, openai_client, running_server

pytestmark = [pytest.mark.model, pytest.mark.server]

KEY, OTHER_KEY = "agents-key", "agents-other-key"
MODEL = "SmolLM2-135M-Instruct"
BETA = "context-management-2025-06-27"
GREEDY = {"temperature": 0}  # this SDK has no temperature argument
SHARED = "You are a careful coding agent. Follow the repository's conventions. " * 40
TOOLS = [{"name": name, "description": f"{name} a file", "input_schema": {
    "type": "object", "properties": {"path": {"type": "string"}}}} for name in ("read", "grep")]


def header(suffix: str) -> str:
    return f"x-anthropic-billing-header: cc_version=2.1.332.{suffix}; cc_entrypoint=sdk-cli;"


@pytest.fixture(scope="module")
def server(model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    # Two keys in their own namespaces: the second one's cache is cold (cache on == off).
    with running_server(tmp_path_factory, "--api-key", KEY, "--api-key", OTHER_KEY,
                        "--isolate-tenants", "--max-tokens-policy", "clamp",
                        name="agents") as proc:
        yield proc


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> Iterator[anthropic.Anthropic]:
    with anthropic_client(server, KEY) as c:
        yield c


@pytest.fixture(scope="module")
def cold_client(server: ServerProcess) -> Iterator[anthropic.Anthropic]:
    with anthropic_client(server, OTHER_KEY) as c:
        yield c


def block_system(suffix: str, tag: str) -> list[dict[str, Any]]:
    return [{"type": "text", "text": header(suffix)},
            {"type": "text", "text": f"[{tag}] {SHARED}", "cache_control": {"type": "ephemeral"}}]


def total(usage: Any) -> int:
    return usage.input_tokens + usage.cache_read_input_tokens + usage.cache_creation_input_tokens


def test_billing_header_block_is_stripped_and_the_prefix_after_it_is_read_from_the_cache(
        client: anthropic.Anthropic, server: ServerProcess) -> None:
    ask = [{"role": "user", "content": "Say hi."}]
    first = client.messages.with_raw_response.create(
        model=MODEL, max_tokens=2, system=block_system("a1f", "block"), messages=ask)
    second = client.messages.create(model=MODEL, max_tokens=2,
                                    system=block_system("9c2", "block"), messages=ask)
    plain = client.messages.count_tokens(model=MODEL, system=block_system("x", "block")[1:],
                                         messages=ask)
    assert "claude_code_billing_header (system.0," in first.headers[PREAMBLE_HEADER]
    # The model never saw the header: the prompt is the one without it, token for token.
    assert total(first.parse().usage) == total(second.usage) == plain.input_tokens
    # The breakpoint on the block after the header wrote it, and the next request read it.
    assert first.parse().usage.cache_creation_input_tokens > 0
    assert second.usage.cache_read_input_tokens >= 0.95 * plain.input_tokens - 20
    counted = client.messages.count_tokens(model=MODEL, system=block_system("d4", "block"),
                                           messages=ask)
    assert counted.input_tokens == total(second.usage)
    metrics = read_metrics(server.base_url)
    stripped = [v for k, v in metrics.items()
                if k.startswith("preamble_stripped_total")]
    assert stripped and stripped[0] >= 2


def test_billing_header_line_leaves_a_string_system_prompt(client: anthropic.Anthropic) -> None:
    ask = [{"role": "user", "content": "Name a color."}]
    with_header = client.messages.create(model=MODEL, max_tokens=6, extra_body=GREEDY,
                                         system=f"{header('77e')}\n[string] {SHARED}",
                                         messages=ask)
    without = client.messages.create(model=MODEL, max_tokens=6, extra_body=GREEDY,
                                     system=f"[string] {SHARED}", messages=ask)
    assert total(with_header.usage) == total(without.usage)
    assert with_header.content[0].text == without.content[0].text
    assert without.usage.cache_read_input_tokens >= total(without.usage) - 20


def test_a_header_anywhere_but_the_head_of_the_system_text_is_prompt(
        client: anthropic.Anthropic) -> None:
    ask = [{"role": "user", "content": "Hi."}]
    moved = client.messages.with_raw_response.create(
        model=MODEL, max_tokens=1, system=f"[late] {SHARED}\n{header('1')}", messages=ask)
    plain = client.messages.count_tokens(model=MODEL, system=f"[late] {SHARED}", messages=ask)
    assert PREAMBLE_HEADER not in moved.headers
    assert total(moved.parse().usage) > plain.input_tokens


# --- context editing --------------------------------------------------------------------


def tool_conversation(uses: int, tag: str) -> list[dict[str, Any]]:
    """A user task, then `uses` tool calls (alternating read and grep) each with a long
    result, then a final question."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": f"[{tag}] Fix the bug."}]
    for i in range(uses):
        name = "read" if i % 2 == 0 else "grep"
        messages.append({"role": "assistant", "content": [
            {"type": "text", "text": f"Step {i}."},
            {"type": "tool_use", "id": f"toolu_{i}", "name": name, "input": {"path": f"f{i}.py"}}]})
        messages.append({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": f"toolu_{i}",
             "content": f"line {i}: " + "def handler(request): return respond(request)\n" * 12}]})
    messages.append({"role": "user", "content": "What next?"})
    return messages


def cleared(messages: list[dict[str, Any]], uses: list[int], inputs: list[int] = ()
            ) -> list[dict[str, Any]]:
    """The hand-edited conversation: results of `uses` replaced, inputs of `inputs` emptied."""
    out = copy.deepcopy(messages)
    for i in uses:
        out[2 + 2 * i]["content"][0]["content"] = CLEARED_RESULT
    for i in inputs:
        out[1 + 2 * i]["content"][1]["input"] = {}
    return out


def count(client: anthropic.Anthropic, messages: list[dict[str, Any]], **extra: Any) -> Any:
    return client.beta.messages.count_tokens(model=MODEL, messages=messages, tools=TOOLS,
                                             betas=[BETA], **extra)


def edit(**params: Any) -> dict[str, Any]:
    return {"edits": [{"type": "clear_tool_uses_20250919", **params}]}


def check_edit(client: anthropic.Anthropic, messages: list[dict[str, Any]],
               management: dict[str, Any], expected: list[dict[str, Any]]) -> None:
    """count_tokens with the edit counts the hand-edited conversation, and says what it was
    before."""
    edited = count(client, messages, context_management=management)
    assert edited.input_tokens == count(client, expected).input_tokens
    assert edited.context_management.original_input_tokens == count(client, messages).input_tokens


@pytest.mark.parametrize(("params", "uses", "inputs"), [
    ({"trigger": {"type": "input_tokens", "value": 0}}, [0, 1], []),  # keep defaults to 3
    ({"trigger": {"type": "input_tokens", "value": 0}, "keep": {"type": "tool_uses", "value": 1}},
     [0, 1, 2, 3], []),
    ({"trigger": {"type": "input_tokens", "value": 10**6}}, [], []),  # below the trigger
    ({"trigger": {"type": "tool_uses", "value": 5}, "keep": {"type": "tool_uses", "value": 0}},
     [], []),  # 5 uses do not exceed 5
    ({"trigger": {"type": "tool_uses", "value": 4}, "keep": {"type": "tool_uses", "value": 0}},
     [0, 1, 2, 3, 4], []),
    ({"trigger": {"type": "tool_uses", "value": 0}, "keep": {"type": "tool_uses", "value": 1},
      "exclude_tools": ["grep"]}, [0, 2], []),
    ({"trigger": {"type": "tool_uses", "value": 0}, "keep": {"type": "tool_uses", "value": 3},
      "clear_tool_inputs": True}, [0, 1], [0, 1]),
    ({"trigger": {"type": "tool_uses", "value": 0}, "keep": {"type": "tool_uses", "value": 2},
      "clear_tool_inputs": ["grep"]}, [0, 1, 2], [1]),
    ({"trigger": {"type": "tool_uses", "value": 0}, "keep": {"type": "tool_uses", "value": 3},
      "clear_at_least": {"type": "input_tokens", "value": 10**6}}, [], []),
    ({"trigger": {"type": "tool_uses", "value": 0}, "keep": {"type": "tool_uses", "value": 3},
      "clear_at_least": {"type": "input_tokens", "value": 100}}, [0, 1], []),
])
def test_clear_tool_uses_renders_the_hand_edited_conversation(
        client: anthropic.Anthropic, params: dict[str, Any], uses: list[int],
        inputs: list[int]) -> None:
    messages = tool_conversation(5, "count")
    check_edit(client, messages, edit(**params), cleared(messages, uses, inputs))


def thinking_conversation() -> list[dict[str, Any]]:
    """Three assistant turns with thinking; the second is a tool loop (one turn, two
    messages)."""
    def thought(i: int) -> dict[str, Any]:
        return {"type": "thinking", "thinking": f"Reasoning {i}: " + "consider the cases. " * 10,
                "signature": f"sig{i}"}
    return [
        {"role": "user", "content": "Plan it."},
        {"role": "assistant", "content": [thought(0), {"type": "text", "text": "Plan A."}]},
        {"role": "user", "content": "Do it."},
        {"role": "assistant", "content": [thought(1), {"type": "tool_use", "id": "toolu_t",
                                                       "name": "read", "input": {"path": "a"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_t",
                                      "content": "ok"}]},
        {"role": "assistant", "content": [thought(2), {"type": "text", "text": "Done."}]},
        {"role": "user", "content": "Check it."},
        {"role": "assistant", "content": [thought(3), {"type": "text", "text": "Checked."}]},
        {"role": "user", "content": "Thanks."},
    ]


def without_thinking(messages: list[dict[str, Any]], at: list[int]) -> list[dict[str, Any]]:
    out = copy.deepcopy(messages)
    for i in at:
        out[i]["content"] = [b for b in out[i]["content"] if b["type"] != "thinking"]
    return out


THINKING_ON = {"type": "enabled", "budget_tokens": 1024}


@pytest.mark.parametrize(("keep", "stripped"), [
    (None, [1, 3, 5]),  # default: the last thinking turn only
    ({"type": "thinking_turns", "value": 2}, [1]),  # the tool loop (messages 3 and 5) is one turn
    ({"type": "thinking_turns", "value": 0}, [1, 3, 5, 7]),
    ("all", []),
    ({"type": "all"}, []),
])
def test_clear_thinking_keeps_the_last_turns(client: anthropic.Anthropic, keep: Any,
                                             stripped: list[int]) -> None:
    messages = thinking_conversation()
    spec = {"type": "clear_thinking_20251015"} | ({} if keep is None else {"keep": keep})
    edited = count(client, messages, context_management={"edits": [spec]}, thinking=THINKING_ON)
    expected = count(client, without_thinking(messages, stripped), thinking=THINKING_ON)
    assert edited.input_tokens == expected.input_tokens


def test_applied_edits_in_the_response_and_the_stream_and_cache_on_equals_off(
        client: anthropic.Anthropic, cold_client: anthropic.Anthropic) -> None:
    messages = tool_conversation(4, "generate")
    management = edit(trigger={"type": "tool_uses", "value": 0},
                      keep={"type": "tool_uses", "value": 2})
    warm = client.messages.create(model=MODEL, max_tokens=1, messages=messages, tools=TOOLS)
    before = count(client, messages[:2]).input_tokens  # up to the first cleared result
    raw = client.beta.messages.with_raw_response.create(
        model=MODEL, max_tokens=8, extra_body=GREEDY, messages=messages, tools=TOOLS, betas=[BETA],
        context_management=management)
    reply = raw.parse()
    [applied] = reply.context_management.applied_edits
    assert applied.type == "clear_tool_uses_20250919" and applied.cleared_tool_uses == 2
    assert applied.cleared_input_tokens == total(warm.usage) - total(reply.usage) > 0
    assert raw.headers[CONTEXT_EDIT_HEADER] == "messages.2.content.0"
    # The cache kept the prefix up to the first cleared block (less the generation prompt
    # count_tokens adds) and no further.
    assert before - 8 <= reply.usage.cache_read_input_tokens < total(warm.usage) - 100
    cold = cold_client.beta.messages.create(
        model=MODEL, max_tokens=8, extra_body=GREEDY, messages=messages, tools=TOOLS, betas=[BETA],
        context_management=management)
    assert cold.usage.cache_read_input_tokens == 0
    assert cold.content[0].text == reply.content[0].text
    with client.beta.messages.stream(model=MODEL, max_tokens=8, extra_body=GREEDY, messages=messages,
                                     tools=TOOLS, betas=[BETA],
                                     context_management=management) as stream:
        final = stream.get_final_message()
    assert final.context_management.applied_edits[0].cleared_tool_uses == 2
    assert final.content[0].text == reply.content[0].text


@pytest.mark.parametrize(("management", "thinking", "message"), [
    ({"edits": [{"type": "compact_20260112"}]}, None, "not implemented"),
    ({"edits": [{"type": "clear_everything"}]}, None, "not implemented"),
    ({"edits": [{"type": "clear_thinking_20251015"}]}, None, "needs thinking"),
    ({"edits": [{"type": "clear_tool_uses_20250919"}, {"type": "clear_thinking_20251015"}]},
     THINKING_ON, "must come first"),
    ({"edits": [{"type": "clear_tool_uses_20250919", "keep": {"type": "turns", "value": 1}}]},
     None, "keep"),
    ({"edits": [{"type": "clear_tool_uses_20250919", "placeholder": "x"}]}, None, "placeholder"),
])
def test_edits_this_server_cannot_apply_are_refused(
        client: anthropic.Anthropic, management: dict[str, Any], thinking: Any,
        message: str) -> None:
    extra = {"thinking": thinking} if thinking else {}
    with pytest.raises(anthropic.BadRequestError, match=message):
        client.beta.messages.create(model=MODEL, max_tokens=2, betas=[BETA],
                                    messages=[{"role": "user", "content": "Hi."}],
                                    context_management=management, **extra)


# --- fields agent clients send, the max-tokens policy, the probe ---------------------------


def test_what_is_not_applied_is_said_in_a_header(client: anthropic.Anthropic) -> None:
    raw = client.beta.messages.with_raw_response.create(
        model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "Hi."}],
        metadata={"user_id": "u1"}, thinking={"type": "adaptive"}, service_tier="auto",
        betas=[BETA, "interleaved-thinking-2025-05-14"])
    assert raw.headers["x-radixserve-not-applied"] == (
        "metadata, anthropic-beta=interleaved-thinking-2025-05-14")
    assert raw.headers["x-radixserve-thinking"].startswith("ignored")
    # A field this server does not know is named too, never dropped unsaid.
    raw = client.messages.with_raw_response.create(
        model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "Hi."}],
        extra_body={"inference_speed": "fast"})
    assert raw.headers["x-radixserve-not-applied"] == "inference_speed"


@pytest.mark.parametrize("field, value", [
    ("mcp_servers", [{"type": "url", "url": "https://example.invalid/mcp", "name": "x"}]),
    ("container", "container_1"),
])
def test_server_side_tool_features_are_refused(client: anthropic.Anthropic, field: str,
                                               value: Any) -> None:
    with pytest.raises(anthropic.BadRequestError, match=field):
        client.messages.create(model=MODEL, max_tokens=2, extra_body={field: value},
                               messages=[{"role": "user", "content": "Hi."}])


def test_a_system_message_in_the_conversation_is_rendered_until_cleared(
        client: anthropic.Anthropic) -> None:
    note = {"role": "system", "content": "The date is 2026-12-04.",
            "clear_at": "next_user_message"}
    first = [{"role": "user", "content": "Hi."}, note]
    later = [*first, {"role": "assistant", "content": "Hello."},
             {"role": "user", "content": "Bye."}]
    shown = count(client, first).input_tokens
    assert shown > count(client, first[:1]).input_tokens
    hidden = [m for m in later if m is not note]
    assert count(client, later).input_tokens == count(client, hidden).input_tokens


def test_clamp_lowers_max_tokens_and_says_so(client: anthropic.Anthropic) -> None:
    raw = client.messages.with_raw_response.create(
        model=MODEL, max_tokens=32000, messages=[{"role": "user", "content": "Hi."}],
        stop_sequences=[".", "!", "?", "\n"])
    requested, granted = raw.headers[MAX_TOKENS_HEADER].split("->")
    assert requested == "32000" and 0 < int(granted) < 8192
    assert raw.parse().usage.output_tokens <= int(granted)


def test_clamp_is_reported_on_the_openai_routes_too(server: ServerProcess) -> None:
    with openai_client(server, KEY) as openai:
        chat = openai.chat.completions.with_raw_response.create(
            model=MODEL, max_tokens=32000, messages=[{"role": "user", "content": "Hi."}],
            stop=[".", "!", "?", "\n"], temperature=0)
        legacy = openai.completions.with_raw_response.create(
            model=MODEL, max_tokens=32000, prompt=["Hi.", "A longer prompt, " * 20],
            stop=[".", "\n"], temperature=0)
        streamed = openai.completions.with_raw_response.create(
            model=MODEL, max_tokens=9000, prompt="Hi.", stop=[".", "\n"], temperature=0,
            stream=True)
        fitting = openai.chat.completions.with_raw_response.create(
            model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "Hi."}])
    requested, granted = chat.headers[MAX_TOKENS_HEADER].split("->")
    assert requested == "32000" and 0 < int(granted) < 8192
    assert chat.parse().usage.completion_tokens <= int(granted)
    # Two prompts: the header gives the least room either was granted (the longer prompt's).
    requested, least = legacy.headers[MAX_TOKENS_HEADER].split("->")
    assert requested == "32000" and 0 < int(least) < int(granted)
    assert streamed.headers[MAX_TOKENS_HEADER].startswith("9000->")
    assert MAX_TOKENS_HEADER not in fitting.headers


def test_head_root_answers_200(server: ServerProcess) -> None:
    assert httpx.head(server.base_url + "/").status_code == 200
