"""What both endpoints share: the server's limits, the model check, request -> SamplingParams, the context
check, queueing a request's prompts in the engine, and the engine's errors as HTTP errors."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel

from tokenmill.engine.async_engine import AsyncEngine
from tokenmill.engine.streams import EngineDeadError, EngineDrainingError, QueueFullError, RequestStream, SLOShedError
from tokenmill.engine.tracing import traces_endpoint
from tokenmill.sampling_params import MAX_LOGPROBS, MAX_STOP_STRINGS, InvalidParameter, SamplingParams
from tokenmill.server.chat_template import load_chat_template
from tokenmill.server.logprobs import _TokenText
from tokenmill.server.lora import REQUEST_LORA, LoRAModels
from tokenmill.server.protocol import OpenAIError, bad_request
from tokenmill.server.reasoning import check_reasoning_parser
from tokenmill.server.tool_parsers import TOOL_CALL_PARSERS

if TYPE_CHECKING:
    from tokenmill.engine.tracing import RequestTracer
    from tokenmill.sampling_params import StructuredOutputsParams
    from tokenmill.server.protocol import ChatCompletionRequest, CompletionRequest
    from tokenmill.server.reasoning import Reasoning
    from tokenmill.tokenizer import Tokenizer

GREEDY_EPS = 1e-5  # temperatures below this are greedy (as vLLM), avoiding logits / ~0 overflow
# vLLM's structured-output backend names that mean llguidance (options after ":" change nothing here)
GUIDED_BACKENDS = frozenset({"auto", "guidance", "llguidance"})

# vLLM request fields that would change the result and that this server does not implement: a 400 naming the
# field (never silently ignored) unless it is at its default. field -> (refused when its value is this, why);
# the request is passed too, for the one that depends on another field.
UNSUPPORTED: dict[str, tuple[Callable[[Any, Any], bool], str]] = {
    "use_beam_search": (lambda v, r: bool(v), "beam search is not supported"),
    "prompt_embeds": (lambda v, r: v is not None, "prompt embeddings are not supported"),
    "logits_processors": (lambda v, r: bool(v), "custom logits processors are not supported"),
    "guided_whitespace_pattern": (lambda v, r: v is not None,
                                  "a JSON whitespace pattern is not supported (JSON is written compact)"),
    "guided_decoding_backend": (lambda v, r: v is not None and v.partition(":")[0] not in GUIDED_BACKENDS,
                                "structured outputs run on llguidance here (vLLM's 'guidance' backend; 'auto' is "
                                "accepted)"),
    "spaces_between_special_tokens": (lambda v, r: v is False and r.skip_special_tokens is False,
                                      "false is not supported"),
    "return_tokens_as_token_ids": (lambda v, r: bool(v), "return_tokens_as_token_ids is not supported"),
    "prompt_logprobs": (lambda v, r: v is not None and bool(r.stream),
                        "prompt_logprobs are not available with stream=true"),
    "chat_template": (lambda v, r: v is not None, "a chat template in the request is not accepted; the server's "
                      "(--chat-template, else the model's) is used"),
    "continue_final_message": (lambda v, r: bool(v), "continue_final_message is not supported"),
    "echo": (lambda v, r: bool(v) and hasattr(r, "messages"), "echo is not supported on chat completions"),
    "structural_tag": (lambda v, r: v is not None, "structural_tag is not supported"),
    "functions": (lambda v, r: v is not None, "functions is deprecated: send tools"),
    "function_call": (lambda v, r: v is not None, "function_call is deprecated: send tool_choice"),
}
# the chat template's own variables, which chat_template_kwargs must not replace
RESERVED_TEMPLATE_VARS = frozenset({"messages", "add_generation_prompt", "tools", "documents"})


@dataclass
class ServerConfig:
    """What the HTTP layer enforces; see ``tokenmill serve --help`` for each flag."""

    served_model_names: Sequence[str] = ()  # default: the engine's model name
    api_key: str | None = None
    max_n: int = 8
    max_logprobs: int = MAX_LOGPROBS
    max_stop: int = MAX_STOP_STRINGS
    max_prompts: int = 32  # prompts in one batched /v1/completions request
    max_request_bytes: int = 1 << 20
    request_body_timeout: float = 30.0  # seconds a body may take to arrive (slowloris)
    drain_timeout: float = 30.0
    tool_call_parser: str = "hermes"  # how tool_choice auto reads calls in the output (server/tool_parsers.py)
    reasoning_parser: str | None = None  # thinking -> reasoning_content (server/reasoning.py)
    chat_template: str | None = None  # --chat-template: a Jinja file or the template itself, over the model's
    # the engine died: exit (status 1) this long after, once the failed requests got their errors
    exit_on_engine_death: bool = False
    restart_engine_core: bool = False  # instead: start a fresh engine core process and keep serving
    dashboard: bool = True  # /dashboard and the metrics history behind it (server/dashboard.py)
    request_timelines: int = 1000  # finished requests whose timelines are kept (engine/timelines.py); 0: off
    otlp_traces_endpoint: str | None = None  # OTLP/HTTP collector: a span tree per request (engine/tracing.py)
    live_replay_interval: float = 60.0  # seconds between replays of the recent traffic (server/live_replay.py); 0: off
    responses_store_size: int = 1000  # finished /v1/responses kept for previous_response_id and GET; 0: none
    lora_modules: Sequence[tuple[str, str]] = ()  # --lora-modules: (name, path) of the adapters served at startup
    chat_template_text: str | None = field(init=False, default=None, repr=False)  # chat_template's, loaded

    def __post_init__(self) -> None:
        check_reasoning_parser(self.reasoning_parser)
        if self.chat_template is not None:
            self.chat_template_text = load_chat_template(self.chat_template)
        if self.responses_store_size < 0:
            raise ValueError(f"--responses-store-size must be >= 0 (0 turns storing off), got "
                             f"{self.responses_store_size}")
        if self.request_timelines < 0:
            raise ValueError(f"request_timelines must be >= 0, got {self.request_timelines}")
        if not self.live_replay_interval >= 0:
            raise ValueError(f"--live-replay-interval must be >= 0 seconds (0 turns it off), got "
                             f"{self.live_replay_interval}")
        if self.otlp_traces_endpoint is not None:
            traces_endpoint(self.otlp_traces_endpoint)  # raises with what to give
            if not self.request_timelines:
                raise ValueError("--otlp-traces-endpoint builds each request's spans from its timeline: keep "
                                 "--request-timelines above 0")
        if not 1 <= self.max_n:
            raise ValueError(f"max_n must be >= 1, got {self.max_n}")
        if not 0 <= self.max_logprobs <= MAX_LOGPROBS:
            raise ValueError(f"max_logprobs must be in [0, {MAX_LOGPROBS}], got {self.max_logprobs}")
        if not 0 <= self.max_stop <= MAX_STOP_STRINGS:
            raise ValueError(f"max_stop must be in [0, {MAX_STOP_STRINGS}], got {self.max_stop}")
        if self.max_prompts < 1 or self.max_request_bytes < 1 or not self.request_body_timeout > 0:
            raise ValueError("max_prompts, max_request_bytes and request_body_timeout must be positive")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must not be empty")
        if self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(f"--tool-call-parser must be one of {', '.join(TOOL_CALL_PARSERS)}, "
                             f"got {self.tool_call_parser!r}")


@dataclass
class _Prepared:
    prompt_ids: list[list[int]]
    prompt_texts: list[str]
    params: SamplingParams
    max_tokens_param: str
    prompt_param: str
    streams: list[RequestStream] = field(default_factory=list)
    structured_param: str | None = None  # the field a structured-output constraint came from
    tool_choice: object = None  # chat: "auto" (parse calls), "required", a function name, or None
    tool_parser: str = "hermes"
    tools: list[dict] | None = None  # the request's (a parser types arguments by their schemas)
    reasoning: Reasoning | None = None  # how the output splits into reasoning and content
    kv_transfer_params: dict | None = None  # prefill/decode disaggregation: what the router sent
    cache_salt: str | None = None  # its own prefix-cache salt


def _usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's usage object; cached_tokens: the prompt tokens found in the prefix cache (the prefix-cache
    hits the scheduler counted for the request)."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def check_unsupported(req: BaseModel) -> None:
    """A 400 naming the first field of UNSUPPORTED that the request sets and this server cannot honour."""
    for name, (refused, why) in UNSUPPORTED.items():
        if name in type(req).model_fields and refused(getattr(req, name), req):
            raise bad_request(f"{name}: {why}", name)


def check_cache_salt(salt: str | None) -> str | None:
    if salt is not None and not salt:
        raise bad_request("cache_salt must be a non-empty string", "cache_salt")
    return salt


def truncate_prompt(ids: list[int], keep: int | None) -> list[int]:
    """vLLM's truncate_prompt_tokens: the prompt's last ``keep`` tokens."""
    return ids[-keep:] if keep is not None and len(ids) > keep else ids


def _split_prompts(prompt: str | list[str] | list[int] | list[list[int]] | None) -> list[str | list[int]]:
    if prompt is None:
        raise bad_request("prompt is required", "prompt")
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise bad_request("prompt must not be empty", "prompt")
    if isinstance(prompt[0], int):
        return [prompt]
    return list(prompt)  # list[str] or list[list[int]]


def _validation_error(exc: RequestValidationError) -> OpenAIError:
    errors = list(exc.errors())
    if not errors:
        return bad_request("invalid request")
    first = errors[0]
    loc = list(first.get("loc", ()))
    if loc and loc[0] == "body":
        loc = loc[1:]
    kind = first.get("type")
    if kind == "json_invalid":
        ctx = first.get("ctx") or {}
        pos = loc[0] if loc else "?"
        return bad_request(f"malformed JSON body (at character {pos}): {ctx.get('error', 'decode error')}", None,
                           "invalid_json")
    if not loc:
        return bad_request("a JSON request body is required" if kind == "missing" else
                           "the request body must be a JSON object", None)
    param = str(loc[0])
    if param == "messages" and len(loc) > 1 and isinstance(loc[1], int):
        param = f"messages[{loc[1]}]"
        if len(loc) > 2 and loc[2] in ("role", "content", "name"):
            param += f".{loc[2]}"
    same = [e for e in errors if list(e.get("loc", ()))[1:2] == [loc[0]]]
    msgs = list(dict.fromkeys(e.get("msg", "") for e in same))[:4]
    return bad_request(f"invalid {param!r}: {'; '.join(msgs)}", param)


class ServingBase:
    """State and checks shared by the endpoints."""

    def __init__(self, engine: AsyncEngine, config: ServerConfig) -> None:
        self.engine = engine
        self.config = config
        llm = engine.engine
        self.model_names = list(config.served_model_names) or [llm.model_name]
        self.model_name = self.model_names[0]
        self.tokenizer = llm.tokenizer
        self._templated = None if config.chat_template_text is None else \
            self.tokenizer.with_chat_template(config.chat_template_text)
        self.max_model_len = llm.max_model_len
        self.vocab_size = llm.model_config.vocab_size
        self.created = int(time.time())
        self.draining = False
        self.token_text = _TokenText(self.tokenizer)
        # (code, seconds from the request's arrival to its refusal): set by build_app to the metrics' hook
        self.on_refused: Callable[[str, float], None] | None = None
        self.tracer: RequestTracer | None = None  # --otlp-traces-endpoint: set by build_app
        self.loras = LoRAModels(getattr(llm, "info", None), self.model_names, config.lora_modules)  # (--enable-lora)

    @property
    def chat_tokenizer(self) -> Tokenizer:
        """What renders chats: the tokenizer, with --chat-template's template where one was given."""
        return self.tokenizer if self._templated is None else self._templated

    def check_serving(self, task: str | None = "generate") -> None:
        """Whether a request may start: the engine alive and admitting, and serving ``task`` (generate for the
        text endpoints; None: the pooling endpoints check their own)."""
        served = self.engine.engine.info.served.task
        if task is not None and served != task:
            raise bad_request(f"this model is served for {'embeddings' if served == 'embed' else 'scores'} "
                              f"(--task {served}): it generates no text; start another server with --task {task} "
                              "for completions", "model")
        if self.engine.error is not None:
            raise OpenAIError(500, f"the engine loop died ({self.engine.error!r}); the server cannot generate "
                              "any more and must be restarted", None, "engine_dead")
        if self.draining or not self.engine.accepting or not self.engine.is_running:
            raise OpenAIError(503, "the server is shutting down and admits no new requests", None, "draining")

    def check_model(self, model: str | None) -> str:
        """The model the request names (the base, or a LoRA adapter: start() runs it); 404 for any other."""
        REQUEST_LORA.set(None if model is None else self.loras.get(model))
        if model is None:
            return self.model_name
        if model not in self.model_names and REQUEST_LORA.get() is None:
            names = self.model_names + list(self.loras.adapters)
            raise OpenAIError(404, f"the model {model!r} does not exist; this server serves "
                              f"{', '.join(repr(m) for m in names)}", "model", "model_not_found")
        return model

    def sampling_params(self, req: CompletionRequest | ChatCompletionRequest, *, max_tokens: int | None,
                        max_tokens_param: str, logprobs: int | None, logprobs_param: str,
                        structured: StructuredOutputsParams | None = None, prompt_logprobs: int | None = None,
                        ) -> SamplingParams:
        cfg = self.config
        check_unsupported(req)
        check_cache_salt(req.cache_salt)
        n = 1 if req.n is None else req.n
        if n > cfg.max_n:
            raise bad_request(f"n={n} is above this server's limit of {cfg.max_n} (--max-n)", "n")
        if req.best_of is not None and req.best_of != n:
            raise bad_request("best_of other than n is not supported", "best_of")
        if logprobs is not None and logprobs > cfg.max_logprobs:
            raise bad_request(f"{logprobs_param}={logprobs} is above this server's limit of {cfg.max_logprobs}",
                              logprobs_param)
        prompt_logprobs = req.prompt_logprobs if prompt_logprobs is None else prompt_logprobs
        if prompt_logprobs is not None and prompt_logprobs > cfg.max_logprobs:
            raise bad_request(f"prompt_logprobs={prompt_logprobs} is above this server's limit of "
                              f"{cfg.max_logprobs}", "prompt_logprobs")
        logit_bias = None
        if req.logit_bias is not None:
            try:
                logit_bias = {int(k): v for k, v in req.logit_bias.items()}
            except ValueError:
                raise bad_request("logit_bias keys must be token ids (integers as strings)", "logit_bias") from None
            bad_ids = [t for t in logit_bias if not 0 <= t < self.vocab_size]
            if bad_ids:
                raise bad_request(f"logit_bias token id {bad_ids[0]} is outside the vocabulary "
                                  f"[0, {self.vocab_size})", "logit_bias")
        bad_ids = [t for t in req.allowed_token_ids or () if not 0 <= t < self.vocab_size]
        if bad_ids:
            raise bad_request(f"allowed_token_ids: token id {bad_ids[0]} is outside the vocabulary "
                              f"[0, {self.vocab_size})", "allowed_token_ids")
        if req.stream_options is not None and not req.stream:
            raise bad_request("stream_options is only allowed with stream=true", "stream_options")
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        if len(stop) > cfg.max_stop:
            raise bad_request(f"{len(stop)} stop strings given; at most {cfg.max_stop} are allowed", "stop")
        if any(not s for s in stop):
            raise bad_request("stop strings must not be empty", "stop")
        stop_ids = list(req.stop_token_ids or [])
        bad_ids = [t for t in stop_ids if not 0 <= t < self.vocab_size]
        if bad_ids:
            raise bad_request(f"stop token id {bad_ids[0]} is outside the vocabulary [0, {self.vocab_size})",
                              "stop_token_ids")
        temperature = 1.0 if req.temperature is None else req.temperature
        if temperature < GREEDY_EPS:
            temperature = 0.0
        top_k = 0 if req.top_k is None else req.top_k
        if top_k >= self.vocab_size:
            top_k = 0  # keeps every token: the same as off
        kwargs = dict(
            n=n, temperature=temperature, top_p=1.0 if req.top_p is None else req.top_p, top_k=top_k,
            min_p=req.min_p or 0.0, repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            presence_penalty=req.presence_penalty or 0.0, frequency_penalty=req.frequency_penalty or 0.0,
            seed=req.seed, max_tokens=max_tokens, min_tokens=req.min_tokens or 0, stop=stop,
            stop_token_ids=stop_ids, ignore_eos=bool(req.ignore_eos),
            include_stop_str_in_output=bool(req.include_stop_str_in_output),
            logprobs=logprobs, skip_special_tokens=True if req.skip_special_tokens is None else req.skip_special_tokens,
            prompt_logprobs=prompt_logprobs, logit_bias=logit_bias, allowed_token_ids=req.allowed_token_ids,
            bad_words=req.bad_words or (), structured_outputs=structured,
        )
        try:
            return SamplingParams(**kwargs)
        except InvalidParameter as e:
            param = {"max_tokens": max_tokens_param, "logprobs": logprobs_param}.get(e.param, e.param)
            raise bad_request(str(e), param) from None

    def check_context(self, ids: list[int], max_tokens: int | None, prompt_param: str, max_tokens_param: str) -> None:
        n, ctx = len(ids), self.max_model_len
        if n >= ctx:
            raise bad_request(f"the prompt has {n} tokens but this model's context is {ctx} tokens, with at least "
                              "one left for the completion; shorten the prompt", prompt_param,
                              "context_length_exceeded")
        if max_tokens is not None and n + max_tokens > ctx:
            raise bad_request(f"this model's maximum context length is {ctx} tokens, but {n + max_tokens} were "
                              f"requested ({n} in the prompt, {max_tokens} for the completion); lower "
                              f"{max_tokens_param} to at most {ctx - n}", max_tokens_param, "context_length_exceeded")

    async def start(self, prep: _Prepared, request_id: str, priority: int, arrival: float,
                    slo_ttft_ms: float | None = None, slo_tpot_ms: float | None = None, stream: bool = False,
                    headers: Mapping[str, str] | None = None) -> None:
        """Queue every prompt (all in the same engine pause); on any failure abort what was queued and
        raise an OpenAIError. ``headers``: the HTTP request's (a caller's trace context)."""
        one = len(prep.prompt_ids) == 1
        ids = [request_id] if one else [f"{request_id}-{i}" for i in range(len(prep.prompt_ids))]
        kv = {}
        if prep.kv_transfer_params is not None:
            if not one or prep.params.n != 1:
                raise bad_request("kv_transfer_params (prefill/decode disaggregation) takes one prompt and n 1",
                                  "kv_transfer_params")
            if stream and isinstance(prep.kv_transfer_params, dict) and prep.kv_transfer_params.get("do_remote_decode"):
                raise bad_request("a prefill for remote decode answers with kv_transfer_params in its body: send "
                                  "it with stream false", "stream")
            kv["kv_transfer_params"] = prep.kv_transfer_params
        if prep.cache_salt is not None:
            kv["cache_salt"] = prep.cache_salt
        if REQUEST_LORA.get() is not None:  # the adapter check_model found for this request's model field
            kv["lora_request"] = REQUEST_LORA.get()
        if self.tracer is not None:
            for rid in ids:
                self.tracer.announce(rid, arrival, headers or {}, prep.params)
        adds = [asyncio.ensure_future(self.engine.add_request(
            prompt, prep.params, rid, priority, add_special_tokens=False, arrival_time=arrival,
            slo_ttft_ms=slo_ttft_ms, slo_tpot_ms=slo_tpot_ms, **kv))
            for rid, prompt in zip(ids, prep.prompt_ids)]
        try:
            results = await asyncio.gather(*adds, return_exceptions=True)
        except BaseException:  # cancelled (client gone): the adds abort themselves when cancelled
            for t in adds:
                t.cancel()
                if t.done() and not t.cancelled() and t.exception() is None:
                    t.result().abort()
            raise
        streams = [r for r in results if isinstance(r, RequestStream)]
        errors = [r for r in results if not isinstance(r, RequestStream)]
        if errors:
            for st in streams:
                st.abort()
            if self.tracer is not None:
                for rid in ids:
                    self.tracer.withdraw(rid)
            err = self._engine_error(errors[0], prep)
            if isinstance(errors[0], (QueueFullError, SLOShedError)) and self.on_refused is not None:
                self.on_refused(err.code, time.perf_counter() - arrival)
            raise err from errors[0]
        prep.streams.extend(streams)

    def _engine_error(self, e: BaseException, prep: _Prepared) -> BaseException:
        if isinstance(e, QueueFullError):
            return OpenAIError(503, str(e), None, "overloaded", headers={"Retry-After": "1"})
        if isinstance(e, SLOShedError):
            return OpenAIError(503, str(e), None, "slo_overloaded", headers={"Retry-After": str(e.retry_after)})
        if isinstance(e, EngineDrainingError):
            return OpenAIError(503, str(e), None, "draining")
        if isinstance(e, EngineDeadError):
            return OpenAIError(500, str(e), None, "engine_dead")
        if isinstance(e, ValueError):  # the engine's own checks name the parameter (InvalidParameter)
            param = getattr(e, "param", None)
            param = {"max_tokens": prep.max_tokens_param, "prompt": prep.prompt_param,
                     "structured_outputs": prep.structured_param}.get(param, param)
            return bad_request(str(e), param)
        return e

    def kv_transfer_response(self, prep: _Prepared, request_id: str) -> dict:
        """A producer's answer to a prefill for remote decode: where the consumer pulls the KV from (vLLM's
        response field); {} for any other request."""
        kv = prep.kv_transfer_params
        address = self.engine.engine.info.kv_address
        if not kv or not kv.get("do_remote_decode") or address is None:
            return {}
        return {"kv_transfer_params": {"do_remote_prefill": True, "remote_host": address[0],
                                       "remote_port": address[1], "remote_request_id": request_id,
                                       "num_prompt_tokens": len(prep.prompt_ids[0])}}
