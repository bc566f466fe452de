"""The model's tool calls read out of its text (tool_choice ``auto``, ``--tool-call-parser``; vLLM's names):

- ``hermes``: ``<tool_call>{"name", "arguments"}</tool_call>`` blocks (Hermes, Qwen2.5, SmolLM2).
- ``llama3_json``: ``{"name", "parameters"}`` objects, optionally after ``<|python_tag|>``, ``;`` separated.
- ``mistral``: ``[TOOL_CALLS]`` then a JSON list of ``{"name", "arguments"}`` (older Mistral tokenizers), or
  ``[TOOL_CALLS]name[ARGS]{...}`` per call (v11+); ids are 9 letters and digits, as Mistral's templates demand.
- ``pythonic``: a Python list of calls, ``[get_weather(city="Paris"), f(x=1)]`` (Llama 3.2 / 4), read with
  ``ast``: keyword arguments with literal values only, nothing is evaluated.
- ``qwen3_xml``: Qwen3-Coder's ``<tool_call><function=NAME><parameter=ARG>value</parameter></function>
  </tool_call>``, each value typed by the tool's JSON schema (a parameter the schema does not know stays a
  string), as vLLM's qwen3_xml / qwen3_coder parsers do.

Text that does not parse is returned as content, never an error. Streamed, the parsers with a start tag send
the content before it as it comes and each call once it is complete; the others hold an output that may be
calls until it ends.
"""

from __future__ import annotations

import ast
import json
import random
import re
import string
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

Parsed = tuple[str | None, list["ToolCall"]]


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _mistral_id() -> str:
    # Mistral's chat templates reject any tool call id that is not 9 letters and digits
    return "".join(random.choices(string.ascii_letters + string.digits, k=9))


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


def _until_last(tag: str) -> Callable[[str], int]:
    """The end of the last complete block (one closed by ``tag``), 0 if none is."""
    def complete(text: str) -> int:
        at = text.rfind(tag)
        return at + len(tag) if at >= 0 else 0
    return complete


# ---- hermes -----------------------------------------------------------------------------------------------

_HERMES_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


def parse_hermes(text: str, tools: list[dict] | None = None) -> Parsed:
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


# ---- llama3_json ------------------------------------------------------------------------------------------

def parse_llama3_json(text: str, tools: list[dict] | None = None) -> Parsed:
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


# ---- mistral ----------------------------------------------------------------------------------------------

_MISTRAL = "[TOOL_CALLS]"


def _mistral_calls(text: str) -> tuple[list[ToolCall] | None, int]:
    """(the calls after the first [TOOL_CALLS], or None if one does not parse; where the complete ones end)."""
    decoder, calls = json.JSONDecoder(), []
    at = text.find(_MISTRAL)
    end = 0
    while at >= 0:
        i = at + len(_MISTRAL)
        nxt = text.find(_MISTRAL, i)
        seg = text[i: nxt if nxt >= 0 else len(text)]
        body = seg.lstrip()
        off = i + len(seg) - len(body)
        try:
            if body.startswith("["):  # [TOOL_CALLS][{"name", "arguments"}, ...]
                items, stop = decoder.raw_decode(body)
                found = [_call(x, "arguments") for x in items] if isinstance(items, list) else [None]
            else:  # [TOOL_CALLS]name[ARGS]{...}, optionally name[CALL_ID]id[ARGS]{...}
                head, sep, args = body.partition("[ARGS]")
                name, _, call_id = head.partition("[CALL_ID]")
                if not sep or not name.strip():
                    return None, end
                obj, stop = decoder.raw_decode(args.lstrip())
                stop += len(body) - len(args.lstrip())
                found = [_call({"name": name.strip(), "arguments": obj}, "arguments")]
                if found[0] is not None and call_id.strip():
                    found[0].id = call_id.strip()
        except json.JSONDecodeError:
            return None, end
        if not found or None in found or (nxt >= 0 and body[stop:].strip()):
            return None, end  # text after the last call is dropped, as vLLM does (an EOS kept as text: </s>)
        calls += found
        end, at = off + stop, nxt
    for c in calls:
        if len(c.id) != 9 or not c.id.isalnum():
            c.id = _mistral_id()
    return calls, end


