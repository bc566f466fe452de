"""The simulator's step-cost model fitted live on the steps the server runs, and its own prediction error.

``tokenmill profile`` fits a CalibratedCost (perf/step_cost.py) to a grid of steps timed on an idle engine;
here the same model is fitted to the steps real traffic makes, as they come. Each step is first predicted
by the model fitted on the steps before it (out of sample: the error is what a simulator using the model
would make on this traffic), then the model is refitted every ``refit`` steps on the last ``window``.

What is predicted is a step's cycle, what the simulator charges a step (engine/step_log.py): from its start
to the next step's start when the engine went straight on (the outputs sent and the new requests taken in
between), its own duration when the engine went idle after it.
"""

from __future__ import annotations

import math
import threading
from collections import deque
from typing import TYPE_CHECKING

from tokenmill.perf.step_cost import FEATURES, CalibratedCost

if TYPE_CHECKING:
    from tokenmill.engine.messages import StepStats
    from tokenmill.outputs import RequestOutput
    from tokenmill.perf.step_cost import StepShape


# Served traffic often has one shape (every decode step one token and one row sampled a request): a small ridge
# gives the time those terms share to the constant (perf/step_cost.py), so a what-if with other shapes
# (speculation's multi-token decodes, other budgets) is not priced on an arbitrary split.
RIDGE = 1e-3


class LiveCostModel:
    """An engine observer (on the engine thread); ``error`` and ``describe`` may be read from any thread."""

    def __init__(self, window: int = 2000, refit: int = 100, min_steps: int = 50, error_window: int = 200) -> None:
        self.refit, self.min_steps = refit, min_steps
        self.shapes: deque[StepShape] = deque(maxlen=window)
        self.cycles: deque[float] = deque(maxlen=window)
        self.errors: deque[tuple[float, float]] = deque(maxlen=error_window)  # (predicted, observed) seconds
        self.model: CalibratedCost | None = None
        self.num_fitted = 0  # steps the current model was fitted on
        self.num_steps = 0
        self._since_fit = 0
        self._pending: StepStats | None = None  # the last step, its cycle known once the next one starts
        self._lock = threading.Lock()

    # ---- observer --------------------------------------------------------------------

    def on_tokens(self, num_prompt_tokens: int, num_generation_tokens: int) -> None:
        pass

    def on_request_finished(self, output: RequestOutput, now: float) -> None:
        pass

    def on_step(self, stats: StepStats) -> None:
        if stats.shape is None or stats.duration <= 0:
            return
        last, self._pending = self._pending, stats
        if last is None:
            return
        gap = stats.start_time - (last.start_time + last.duration)
        busy = last.num_running + last.num_waiting > 0
        # the engine went straight on: the cycle runs to this step's start (a long pause is not the loop's)
        cycle = last.duration + gap if busy and 0 <= gap <= max(last.duration, 0.05) else last.duration
        self._observe(last.shape, cycle)

    def _observe(self, shape: StepShape, cycle: float) -> None:
        with self._lock:
            if self.model is not None:
                self.errors.append((self.model(shape), cycle))
            self.shapes.append(shape)
            self.cycles.append(cycle)
            self.num_steps += 1
            self._since_fit += 1
            if len(self.shapes) >= self.min_steps and (self.model is None or self._since_fit >= self.refit):
                self.model = CalibratedCost.fit(list(self.shapes), list(self.cycles), {"source": "live"}, ridge=RIDGE)
                self.num_fitted, self._since_fit = len(self.shapes), 0

    # ---- readers ---------------------------------------------------------------------

    @property
    def error(self) -> float:
        """The recent out-of-sample predictions' absolute errors as a share of the time they predicted:
        sum |predicted - observed| / sum observed (NaN before any). A share of time rather than a mean of
        per-step ratios, so a step of a millisecond cannot swamp it."""
        with self._lock:
            seen = sum(o for _, o in self.errors)
            return sum(abs(p - o) for p, o in self.errors) / seen if seen > 0 else math.nan

    @property
    def bias(self) -> float:
        """The same, signed: above 0 the model predicts slower steps than the server runs."""
        with self._lock:
            seen = sum(o for _, o in self.errors)
            return sum(p - o for p, o in self.errors) / seen if seen > 0 else math.nan

    def describe(self) -> dict:
        """The fitted model as `tokenmill profile` writes one (kind, features, coef) and its error."""
        with self._lock:
            model = self.model
            out = {"steps_observed": self.num_steps, "steps_fitted": self.num_fitted,
                   "predictions": len(self.errors)}
        out["prediction_error"] = None if math.isnan(e := self.error) else e
        out["prediction_bias"] = None if math.isnan(b := self.bias) else b
        if model is not None:
            out.update({"kind": "calibrated", "features": list(FEATURES), "coef": model.coef.tolist(),
                        "min_seconds": model.floor})
        return out
