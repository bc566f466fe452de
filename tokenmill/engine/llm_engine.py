"""LLMEngine: the front end of the step loop. Validate (engine/input_processor.py: once, the grammar compiled
here), hand sequences to the engine core, turn what each step produced into RequestOutputs (detokenization,
stop strings, logprobs).

The engine core (engine/core.py: scheduler, KV cache, model runner) runs in this process by default,
or with ``core_process=True`` (``--engine-core-process``) in its own process behind ZeroMQ
(engine/core_process.py); either way this class talks to it through one CoreClient (engine/core_client.py)
in the same messages (engine/messages.py), and keeps its own copy of each sequence's Request, which the
core's outputs bring up to date.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections import deque
from pathlib import Path
from typing import TYPE_CHECKING

from tokenmill.config import EngineConfig
from tokenmill.engine.core_client import CoreClient, InprocClient, make_client
from tokenmill.engine.input_processor import InputProcessor, ProcessedRequest
from tokenmill.engine.messages import EngineCoreRequest
from tokenmill.engine.messages import AbortRequests, CoreOutput, CoreState, CoreStep, StepStats
from tokenmill.engine.output_processor import OutputProcessor
from tokenmill.outputs import RequestOutput
from tokenmill.request import Request, RequestStatus
from tokenmill.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tokenmill.engine.core import EngineCore
    from tokenmill.lora.request import LoRARequest

__all__ = ["LLMEngine", "StepStats"]
logger = logging.getLogger("tokenmill")


class LLMEngine:
    def __init__(self, config: EngineConfig, *, core_process: bool = False) -> None:
        self._attach(make_client(config, core_process))

    @classmethod
    def from_core(cls, core: EngineCore) -> LLMEngine:
        """The front end of an EngineCore built elsewhere (tests assemble one around a fake runner)."""
        engine = cls.__new__(cls)
        engine._attach(InprocClient(core))
        return engine

    def _attach(self, client: CoreClient) -> None:
        self.client, self.config, self.tokenizer = client, client.config, client.tokenizer
        self.grammars = client.grammars
        self.core = client.core  # the EngineCore, or the handle on its process: for tests and tools that look inside
        info = self.info = client.info
        # the in-process core's parts (scheduler, kv_cache, runner, ...), for tests, benchmarks and tools
        for name, part in client.parts().items():
            setattr(self, name, part)
        self.model_name, self.model_path = info.model_name, Path(info.model_path)
        self.model_config, self.max_model_len = info.model_config, info.max_model_len
        self.quantization, self.kv_bytes_per_token = info.quantization, info.kv_bytes_per_token
        self.input_processor = InputProcessor(self.config, info, self.tokenizer, self.grammars)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.step_stats: deque[StepStats] = deque(maxlen=10_000)
        self.last_step_stats: list[StepStats] = []  # the steps the last step() call took in
        self._sequences: dict[str, Request] = {}  # this side's copy of every unfinished sequence
        self.num_sent = 0  # sequences sent to the core since it started (CoreState.num_added catches up)
        self._ids = itertools.count()

    @property
    def core_pid(self) -> int:
        """The process the engine core runs in (this one, or its own)."""
        return self.client.pid

    @property
    def speculative(self) -> bool:
        return self.info.speculative

    @property
    def state(self) -> CoreState:
        """The core's running and waiting counts, free KV blocks, preemptions: now for a core in this
        process, as of its last message for one in another."""
        return self.client.state()

    @property
    def num_waiting(self) -> int:
        """Sequences waiting in the core's scheduler (in another process: as of its last step, plus the
        sequences sent since)."""
        return self.state.num_waiting + self.client.num_unreported_adds

    @property
    def num_preemptions(self) -> int:
        return self.state.num_preemptions

    @property
    def _progress(self) -> dict[str, tuple[str, int]]:
        """A core process's last answer to request_table()'s question (tests wait for it)."""
        return self.client.progress

    def shutdown(self) -> None:
        """Stop the engine core's process, if it has one, and its tensor-parallel workers, if any."""
        self.client.shutdown()

    def restart_core(self) -> None:
        """A fresh engine core process in place of a dead one (``--restart-engine-core``), same config.
        The dead core's requests are gone with it (their clients got their errors)."""
        self._attach(self.client.restarted())

    def check_alive(self) -> None:
        """Raise if the engine core has died (a process of its own can die apart from this one)."""
        self.client.check_alive()

    def check_invariants(self, timeout: float = 10.0) -> None:
        """Check the KV cache's invariants in the core (AssertionError if one fails). Call it with no
        step in flight elsewhere: with the core in another process it waits for the core's answer and
        applies the steps that come before it."""
        self.client.check_invariants(lambda core_step: self.output_processor.emit(self._apply(core_step)), timeout)

    # ---- requests --------------------------------------------------------------------

    def tokenize_prompt(self, prompt: str | list[int], add_special_tokens: bool = True) -> list[int]:
        return self.input_processor.tokenize_prompt(prompt, add_special_tokens)

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, priority: int = 0, add_special_tokens: bool = True,
                    arrival_time: float | None = None, slo_tpot_ms: float | None = None,
                    kv_transfer_params: dict | None = None, cache_salt: str | None = None,
                    lora_request: LoRARequest | None = None) -> str:
        """Queue a request; raises ValueError (and queues nothing) if it is invalid or can never fit.
        ``arrival_time`` (time.perf_counter) is when it really arrived; the latencies count from it.
        ``slo_tpot_ms``: its own TPOT SLO, which steps are planned to meet while it runs (with a latency
        target set on the engine; ignored otherwise). ``kv_transfer_params``: prefill/decode disaggregation
        (kv_transfer/), {"do_remote_decode": true} on a producer, {"do_remote_prefill": true, "remote_host",
        "remote_port", "remote_request_id"} (the producer's answer) on a consumer. ``cache_salt``: its own
        prefix-cache salt (vLLM's): it shares cached KV blocks only with requests of the same salt.
        ``lora_request``: the adapter it runs with (--enable-lora; tokenmill/lora/)."""
        processed = self.input_processor.process(prompt, params, priority, add_special_tokens, slo_tpot_ms,
                                                 kv_transfer_params, cache_salt, lora_request)
        return self.add_processed(processed, request_id, arrival_time)

    def add_processed(self, request: ProcessedRequest, request_id: str | None = None,
                      arrival_time: float | None = None) -> str:
        """Queue a request the input processor has validated (``self.input_processor.process``): its n
        sequences go to the core as they are."""
        request_id = str(next(self._ids)) if request_id is None else request_id
        if request_id in self.output_processor.groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        params, ids, max_tokens = request.params, request.prompt_token_ids, request.max_tokens
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
            children.append(Request(rid, ids, child_params, self.tokenizer.stop_token_ids, max_tokens,
                                    request.priority, slo_tpot_ms=request.slo_tpot_ms, cache_salt=request.cache_salt,
                                    lora_request=request.lora_request))
        for r in children:
            r.timings.arrival = arrival
            self.client.add_request(EngineCoreRequest(
                r.request_id, ids, r.sampling_params, max_tokens, arrival, request.priority, request.slo_tpot_ms,
                request.kv_transfer_params, constraints=request.constraints, cache_salt=request.cache_salt,
                lora_request=request.lora_request))
            self._sequences[r.request_id] = r
            self.num_sent += 1
        self.output_processor.add(request_id, request.prompt, children)
        return request_id

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """End a request now; with the core in this process its KV blocks are free when this returns."""
        self._end(self.output_processor.child_ids(request_id), RequestStatus.FINISHED_ABORTED)
        return self.output_processor.abort(request_id)

    def has_unfinished_requests(self) -> bool:
        """Sequences to run, or KV transfers the core still has to see through (disaggregation: a producer's
        blocks wait for a consumer; stepping applies their end, and a core in its own process reports it)."""
        return bool(self._sequences) or self.client.has_unfinished()

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
            self.client.abort_requests(AbortRequests(ended, status.value))

    def request_table(self) -> list[dict]:
        """Every unfinished sequence: its id, state (waiting, prefill, decode, preempted), tokens computed
        (KV in the cache) of its total so far, prompt and output tokens, max tokens and arrival time. With
        the core in this process, as of now; in another, as of the core's answer to the last call (each call
        asks again), or what this side knows where the core has not answered yet."""
        progress = self.client.request_progress()
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
        for core_step in self.client.get_output():
            touched.update((g.request_id, g) for g in self._apply(core_step))
        return self.output_processor.emit(list(touched.values()))

    def _apply(self, core_step: CoreStep) -> list:
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
        return self.client.local_core("score()").prompt_logits(self.tokenize_prompt(list(token_ids)))


def _update(req: Request, out: CoreOutput) -> None:
    """Bring this side's copy of a sequence up to date with what the core reports of it."""
    req.output_token_ids.extend(out.new_token_ids)
    req.timings.token_times.extend(out.new_token_times)
    if out.first_scheduled is not None and req.timings.first_scheduled is None:
        req.timings.first_scheduled = out.first_scheduled
    req.num_preemptions = out.num_preemptions
    if out.num_cached_tokens >= 0:
        req.num_cached_tokens = out.num_cached_tokens
    if out.status is not None:
        req.status, req.stop_reason = RequestStatus(out.status), out.stop_reason
        req.timings.finished = out.finished_time
        req.pooled = out.pooled
