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

No tensors here: the simulator and the CPU tests drive this exact code.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from tokenmill.config import SchedulerConfig
from tokenmill.core.kv_cache import KVCacheManager
from tokenmill.core.request_queue import make_queue
from tokenmill.core.step_planner import FixedPlanner
from tokenmill.request import Request, RequestStatus
from tokenmill.sampling_params import InvalidParameter, SamplingParams
from tokenmill.spec_decode.policy import update_acceptance, worthwhile_drafts


@dataclass(frozen=True)
class NewRequestData:
    """Sent once, when the runner first sees a request (it keeps sampling state per request)."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int]
    constraints: Any = None  # structured_output.RequestConstraints: a grammar, bad words


@dataclass(frozen=True)
class ScheduledRequest:
    request_id: str
    token_ids: list[int]  # the ids to compute this step
    start_pos: int  # position of token_ids[0] == num_computed_tokens before the step
    block_table: list[int]
    needs_logits: bool  # this chunk ends the known tokens: sample the next one
    num_draft_tokens: int = 0  # speculative decoding: token_ids[1:] are drafts to verify (logits for each)
    draft_probs: Any = None  # the [drafts, vocab] distributions sampled drafts came from; None: point drafts


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    new_requests: list[NewRequestData] = field(default_factory=list)
    finished_request_ids: list[str] = field(default_factory=list)  # the runner drops their state
    preempted_request_ids: list[str] = field(default_factory=list)
    # preemption by swap, done by the runner before the step's forward pass, in this order:
    # (request id, its blocks in position order) to copy to host memory, then
    # (request id, the fresh blocks) to copy its saved KV back into
    swap_out: list[tuple[str, list[int]]] = field(default_factory=list)
    swap_in: list[tuple[str, list[int]]] = field(default_factory=list)
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0

    @property
    def num_batched_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass(frozen=True)
class ModelRunnerOutput:
    """What comes back from a step: sampled ids (a list per request, for speculative decoding
    later) and, where asked, logprobs as (sampled token logprob, [(token, logprob), ...top-n])."""

    sampled_token_ids: dict[str, list[int]]
    logprobs: dict[str, list[tuple[float, list[tuple[int, float]]]]] = field(default_factory=dict)
    # prompt logprobs, once a request's prompt is done: [None, {token: logprob, top...} per prompt token]
    prompt_logprobs: dict[str, list[dict[int, float] | None]] = field(default_factory=dict)


def check_fits(num_prompt_tokens: int, max_tokens: int, max_model_len: int, num_blocks: int, block_size: int,
               config: SchedulerConfig) -> None:
    """Raise ValueError if a request of this size could never run (the front end asks before it sends
    a request to the engine core, wherever that runs)."""
    total = num_prompt_tokens + max_tokens
    if total > max_model_len:
        raise InvalidParameter(
            f"prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) = {total} exceeds the "
            f"model's context length of {max_model_len} tokens; shorten the prompt or lower max_tokens",
            "max_tokens")
    need = -(-total // block_size)
    if need > num_blocks:
        raise InvalidParameter(
            f"this request needs {need} KV blocks ({total} tokens) but the whole KV cache has "
            f"{num_blocks}; raise --kv-cache-memory or lower max_tokens", "max_tokens")
    if not config.enable_chunked_prefill and total > config.max_num_batched_tokens:
        raise InvalidParameter(
            f"prompt + max_tokens ({total} tokens) exceeds max_num_batched_tokens "
            f"({config.max_num_batched_tokens}) and chunked prefill is off; raise "
            "--max-num-batched-tokens or pass --enable-chunked-prefill", "max_tokens")


# A request preempted this many times is promoted: it runs first and is the last victim (no thrash).
MAX_PREEMPTIONS = 3


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache: KVCacheManager, max_model_len: int,
                 proposer=None) -> None:
        """proposer: a speculative drafter (spec_decode/), drafting at most ``proposer.k`` tokens per
        request and step, d of them costing ``proposer.draft_cost(batch)(d)`` decode steps (the off rule);
        ``may_draft(request, batch)`` says whether it may draft for a request now, ``propose_batch`` is
        asked once a step for the drafts of every decoding request that may draft, ``finish`` when a
        request ends."""
        self.config = config
        self.proposer = proposer
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
        self.draft_s = 0.0
        self.swapped: set[str] = set()  # preempted by swap: their KV waits in the runner's host memory
        self.clock = time.perf_counter  # tests substitute a fake clock

    # ---- admission -------------------------------------------------------------------

    def check_fits(self, num_prompt_tokens: int, max_tokens: int) -> None:
        """Raise ValueError if a request of this size could never run."""
        check_fits(num_prompt_tokens, max_tokens, self.max_model_len, self.kv_cache.num_blocks,
                   self.kv_cache.block_size, self.config)

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.check_fits(request.num_prompt_tokens, request.max_tokens)
        self.requests[request.request_id] = request
        self.waiting.add(request)

    def finish_request(self, request_id: str, status: RequestStatus) -> None:
        """End a request from outside the step (abort, stop string); frees its blocks now."""
        req = self.requests.get(request_id)
        if req is None or req.is_finished:
            return
        if req in self.running:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        self._finish(req, status)

    def _finish(self, req: Request, status: RequestStatus) -> None:
        req.status = status
        req.timings.finished = self.clock()
        self.kv_cache.free(req.request_id)
        self.swapped.discard(req.request_id)  # the runner drops its host copy with its other state
        if self.proposer is not None:
            self.proposer.finish(req.request_id)
        del self.requests[req.request_id]
        if req.request_id in self._known_to_runner:
            self._known_to_runner.discard(req.request_id)
            self._finished_ids.append(req.request_id)

    # ---- one step --------------------------------------------------------------------

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(finished_request_ids=self._finished_ids)
        self._finished_ids = []
        self.draft_s = 0.0  # seconds the drafter ran in this call (engine/utilization.py)
        now = self.clock()
        self.waiting.promote_starved(now)
        self.waiting.order_running(self.running)
        budget = self.planner.token_budget(self)
        max_running = self.planner.max_running(self)

        # 1. Running requests: decodes (one token, plus drafts) and unfinished chunked prefills. A
        # drafting request reserves slots for its drafts now; they are proposed once all are known.
        drafting: list[tuple[Request, int]] = []
        # the batch drafts are priced at: the running requests and those about to join them
        batch = min(len(self.running) + len(self.waiting), max_running)
        draft_cost = self.proposer.draft_cost(batch) if self.proposer is not None else None
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            room = self._draft_room(req, budget, draft_cost, batch) if num_new == 1 else 0
            if room and self.kv_cache.allocate_slots(req.request_id, req.num_computed_tokens + 1 + room) is None:
                room = 0  # drafts never preempt anyone: without room for them, the request just decodes
            num_new += room
            while self.kv_cache.allocate_slots(req.request_id, req.num_computed_tokens + num_new) is None:
                victim = self.running.pop()  # the policy's last: fcfs most recent, priority least urgent
                self._preempt(victim, out)
                if victim is req:
                    break
            else:
                if room:
                    drafting.append((req, room))
                else:
                    self._emit(req, num_new, out)
                budget -= num_new
                i += 1
                continue
            break  # req itself was preempted: nothing after it is left to schedule
        if drafting:
            budget += self._emit_drafted(drafting, out)

        # 2. Waiting requests, in policy order, while there is room. None if we just had to preempt.
        kv = self.kv_cache
        while self.waiting and not out.preempted_request_ids and budget > 0:
            if len(self.running) >= max_running:
                break
            req = self.waiting[0]
            swapped = req.request_id in self.swapped
            if swapped:  # its KV comes back from host memory
                hits, num_cached = [], req.num_computed_tokens
            else:  # a new or recompute-preempted request has no KV; its cached prefix needs no compute
                # a cached prefix has no logits: a request that wants prompt logprobs computes it all
                hits = (kv.get_computed_blocks(req.request_id, req.all_token_ids)
                        if kv.enable_prefix_caching and req.sampling_params.prompt_logprobs is None else [])
                num_cached = len(hits) * kv.block_size
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
            if kv.enable_prefix_caching and not swapped:
                kv.stats.requests += 1
                kv.stats.queries += req.num_tokens
                kv.stats.hits += num_cached
            req.status = RequestStatus.RUNNING
            if req.timings.first_scheduled is None:
                req.timings.first_scheduled = now
            if req.promoted:  # ahead of every victim (the priority policy also sorts it first)
                self.running.insert(0, req)
            else:
                self.running.append(req)
            if req.request_id not in self._known_to_runner:
                self._known_to_runner.add(req.request_id)
                out.new_requests.append(
                    NewRequestData(
                        req.request_id,
                        req.prompt_token_ids,
                        list(req.output_token_ids),
                        req.sampling_params,
                        req.eos_token_ids,
                        req.constraints,
                    )
                )
            self._emit(req, num_new, out)
            budget -= num_new
        return out

    def _draft_room(self, req: Request, budget: int, draft_cost, batch: int) -> int:
        """How many drafts a decoding request may carry: what its acceptance pays for (the off rule),
        within the step's budget (drafts count against it), its max_tokens (the last emitted token is the
        one after the drafts) and the context length."""
        if self.proposer is None or not self.proposer.may_draft(req, batch):
            return 0
        return max(0, min(budget - 1, req.max_tokens - req.num_output_tokens - 1,
                          self.max_model_len - req.num_tokens - 1,
                          worthwhile_drafts(req.draft_acceptance, req.num_steps_without_drafts, self.proposer.k,
                                            draft_cost)))

    def _emit_drafted(self, drafting: list[tuple[Request, int]], out: SchedulerOutput) -> int:
        """Ask the drafter for every drafting request at once (a draft model batches its passes) and
        schedule each with its drafts; returns the reserved budget the drafter did not use."""
        tables = self.kv_cache.block_tables
        t = time.perf_counter()
        proposals = self.proposer.propose_batch([(req, room, tables[req.request_id]) for req, room in drafting])
        self.draft_s += time.perf_counter() - t
        unused = 0
        for (req, room), (drafts, probs) in zip(drafting, proposals):
            drafts = list(drafts)[:room]
            unused += room - len(drafts)
            self._emit(req, 1, out, drafts, probs if drafts else None)
        return unused

    def _emit(self, req: Request, num_new: int, out: SchedulerOutput, drafts: list[int] = (),
              draft_probs: Any = None) -> None:
        start = req.num_computed_tokens
        needs_logits = start + num_new == req.num_tokens
        out.scheduled.append(
            ScheduledRequest(
                req.request_id,
                req.token_ids_slice(start, start + num_new) + list(drafts),
                start,
                self.kv_cache.block_tables[req.request_id],
                needs_logits,
                len(drafts),
                draft_probs,
            )
        )
        # A single new token after the prompt is a decode (with its drafts); anything else is (re)prefill work.
        if num_new == 1 and start >= req.num_prompt_tokens:
            out.num_decode_tokens += 1 + len(drafts)
        else:
            out.num_prefill_tokens += num_new

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        kv = self.kv_cache
        if self.config.preemption_mode == "swap" and req.num_computed_tokens > 0:
            blocks = kv.block_tables[req.request_id][:kv.blocks_needed(req.num_computed_tokens)]
            out.swap_out.append((req.request_id, list(blocks)))
            self.swapped.add(req.request_id)
        else:
            req.num_computed_tokens = 0
        kv.free(req.request_id)
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
        if req.num_preemptions >= MAX_PREEMPTIONS:
            req.promoted = True  # no thrash: from now on it runs first, and others are preempted before it
        self.waiting.add_preempted(req)
        out.preempted_request_ids.append(req.request_id)

    def update_from_output(self, sched: SchedulerOutput, result: ModelRunnerOutput) -> list[Request]:
        """Apply a step's sampled tokens; returns the requests that finished in it."""
        now = self.clock()
        finished: list[Request] = []
        bs = self.kv_cache.block_size
        for s in sched.scheduled:
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
            elif self.proposer is not None and s.needs_logits:
                req.num_steps_without_drafts += 1
            status = None
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
