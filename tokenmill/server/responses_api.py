"""POST /v1/responses (OpenAI's Responses API, as vLLM serves it), GET and DELETE /v1/responses/{id}.

A Responses request runs as a chat completion: its items become chat messages (responses_protocol.py), the chat
path renders them with the tools and starts the request, and the output is split into reasoning, message and
function_call items (responses_output.py). Finished responses are kept in a bounded LRU store
(``--responses-store-size``) for ``previous_response_id`` and GET; ``store: false`` ones are not.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from tokenmill.engine.streams import EngineDeadError
from tokenmill.server.protocol import ChatCompletionRequest, OpenAIError, bad_request
from tokenmill.server.responses import SSEResponse, _dumps, json_response
from tokenmill.server.responses_output import OutputBuilder, ResponseStore
from tokenmill.server.responses_protocol import (
    chat_messages,
    chat_request_body,
    check_unsupported,
    input_items,
    output_as_input,
    response_tools,
    responses_param,
)
from tokenmill.server.serving import _validation_error
from tokenmill.server.streaming import _abort_all, _collect

if TYPE_CHECKING:
    from fastapi import Request
    from fastapi.responses import Response

    from tokenmill.outputs import CompletionOutput, RequestOutput
    from tokenmill.server.responses_protocol import ResponsesRequest
    from tokenmill.server.serving import _Prepared


logger = logging.getLogger("tokenmill.server")


def _status(finish_reason: str | None) -> str:
    return {"length": "incomplete", "abort": "cancelled"}.get(finish_reason, "completed")


class ResponsesMixin:
    """The Responses endpoints; mixed into OpenAIServing (beside ChatMixin, whose chat_prepare it runs)."""

    _responses_store: ResponseStore | None = None

    @property
    def responses_store(self) -> ResponseStore:
        if self._responses_store is None:
            self._responses_store = ResponseStore(self.config.responses_store_size)
        return self._responses_store

    def stored_response(self, response_id: str) -> dict:
        found = self.responses_store.get(response_id)
        if found is None:
            raise OpenAIError(404, f"Response with id {response_id!r} not found.", "response_id", "not_found")
        return found[0]

    def delete_response(self, response_id: str) -> dict:
        if not self.responses_store.delete(response_id):
            raise OpenAIError(404, f"Response with id {response_id!r} not found.", "response_id", "not_found")
        return {"id": response_id, "object": "response", "deleted": True}

    async def create_response(self, req: ResponsesRequest, raw: Request) -> Response:
        arrival = time.perf_counter()
        self.check_serving()
        model = self.check_model(req.model)
        check_unsupported(req)
        tools = response_tools(req.tools)
        items = input_items(req.input)
        if req.previous_response_id is not None:
            if not self.responses_store.size:
                raise bad_request("previous_response_id needs stored responses, and storing is off on this server "
                                  "(--responses-store-size 0)", "previous_response_id")
            found = self.responses_store.get(req.previous_response_id)
            if found is None:
                raise OpenAIError(404, f"Previous response with id {req.previous_response_id!r} not found.",
                                  "previous_response_id", "previous_response_not_found")
            previous, previous_items = found
            items = previous_items + output_as_input(previous["output"]) + items
        try:
            chat = ChatCompletionRequest.model_validate(
                chat_request_body(req, chat_messages(items, req.instructions), tools))
            prep = await self.chat_prepare(chat)
            response_id = f"resp_{uuid.uuid4().hex}"  # the engine's request id too (its timeline's)
            await self.start(prep, response_id, req.priority or 0, arrival, stream=bool(req.stream),
                             headers=raw.headers)
        except ValidationError as e:
            raise self._renamed(_validation_error(RequestValidationError(e.errors()))) from None
        except OpenAIError as e:
            raise self._renamed(e) from None
        base = self._response_base(req, response_id, model, prep, tools)
        store = bool(req.store) and self.responses_store.size > 0
        if req.stream:
            return SSEResponse(self._response_events(prep, base, items, store), lambda: _abort_all(prep.streams))
        out = (await _collect(prep.streams, raw))[0]
        c = out.outputs[0]
        builder = OutputBuilder(prep)
        builder.feed(c.text, True, _item_status(c))
        response = self._finished(base, builder, out, c, len(prep.prompt_ids[0]))
        if store and response["status"] != "cancelled":
            self.responses_store.put(response, items)
        return json_response(response)

    @staticmethod
    def _renamed(e: OpenAIError) -> OpenAIError:
        """A chat path's error, naming the Responses field instead of the chat one."""
        param = responses_param(e.param)
        message = e.message.replace("max_tokens", "max_output_tokens") if param == "max_output_tokens" else e.message
        return OpenAIError(e.status, message, param, e.code, e.type, e.headers)

    def _response_base(self, req: ResponsesRequest, response_id: str, model: str, prep: _Prepared,
                       tools: list[dict]) -> dict:
        """The response object before its output: the request's settings echoed as OpenAI echoes them."""
        text = req.text.model_dump(by_alias=True, exclude_none=True) if req.text is not None else {}
        return {"id": response_id, "object": "response", "created_at": int(time.time()), "status": "in_progress",
                "background": False, "error": None, "incomplete_details": None, "instructions": req.instructions,
                "max_output_tokens": req.max_output_tokens, "max_tool_calls": req.max_tool_calls, "model": model,
                "output": [], "parallel_tool_calls": req.parallel_tool_calls is not False,
                "previous_response_id": req.previous_response_id,
                "reasoning": req.reasoning or {"effort": None, "summary": None},
                "service_tier": req.service_tier or "auto", "store": req.store is not False,
                "temperature": prep.params.temperature, "text": {"format": {"type": "text"}, **text},
                "tool_choice": req.tool_choice or "auto", "tools": tools, "top_logprobs": 0,
                "top_p": prep.params.top_p, "truncation": req.truncation or "disabled", "usage": None,
                "user": req.user, "metadata": req.metadata or {}}

    def _finished(self, base: dict, builder: OutputBuilder, out: RequestOutput, c: CompletionOutput,
                  input_tokens: int) -> dict:
        status = _status(c.finish_reason)
        reasoning_tokens = len(self.tokenizer.encode(builder.reasoning_text, add_special_tokens=False)) \
            if builder.reasoning_text else 0
        output_tokens = len(c.token_ids)
        # cache_write_tokens (OpenAI's billing of cache writes; the client's types require it): nothing is billed
        usage = {"input_tokens": input_tokens,
                 "input_tokens_details": {"cached_tokens": out.num_cached_tokens, "cache_write_tokens": 0},
                 "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
                 "total_tokens": input_tokens + output_tokens}
        return {**base, "status": status, "output": builder.items, "usage": usage,
                "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None}

    async def _response_events(self, prep: _Prepared, base: dict, items: list[dict], store: bool
                               ) -> AsyncIterator[str]:
        builder = OutputBuilder(prep)
        yield _event(builder.event("response.created", response=base))
        yield _event(builder.event("response.in_progress", response=base))
        sent = 0
        try:
            async for out in prep.streams[0]:
                c = out.outputs[0]
                delta, sent = c.text[sent:], len(c.text)
                for e in builder.feed(delta, c.finished, _item_status(c)):
                    yield _event(e)
                if c.finished:
                    response = self._finished(base, builder, out, c, len(prep.prompt_ids[0]))
                    if store and response["status"] != "cancelled":
                        self.responses_store.put(response, items)
                    # response.completed also when incomplete (its status says so), as vLLM sends it: the official
                    # client's stream helper takes its final response only from response.completed
                    yield _event(builder.event("response.completed", response=response))
                    return
        except Exception as e:  # noqa: BLE001 - headers are sent: report in the stream, as OpenAI does
            if isinstance(e, EngineDeadError):
                err = OpenAIError(500, str(e), None, "engine_dead")
            else:
                logger.error("response stream %s failed: %r", base["id"], e, exc_info=e)
                err = OpenAIError(500, f"internal server error: {type(e).__name__}", None, "internal_error")
            yield _event(builder.event("error", code=err.code, message=err.message, param=err.param))


def _item_status(c: CompletionOutput) -> str:
    return "incomplete" if c.finish_reason == "length" else "completed"


def _event(e: dict) -> str:
    return f"event: {e['type']}\ndata: {_dumps(e)}\n\n"
