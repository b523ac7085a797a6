"""Exact verification of a draft against the target model's own choices.

A speculating row holds the request's newest token followed by its draft d_1..d_k; the model's
token at row j (after the request's logits processors, with d_1..d_j taken as output) is t_j.
Greedy decoding would have produced t_0, then t_1 if d_1 == t_0, and so on: the accepted tokens
are the longest prefix of the draft that matches, plus the model's next token. So the output is
token for token what plain decoding gives, however wrong the draft.
"""

from __future__ import annotations

from collections.abc import Sequence


def accept_greedy(draft: Sequence[int], targets: Sequence[int]) -> list[int]:
    """The tokens a greedy request takes from one verified row: `targets` has one token per
    row (len(draft) + 1); returns targets[:a + 1], a the matching prefix's length."""
    assert len(targets) == len(draft) + 1, (len(draft), len(targets))
    accepted = 0
    while accepted < len(draft) and draft[accepted] == targets[accepted]:
        accepted += 1
    return list(targets[: accepted + 1])
