"""Blame: a request's time split into its causes, from the steps the engine ran (engine/timelines.py).

Time to first token is the window from the request's arrival to its first token going out. Every step that
ran in the window is charged for its part of it, split among the step's requests by the tokens each computed
(a decode counts its one token and its drafts): the request's own share is its own compute; the rest is
charged to the requests it went to, as queueing (steps before the request's first), time shared with others
in its own steps, time preempted (steps after a preemption took its blocks) or time waiting for a turn
(steps after its first that did not include it). What no step covers is the time between steps (the engine
loop, the front end, sending the token). The parts add up to the window by construction.

A gap between two of its tokens longer than the target is charged the same way over the steps in the gap,
and named by its largest cause ("a 480-token prefill chunk of request X").
"""

from __future__ import annotations

import statistics
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Iterable

TOP = 10  # requests named per cause


@dataclass(frozen=True)
class StepRecord:
    number: int
    start: float
    duration: float
    requests: list[tuple[str, int, int, int, int]]  # (id, start position, tokens, drafts, emitted)
    preempted: dict[str, str]  # preempted request -> the one that needed its blocks

    @property
    def end(self) -> float:
        return self.start + self.duration


def _weights(step: StepRecord) -> dict[str, int]:
    return {e[0]: e[2] + e[3] for e in step.requests}


def _split(step: StepRecord, seconds: float, into: Counter, tokens: Counter | None = None,
           skip: str | None = None) -> float:
    """Charge ``seconds`` of ``step`` to its requests (but ``skip``) by their tokens; the part charged."""
    w = _weights(step)
    total = sum(w.values()) or 1
    charged = 0.0
    for rid, n in w.items():
        if rid != skip:
            into[rid] += seconds * n / total
            charged += seconds * n / total
            if tokens is not None:
                tokens[rid] += n
    return charged


def _top(seconds: Counter, tokens: Counter | None = None) -> dict:
    named = [{"request_id": rid, "seconds": s, **({"tokens": tokens[rid]} if tokens is not None else {})}
             for rid, s in seconds.most_common(TOP)]
    return {"seconds": sum(seconds.values()), "by_request": named}


def ttft_blame(request_id: str, t0: float, t1: float, steps: Iterable[StepRecord], own: set[int],
               preempted: dict[int, str]) -> dict:
    """The window [t0, t1] (arrival, first token out) charged to its causes. ``own``: the numbers of the
    steps the request took part in; ``preempted``: step number -> the request that needed its blocks."""
    first = min(own) if own else float("inf")
    queue, queue_tokens, shared, lost, turn = Counter(), Counter(), Counter(), Counter(), Counter()
    mine = covered = 0.0
    out_since = None  # preempted: from this step until it runs again
    for s in sorted(steps, key=lambda s: s.number):
        if s.number in preempted:
            out_since = s.number
        overlap = min(s.end, t1) - max(s.start, t0)
        if overlap <= 0:
            continue
        covered += overlap
        if s.number in own:
            out_since = None
            w = _weights(s)
            share = overlap * w[request_id] / (sum(w.values()) or 1)
            mine += share
            _split(s, overlap, shared, skip=request_id)
        elif s.number < first:
            _split(s, overlap, queue, queue_tokens)
        elif out_since is not None:
            _split(s, overlap, lost)
        else:
            _split(s, overlap, turn)
    total = t1 - t0
    parts = {"total_s": total, "queue": _top(queue, queue_tokens), "own_compute_s": mine,
             "shared_steps": _top(shared), "preempted": _top(lost), "waiting_for_a_turn": _top(turn),
             "between_steps_s": total - covered}
    parts["summary"] = _ttft_summary(parts)
    return parts


def _ttft_summary(p: dict) -> str:
    causes = [("queued behind", p["queue"]), ("sharing its steps with", p["shared_steps"]),
              ("preempted for", p["preempted"]), ("waiting for a turn behind", p["waiting_for_a_turn"])]
    what, part = max(causes, key=lambda c: c[1]["seconds"])
    big = max(part["seconds"], p["own_compute_s"], p["between_steps_s"])
    if big == p["own_compute_s"]:
        return f"mostly its own prefill: {p['own_compute_s']:.3f} s of {p['total_s']:.3f} s"
    if big == p["between_steps_s"]:
        return f"mostly between steps (engine loop, front end): {p['between_steps_s']:.3f} s of {p['total_s']:.3f} s"
    top = part["by_request"][0]
    tokens = f" ({top['tokens']} tokens)" if "tokens" in top else ""
    return (f"mostly {what} other requests: {part['seconds']:.3f} s of {p['total_s']:.3f} s, the most "
            f"{top['seconds']:.3f} s for request {top['request_id']}{tokens}")


def itl_blame(request_id: str, steps: list[StepRecord], own: set[int], target_s: float | None) -> dict:
    """The gaps between the request's tokens (step end to step end) over ``target_s`` (None: twice its median
    gap), each charged to the requests in the steps it spanned and named by its largest cause."""
    emits = [s for s in steps if s.number in own and any(e[0] == request_id and e[4] for e in s.requests)]
    gaps = [(a, b, b.end - a.end) for a, b in zip(emits, emits[1:])]
    if target_s is None:
        if len(gaps) < 3:
            return {"target_s": None, "spikes": []}
        target_s = 2 * statistics.median(g for _, _, g in gaps)
    spikes = []
    for a, b, gap in gaps:
        if gap <= target_s:
            continue
        others, mine, covered, biggest = Counter(), 0.0, 0.0, None
        for s in steps:
            overlap = min(s.end, b.end) - max(s.start, a.end)
            if overlap <= 0:
                continue
            covered += overlap
            charged = _split(s, overlap, others, skip=request_id)
            mine += overlap - charged if s.number in own else 0.0
            for e in s.requests:
                if e[0] != request_id and (biggest is None or e[2] + e[3] > biggest[2] + biggest[3]):
                    biggest = e
        spikes.append({"step": b.number, "gap_s": gap, "own_compute_s": mine, "others": _top(others),
                       "between_steps_s": gap - covered, "cause": _describe(biggest)})
    return {"target_s": target_s, "spikes": spikes}


def _describe(e: tuple | None) -> str:
    if e is None:
        return "no other request: the step itself, or time between steps"
    if e[2] > 1:
        return f"a {e[2]}-token prefill chunk of request {e[0]}"
    return f"a decode of request {e[0]}" + (f" with {e[3]} drafts" if e[3] else "")
