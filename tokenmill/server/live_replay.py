"""The simulator checking itself on live traffic: every ``--live-replay-interval`` seconds (when requests
finished since the last time) the server replays its recent traffic (the arrivals, prompt, cached and output
tokens of the last 200 finished requests and whatever was in flight beside them: engine/timelines.py)
through the simulator with the step-cost model it fitted on its own steps (engine/live_cost.py) and its own
scheduler settings (sim/replay.py), and publishes the replay's mean TTFT and TPOT beside the measured ones
on /metrics (``tokenmill:replay_{predicted,observed}_{ttft,tpot}_seconds``) and the dashboard.

It runs on a thread of its own; a replay of 200 requests takes a fraction of a second of CPU once a minute.
"""

from __future__ import annotations

import logging
import math
import threading
from typing import TYPE_CHECKING

from tokenmill.sim.replay import replay

if TYPE_CHECKING:
    from collections.abc import Callable

    from tokenmill.engine.live_cost import LiveCostModel
    from tokenmill.engine.timelines import TimelineRecorder

logger = logging.getLogger("tokenmill")

MAX_REQUESTS = 200  # finished requests a replay scores
MIN_REQUESTS = 5  # fewer: no replay


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def tpot(r: dict) -> float | None:
    """Time per output token after the first: (end-to-end - TTFT) / (outputs - 1)."""
    if r.get("ttft_s") is None or r.get("e2e_s") is None or r["output_tokens"] < 2:
        return None
    return (r["e2e_s"] - r["ttft_s"]) / (r["output_tokens"] - 1)


def compare(rows: list[dict], predicted: dict[str, dict]) -> dict | None:
    """Mean TTFT and TPOT, measured and replayed, over the finished requests of the window proper (not those
    carried over from before it) that the replay also finished."""
    scored = [r for r in rows if r["finished"] and not r.get("before") and r["ttft_s"] is not None
              and r["request_id"] in predicted]
    if len(scored) < MIN_REQUESTS:
        return None
    obs_tpot = [(tpot(r), tpot({**predicted[r["request_id"]], "output_tokens": r["output_tokens"]}))
                for r in scored]
    pairs = [(o, p) for o, p in obs_tpot if o is not None and p is not None]
    return {"requests": len(scored),
            "observed_ttft_s": _mean([r["ttft_s"] for r in scored]),
            "predicted_ttft_s": _mean([predicted[r["request_id"]]["ttft_s"] for r in scored]),
            "observed_tpot_s": _mean([o for o, _ in pairs]), "predicted_tpot_s": _mean([p for _, p in pairs])}


class LiveReplay:
    """``engine_settings``: what the replay schedules with (the /window route's ``engine`` part)."""

    def __init__(self, timelines: TimelineRecorder, live_cost: LiveCostModel, engine_settings: Callable[[], dict],
                 interval_s: float = 60.0, max_requests: int = MAX_REQUESTS) -> None:
        self.timelines, self.live_cost, self.engine_settings = timelines, live_cost, engine_settings
        self.interval_s, self.max_requests = interval_s, max_requests
        self.last: dict | None = None  # the latest comparison
        self._seen = None  # the newest finished request the last replay covered
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def value(self, key: str) -> float:
        return math.nan if self.last is None else self.last[key]

    def run_once(self) -> dict | None:
        """Replay the recent traffic now; the comparison (also kept in ``last``), or None when there is too
        little to replay (no cost model fitted yet, fewer than 5 finished requests, nothing new)."""
        rows = self.timelines.recent(self.max_requests)
        newest = max((r["arrival_s"] + r["e2e_s"] for r in rows if r["finished"]), default=None)
        key = (len(rows), newest, rows[0]["request_id"] if rows else None)
        doc = self.live_cost.describe()
        if not rows or key == self._seen or "coef" not in doc:
            return None
        self._seen = key
        got = compare(rows, replay({"requests": rows, "cost_model": doc}, self.engine_settings()))
        if got is not None:
            self.last = got
        return got

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="tokenmill-live-replay", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.run_once()
            except Exception:  # noqa: BLE001 - the check must never stop the server
                logger.exception("the live replay failed")

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
