"""A mixed prompt workload for cache-on against cache-off checks: a shared system prompt,
multi-turn chats, a branching agent and unique prompts, in rounds."""

from __future__ import annotations

import random

from radixserve import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


def mixed_workload(llm: LLM) -> list[list[list[int]]]:
    """Rounds of prompts: shared system prompt, multi-turn, branching agent, unique ones."""
    tok = llm.tokenizer
    system = ("You are a careful assistant for a hardware store. Answer briefly. "
              "Our opening hours are nine to five, Monday to Saturday. ") * 6

    def chat(*turns: str) -> list[int]:
        messages = [{"role": "system", "content": system}]
        for i, text in enumerate(turns):
            messages.append({"role": "user" if i % 2 == 0 else "assistant", "content": text})
        return tok.encode_chat(messages)

    agent = ["Find the cheapest hammer.", "Calling search(tool='catalog', q='hammer')",
             "Result: claw hammer $12, sledge $30."]
    rng = random.Random(1)
    unique = [[rng.randrange(200, 40000) for _ in range(rng.randrange(20, 60))] for _ in range(3)]
    return [
        [chat("Do you sell nails?"), chat("Are you open on Sunday?"), unique[0]],
        [chat("Do you sell nails?", "Yes, many sizes.", "Which size for drywall?"),
         chat(*agent, "Buy the claw hammer."), chat(*agent, "Compare with the sledge."), unique[1]],
        [chat("Do you sell nails?", "Yes, many sizes.", "Which size for drywall?", "1.25 inch.",
              "And for a deck?"), chat(*agent[:2], "Result: none found."), unique[2]],
    ]


def run_rounds(llm: LLM, rounds: list[list[list[int]]]) -> list[list[int]]:
    out = []
    for prompts in rounds:
        results = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
        out.extend(r.outputs[0].token_ids for r in results)
    return out
