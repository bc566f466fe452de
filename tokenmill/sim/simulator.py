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

With prefill/decode disaggregation (``Disaggregation``), P producer and D decode instances run in the same
loop, each an engine of its own (its Scheduler and KV pool of the configured size, the same cost model, its
own clock), through the scheduler's own disaggregation states (core/scheduler.py), as the router and the
KV connector drive them (kv_transfer/). A request arrives at the producer with the fewest requests as its
prefill alone (max_tokens 1, ``do_remote_decode``: the token sampled there is thrown away, the blocks are
held when it ends). When that step ends it goes to the decode instance with the fewest requests
(``do_remote_prefill``), which admits it when it has a running slot and blocks for its prompt, like any
request (else it queues), and asks for the KV of prompt tokens 0..n-2 (``SchedulerOutput.kv_recv``). The
bytes move once both instances' links are free (one transfer at a time on each, first come first served)
and take bytes / bandwidth + latency (cost.py); when they are in, before each instance's next step, the
producer frees its blocks (``kv_send_done``) and the request runs from its last prompt token
(``kv_recv_done``): one step computes that token and samples the first output, then it decodes. Its
timings are the decode instance's from its arrival at the producer: TTFT = prefill queue + prefill + decode
queue + link wait + transfer + first step, the ITLs the decode instance's steps. A request that could
never fit is rejected (400) at arrival; an SLO admission sheds at the producer.

What it leaves out, to stay this small: the KV moves after the whole prefill, not layer by layer as it is
computed; a transfer has each link to itself rather than sharing its bandwidth, and never fails; the hops
between router and instances take no time; the router's balancing is on exact counts (the real one adds
its in-flight requests to a /metrics poll a second old, ties round robin: here the lowest index). The
engine does not yet build a KV role with tensor or pipeline parallelism or a draft model; the simulator
prices them (each device ships its shard over its own link).
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from tokenmill.bench.client import RequestResult
from tokenmill.bench.datasets import SampleRequest
from tokenmill.config import SchedulerConfig
from tokenmill.core.kv_cache import KVCacheManager
from tokenmill.core.assembly import make_admission, make_scheduler
from tokenmill.core.sched_output import KVRecv, ModelRunnerOutput
from tokenmill.request import Request
from tokenmill.sampling_params import SamplingParams
from tokenmill.perf.step_cost import StepShape
from tokenmill.perf.cost import kv_transfer_seconds, kv_transfer_tokens
from tokenmill.sim.spec import SimProposer, SpecDecoding, accepted_drafts, draft_cost_model
from tokenmill.spec_decode.stats import step_acceptance, summarize
from tokenmill.spec_decode.step import propose_drafts

SIM_TOKEN = 1  # what every simulated step "samples": any id that is not a stop token


@dataclass(frozen=True)
class SimStep:
    start: float
    duration: float
    prefill_tokens: int
    decode_tokens: int
    scheduled: tuple[tuple[str, int], ...]  # (request id, tokens computed) in scheduling order
    num_running: int  # after the step (a prefill instance's: during it, as its prefills end in it)
    num_waiting: int
    kv_blocks_used: int  # likewise
    breakdown: dict | None = None  # the cost model's account of the step, where it gives one
    num_draft_tokens: int = 0  # speculative decoding: drafts the step verified, and those accepted
    num_accepted_tokens: int = 0
    draft_s: float = 0.0  # of duration: the draft model's passes
    instance: int = 0  # which engine ran it (disaggregation: the producers first, then the decode instances)


@dataclass
class SimResult:
    results: list[RequestResult]
    steps: list[SimStep]
    duration: float
    num_preemptions: int
    num_blocks: int
    block_size: int
    spec: dict | None = None  # speculative decoding: vLLM's acceptance summary (spec_decode/stats.py)
    roles: tuple[str, ...] = ("serve",)  # each instance's: "serve", or "prefill" / "decode" (disaggregated)
    transfers: list | None = None  # disaggregation: a KVTransfer per request that reached a decode instance


