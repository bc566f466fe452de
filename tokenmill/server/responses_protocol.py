"""The Responses API's request (POST /v1/responses, OpenAI's and vLLM's fields) and its translation into a chat
request: input items -> chat messages, flat function tools -> chat tools, ``text.format`` -> response_format.

Items are checked here by hand rather than by a pydantic union, so a bad one is a 400 naming ``input[i]...``.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from tokenmill.server.protocol import INT32_MAX, INT32_MIN, _Request, _Strict, bad_request

MESSAGE_ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = ("input_text", "output_text")


class TextFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseText(_Strict):
    format: TextFormat | None = None
    verbosity: str | None = None


class ResponsesRequest(_Request):
    model: str | None = None
    input: str | list[dict[str, Any]] | None = None
    instructions: str | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = True
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    stream: bool | None = False
    store: bool | None = True
    previous_response_id: str | None = None
    text: ResponseText | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    reasoning: dict[str, Any] | None = None  # accepted and echoed: the model thinks as its template says
    include: list[str] | None = None
    truncation: Literal["auto", "disabled"] | None = "disabled"
    top_logprobs: int | None = Field(None, ge=0)
    max_tool_calls: int | None = Field(None, ge=1)  # OpenAI's limit on built-in tool calls: there are none here
    service_tier: str | None = None
    prompt_cache_key: str | None = None  # the prefix cache needs no key
    safety_identifier: str | None = None
    stream_options: dict[str, Any] | None = None
    # refused unless at their default (check_unsupported below)
    background: bool | None = False
    prompt: Any = None
    conversation: Any = None
    # vLLM's extensions on its ResponsesRequest
    top_k: int | None = Field(None, ge=-1)
    logit_bias: dict[str, float] | None = None
    skip_special_tokens: bool | None = True
    priority: int | None = Field(0, ge=INT32_MIN, le=INT32_MAX)
    cache_salt: str | None = None


# include values that change nothing here (no encrypted reasoning, no built-in tools)
_HARMLESS_INCLUDES = frozenset({"reasoning.encrypted_content", "code_interpreter_call.outputs",
                                "computer_call_output.output.image_url", "file_search_call.results",
                                "message.input_image.image_url", "web_search_call.action.sources",
                                "web_search_call.results"})


def check_unsupported(req: ResponsesRequest) -> None:
    """A 400 naming a field this server cannot honour."""
    if req.background:
        raise bad_request("background responses are not supported: send background false", "background")
    if req.prompt is not None:
        raise bad_request("prompt templates (prompt) are not supported: send the input itself", "prompt")
    if req.conversation is not None:
        raise bad_request("conversations are not supported: chain responses with previous_response_id",
                          "conversation")
    if req.truncation == "auto":
        raise bad_request("truncation 'auto' is not supported (an input over the context is a 400): send "
                          "'disabled'", "truncation")
    if req.top_logprobs:
        raise bad_request("top_logprobs is not supported on /v1/responses", "top_logprobs")
    refused = [i for i in req.include or () if i not in _HARMLESS_INCLUDES]
    if refused:
        raise bad_request(f"include {refused[0]!r} is not supported", "include")


def _text_of(content: Any, param: str, kinds: tuple[str, ...]) -> str:
    """A message's or an output's content as text: a string, or text parts of the given types joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{param} must be a string or a list of content parts", param)
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in kinds or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise bad_request(f"{param}[{j}]: only text content parts ({', '.join(kinds)}) are supported, got "
                              f"{kind!r}", param)
        texts.append(part["text"])
    return "".join(texts)


