"""A request's cache blocks rendered with the model's chat template, and the token offset in
that prompt where each breakpoint's cached prefix ends.

Tools become a section at the top of the system message (so the cache order tools, system,
messages holds in the prompt); tool_use, tool_result and other blocks are rendered as text.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from radixserve.provider_caching.render import RenderedRequest
from radixserve.sequences import common_prefix_len

# Asks for the hermes format, which the server reads tool calls in (and forces them in).
TOOLS_HEADER = ('# Tools\nYou may call the following tools (JSON schemas). To call one, reply '
                'with <tool_call>{"name": ..., "arguments": {...}}</tool_call>:')
PIECE_SEPARATOR = "\n\n"


class ChatTemplateTokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def apply_chat_template(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True, **extra: Any,
    ) -> str: ...


@dataclass(frozen=True)
class Piece:
    """Text inside one chat message; `block_index` is the cache block it renders (None for
    framing such as the tools header)."""

    text: str
    block_index: int | None


@dataclass(frozen=True)
class ChatMessage:
    role: str
    pieces: tuple[Piece, ...]


@dataclass(frozen=True)
class ChatPrompt:
    """Chat-template messages built from cache blocks, each piece tied to its block, and the
    template's extra arguments (such as enable_thinking)."""

    messages: tuple[ChatMessage, ...]
    template_args: tuple[tuple[str, Any], ...] = ()

    def chat_messages(self, through_block: int | None = None) -> list[dict[str, str]]:
        """Messages for the template; with `through_block`, cut right after that block."""
        out = []
        for message in self.messages:
            kept = []
            for piece in message.pieces:
                if through_block is not None and piece.block_index is not None \
                        and piece.block_index > through_block:
                    break
                kept.append(piece.text)
            else:
                out.append({"role": message.role, "content": PIECE_SEPARATOR.join(kept)})
                continue
            if kept:
                out.append({"role": message.role, "content": PIECE_SEPARATOR.join(kept)})
            break
        return out


@dataclass(frozen=True)
class RenderedPrompt:
    text: str
    token_ids: list[int]


def chat_prompt(request: RenderedRequest) -> ChatPrompt:
    """Maps cache blocks to chat messages: tools and the system tier become the leading system
    message (Anthropic `system`, or OpenAI's first system/developer message, with `developer`
    rendered as `system`); every other message keeps its role, its blocks joined as text."""
    tools = [Piece(b.text, i) for i, b in enumerate(request.blocks) if b.tier == "tools"]
    messages: list[tuple[str, list[Piece]]] = []
    current: object = object()
    for index, block in enumerate(request.blocks):
        if block.tier == "tools":
            continue
        key = ("system", None) if block.message_index is None else block.message_index
        if key != current:
            role = "system" if block.message_index is None else (block.role or "user")
            messages.append(("system" if role == "developer" else role, []))
            current = key
        messages[-1][1].append(Piece(block.text, index))
    if tools:
        tools.insert(0, Piece(TOOLS_HEADER, None))
        if messages and messages[0][0] == "system":
            messages[0] = ("system", tools + messages[0][1])
        else:
            messages.insert(0, ("system", tools))
    return ChatPrompt(tuple(ChatMessage(role, tuple(pieces)) for role, pieces in messages))


def render_prompt(tokenizer: ChatTemplateTokenizer, prompt: ChatPrompt) -> RenderedPrompt:
    """The full prompt (with the generation prompt) and its token ids, as the engine runs it."""
    text = tokenizer.apply_chat_template(prompt.chat_messages(), add_generation_prompt=True,
                                         **dict(prompt.template_args))
    return RenderedPrompt(text, tokenizer.encode(text, add_special_tokens=False))


def breakpoint_token_offsets(
    tokenizer: ChatTemplateTokenizer,
    prompt: ChatPrompt,
    block_indices: Sequence[int],
    rendered: RenderedPrompt | None = None,
) -> list[int]:
    """For each block index, how many leading tokens of the rendered prompt the prefix ending
    with that block covers.

    Method: render the conversation cut right after the block (no generation prompt); the
    cached prefix is the longest common character prefix of that text and the full prompt,
    and its token length is the longest common prefix of the two token sequences. So a token
    that straddles the block end (a BPE merge across it) is left out, and a template that
    renders earlier turns differently once later turns exist only shortens the prefix: the
    offset never covers text the full prompt does not share.
    """
    rendered = rendered or render_prompt(tokenizer, prompt)
    offsets = []
    for block in block_indices:
        cut = tokenizer.apply_chat_template(prompt.chat_messages(block),
                                            add_generation_prompt=False,
                                            **dict(prompt.template_args))
        chars = common_prefix_len(cut, rendered.text)
        ids = tokenizer.encode(rendered.text[:chars], add_special_tokens=False)
        offsets.append(common_prefix_len(ids, rendered.token_ids))
    return offsets