@dataclass(frozen=True)
class Disaggregation:
    """Prefill/decode disaggregation: ``prefill`` producer and ``decode`` consumer instances, each an engine
    of the Simulator's configuration (scheduler, KV pool, cost model), and the link a request's KV crosses
    from one to the other: ``kv_token_bytes`` a token (cost.kv_bytes_per_token), ``link_bandwidth`` bytes/s
    (an instance's NICs together), ``link_latency`` seconds a transfer."""

    prefill: int
    decode: int
    kv_token_bytes: float
    link_bandwidth: float
    link_latency: float = 0.0

    def __post_init__(self) -> None:
        if self.prefill < 1 or self.decode < 1:
            raise ValueError(f"disaggregation needs at least one prefill and one decode instance, got "
                             f"{self.prefill}:{self.decode}")
        if not self.link_bandwidth > 0:
            raise ValueError(f"the KV link needs a positive bandwidth, got {self.link_bandwidth} bytes/s")

    def transfer(self, prompt_len: int, cached: int = 0) -> tuple[float, float]:
        """(bytes, seconds) of shipping a ``prompt_len``-token prompt's KV, less a ``cached`` prefix the
        consumer holds, over a free link."""
        nbytes = kv_transfer_tokens(prompt_len, cached) * self.kv_token_bytes
        return nbytes, kv_transfer_seconds(nbytes, self.link_bandwidth, self.link_latency)


@dataclass(frozen=True)
class KVTransfer:
    """One request's way through a disaggregated deployment, in seconds on the run's clock."""

    index: int  # the request's index in the workload
    producer: int  # instance indices (the producers first, then the decode instances)
    consumer: int
    arrival: float
    prefilled: float  # the producer's step that computed its last prompt token ended
    admitted: float  # the decode instance reserved its blocks and asked for the KV
    start: float  # both links were free: the bytes began to move
    end: float  # the KV is in the decode instance's blocks
    bytes: float


class _Instance:
    """One engine in the loop: its KV pool, scheduler (and drafter), its own clock, what was handed to it
    that it takes in before its next step (requests from the front end, KV transfers that ended: as the
    engine polls its connector before each step), the step it is running, and the steps it ran."""

    def __init__(self, sim: "Simulator", index: int, role: str) -> None:
        self.index, self.role = index, role
        self.kv = KVCacheManager(sim.num_blocks, sim.block_size, sim.enable_prefix_caching)
        spec = sim.spec
        self.proposer = SimProposer(spec, sim.block_size, sim.draft_cost) if spec is not None else None
        # the engine's scheduler (and SLO planner, on the cost model as the truth), a lane a step in flight
        self.sched = make_scheduler(sim.config, self.kv, sim.max_model_len, sim.cost, sim.steps_in_flight,
                                    self.proposer.finish if self.proposer is not None else None)
        self.admission = make_admission(sim.config)
        self.now = 0.0
        self.sched.clock = lambda: self.now
        self.inbox: list[tuple] = []  # ("new", k, prompt ids) | ("sent", k) | ("received", k, error)
        # the steps running, oldest first: (scheduler output, shape, seconds, of which drafting, start,
        # producer's counts, end); more than one with pipeline parallelism's steps in flight
        self.flight: deque[tuple] = deque()
        self.max_flight = sim.steps_in_flight
        self.stage_free = 0.0  # when the first stage can take the next step
        self.stalled = False  # steps in flight and nothing else to schedule: wait for one to end
        self.steps: list[SimStep] = []

    def next_time(self) -> float:
        """When this instance's next step ends, or (steps in flight) when it may launch another."""
        t = self.flight[0][-1] if self.flight else math.inf
        if self.flight and len(self.flight) < self.max_flight and not self.stalled and self._more():
            t = min(t, self.stage_free)
        return t

    def may_launch(self, t: float) -> bool:
        return (len(self.flight) < self.max_flight and self.stage_free <= t and self.has_work
                and (not self.flight or self._more()))

    def _more(self) -> bool:
        """Work for another step while some are in flight, as the engine checks it (engine/core.py
        _pipelined_step), or what was handed in."""
        return bool(self.inbox) or self.sched.has_work_beyond_in_flight()

    def slow_step(self, seconds: float) -> None:
        """The running step takes ``seconds`` longer (the front end took them from its cores)."""
        out, shape, dt, draft_s, start, during, end = self.flight[0]
        self.flight[0] = (out, shape, dt + seconds, draft_s, start, during, end + seconds)

    @property
    def has_work(self) -> bool:
        return bool(self.inbox) or self.sched.has_unfinished()

    @property
    def load(self) -> int:
        """Requests it holds or was handed (the router balances on running + waiting + in flight)."""
        return len(self.sched.requests) + sum(1 for item in self.inbox if item[0] == "new")


