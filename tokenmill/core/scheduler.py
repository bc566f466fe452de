"""Continuous-batching scheduler: who computes how many tokens this step.

Prefill and decode are one thing here: a request has ``num_tokens`` ids of which
``num_computed_tokens`` have KV; each step hands out the difference under one token
budget and a cap on running requests, both the planner's (``core/step_planner.py``: the
configured ``max_num_batched_tokens`` and ``max_num_seqs``, or planned to a latency target
on a step-cost model). Running requests go first, so decodes are never starved by
arriving prompts; what budget is left admits waiting requests in the policy's order
(``core/request_queue.py``: fcfs or priority). With chunked prefill a prompt larger than
the budget left is split across steps; its first token is sampled only once the whole
prompt is computed. With prefix caching an admitted request starts at the end of its
longest cached prefix.

When the KV pool is full, the running request the policy ranks last (fcfs: the most
recently admitted) is preempted. By recompute (default): its blocks are freed, its tokens
kept, and it goes back to the waiting queue with ``num_computed_tokens = 0``. By swap: the
runner copies its KV blocks to host memory before the step (``swap_out``), its blocks are
freed and it keeps ``num_computed_tokens``; when it is admitted again it gets fresh blocks,
which the runner fills back from host memory before that step (``swap_in``).

Prefill/decode disaggregation (kv_transfer/) is two more states. On a consumer, a request whose
prompt was prefilled elsewhere is admitted with blocks for its whole prompt reserved (after any cached
prefix) and waits in ``waiting_for_kv``, costing no budget, while the connector fills its blocks
(``kv_recv``); once they arrive it runs with all but its last prompt token computed, so its first step
computes that token and samples the first output, as after a prefix-cache hit. On a producer, a request
that asked for remote decode keeps its blocks when it finishes, until the connector has sent them
(``take_kv_sends``, ``kv_send_done``); the connector owns the timeout either way.

No tensors here: the simulator and the CPU tests drive this exact code.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from tokenmill.config import SchedulerConfig
from tokenmill.core.fits import check_fits
from tokenmill.core.kv_cache import KVCacheManager
from tokenmill.core.lanes import Lanes
from tokenmill.core.remote_kv import RemoteKV, wants_remote_prefill
from tokenmill.core.request_queue import make_queue
from tokenmill.core.sched_output import (KVSend, ModelRunnerOutput, NewRequestData, ScheduledRequest,
                                          SchedulerOutput)
from tokenmill.core.step_planner import FixedPlanner
from tokenmill.request import Request, RequestStatus
from tokenmill.core.draft_policy import update_acceptance

if TYPE_CHECKING:
    from tokenmill.core.kv_tier import KVTier


# A request preempted this many times is promoted: it runs first and is the last victim (no thrash).
MAX_PREEMPTIONS = 3


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache: KVCacheManager, max_model_len: int) -> None:
        self.config = config
        self.kv_cache = kv_cache
        self.max_model_len = max_model_len
        self.waiting = make_queue(config.policy, config.starvation_timeout)
        # the step's token budget and the running cap (core/step_planner.py); the engine installs an
        # SLOPlanner when a latency target is set
        self.planner = FixedPlanner(config)
        self.running: list[Request] = []  # in preemption order: the last one is the first victim
        self.requests: dict[str, Request] = {}
        self._known_to_runner: set[str] = set()
        self._finished_ids: list[str] = []
        self.num_preemptions = 0
        # called with a request's id when it ends (a drafter drops what it holds for the request)
        self.finish_hooks: list[Callable[[str], None]] = []
        self.swapped: set[str] = set()  # preempted by swap: their KV waits in the runner's host memory
        self.remote_kv = RemoteKV(kv_cache)  # disaggregation: requests waiting for KV, blocks held to send
        self.kv_tier: KVTier | None = None  # the KV tier on local disk (core/kv_tier.py), where one is on
        self._lanes = Lanes()  # pipeline parallelism's steps in flight (core/lanes.py)
        self.clock = time.perf_counter  # tests substitute a fake clock
        # --max-loras: the distinct adapters the running requests may use (the runner's slots); None: no LoRA
        self.max_loras: int | None = None

    @property
    def lanes(self) -> int:
        """Steps in flight at once (one lane each); 1 without pipeline parallelism."""
        return self._lanes.n

    @lanes.setter
    def lanes(self, n: int) -> None:
        self._lanes.n = n

    @property
    def in_flight(self) -> set[str]:
        """Requests in a step not yet applied: neither scheduled again nor preempted until then."""
        return self._lanes.in_flight

    @property
    def waiting_for_kv(self) -> dict[str, Request]:
        return self.remote_kv.waiting

    @property
    def kv_sending(self) -> set[str]:
        return self.remote_kv.sending

    # ---- admission -------------------------------------------------------------------

    def check_fits(self, num_prompt_tokens: int, max_tokens: int) -> None:
        """Raise ValueError if a request of this size could never run."""
        check_fits(num_prompt_tokens, max_tokens, self.max_model_len, self.kv_cache.num_blocks,
                   self.kv_cache.block_size, self.config)

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests or request.request_id in self.in_flight:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.check_fits(request.num_prompt_tokens, request.max_tokens)
        if request.cache_salt is not None:
            self.kv_cache.set_request_salt(request.request_id, request.cache_salt)
        self.requests[request.request_id] = request
        self.waiting.add(request)

    def finish_request(self, request_id: str, status: RequestStatus) -> None:
        """End a request from outside the step (abort, stop string); frees its blocks now."""
        req = self.requests.get(request_id)
        if req is None or req.is_finished:
            return
        if req in self.running:
            self.running.remove(req)
        elif request_id in self.waiting_for_kv:  # the connector may be writing its blocks: keep them
            self.remote_kv.cancel(request_id)
        else:
            self.waiting.remove(req)
        self._finish(req, status)

    def _finish(self, req: Request, status: RequestStatus) -> None:
        req.status = status
        req.timings.finished = self.clock()
        kv = req.kv_transfer
        if kv and kv.get("do_remote_decode") and status in (RequestStatus.FINISHED_LENGTH,
                                                            RequestStatus.FINISHED_STOPPED):
            self.remote_kv.hold_for_send(req)  # its blocks go to a consumer first
        elif not self.remote_kv.holds_blocks(req.request_id):
            self.kv_cache.free(req.request_id)
        self.kv_cache.drop_request_salt(req.request_id)
        self.swapped.discard(req.request_id)  # the runner drops its host copy with its other state
        self._lanes.leave(req.request_id)
        for hook in self.finish_hooks:
            hook(req.request_id)
        del self.requests[req.request_id]
        if req.request_id in self._known_to_runner:
            self._known_to_runner.discard(req.request_id)
            if self._lanes.finish(req.request_id):  # (in flight: the runner hears once its step is applied)
                self._finished_ids.append(req.request_id)

    # ---- one step --------------------------------------------------------------------

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.waiting_for_kv or self.in_flight)

    def has_work_beyond_in_flight(self) -> bool:
        """Something another step could take while steps are in flight: a waiting request, or a running
        one whose step is not in flight."""
        return bool(self.waiting) or any(r.request_id not in self.in_flight for r in self.running)

    # ---- disaggregation ----------------------------------------------------------------

    def take_kv_sends(self) -> list[KVSend]:
        """Producer: requests finished since the last call whose blocks wait for a consumer."""
        return self.remote_kv.take_sends()

    def kv_send_done(self, request_id: str) -> None:
        """Producer: the connector sent the blocks (or gave up): they are free."""
        self.remote_kv.sent(request_id)

    def kv_recv_done(self, request_id: str, error: str | None = None) -> Request | None:
        """Consumer: the connector filled the request's blocks (error None) or could not. On success it runs
        from its last prompt token; on failure it computes its prompt here (``remote_kv.recompute_failed``)
        or ends, aborted with the error: then it is returned, for the engine to report."""
        if self.kv_tier is not None:
            self.kv_tier.loaded(request_id, error)
        req = self.remote_kv.received(request_id, error)
        if req is None:
            return None
        if error is None:
            req.status = RequestStatus.RUNNING
            req.timings.first_scheduled = self.clock()
            if req.promoted:
                self.running.insert(0, req)
            else:
                self.running.append(req)
            return None
        if self.remote_kv.recompute_failed:
            req.kv_transfer = None
            req.status = RequestStatus.WAITING
            self.waiting.add_preempted(req)
            return None
        req.error = error
        self._finish(req, RequestStatus.FINISHED_ABORTED)
        return req

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(finished_request_ids=self._finished_ids)
        self._finished_ids = []
        if self.kv_tier is not None:  # blocks the pool evicts while this step is scheduled go to the tier
            self.kv_tier.open_step()
        self.draft_s = 0.0  # seconds the drafter ran in this call (engine/utilization.py)
        now = self.clock()
        self.waiting.promote_starved(now)
        self.waiting.order_running(self.running)
        budget = self.planner.token_budget(self)
        max_running = self.planner.max_running(self)

        # 1. Running requests: decodes (one token, plus the drafts proposed after the last step, as many as the
        # budget takes: spec_decode/step.py) and unfinished chunked prefills.
        lane = self._lanes.take(self.running)
        starved = False  # a running request waits for blocks that requests in flight hold
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if self._lanes.skips(req.request_id, lane):
                i += 1  # its step is in flight, or this step is another lane's
                continue
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            drafts = req.spec_token_ids[:budget - 1] if num_new == 1 else []  # (their slots are reserved)
            num_new += len(drafts)
            while self.kv_cache.allocate_slots(req.request_id, req.num_computed_tokens + num_new) is None:
                victim = self._lanes.pop_victim(self.running, i)  # the policy's last: fcfs most recent, priority least urgent
                if victim is None:  # only requests in flight could give blocks back: wait for them
                    starved = True
                    break
                self._preempt(victim, out, req.request_id)
                if victim is req:
                    break
            else:
                probs = req.spec_probs[:len(drafts)] if drafts and req.spec_probs is not None else None
                self._emit(req, num_new - len(drafts), out, drafts, probs)
                req.spec_token_ids, req.spec_probs = [], None  # proposed again after this step
                budget -= num_new
                i += 1
                continue
            break  # req itself was preempted (or must wait): nothing after it is left to schedule

        # 2. Waiting requests, in policy order, while there is room. None if we just had to preempt.
        kv = self.kv_cache
        lane_room = self._lanes.room(self.running, len(self.waiting), lane)
        skipped: list[Request] = []  # waiting for an adapter slot: the requests behind them may run (vLLM's rule)
        while self.waiting and not out.preempted_request_ids and not starved and budget > 0:
            if len(self.running) + len(self.waiting_for_kv) >= max_running:
                break
            if lane_room <= 0:
                break
            req = self.waiting[0]
            if self.max_loras is not None and not self._lora_slot_free(req):
                skipped.append(self.waiting.pop())
                continue
            swapped = req.request_id in self.swapped
            if swapped:  # its KV comes back from host memory
                hits, num_cached = [], req.num_computed_tokens
            else:  # a new or recompute-preempted request has no KV; its cached prefix needs no compute
                # a cached prefix has no logits or hidden states: a request wanting them computes it all
                hits = (kv.get_computed_blocks(req.request_id, req.all_token_ids)
                        if kv.enable_prefix_caching and not req.sampling_params.needs_all_prompt_rows else [])
                num_cached = len(hits) * kv.block_size
            if not swapped and wants_remote_prefill(req, num_cached):  # its KV comes from a producer
                if kv.allocate_slots(req.request_id, req.num_prompt_tokens, hits) is None:
                    break
                self.waiting.pop()
                self._count_prefix_hits(req, num_cached)
                out.kv_recv.append(self.remote_kv.await_kv(req, num_cached))
                continue
            tier = (self.kv_tier.lookup(req.request_id,
                                        kv.prefix_block_hashes(req.request_id, req.all_token_ids)[len(hits):])
                    if self.kv_tier is not None and not swapped and not req.sampling_params.needs_all_prompt_rows
                    else [])
            if tier:  # its next blocks are in the KV tier: read into reserved blocks while it waits (as remote KV)
                num_tier = num_cached + len(tier) * kv.block_size
                if kv.allocate_slots(req.request_id, num_tier, hits) is None:
                    break
                self.waiting.pop()
                self._count_prefix_hits(req, num_cached)
                self.kv_tier.admitted(req.request_id, reading=True)
                out.kv_recv.append(self.remote_kv.await_kv(req, num_cached, num_tier, tier))
                continue
            num_new = req.num_tokens - num_cached
            if num_new > budget:
                if not self.config.enable_chunked_prefill:
                    break
                num_new = budget
            if kv.allocate_slots(req.request_id, num_cached + num_new, hits) is None:
                break
            self.waiting.pop()
            if swapped:
                self.swapped.discard(req.request_id)
                out.swap_in.append((req.request_id, kv.block_tables[req.request_id][:kv.blocks_needed(num_cached)]))
            req.num_computed_tokens = num_cached
            if not swapped:
                self._count_prefix_hits(req, num_cached)
                if self.kv_tier is not None:
                    self.kv_tier.admitted(req.request_id)
            req.status = RequestStatus.RUNNING
            if req.timings.first_scheduled is None:
                req.timings.first_scheduled = now
            if req.promoted:  # ahead of every victim (the priority policy also sorts it first)
                self.running.insert(0, req)
            else:
                self.running.append(req)
            self._lanes.join(req.request_id, lane)
            lane_room -= 1
            self._emit(req, num_new, out)
            budget -= num_new
        for req in reversed(skipped):
            self.waiting.add_preempted(req)  # back where they were
        if self.kv_tier is not None:
            self.kv_tier.close_step(out)
        return out

    def _lora_slot_free(self, req: Request) -> bool:
        """Whether ``req`` may join the running requests: no adapter, one of theirs, or a slot left."""
        if req.lora_request is None:
            return True
        running = {r.lora_request.lora_int_id for r in self.running if r.lora_request is not None}
        return req.lora_request.lora_int_id in running or len(running) < self.max_loras

    def _count_prefix_hits(self, req: Request, num_cached: int) -> None:
        kv = self.kv_cache
        if req.num_cached_tokens < 0:  # its first admission (vLLM's num_cached_tokens), not a readmission
            req.num_cached_tokens = num_cached
        if kv.enable_prefix_caching:
            kv.stats.requests += 1
            kv.stats.queries += req.num_tokens
            kv.stats.hits += num_cached

    # ---- speculative decoding (the drafter runs after each step: spec_decode/step.py) -----------

    def draft_batch_size(self) -> int:
        """The batch drafts are priced at: the running requests and those about to join them."""
        return min(len(self.running) + len(self.waiting), self.planner.max_running(self))

    def may_carry_drafts(self) -> list[Request]:
        """Running requests whose next step is a decode not yet given drafts (nor in flight)."""
        return [r for r in self.running if r.num_tokens - r.num_computed_tokens == 1 and not r.spec_token_ids
                and r.request_id not in self.in_flight]

    def reserve_draft_slots(self, req: Request, n: int) -> int:
        """Reserve KV slots for up to ``n`` drafts of a decoding request, within its max_tokens (the last
        emitted token is the one after the drafts) and the context; the number reserved. Drafts never preempt
        anyone: without free blocks for them the request just decodes."""
        n = max(0, min(n, req.max_tokens - req.num_output_tokens - 1, self.max_model_len - req.num_tokens - 1))
        if n and self.kv_cache.allocate_slots(req.request_id, req.num_computed_tokens + 1 + n) is None:
            return 0
        return n

    def update_draft_token_ids(self, drafts: dict[str, tuple[list[int], Any]]) -> None:
        """The drafter's proposals (token ids, their probabilities or None) for the next step."""
        for request_id, (token_ids, probs) in drafts.items():
            req = self.requests.get(request_id)
            if req is not None and req.status is RequestStatus.RUNNING and token_ids:
                req.spec_token_ids, req.spec_probs = list(token_ids), probs

    def _emit(self, req: Request, num_new: int, out: SchedulerOutput, drafts: list[int] = (),
              draft_probs: Any = None) -> None:
        if req.request_id not in self._known_to_runner:  # its first step: the runner learns of it
            self._known_to_runner.add(req.request_id)
            out.new_requests.append(NewRequestData(req.request_id, req.prompt_token_ids, list(req.output_token_ids),
                                                   req.sampling_params, req.eos_token_ids, req.constraints,
                                                   req.lora_request))
        start = req.num_computed_tokens
        needs_logits = start + num_new == req.num_tokens
        self._lanes.launched(req.request_id)
        new_blocks, new_table = self.kv_cache.take_new_blocks(req.request_id)
        token_ids = req.token_ids_slice(start, start + num_new) + list(drafts)
        out.scheduled.append(ScheduledRequest(req.request_id, token_ids, start, new_blocks, needs_logits, len(drafts),
                                              draft_probs, new_table))
        # A single new token after the prompt is a decode (with its drafts); anything else is (re)prefill work.
        if num_new == 1 and start >= req.num_prompt_tokens:
            out.num_decode_tokens += 1 + len(drafts)
        else:
            out.num_prefill_tokens += num_new

    def _preempt(self, req: Request, out: SchedulerOutput, needed_by: str) -> None:
        kv = self.kv_cache
        if self.config.preemption_mode == "swap" and req.num_computed_tokens > 0:
            blocks = kv.block_tables[req.request_id][:kv.blocks_needed(req.num_computed_tokens)]
            out.swap_out.append((req.request_id, list(blocks)))
            self.swapped.add(req.request_id)
        else:
            req.num_computed_tokens = 0
        kv.free(req.request_id)
        self._lanes.leave(req.request_id)
        req.spec_token_ids, req.spec_probs = [], None  # their slots are gone with the blocks
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
        if req.num_preemptions >= MAX_PREEMPTIONS:
            req.promoted = True  # no thrash: from now on it runs first, and others are preempted before it
        self.waiting.add_preempted(req)
        out.preempted_request_ids.append(req.request_id)
        out.preempted_for[req.request_id] = needed_by

    def update_from_output(self, sched: SchedulerOutput, result: ModelRunnerOutput) -> list[Request]:
        """Apply a step's sampled tokens; returns the requests that finished in it."""
        now = self.clock()
        finished: list[Request] = []
        bs = self.kv_cache.block_size
        for s in sched.scheduled:
            if self._lanes.landed(s.request_id):  # it ended while its step ran: now the runner may hear
                self._finished_ids.append(s.request_id)
            req = self.requests.get(s.request_id)
            if req is None or req.status is not RequestStatus.RUNNING:
                continue  # aborted while the step ran
            before = req.num_computed_tokens
            tokens = result.sampled_token_ids.get(s.request_id, []) if s.needs_logits else []
            # Speculation: the KV of the scheduled token and of the accepted drafts stands (all emitted
            # tokens but the last are accepted drafts); rejected drafts' slots are simply written again.
            accepted = len(tokens) - 1 if s.num_draft_tokens else 0
            req.num_computed_tokens += len(s.token_ids) - s.num_draft_tokens + accepted
            if s.num_draft_tokens:
                req.num_accepted_drafts += accepted
                req.num_drafts += s.num_draft_tokens
                req.draft_acceptance = update_acceptance(req.draft_acceptance, accepted, s.num_draft_tokens)
                req.num_steps_without_drafts = 0
            elif s.needs_logits:
                req.num_steps_without_drafts += 1
            status = None
            if s.needs_logits and s.request_id in result.pooled:  # a pooling request's prompt is done
                req.pooled, status = result.pooled[s.request_id], RequestStatus.FINISHED_STOPPED
            for token in tokens:
                req.output_token_ids.append(token)
                req.timings.token_times.append(now)
                status = self._check_stop(req, token)
                if status is not None:
                    break  # a stop inside an accepted run drops the tokens after it
            # Blocks are hashed once their tokens are known and accepted (after the outputs above), and
            # before a finishing request frees them, so they stay cached for the next request.
            computed = min(req.num_computed_tokens, req.num_tokens)
            if self.kv_cache.enable_prefix_caching and computed // bs > before // bs:
                self.kv_cache.cache_full_blocks(req.request_id, req.all_token_ids, computed)
            if status is not None:
                self.running.remove(req)
                self._finish(req, status)
                finished.append(req)
        return finished

    def _check_stop(self, req: Request, token: int) -> RequestStatus | None:
        sp = req.sampling_params
        if req.num_output_tokens >= sp.min_tokens:
            if not sp.ignore_eos and token in req.eos_token_ids:
                req.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
            if token in sp.stop_token_ids:
                req.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
        if req.num_output_tokens >= req.max_tokens or req.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None
