"""A reasoning model's chat template rewriting the history: a conversation's next turn (the
previous request's messages, the assistant's reply, a tool result or user message) whose
prompt, as the model's template renders it, leaves the previous prompt and its generated reply
inside an assistant turn. The reply began with its reasoning (think tags); sent back without
`reasoning_content`, the template renders the turn without it, and every token after that
point is prefilled again on every turn.

Needs the model's chat template (`radixserve lint --model`); OpenAI chat requests only (the
Anthropic route renders thinking blocks the client sends back).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from radixserve.lint.corpus import Corpus
from radixserve.lint.findings import Instance
from radixserve.lint.structure import PrefixStructure
from radixserve.provider_caching.history_rewrite import (
    HistoryRewrite,
    find_rewrite,
    next_turn_history,
)
from radixserve.provider_caching.template import ChatTemplateTokenizer

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
# A stand-in for the reasoning, which the log does not hold: only where the history leaves
# the generated text matters, and the cost is counted on the history's side.
_REASONING = "reasoning"


def template_rewrite_instances(corpus: Corpus, structure: PrefixStructure,
                               chat: ChatTemplateTokenizer, template: str) -> list[Instance]:
    """One instance per next turn whose history the template rewrote; none unless the
    template writes think tags."""
    if THINK_CLOSE not in template:
        return []
    instances = []
    for d in structure.divergences:
        if d.reference is None or not d.extends_reference:
            continue
        r, q = corpus.requests[d.request], corpus.requests[d.reference]
        if r.rendered.format != "openai":
            continue
        found = _rewrite(chat, r.logged.body, q.logged.body)
        if found is not None:
            instances.append(Instance(
                "template_rewrite", r.index, r.logged.location, tier="messages",
                path="messages", tokens_lost=found.tokens, detail=found.describe(),
                reference=q.index))
    return instances


def _rewrite(chat: ChatTemplateTokenizer, body: dict[str, Any],
             previous: dict[str, Any]) -> HistoryRewrite | None:
    """The rewrite when `body` continues `previous` with an assistant reply whose reasoning
    the template leaves out."""
    messages, earlier = body.get("messages"), previous.get("messages")
    if not isinstance(messages, list) or not isinstance(earlier, list):
        return None
    n = len(earlier)
    if len(messages) <= n or not _assistant(messages[n]) or messages[n].get("reasoning_content"):
        return None
    tools = body.get("tools") or None
    try:
        prompt_text = chat.apply_chat_template(_dicts(earlier), tools, True)
        history = next_turn_history(chat, _dicts(messages[: n + 1]), tools, {})
    except Exception:  # a template that cannot render this log's messages: nothing to say
        return None
    # As generated: the previous prompt, then the reply opening its reasoning (unless the
    # prompt opened it already).
    opened = prompt_text.rfind(THINK_OPEN) > prompt_text.rfind(THINK_CLOSE)
    generated = chat.encode(prompt_text + ("" if opened else THINK_OPEN) + _REASONING,
                            add_special_tokens=False)
    rewrite = find_rewrite(chat, _dicts(messages[: n + 1]), tools, {}, generated, history)
    if rewrite is None:
        return None
    # The cost is the history after the divergence up to the next message: the turn as it is
    # rendered now, which would have been a cache hit.
    return HistoryRewrite(rewrite.assistant_turn, rewrite.diverges_at,
                          len(history) - rewrite.diverges_at)


def _assistant(message: Any) -> bool:
    return isinstance(message, dict) and message.get("role") == "assistant"


def _dicts(messages: Sequence[Any]) -> list[dict[str, Any]]:
    """Messages as templates take them: string content (text parts joined)."""
    result = []
    for message in messages:
        item = dict(message)
        content = item.get("content")
        if isinstance(content, list):
            item["content"] = "".join(part.get("text", "") for part in content
                                      if isinstance(part, dict))
        elif content is None:
            item["content"] = ""
        result.append(item)
    return result

