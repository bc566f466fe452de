"""The server's log lines: one per finished request, and a periodic engine line while busy (vLLM's
LoggingStatLogger): throughput, running and waiting requests, KV cache use, prefix-cache hit rate and
speculative decoding's acceptance. An EngineObserver of the AsyncEngine."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from tokenmill.engine.messages import StepStats
from tokenmill.engine.utilization import ProcessCpu
from tokenmill.outputs import RequestOutput

request_logger = logging.getLogger("tokenmill.requests")
stats_logger = logging.getLogger("tokenmill.stats")


class LoggingStatLogger:
    """``interval`` seconds of busy time between engine lines (0 or None: none); ``log_requests``: a line
    per finished request. ``snapshot()`` is the AsyncEngine's EngineSnapshot; ``engine`` the LLMEngine."""

    def __init__(self, snapshot: Callable[[], Any], engine: Any, interval: float | None, log_requests: bool) -> None:
        self.snapshot, self.interval, self.log_requests = snapshot, interval, log_requests
        self.prefix_caching = engine.config.cache.enable_prefix_caching
        self.speculative = engine.speculative
        self.roofline = getattr(engine.info, "roofline", None)
        self.cpu = ProcessCpu(lambda: engine.core_pid)
        self._reset(time.perf_counter())

    def _reset(self, now: float) -> None:
        self.start = now
        self.prompt = self.gen = self.finished = 0
        self.queries = self.hits = 0  # prefix-cache lookups, in tokens
        self.drafts = self.draft_tokens = self.accepted = 0  # speculative decoding
        self.shed: dict[str, int] = {}  # admission refusals (and predicted misses) by reason
        self.predicted = self.observed = 0.0  # step seconds, where a latency target plans them
        self.last: StepStats | None = None
        self.device_s = self.flops = self.bytes = 0.0  # utilization (engine/utilization.py)
        self.expert_tokens: list[list[int]] = []  # mixture of experts: routed tokens per layer and expert
        self.cpu_start = self.cpu.seconds()

    # ---- EngineObserver --------------------------------------------------------------

    def on_tokens(self, num_prompt_tokens: int, num_generation_tokens: int) -> None:
        self.prompt += num_prompt_tokens
        self.gen += num_generation_tokens

    def on_request_finished(self, output: RequestOutput, now: float) -> None:
        self.finished += 1
        if self.log_requests:
            _log_finished(output, now)

    def on_admission(self, outcome: str) -> None:
        self.shed[outcome] = self.shed.get(outcome, 0) + 1

    def on_step(self, stats: StepStats) -> None:
        if stats.predicted_duration is not None:
            self.predicted += stats.predicted_duration
            self.observed += stats.duration
            self.last = stats
        if not (self.prompt or self.gen or self.finished or self.queries or self.drafts):
            self.start = stats.start_time  # intervals count busy time: an idle gap starts a new one
            self.cpu_start = self.cpu.seconds()
        self.queries += stats.prefix_cache_queries
        self.device_s += stats.forward_s + stats.draft_s
        self.flops += stats.flops
        self.bytes += stats.bytes
        self.hits += stats.prefix_cache_hits
        if stats.expert_tokens:
            if not self.expert_tokens:
                self.expert_tokens = [[0] * len(c) for c in stats.expert_tokens]
            for acc, counts in zip(self.expert_tokens, stats.expert_tokens):
                acc[:] = [a + n for a, n in zip(acc, counts)]
        if stats.spec is not None:
            self.drafts += stats.spec.num_drafts
            self.draft_tokens += stats.spec.num_draft_tokens
            self.accepted += stats.spec.num_accepted_tokens
        now = time.perf_counter()
        if self.interval and now - self.start >= self.interval:
            dt, s = now - self.start, self.snapshot()
            stats_logger.info(
                "engine: %.1f prompt tokens/s, %.1f generation tokens/s, %d requests finished; "
                "%d running, %d waiting; KV cache %.1f%% used (%d/%d blocks); %d preemptions total%s",
                self.prompt / dt, self.gen / dt, self.finished, s.num_running, s.num_waiting,
                100 * s.kv_cache_usage, s.num_blocks - s.num_free_blocks, s.num_blocks, s.num_preemptions,
                self._prefix_text() + self._spec_text() + self._moe_text() + self._plan_text() + self._device_text(dt))
            self._reset(now)

    def _spec_text(self) -> str:
        """vLLM's SpecDecoding line: acceptance rate and mean acceptance length (accepted + 1 per draft)."""
        if not self.speculative or not self.drafts:
            return ""
        rate = self.accepted / self.draft_tokens
        return (f"; speculative decoding: acceptance rate {100 * rate:.1f}%, "
                f"mean acceptance length {1 + self.accepted / self.drafts:.2f}")

    def _moe_text(self) -> str:
        """The router's load balance over the interval: busiest expert over the mean, worst layer."""
        if not any(sum(c) for c in self.expert_tokens):
            return ""
        from tokenmill.layers.moe import expert_imbalance  # here: layers/ imports torch
        return f"; experts: busiest {expert_imbalance(self.expert_tokens):.2f}x the mean (worst layer)"

    def _plan_text(self) -> str:
        """The SLO planner's targets, its step-time prediction against what the steps took, and refusals."""
        parts = []
        if self.last is not None and self.predicted:
            parts.append(f"batch target {self.last.batch_target}, step budget {self.last.token_budget} tokens, "
                         f"steps take {self.last.cost_ratio:.2f}x the cost model's time, "
                         f"{100 * self.observed / self.predicted:.0f}% of the corrected prediction")
        if self.shed:
            parts.append("admission: " + ", ".join(f"{n} {why}" for why, n in sorted(self.shed.items())))
        return "".join(f"; {p}" for p in parts)

    def _device_text(self, dt: float) -> str:
        """The device's busy share of the interval, the fraction of its roofline the model used while busy,
        and the engine process's CPU use."""
        parts = [f"device busy {100 * self.device_s / dt:.0f}%"]
        roof = self.roofline
        if roof is not None and self.device_s:
            parts.append(f"{100 * self.flops / self.device_s / roof.peak_flops:.0f}% of peak FLOP/s and "
                         f"{100 * self.bytes / self.device_s / roof.peak_bandwidth:.0f}% of peak bandwidth while busy")
        cpu = self.cpu.seconds() - self.cpu_start
        if cpu == cpu:
            parts.append(f"engine CPU {100 * cpu / dt / self.cpu.num_cpus:.0f}% of {self.cpu.num_cpus}")
        return "; " + ", ".join(parts)

    def _prefix_text(self) -> str:
        if not self.prefix_caching:
            return ""
        return f"; prefix cache hit rate {100 * (self.hits / self.queries if self.queries else 0.0):.1f}%"


def _fmt(v: float | None, unit: str = "s") -> str:
    return "-" if v is None else f"{v:.3f} {unit}"


def _log_finished(out: RequestOutput, now: float) -> None:
    for c, m in zip(out.outputs, out.metrics or [None] * len(out.outputs)):
        rid = out.request_id if len(out.outputs) == 1 else f"{out.request_id}#{c.index}"
        if m is None:
            request_logger.info("request %s finished (%s): prompt %d tokens, output %d tokens", rid,
                                c.finish_reason, len(out.prompt_token_ids), len(c.token_ids))
            continue
        e2e = (m.finished_time or now) - m.arrival_time
        request_logger.info(
            "request %s finished (%s): prompt %d tokens, output %d tokens, queue %s, TTFT %s, TPOT %s, e2e %s",
            rid, c.finish_reason, len(out.prompt_token_ids), len(c.token_ids), _fmt(m.queue_time), _fmt(m.ttft),
            _fmt(m.tpot), _fmt(e2e))
