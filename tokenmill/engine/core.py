"""EngineCore: the step loop's engine, schedule -> run the model -> apply, and nothing else."""

from __future__ import annotations

import collections
import logging
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

_t = time.perf_counter()
import torch  # noqa: E402 -- timed: the first startup phase

TORCH_IMPORT_S = time.perf_counter() - _t

from tokenmill.config import EngineConfig  # noqa: E402
from tokenmill.core.kv_cache import KVCacheManager  # noqa: E402
from tokenmill.core.scheduler import Scheduler  # noqa: E402
from tokenmill.core.sched_output import ModelRunnerOutput  # noqa: E402
from tokenmill.perf.step_cost import StepShape  # noqa: E402
from tokenmill.engine.messages import AbortRequests, CoreInfo, CoreOutput, CoreState, CoreStep, StepStats  # noqa: E402
from tokenmill.lora.manager import lora_salt  # noqa: E402
from tokenmill.request import Request, RequestStatus  # noqa: E402
from tokenmill.perf.cost import step_bytes, step_flops  # noqa: E402
from tokenmill.spec_decode.stats import step_acceptance  # noqa: E402
from tokenmill.spec_decode.step import propose_drafts  # noqa: E402
from tokenmill.structured_output import GrammarCompiler  # noqa: E402

if TYPE_CHECKING:
    from tokenmill.config import ModelConfig
    from tokenmill.spec_decode.step import Drafter
    from tokenmill.engine.messages import EngineCoreRequest
    from tokenmill.tokenizer import Tokenizer

logger = logging.getLogger("tokenmill")
# The failure tests' hook: the model runner raises at this step of the engine core (1-based).
FAULT_ENV = "TOKENMILL_FAULT_AT_STEP"
KV_POLL_S = 0.005  # with only KV transfers pending, how long a step waits for one to end (or for a request)


def device_uuid(device: torch.device) -> str | None:
    """A GPU's UUID as NVML spells it ("GPU-..."), or None."""
    if device.type != "cuda":
        return None
    uuid = getattr(torch.cuda.get_device_properties(device), "uuid", None)
    return None if uuid is None else f"GPU-{uuid}"


class InjectedFault(RuntimeError):
    """Raised by the runner at step $TOKENMILL_FAULT_AT_STEP (tests of the failure path)."""


