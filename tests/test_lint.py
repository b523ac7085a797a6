"""`radixserve lint` on fixture logs (tests/fixtures/lint, written by make_fixtures.py): each
planted cache-buster is found at its place with the tokens it costs; clean logs have no
findings; malformed lines are reported and skipped; the CLI's output and exit status."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from radixserve.cli import main
from radixserve.lint import cli as lint_cli
from radixserve.lint.analysis import LintOptions, LintReport, lint_log
from radixserve.lint.logs import read_logs
from radixserve.lint.report import render_text, to_json

pytestmark = [pytest.mark.model]

FIXTURES = Path(__file__).parent / "fixtures" / "lint"


def tokens(tokenizer, text: str) -> int:
    return len(tokenizer.encode(text, add_special_tokens=False))


def lint(tokenizer, name: str, **options) -> LintReport:
    return lint_log(read_logs([FIXTURES / name]), tokenizer, LintOptions(**options))


def body(name: str, line: int) -> dict:
    record = json.loads((FIXTURES / name).read_text().splitlines()[line - 1])
    return record.get("body", record)


def only(report: LintReport, kind: str):
    found = [f for f in report.findings if f.kind == kind]
    assert len(found) == 1, [(f.kind, f.location) for f in report.findings]
    return found[0]


@pytest.mark.parametrize("name", ["clean_anthropic.jsonl", "clean_openai.jsonl"])
def test_clean_logs_have_no_findings(tokenizer, name):
    report = lint(tokenizer, name)
    assert report.findings == ()
    assert report.structure.distinct_prefixes == 1
    assert report.structure.reusable_fraction > 0.75
    assert "none: no cache-busters found" in render_text(report)


def test_timestamp_in_the_system_prompt(tokenizer):
    report = lint(tokenizer, "timestamp.jsonl")
    finding = only(report, "timestamp")
    assert report.findings == (finding,)
    system = body("timestamp.jsonl", 2)["system"][0]["text"]
    lost = tokens(tokenizer, system[system.index("Z\n") + 1 :])
    assert (finding.location, finding.path, finding.line_in_block) == (
        f"{FIXTURES / 'timestamp.jsonl'}:2",
        "system.0",
        2,
    )
    assert finding.detail == "2025-06-02T09:11:00Z"
    assert finding.requests == 4 and finding.tokens_lost_per_request == lost
    assert finding.fix == (
        f"move the date/time from system.0 line 2 to the last user message: "
        f"+{lost:,} cached tokens per request"
    )


def test_session_id_in_the_system_message(tokenizer):
    finding = only(lint(tokenizer, "request_id.jsonl"), "request_id")
    system = body("request_id.jsonl", 2)["messages"][0]["content"]
    sid = "7a6b5c4d-3e2f-4a1b-9c8d-7e6f5a4b3c2d"
    assert (finding.path, finding.line_in_block, finding.detail) == ("messages.0.content", 2, sid)
    assert finding.char_offset == system.index(sid)
    assert finding.tokens_lost_per_request == tokens(
        tokenizer, system[system.index(sid) + len(sid) :]
    )


def test_tool_schema_with_reordered_keys(tokenizer):
    finding = only(lint(tokenizer, "key_order.jsonl"), "key_order")
    system = body("key_order.jsonl", 2)["system"][0]["text"]
    assert (finding.location.endswith(":2"), finding.path) == (True, "tools.1")
    # The whole tool is one block, so what is lost is the system prompt after it.
    assert finding.tokens_lost_per_request == tokens(tokenizer, system)
    assert "sort_keys=True" in finding.fix


def test_tool_list_that_differs_per_user(tokenizer):
    finding = only(lint(tokenizer, "tool_list.jsonl"), "tool_list")
    system = body("tool_list.jsonl", 1)["messages"][0]["content"]
    assert (finding.tier, finding.requests) == ("tools", 3)
    assert finding.tokens_lost_per_request == tokens(tokenizer, system)


def test_per_request_text_before_the_shared_system_prompt(tokenizer):
    finding = only(lint(tokenizer, "per_request.jsonl"), "per_request_content")
    first, shared = body("per_request.jsonl", 2)["system"]
    assert (finding.path, finding.char_offset, finding.detail) == (
        "system.0",
        16,
        "Eli on the basic",
    )
    assert finding.tokens_lost_per_request == tokens(tokenizer, " plan.") + tokens(
        tokenizer, shared["text"]
    )
    assert finding.requests == 3


def test_reasoning_effort_changed_within_a_conversation(tokenizer):
    finding = only(lint(tokenizer, "setting_change.jsonl"), "setting_change")
    turn1 = body("setting_change.jsonl", 1)["messages"]
    assert finding.location.endswith(":2") and finding.detail == 'reasoning_effort: "low" -> "high"'
    assert finding.tokens_lost_per_request == sum(tokens(tokenizer, m["content"]) for m in turn1)
    assert finding.fix.startswith("keep reasoning_effort fixed")


def test_an_effort_given_to_the_template_changed_within_a_conversation(tokenizer, tmp_path):
    # gpt-oss's template writes it at the head of the system message: nothing after survives.
    turn1 = [{"role": "system", "content": "You review pull requests. " * 12},
             {"role": "user", "content": "Review the first change."}]
    turn2 = [*turn1, {"role": "assistant", "content": "Looks fine."},
             {"role": "user", "content": "And the second?"}]
    log = tmp_path / "effort.jsonl"
    log.write_text("".join(json.dumps({"model": "gpt-oss-20b", "messages": m,
                                       "chat_template_kwargs": {"reasoning_effort": effort}})
                           + "\n" for m, effort in ((turn1, "low"), (turn2, "high"))))
    finding = only(lint_log(read_logs([log]), tokenizer, LintOptions()), "setting_change")
    assert finding.detail == 'chat_template_kwargs.reasoning_effort: "low" -> "high"'
    assert finding.tokens_lost_per_request == sum(tokens(tokenizer, m["content"]) for m in turn1)


def test_breakpoint_misuse(tokenizer):
    report = lint(tokenizer, "breakpoints.jsonl")
    errors = [f for f in report.findings if f.kind == "breakpoint_error"]
    assert [(f.severity, f.location[-2:]) for f in errors] == [("error", ":1"), ("error", ":2")]
    assert errors[0].detail == "A maximum of 4 blocks with cache_control may be provided. Found 5."
    assert errors[1].path == "system.1.cache_control.ttl"
    below = only(report, "breakpoint_below_minimum")
    header = body("breakpoints.jsonl", 3)["system"][0]["text"]
    assert (below.location[-2:], below.path) == (":3", "system.0")
    assert f"{tokens(tokenizer, header):,} tokens, below this model's 1,024 minimum" in below.detail
    missing = only(report, "no_breakpoint")
    assert missing.location.endswith(":5")
    assert missing.tokens_lost_per_request == tokens(
        tokenizer, body("breakpoints.jsonl", 5)["system"]
    )
    assert render_text(report).index("ERROR") < render_text(report).index("WARN")


def test_breakpoint_on_a_block_that_changes(tokenizer):
    finding = only(lint(tokenizer, "volatile_breakpoint.jsonl"), "volatile_breakpoint")
    stable = body("volatile_breakpoint.jsonl", 1)["system"][0]["text"]
    assert (finding.path, finding.requests) == ("system.1", 3)
    assert finding.tokens_lost_per_request == tokens(tokenizer, stable)
    assert "add a breakpoint at the end of system.0" in finding.fix


def test_fan_out_of_a_cold_prefix(tokenizer):
    report = lint(tokenizer, "fan_out.jsonl")
    finding = only(report, "fan_out")
    assert report.findings == (finding,)
    assert (finding.requests, finding.path) == (3, "system.0")
    assert finding.tokens_lost_per_request == tokens(
        tokenizer, body("fan_out.jsonl", 1)["system"][0]["text"]
    )
    # Further apart than the first-token latency, the same requests are fine.
    assert lint(tokenizer, "fan_out.jsonl", first_token_s=0.05).findings == ()


def test_malformed_lines_are_reported_and_skipped(tokenizer):
    report = lint(tokenizer, "malformed.jsonl")
    assert report.requests == 2
    reasons = {m.line: m.reason for m in report.malformed}
    assert sorted(reasons) == [2, 3, 4, 6, 7, 8]
    assert reasons[2].startswith("invalid JSON")
    assert reasons[3] == "expected a JSON object, got list"
    assert "no 'messages' list" in reasons[4]
    assert "bad timestamp 'yesterday'" in reasons[6]
    assert reasons[7] == "cannot render: messages.0.role: missing role"
    assert reasons[8] == "cannot render: system: expected a list"


def test_wrapper_and_plain_shapes_and_timestamps(tmp_path):
    from radixserve.lint.logs import parse_line

    plain = parse_line(
        json.dumps(
            {
                "model": "gpt-4o",
                "timestamp": "2025-06-01T00:00:00Z",
                "messages": [{"role": "user", "content": "x"}],
            }
        )
    )
    assert plain.format == "openai" and "timestamp" not in plain.body
    assert plain.timestamp == 1748736000.0
    wrapped = parse_line(
        json.dumps(
            {
                "ts": 1,
                "timestamp": 1748736000123,
                "format": "anthropic",
                "output_tokens": 12,
                "request": {"messages": []},
            }
        )
    )
    assert (wrapped.format, wrapped.timestamp, wrapped.output_tokens) == (
        "anthropic",
        1748736000.123,
        12,
    )
    with pytest.raises(ValueError, match="format"):
        parse_line(json.dumps({"format": "cohere", "body": {"messages": []}}))


def write_log(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_simulator_reproduces_the_break_even_arithmetic(tokenizer, tmp_path):
    system = body("clean_anthropic.jsonl", 1)["system"]
    request = {
        "model": "claude-sonnet-4-5",
        "max_tokens": 5,
        "system": system,
        "messages": [{"role": "user", "content": "Hello"}],
    }
    log = write_log(
        tmp_path / "two.jsonl",
        [{"timestamp": 0, "body": request}, {"timestamp": 60, "body": request}],
    )
    prices = tmp_path / "prices.json"
    prices.write_text(json.dumps({"anthropic-1024": {"input": 1.0, "output": 5.0}}))
    from radixserve.provider_caching import load_prices

    options = LintOptions(simulate="anthropic", prices=load_prices(prices))
    sim = lint_log(read_logs([log]), tokenizer, options).simulation
    cached = tokens(tokenizer, system[0]["text"])
    tail = tokens(tokenizer, "Hello")
    assert [u.cache_write_5m_tokens for u in sim.usages] == [cached, 0]
    assert [u.cache_read_tokens for u in sim.usages] == [0, cached]
    assert sim.cost.with_cache == pytest.approx((1.25 * cached + 0.1 * cached + 2 * tail) / 1e6)
    assert sim.cost.without_cache == pytest.approx((2.0 * cached + 2 * tail) / 1e6)
    assert (sim.break_even_5m, sim.break_even_1h) == (1, 2)
    # Sent together, before the first could respond, both pay for the write.
    together = write_log(
        tmp_path / "together.jsonl",
        [{"timestamp": 0, "body": request}, {"timestamp": 0.2, "body": request}],
    )
    report = lint_log(read_logs([together]), tokenizer, options)
    assert [u.cache_write_5m_tokens for u in report.simulation.usages] == [cached, cached]
    assert report.simulation.cost.with_cache == pytest.approx((2.5 * cached + 2 * tail) / 1e6)
    # ...and the fan-out fix (wait for the first token) restores the 1.35.
    assert report.simulation_fixed.cost.with_cache == pytest.approx(sim.cost.with_cache)


def test_simulated_fixes_recover_the_cache(tokenizer):
    for name in ("timestamp.jsonl", "per_request.jsonl", "volatile_breakpoint.jsonl"):
        report = lint(tokenizer, name, simulate="anthropic")
        assert report.simulation.cache_read_tokens == 0, name
        assert report.simulation_fixed.hit_rate > 0.6, name
        assert report.simulation_fixed.cost.with_cache < report.simulation.cost.with_cache
    for name in ("request_id.jsonl", "tool_list.jsonl", "setting_change.jsonl", "key_order.jsonl"):
        report = lint(tokenizer, name, simulate="openai")
        assert report.simulation_fixed.hit_rate > report.simulation.hit_rate + 0.2, name


def test_vendor_minimums_in_simulation(tokenizer):
    # The shared prompt is ~1,800 tokens: cached by OpenAI (1,024), not by Gemini 2.5 (2,048).
    openai = lint(tokenizer, "clean_openai.jsonl", simulate="openai").simulation
    assert openai.requests_with_hits == 4
    assert all(u.cache_read_tokens % 128 == 0 for u in openai.usages)
    gemini = lint(tokenizer, "clean_openai.jsonl", simulate="gemini").simulation
    assert gemini.cache_read_tokens == 0 and gemini.profiles == ("gemini-2048",)


@pytest.fixture
def cli(tokenizer, monkeypatch, capsys):
    monkeypatch.setattr(lint_cli, "_load_tokenizer", lambda model: tokenizer)

    def run(*args: str) -> tuple[int, str, str]:
        status = main(["lint", *args])
        out, err = capsys.readouterr()
        return status, out, err

    return run


def test_cli_exit_status_and_json(cli):
    status, out, _ = cli(str(FIXTURES / "timestamp.jsonl"), "--json")
    data = json.loads(out)
    assert status == 1 and [f["kind"] for f in data["findings"]] == ["timestamp"]
    assert data["structure"]["distinct_prefixes"] == 5
    assert cli(str(FIXTURES / "timestamp.jsonl"), "--fail-threshold", "1")[0] == 0
    status, out, _ = cli(str(FIXTURES / "clean_openai.jsonl"))
    assert status == 0 and "\033[" not in out  # not a terminal: no colour
    status, out, _ = cli(str(FIXTURES / "timestamp.jsonl"), "--colour", "always")
    assert "\033[33mWARN" in out


def test_cli_simulation_json(cli, tmp_path):
    status, out, _ = cli(str(FIXTURES / "fan_out.jsonl"), "--json", "--simulate", "anthropic")
    data = json.loads(out)
    assert data["simulation"]["cache_read_tokens"] == 0
    assert data["simulation_fixed"]["hit_rate"] > 0.7
    assert data["simulation"]["break_even_reuses"] == {"5m": 1, "1h": 2}


def test_cli_usage_errors(cli, tmp_path):
    status, _, err = cli(str(tmp_path / "missing.jsonl"))
    assert status == 2 and "no such log file" in err
    bad = tmp_path / "prices.json"
    bad.write_text('{"x": 1}')
    status, _, err = cli(str(FIXTURES / "clean_openai.jsonl"), "--prices", str(bad))
    assert status == 2 and "need an object" in err
    empty = tmp_path / "empty"
    empty.mkdir()
    assert cli(str(empty))[0] == 2


def test_cli_reads_a_directory(cli):
    status, out, _ = cli(str(FIXTURES), "--json")
    data = json.loads(out)
    assert len(data["files"]) == len(list(FIXTURES.glob("*.jsonl")))
    assert {m["line"] for m in data["malformed"]} == {2, 3, 4, 6, 7, 8}


def test_report_json_is_serialisable(tokenizer):
    report = lint(tokenizer, "breakpoints.jsonl", simulate="anthropic")
    data = json.loads(json.dumps(to_json(report)))
    assert data["simulation"]["rejected"] == 2


def test_json_in_text_and_tool_call_arguments_with_changing_key_order(tokenizer, tmp_path):
    shared = body("clean_openai.jsonl", 1)["messages"][0]["content"]
    profiles = ['{"plan": "gold", "region": "EU"}', '{"region": "EU", "plan": "gold"}']
    log = write_log(
        tmp_path / "profile.jsonl",
        [
            {
                "timestamp": 60 * i,
                "body": {
                    "model": "gpt-4o",
                    "messages": [
                        {"role": "system", "content": f"Profile: {profiles[i % 2]}\n{shared}"},
                        {"role": "user", "content": f"Question number {i}?"},
                    ],
                },
            }
            for i in range(4)
        ],
    )
    report = lint_log(read_logs([log]), tokenizer, LintOptions(simulate="openai"))
    finding = only(report, "key_order")
    assert (finding.path, finding.char_offset, finding.requests) == ("messages.0.content", 9, 1)
    assert finding.tokens_lost_per_request == tokens(tokenizer, "\n" + shared)
    assert report.simulation_fixed.hit_rate > report.simulation.hit_rate

    call = {"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": ""}}
    history = [{"role": "system", "content": shared}, {"role": "user", "content": "Order A-1?"}]
    turns = []
    for i, args in enumerate(
        ['{"id": "A-1", "fields": ["eta"]}', '{"fields": ["eta"], "id": "A-1"}']
    ):
        assistant = {
            "role": "assistant",
            "content": None,
            "tool_calls": [call | {"function": {"name": "lookup", "arguments": args}}],
        }
        turns.append(
            {
                "timestamp": 60 * i,
                "body": {
                    "model": "gpt-4o",
                    "messages": history
                    + [
                        assistant,
                        {
                            "role": "tool",
                            "tool_call_id": "c1",
                            "content": "ETA Friday " + "x " * 40,
                        },
                        {"role": "user", "content": f"Thanks {i}"},
                    ],
                },
            }
        )
    report = lint_log(
        read_logs([write_log(tmp_path / "calls.jsonl", turns)]), tokenizer, LintOptions()
    )
    finding = only(report, "key_order")
    assert finding.path == "messages.2.tool_calls.0"


def test_repairs_edit_the_body():
    from radixserve.lint.repairs import (
        AddBreakpoint,
        MoveMatches,
        MoveSpan,
        PinSetting,
        SortJson,
        UnifyTools,
        repair_body,
    )

    original = {
        "system": "Now: 2025-06-01 10:00. Be brief.",
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": 'Hi {"b": 1, "a": 2}'}]}
        ],
        "tools": [{"name": "z"}],
        "tool_choice": {"type": "any"},
    }
    fixed = repair_body(original, [MoveMatches("system", 1, "timestamp")])
    assert fixed["system"] == "Now: . Be brief."
    assert fixed["messages"][0]["content"][0]["text"].endswith("\n\n2025-06-01 10:00")
    assert original["system"].startswith("Now: 2025")  # the input is not modified
    fixed = repair_body(
        original,
        [
            MoveSpan("system", 0, 5),
            SortJson("messages.0.content.0", 1),
            PinSetting("tool_choice", None),
            AddBreakpoint("system"),
            UnifyTools("anthropic", ('{"name": "a"}', '{"name": "z"}')),
        ],
    )
    assert fixed["system"] == [
        {
            "type": "text",
            "text": "2025-06-01 10:00. Be brief.",
            "cache_control": {"type": "ephemeral"},
        }
    ]
    assert fixed["messages"][0]["content"][0]["text"] == 'Hi {"a": 2, "b": 1}\n\nNow: '
    assert "tool_choice" not in fixed and [t["name"] for t in fixed["tools"]] == ["a", "z"]


def test_claude_codes_billing_header_is_named_with_its_client_cost_and_fix(tokenizer, tmp_path):
    shared = "You are Claude Code, a coding agent. Use the tools with care. " * 30
    log = tmp_path / "claude_code.jsonl"
    log.write_text("\n".join(json.dumps({"body": {
        "model": "claude-sonnet-4-5", "max_tokens": 100,
        "system": [{"type": "text", "text": f"x-anthropic-billing-header: cc_version=2.1.332."
                                            f"{suffix}; cc_entrypoint=cli;"},
                   {"type": "text", "text": shared, "cache_control": {"type": "ephemeral"}}],
        "messages": [{"role": "user", "content": "Fix the failing test."}]}})
        for suffix in ("0b8", "3f1", "a27")) + "\n")
    report = lint_log(read_logs([log]), tokenizer, LintOptions())
    finding = only(report, "client_preamble")
    assert (finding.path, finding.requests) == ("system.0", 2)
    assert finding.tokens_lost_per_request >= tokens(tokenizer, shared)
    assert finding.fix.startswith("Claude Code sends this line")
    assert "--strip-preambles" in finding.fix and "CLAUDE_CODE_ATTRIBUTION_HEADER=0" in finding.fix
