"""InputProcessor: a request's one validation, in the front end (vLLM's InputProcessor).

It tokenizes the prompt and checks it against the vocabulary, checks the sampling, priority, SLO and
kv_transfer parameters, resolves max_tokens, checks the request can ever fit this engine (core/fits.py), and
compiles its constraints (a structured-output grammar, bad_words) once. What it produces is what the engine
core needs: an EngineCoreRequest (engine/messages.py) per sequence, which carries the compiled constraints, so the core (in this
process or across the socket, engine/core_process.py) trusts it and compiles nothing again. The runner builds
its grammar matcher from the validated grammar.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from tokenmill.core.fits import check_fits
from tokenmill.lora.request import LoRARequest
from tokenmill.sampling_params import InvalidParameter, SamplingParams
from tokenmill.structured_output import GrammarCompiler, RequestConstraints, build_constraints

if TYPE_CHECKING:
    from tokenmill.config import EngineConfig
    from tokenmill.engine.messages import CoreInfo
    from tokenmill.tokenizer import Tokenizer


@dataclass
class ProcessedRequest:
    """A validated request, before it fans out into its n sequences."""

    prompt: str | None  # the prompt's text where it was given as text (the outputs echo it)
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int  # resolved
    priority: int = 0
    slo_tpot_ms: float | None = None
    kv_transfer_params: dict | None = None
    constraints: RequestConstraints | None = None
    cache_salt: str | None = None
    lora_request: LoRARequest | None = None


class InputProcessor:
    """Validates requests against one engine: its vocabulary, context, KV cache and scheduler limits, and
    KV-transfer role. Raises InvalidParameter (a ValueError naming the field) for what the caller got wrong."""

    def __init__(self, config: EngineConfig, info: CoreInfo, tokenizer: Tokenizer, grammars: GrammarCompiler) -> None:
        self.config, self.info, self.tokenizer, self.grammars = config, info, tokenizer, grammars
        self.vocab_size, self.max_model_len = info.model_config.vocab_size, info.max_model_len

    def tokenize_prompt(self, prompt: str | list[int], add_special_tokens: bool = True) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidParameter("prompt is empty: give at least one character or token", "prompt")
            return self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
        if not isinstance(prompt, (list, tuple)) or not all(isinstance(t, int) and not isinstance(t, bool)
                                                           for t in prompt):
            raise InvalidParameter("prompt must be a string or a list of token ids", "prompt")
        if not prompt:
            raise InvalidParameter("prompt is empty: give at least one token id", "prompt")
        bad = [t for t in prompt if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidParameter(f"prompt token id {bad[0]} is outside the vocabulary "
                                   f"[0, {self.vocab_size})", "prompt")
        return list(prompt)

    def process(self, prompt: str | list[int], params: SamplingParams | None = None, priority: int = 0,
                add_special_tokens: bool = True, slo_tpot_ms: float | None = None,
                kv_transfer_params: dict | None = None, cache_salt: str | None = None,
                lora_request: LoRARequest | None = None) -> ProcessedRequest:
        """Every check a request gets, in one place and once; raises ValueError if it is invalid or can
        never fit (LLMEngine.add_request documents the arguments)."""
        params = params or SamplingParams()
        if kv_transfer_params is not None:
            check_kv_transfer_params(kv_transfer_params, self.config.kv_transfer.kv_role, params)
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise InvalidParameter(f"priority must be an integer (lower runs first), got {priority!r}", "priority")
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        if slo_tpot_ms is not None and not (isinstance(slo_tpot_ms, (int, float)) and slo_tpot_ms > 0):
            raise InvalidParameter(f"slo_tpot_ms must be positive milliseconds, got {slo_tpot_ms!r}", "slo_tpot_ms")
        if cache_salt is not None and not (isinstance(cache_salt, str) and cache_salt):
            raise InvalidParameter("cache_salt must be a non-empty string", "cache_salt")
        if lora_request is not None:
            check_lora_request(lora_request, self.config.lora.enable_lora)
        ids = self.tokenize_prompt(prompt, add_special_tokens)
        check_task(params, self.info.served.task)
        max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len - len(ids)
        if params.pooling is not None:  # pooling: the prompt alone, no token generated
            max_tokens = 0
        elif max_tokens < 1:
            raise InvalidParameter(f"prompt ({len(ids)} tokens) leaves no room to generate in the "
                                   f"{self.max_model_len}-token context", "prompt")
        info = self.info
        check_fits(len(ids), max_tokens, self.max_model_len, info.num_blocks, info.block_size, self.config.scheduler)
        constraints = build_constraints(params, self.tokenizer, self.vocab_size, self.grammars)
        return ProcessedRequest(prompt if isinstance(prompt, str) else None, ids, params, max_tokens, priority,
                                slo_tpot_ms, kv_transfer_params, constraints, cache_salt, lora_request)


def check_lora_request(lora: LoRARequest, enabled: bool) -> None:
    """Refuse an adapter where LoRA is off, or what is not a LoRARequest (its files are the core's to read)."""
    if not isinstance(lora, LoRARequest):
        raise InvalidParameter(f"lora_request must be a LoRARequest, got {type(lora).__name__}", "lora_request")
    if not enabled:
        raise InvalidParameter(f"LoRA adapter {lora.lora_name!r} asked for, but this engine serves no adapters: start "
                               "it with --enable-lora", "model")


def check_task(params: SamplingParams, task: str) -> None:
    """Refuse a request the served task does not run (engine/tasks.py)."""
    if params.pooling is None and task != "generate":
        raise InvalidParameter(f"this model is served for {'embeddings' if task == 'embed' else 'scores'} "
                               f"(--task {task}): it generates no text; start another server with --task generate "
                               "for completions", "model")
    if params.pooling is not None:
        kind = params.pooling.kind
        want = "embed" if kind == "embed" else "score"
        if task != want:
            raise InvalidParameter(f"this model is served with --task {task}: a {kind} request needs a model served "
                                   f"with --task {want}", "model")
        if params.n != 1:
            raise InvalidParameter("a pooling request has n 1", "n")


def check_kv_transfer_params(kv: dict, role: str | None, params: SamplingParams) -> None:
    """Refuse kv_transfer_params this engine cannot act on (InvalidParameter names the field)."""
    if not isinstance(kv, dict):
        raise InvalidParameter("kv_transfer_params must be an object", "kv_transfer_params")
    if kv.get("do_remote_decode"):
        if role != "producer":
            raise InvalidParameter("kv_transfer_params do_remote_decode needs a prefill instance: start this server "
                                   "with --kv-role producer", "kv_transfer_params")
        if params.max_tokens != 1 or params.n != 1:
            raise InvalidParameter("a prefill for remote decode (kv_transfer_params do_remote_decode) must have "
                                   "max_tokens 1 and n 1: the consumer generates the completion", "max_tokens")
    if kv.get("do_remote_prefill"):
        if role != "consumer":
            raise InvalidParameter("kv_transfer_params do_remote_prefill needs a decode instance: start this "
                                   "server with --kv-role consumer", "kv_transfer_params")
        missing = [k for k in ("remote_host", "remote_port", "remote_request_id") if kv.get(k) in (None, "")]
        if missing:
            raise InvalidParameter(f"kv_transfer_params do_remote_prefill needs {', '.join(missing)} (the prefill "
                                   "response's kv_transfer_params give them)", "kv_transfer_params")
