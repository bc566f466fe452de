"""Request timelines: what happened to each request, step by step, kept by the server with bounded memory.

An engine observer (engine/observers.py) on the engine thread. It keeps the recent steps' composition (who
computed how many tokens in each, who was preempted for whom: the core's StepStats) in a ring bounded by the
entries it holds, and per request (the in-flight ones and the most recent finished ones) its arrival, the
steps it took part in, its preemptions, when its outputs went out and how it ended. ``timeline(id)`` reads
them back with the blame for its time (engine/blame.py): served at ``GET /v1/requests/{id}/timeline``.
Steps are on the engine's clock (time.perf_counter: one clock across the machine's processes, so a core in
its own process stamps its steps on the same one).
"""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tokenmill.engine.blame import StepRecord, itl_blame, ttft_blame

if TYPE_CHECKING:
    from tokenmill.core.sched_output import KVTransferStats
    from tokenmill.engine.messages import StepStats
    from tokenmill.outputs import RequestOutput

MAX_REQUESTS = 1000  # finished requests kept (in-flight ones are always kept)
MAX_STEP_ENTRIES = 200_000  # (request, step) entries in the step ring: about 20 MB


@dataclass
class Timeline:
    request_id: str
    arrival: float
    steps: list[int] = field(default_factory=list)  # the step numbers it took part in
    preemptions: list[tuple[int, str]] = field(default_factory=list)  # (step number, for whom)
    # disaggregation: (the step that reported it, its KVTransferStats): a transfer ends between steps
    kv_transfers: list[tuple[float, KVTransferStats]] = field(default_factory=list)
    outputs: list[tuple[float, int]] = field(default_factory=list)  # (when sent, output tokens so far)
    prompt_tokens: int = 0
    cached_tokens: int = -1  # where its first step started (-1: not scheduled yet)
    finished: float | None = None
    finish_reason: str | None = None

    @property
    def first_token(self) -> float | None:
        return next((t for t, n in self.outputs if n > 0), None)


