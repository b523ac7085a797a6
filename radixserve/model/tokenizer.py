"""Text <-> token ids, and the model's chat template.

Built on the `tokenizers` library, from either an HF `tokenizer.json` or the vocabulary stored
in a GGUF file's metadata, so both model formats tokenise the same way HF does.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.sandbox
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

from radixserve.model.sentencepiece import sentencepiece_backend

# Pre-tokenizer splits of the GPT-2-style vocabularies, by the GGUF `tokenizer.ggml.pre` name.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclass
class ChatTokenizer:
    """A tokenizer plus what chat rendering needs: template, special tokens, BOS policy."""

    backend: Tokenizer
    chat_template: str | None
    bos_token: str | None
    eos_token: str | None
    add_bos: bool
    # Every id that ends generation: the EOS token and the template's end-of-turn tokens.
    stop_token_ids: set[int] = field(default_factory=set)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token_id(self) -> int | None:
        return self.backend.token_to_id(self.bos_token) if self.bos_token else None

    @property
    def eos_token_id(self) -> int | None:
        return self.backend.token_to_id(self.eos_token) if self.eos_token else None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; with `add_special_tokens`, a BOS first where the model wants it."""
        ids = self.backend.encode(text, add_special_tokens=False).ids
        bos = self.bos_token_id
        if add_special_tokens and self.add_bos and bos is not None:
            ids = [bos, *ids]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        **extra: Any,
    ) -> str:
        """Renders `messages` (and `tools`, if the template takes them) to prompt text."""
        if not self.chat_template:
            raise ValueError("this model has no chat template; use a completion prompt")
        template = _compile_template(self.chat_template)
        return template.render(
            messages=messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
            **extra,
        )

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        **extra: Any,
    ) -> list[int]:
        # The template writes the BOS itself where the model has one, so none is added here.
        text = self.apply_chat_template(messages, tools, add_generation_prompt, **extra)
        return self.encode(text, add_special_tokens=False)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(value: Any, indent: int | None = None) -> str:
    # Sorted keys: the same tool schema must render to the same tokens every time, or the
    # prefix cache misses on every request that reorders a dict.
    return json.dumps(value, ensure_ascii=False, indent=indent, sort_keys=True)


@functools.lru_cache(maxsize=8)
def _compile_template(source: str) -> jinja2.Template:
    # Compiled once per template source; a compiled template is immutable, so sharing is safe.
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True
    )
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.filters["tojson"] = _tojson
    return env.from_string(source)


def _end_of_turn_ids(backend: Tokenizer, eos: str | None) -> set[int]:
    ids = set()
    for name in (eos, "<|im_end|>", "<|eot_id|>", "<|end_of_text|>", "<|endoftext|>", "</s>",
                 "<end_of_turn>"):
        if name and (tid := backend.token_to_id(name)) is not None:
            ids.add(tid)
    return ids


def _token_content(value: Any) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value


def load_hf_tokenizer(model_dir: Path) -> ChatTokenizer:
    """From an HF model directory: tokenizer.json plus tokenizer_config.json."""
    path = model_dir / "tokenizer.json"
    if not path.exists():
        raise FileNotFoundError(f"{model_dir} has no tokenizer.json (a fast HF tokenizer is needed)")
    backend = Tokenizer.from_file(str(path))
    config: dict[str, Any] = {}
    if (model_dir / "tokenizer_config.json").exists():
        config = json.loads((model_dir / "tokenizer_config.json").read_text())
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: take the default one
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    if template is None and (model_dir / "chat_template.jinja").exists():
        template = (model_dir / "chat_template.jinja").read_text()
    bos = _token_content(config.get("bos_token"))
    eos = _token_content(config.get("eos_token"))
    # Backends with a post-processor add BOS themselves; we add it explicitly instead, so that
    # rendered chat text (which carries its own BOS) is never given two.
    add_bos = bool(config.get("add_bos_token", _post_processor_adds_bos(backend, bos)))
    backend.no_padding()
    backend.no_truncation()
    backend.post_processor = None
    return ChatTokenizer(
        backend=backend,
        chat_template=template,
        bos_token=bos,
        eos_token=eos,
        add_bos=add_bos,
        stop_token_ids=_end_of_turn_ids(backend, eos),
    )


def _post_processor_adds_bos(backend: Tokenizer, bos: str | None) -> bool:
    if not bos or backend.post_processor is None:
        return False
    probe = backend.encode("a", add_special_tokens=True).ids
    return bool(probe) and probe[0] == backend.token_to_id(bos)


def load_gguf_tokenizer(metadata: dict[str, Any],
                        fallback_template: str | None = None) -> ChatTokenizer:
    """From a GGUF file's `tokenizer.ggml.*` metadata: GPT-2-style byte-level BPE, or
    SentencePiece BPE (Gemma). `fallback_template` is the model family's chat template, for
    a file that carries none."""
    kind = metadata.get("tokenizer.ggml.model")
    if kind == "gpt2":
        backend = _byte_level_backend(metadata)
    elif kind == "llama":
        backend = sentencepiece_backend(metadata)
    else:
        raise ValueError(
            f"GGUF tokenizer type {kind!r} is not supported (supported: 'gpt2' byte-level BPE, "
            "as in SmolLM2, Llama 3 and Qwen2, and 'llama' SentencePiece BPE, as in Gemma); "
            "load the model's HF directory instead"
        )
    tokens: list[str] = metadata["tokenizer.ggml.tokens"]
    bos_id = metadata.get("tokenizer.ggml.bos_token_id")
    eos_id = metadata.get("tokenizer.ggml.eos_token_id")
    bos = tokens[bos_id] if bos_id is not None else None
    eos = tokens[eos_id] if eos_id is not None else None
    template = metadata.get("tokenizer.chat_template") or fallback_template
    # GGUF converters set add_bos_token for nearly every model, while HF's own tokenizers differ
    # (SmolLM2 and Qwen2 add none). A chat template that writes `bos_token` is the reliable
    # sign that the model was trained with one.
    add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", False)) and bool(
        template and "bos_token" in template
    )
    return ChatTokenizer(
        backend=backend,
        chat_template=template,
        bos_token=bos,
        eos_token=eos,
        add_bos=add_bos,
        stop_token_ids=_end_of_turn_ids(backend, eos),
    )


def _byte_level_backend(metadata: dict[str, Any]) -> Tokenizer:
    tokens: list[str] = metadata["tokenizer.ggml.tokens"]
    merges = [tuple(m.split(" ", 1)) for m in metadata["tokenizer.ggml.merges"]]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    pre = metadata.get("tokenizer.ggml.pre", "default")
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    if pre in ("llama3", "llama-bpe", "llama-v3", "smaug-bpe"):
        split = pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated")
        backend.pre_tokenizer = pre_tokenizers.Sequence([split, byte_level])
    elif pre in ("qwen2", "qwen2.5"):
        split = pre_tokenizers.Split(Regex(_QWEN2_SPLIT), behavior="isolated")
        backend.pre_tokenizer = pre_tokenizers.Sequence([split, byte_level])
    elif pre == "smollm":
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    else:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    types: list[int] = metadata.get("tokenizer.ggml.token_type", [1] * len(tokens))
    # GGUF token types: 3 = control, 4 = user-defined. Both must match as whole tokens in text.
    specials = [AddedToken(tokens[i], special=True, normalized=False)
                for i, t in enumerate(types) if t in (3, 4)]
    backend.add_special_tokens(specials)
    return backend
