"""A reasoning agent loop against `radixserve serve`: a random-weight Qwen3 with Qwen3's own chat
template, five turns of tool calls (each reply forced into reasoning then a call, so the shape
is known), a client that drops `reasoning_content`. Per turn, the prompt tokens not read from
the cache, three ways: the plain template (`--no-next-turn-prefill`), the reasoning sent back,
and the next-turn prefill. Then what the background prefill costs other requests: the TTFT of
a short unrelated request sent while a long history is being prefilled in the background,
against the same request on an idle engine.

    python benchmarks/bench_reasoning_history.py --template PATH/Qwen-Qwen3-0.6B.jinja
    python benchmarks/bench_reasoning_history.py --template T --hidden 256 --layers 4 --turns 3

The template is the family's own (llama.cpp's tree keeps it as models/templates/...).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import torch
import transformers

from radixserve.model.default_model import default_model_path
from radixserve.model.loader import load_tokenizer
from radixserve.testing.server import ServerProcess, start_server

TOOLS = [{"type": "function", "function": {
    "name": "lookup", "description": "Looks a word up.",
    "parameters": {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}}}]
THINK = r"<think>\n[a-z]{2,8}( [a-z]{2,8}){8,16}\n</think>\n\n"
CALL = THINK + r'<tool_call>\n\{"name": "lookup", "arguments": \{"q": "[a-z]{2,6}"\}\}\n</tool_call>'
MODES = {"plain": (False, ["--no-next-turn-prefill"]), "kept": (True, ["--no-next-turn-prefill"]),
         "next_turn_prefill": (False, [])}


def build_model(folder: Path, hidden: int, layers: int, template: Path) -> Path:
    torch.manual_seed(0)
    config = transformers.Qwen3Config(
        hidden_size=hidden, intermediate_size=hidden * 3, num_hidden_layers=layers,
        num_attention_heads=max(hidden // 64, 1), num_key_value_heads=max(hidden // 256, 1),
        head_dim=64, vocab_size=49152, max_position_embeddings=8192, tie_word_embeddings=False)
    model = transformers.Qwen3ForCausalLM(config).eval()
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer = load_tokenizer(default_model_path())
    tokenizer.backend.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": template.read_text(), "eos_token": tokenizer.eos_token,
        "bos_token": tokenizer.bos_token, "tokenizer_class": "GPT2Tokenizer"}))
    return folder


def _metric(server: ServerProcess, name: str) -> float:
    for line in httpx.get(server.base_url + "/metrics").text.splitlines():
        if line.startswith(f"radixserve:{name}") and not line.startswith("#"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _settle(server: ServerProcess) -> None:
    """Until the background prefill has nothing queued or running (a user reading the reply)."""
    time.sleep(0.2)
    deadline = time.monotonic() + 120
    while _metric(server, "background_prefill_pending") and time.monotonic() < deadline:
        time.sleep(0.05)


def agent_loop(server: ServerProcess, keep: bool, turns: int, system: str,
               settle: bool = True) -> list[int]:
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0,
                           timeout=600)
    model = client.models.list().data[0].id
    messages: list[dict[str, Any]] = [{"role": "system", "content": system},
                                      {"role": "user", "content": "Find what the card means."}]
    uncached = []
    for turn in range(turns):
        response = client.chat.completions.create(
            model=model, messages=messages, tools=TOOLS, tool_choice="none", max_tokens=96,
            temperature=0, extra_body={"guided_regex": CALL})
        usage = response.usage
        assert usage is not None and usage.prompt_tokens_details is not None
        uncached.append(usage.prompt_tokens - usage.prompt_tokens_details.cached_tokens)
        message = response.choices[0].message
        call = json.loads((message.content or "").removeprefix("<tool_call>\n")
                          .removesuffix("\n</tool_call>"))
        sent: dict[str, Any] = {"role": "assistant", "content": "", "tool_calls": [{
            "id": f"call_{turn}", "type": "function", "function": {
                "name": call["name"], "arguments": json.dumps(call["arguments"])}}]}
        if keep:
            sent["reasoning_content"] = (message.model_extra or {}).get("reasoning_content")
        messages += [sent, {"role": "tool", "tool_call_id": f"call_{turn}",
                            "content": f"result {turn}: " + "a small grey bird. " * 20}]
        if settle:
            _settle(server)
    return uncached


def _ttft(server: ServerProcess, text: str) -> float:
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0)
    started = time.perf_counter()
    stream = client.chat.completions.create(
        model=client.models.list().data[0].id, messages=[{"role": "user", "content": text}],
        max_tokens=2, temperature=0, stream=True)
    for _ in stream:
        elapsed = time.perf_counter() - started
        stream.close()
        return elapsed
    raise RuntimeError("no token")


def background_cost(server: ServerProcess, system: str, samples: int) -> dict[str, float]:
    """TTFT of a short request on an idle engine, and sent while the engine prefills a long
    history in the background (a finished turn of a conversation with a long system prompt);
    `yielded` says how many of those requests found a prefill running."""
    idle = [_ttft(server, f"Say hi {i}.") for i in range(samples)]
    busy = []
    for i in range(samples):
        long_system = f"{i} " + system  # a fresh conversation: nothing of it cached
        # The short request goes as soon as the turn's reply is back: the server then renders
        # the next turn and starts its prefill, which the request interrupts (within one step:
        # a prefill chunk of up to --max-num-batched-tokens) or finds finished.
        started = _metric(server, "background_prefill_jobs")
        agent_loop(server, False, 1, long_system, settle=False)
        # Sent once the history's prefill has started (the server renders the next turn off
        # the event loop first): the request then meets it running, unless it is done.
        deadline = time.monotonic() + 30
        while (_metric(server, "background_prefill_jobs") <= started
               and time.monotonic() < deadline):
            time.sleep(0.005)
        busy.append(_ttft(server, f"Say hello {i}."))
        _settle(server)
    return {"idle_ttft_s": statistics.median(idle), "during_background_ttft_s":
            statistics.median(busy), "yielded": _metric(server, "background_prefill_yielded")}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--template", type=Path, required=True,
                        help="Qwen3's chat template (llama.cpp's models/templates/"
                             "Qwen-Qwen3-0.6B.jinja)")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--system-words", type=int, default=300)
    parser.add_argument("--samples", type=int, default=3)
    parser.add_argument("--cost-system-words", type=int, default=4000,
                        help="system prompt of the conversations whose background prefill the "
                             "short requests interrupt (long enough to still be running)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None, help="write the figures as JSON")
    args = parser.parse_args()
    system = "You are a careful agent that reads cards and looks words up. " * (
        args.system_words // 11 + 1)
    results: dict[str, Any] = {"turns": args.turns, "hidden": args.hidden, "layers": args.layers}
    with tempfile.TemporaryDirectory() as folder:
        model = build_model(Path(folder) / "qwen3", args.hidden, args.layers, args.template)
        for mode, (keep, flags) in MODES.items():
            server = start_server(["--model", str(model), "--num-threads", str(args.threads),
                                   "--kv-cache-tokens", "32768", *flags],
                                  Path(folder) / f"{mode}.log")
            try:
                results[mode] = agent_loop(server, keep, args.turns, system)
                print(f"{mode:>18}: uncached prompt tokens per turn {results[mode]}")
                if mode == "next_turn_prefill":
                    long_system = system * (args.cost_system_words // args.system_words + 1)
                    results["background_cost"] = cost = background_cost(server, long_system,
                                                                        args.samples)
                    print(f"{'':>18}  short request TTFT: idle {cost['idle_ttft_s']:.3f} s, "
                          f"during a background prefill {cost['during_background_ttft_s']:.3f} "
                          f"s ({cost['yielded']:.0f} prefills yielded)")
            finally:
                server.stop()
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