class TimelineRecorder:
    """``itl_target_s``: the gap between tokens past which a gap is explained (the server's ITL target or
    TPOT SLO; None: twice the request's own median gap)."""

    def __init__(self, max_requests: int = MAX_REQUESTS, max_step_entries: int = MAX_STEP_ENTRIES,
                 itl_target_s: float | None = None) -> None:
        self.max_requests, self.max_step_entries, self.itl_target_s = max_requests, max_step_entries, itl_target_s
        self._timelines: OrderedDict[str, Timeline] = OrderedDict()
        self._finished: deque[str] = deque()
        self._steps: deque[StepRecord] = deque()
        self._entries = 0
        self._number = 0
        self._lock = threading.Lock()  # the engine thread writes; HTTP handlers read

    # ---- the engine thread ----------------------------------------------------------

    def on_request_added(self, request_id: str, arrival: float) -> None:
        with self._lock:
            self._timelines[request_id] = Timeline(request_id, arrival)

    def on_request_output(self, out: RequestOutput, now: float) -> None:
        with self._lock:
            tl = self._timelines.get(out.request_id)
            if tl is None:
                return
            tl.prompt_tokens = len(out.prompt_token_ids)
            n = sum(len(c.token_ids) for c in out.outputs)
            if not tl.outputs or n > tl.outputs[-1][1]:
                tl.outputs.append((now, n))
            if out.finished:
                tl.finished = now
                tl.finish_reason = ",".join(str(c.finish_reason) for c in out.outputs)
                self._finished.append(out.request_id)
                while len(self._finished) > self.max_requests:
                    self._timelines.pop(self._finished.popleft(), None)

    def on_tokens(self, num_prompt_tokens: int, num_generation_tokens: int) -> None:
        pass

    def on_request_finished(self, output: RequestOutput, now: float) -> None:
        pass

    def on_step(self, stats: StepStats) -> None:
        with self._lock:
            for t in stats.kv_transfers or ():
                tl = self._timelines.get(t.request_id)
                if tl is not None:
                    tl.kv_transfers.append((stats.start_time, t))
            if stats.requests is None:
                return
            rec = StepRecord(self._number, stats.start_time, stats.duration, stats.requests, stats.preempted or {})
            self._number += 1
            self._steps.append(rec)
            self._entries += len(rec.requests) + 1
            while self._entries > self.max_step_entries and len(self._steps) > 1:
                self._entries -= len(self._steps.popleft().requests) + 1
            for rid, start, *_ in rec.requests:
                tl = self._timelines.get(rid)
                if tl is not None:
                    if not tl.steps or tl.cached_tokens < 0:
                        tl.cached_tokens = start
                    tl.steps.append(rec.number)
            for victim, needed_by in rec.preempted.items():
                tl = self._timelines.get(victim)
                if tl is not None:
                    tl.preemptions.append((rec.number, needed_by))

    # ---- readers (any thread) -------------------------------------------------------

    def _end(self, tl: Timeline) -> float:
        """Where the request's time ends so far: its finish, else the last step's end."""
        if tl.finished is not None:
            return tl.finished
        return self._steps[-1].end if self._steps else tl.arrival

    def timeline(self, request_id: str) -> dict | None:
        """The request's timeline and blame as JSON-ready data; None if it is not among those kept."""
        with self._lock:
            tl = self._timelines.get(request_id)
            if tl is None:
                return None
            end = self._end(tl)
            steps = [s for s in self._steps if s.end > tl.arrival and s.start < end]
            tl = Timeline(tl.request_id, tl.arrival, list(tl.steps), list(tl.preemptions), list(tl.kv_transfers),
                          list(tl.outputs), tl.prompt_tokens, tl.cached_tokens, tl.finished, tl.finish_reason)
        return describe(tl, steps, self.itl_target_s)

    def window(self, request_id: str) -> dict | None:
        """What a replay of the request's time needs (``tokenmill explain``): every kept request that arrived
        from the first arrival among those in flight with it to its end, each with its arrival (seconds
        after that first one), its prompt, cached and output tokens and its measured TTFT and gaps between
        outputs, and the front end's part of its TTFT. None if the request is not kept."""
        with self._lock:
            tl = self._timelines.get(request_id)
            if tl is None:
                return None
            kept, steps, end = list(self._timelines.values()), list(self._steps), self._end(tl)
        return {"request_id": request_id, "requests": _rows(kept, steps, tl.arrival, end)}

    def recent(self, max_requests: int) -> list[dict]:
        """The same rows for the traffic from the arrival of the oldest of the last ``max_requests`` finished
        requests until now (the server's live replay, server/live_replay.py); [] before any finished."""
        with self._lock:  # (references only: the rows are built outside, the engine thread never waits on them)
            kept, steps = list(self._timelines.values()), list(self._steps)
        done = sorted((x for x in kept if x.finished is not None), key=lambda x: x.arrival)
        if not done:
            return []
        return _rows(kept, steps, done[-max_requests:][0].arrival, max(x.finished for x in done))


def _rows(kept: list[Timeline], ring: list[StepRecord], t0: float, end: float) -> list[dict]:
    """Every kept request arriving from the first arrival among those in flight at any time in [t0, end]
    to ``end``, in arrival order; ``before``: it arrived before t0 (carried over). (Read while the engine
    thread may append to a timeline: a row may miss its latest step, never break.)"""
    beside = [x for x in kept if x.arrival <= end and (x.finished is None or x.finished >= t0)]
    start = min(x.arrival for x in beside)
    members = sorted((x for x in kept if start <= x.arrival <= end), key=lambda x: x.arrival)
    by_number = {s.number: s for s in ring}
    rows = []
    for x in members:
        times = [t for t, _ in x.outputs]
        steps = [by_number[n] for n in x.steps if n in by_number]
        first_out = next((s for s in steps if any(e[0] == x.request_id and e[4] for e in s.requests)), None)
        drafted = [e for s in steps for e in s.requests if e[0] == x.request_id and e[3]]
        rows.append({"request_id": x.request_id, "arrival_s": x.arrival - start,
                     # speculative decoding: drafts verified, and accepted (all it emitted but the target's own)
                     "drafts": sum(e[3] for e in drafted), "accepted": sum(max(e[4] - 1, 0) for e in drafted),
                     "prompt_tokens": x.prompt_tokens, "cached_tokens": max(x.cached_tokens, 0),
                     "output_tokens": x.outputs[-1][1] if x.outputs else 0,
                     "finished": x.finished is not None, "before": x.arrival < t0,
                     "ttft_s": None if x.first_token is None else x.first_token - x.arrival,
                     "e2e_s": None if x.finished is None else x.finished - x.arrival,
                     "itl_s": [b - a for a, b in zip(times, times[1:])],
                     # the front end's part: arrival to its first step, its first token's step to out
                     "to_first_step_s": steps[0].start - x.arrival if steps else None,
                     "out_after_step_s": (x.first_token - first_out.end
                                          if first_out is not None and x.first_token is not None else None)})
    return rows


