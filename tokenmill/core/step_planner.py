"""Step planning: how many tokens a step may take, how many requests may run at once, and whether a
newcomer's first token can arrive in time. The scheduler consults a planner at the top of every step,
beside its queue policy (fcfs or priority order); the planner never reorders anyone.

- ``FixedPlanner``: the configured token budget (``max_num_batched_tokens``) and sequence cap
  (``max_num_seqs``). Offline commands get it: throughput is all they want.
- ``SLOPlanner``: plans against a latency target with a step-cost model (perf/step_cost.py) measured on
  this machine. The token budget of a step is the decodes plus the largest prefill chunk whose predicted
  step time meets the target (Sarathi-Serve's rule), so a long prompt is cut finer as its chunks reach
  deeper into its context, never into a step that stalls the decodes past the target. With a TPOT SLO
  the running batch is also held at the size whose decode step (plus a minimal chunk) meets it. After
  each step it publishes a ``Forecast``: enough for ``SLOAdmission`` to predict a newcomer's time to
  first token without touching the scheduler, in the API process, within microseconds.

No tensors here: the engine core, the simulator and the unit tests run this code.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import msgspec

from tokenmill.config import SchedulerConfig
from tokenmill.perf.step_cost import StepShape, StepTimeTracker

if TYPE_CHECKING:
    from tokenmill.core.request_queue import FCFSQueue, PriorityQueue
    from tokenmill.request import Request

# The smallest prefill chunk a step takes even when the decodes alone fill the target: arriving prompts
# always make progress (and the batch target leaves room for it).
MIN_CHUNK = 16
EPS = 1e-9  # seconds: a step predicted at exactly the target meets it, float rounding notwithstanding
# Plans aim this far under their targets, since step times and TTFTs are predictions: steps at 90% of
# the ITL/TPOT target; admission at 80% of the TTFT SLO, the predicted TTFT having missed by up to +20% at
# the 99th percentile on 2 vCPUs under 2.5x overload (BENCHMARKS.md).
HEADROOM = 0.9
TTFT_HEADROOM = 0.8


class Forecast(msgspec.Struct, array_like=True, omit_defaults=True):
    """The engine's load as a planner sees it after a step (what TTFT prediction needs)."""

    step_s: float  # predicted seconds of a step at the current batch with a full prefill chunk
    prefill_per_step: int  # prompt tokens such a step computes
    running_prefill_tokens: int = 0  # prompt tokens the running requests have still to compute
    waiting: list[tuple[int, int, int]] = []  # (priority, sequences, prompt tokens to compute), by priority
    free_slots: int = 0  # the batch target less the running: negative when the target fell below the batch
    slot_steps: list[int] = []  # the running requests' remaining decode steps, ascending: when slots free
    # (prompt position, the chunk planned from there), ascending: deeper chunks are smaller (their attention
    # reads more context); token counts above are in first-chunk tokens (prefill_equivalent)
    chunk_at: list[tuple[int, int]] = []


# Prompt positions the forecast plans a chunk from (those under the context length).
DEPTHS = (0, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)


def prefill_equivalent(chunk_at: list[tuple[int, int]], start: int, end: int) -> float:
    """Prompt positions start..end as first-chunk tokens: the steps they take, chunk by chunk at each
    depth's planned size, times the first chunk's size. A long prompt takes more steps than its length at
    the first chunk's rate; without a table the tokens count as they are."""
    if not chunk_at or end <= start:
        return float(max(end - start, 0))
    pos, steps, i = start, 0.0, 0
    while pos < end:
        while i + 1 < len(chunk_at) and chunk_at[i + 1][0] <= pos:
            i += 1
        c = max(chunk_at[i][1], 1)
        n = min(c, end - pos)
        steps += n / c
        pos += n
    return steps * max(chunk_at[0][1], 1)


class PlannedScheduler(Protocol):
    """What a planner reads of the scheduler it plans for (core/scheduler.py's Scheduler, which imports this
    module): the running and waiting requests and the context length."""

    @property
    def running(self) -> list[Request]: ...

    @property
    def waiting(self) -> FCFSQueue | PriorityQueue: ...

    @property
    def max_model_len(self) -> int: ...


class FixedPlanner:
    """The configured budget and cap; no predictions, no forecast."""

    predicts = False

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config

    def token_budget(self, sched: PlannedScheduler) -> int:
        return self.config.max_num_batched_tokens

    def max_running(self, sched: PlannedScheduler) -> int:
        return self.config.max_num_seqs

    def forecast(self, sched: PlannedScheduler) -> Forecast | None:
        return None