class Simulator:
    def __init__(self, cost: Callable[[StepShape], float], scheduler: SchedulerConfig, num_blocks: int,
                 block_size: int, max_model_len: int, enable_prefix_caching: bool = True,
                 keep_breakdown: bool = False, spec: SpecDecoding | None = None,
                 disaggregation: Disaggregation | None = None, steps_in_flight: int = 1,
                 request_overhead_s: float = 0.0, request_overhead_per_token_s: float = 0.0,
                 front_end_shares_cpu: bool = False) -> None:
        """steps_in_flight > 1: pipeline parallelism's steps in flight (``--pipeline-batches-in-flight``);
        the cost model then gives each step's ``pipeline_times`` (the first stage's turn, the latency).
        request_overhead_s (+ request_overhead_per_token_s a prompt token): the front end's time for a
        request outside the engine's steps (HTTP, tokenizing, the first token back to the client): each
        request reaches the scheduler that much after it arrives, and its TTFT and E2EL count from its
        arrival. front_end_shares_cpu: the front end runs on the engine's own cores (a CPU server), so that
        work also slows the step running when the request reaches the scheduler by as much (one step at a
        time only)."""
        if request_overhead_s < 0 or request_overhead_per_token_s < 0:
            raise ValueError(f"the request overhead (--request-overhead-ms) must be >= 0, got "
                             f"{1000 * request_overhead_s:g} ms + {1000 * request_overhead_per_token_s:g} ms a prompt token")
        self.request_overhead = (request_overhead_s, request_overhead_per_token_s)
        self.front_end_shares_cpu = front_end_shares_cpu
        if steps_in_flight > 1 and not hasattr(getattr(cost, "inner", cost), "pipeline_times"):
            raise ValueError("steps in flight need a pipeline-parallel roofline cost model (--hardware with "
                             "--pipeline-parallel-size > 1)")
        self.steps_in_flight = steps_in_flight
        self.cost, self.config = cost, scheduler
        self.num_blocks, self.block_size, self.max_model_len = num_blocks, block_size, max_model_len
        self.enable_prefix_caching, self.keep_breakdown = enable_prefix_caching, keep_breakdown
        self.spec, self.disaggregation = spec, disaggregation
        # the off rule's cost curve, as the engine measures it at startup (here: from the cost models)
        self.draft_cost = (draft_cost_model(cost, spec.drafter, spec.k, max_model_len)
                           if spec is not None else None)

    def run(self, requests: Sequence[SampleRequest], arrivals: Sequence[float], seed: int = 0) -> SimResult:
        return _Run(self, requests, arrivals, seed).run()

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