def describe(tl: Timeline, steps: list[StepRecord], itl_target_s: float | None) -> dict:
    """A timeline as data: times in seconds since arrival, every step it took part in with the step's whole
    composition, preemptions and why, and the blame for its TTFT and its slow gaps between tokens."""
    t0 = tl.arrival
    own = set(tl.steps)
    kept_from = steps[0].number if steps else None
    events: list[dict] = [{"t": 0.0, "event": "arrived"}]
    preempted = dict(tl.preemptions)
    for s in steps:
        if s.number in own:
            me = next(e for e in s.requests if e[0] == tl.request_id)
            events.append({"t": s.start - t0, "event": "step", "step": s.number, "duration": s.duration,
                           "start_position": me[1], "tokens": me[2], "drafts": me[3], "emitted": me[4],
                           "kind": _kind(me), "batch_size": len(s.requests),
                           "batch": [_entry(e) for e in _largest(s.requests, tl.request_id)]})
        if s.number in preempted:
            why = preempted[s.number]
            events.append({"t": s.start - t0, "event": "preempted", "step": s.number,
                           "reason": "KV cache full", "needed_by": why})
    for reported, t in tl.kv_transfers:  # it ended by the step that reported it
        events.append({"t": reported - t.seconds - t0, "event": "kv_transfer", "direction": t.direction,
                       "duration": t.seconds, "blocks": t.num_blocks, "bytes": t.num_bytes, "error": t.error})
    events.sort(key=lambda e: e["t"])
    first = tl.first_token
    if first is not None:
        events.append({"t": first - t0, "event": "first_token"})
    if tl.finished is not None:
        events.append({"t": tl.finished - t0, "event": "finished", "reason": tl.finish_reason})
    status = "finished" if tl.finished is not None else "running" if tl.steps else "waiting"
    out = {"request_id": tl.request_id, "status": status, "prompt_tokens": tl.prompt_tokens,
           "cached_tokens": max(tl.cached_tokens, 0), "output_tokens": tl.outputs[-1][1] if tl.outputs else 0,
           "num_preemptions": len(tl.preemptions), "ttft_s": None if first is None else first - t0,
           "e2e_s": None if tl.finished is None else tl.finished - t0,
           "output_gaps_s": [b[0] - a[0] for a, b in zip(tl.outputs, tl.outputs[1:])], "events": events}
    missing = [n for n in tl.steps if kept_from is None or n < kept_from]
    if missing:
        out["note"] = f"{len(missing)} of its steps are no longer kept (the step ring keeps the most recent)"
    if first is not None:
        out["ttft_blame"] = ttft_blame(tl.request_id, t0, first, steps, own, preempted)
    out["itl_blame"] = itl_blame(tl.request_id, steps, own, itl_target_s)
    return out


BATCH_SHOWN = 16  # the other requests shown per step, the largest first


def _largest(entries: list[tuple], skip: str) -> list[tuple]:
    others = [e for e in entries if e[0] != skip]
    return others if len(others) <= BATCH_SHOWN else sorted(others, key=lambda e: -(e[2] + e[3]))[:BATCH_SHOWN]


def _kind(e: tuple) -> str:
    """A decode computes one token (with any drafts); anything longer is a prefill chunk."""
    return "decode" if e[2] == 1 else "prefill"


def _entry(e: tuple) -> dict:
    return {"request_id": e[0], "tokens": e[2], "drafts": e[3], "kind": _kind(e)}
