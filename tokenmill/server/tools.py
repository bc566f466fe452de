"""Tool calling: tools into the prompt and tool_choice into a constraint (the calls back out: tool_parsers.py).

- Rendering: tools, assistant ``tool_calls`` and ``tool`` messages go to the model's own chat template
  (``tools=`` as transformers passes them). A template that knows nothing of tools (SmolLM2's) gets them
  the Hermes way inside the messages themselves: the tool signatures and the call format appended to
  the system message, earlier calls as ``<tool_call>`` blocks, results as ``<tool_response>`` blocks.
- ``tool_choice``: ``none`` renders no tools and parses nothing; ``auto`` parses the output with the
  server's ``--tool-call-parser``; ``required`` and a named function constrain the output with a JSON
  schema (structured outputs), as vLLM does: a named function's output is its arguments, ``required``'s
  an array of ``{"name", "parameters"}``.
- Parsers (``hermes``, ``llama3_json``, ``mistral``, ``pythonic``, ``qwen3_xml``) are in tool_parsers.py.
"""

from __future__ import annotations

import json

from tokenmill.sampling_params import StructuredOutputsParams

_HERMES_SYSTEM = (
    "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}}\n</tool_call>")


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