def _string(item: dict, key: str, param: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise bad_request(f"{param}.{key} is required and must be a string", f"{param}.{key}")
    return value


def input_items(given: str | list[dict] | None) -> list[dict]:
    """The request's input as checked items in one shape: messages ``{type: message, role, content: str}``,
    ``function_call`` and ``function_call_output`` items. Reasoning items sent back are dropped (a chat
    template does not render earlier thinking)."""
    if given is None:
        raise bad_request("input is required", "input")
    if isinstance(given, str):
        return [{"type": "message", "role": "user", "content": given}]
    items = []
    for i, item in enumerate(given):
        param = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in MESSAGE_ROLES:
                raise bad_request(f"{param}.role must be one of {', '.join(MESSAGE_ROLES)}, got {role!r}",
                                  f"{param}.role")
            items.append({"type": "message", "role": role,
                          "content": _text_of(item.get("content"), f"{param}.content", TEXT_PARTS + ("refusal",)
                                              if role == "assistant" else TEXT_PARTS)})
        elif kind == "function_call":
            items.append({"type": "function_call", **{k: _string(item, k, param)
                                                      for k in ("call_id", "name", "arguments")}})
        elif kind == "function_call_output":
            items.append({"type": "function_call_output", "call_id": _string(item, "call_id", param),
                          "output": _text_of(item.get("output"), f"{param}.output", ("input_text", "output_text"))})
        elif kind != "reasoning":
            raise bad_request(f"{param}: input items of type {kind!r} are not supported (messages, function_call, "
                              "function_call_output and reasoning are)", f"{param}.type")
    return items


def chat_messages(items: list[dict], instructions: str | None) -> list[dict]:
    """Items -> chat messages: instructions a system message first, developer messages system ones, each run of
    function calls an assistant message's tool_calls (on the assistant message just before, if any), each output
    a tool message."""
    messages = [{"role": "system", "content": instructions}] if instructions else []
    for item in items:
        kind = item["type"]
        if kind == "message":
            role = "system" if item["role"] == "developer" else item["role"]
            messages.append({"role": role, "content": item["content"]})
        elif kind == "function_call":
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            if messages and messages[-1]["role"] == "assistant":
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
    return messages


def output_as_input(output: list[dict]) -> list[dict]:
    """A stored response's output items as the next request's input items."""
    return input_items([o for o in output if o.get("type") in ("message", "function_call")])


def response_tools(tools: list[Any] | None) -> list[dict]:
    """The request's tools, checked to be function tools, in the Responses shape (echoed in the response)."""
    out, other = [], []
    for t in tools or ():
        if not isinstance(t, dict):
            raise bad_request("each tool must be an object", "tools")
        if t.get("type") != "function":
            other.append(t.get("type"))
            continue
        out.append({"type": "function", "name": t.get("name"), "description": t.get("description"),
                    "parameters": t.get("parameters"), "strict": t.get("strict")})
    if other:
        raise bad_request(f"only function tools are supported; got tools of type "
                          f"{', '.join(repr(k) for k in dict.fromkeys(other))}", "tools")
    return out


def chat_tool_choice(choice: str | dict | None) -> str | dict | None:
    """The Responses tool_choice in the chat shape."""
    if choice is None or choice in ("none", "auto", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    kind = choice.get("type") if isinstance(choice, dict) else choice
    raise bad_request(f"tool_choice must be 'none', 'auto', 'required' or {{\"type\": \"function\", \"name\": ...}}; "
                      f"got {kind!r}", "tool_choice")


def response_format(text: ResponseText | None) -> dict | None:
    """``text.format`` as the chat request's response_format (the structured-output path)."""
    fmt = text.format if text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    if fmt.json_schema is None:
        raise bad_request("text.format of type json_schema needs a schema", "text")
    schema = {"name": fmt.name or "response", "schema": fmt.json_schema}
    return {"type": "json_schema", "json_schema": {**schema, "description": fmt.description, "strict": fmt.strict}}


def chat_request_body(req: ResponsesRequest, messages: list[dict], tools: list[dict]) -> dict:
    """The chat completion request a Responses request runs as."""
    body = {"model": req.model, "messages": messages, "max_tokens": req.max_output_tokens,
            "temperature": req.temperature, "top_p": req.top_p, "stream": req.stream, "user": req.user,
            "tools": [{"type": "function", "function": {k: v for k, v in t.items() if k != "type" and v is not None}}
                      for t in tools] or None,
            "tool_choice": chat_tool_choice(req.tool_choice), "parallel_tool_calls": req.parallel_tool_calls,
            "response_format": response_format(req.text), "top_k": req.top_k, "logit_bias": req.logit_bias,
            "skip_special_tokens": req.skip_special_tokens, "priority": req.priority, "cache_salt": req.cache_salt}
    return {k: v for k, v in body.items() if v is not None}


# a chat error's param -> the Responses field it came from
CHAT_PARAMS = {"messages": "input", "max_tokens": "max_output_tokens", "response_format": "text"}


def responses_param(param: str | None) -> str | None:
    if param is None:
        return None
    head = param.split("[", 1)[0].split(".", 1)[0]
    return CHAT_PARAMS.get(head, param)
