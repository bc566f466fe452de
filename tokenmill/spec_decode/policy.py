"""When drafting pays: how many drafts a request gets this step (the off rule).

A draft costs a share of a decode step to verify whether or not it is accepted: on the CPU kernels a
verification step of 1 + d tokens took about 1 + 0.5 d decode steps (BENCHMARKS.md, speculative decoding:
the integer GEMMs at a few tokens are compute-bound). Draft i (1-based) is accepted with probability about
a^i, for a request's recent per-draft acceptance a, so it pays while a^i > DRAFT_COST. A request whose
acceptance fell so low that no draft pays gets none, and one probe draft every PROBE_EVERY steps to
notice when its text starts to repeat again.
"""

from __future__ import annotations

DRAFT_COST = 0.5  # verification time of one draft token, in decode steps (measured; see above)
PROBE_EVERY = 8  # steps without drafts before one probe draft
EMA = 0.5  # weight of the newest step in the acceptance estimate


def worthwhile_drafts(acceptance: float, steps_without_drafts: int, limit: int = 64) -> int:
    n, p = 0, acceptance
    while n < limit and p > DRAFT_COST:
        n += 1
        p *= acceptance
    if n == 0 and steps_without_drafts >= PROBE_EVERY:
        return 1
    return n


def update_acceptance(acceptance: float, accepted: int, drafted: int) -> float:
    """The per-draft acceptance a with a^drafted matched to this step: accepting all counts as 1, the
    first rejected at position j as the fraction j / drafted (a simple, monotone estimate)."""
    return (1 - EMA) * acceptance + EMA * (accepted / drafted)