class _Run:
    """One run of the event loop over a Simulator's instances. Its events, in time order: a step ends (the
    scheduler takes its sampled tokens; a producer's finished prefill is handed to a decode instance), a
    request arrives (at a front instance), a KV transfer ends (at both its instances); then every idle
    instance with work takes in what it was handed and starts its next step. At equal times they come in
    that order, instances by index. One instance is the engine's own loop."""

    def __init__(self, sim: Simulator, requests: Sequence[SampleRequest], arrivals: Sequence[float],
                 seed: int) -> None:
        self.sim, self.requests, self.arrivals = sim, requests, arrivals
        dis = sim.disaggregation
        self.roles = ["serve"] if dis is None else ["prefill"] * dis.prefill + ["decode"] * dis.decode
        self.insts = [_Instance(sim, i, role) for i, role in enumerate(self.roles)]
        self.front = [x for x in self.insts if x.role != "decode"]
        self.decoders = [x for x in self.insts if x.role == "decode"]
        self.rng = np.random.default_rng(seed)
        self.spec_rng = np.random.default_rng([seed, 1])  # acceptance draws: the prompts' stream stays as without
        self.spec_steps = []
        self.by_id: dict[str, tuple[int, Request]] = {}
        self.rejected: dict[int, str] = {}
        self.shed: dict[int, str] = {}
        # disaggregation: when each instance's link is next free, the transfers' ends (a heap of (time,
        # order, instance, inbox item)), each request's producer and prefill end, and the transfers
        self.link_free = [0.0] * len(self.insts)
        self.landing: list[tuple] = []
        self.order = itertools.count()  # the heap's tie-break
        self.prefilled: dict[int, tuple[int, float]] = {}
        self.transfers: dict[int, KVTransfer] = {}

    def run(self) -> SimResult:
        sim, requests, insts = self.sim, self.requests, self.insts
        fixed, per_token = sim.request_overhead
        overhead = [fixed + per_token * r.prompt_len for r in requests]  # the front end's time for each
        arrivals = [a + o for a, o in zip(self.arrivals, overhead)]  # at the scheduler
        order = np.argsort(np.asarray(arrivals, dtype=float), kind="stable")
        i, n = 0, len(requests)
        while True:
            t = min(x.next_time() for x in insts)
            if i < n:
                t = min(t, float(arrivals[order[i]]))
            if self.landing:
                t = min(t, self.landing[0][0])
            if math.isinf(t):
                break
            for x in insts:  # 1. steps that end now
                while x.flight and x.flight[0][-1] == t:
                    self._end_step(x)
            while i < n and arrivals[order[i]] <= t:  # 2. arrivals, to the least loaded front instance
                k = int(order[i])
                i += 1
                r = requests[k]
                ids = (list(r.prompt_ids) if r.prompt_ids else
                       self.rng.integers(100, 30000, max(r.prompt_len, 1)).tolist())
                front = min(self.front, key=lambda y: y.load)
                front.inbox.append(("new", k, ids))
                front.stalled = False
                if sim.front_end_shares_cpu and front.flight and front.max_flight == 1:
                    front.slow_step(overhead[k])
            while self.landing and self.landing[0][0] <= t:  # ... and the transfers that ended
                _, _, d, item = heapq.heappop(self.landing)
                insts[d].inbox.append(item)
                insts[d].stalled = False
            for x in insts:  # 3. idle instances with work (or room for another step in flight) start a step
                if x.may_launch(t):
                    x.now = max(x.now, t)
                    self._take_in(x)
                    self._start_step(x)
        if any(x.has_work for x in insts):
            raise RuntimeError("the simulated scheduler stalled with requests left")
        results = [sim._result(k, requests[k], self.by_id.get(str(k)), self.rejected.get(k), self.shed.get(k),
                               self.arrivals[k], sim.spec is not None) for k in range(n)]
        steps = sorted((s for x in insts for s in x.steps), key=lambda s: s.start)
        return SimResult(results, steps, max(x.now for x in insts), sum(x.sched.num_preemptions for x in insts),
                         sim.num_blocks, sim.block_size, summarize(self.spec_steps) if sim.spec is not None else None,
                         tuple(self.roles),
                         [self.transfers[k] for k in sorted(self.transfers)] if sim.disaggregation else None)

    def _take_in(self, x: _Instance) -> None:
        """What was handed to an instance reaches its scheduler. A transfer that ended: the producer's held
        blocks are freed (``kv_send_done``), the consumer's request runs from its last prompt token
        (``kv_recv_done``). A new request, checked as the server checks it (can it ever fit; with an SLO
        admission, is its TTFT predicted to meet it): at a producer, its prefill alone (max_tokens 1, asking
        for remote decode: its blocks are held when it ends; checked against the decode instances too,
        where it must fit); at a decode instance, asking for remote prefill (the scheduler reserves its
        blocks when there is room, then asks for the KV: ``SchedulerOutput.kv_recv``)."""
        requests, sched = self.requests, x.sched
        for item in x.inbox:
            if item[0] == "sent":
                sched.kv_send_done(str(item[1]))
                continue
            if item[0] == "received":
                sched.kv_recv_done(str(item[1]), item[2])
                continue
            _, k, ids = item
            r = requests[k]
            max_tokens = 1 if x.role == "prefill" else r.output_len
            kv_transfer = ({"do_remote_decode": True} if x.role == "prefill" else
                           {"do_remote_prefill": True, "remote_instance": self.prefilled[k][0]}
                           if x.role == "decode" else None)
            req = Request(str(k), ids, SamplingParams(max_tokens=max_tokens, ignore_eos=True), frozenset(), max_tokens,
                          kv_transfer=kv_transfer)
            req.timings.arrival = float(self.arrivals[k])
            if x.role == "decode":
                sched.add_request(req)  # it fits: checked on its arrival at the producer
                self.by_id[req.request_id] = (k, req)
                continue
            if x.admission is not None:
                verdict = x.admission.check(sched.planner.forecast(sched), len(ids))
                if not verdict.admit:  # the server's 503, at once
                    self.shed[k] = f"shed: predicted TTFT {verdict.predicted_ttft_s:.2f} s"
                    continue
            try:
                if x.role == "prefill":
                    self.decoders[0].sched.check_fits(len(ids), r.output_len)
                sched.add_request(req)
            except ValueError as e:  # can never fit: the server would answer 400
                self.rejected[k] = str(e)
                continue
            self.by_id[req.request_id] = (k, req)
        x.inbox = []

    def _start_step(self, x: _Instance) -> None:
        """The instance's next step, scheduled at its clock; it ends after the cost model's time. A decode
        instance's KV pulls start now. Nothing to schedule (requests waiting for their KV, or for room a
        held or pulled block frees): it stays idle until something arrives."""
        if not x.sched.has_unfinished():  # all it was handed was shed or rejected, or was a transfer's end
            return
        sim = self.sim
        for _ in range(x.max_flight):  # steps in flight: a lane with nothing to run, its turn passes (the
            out = x.sched.schedule()   # engine's loop calls again at once)
            for recv in out.kv_recv:
                self._pull(x, recv)
            if not out.is_empty or x.flight:
                break
        if out.is_empty:
            x.stalled = bool(x.flight)
            return
        shape = StepShape.of(out)
        draft_s = 0.0
        if x.proposer is not None and sim.spec.drafter is not None:  # (rank 0 drafts before it launches)
            draft_s = sum(sim.spec.drafter(p) for p in x.proposer.take_passes())
        # a producer's batch and pool are counted during its steps (its requests leave when their prefill ends)
        during = (len(x.sched.running), x.kv.num_blocks - x.kv.num_free_blocks) if x.role == "prefill" else None
        if x.max_flight > 1:  # pipeline stages: the first is free after its turn, the step ends P turns on
            turn, latency = sim.cost.pipeline_times(shape)
            x.stage_free = x.now + draft_s + turn
            # (the engine's planner is not corrected with steps in flight: a step's wall time is not its cost)
            end = max(x.now + draft_s + latency, x.flight[-1][-1] + turn if x.flight else 0.0)  # stages in order
            x.flight.append((out, shape, end - x.now, draft_s, x.now, during, end))
            return
        dt = sim.cost(shape) + draft_s
        if x.sched.planner.predicts:  # as the engine: the planner corrects by observed / predicted
            x.sched.planner.observe(shape, dt)
        x.flight.append((out, shape, dt, draft_s, x.now, during, x.now + dt))

    def _pull(self, x: _Instance, recv: KVRecv) -> None:
        """A decode instance asks for a request's KV: prompt tokens [first_block x block_size, n - 1) move
        from its producer once both instances' links are free, each link one transfer at a time."""
        k = int(recv.request_id)
        p, prefilled = self.prefilled[k]
        cached = recv.first_block * x.kv.block_size
        nbytes, seconds = self.sim.disaggregation.transfer(recv.num_tokens + 1, cached)
        start = max(x.now, self.link_free[p], self.link_free[x.index])
        self.link_free[p] = self.link_free[x.index] = end = start + seconds
        heapq.heappush(self.landing, (end, next(self.order), x.index, ("received", k, None)))
        heapq.heappush(self.landing, (end, next(self.order), p, ("sent", k)))
        self.transfers[k] = KVTransfer(k, p, x.index, float(self.arrivals[k]), prefilled, x.now, start, end, nbytes)

    def _end_step(self, x: _Instance) -> None:
        """The running step ends: every request that needed a token gets one (with speculative decoding,
        its accepted drafts and one more); a producer's finished prefills go to the least loaded decode
        instance (as the router sends them on when the producer answers)."""
        sim, spec = self.sim, self.sim.spec
        out, shape, dt, draft_s, start, during, end = x.flight.popleft()
        x.now, x.stalled = max(x.now, end), False
        if x.proposer is None:
            sampled = {s.request_id: [SIM_TOKEN] for s in out.scheduled if s.needs_logits}
        else:
            sampled = {s.request_id: [SIM_TOKEN] * (1 + accepted_drafts(self.spec_rng, s.num_draft_tokens,
                                                                          spec.acceptance))
                       for s in out.scheduled if s.needs_logits}
        x.sched.update_from_output(out, ModelRunnerOutput(sampled))
        if x.proposer is not None:  # the next step's drafts (priced when it launches, as rank 0 runs them first)
            propose_drafts(x.sched, x.proposer)
        drafted = accepted = 0
        if x.proposer is not None:
            stats = step_acceptance(out.scheduled, sampled, spec.k)
            if stats.num_drafts:
                self.spec_steps.append(stats)
            drafted, accepted = stats.num_draft_tokens, stats.num_accepted_tokens
        b = None
        breakdown = getattr(sim.cost, "breakdown", None) if sim.keep_breakdown else None
        if breakdown:
            b = breakdown(shape)
            if draft_s:
                b = {**b, "draft_s": draft_s, "seconds": b["seconds"] + draft_s}
        sched, kv = x.sched, x.kv
        running, blocks = during or (len(sched.running), kv.num_blocks - kv.num_free_blocks)
        x.steps.append(SimStep(start, dt, out.num_prefill_tokens, out.num_decode_tokens,
                               tuple((s.request_id, len(s.token_ids)) for s in out.scheduled),
                               running, len(sched.waiting), blocks, b, drafted, accepted, draft_s, x.index))
        if x.role == "prefill":
            for send in sched.take_kv_sends():
                k = int(send.request_id)
                self.prefilled[k] = (x.index, x.now)
                min(self.decoders, key=lambda y: y.load).inbox.append(("new", k, send.prompt_token_ids))
