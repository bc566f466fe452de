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
from tokenmill.perf.cost import ScaledCost
from tokenmill.perf.step_cost import FEATURES, CalibratedCost
from tokenmill.sim.simulator import Simulator
from tokenmill.sim.spec import DEFAULT_ACCEPTANCE, SpecDecoding


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
                    engine["enable_prefix_caching"], request_overhead_s=front_end_overhead(rows),
                    spec=speculation(engine.get("speculative"), rows, cost))
    result = sim.run(reqs, [r["arrival_s"] for r in rows], seed)
    out = {}
    for r, res in zip(rows, sorted(result.results, key=lambda x: x.index)):
        if res.success:
            out[r["request_id"]] = {"ttft_s": res.ttft_s, "e2e_s": res.e2el_s, "itl_s": list(res.itl_s)}
    return out


def speculation(spec: dict | None, rows: list[dict], cost: CalibratedCost) -> SpecDecoding | None:
    """Speculative decoding as served or asked (``{"method", "k"}`` and optionally ``acceptance``, the
    per-draft probability, and ``draft_cost``); None when off. The acceptance defaults to what the window's
    requests measured (when they drafted), else the simulator's default. A served draft model's passes are
    inside the steps the cost model was fitted on, so they cost nothing more; a draft model the server did
    not run costs ``draft_cost`` times a target step of the same shape."""
    if not spec or not spec.get("method"):
        return None
    k = int(spec["k"])
    acceptance = spec.get("acceptance")
    if acceptance is None:
        drafts = sum(r.get("drafts", 0) for r in rows)
        rate = sum(r.get("accepted", 0) for r in rows) / drafts if drafts else None
        acceptance = per_draft_acceptance(rate, k) if rate is not None else DEFAULT_ACCEPTANCE
    drafter = ScaledCost(cost, spec["draft_cost"]) if spec.get("draft_cost") else None
    return SpecDecoding(spec["method"], k, acceptance, drafter)


def per_draft_acceptance(rate: float, k: int) -> float:
    """The per-draft probability A whose drafts, each accepted while the ones before were, give acceptance
    ``rate`` (accepted / drafted, vLLM's) at k drafts: (A + A^2 + ... + A^k) / k = rate, by bisection."""
    lo, hi = 0.0, 1.0
    for _ in range(50):
        a = (lo + hi) / 2
        lo, hi = (a, hi) if sum(a ** i for i in range(1, k + 1)) / k < rate else (lo, a)
    return (lo + hi) / 2


def front_end_overhead(rows: list[dict]) -> float:
    """A request's time outside the engine's steps, as served: the quickest any request of the window got from
    arrival to its first step (one that found the engine idle), plus the median time from the step that made
    a first token to the token going out. The replay charges it to each request before it is scheduled."""
    ins = [r["to_first_step_s"] for r in rows if r.get("to_first_step_s") is not None]
    outs = [r["out_after_step_s"] for r in rows if r.get("out_after_step_s") is not None]
    return max(0.0, (min(ins) if ins else 0.0) + (float(np.median(outs)) if outs else 0.0))
