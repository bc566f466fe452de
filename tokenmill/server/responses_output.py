"""A response's output items, built from the model's text as it comes, with the stream events that build them
(OpenAI's Responses event sequence), and the bounded store of finished responses.

One path for both: a non-streamed response feeds its whole text at once and keeps only the items, so the two
cannot disagree. The text is split by the chat path's own machinery: the reasoning parser (thinking -> a
``reasoning`` item) and the tool-call stream (calls -> ``function_call`` items, the rest -> a ``message``).
"""

from __future__ import annotations

import uuid
from collections import OrderedDict
from typing import TYPE_CHECKING

from tokenmill.server.chat import _ToolStream

if TYPE_CHECKING:
    from tokenmill.server.serving import _Prepared


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


class OutputBuilder:
    """One response's output items and the events that stream them, fed the output's text deltas."""

    def __init__(self, prep: _Prepared) -> None:
        self.reasoning = prep.reasoning.stream() if prep.reasoning is not None else None
        self.tools = _ToolStream(prep) if prep.tool_choice is not None else None
        self.items: list[dict] = []  # finished items
        self.open: dict | None = None  # the item being written
        self.text = ""  # the open item's text (a message's, a call's arguments, the reasoning)
        self.reasoning_text = ""  # all of it, for the usage's reasoning_tokens
        self.sequence_number = 0

    def event(self, type: str, **fields) -> dict:  # noqa: A002 - OpenAI's field name
        e = {"type": type, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return e

    def feed(self, delta: str, final: bool, status: str = "completed") -> list[dict]:
        """The events this delta makes; ``final``: the output ended (``status``: the last item's)."""
        events: list[dict] = []
        thought, content = self.reasoning.feed(delta, final) if self.reasoning is not None else ("", delta)
        if thought:
            self.reasoning_text += thought
            events += self._append("reasoning", thought)
        if self.tools is None:
            if content:
                events += self._append("message", content)
        else:
            msg, _ = self.tools.delta(content, final)
            if msg.get("content"):
                events += self._append("message", msg["content"])
            for call in msg.get("tool_calls", ()):
                if "id" in call:  # a new call: its name, maybe its arguments whole
                    events += self._close("completed")
                    events += self._open({"id": _id("fc"), "type": "function_call", "status": "in_progress",
                                          "call_id": call["id"], "name": call["function"]["name"], "arguments": ""})
                events += self._append("function_call", call["function"].get("arguments") or "")
        if final:
            if not self.items and self.open is None:  # nothing came: an empty message, as OpenAI sends
                events += self._open(self._message())
            events += self._close(status)
        return events

    @staticmethod
    def _message() -> dict:
        return {"id": _id("msg"), "type": "message", "role": "assistant", "status": "in_progress", "content": []}

    def _where(self) -> dict:
        return {"item_id": self.open["id"], "output_index": len(self.items)}

    def _open(self, item: dict) -> list[dict]:
        self.open, self.text = item, ""
        events = [self.event("response.output_item.added", output_index=len(self.items), item=dict(item))]
        if item["type"] == "message":
            events.append(self.event("response.content_part.added", **self._where(), content_index=0,
                                     part=_text_part("")))
        return events

    def _append(self, kind: str, text: str) -> list[dict]:
        events = []
        if self.open is None or self.open["type"] != kind:
            events += self._close("completed")
            if kind == "function_call":  # arguments with no call open: cannot happen (a call starts with its name)
                return events
            events += self._open(self._message() if kind == "message" else
                                 {"id": _id("rs"), "type": "reasoning", "summary": [], "status": "in_progress"})
        if not text:
            return events
        self.text += text
        kind_event = {"message": "response.output_text.delta", "reasoning": "response.reasoning_text.delta",
                      "function_call": "response.function_call_arguments.delta"}[kind]
        extra = {"content_index": 0, "logprobs": []} if kind == "message" else \
            {"content_index": 0} if kind == "reasoning" else {}
        events.append(self.event(kind_event, **self._where(), **extra, delta=text))
        return events

    def _close(self, status: str) -> list[dict]:
        item = self.open
        if item is None:
            return []
        where, text = self._where(), self.text
        events = []
        if item["type"] == "message":
            events.append(self.event("response.output_text.done", **where, content_index=0, logprobs=[], text=text))
            events.append(self.event("response.content_part.done", **where, content_index=0, part=_text_part(text)))
            item = {**item, "status": status, "content": [_text_part(text)]}
        elif item["type"] == "reasoning":
            events.append(self.event("response.reasoning_text.done", **where, content_index=0, text=text))
            item = {**item, "status": "completed", "content": [{"type": "reasoning_text", "text": text}]}
        else:
            events.append(self.event("response.function_call_arguments.done", **where, name=item["name"],
                                     arguments=text))
            item = {**item, "status": "completed", "arguments": text}
        events.append(self.event("response.output_item.done", output_index=where["output_index"], item=item))
        self.items.append(item)
        self.open, self.text = None, ""
        return events


class ResponseStore:
    """The last ``size`` stored responses (least recently used out first), each with the input items that led
    to it (its whole conversation, for a previous_response_id)."""

    def __init__(self, size: int) -> None:
        if size < 0:
            raise ValueError(f"--responses-store-size must be >= 0 (0 turns storing off), got {size}")
        self.size = size
        self._entries: OrderedDict[str, tuple[dict, list[dict]]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response: dict, items: list[dict]) -> None:
        if not self.size:
            return
        self._entries[response["id"]] = (response, items)
        self._entries.move_to_end(response["id"])
        while len(self._entries) > self.size:
            self._entries.popitem(last=False)

    def get(self, response_id: str) -> tuple[dict, list[dict]] | None:
        found = self._entries.get(response_id)
        if found is not None:
            self._entries.move_to_end(response_id)
        return found

    def delete(self, response_id: str) -> bool:
        return self._entries.pop(response_id, None) is not None
