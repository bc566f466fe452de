"""OpenAI request schemas (pydantic, strict types) and the OpenAI error object.

Types are strict: a string where a number belongs is an error, not a coercion. Ranges that do
not depend on the server's configuration are checked here, so a bad field is named in the
error's ``param``; the rest (caps, context length) is checked in the handlers.
"""

from __future__ import annotations

import logging
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

logger = logging.getLogger("tokenmill.server")

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1


class OpenAIError(Exception):
    """An error the server answers with ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str | None = None, headers: dict[str, str] | None = None) -> None:  # noqa: A002
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _default_type(status)
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def _default_type(status: int) -> str:
    # OpenAI's convention: a client error is an invalid_request_error (the code says which), except a
    # missing or wrong key (authentication_error) and something that does not exist (not_found_error);
    # every server-side one is a server_error.
    if status >= 500:
        return "server_error"
    return {401: "authentication_error", 404: "not_found_error"}.get(status, "invalid_request_error")


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict:  # noqa: A002
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param, code)


class _Strict(BaseModel):
    # Unknown fields are ignored (clients send vendor extensions); known ones must have the right type.
    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="ignore")


_WARNED: set[str] = set()
_MAX_WARNED = 256  # field names remembered; beyond that new ones go unlogged (a client can send endless names)


class _Request(_Strict):
    """A request body: an unknown top-level field is accepted and ignored, as vLLM does, with one WARNING per
    field name for the life of the process (a field that would change the result is declared, and refused in the
    handler when it cannot be honoured)."""

    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="allow")

    @model_validator(mode="after")
    def _log_unknown(self) -> _Request:
        for name in self.model_extra or ():
            if name not in _WARNED and len(_WARNED) < _MAX_WARNED:
                _WARNED.add(name)
                logger.warning("ignoring unknown field %r in %s (logged once per field name)", name,
                               type(self).__name__)
        return self


class StreamOptions(_Strict):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class JsonSchemaFormat(_Strict):
    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsRequest(_Strict):
    json_schema: dict[str, Any] | str | None = Field(None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None


class _SamplingFields(_Request):
    model: str | None = None
    temperature: float | None = Field(None, ge=0, description="0 = greedy; default 1")
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, description="-1 or 0 disables top-k (vLLM extension)")
    min_p: float | None = Field(None, ge=0, le=1)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0, le=1e6)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    n: int | None = Field(1, ge=1)
    ignore_eos: bool | None = False
    min_tokens: int | None = Field(0, ge=0)
    include_stop_str_in_output: bool | None = False
    skip_special_tokens: bool | None = True
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    priority: int | None = Field(0, ge=INT32_MIN, le=INT32_MAX,
                                 description="scheduling priority (vLLM extension; lower runs first)")
    # tokenmill's extension: the request's own SLOs, over the server's --slo-ttft-ms / --slo-tpot-ms
    slo_ttft_ms: float | None = Field(None, gt=0, description="shed with 503 if the first token cannot come in time")
    slo_tpot_ms: float | None = Field(None, gt=0, description="time per output token the steps are planned to meet")
    user: str | None = None
    # vLLM's prefill/decode disaggregation field: {"do_remote_decode": true} to a producer, its answer's
    # kv_transfer_params (with "do_remote_prefill": true) to a consumer; the router sends both
    kv_transfer_params: dict[str, Any] | None = None
    logit_bias: dict[str, float] | None = None
    best_of: int | None = Field(None, ge=1)
    # vLLM's extensions: token constraints, prompt logprobs and structured outputs (old and new spelling)
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    prompt_logprobs: int | None = Field(None, ge=0)
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # vLLM's: an instance-unique salt for the prefix cache; only requests with the same salt share cached blocks
    cache_salt: str | None = None
    truncate_prompt_tokens: int | None = Field(None, ge=1, description="keep only the prompt's last N tokens")
    # vLLM fields that would change the result and are refused unless at their default (serving.py: UNSUPPORTED)
    use_beam_search: bool | None = False
    length_penalty: float | None = 1.0  # beam search's only
    spaces_between_special_tokens: bool | None = True
    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: str | None = None
    logits_processors: list[Any] | None = None
    return_tokens_as_token_ids: bool | None = None


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]] | None = None
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0)
    echo: bool | None = False
    suffix: str | None = None
    add_special_tokens: bool | None = Field(True, description="vLLM extension: BOS/EOS where the model asks")
    prompt_embeds: Any = None  # refused


class TextPart(_Strict):
    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="allow")
    type: str
    text: str | None = None


class ChatMessage(_Strict):
    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="allow")
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None


class FunctionDefinition(_Strict):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0)
    add_generation_prompt: bool | None = Field(True, description="vLLM extension")
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = True
    # vLLM's template fields: extra variables for the Jinja chat template, documents (RAG templates read them)
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[dict[str, Any]] | None = None
    add_special_tokens: bool | None = Field(False, description="BOS/EOS on top of what the template writes")
    include_reasoning: bool | None = Field(True, description="vLLM's: send reasoning_content (--reasoning-parser)")
    # refused unless at their default (serving.py: UNSUPPORTED)
    chat_template: str | None = None
    continue_final_message: bool | None = False
    echo: bool | None = False
    structural_tag: str | None = None
    functions: Any = None
    function_call: Any = None


class TokenizeRequest(_Request):
    """vLLM's POST /tokenize: a prompt (TokenizeCompletionRequest) or chat messages (TokenizeChatRequest)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: true for a prompt, false for messages (as vLLM)
    add_generation_prompt: bool | None = True
    continue_final_message: bool | None = False
    return_token_strs: bool | None = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[dict[str, Any]] | None = None
    tools: list[Tool] | None = None


class DetokenizeRequest(_Request):
    """vLLM's POST /detokenize."""

    model: str | None = None
    tokens: list[int] | None = None
