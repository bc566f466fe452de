"""Step times measured on a live engine: the startup calibration a latency target plans with, and the points
``tokenmill profile`` (sim/profile.py) fits a cost model to.

Grid: decode batches of 1-64 requests at contexts of 128-1024 tokens, prefill chunks of 16-256 tokens at
a few offsets, and mixed steps (decodes plus a chunk). Every step runs through the engine's own
ModelRunner (forward pass and sampling), on blocks borrowed from its pool; each point is the median of
a few runs.
"""

from __future__ import annotations

import logging
import statistics
import time
from typing import TYPE_CHECKING, Any, Protocol

from tokenmill.core.sched_output import NewRequestData, ScheduledRequest, SchedulerOutput
from tokenmill.perf.step_cost import CalibratedCost, StepShape
from tokenmill.sampling_params import SamplingParams

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable

    import torch

    from tokenmill.config import EngineConfig, ModelConfig
    from tokenmill.core.kv_cache import KVCacheManager
    from tokenmill.tokenizer import Tokenizer
    from tokenmill.worker.model_runner import ModelRunner

logger = logging.getLogger("tokenmill")


class StartupState(Protocol):
    """What the start-up probes read of an engine being built (engine/builder.py CoreBuilder): the model's
    name, device, dtype, config and tokenizer, its context, the KV cache and the runner."""

    model_name: str
    device: torch.device
    dtype: torch.dtype
    model_config: ModelConfig
    tokenizer: Tokenizer
    max_model_len: int
    kv_cache: KVCacheManager
    runner: Any


class TimedEngine(Protocol):
    """What the step timing reads of an engine: its KV pool, its ModelRunner and its context (a CoreBuilder at
    start-up, or an in-process LLMEngine, which carries its core's parts)."""

    kv_cache: KVCacheManager
    runner: ModelRunner
    max_model_len: int


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


def measure(engine: TimedEngine, point: tuple[int, int, int, int], repeats: int = 3) -> tuple[object, float]:
    """(the step's SchedulerOutput, median seconds of the runner executing it)."""
    import torch

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


def time_points(engine: TimedEngine, points: Iterable[tuple[int, int, int, int]], repeats: int = 3,
                report: Callable[[int, tuple[int, int, int, int], float | str], None] | None = None,
                ) -> tuple[list[StepShape], list[float]]:
    """(StepShapes, median seconds) of the points that fit the engine's context and KV pool; ``report(i, point,
    seconds or why skipped)`` hears of each."""
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


def calibrate(engine: TimedEngine, points: Iterable[tuple[int, int, int, int]], repeats: int = 3,
              ) -> tuple[CalibratedCost, int]:
    """(CalibratedCost fitted to the points that fit the engine's pool and context, how many did)."""
    shapes, seconds = time_points(engine, points, repeats)
    if len(shapes) < 2:
        raise ValueError("too few calibration steps fit in the KV pool to plan step times; raise "
                         "--kv-cache-memory, or give --step-cost-profile from `tokenmill profile`")
    return CalibratedCost.fit(shapes, seconds), len(shapes)


def startup_step_cost(core: StartupState, config: EngineConfig) -> CalibratedCost:
    """The step-cost model latency targets plan with: --step-cost-profile's, or fitted now to a few
    steps timed on this machine (about 1.5 s for the embedded model)."""
    if config.step_cost_profile:
        cost = CalibratedCost.load(config.step_cost_profile)
        made_for = cost.meta.get("model")
        if made_for and made_for != core.model_name:
            logger.warning("--step-cost-profile %s was measured on %s, not %s: plans will be off until the "
                           "observed step times correct them", config.step_cost_profile, made_for,
                           core.model_name)
        return cost
    t = time.perf_counter()
    cost, n = calibrate(core, STARTUP_GRID, repeats=1)
    s = config.scheduler
    logger.info("step cost: %d steps timed in %.1f s; a decode step predicted %.1f ms at batch 1, %.1f ms at "
                "32; a 256-token chunk %.1f ms (planning to %s ms per step)", n, time.perf_counter() - t,
                1e3 * cost(StepShape.planned(1, 256, 0, 0)), 1e3 * cost(StepShape.planned(32, 32 * 256, 0, 0)),
                1e3 * cost(StepShape.planned(0, 0, 256, 0)), s.slo_tpot_ms or s.itl_target_ms)
    return cost
