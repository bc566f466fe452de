"""The discrete-event simulator: the real Scheduler and KVCacheManager, a clock a cost model advances.

Requests arrive on the benchmark's schedule; whenever the scheduler has work, one step is scheduled
exactly as the engine would schedule it, its duration is predicted from its shape, the clock moves on by
that much, and every request that needed a token gets one (never end-of-sequence: each runs to its
max_tokens, as ``tokenmill bench`` asks with EOS ignored). Each request's arrival, first-token and
per-token times come out as the benchmark's ``RequestResult``, so its metrics, reports and plots apply.

With speculative decoding (``spec``, sim/spec.py) the scheduler gets a proposer as the engine's does:
its off rule picks each decoding request's drafts, their KV slots are reserved, the step carries them;
the step's time is the target's over that shape plus the draft model's passes, and each drafted request
gets its accepted drafts (drawn from the acceptance model, on a seeded stream of its own) and one more
token, all at the step's end: one streamed chunk, as the server sends it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from tokenmill.bench.client import RequestResult
from tokenmill.bench.datasets import SampleRequest
from tokenmill.config import SchedulerConfig
from tokenmill.core.kv_cache import KVCacheManager
from tokenmill.core.scheduler import ModelRunnerOutput, Scheduler
from tokenmill.request import Request
from tokenmill.sampling_params import SamplingParams
from tokenmill.core.step_cost import StepShape
from tokenmill.core.step_planner import SLOAdmission, SLOPlanner
from tokenmill.sim.cost import draft_cost_model
from tokenmill.sim.spec import SimProposer, SpecDecoding, accepted_drafts
from tokenmill.spec_decode.stats import step_acceptance, summarize

SIM_TOKEN = 1  # what every simulated step "samples": any id that is not a stop token


@dataclass(frozen=True)
class SimStep:
    start: float
    duration: float
    prefill_tokens: int
    decode_tokens: int
    scheduled: tuple[tuple[str, int], ...]  # (request id, tokens computed) in scheduling order
    num_running: int
    num_waiting: int
    kv_blocks_used: int
    breakdown: dict | None = None  # the cost model's account of the step, where it gives one
    num_draft_tokens: int = 0  # speculative decoding: drafts the step verified, and those accepted
    num_accepted_tokens: int = 0
    draft_s: float = 0.0  # of duration: the draft model's passes


@dataclass
class SimResult:
    results: list[RequestResult]
    steps: list[SimStep]
    duration: float
    num_preemptions: int
    num_blocks: int
    block_size: int
    spec: dict | None = None  # speculative decoding: vLLM's acceptance summary (spec_decode/stats.py)


class Simulator:
    def __init__(self, cost: Callable[[StepShape], float], scheduler: SchedulerConfig, num_blocks: int,
                 block_size: int, max_model_len: int, enable_prefix_caching: bool = True,
                 keep_breakdown: bool = False, spec: SpecDecoding | None = None) -> None:
        self.cost, self.config = cost, scheduler
        self.num_blocks, self.block_size, self.max_model_len = num_blocks, block_size, max_model_len
        self.enable_prefix_caching, self.keep_breakdown = enable_prefix_caching, keep_breakdown
        self.spec = spec
        # the off rule's cost curve, as the engine measures it at startup (here: from the cost models)
        self.draft_cost = (draft_cost_model(cost, spec.drafter, spec.k, max_model_len)
                           if spec is not None else None)

    def run(self, requests: Sequence[SampleRequest], arrivals: Sequence[float], seed: int = 0) -> SimResult:
        kv = KVCacheManager(self.num_blocks, self.block_size, self.enable_prefix_caching)
        spec = self.spec
        proposer = SimProposer(spec, self.block_size, self.draft_cost) if spec is not None else None
        sched = Scheduler(self.config, kv, self.max_model_len, proposer)
        spec_rng = np.random.default_rng([seed, 1])  # acceptance draws: the prompts' stream stays as without
        spec_steps = []
        admission = None
        if self.config.plans_steps:  # the engine's SLO planner, on the cost model as the truth
            sched.planner = SLOPlanner(self.config, self.cost)
            admission = SLOAdmission(self.config.slo_ttft_ms, self.config.slo_policy, self.config.policy == "fcfs")
        now = 0.0
        sched.clock = lambda: now
        rng = np.random.default_rng(seed)
        order = np.argsort(np.asarray(arrivals, dtype=float), kind="stable")
        by_id: dict[str, tuple[int, Request]] = {}
        steps: list[SimStep] = []
        rejected: dict[int, str] = {}
        shed: dict[int, str] = {}
        i, n = 0, len(requests)
        breakdown = getattr(self.cost, "breakdown", None) if self.keep_breakdown else None
        while i < n or sched.has_unfinished():
            while i < n and arrivals[order[i]] <= now:
                k = int(order[i])
                i += 1
                r = requests[k]
                ids = list(r.prompt_ids) if r.prompt_ids else rng.integers(100, 30000, max(r.prompt_len, 1)).tolist()
                req = Request(str(k), ids, SamplingParams(max_tokens=r.output_len, ignore_eos=True), frozenset(),
                              r.output_len)
                req.timings.arrival = float(arrivals[k])
                if admission is not None:
                    verdict = admission.check(sched.planner.forecast(sched), len(ids))
                    if not verdict.admit:  # the server's 503, at once
                        shed[k] = f"shed: predicted TTFT {verdict.predicted_ttft_s:.2f} s"
                        continue
                try:
                    sched.add_request(req)
                except ValueError as e:  # can never fit: the server would answer 400
                    rejected[k] = str(e)
                    continue
                by_id[req.request_id] = (k, req)
            if not sched.has_unfinished():
                if i < n:
                    now = float(arrivals[order[i]])
                continue
            out = sched.schedule()
            if out.is_empty:  # nothing can run until more arrives (cannot happen with work admitted)
                if i >= n:
                    raise RuntimeError("the simulated scheduler stalled with requests left")
                now = float(arrivals[order[i]])
                continue
            shape = StepShape.of(out)
            dt = self.cost(shape)
            draft_s = 0.0
            if proposer is not None and spec.drafter is not None:
                draft_s = sum(spec.drafter(p) for p in proposer.take_passes())
                dt += draft_s
            if sched.planner.predicts:  # as the engine: the planner corrects by observed / predicted
                sched.planner.observe(shape, dt)
            start = now
            now += dt
            if proposer is None:
                sampled = {s.request_id: [SIM_TOKEN] for s in out.scheduled if s.needs_logits}
            else:
                sampled = {s.request_id: [SIM_TOKEN] * (1 + accepted_drafts(spec_rng, s.num_draft_tokens,
                                                                              spec.acceptance))
                           for s in out.scheduled if s.needs_logits}
            sched.update_from_output(out, ModelRunnerOutput(sampled))
            drafted = accepted = 0
            if proposer is not None:
                stats = step_acceptance(out.scheduled, sampled, spec.k)
                if stats.num_drafts:
                    spec_steps.append(stats)
                drafted, accepted = stats.num_draft_tokens, stats.num_accepted_tokens
            b = None
            if breakdown:
                b = breakdown(shape)
                if draft_s:
                    b = {**b, "draft_s": draft_s, "seconds": b["seconds"] + draft_s}
            steps.append(SimStep(start, dt, out.num_prefill_tokens, out.num_decode_tokens,
                                 tuple((s.request_id, len(s.token_ids)) for s in out.scheduled),
                                 len(sched.running), len(sched.waiting), kv.num_blocks - kv.num_free_blocks,
                                 b, drafted, accepted, draft_s))
        results = [self._result(k, requests[k], by_id.get(str(k)), rejected.get(k), shed.get(k), arrivals[k],
                                spec is not None) for k in range(n)]
        return SimResult(results, steps, now, sched.num_preemptions, self.num_blocks, self.block_size,
                         summarize(spec_steps) if spec is not None else None)

    @staticmethod
    def _result(k: int, r: SampleRequest, entry, error: str | None, shed: str | None, arrival: float,
                multi_token: bool = False) -> RequestResult:
        if shed is not None:
            return RequestResult(k, r.prompt_len, r.output_len, scheduled_s=arrival, start_s=arrival, end_s=arrival,
                                 success=False, error=shed, status=503)
        if entry is None:
            return RequestResult(k, r.prompt_len, r.output_len, success=False, error=error or "not run", status=400)
        _, req = entry
        t = req.timings
        times = t.token_times
        # one streamed chunk a step: a step's tokens (accepted drafts and the one after) share its time
        chunks = [a for i, a in enumerate(times) if i == 0 or a != times[i - 1]] if multi_token else times
        return RequestResult(k, r.prompt_len, r.output_len, scheduled_s=t.arrival, start_s=t.arrival,
                             end_s=t.finished, success=True, status=200, ttft_s=times[0] - t.arrival,
                             itl_s=[b - a for a, b in zip(chunks, chunks[1:])], e2el_s=t.finished - t.arrival,
                             prompt_tokens=req.num_prompt_tokens, completion_tokens=len(times), finish_reason="length")
