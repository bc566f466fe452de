"""When drafting pays: how many drafts a request gets this step (the off rule).

d drafts make a request's step longer by cost(d) decode steps, whether or not they are accepted: their
verification (the target's step grows by d tokens) plus, for a draft model, d drafter passes. Draft i
(1-based) is accepted with probability about a^i, for the request's recent per-draft acceptance a, so
d drafts bring 1 + a + ... + a^d tokens for 1 + cost(d) steps' time; a request gets the d (0 to k) with
the most tokens per unit of time, so none where no d beats plain decoding. A request whose acceptance
fell that low gets one probe draft every PROBE_EVERY steps (where one draft costs under a step) to
notice when its text starts to repeat again.

cost(d) comes from step times the engine measures at startup (``DraftCostModel``) and grows with the
batch: a few-token step is memory-bound (extra tokens nearly free) where a large batch's is
compute-bound (each extra token costs as much as a decoded one). On the CPU kernels a gguf target's
first draft costs most (the integer GEMMs are compute-bound from one token on: 2 tokens take about 1.8x
one), a float target's drafts about 0.1 step each, and a gguf drafter's pass about 0.3 of a float
target's decode step (BENCHMARKS.md, speculative decoding).
"""

from __future__ import annotations

from collections.abc import Callable

DRAFT_COST = 0.5  # per draft, where nothing is measured: a gguf target's verification of one draft token
PROBE_EVERY = 8  # steps without drafts before one probe draft
EMA = 0.5  # weight of the newest step in the acceptance estimate


def constant_cost(c: float) -> Callable[[int], float]:
    return lambda d: c * d


def worthwhile_drafts(acceptance: float, steps_without_drafts: int, limit: int = 64,
                      cost: Callable[[int], float] = constant_cost(DRAFT_COST)) -> int:
    """The number of drafts (0 to limit) with the most expected tokens per unit of step time."""
    best, best_rate, tokens, p = 0, 1.0, 1.0, 1.0
    for d in range(1, limit + 1):
        p *= acceptance
        tokens += p
        rate = tokens / (1 + cost(d))
        if rate > best_rate + 1e-9:
            best, best_rate = d, rate
    if best == 0 and steps_without_drafts >= PROBE_EVERY and cost(1) < 1:  # at cost >= 1 no draft ever pays
        return 1
    return best


def update_acceptance(acceptance: float, accepted: int, drafted: int) -> float:
    """The per-draft acceptance a with a^drafted matched to this step: accepting all counts as 1, the
    first rejected at position j as the fraction j / drafted (a simple, monotone estimate)."""
    return (1 - EMA) * acceptance + EMA * (accepted / drafted)


PROBE_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)  # tokens per step the engine times at startup
CATCH_UP_SHARE = 0.25  # most of a request's remaining time a drafter's catch-up pass may take


class DraftCostModel:
    """cost(d) at a batch of B decoding requests, from step times measured at startup: target(n), the
    target's step over n tokens, and drafter(n), a drafter pass over n (None: drafting is free, as
    n-gram lookup is); both interpolated piecewise linearly and extended past the largest size by the
    last slope. ``model(B)`` is the cost function for that batch.

    Each of B requests drafting d tokens turns a step of B tokens into one of B (1 + d), and adds d
    drafter passes over B: cost(d) = [target(B (1 + d)) - target(B) + d drafter(B)] / target(B)."""

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

    def __call__(self, batch: int) -> Callable[[int], float]:
        b = max(batch, 1)
        one = self._at(self.target, b)
        pass_cost = self._at(self.drafter, b) / one if self.drafter is not None else 0.0

        def cost(d: int) -> float:
            return max(self._at(self.target, b * (1 + d)) - one, 0.0) / one + d * pass_cost

        return cost
