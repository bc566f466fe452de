"""``tokenmill profile``: real step times of this machine over a grid of step shapes, and the calibrated
cost model fitted to them (with its error on held-out steps).

Grid: decode batches of 1-64 requests at contexts of 128-1024 tokens, prefill chunks of 16-256 tokens at
a few offsets, and mixed steps (decodes plus a chunk). Every step runs through the engine's own
ModelRunner (forward pass and sampling), on blocks borrowed from its pool; each point is the median of
a few runs. Every fourth point is held out of the fit and predicted.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

DECODE_BATCHES = (1, 2, 4, 8, 16, 32, 64)
CONTEXTS = (128, 512, 1024)
CHUNKS = (16, 64, 128, 256)
CHUNK_STARTS = (0, 512)


# What an engine with a latency target times at startup when no profile is given: decodes at a few batch
# sizes and contexts, chunks at three offsets, mixed steps (about 1.5 s for the embedded model).
STARTUP_GRID = ((1, 128, 0, 0), (2, 256, 0, 0), (8, 512, 0, 0), (32, 256, 0, 0), (16, 1024, 0, 0),
                (0, 0, 16, 0), (0, 0, 32, 0), (0, 0, 128, 0), (0, 0, 128, 512), (0, 0, 256, 0), (0, 0, 64, 1024),
                (8, 512, 64, 0), (4, 256, 64, 1024))


def grid(quick: bool = False) -> list[tuple[int, int, int, int]]:
    """(decode requests, their context, prefill chunk tokens, chunk start) per point."""
    batches = DECODE_BATCHES[::2] if quick else DECODE_BATCHES
    pts = [(b, c, 0, 0) for b in batches for c in CONTEXTS]
    pts += [(0, 0, n, s) for n in CHUNKS for s in CHUNK_STARTS]
    pts += [(b, 512, n, 0) for b in (4, 16) for n in (64, 256)]
    return pts


def measure(engine, point: tuple[int, int, int, int], repeats: int = 3) -> tuple[object, float]:  # noqa: ANN001
    """(the step's SchedulerOutput, median seconds of the runner executing it)."""
    import torch

    from tokenmill.core.scheduler import NewRequestData, ScheduledRequest, SchedulerOutput
    from tokenmill.sampling_params import SamplingParams

    b, ctx, n, start = point
    kv = engine.kv_cache
    scheduled, new, ids = [], [], []
    sp = SamplingParams(temperature=0, max_tokens=1)
    for i in range(b):
        rid = f"__profile_d{i}"
        table = kv.allocate_slots(rid, ctx)
        scheduled.append(ScheduledRequest(rid, [1], ctx - 1, table, True))
        new.append(NewRequestData(rid, [1] * (ctx - 1), [], sp, frozenset()))
        ids.append(rid)
    if n:
        rid = "__profile_p"
        table = kv.allocate_slots(rid, start + n)
        scheduled.append(ScheduledRequest(rid, [1] * n, start, table, True))
        new.append(NewRequestData(rid, [1] * (start + n), [], sp, frozenset()))
        ids.append(rid)
    if any(kv.block_tables.get(r) is None for r in ids):
        for r in ids:
            kv.free(r)
        raise ValueError(f"the KV pool is too small for profile point {point}; raise --kv-cache-memory")
    out = SchedulerOutput(scheduled, new, num_prefill_tokens=n, num_decode_tokens=b)
    times = []
    try:
        with torch.inference_mode():
            for r in range(repeats + 1):
                step = out if r == 0 else SchedulerOutput(scheduled, [], num_prefill_tokens=n, num_decode_tokens=b)
                t = time.perf_counter()
                engine.runner.execute(step)
                times.append(time.perf_counter() - t)
                for s in scheduled:  # the runner appended a sampled token: keep the state as it was
                    engine.runner.states[s.request_id].output_token_ids.clear()
    finally:
        engine.runner.execute(SchedulerOutput(finished_request_ids=list(ids)))
        for r in ids:
            kv.free(r)
    return out, statistics.median(times[1:])


def time_points(engine, points, repeats: int = 3, report=None):  # noqa: ANN001, ANN201
    """(StepShapes, median seconds) of the points that fit the engine's context and KV pool; ``report(i, point,
    seconds or why skipped)`` hears of each."""
    from tokenmill.core.step_cost import StepShape

    shapes, seconds = [], []
    for i, p in enumerate(points):
        if max(p[1], p[2] + p[3]) > engine.max_model_len:
            result = f"skipped: beyond the {engine.max_model_len}-token context"
        else:
            try:
                out, result = measure(engine, p, repeats)
                shapes.append(StepShape.of(out))
                seconds.append(result)
            except ValueError as e:  # the pool is too small for it
                result = f"skipped: {e}"
        if report is not None:
            report(i, p, result)
    return shapes, seconds


def calibrate(engine, points, repeats: int = 3):  # noqa: ANN001, ANN201
    """(CalibratedCost fitted to the points that fit the engine's pool and context, how many did)."""
    from tokenmill.core.step_cost import CalibratedCost

    shapes, seconds = time_points(engine, points, repeats)
    if len(shapes) < 2:
        raise ValueError("too few calibration steps fit in the KV pool to plan step times; raise "
                         "--kv-cache-memory, or give --step-cost-profile from `tokenmill profile`")
    return CalibratedCost.fit(shapes, seconds), len(shapes)


def fit_held_out(shapes: list, seconds: list[float], meta: dict, by_time: bool = False):  # noqa: ANN201
    """(CalibratedCost fitted to every point, its mean and max relative error on every fourth point when fitted
    to the other three). ``by_time``: each point's relative error weighs as much as its seconds (served steps,
    where what matters is the time they add up to: the many short steps of a light load must not outvote the
    fewer long ones of a heavy load); the held-out error is then also time-weighted."""
    from tokenmill.core.step_cost import CalibratedCost

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
