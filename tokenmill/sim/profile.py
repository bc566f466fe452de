"""``tokenmill profile``: real step times of this machine over a grid of step shapes (engine/calibration.py),
and the calibrated cost model fitted to them (with its error on held-out steps), or fitted to the steps a
server logged (``--from-step-log``).
"""

from __future__ import annotations

import argparse
import statistics
from typing import TYPE_CHECKING

import numpy as np

from tokenmill.engine.calibration import grid, time_points

if TYPE_CHECKING:
    from tokenmill.perf.step_cost import CalibratedCost


def fit_held_out(shapes: list, seconds: list[float], meta: dict, by_time: bool = False) -> CalibratedCost:
    """(CalibratedCost fitted to every point, its mean and max relative error on every fourth point when fitted
    to the other three). ``by_time``: each point's relative error weighs as much as its seconds (served steps,
    where what matters is the time they add up to: the many short steps of a light load must not outvote the
    fewer long ones of a heavy load); the held-out error is then also time-weighted."""
    from tokenmill.perf.step_cost import CalibratedCost

    def weights(idx: list[int]) -> list[float] | None:
        return [seconds[i] for i in idx] if by_time else None

    fit_idx = [i for i in range(len(shapes)) if i % 4 != 3]
    held = [i for i in range(len(shapes)) if i % 4 == 3]
    model = CalibratedCost.fit([shapes[i] for i in fit_idx], [seconds[i] for i in fit_idx], weights=weights(fit_idx))
    errors = [abs(model(shapes[i]) - seconds[i]) / seconds[i] for i in held]
    mean = float(np.average(errors, weights=weights(held)))
    print(f"held-out steps: {'time-weighted ' if by_time else ''}mean error {100 * mean:.1f}%, max "
          f"{100 * max(errors):.1f}% ({len(held)} of {len(shapes)} points)")
    return CalibratedCost.fit(shapes, seconds, {**meta, "held_out_mean_error": mean}, weights=weights(range(len(shapes))))


def profile_from_step_logs(paths: list[str], output: str) -> int:
    from tokenmill.engine.step_log import read_step_log, step_cycles

    shapes, seconds, head = [], [], None
    same = ("model", "quantization", "kv_bytes_per_token")  # what logs fitted together must share
    for path in paths:
        engine, records = read_step_log(path)
        if head is not None and any(engine.get(k) != head.get(k) for k in same):
            raise ValueError(f"{path} was logged by another engine ({engine}) than {paths[0]} ({head}): fit each "
                             "engine's logs separately")
        head = head or engine  # the first log's KV pool is the profile's (the simulator's default pool)
        s, c = step_cycles(records)
        shapes += s
        seconds += c
    if len(shapes) < 8:
        raise ValueError(f"{len(shapes)} steps in the step logs: too few to fit; serve a longer workload")
    print(f"{len(shapes)} served steps, cycle median {1000 * statistics.median(seconds):.2f} ms")
    fit_held_out(shapes, seconds, {**head, "source": "served steps"}, by_time=True).save(output)
    print(f"saved {output}")
    return 0


def cmd_profile(a: argparse.Namespace) -> int:
    if a.from_step_log:
        return profile_from_step_logs(a.from_step_log, a.output)
    from tokenmill.engine.arg_utils import engine_kwargs
    from tokenmill.config import EngineConfig
    from tokenmill.engine.llm_engine import LLMEngine
    from tokenmill.engine.step_log import engine_meta

    engine = LLMEngine(EngineConfig.from_kwargs(**engine_kwargs(a)))
    for layer in engine.runner.kv_caches:  # timing over a zeroed pool, not stale memory's NaNs or denormals
        for t in layer:
            t.zero_()
    points = grid(a.quick)

    def report(i: int, p: tuple, result: float | str) -> None:
        what = result if isinstance(result, str) else (f"decodes {p[0]} x ctx {p[1]}, chunk {p[2]} at {p[3]}: "
                                                        f"{1000 * result:.2f} ms")
        print(f"[{i + 1}/{len(points)}] {what}", flush=True)

    shapes, seconds = time_points(engine, points, report=report)
    if len(shapes) < 8:
        raise ValueError("too few profile points fit in the KV pool; raise --kv-cache-memory")
    fit_held_out(shapes, seconds, engine_meta(engine.info)).save(a.output)
    print(f"saved {a.output}")
    return 0