def parse_mistral(text: str, tools: list[dict] | None = None) -> Parsed:
    if _MISTRAL not in text:
        return text, []
    calls, _ = _mistral_calls(text)
    if not calls:
        return text, []
    content = text[: text.index(_MISTRAL)].strip()
    return content or None, calls


def _mistral_complete(text: str) -> int:
    # the segments that parse so far (the whole text's parse fails while the last one is still coming)
    at, end = text.find(_MISTRAL), 0
    while at >= 0:
        nxt = text.find(_MISTRAL, at + len(_MISTRAL))
        upto = nxt if nxt >= 0 else len(text)
        calls, _ = _mistral_calls(text[at:upto])
        if not calls:
            return end
        end, at = upto, nxt
    return end


# ---- pythonic ---------------------------------------------------------------------------------------------

_PY_START, _PY_END = "<|python_start|>", "<|python_end|>"  # Llama 4 wraps its calls in these


def _dotted(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        head = _dotted(node.value)
        return None if head is None else f"{head}.{node.attr}"
    return None


def parse_pythonic(text: str, tools: list[dict] | None = None) -> Parsed:
    body = text.strip()
    if body.startswith(_PY_START):
        body = body[len(_PY_START):].removesuffix(_PY_END).strip()
    if not (body.startswith("[") and body.endswith("]")):
        return text, []
    try:
        tree = ast.parse(body, mode="eval")
    except (SyntaxError, ValueError, RecursionError):
        return text, []
    if not isinstance(tree.body, ast.List) or not tree.body.elts:
        return text, []
    calls = []
    for node in tree.body.elts:
        name = _dotted(node.func) if isinstance(node, ast.Call) else None
        if name is None or node.args or any(kw.arg is None for kw in node.keywords):
            return text, []  # positional or **arguments: not a call we can name the arguments of
        try:  # literal values only: nothing is evaluated
            args = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords}
            calls.append(ToolCall(name, json.dumps(args, ensure_ascii=False)))
        except (ValueError, TypeError, SyntaxError, RecursionError):
            return text, []
    return None, calls


# ---- qwen3_xml --------------------------------------------------------------------------------------------

_QWEN3_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)
_QWEN3_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)(?:</function>|$)", re.DOTALL)
_QWEN3_PARAM = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|$)", re.DOTALL)


def _schema_of(tools: list[dict] | None, name: str) -> dict:
    for t in tools or ():
        fn = t.get("function") or {}
        if fn.get("name") == name:
            return (fn.get("parameters") or {}).get("properties") or {}
    return {}


def _typed(value: str, schema: dict | None):
    """A parameter's text as its schema's type, as vLLM's qwen3 parsers convert it."""
    if value.lower() == "null":
        return None
    if schema is None:  # a parameter the tool does not declare: as written
        return value
    kind = schema.get("type", "string")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "string")
    kind = str(kind).lower()
    try:
        if kind in ("string", "str", "text", "varchar", "char", "enum"):
            return value
        if kind.startswith(("int", "uint", "long", "short", "unsigned")):
            return int(value)
        if kind.startswith(("num", "float", "double")):
            f = float(value)
            return int(f) if f.is_integer() and "." not in value and "e" not in value.lower() else f
        if kind in ("boolean", "bool", "binary"):
            return value.lower() == "true"
    except (ValueError, OverflowError):
        return value
    try:  # object, array, anything else: JSON, else a Python literal, else the text
        return json.loads(value)
    except json.JSONDecodeError:
        try:
            return ast.literal_eval(value)
        except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
            return value


def parse_qwen3_xml(text: str, tools: list[dict] | None = None) -> Parsed:
    if "<tool_call>" not in text:
        return text, []
    calls = []
    for block in _QWEN3_CALL.finditer(text):
        fn = _QWEN3_FUNCTION.search(block.group(1))
        if fn is None:
            return text, []
        name, schema = fn.group(1).strip(), _schema_of(tools, fn.group(1).strip())
        args = {}
        for p in _QWEN3_PARAM.finditer(fn.group(2)):
            value = p.group(2).removeprefix("\n").removesuffix("\n")
            args[p.group(1).strip()] = _typed(value, schema.get(p.group(1).strip()))
        try:
            calls.append(ToolCall(name, json.dumps(args, ensure_ascii=False)))
        except (TypeError, ValueError):  # a literal JSON cannot hold (a set, bytes)
            return text, []
    content = text[: text.index("<tool_call>")].strip()
    return content or None, calls


