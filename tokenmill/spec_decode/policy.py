"""When drafting pays: how many drafts a request gets this step (the off rule).

A draft costs a share c of a decode step whether or not it is accepted: its verification (the target's
step grows by a token) plus, for a draft model, the drafter's pass. The engine measures the step times
c follows from at startup (``DraftCostModel``), and c grows with the batch: on the CPU kernels a gguf target's verification step of 1 + d tokens took about
1 + 0.5 d decode steps (the integer GEMMs at a few tokens are compute-bound), a float target's about
1 + 0.1 d, and a gguf drafter's pass about 0.25 of a float target's decode step (BENCHMARKS.md,
speculative decoding). Draft i (1-based) is accepted with probability about a^i, for a request's recent
per-draft acceptance a, so it pays while a^i > c. A request whose acceptance fell so low that no draft
pays gets none, and one probe draft every PROBE_EVERY steps to notice when its text starts to repeat
again.
"""

from __future__ import annotations

DRAFT_COST = 0.5  # c where it is not measured: a gguf target's verification of one draft token, alone
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


PROBE_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)  # tokens per step the engine times at startup
CATCH_UP_SHARE = 0.25  # most of a request's remaining time a drafter's catch-up pass may take


class DraftCostModel:
    """c at a batch of B decoding requests, from step times measured at startup: target(n), the target's
    step over n tokens, and drafter(n), a drafter pass over n (None: drafting is free, as n-gram lookup
    is); both interpolated piecewise linearly and extended past the largest size by the last slope.

    Each of B requests drafting k tokens turns a step of B tokens into one of B (1 + k), and adds k
    drafter passes over B: per draft, [target(B (1 + k)) - target(B)] / (B k) + drafter(B) / B, against
    target(B) / B per token of a plain decode step. Where the step is memory-bound (few requests) that
    is small; where it is compute-bound (many requests) it reaches 1 and no draft pays."""

    def __init__(self, target: dict[int, float], drafter: dict[int, float] | None, k: int) -> None:
        self.target, self.drafter, self.k = sorted(target.items()), sorted(drafter.items()) if drafter else None, k

    @staticmethod
    def _at(points: list[tuple[int, float]], n: float) -> float:
        for (n0, t0), (n1, t1) in zip(points, points[1:]):
            if n <= n1 or (n1, t1) == points[-1]:
                return t0 + (t1 - t0) * (n - n0) / (n1 - n0)
        return points[0][1]

    def catch_up_pays(self, lag: int, remaining: int, batch: int) -> bool:
        """A drafter that lags a request by ``lag`` tokens (never drafted for it, or not for a while)
        first runs over them: worth it only where that pass is a small share (CATCH_UP_SHARE) of the
        time the request has left, ``remaining`` tokens at a step of ``batch`` each."""
        if self.drafter is None or lag <= self.k + 1:
            return True
        return self._at(self.drafter, lag) <= CATCH_UP_SHARE * remaining * self._at(self.target, max(batch, 1))

    def __call__(self, batch: int) -> float:
        b = max(batch, 1)
        one = self._at(self.target, b)
        c = max(self._at(self.target, b * (1 + self.k)) - one, 0.0) / (self.k * one)
        if self.drafter is not None:
            c += self._at(self.drafter, b) / one
        return c
