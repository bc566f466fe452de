"""Replaying served traffic through the simulator: a window of requests the server recorded (engine/timelines.py:
arrivals, prompt, cached and output tokens, the front end's time) with the step-cost model it fitted on its own
steps (engine/live_cost.py) and its scheduler settings. ``tokenmill explain`` (sim/explain.py) replays one
request's window as served and with other settings; the server replays its recent traffic to publish how
far the simulator's TTFT and TPOT are from what it measured (server/live_replay.py).
"""

from __future__ import annotations

import numpy as np

from tokenmill.bench.datasets import SampleRequest
from tokenmill.config import SchedulerConfig
from tokenmill.perf.step_cost import FEATURES, CalibratedCost
from tokenmill.sim.simulator import Simulator


def replay(window: dict, engine: dict, seed: int = 0) -> dict[str, dict]:
    """Each finished request's simulated TTFT, end-to-end latency and gaps between tokens, by id."""
    doc = window["cost_model"]
    if "coef" not in doc or list(doc.get("features", ())) != list(FEATURES):
        raise ValueError(f"the server has fitted no step-cost model yet ({doc.get('steps_observed', 0)} steps "
                         "observed; it fits after 50): send it some traffic first")
    cost = CalibratedCost(doc["coef"], {"min_seconds": doc.get("min_seconds", 0.0)})
    sched = SchedulerConfig(**engine["scheduler"])
    rows = window["requests"]
    rng = np.random.default_rng(seed)
    head_len = max((r["cached_tokens"] for r in rows), default=0)
    head = rng.integers(100, 30000, head_len).tolist()  # the common head the cache hits are on
    reqs = []
    for r in rows:
        n, c = max(r["prompt_tokens"], 1), r["cached_tokens"]
        ids = head[:c] + rng.integers(30000, 60000, max(n - c, 1)).tolist()
        reqs.append(SampleRequest("", len(ids), max(r["output_tokens"], 1), prompt_ids=ids))
    sim = Simulator(cost, sched, engine["num_blocks"], engine["block_size"], engine["max_model_len"],
                    engine["enable_prefix_caching"], request_overhead_s=front_end_overhead(rows))
    result = sim.run(reqs, [r["arrival_s"] for r in rows], seed)
    out = {}
    for r, res in zip(rows, sorted(result.results, key=lambda x: x.index)):
        if res.success:
            out[r["request_id"]] = {"ttft_s": res.ttft_s, "e2e_s": res.e2el_s, "itl_s": list(res.itl_s)}
    return out


def front_end_overhead(rows: list[dict]) -> float:
    """A request's time outside the engine's steps, as served: the quickest any request of the window got from
    arrival to its first step (one that found the engine idle), plus the median time from the step that made
    a first token to the token going out. The replay charges it to each request before it is scheduled."""
    ins = [r["to_first_step_s"] for r in rows if r.get("to_first_step_s") is not None]
    outs = [r["out_after_step_s"] for r in rows if r.get("out_after_step_s") is not None]
    return max(0.0, (min(ins) if ins else 0.0) + (float(np.median(outs)) if outs else 0.0))