# ---- the registry -----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ToolParser:
    parse: Callable[[str, list[dict] | None], Parsed]
    start: str | None = None  # the tag that opens the calls: content before it streams as it comes
    leads: tuple[str, ...] = ()  # no start tag: an output that begins so may be calls, held until it ends
    complete: Callable[[str], int] | None = None  # where the complete calls end (streamed early)


TOOL_PARSERS: dict[str, ToolParser] = {
    "hermes": ToolParser(parse_hermes, "<tool_call>", complete=_until_last("</tool_call>")),
    "llama3_json": ToolParser(parse_llama3_json, leads=("{", "<|python_tag|>")),
    "mistral": ToolParser(parse_mistral, _MISTRAL, complete=_mistral_complete),
    "pythonic": ToolParser(parse_pythonic, leads=("[", _PY_START)),
    "qwen3_xml": ToolParser(parse_qwen3_xml, "<tool_call>", complete=_until_last("</tool_call>")),
}
TOOL_CALL_PARSERS = tuple(TOOL_PARSERS)


def parse_tool_calls(parser: str, text: str, tools: list[dict] | None = None) -> Parsed:
    return TOOL_PARSERS[parser].parse(text, tools)


def parse_required(text: str) -> list[ToolCall] | None:
    """tool_choice required: the constrained JSON array of {"name", "parameters"}."""
    try:
        items = json.loads(text)
    except json.JSONDecodeError:
        return None
    calls = [_call(x, "parameters") for x in items] if isinstance(items, list) else [None]
    return None if not calls or None in calls else calls


def _partial_tail(text: str, tag: str) -> int:
    """The length of text's longest tail that is a proper beginning of tag (it may become the tag)."""
    return next((k for k in range(min(len(tag) - 1, len(text)), 0, -1) if text.endswith(tag[:k])), 0)


class StreamingToolParser:
    """Content deltas and whole tool calls from an ``auto`` stream: text that could begin a tool call is
    held back; each call goes out in one delta once it is complete (or the stream ends)."""

    def __init__(self, parser: str, tools: list[dict] | None = None) -> None:
        self.p = TOOL_PARSERS[parser]
        self.tools = tools
        self.text = ""  # everything so far
        self.sent = 0  # characters of text already sent as content
        self.calls_sent = 0
        self.in_calls = False  # from the first tool call on, nothing more is content

    def feed(self, delta: str, final: bool) -> tuple[str, list[ToolCall]]:
        self.text += delta
        p = self.p
        if p.start is None:  # the calls are the whole output, known at the end
            head = self.text.lstrip()
            maybe = self.sent == 0 and any(head.startswith(x) or x.startswith(head) for x in p.leads)
            if not final:
                if maybe:
                    return "", []
                out, self.sent = self.text[self.sent:], len(self.text)
                return out, []
            _, calls = p.parse(self.text, self.tools) if maybe else (None, [])
            if calls:
                return "", calls
            out, self.sent = self.text[self.sent:], len(self.text)
            return out, []
        content = ""
        if not self.in_calls:
            at = self.text.find(p.start)
            if at < 0:  # hold back a tail that may be the tag's beginning
                upto = len(self.text) - (0 if final else _partial_tail(self.text, p.start))
                content, self.sent = self.text[self.sent:upto], max(self.sent, upto)
                return content, []
            content, self.sent, self.in_calls = self.text[self.sent:at], at, True
        if final:
            _, calls = p.parse(self.text, self.tools)
            if not calls:  # malformed: what is left was content after all, unless calls went out already
                return (content, []) if self.calls_sent else (content + self.text[self.sent:], [])
        else:
            end = p.complete(self.text) if p.complete is not None else 0
            _, calls = p.parse(self.text[:end], self.tools) if end > self.sent else (None, [])
        new = calls[self.calls_sent:]
        self.calls_sent += len(new)
        return content, new
