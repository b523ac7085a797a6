"""Text of an exact token length for a given tokenizer.

Words are drawn from the tokenizer's own vocabulary, keeping only those that are one token both
with and without a leading space, so `n` words joined by spaces are exactly `n` tokens.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

from radixserve.model.tokenizer import ChatTokenizer

# Byte-level BPE vocabularies mark a leading space with "Ġ"; SentencePiece ones with "▁".
_SPACED_WORD = re.compile(r"[Ġ▁]([a-z]{3,9})")


@dataclass(frozen=True)
class WordBank:
    """Words that each tokenise to exactly one token, alone or after a space."""

    words: tuple[str, ...]

    @classmethod
    def from_tokenizer(cls, tokenizer: ChatTokenizer, limit: int = 4096) -> WordBank:
        vocab = tokenizer.backend.get_vocab()
        found: list[str] = []
        for piece, token_id in sorted(vocab.items(), key=lambda item: item[1]):
            match = _SPACED_WORD.fullmatch(piece)
            if match is None:
                continue
            word = match.group(1)
            # Checked by encoding, not trusted from the vocabulary: BPE merges may not reach a
            # vocabulary entry, and then the word would cost two tokens.
            if tokenizer.encode(" " + word, add_special_tokens=False) != [token_id]:
                continue
            if len(tokenizer.encode(word, add_special_tokens=False)) != 1:
                continue
            found.append(word)
            if len(found) >= limit:
                break
        if len(found) < 256:
            raise ValueError(
                f"the tokenizer has only {len(found)} single-token lowercase words; "
                "exact-length prompts need at least 256"
            )
        return cls(tuple(found))

    def text(self, rng: random.Random, num_tokens: int) -> str:
        """`num_tokens` random words: exactly that many tokens, alone or after a newline/space."""
        if num_tokens < 1:
            raise ValueError("num_tokens must be >= 1")
        return " ".join(rng.choice(self.words) for _ in range(num_tokens))

    def distinct_texts(self, rng: random.Random, count: int, num_tokens: int) -> list[str]:
        """`count` texts of `num_tokens` tokens whose first words all differ, so they share no
        token with each other beyond what the surrounding template adds."""
        if count > len(self.words):
            raise ValueError(f"at most {len(self.words)} distinct texts, asked for {count}")
        firsts = rng.sample(self.words, count)
        if num_tokens == 1:
            return firsts
        return [first + " " + self.text(rng, num_tokens - 1) for first in firsts]
