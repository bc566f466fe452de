"""LLMEngine: the front end of the step loop. Tokenize and validate, hand sequences to the engine
core, turn what each step produced into RequestOutputs (detokenization, stop strings, logprobs).

The engine core (engine/core.py: scheduler, KV cache, model runner) runs in this process by default,
or with ``core_process=True`` (``--engine-core-process``) in its own process behind ZeroMQ
(engine/core_process.py); either way this class talks to it in the same messages (engine/messages.py)
and keeps its own copy of each sequence's Request, which the core's outputs bring up to date.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import time
from collections import deque
from pathlib import Path

from tokenmill.config import EngineConfig
from tokenmill.core.fits import check_fits
from tokenmill.engine.messages import AbortRequests, AddRequest, CoreOutput, CoreState, CoreStep, StepStats
from tokenmill.engine.output_processor import OutputProcessor
from tokenmill.outputs import RequestOutput
from tokenmill.request import Request, RequestStatus
from tokenmill.sampling_params import InvalidParameter, SamplingParams
from tokenmill.structured_output import GrammarCompiler, build_constraints

__all__ = ["LLMEngine", "StepStats"]
logger = logging.getLogger("tokenmill")


class LLMEngine:
    def __init__(self, config: EngineConfig, *, core_process: bool = False) -> None:
        if core_process:
            from tokenmill.engine.core_process import CoreProcessClient
            from tokenmill.tokenizer import load_tokenizer

            # The tokenizer loads here while the core loads the model in its own process.
            core = CoreProcessClient(config)
            try:
                tokenizer = load_tokenizer(config.model)
                core.wait_ready()
            except BaseException:
                core.shutdown()
                raise
        else:
            from tokenmill.engine.builder import build_core

            core = build_core(config)
            tokenizer = core.tokenizer
        self._attach(config, core, tokenizer, core_process)

    @classmethod
    def from_core(cls, core) -> LLMEngine:  # noqa: ANN001
        """The front end of an EngineCore built elsewhere (tests assemble one around a fake runner)."""
        engine = cls.__new__(cls)
        engine._attach(core.config, core, core.tokenizer, False)
        return engine

    def _attach(self, config: EngineConfig, core, tokenizer, remote: bool) -> None:  # noqa: ANN001
        self.config, self.core, self.tokenizer, self._remote = config, core, tokenizer, remote
        info = self.info = core.info
        if remote:
            self.grammars = GrammarCompiler(tokenizer, info.model_config.vocab_size)
        else:
            self.grammars = core.grammars
            # the in-process core's parts, for tests, benchmarks and tools that look inside
            self.scheduler, self.kv_cache, self.runner = core.scheduler, core.kv_cache, core.runner
            self.device, self.dtype, self.startup = core.device, core.dtype, core.startup
        self.model_name, self.model_path = info.model_name, Path(info.model_path)
        self.model_config, self.max_model_len = info.model_config, info.max_model_len
        self.quantization, self.kv_bytes_per_token = info.quantization, info.kv_bytes_per_token
        self.output_processor = OutputProcessor(tokenizer)
        self.step_stats: deque[StepStats] = deque(maxlen=10_000)
        self.last_step_stats: list[StepStats] = []  # the steps the last step() call took in
        # a core process's, as of its last message
        self._state = getattr(core, "ready_state", None) or CoreState(num_free_blocks=info.num_blocks)
        self._sequences: dict[str, Request] = {}  # this side's copy of every unfinished sequence
        self._added_since_state = 0  # sequences sent since the last state (the waiting count's lag)
        self.num_sent = 0  # sequences sent to the core since it started (CoreState.num_added catches up)
        self._ids = itertools.count()
        self._progress: dict[str, tuple[str, int]] = {}  # a core process's last ReportRequests answer

    @property
    def core_pid(self) -> int:
        """The process the engine core runs in (this one, or its own)."""
        return self.core.process.pid if self._remote else os.getpid()

    @property
    def speculative(self) -> bool:
        return self.info.speculative

    @property
    def state(self) -> CoreState:
        """The core's running and waiting counts, free KV blocks, preemptions: now for a core in this
        process, as of its last message for one in another."""
        return self._state if self._remote else self.core.state()

    @property
    def num_waiting(self) -> int:
        """Sequences waiting in the core's scheduler (in another process: as of its last step, plus the
        sequences sent since)."""
        return self.state.num_waiting + (self._added_since_state if self._remote else 0)

    @property
    def num_preemptions(self) -> int:
        return self.state.num_preemptions

    def shutdown(self) -> None:
        """Stop the engine core's process, if it has one, and its tensor-parallel workers, if any."""
        if self._remote:
            self.core.shutdown()
        elif hasattr(self.core, "shutdown"):
            self.core.shutdown()

    def restart_core(self) -> None:
        """A fresh engine core process in place of a dead one (``--restart-engine-core``), same config.
        The dead core's requests are gone with it (their clients got their errors)."""
        if not self._remote:
            raise RuntimeError("only an engine core in its own process can be restarted (--engine-core-process)")
        from tokenmill.engine.core_process import CoreProcessClient

        self.core.shutdown()
        core = CoreProcessClient(self.config)
        try:
            core.wait_ready()
        except BaseException:
            core.shutdown()
            raise
        self._attach(self.config, core, self.tokenizer, True)

    def check_alive(self) -> None:
        """Raise if the engine core has died (a process of its own can die apart from this one)."""
        if self._remote:
            self.core.check_alive()

    def check_invariants(self, timeout: float = 10.0) -> None:
        """Check the KV cache's invariants in the core (AssertionError if one fails). Call it with no
        step in flight elsewhere: with the core in another process it waits for the core's answer and
        applies the steps that come before it."""
        if not self._remote:
            self.kv_cache.check_invariants()
            return
        self.core.check_invariants()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for core_step in self.core.step():
                self.output_processor.emit(self._apply(core_step))
                if core_step.state.invariants_checked:
                    assert core_step.state.invariant_error is None, core_step.state.invariant_error
                    return
        raise TimeoutError("the engine core did not answer the invariant check")

    # ---- requests --------------------------------------------------------------------

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
        bad = [t for t in prompt if not 0 <= t < self.model_config.vocab_size]
        if bad:
            raise InvalidParameter(f"prompt token id {bad[0]} is outside the vocabulary "
                                   f"[0, {self.model_config.vocab_size})", "prompt")
        return list(prompt)

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, priority: int = 0, add_special_tokens: bool = True,
                    arrival_time: float | None = None, slo_tpot_ms: float | None = None,
                    kv_transfer_params: dict | None = None) -> str:
        """Queue a request; raises ValueError (and queues nothing) if it is invalid or can never fit.
        ``arrival_time`` (time.perf_counter) is when it really arrived; the latencies count from it.
        ``slo_tpot_ms``: its own TPOT SLO, which steps are planned to meet while it runs (with a latency
        target set on the engine; ignored otherwise). ``kv_transfer_params``: prefill/decode disaggregation
        (kv_transfer/), {"do_remote_decode": true} on a producer, {"do_remote_prefill": true, "remote_host",
        "remote_port", "remote_request_id"} (the producer's answer) on a consumer."""
        params = params or SamplingParams()
        if kv_transfer_params is not None:
            check_kv_transfer_params(kv_transfer_params, self.config.kv_transfer.kv_role, params)
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise InvalidParameter(f"priority must be an integer (lower runs first), got {priority!r}", "priority")
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        if slo_tpot_ms is not None and not (isinstance(slo_tpot_ms, (int, float)) and slo_tpot_ms > 0):
            raise InvalidParameter(f"slo_tpot_ms must be positive milliseconds, got {slo_tpot_ms!r}", "slo_tpot_ms")
        request_id = str(next(self._ids)) if request_id is None else request_id
        if request_id in self.output_processor.groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        ids = self.tokenize_prompt(prompt, add_special_tokens)
        max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len - len(ids)
        if max_tokens < 1:
            raise InvalidParameter(f"prompt ({len(ids)} tokens) leaves no room to generate in the "
                                   f"{self.max_model_len}-token context", "prompt")
        info = self.info
        check_fits(len(ids), max_tokens, self.max_model_len, info.num_blocks, info.block_size,
                   self.config.scheduler)
        # compiled here to reject a bad grammar before anything is queued (the core compiles its own)
        build_constraints(params, self.tokenizer, self.model_config.vocab_size, self.grammars)
        arrival = time.perf_counter() if arrival_time is None else arrival_time
        children = []
        for i in range(params.n):
            child_params = params
            if params.n > 1 and params.seed is not None:
                # distinct but reproducible streams for the n samples
                child_params = dataclasses.replace(params, seed=params.seed + i)
            rid = request_id if params.n == 1 else f"{request_id}#{i}"
            if rid in self._sequences:
                raise ValueError(f"request id {rid!r} is already in use")
            children.append(Request(rid, ids, child_params, self.tokenizer.stop_token_ids, max_tokens, priority,
                                    slo_tpot_ms=slo_tpot_ms))
        for r in children:
            r.timings.arrival = arrival
            self.core.add(AddRequest(r.request_id, ids, r.sampling_params, max_tokens, arrival, priority,
                                     slo_tpot_ms, kv_transfer_params))
            self._sequences[r.request_id] = r
            self.num_sent += 1
        self._added_since_state += len(children)
        self.output_processor.add(request_id, prompt if isinstance(prompt, str) else None, children)
        return request_id

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """End a request now; with the core in this process its KV blocks are free when this returns."""
        self._end(self.output_processor.child_ids(request_id), RequestStatus.FINISHED_ABORTED)
        return self.output_processor.abort(request_id)

    def has_unfinished_requests(self) -> bool:
        """Sequences to run, or KV transfers the core still has to see through (disaggregation: a producer's
        blocks wait for a consumer; stepping applies their end, and a core in its own process reports it)."""
        if self._remote:
            return bool(self._sequences) or self._state.num_kv_held > 0
        return bool(self._sequences) or self.core.has_unfinished()

    def _end(self, child_ids: list[str], status: RequestStatus) -> None:
        """End sequences on both sides: here at once, in the core with the next message."""
        now = time.perf_counter()
        ended = []
        for cid in child_ids:
            req = self._sequences.pop(cid, None)
            if req is not None and not req.is_finished:
                req.status, req.timings.finished = status, now
                ended.append(cid)
        if ended:
            self.core.abort(AbortRequests(ended, status.value))

    def request_table(self) -> list[dict]:
        """Every unfinished sequence: its id, state (waiting, prefill, decode, preempted), tokens computed
        (KV in the cache) of its total so far, prompt and output tokens, max tokens and arrival time. With
        the core in this process, as of now; in another, as of the core's answer to the last call (each call
        asks again), or what this side knows where the core has not answered yet."""
        if self._remote:
            self.core.report_requests()
            progress = self._progress
        else:
            progress = {rid: (status, computed) for rid, status, computed in self.core.request_progress()}
        rows = []
        for rid, req in self._sequences.items():
            prompt, output = len(req.prompt_token_ids), len(req.output_token_ids)
            status, computed = progress.get(rid, (None, None))
            if status is None:  # not reported yet: what this side saw
                status = "running" if output else "waiting"
                computed = prompt + output - 1 if output else 0
            if status == "running":
                state = "prefill" if computed < prompt else "decode"
            else:
                state = "preempted" if status == "preempted" or output else "waiting"
            rows.append({"id": rid, "state": state, "computed_tokens": computed, "total_tokens": prompt + output,
                         "prompt_tokens": prompt, "output_tokens": output, "max_tokens": req.max_tokens,
                         "arrival_time": req.timings.arrival})
        return rows

    # ---- the step --------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One engine step (in another process: every step the core finished since the last call)."""
        touched: dict[str, object] = {}
        self.last_step_stats = []
        for core_step in self.core.step() if self._remote else [self.core.step()]:
            touched.update((g.request_id, g) for g in self._apply(core_step))
        return self.output_processor.emit(list(touched.values()))

    def _apply(self, core_step: CoreStep) -> list:
        self._state = core_step.state
        if core_step.state.requests is not None:
            self._progress = {rid: (status, computed) for rid, status, computed in core_step.state.requests}
        self._added_since_state = 0
        if core_step.stats is not None:
            self.step_stats.append(core_step.stats)
            self.last_step_stats.append(core_step.stats)
        updated, logprobs, prompt_logprobs = [], {}, {}
        for out in core_step.outputs:
            req = self._sequences.get(out.request_id)
            if req is None:
                continue  # ended on this side while the core ran its step
            _update(req, out)
            updated.append(req)
            if out.logprobs is not None:
                logprobs[out.request_id] = out.logprobs
            if out.prompt_logprobs is not None:
                prompt_logprobs[out.request_id] = out.prompt_logprobs
            if req.is_finished:
                del self._sequences[out.request_id]
                if out.error:
                    logger.error("request %s failed in the engine core: %s", out.request_id, out.error)
        groups, stopped = self.output_processor.process(updated, logprobs, prompt_logprobs)
        self._end(stopped, RequestStatus.FINISHED_STOPPED)  # a stop string matched: end it now
        return groups

    # ---- outside the scheduler (the core in this process only) ---------------------------

    def _local_core(self, what: str):
        if not hasattr(self, "scheduler"):
            raise RuntimeError(f"{what} needs the engine core in this process; build the engine without "
                               "--engine-core-process")
        return self.core

    def score(self, token_ids: list[int]):
        """Log-probability of each token after the first given the ones before it ([len - 1] float32):
        one prefill through the paged KV cache (so KV-cache quantization counts), outside the scheduler.
        Call it only while no request runs."""
        import torch

        logits = self.prompt_logits(token_ids)
        x = torch.tensor(list(token_ids)[1:])
        return torch.log_softmax(logits, -1).gather(1, x[:, None]).squeeze(1)

    def prompt_logits(self, token_ids: list[int]):
        """Next-token logits after each prefix of ``token_ids`` ([len - 1, vocab] float32 on the CPU;
        row i follows token_ids[: i + 1]), from one prefill as in score()."""
        return self._local_core("score()").prompt_logits(self.tokenize_prompt(list(token_ids)))


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


def _update(req: Request, out: CoreOutput) -> None:
    """Bring this side's copy of a sequence up to date with what the core reports of it."""
    req.output_token_ids.extend(out.new_token_ids)
    req.timings.token_times.extend(out.new_token_times)
    if out.first_scheduled is not None and req.timings.first_scheduled is None:
        req.timings.first_scheduled = out.first_scheduled
    req.num_preemptions = out.num_preemptions
    if out.status is not None:
        req.status, req.stop_reason = RequestStatus(out.status), out.stop_reason
        req.timings.finished = out.finished_time