class SLOPlanner:
    """Plans each step to meet a per-step time target (the TPOT SLO, else the ITL target) on a cost
    model corrected by the observed/predicted ratio of recent steps."""

    predicts = True

    def __init__(self, config: SchedulerConfig, cost: Callable[[StepShape], float],
                 headroom: float = HEADROOM) -> None:
        target_ms = config.slo_tpot_ms or config.itl_target_ms
        if not target_ms:
            raise ValueError("an SLO planner needs a TPOT SLO or an ITL target")
        self.config, self.cost, self.headroom = config, cost, headroom
        self.target_s = headroom * target_ms / 1e3
        self.tracker = StepTimeTracker()
        self.last_budget = config.max_num_batched_tokens
        self.last_batch_target = config.max_num_seqs

    def predict(self, shape: StepShape) -> float:
        """Seconds, corrected by what recent steps took against their predictions."""
        return self.cost(shape) * self.tracker.ratio

    def observe(self, shape: StepShape, seconds: float) -> None:
        self.tracker.observe(self.cost(shape), seconds)

    def target(self, sched: PlannedScheduler) -> float:
        """The step-time target: the tightest TPOT among the running requests' own SLOs, else the engine's."""
        own = [r.slo_tpot_ms for r in sched.running if r.slo_tpot_ms]
        return min([self.target_s] + [self.headroom * ms / 1e3 for ms in own])

    def max_prefill(self, num_decodes: int, decode_context: int, start: int, target_s: float) -> int:
        """The largest chunk (MIN_CHUNK at least) at position ``start`` whose step with these decodes
        meets ``target_s``: a bisection, the predicted time growing with the chunk."""
        cap = max(self.config.max_num_batched_tokens - num_decodes, 0)
        lo, hi = min(MIN_CHUNK, cap), cap
        fits = lambda n: self.predict(StepShape.planned(num_decodes, decode_context, n, start)) <= target_s + EPS  # noqa: E731
        if fits(hi):
            return hi
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid)
        return lo

    def token_budget(self, sched: PlannedScheduler) -> int:
        if not self.config.enable_chunked_prefill:  # whole prompts: the budget cannot cut them
            return self.config.max_num_batched_tokens
        decodes = [r for r in sched.running if r.num_tokens - r.num_computed_tokens == 1]
        prefilling = [r for r in sched.running if r.num_tokens - r.num_computed_tokens > 1]
        start = prefilling[0].num_computed_tokens if prefilling else 0
        chunk = self.max_prefill(len(decodes), sum(r.num_tokens for r in decodes), start, self.target(sched))
        self.last_budget = len(decodes) + chunk
        return self.last_budget

    def batch_target(self, context: int, target_s: float) -> int:
        """The most requests whose decode step, at this mean context and with a minimal chunk, meets the target."""
        cap = self.config.max_num_seqs
        fits = lambda b: self.predict(StepShape.planned(b, b * context, MIN_CHUNK, 0)) <= target_s + EPS  # noqa: E731
        if fits(cap):
            return cap
        lo, hi = 1, cap
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid)
        return lo

    def max_running(self, sched: PlannedScheduler) -> int:
        if not self.config.slo_tpot_ms:
            return self.config.max_num_seqs
        reqs = list(sched.running) or list(sched.waiting)[:1]
        # the mean context the batch will have halfway through its remaining outputs
        context = (sum(r.num_tokens + (r.max_tokens - r.num_output_tokens) // 2 for r in reqs) // len(reqs)
                   if reqs else 512)
        self.last_batch_target = self.batch_target(max(context, 1), self.target(sched))
        return self.last_batch_target

    def forecast(self, sched: PlannedScheduler) -> Forecast:
        cap = self.max_running(sched)
        # A newcomer's prompt is computed beside the decodes of those running and, as they get their first
        # tokens one after another, of about half those waiting ahead of it: plan its steps at that batch
        # (up to the target), at their mean context.
        batch = min(cap, len(sched.running) + (len(sched.waiting) + 1) // 2)
        everyone = list(sched.running) + list(sched.waiting)
        context = sum(r.num_tokens for r in everyone) // len(everyone) if everyone else 0
        target = self.target(sched)
        if self.config.enable_chunked_prefill:
            chunk_at = [(d, self.max_prefill(batch, batch * context, d, target)) for d in DEPTHS
                        if d < sched.max_model_len]
        else:
            chunk_at = [(0, self.config.max_num_batched_tokens)]
        chunk = chunk_at[0][1]
        step_s = self.predict(StepShape.planned(batch, batch * context, chunk, 0))
        waiting: dict[int, list[int]] = {}
        for r in sched.waiting:
            w = waiting.setdefault(r.priority, [0, 0])
            w[0] += 1
            w[1] += round(prefill_equivalent(chunk_at, r.num_computed_tokens, r.num_tokens))
        running_prefill = sum(round(prefill_equivalent(chunk_at, r.num_computed_tokens, r.num_tokens))
                              for r in sched.running if r.num_tokens - r.num_computed_tokens > 1)
        return Forecast(step_s, max(chunk, 1), running_prefill,
                        [(p, c, t) for p, (c, t) in sorted(waiting.items())],
                        cap - len(sched.running),
                        sorted(r.max_tokens - r.num_output_tokens for r in sched.running), chunk_at)


@dataclass(frozen=True)
class Verdict:
    admit: bool
    meets: bool  # the predicted TTFT meets the target (under ``queue`` a request that does not is admitted)
    predicted_ttft_s: float
    prefill_tokens: float  # its prompt in first-chunk tokens (what it adds to the backlog once admitted)
    retry_after_s: int = 0  # when shed: seconds until the backlog has drained enough to fit


def predict_ttft(f: Forecast, prompt_tokens: float, priority: int = 0, fcfs: bool = True, elapsed_s: float = 0.0,
                 pending_seqs: int = 0, pending_tokens: float = 0) -> float:
    """A newcomer's time to first token: the step in flight when it arrives (it joins the next one), then
    the later of (a) the prefill ahead of it (running prefills and waiting prompts it does not overtake,
    plus ``pending`` ones admitted since the forecast, less what ``elapsed_s`` of steps computed since)
    and (b) a free batch slot, then its own prefill. Token counts are first-chunk tokens
    (``prefill_equivalent``), ``prompt_tokens`` too."""
    seqs, tokens = pending_seqs, pending_tokens
    for p, c, t in f.waiting:
        if fcfs or p <= priority:
            seqs, tokens = seqs + c, tokens + t
    steps_done = elapsed_s / f.step_s if f.step_s > 0 else 0.0
    backlog = max(0.0, f.running_prefill_tokens + tokens - steps_done * f.prefill_per_step)
    through_queue = math.ceil((backlog + prompt_tokens) / f.prefill_per_step) * f.step_s
    need = seqs + 1 - f.free_slots  # slots that must free before one is ours
    if need <= 0:
        slot_s = 0.0
    elif need <= len(f.slot_steps):
        slot_s = max(f.slot_steps[need - 1] * f.step_s - elapsed_s, 0.0)
    else:  # more are waiting than the whole running batch frees once: a full request lifetime at least
        return math.inf
    return f.step_s + max(through_queue, slot_s + math.ceil(prompt_tokens / f.prefill_per_step) * f.step_s)


class SLOAdmission:
    """Admit a request only if its predicted TTFT meets its target (its own, else the engine's).
    policy ``shed``: answer the rest at once (503 with Retry-After); ``queue``: keep them waiting, counted."""

    def __init__(self, ttft_ms: float | None, policy: str = "shed", fcfs: bool = True,
                 headroom: float = TTFT_HEADROOM) -> None:
        self.ttft_s = ttft_ms / 1e3 if ttft_ms else None
        self.policy, self.fcfs, self.headroom = policy, fcfs, headroom

    def check(self, f: Forecast | None, prompt_tokens: int, priority: int = 0, ttft_ms: float | None = None,
              elapsed_s: float = 0.0, pending_seqs: int = 0, pending_tokens: float = 0) -> Verdict:
        target = ttft_ms / 1e3 if ttft_ms else self.ttft_s
        if f is None or target is None:
            return Verdict(True, True, 0.0, prompt_tokens)
        target *= self.headroom
        work = prefill_equivalent(f.chunk_at, 0, prompt_tokens)
        t = predict_ttft(f, work, priority, self.fcfs, elapsed_s, pending_seqs, pending_tokens)
        if t <= target or self.policy == "queue":
            return Verdict(True, t <= target, t, work)
        wait = t - target if math.isfinite(t) else (f.slot_steps[-1] if f.slot_steps else 1) * f.step_s
        return Verdict(False, False, t, work, max(1, math.ceil(wait)))
