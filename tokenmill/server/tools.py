"""Tool calling: tools into the prompt, tool_choice into a constraint, the model's calls back out.

- Rendering: tools, assistant ``tool_calls`` and ``tool`` messages go to the model's own chat template
  (``tools=`` as transformers passes them). A template that knows nothing of tools (SmolLM2's) gets them
  the Hermes way inside the messages themselves: the tool signatures and the call format appended to
  the system message, earlier calls as ``<tool_call>`` blocks, results as ``<tool_response>`` blocks.
- ``tool_choice``: ``none`` renders no tools and parses nothing; ``auto`` parses the output with the
  server's ``--tool-call-parser``; ``required`` and a named function constrain the output with a JSON
  schema (structured outputs), as vLLM does: a named function's output is its arguments, ``required``'s
  an array of ``{"name", "parameters"}``.
- Parsers: ``hermes`` (``<tool_call>{"name", "arguments"}</tool_call>``: Hermes, Qwen2.5, SmolLM2) and
  ``llama3_json`` (``{"name", "parameters"}`` objects, optionally after ``<|python_tag|>``, ``;``
  separated). Text that does not parse is returned as content, never an error.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

from tokenmill.sampling_params import StructuredOutputsParams

TOOL_CALL_PARSERS = ("hermes", "llama3_json")

_HERMES_SYSTEM = (
    "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}}\n</tool_call>")


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def template_knows_tools(chat_template: str | None) -> bool:
    return bool(chat_template) and "tools" in chat_template


def messages_with_tools(messages: list[dict], tools: list[dict] | None) -> list[dict]:
    """The Hermes rendering inside plain messages, for a template without tool support."""
    out = [dict(m) for m in messages]
    for m in out:
        calls = m.pop("tool_calls", None)
        if m["role"] == "assistant" and calls:
            blocks = []
            for c in calls:
                fn = c.get("function", {}) if isinstance(c, dict) else {}
                args = fn.get("arguments", "{}")
                try:
                    args = json.loads(args) if isinstance(args, str) else args
                except json.JSONDecodeError:
                    pass
                blocks.append("<tool_call>\n" + json.dumps({"name": fn.get("name"), "arguments": args}) +
                              "\n</tool_call>")
            m["content"] = "\n".join(([m["content"]] if m.get("content") else []) + blocks)
        elif m["role"] == "tool":
            m["role"] = "user"
            m.pop("tool_call_id", None)
            m["content"] = f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"
    if tools:
        text = _HERMES_SYSTEM.format(tools="\n".join(json.dumps(t) for t in tools))
        if out and out[0]["role"] == "system":
            out[0]["content"] = (out[0].get("content") or "") + text
        else:
            out.insert(0, {"role": "system", "content": "You are a helpful assistant." + text})
    return out


def tool_choice_constraint(tools: list[dict], choice) -> tuple[StructuredOutputsParams | None, str | None]:
    """(the structured output a tool_choice forces, the named function or None)."""
    def params_schema(t: dict) -> dict:
        return t["function"].get("parameters") or {"type": "object", "properties": {}}

    if isinstance(choice, dict):
        name = choice["function"]["name"]
        match = [t for t in tools if t["function"]["name"] == name]
        if not match:
            raise ValueError(f"tool_choice names the function {name!r}, which is not in tools")
        return StructuredOutputsParams(json=params_schema(match[0])), name
    if choice == "required":
        calls = [{"type": "object", "properties": {"name": {"const": t["function"]["name"]},
                                                   "parameters": params_schema(t)},
                  "required": ["name", "parameters"], "additionalProperties": False} for t in tools]
        return StructuredOutputsParams(json={"type": "array", "minItems": 1, "items": {"anyOf": calls}}), None
    return None, None


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text
    id: str = field(default_factory=new_call_id)

    def to_openai(self, index: int | None = None) -> dict:
        d = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return d if index is None else {"index": index, **d}


def _call(obj, args_key: str) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    if isinstance(args, str):
        try:
            json.loads(args)
        except json.JSONDecodeError:
            return None
        return ToolCall(obj["name"], args)
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


_HERMES_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


def parse_hermes(text: str) -> tuple[str | None, list[ToolCall]]:
    if "<tool_call>" not in text:
        return text, []
    calls = []
    for m in _HERMES_BLOCK.finditer(text):
        try:
            call = _call(json.loads(m.group(1)), "arguments")
        except json.JSONDecodeError:
            call = None
        if call is None:
            return text, []  # malformed: all of it is content
        calls.append(call)
    content = text[: text.index("<tool_call>")].strip()
    return content or None, calls


def parse_llama3_json(text: str) -> tuple[str | None, list[ToolCall]]:
    body = text.strip()
    if body.startswith("<|python_tag|>"):
        body = body[len("<|python_tag|>"):].strip()
    if not body.startswith("{"):
        return text, []
    calls, decoder, i = [], json.JSONDecoder(), 0
    while i < len(body):
        try:
            obj, end = decoder.raw_decode(body, i)
        except json.JSONDecodeError:
            return text, []
        call = _call(obj, "parameters")
        if call is None:
            return text, []
        calls.append(call)
        i = end
        while i < len(body) and body[i] in " \n\t;":
            i += 1
    return None, calls


PARSERS = {"hermes": parse_hermes, "llama3_json": parse_llama3_json}


def parse_required(text: str) -> list[ToolCall] | None:
    """tool_choice required: the constrained JSON array of {"name", "parameters"}."""
    try:
        items = json.loads(text)
    except json.JSONDecodeError:
        return None
    calls = [_call(x, "parameters") for x in items] if isinstance(items, list) else [None]
    return None if not calls or None in calls else calls


class StreamingToolParser:
    """Content deltas and whole tool calls from an ``auto`` stream: text that could begin a tool call is
    held back; each call goes out in one delta once its block is complete (or the stream ends)."""

    def __init__(self, parser: str) -> None:
        self.parse = PARSERS[parser]
        self.start = "<tool_call>" if parser == "hermes" else None
        self.text = ""  # everything so far
        self.sent = 0  # characters of text already sent as content
        self.calls_sent = 0
        self.in_calls = False  # from the first tool call on, nothing more is content

    def feed(self, delta: str, final: bool) -> tuple[str, list[ToolCall]]:
        self.text += delta
        if self.start is None:  # llama3_json: a call is the whole output, known at the end
            if not final:
                if self.text.lstrip().startswith(("{", "<|python_tag|>")) or not self.text.strip():
                    return "", []
                out, self.sent = self.text[self.sent:], len(self.text)
                return out, []
            content, calls = self.parse(self.text) if self.sent == 0 else (None, [])
            if calls:
                return "", calls
            out, self.sent = self.text[self.sent:], len(self.text)
            return out, []
        content = ""
        if not self.in_calls:
            at = self.text.find(self.start)
            if at < 0:  # hold back a tail that may be the tag's beginning
                keep = next((k for k in range(len(self.start) - 1, 0, -1) if self.text.endswith(self.start[:k])), 0)
                upto = len(self.text) if final else len(self.text) - keep
                content, self.sent = self.text[self.sent:upto], max(self.sent, upto)
                return content, []
            content, self.sent, self.in_calls = self.text[self.sent:at], at, True
        blocks = self.text[self.sent:]
        complete = blocks.count("</tool_call>")
        if final or complete > self.calls_sent:
            _, calls = self.parse(self.text)
            if final and not calls:  # malformed: what is left was content after all
                return content + blocks, []
            new = calls[self.calls_sent: None if final else complete]
            self.calls_sent += len(new)
            return content, new
        return content, []
