"""POST /v1/chat/completions: chat templates, tools, structured outputs, streaming deltas."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel

from tokenmill.server.protocol import ChatCompletionRequest, ChatMessage, bad_request
from tokenmill.server.reasoning import ReasoningStream, reasoning_for
from tokenmill.server.responses import SSEResponse, _sse, json_response
from tokenmill.server.serving import RESERVED_TEMPLATE_VARS, _Prepared, _usage, check_cache_salt, truncate_prompt
from tokenmill.server.streaming import _abort_all, _chunk_builder, _collect, _DeltaTracker, _merge, error_event
from tokenmill.server.structured import structured_outputs
from tokenmill.server.tool_parsers import StreamingToolParser, ToolCall, parse_required, parse_tool_calls
from tokenmill.server.tools import messages_with_tools, template_knows_tools, tool_choice_constraint

logger = logging.getLogger("tokenmill.server")


class _ToolStream:
    """One streamed choice's tool calls as OpenAI deltas, by the request's tool_choice: auto parses as
    the text comes (server/tools.py), a named function streams its arguments, required sends its
    calls when the array is complete."""

    def __init__(self, prep: _Prepared) -> None:
        self.choice = prep.tool_choice
        self.parser = StreamingToolParser(prep.tool_parser, prep.tools) if self.choice == "auto" else None
        self.text = ""
        self.count = 0  # tool calls sent
        self.named = None if self.choice in ("auto", "required") else ToolCall(self.choice, "")

    def delta(self, text: str, final: bool) -> tuple[dict, bool]:
        """(the delta message, whether this choice has called a tool so far)."""
        if self.parser is not None:
            content, calls = self.parser.feed(text, final)
            msg = {"content": content} if content else {}
            if calls:
                msg["tool_calls"] = [t.to_openai(self.count + i) for i, t in enumerate(calls)]
                self.count += len(calls)
            return msg, self.count > 0
        if self.named is not None:
            if self.count == 0:
                self.count = 1
                return {"tool_calls": [self.named.to_openai(0) | {"function": {"name": self.named.name,
                                                                             "arguments": text}}]}, True
            return ({"tool_calls": [{"index": 0, "function": {"arguments": text}}]} if text else {}), True
        self.text += text
        if not final:
            return {}, False
        calls = parse_required(self.text)
        if not calls:
            return {"content": self.text}, False
        self.count = len(calls)
        return {"tool_calls": [t.to_openai(i) for i, t in enumerate(calls)]}, True


class ChatMixin:
    """The chat endpoint; mixed into OpenAIServing."""

    async def chat_prompt_ids(self, req_messages: list[ChatMessage], tools: list[dict] | None,
                              add_generation_prompt: bool | None, template_kwargs: dict | None,
                              documents: list[dict] | None, add_special_tokens: bool) -> list[int]:
        """The prompt's token ids: the messages rendered by the model's chat template (with tools, documents
        and the request's chat_template_kwargs as template variables), as /v1/chat/completions and /tokenize
        see them. Bad messages are a 400 naming them."""
        kwargs = dict(template_kwargs or {})
        clash = sorted(RESERVED_TEMPLATE_VARS & kwargs.keys())
        if clash:
            raise bad_request(f"chat_template_kwargs must not set {', '.join(clash)}: give it as its own field",
                              "chat_template_kwargs")
        messages = []
        for i, m in enumerate(req_messages):
            if not m.role:
                raise bad_request(f"messages[{i}].role must not be empty", f"messages[{i}].role")
            content = m.content
            if isinstance(content, list):
                texts = []
                for j, part in enumerate(content):
                    if part.type != "text" or part.text is None:
                        raise bad_request(f"messages[{i}].content[{j}]: only text content parts are supported",
                                          f"messages[{i}].content")
                    texts.append(part.text)
                content = "\n".join(texts)
            # null content (allowed by OpenAI, e.g. an assistant turn) renders as empty text
            msg = {**(m.model_extra or {}), "role": m.role, "content": "" if content is None else content}
            if m.name is not None:
                msg["name"] = m.name
            messages.append(msg)
        add_gen = True if add_generation_prompt is None else add_generation_prompt
        native_tools = template_knows_tools(self.chat_tokenizer.chat_template)
        if not native_tools and (tools or any(m["role"] == "tool" or m.get("tool_calls") for m in messages)):
            messages = messages_with_tools(messages, tools)
        if native_tools and tools:
            kwargs["tools"] = tools
        if documents is not None:
            kwargs["documents"] = documents

        def render() -> list[int]:
            text = self.chat_tokenizer.apply_chat_template(messages, add_generation_prompt=add_gen, **kwargs)
            # the template holds any BOS; add_special_tokens (vLLM's, default off) adds them on top
            return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

        try:
            ids = await asyncio.to_thread(render)
        except ValueError as e:
            raise bad_request(str(e), "messages") from None
        except Exception as e:  # noqa: BLE001 - a template can fail in any way on odd input (TypeError, ...)
            raise bad_request(f"the chat template could not render these messages: {type(e).__name__}: {e}",
                              "messages") from None
        if not ids:
            raise bad_request("the chat template rendered an empty prompt", "messages")
        return ids

    async def chat_prepare(self, req: ChatCompletionRequest) -> _Prepared:
        """A chat request checked and rendered into its prompt, sampling parameters, tools and reasoning split,
        ready to start (/v1/chat/completions and /v1/responses)."""
        if req.messages is None:
            raise bad_request("messages is required", "messages")
        if not req.messages:
            raise bad_request("messages must not be empty", "messages")
        structured, structured_param = structured_outputs(req)
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
        choice = req.tool_choice
        if isinstance(choice, BaseModel):
            choice = choice.model_dump()
        if choice is not None and not tools and choice != "none":
            raise bad_request("tool_choice needs tools", "tool_choice")
        choice = choice or ("auto" if tools else None)
        if choice == "none":
            tools = None
        forced_name = None
        if tools and choice != "auto":
            if structured is not None:
                raise bad_request(f"tool_choice {choice if isinstance(choice, str) else 'with a function'} "
                                  f"cannot be combined with {structured_param}", "tool_choice")
            try:
                structured, forced_name = tool_choice_constraint(tools, choice)
            except ValueError as e:
                raise bad_request(str(e), "tool_choice") from None
            structured_param = "tools"
        if req.top_logprobs is not None and not req.logprobs:
            raise bad_request("top_logprobs needs logprobs=true", "top_logprobs")
        max_tokens, max_tokens_param = req.max_tokens, "max_tokens"
        if req.max_completion_tokens is not None:
            max_tokens, max_tokens_param = req.max_completion_tokens, "max_completion_tokens"
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        params = self.sampling_params(req, max_tokens=max_tokens, max_tokens_param=max_tokens_param,
                                      logprobs=logprobs, logprobs_param="top_logprobs", structured=structured)
        ids = await self.chat_prompt_ids(req.messages, tools, req.add_generation_prompt, req.chat_template_kwargs,
                                         req.documents, bool(req.add_special_tokens))
        ids = truncate_prompt(ids, req.truncate_prompt_tokens)
        self.check_context(ids, max_tokens, "messages", max_tokens_param)
        # an output forced to a tool call is JSON from its first token: no thinking in it
        reasoning = None if tools and choice != "auto" else reasoning_for(
            self.config.reasoning_parser, req.chat_template_kwargs, structured is not None,
            req.include_reasoning is not False)
        prep = _Prepared([ids], [""], params, max_tokens_param, "messages", structured_param=structured_param,
                         tool_choice=forced_name or (choice if tools else None), tool_parser=self.config.tool_call_parser,
                         tools=tools, reasoning=reasoning, kv_transfer_params=req.kv_transfer_params,
                         cache_salt=check_cache_salt(req.cache_salt))
        return prep

    async def chat_completions(self, req: ChatCompletionRequest, raw: Request) -> Response:
        arrival = time.perf_counter()
        self.check_serving()
        model = self.check_model(req.model)
        prep = await self.chat_prepare(req)
        params, ids = prep.params, prep.prompt_ids[0]
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        await self.start(prep, request_id, req.priority or 0, arrival, req.slo_ttft_ms, req.slo_tpot_ms,
                         stream=bool(req.stream), headers=raw.headers)
        created = int(time.time())
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return SSEResponse(self._chat_events(prep, request_id, created, model, include_usage),
                               lambda: _abort_all(prep.streams))
        finals = await _collect(prep.streams, raw)
        out = finals[0]
        choices = []
        for c in out.outputs:
            lp = {"content": self._chat_logprobs(c.token_ids, c.logprobs, params.logprobs)} \
                if c.logprobs is not None else None
            reasoning_text, text = prep.reasoning.split(c.text) if prep.reasoning is not None else (None, c.text)
            # tool calls are read from the content only, never from the thinking
            content, calls = self._tool_calls(prep, text) if text is not None else (None, [])
            message = {"role": "assistant", "content": content}
            if self.config.reasoning_parser is not None:
                message["reasoning_content"] = reasoning_text if prep.reasoning and prep.reasoning.include else None
            finish = c.finish_reason
            if calls:
                message["tool_calls"] = [t.to_openai() for t in calls]
                finish = "tool_calls" if finish == "stop" else finish
            choices.append({"index": c.index, "message": message,
                            "logprobs": lp, "finish_reason": finish, "stop_reason": c.stop_reason})
        completion_tokens = sum(len(c.token_ids) for c in out.outputs)
        extra = {}
        if req.prompt_logprobs is not None and out.prompt_logprobs is not None:  # vLLM's field, beside choices
            extra["prompt_logprobs"] = self._vllm_prompt_logprobs(out.prompt_logprobs)
        return json_response({"id": request_id, "object": "chat.completion", "created": created, "model": model,
                              "choices": choices, "usage": _usage(len(ids), completion_tokens, out.num_cached_tokens),
                              **extra, **self.kv_transfer_response(prep, request_id)})

    def _tool_calls(self, prep: _Prepared, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, tool calls) of a finished output, by the request's tool_choice."""
        choice = prep.tool_choice
        if choice is None:
            return text, []
        if choice == "auto":
            return parse_tool_calls(prep.tool_parser, text, prep.tools)
        if choice == "required":
            calls = parse_required(text)
            return (None, calls) if calls else (text, [])
        return None, [ToolCall(choice, text)]  # a named function: the output is its arguments

    async def _chat_events(self, prep: _Prepared, request_id: str, created: int, model: str,
                           include_usage: bool) -> AsyncIterator[str]:
        params = prep.params
        track = _DeltaTracker()
        chunk = _chunk_builder(request_id, "chat.completion.chunk", created, model, include_usage)

        merged = _merge(prep.streams)
        tool_streams: dict[int, _ToolStream] = {}
        reasoning_streams: dict[int, ReasoningStream] = {}
        cached = 0
        try:
            yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                          "finish_reason": None} for i in range(params.n)])
            async for _, out in merged:
                cached = out.num_cached_tokens
                for c in out.outputs:
                    d = track.delta(c.index, c)
                    if d is None:
                        continue
                    delta, new_ids, start, tstart = d
                    lp = None
                    if c.logprobs is not None:
                        lp = {"content": self._chat_logprobs(new_ids, c.logprobs[tstart:], params.logprobs)}
                    thought = ""
                    if prep.reasoning is not None:
                        rs = reasoning_streams.setdefault(c.index, prep.reasoning.stream())
                        thought, delta = rs.feed(delta, c.finished)
                        thought = thought if prep.reasoning.include else ""
                    message = {"content": delta} if delta else {}
                    called = False
                    if prep.tool_choice is not None:
                        message, called = tool_streams.setdefault(c.index, _ToolStream(prep)).delta(delta, c.finished)
                    if thought:
                        message = {"reasoning_content": thought, **message}
                    if not message and lp is None and not c.finished:
                        continue  # all of it held back (a tag's beginning)
                    choice = {"index": c.index, "delta": message, "logprobs": lp, "finish_reason": None}
                    if c.finished:
                        choice["finish_reason"] = "tool_calls" if called and c.finish_reason == "stop" else c.finish_reason
                        choice["stop_reason"] = c.stop_reason
                    yield chunk([choice])
            if include_usage:
                yield _sse({"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model,
                            "choices": [], "usage": _usage(len(prep.prompt_ids[0]), track.completion_tokens, cached)})
        except Exception as e:  # noqa: BLE001 - headers are sent: report in the stream
            yield error_event(e, request_id)
        finally:
            await merged.aclose()
        yield "data: [DONE]\n\n"