class StartupPhases:
    """Times the engine's startup phases and logs each at debug level (``--log-level debug``) with the
    process's peak resident memory so far: where a slow or large start goes."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {"import torch": TORCH_IMPORT_S}
        self._t = time.perf_counter()
        logger.debug("startup: import torch %.3f s", TORCH_IMPORT_S)

    def __call__(self, name: str) -> None:
        now = time.perf_counter()
        self.seconds[name] = now - self._t
        self._t = now
        try:
            import resource

            peak = f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB"
        except ImportError:  # not on this platform
            peak = "?"
        logger.debug("startup: %s %.3f s (peak resident %s)", name, self.seconds[name], peak)


@dataclass
class CoreParts:
    """What an engine core runs on: the model's description and tokenizer, the KV cache and the scheduler over
    it, the model runner (or anything with its interface), the grammar compiler, what the core reports about
    itself (``info``, the weight and KV bytes a step's figures count), the executor (executor/) and KV connector
    where there are ones (the core stops them at shutdown), and the speculative drafter, which proposes each
    step's drafts after the last one's tokens are applied (spec_decode/step.py)."""

    model_config: ModelConfig
    tokenizer: Tokenizer
    max_model_len: int
    kv_cache: KVCacheManager
    scheduler: Scheduler
    runner: Any
    grammars: GrammarCompiler
    info: CoreInfo
    weight_bytes: int = 0
    kv_bytes_per_token: int = 0
    executor: Any = None
    kv_connector: Any = None
    startup: StartupPhases | None = None
    device: torch.device | None = None  # where the model runs, and its compute dtype (for tools that look inside)
    dtype: torch.dtype | None = None
    proposer: Drafter | None = None


class EngineCore:
    """The scheduler, the KV cache and the model runner: requests in, one step's new tokens out.

    Nothing here tokenizes or detokenizes; the front end (LLMEngine) does, in this process or in
    the API server's (engine/core_process.py).
    """

    def __init__(self, config: EngineConfig, parts: CoreParts) -> None:
        """Holds its parts (engine/builder.py ``build_core`` makes them from a config; tests assemble them
        around a fake runner) and starts the step loop's bookkeeping."""
        self.config = config
        self.model_config, self.tokenizer, self.max_model_len = parts.model_config, parts.tokenizer, parts.max_model_len
        self.kv_cache, self.scheduler, self.runner, self.grammars = parts.kv_cache, parts.scheduler, parts.runner, parts.grammars
        self.info, self.weight_bytes, self.kv_bytes_per_token = parts.info, parts.weight_bytes, parts.kv_bytes_per_token
        self.executor, self.kv_connector, self.startup = parts.executor, parts.kv_connector, parts.startup
        self.device, self.dtype = parts.device, parts.dtype
        self.proposer = parts.proposer  # (the scheduler tells it when a request ends: core/assembly.py)
        self.start_loop()

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers and the KV connector, if any."""
        if getattr(self, "executor", None) is not None:
            self.executor.shutdown()
        if getattr(self, "kv_connector", None) is not None:
            self.kv_connector.shutdown()

    def start_loop(self) -> None:
        """The step loop's own bookkeeping."""
        self._sent: dict[str, int] = {}  # request id -> output tokens already reported
        self._busy = 0.0  # seconds spent in steps
        self._steps = 0
        self._num_added = 0  # sequences added since start (the front end matches its admissions to it)
        self._idle = False  # the last step computed nothing (with transfers pending, the next one waits)
        # pipeline parallelism: the steps in flight, oldest first (_pipelined_step), and the time of the
        # calls that only launched one
        self._batches = collections.deque() if self.scheduler.lanes > 1 else None
        self._launch_s = 0.0
        # Fault injection for the failure tests: a step raises as a failing forward pass would.
        fault = os.environ.get(FAULT_ENV)
        self._fault_step = int(fault) if fault else None

    # ---- requests --------------------------------------------------------------------

    def add(self, msg: EngineCoreRequest) -> None:
        """Queue one sequence as the front end's input processor validated it (engine/input_processor.py), its
        constraints compiled: nothing is compiled again here (the scheduler keeps its own guard on ids and fit)."""
        self._num_added += 1
        lora, salt = getattr(self.runner, "lora", None), msg.cache_salt
        if msg.lora_request is not None:  # loaded here (a clear ValueError if it cannot run), held until it ends
            if lora is None:
                raise ValueError(f"LoRA adapter {msg.lora_request.lora_name!r} asked for, but this engine serves no "
                                 "adapters: start it with --enable-lora")
            salt = lora_salt(lora.acquire(msg.request_id, msg.lora_request), salt)
        req = Request(msg.request_id, msg.prompt_token_ids, msg.params, self.tokenizer.stop_token_ids,
                      msg.max_tokens, msg.priority, constraints=msg.constraints, slo_tpot_ms=msg.slo_tpot_ms,
                      kv_transfer=msg.kv_transfer, cache_salt=salt, lora_request=msg.lora_request)
        req.timings.arrival = msg.arrival_time
        try:
            self.scheduler.add_request(req)
        except BaseException:
            if msg.lora_request is not None:
                lora.release(msg.request_id)
            raise
        self._sent[msg.request_id] = 0
        self._idle = False

    def abort(self, msg: AbortRequests) -> None:
        """End sequences now (their KV blocks are free when this returns)."""
        status = RequestStatus(msg.status)
        self._idle = False
        for rid in msg.request_ids:
            self.scheduler.finish_request(rid, status)
            self._sent.pop(rid, None)

    def has_unfinished(self) -> bool:
        """Requests to run, or KV transfers to see through (their blocks are freed by a step)."""
        return self.scheduler.has_unfinished() or (self.kv_connector is not None and self.kv_connector.pending())

    def state(self) -> CoreState:
        s = self.scheduler
        return CoreState(len(s.running), len(s.waiting), self.kv_cache.num_free_blocks, s.num_preemptions, self._busy,
                         num_added=self._num_added, forecast=s.planner.forecast(s),
                         num_waiting_for_kv=len(s.waiting_for_kv), num_kv_held=len(s.kv_sending))

    def request_progress(self) -> list[tuple[str, str, int]]:
        """(request id, status, tokens whose KV is computed) of every request in the scheduler."""
        return [(rid, r.status.value, r.num_computed_tokens) for rid, r in self.scheduler.requests.items()]

    def check_invariants(self) -> str | None:
        """What is wrong with the KV cache's bookkeeping, or None."""
        try:
            self.kv_cache.check_invariants()
        except AssertionError as e:
            return str(e) or "an invariant failed"
        return None

    # ---- the step --------------------------------------------------------------------

    def _kv_transfers(self) -> tuple[list[CoreOutput], list]:
        """Apply the transfers that ended: a producer's sent blocks are freed, a consumer's request runs (or
        recomputes, or fails: then its output is returned)."""
        outputs, records = [], []
        if self._idle:  # nothing could run last step, and nothing new came: wait for a transfer to end
            self.kv_connector.wait(KV_POLL_S)
        for kind, rid, error, record in self.kv_connector.poll():
            records.append(record)
            if kind == "sent":
                if error:
                    logger.warning("KV transfer: the blocks of %s were not sent: %s", rid, error)
                self.scheduler.kv_send_done(rid)
                continue
            if error:
                logger.warning("KV transfer: the KV of %s did not arrive (%s); %s", rid, error,
                               "computing its prompt here" if self.scheduler.remote_kv.recompute_failed else "failing it")
            failed = self.scheduler.kv_recv_done(rid, error)
            if failed is not None:
                outputs.append(self._output(failed, ModelRunnerOutput({})))
        return outputs, records

    def step(self) -> CoreStep:
        if self._batches is not None:
            return self._pipelined_step()
        kv_outputs, kv_records = self._kv_transfers() if self.kv_connector is not None else ([], [])
        start = time.perf_counter()
        self._steps += 1
        pc = self.kv_cache.stats
        queries, hits = pc.queries, pc.hits
        sched = self.scheduler.schedule()
        for recv in sched.kv_recv:
            self.kv_connector.start_receive(recv)
        self._idle = sched.is_empty
        scheduled = time.perf_counter()
        planner = self.scheduler.planner
        shape = StepShape.of(sched) if sched.scheduled else None
        predicted = planner.predict(shape) if shape is not None and planner.predicts else None
        if self._steps == self._fault_step:  # as a forward pass failing: after blocks were handed out
            raise InjectedFault(f"fault injected at engine step {self._steps} (${FAULT_ENV})")
        result = self.runner.execute(sched)
        outputs = kv_outputs + self._apply(sched, result)
        draft_s = self._propose_drafts()
        if self.kv_connector is not None:  # held before the front end hears they finished
            for send in self.scheduler.take_kv_sends():
                self.kv_connector.offer(send)
        if self._idle and self.kv_connector is not None and not outputs and not kv_records:
            return CoreStep([], None, self.state())  # a poll for transfers: no step to report
        duration = time.perf_counter() - start
        if shape is not None and planner.predicts:
            planner.observe(shape, duration)
        stats = self._stats(sched, result, start, duration, shape, predicted, pc.queries - queries, pc.hits - hits,
                            scheduled - start, draft_s, kv_records or None)
        return CoreStep(outputs, stats, self.state())

    def _pipelined_step(self) -> CoreStep:
        """Pipeline parallelism with several steps in flight (vLLM's batch queue): each call launches the
        next step (of requests not in flight) while there is room and returns at once if another could
        follow; otherwise it finishes the oldest step and reports it. Rank 0 thus schedules and runs stage
        0 of step n + 1 while the later stages work on step n, and no stage waits for a step to end."""
        start = time.perf_counter()
        batches = self._batches
        if len(batches) < self.config.parallel.batches_in_flight:
            self._steps += 1
            pc = self.kv_cache.stats
            queries, hits = pc.queries, pc.hits
            sched = self.scheduler.schedule()
            scheduled = time.perf_counter()
            if self._steps == self._fault_step:
                raise InjectedFault(f"fault injected at engine step {self._steps} (${FAULT_ENV})")
            launched = self.runner.launch(sched)
            if launched is not None:
                batches.append((sched, launched, start, pc.queries - queries, pc.hits - hits, scheduled - start))
                room = len(batches) < self.config.parallel.batches_in_flight
                if room and self.scheduler.has_work_beyond_in_flight():
                    self._launch_s += time.perf_counter() - start
                    return CoreStep([], None, self.state())
        if not batches:
            return CoreStep([], None, self.state())
        sched, launched, launched_at, queries, hits, schedule_s = batches.popleft()
        result = self.runner.finish(launched)
        outputs = self._apply(sched, result)
        draft_s = self._propose_drafts()
        duration = time.perf_counter() - start + self._launch_s  # every call's time counted once
        self._launch_s = 0.0
        shape = StepShape.of(sched)
        return CoreStep(outputs, self._stats(sched, result, launched_at, duration, shape, None, queries, hits,
                                             schedule_s, draft_s), self.state())

    def _apply(self, sched, result) -> list[CoreOutput]:
        """A step's sampled tokens into the scheduler: the outputs of the requests it advanced or ended."""
        finished = self.scheduler.update_from_output(sched, result)
        requests = self.scheduler.requests
        updated = [requests[r] for r in result.sampled_token_ids if r in requests]
        return [self._output(req, result) for req in updated + finished]

    def _propose_drafts(self) -> float:
        """The next step's drafts, now that this one's tokens are in (spec_decode/step.py); its seconds."""
        return propose_drafts(self.scheduler, self.proposer) if self.proposer is not None else 0.0

    def _stats(self, sched, result, start: float, duration: float, shape, predicted, queries: int, hits: int,
               schedule_s: float, draft_s: float, kv_transfers: list | None = None) -> StepStats:
        self._busy += duration
        planner = self.scheduler.planner
        lora = getattr(self.runner, "lora", None)
        return StepStats(
            start, duration, sched.num_prefill_tokens, sched.num_decode_tokens,
            len(sched.scheduled), len(self.scheduler.running), len(self.scheduler.waiting),
            self.kv_cache.num_blocks - self.kv_cache.num_free_blocks, len(sched.preempted_request_ids),
            queries, hits,
            step_acceptance(sched.scheduled, result.sampled_token_ids, self.config.speculative.num_speculative_tokens)
            if self.proposer is not None else None,
            predicted, getattr(planner, "last_budget", None), getattr(planner, "last_batch_target", None),
            planner.tracker.ratio if predicted is not None else None,
            schedule_s=schedule_s, draft_s=draft_s,
            forward_s=getattr(self.runner, "forward_s", 0.0), sample_s=getattr(self.runner, "sample_s", 0.0),
            flops=step_flops(self.model_config, shape) if shape is not None else 0.0,
            bytes=step_bytes(self.weight_bytes, self.kv_bytes_per_token, shape) if shape is not None else 0.0,
            expert_tokens=self._expert_tokens(),
            kv_transfers=kv_transfers,
            kv_offload=self.scheduler.kv_tier.take_stats() if getattr(self.scheduler, "kv_tier", None) else None,
            shape=shape,
            requests=[(s.request_id, s.start_pos, len(s.token_ids) - s.num_draft_tokens, s.num_draft_tokens,
                       len(result.sampled_token_ids.get(s.request_id, ())) if s.needs_logits else 0)
                      for s in sched.scheduled],
            preempted=dict(sched.preempted_for) or None,
            lora=None if lora is None else lora.lora_stats(self.scheduler.running, self.scheduler.waiting),
        )

    def _expert_tokens(self) -> list[list[int]] | None:
        take = getattr(getattr(self.runner, "model", None), "take_expert_tokens", None)
        tokens = take() if take is not None else None
        if tokens is not None and getattr(self.runner, "pipeline", None) is not None:  # the later stages' layers
            from tokenmill.distributed.pipeline import later_stages_expert_tokens

            tokens += later_stages_expert_tokens(self.runner.model, self.runner.pipeline[0])
        return tokens

    def _output(self, req: Request, result) -> CoreOutput:
        rid = req.request_id
        sent = self._sent.get(rid, 0)
        n = len(req.output_token_ids)
        out = CoreOutput(rid, req.output_token_ids[sent:], req.timings.token_times[sent:n],
                         result.logprobs.get(rid), result.prompt_logprobs.get(rid), req.timings.first_scheduled,
                         req.num_preemptions)
        if sent == 0:  # (set at admission, before any token: it crosses with the first output only)
            out.num_cached_tokens = req.num_cached_tokens
        if req.is_finished:
            out.status, out.stop_reason, out.finished_time = req.status.value, req.stop_reason, req.timings.finished
            out.error, out.pooled = req.error, req.pooled
            self._sent.pop(rid, None)
        else:
            self._sent[rid] = n
        return out

    # ---- outside the scheduler -------------------------------------------------------

    @torch.inference_mode()
    def prompt_logits(self, token_ids: list[int]) -> torch.Tensor:
        """Next-token logits after each prefix of ``token_ids`` ([len - 1, vocab] float32 on the CPU;
        row i follows token_ids[: i + 1]), from one prefill through the paged KV cache. The front end has
        checked the ids against the vocabulary."""
        if self.has_unfinished():
            raise RuntimeError("score() runs outside the scheduler: finish or abort the running requests first")
        ids = list(token_ids)
        if not 2 <= len(ids) <= self.max_model_len:
            raise ValueError(f"score() needs 2 to {self.max_model_len} tokens, got {len(ids)}")
        table = self.kv_cache.allocate_slots("__score__", len(ids))
        if table is None:
            raise ValueError(f"{len(ids)} tokens do not fit in the KV cache; raise --kv-cache-memory")
        try:
            return self.runner.prompt_logits(ids, table).float().cpu()
        finally:
            self.kv_cache.free("__score__")
