"""The scheduling half of an engine, assembled one way for the engine (engine/builder.py) and the simulator
(sim/simulator.py), so what the simulator predicts is what the engine's scheduler would do: the scheduler over
a KV pool, its SLO planner on a step-cost model, a lane per pipeline step in flight, a drafter told when a
request ends; and the front end's SLO admission over it."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tokenmill.core.scheduler import Scheduler
from tokenmill.core.step_planner import SLOAdmission, SLOPlanner

if TYPE_CHECKING:
    from collections.abc import Callable

    from tokenmill.config import SchedulerConfig
    from tokenmill.core.kv_cache import KVCacheManager
    from tokenmill.perf.step_cost import StepShape


def make_scheduler(config: SchedulerConfig, kv_cache: KVCacheManager, max_model_len: int,
                   step_cost: Callable[[StepShape], float] | None = None, lanes: int = 1,
                   finish_hook: Callable[[str], None] | None = None) -> Scheduler:
    """step_cost: what a step costs (the engine's startup calibration, the simulator's cost model); the SLO
    planner needs it when the config sets latency targets. finish_hook: a drafter's ``finish``."""
    sched = Scheduler(config, kv_cache, max_model_len)
    if config.plans_steps:
        if step_cost is None:
            raise ValueError("latency targets (--itl-target-ms, --slo-ttft-ms, --slo-tpot-ms) plan steps with a "
                             "step-cost model, and none was given")
        sched.planner = SLOPlanner(config, step_cost)
    sched.lanes = lanes
    if finish_hook is not None:
        sched.finish_hooks.append(finish_hook)
    return sched


def make_admission(config: SchedulerConfig) -> SLOAdmission | None:
    """The front end's admission by predicted TTFT, where the config sets latency targets."""
    if not config.plans_steps:
        return None
    return SLOAdmission(config.slo_ttft_ms, config.slo_policy, fcfs=config.policy == "fcfs")
