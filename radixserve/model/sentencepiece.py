"""A SentencePiece BPE vocabulary from a GGUF file (`tokenizer.ggml.model` "llama", as Gemma
writes it) rebuilt as a `tokenizers` BPE: spaces spelled "▁", no pre-split (the whole text is
one word, so runs of spaces merge into the tokens that hold them), byte fallback for the rest.
"""

from __future__ import annotations

from typing import Any

from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers

SPACE = "\u2581"
# GGUF token types (llama.cpp's enum).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6


def sentencepiece_backend(metadata: dict[str, Any]) -> Tokenizer:
    """The tokenizer a SentencePiece BPE GGUF describes. The file lists no merges: each token
    that two others concatenate to is a merge of them, ranked by the token's place in the
    vocabulary (a BPE vocabulary lists its merges' results in the order they were learnt)."""
    tokens = [_respell(token) for token in metadata["tokenizer.ggml.tokens"]]
    types: list[int] = metadata.get("tokenizer.ggml.token_type", [NORMAL] * len(tokens))
    vocab = {token: i for i, token in enumerate(tokens)}
    merges: list[tuple[str, str]] = []
    for token, kind in zip(tokens, types, strict=True):
        if kind not in (NORMAL, USER_DEFINED):
            continue
        splits = [(token[:cut], token[cut:]) for cut in range(1, len(token))
                  if token[:cut] in vocab and token[cut:] in vocab]
        # Of one token's several splits, the one with the longer left part first.
        merges.extend(sorted(splits, key=lambda pair: -len(pair[0])))
    unk_id = metadata.get("tokenizer.ggml.unknown_token_id")
    backend = Tokenizer(models.BPE(
        vocab=vocab, merges=merges, fuse_unk=True, byte_fallback=True,
        unk_token=tokens[unk_id] if unk_id is not None else None))
    normal = [normalizers.Replace(" ", SPACE)]
    if metadata.get("tokenizer.ggml.add_space_prefix", False):
        normal.insert(0, normalizers.Prepend(SPACE))
    backend.normalizer = normalizers.Sequence(normal)
    backend.decoder = decoders.Sequence(
        [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()])
    # Control tokens are special (dropped when decoding with skip_special_tokens); user-defined
    # ones ("\n\n", runs of spaces) are text the tokenizer must still match whole, spaces
    # spelled as the normalizer spells them.
    backend.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                                for i, kind in enumerate(types) if kind == CONTROL])
    backend.add_tokens([AddedToken(tokens[i], special=False, normalized=True)
                        for i, kind in enumerate(types) if kind == USER_DEFINED])
    return backend


def _respell(token: str) -> str:
    # A token of only spaces is stored with real spaces, while the text it must match has them
    # spelled "▁" by the normalizer.
    return SPACE * len(token) if token and not token.strip(" ") else token
