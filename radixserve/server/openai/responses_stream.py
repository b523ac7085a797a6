"""A response's output items as they grow, and the Responses stream events that say so, each
with its `sequence_number`: a reasoning item (its reasoning_text part's deltas), a message item
(its output_text part's deltas) and function_call items (their arguments' deltas), opened and
closed in order. A non-streamed response builds the
same items in one go, so both forms carry the same output.
"""

from __future__ import annotations

import uuid
from typing import Any

from radixserve.server.transport import sse


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class OutputEvents:
    """The output list and the event stream of one response."""

    def __init__(self) -> None:
        self.output: list[dict[str, Any]] = []
        self.sequence = 0
        self._open: dict[str, Any] | None = None  # the item still growing
        self._calls: dict[int, dict[str, Any]] = {}  # call index -> its item

    def event(self, kind: str, **fields: Any) -> bytes:
        body = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return sse(body, event=kind)

    def _add(self, item: dict[str, Any]) -> bytes:
        self.output.append(item)
        self._open = item
        return self.event("response.output_item.added", output_index=len(self.output) - 1,
                          item=item)

    def text(self, delta: str, logprobs: list[dict[str, Any]] | None = None,
             item_id: str | None = None) -> bytes:
        """Adds text to the open message item (opening one first if needed)."""
        events = b""
        item = self._open
        if item is None or item["type"] != "message":
            events += self.close()
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            item = {"id": item_id or _id("msg"), "type": "message", "role": "assistant",
                    "status": "in_progress", "content": [part]}
            events += self._add(item)
            events += self.event("response.content_part.added", item_id=item["id"],
                                 output_index=len(self.output) - 1, content_index=0,
                                 part={**part})
        part = item["content"][0]
        part["text"] += delta
        part["logprobs"].extend(logprobs or [])
        if delta or logprobs:
            events += self.event("response.output_text.delta", item_id=item["id"],
                                 output_index=len(self.output) - 1, content_index=0,
                                 delta=delta, logprobs=logprobs or [])
        return events

    def reasoning(self, delta: str, item_id: str | None = None) -> bytes:
        """Adds text to the open reasoning item (opening one first if needed): the model's
        reasoning as it wrote it, a `reasoning_text` part; no summary is made of it."""
        events = b""
        item = self._open
        if item is None or item["type"] != "reasoning":
            events += self.close()
            part = {"type": "reasoning_text", "text": ""}
            item = {"id": item_id or _id("rs"), "type": "reasoning", "status": "in_progress",
                    "summary": [], "content": [part]}
            events += self._add(item)
            events += self.event("response.content_part.added", item_id=item["id"],
                                 output_index=len(self.output) - 1, content_index=0,
                                 part={**part})
        item["content"][0]["text"] += delta
        if delta:
            events += self.event("response.reasoning_text.delta", item_id=item["id"],
                                 output_index=len(self.output) - 1, content_index=0,
                                 delta=delta)
        return events

    def call(self, index: int, name: str | None, arguments: str,
             ids: tuple[str, str] | None = None) -> bytes:
        """Starts call `index` (when `name` is given) or adds to its arguments."""
        events = b""
        if name is not None:
            events += self.close()
            item_id, call_id = ids or (_id("fc"), _id("call"))
            item = {"id": item_id, "type": "function_call", "status": "in_progress",
                    "call_id": call_id, "name": name, "arguments": ""}
            self._calls[index] = item
            events += self._add(item)
        item = self._calls[index]
        item["arguments"] += arguments
        if arguments:
            events += self.event("response.function_call_arguments.delta", item_id=item["id"],
                                 output_index=self.output.index(item), delta=arguments)
        return events

    def close(self, status: str = "completed") -> bytes:
        """Closes the open item with its done events."""
        item, self._open = self._open, None
        if item is None:
            return b""
        index = self.output.index(item)
        item["status"] = status
        events = b""
        if item["type"] == "message":
            part = item["content"][0]
            events += self.event("response.output_text.done", item_id=item["id"],
                                 output_index=index, content_index=0, text=part["text"],
                                 logprobs=part["logprobs"])
            events += self.event("response.content_part.done", item_id=item["id"],
                                 output_index=index, content_index=0, part=part)
        elif item["type"] == "reasoning":
            part = item["content"][0]
            events += self.event("response.reasoning_text.done", item_id=item["id"],
                                 output_index=index, content_index=0, text=part["text"])
            events += self.event("response.content_part.done", item_id=item["id"],
                                 output_index=index, content_index=0, part=part)
        else:
            events += self.event("response.function_call_arguments.done", item_id=item["id"],
                                 output_index=index, name=item["name"],
                                 arguments=item["arguments"])
        return events + self.event("response.output_item.done", output_index=index, item=item)

    def finish(self, status: str) -> bytes:
        """Closes the last item; an output with no item at all gets an empty message."""
        events = b"" if self.output else self.text("")
        return events + self.close(status)


def replay(body: dict[str, Any]) -> list[bytes]:
    """A finished response's stream, rebuilt from its body (GET with stream=true): each item's
    events with its whole text or arguments as one delta."""
    events = OutputEvents()
    shell = {**body, "status": "in_progress", "output": [], "usage": None}
    out = [events.event("response.created", response=shell),
           events.event("response.in_progress", response=shell)]
    for item in body.get("output", []):
        if item["type"] == "message":
            part = item["content"][0] if item["content"] else {"text": "", "logprobs": []}
            out.append(events.text(part["text"], part.get("logprobs"), item["id"]))
        elif item["type"] == "reasoning":
            text = "".join(part["text"] for part in item.get("content") or [])
            out.append(events.reasoning(text, item["id"]))
        else:
            out.append(events.call(len(events.output), item["name"], item["arguments"],
                                   (item["id"], item["call_id"])))
        out.append(events.close(item.get("status", "completed")))
    kind = "response.completed" if body["status"] == "completed" else "response.incomplete"
    out.append(events.event(kind, response=body))
    return out
