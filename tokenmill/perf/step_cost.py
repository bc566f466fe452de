"""Step time against a step's shape: what the scheduler plans with and the simulator runs on.

``StepShape`` is what a step computes (tokens, sampled rows, attention context); ``CalibratedCost``
is a linear model of its seconds over that shape, fitted to steps timed on the machine at hand (at
engine startup, or by ``tokenmill profile``); ``StepTimeTracker`` keeps the ratio of observed to
predicted step time, so plans follow a machine that got busier or a fit that is off. The roofline
(perf/cost.py) takes the same shapes. No tensors here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from tokenmill.core.sched_output import SchedulerOutput


@dataclass(frozen=True)
class StepShape:
    prefill_tokens: int
    decode_tokens: int
    sampled: int  # rows whose logits are computed
    attention_context: int  # sum over the step's tokens of the context each attends to
    kv_read_tokens: int  # sum over the step's requests of their context (read once each)
    decode_context: int  # sum of the decoding requests' contexts
    num_seqs: int

    @property
    def tokens(self) -> int:
        return self.prefill_tokens + self.decode_tokens

    @classmethod
    def of(cls, sched: SchedulerOutput) -> "StepShape":
        attn = kv = dec_ctx = sampled = 0
        for s in sched.scheduled:
            n, start = len(s.token_ids), s.start_pos
            attn += n * start + n * (n + 1) // 2
            kv += start + n
            if n == 1 or s.num_draft_tokens:  # a decode; with drafts, they attend as a chunk after it
                dec_ctx += start + 1
            if s.needs_logits:
                sampled += 1 + s.num_draft_tokens
        return cls(sched.num_prefill_tokens, sched.num_decode_tokens, sampled, attn, kv, dec_ctx, len(sched.scheduled))

    @classmethod
    def planned(cls, num_decodes: int, decode_context: int, prefill_tokens: int, prefill_start: int) -> "StepShape":
        """A step the scheduler is weighing: ``num_decodes`` decodes whose contexts sum to ``decode_context``,
        plus one prefill chunk of ``prefill_tokens`` starting at position ``prefill_start``."""
        n = prefill_tokens
        attn = decode_context + n * prefill_start + n * (n + 1) // 2
        return cls(n, num_decodes, num_decodes + (1 if n else 0), attn, decode_context + (prefill_start + n if n else 0),
                   decode_context, num_decodes + (1 if n else 0))


FEATURES = ("1", "prefill_tokens", "decode_tokens", "decode_context", "prefill_attention", "sampled")


def features(s: StepShape) -> list[float]:
    prefill_attn = s.attention_context - s.decode_context  # the decodes' share is their context
    return [1.0, s.prefill_tokens, s.decode_tokens, s.decode_context / 1e3, prefill_attn / 1e3, s.sampled]


class CalibratedCost:
    """A linear model of measured step times over the step's shape (FEATURES), fitted by least squares
    to ``tokenmill profile``'s grid on the machine at hand."""

    def __init__(self, coef: list[float], meta: dict | None = None) -> None:
        self.coef, self.meta = np.asarray(coef, dtype=float), meta or {}
        self._coef = tuple(float(c) for c in self.coef)  # plain floats: the planner calls this many times a step
        self.floor = float(self.meta.get("min_seconds", 0.0))

    @classmethod
    def fit(cls, shapes: list[StepShape], seconds: list[float], meta: dict | None = None,
            weights: list[float] | None = None, ridge: float = 0.0) -> "CalibratedCost":
        """Least squares of the relative error, each step's squared error times its weight (default 1).
        ``ridge`` > 0 adds a small penalty on the per-token terms (each column scaled to unit size): where the
        steps cannot tell terms apart (served traffic of one shape: every decode step one token, one row
        sampled), the shared time goes to the constant instead of an arbitrary split that would price
        other shapes wrong."""
        x, y = np.asarray([features(s) for s in shapes]), np.asarray(seconds)
        # Relative error is what planning feels (a 5 ms decode step predicted at 20 ms is as wrong as a
        # 500 ms chunk predicted at 2 s), so each step's row is weighted by 1 / its time.
        w = np.sqrt(np.asarray(weights, dtype=float)) if weights is not None else np.ones_like(y)
        x, y = x * (w / y)[:, None], w
        if ridge > 0:
            scale = np.sqrt((x[:, 1:] ** 2).mean(axis=0))
            penalty = np.zeros((x.shape[1] - 1, x.shape[1]))
            penalty[:, 1:] = np.diag(np.sqrt(ridge * len(y)) * np.where(scale > 0, scale, 1.0))
            x, y = np.vstack([x, penalty]), np.concatenate([y, np.zeros(len(penalty))])
        # least squares with no negative per-token cost: a term that comes out negative is dropped and
        # the rest refitted (an active set), so "where the time goes" never reads below zero
        active = list(range(x.shape[1]))
        coef = np.zeros(x.shape[1])
        while True:
            sol, *_ = np.linalg.lstsq(x[:, active], y, rcond=None)
            neg = [a for a, c in zip(active, sol) if c < 0 and a != 0]
            if not neg:
                coef[active] = sol
                break
            active.remove(min(neg, key=lambda a: sol[active.index(a)]))
        return cls(coef.tolist(), {**(meta or {}), "min_seconds": float(min(seconds))})

    def __call__(self, s: StepShape) -> float:
        return max(sum(c * f for c, f in zip(self._coef, features(s))), self.floor)

    def breakdown(self, s: StepShape) -> dict[str, float]:
        f = features(s)
        prefill = self.coef[1] * f[1] + self.coef[4] * f[4]
        decode = self.coef[2] * f[2] + self.coef[3] * f[3]
        return {"prefill_s": prefill, "decode_s": decode, "seconds": self(s)}

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps({"kind": "calibrated", "features": FEATURES, "coef": self.coef.tolist(),
                                          **self.meta}, indent=1))

    @classmethod
    def load(cls, path: str | Path) -> "CalibratedCost":
        try:
            doc = json.loads(Path(path).read_text())
            if doc.get("kind") != "calibrated" or list(doc["features"]) != list(FEATURES):
                raise ValueError("not a calibrated profile of this tokenmill version")
            meta = {k: v for k, v in doc.items() if k not in ("kind", "features", "coef")}
            return cls(doc["coef"], meta)
        except (OSError, json.JSONDecodeError, KeyError, ValueError) as e:
            raise ValueError(f"{path} is not a profile written by `tokenmill profile` ({e})") from None


class StepTimeTracker:
    """Observed over predicted step time, smoothed (an exponential moving average over about 20 steps),
    clamped to [1/4, 4]: the factor plans multiply the cost model's predictions by."""

    ALPHA = 0.05

    def __init__(self) -> None:
        self.ratio = 1.0
        self.last_predicted = self.last_observed = 0.0

    def observe(self, predicted_s: float, observed_s: float) -> None:
        self.last_predicted, self.last_observed = predicted_s, observed_s
        if predicted_s > 0 and observed_s > 0:
            r = self.ratio + self.ALPHA * (observed_s / predicted_s - self.ratio)
            self.ratio = min(max(r, 0.25), 4.0)
