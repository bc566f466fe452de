"""When drafting pays: how many drafts a request gets this step (the off rule).

A draft costs a share c of a decode step whether or not it is accepted: its verification (the target's
step grows by a token) plus, for a draft model, the drafter's pass. The engine measures c at startup
(``measure_draft_cost``): on the CPU kernels a gguf target's verification step of 1 + d tokens took about
1 + 0.5 d decode steps (the integer GEMMs at a few tokens are compute-bound), a float target's about
1 + 0.1 d, and a gguf drafter's pass about 0.25 of a float target's decode step (BENCHMARKS.md,
speculative decoding). Draft i (1-based) is accepted with probability about a^i, for a request's recent
per-draft acceptance a, so it pays while a^i > c. A request whose acceptance fell so low that no draft
pays gets none, and one probe draft every PROBE_EVERY steps to notice when its text starts to repeat
again.
"""

from __future__ import annotations

DRAFT_COST = 0.5  # c where it is not measured: a gguf target's verification of one draft token
PROBE_EVERY = 8  # steps without drafts before one probe draft
EMA = 0.5  # weight of the newest step in the acceptance estimate


def worthwhile_drafts(acceptance: float, steps_without_drafts: int, limit: int = 64,
                      draft_cost: float = DRAFT_COST) -> int:
    n, p = 0, acceptance
    while n < limit and p > draft_cost:
        n += 1
        p *= acceptance
    if n == 0 and steps_without_drafts >= PROBE_EVERY and draft_cost < 1:  # at c >= 1 no draft ever pays
        return 1
    return n


def update_acceptance(acceptance: float, accepted: int, drafted: int) -> float:
    """The per-draft acceptance a with a^drafted matched to this step: accepting all counts as 1, the
    first rejected at position j as the fraction j / drafted (a simple, monotone estimate)."""
    return (1 - EMA) * acceptance + EMA * (accepted / drafted)


def measure_draft_cost(time_target, time_drafter, k: int) -> float:
    """c for k drafts, in decode steps: time_target(n) times the target's step over n tokens of one
    request, time_drafter() one drafter pass (None: drafting is free, as n-gram lookup is)."""
    one = time_target(1)
    verify = max(time_target(1 + k) - one, 0.0) / k
    draft = time_drafter() if time_drafter is not None else 0.0
    return (verify + draft) / one
