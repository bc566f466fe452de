"""One reading of a server's Prometheus metrics, and the live figures two readings give.

A ``Scrape`` holds the samples a live view needs, summed over label sets (model names, engines), from
a tokenmill server's registry or from any server's ``/metrics`` text: tokenmill's, or vLLM's own (its
older and newer names both). ``frame`` turns a reading and earlier ones into what the dashboard and
``tokenmill top`` show: gauges as they are, counters as rates, and latency percentiles from the
histograms' bucket deltas over a window, the way Prometheus' ``histogram_quantile`` reads them.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

# The metrics a live view reads, each under the names servers have exported it by (the first present wins).
GAUGES = {
    "running": ("vllm:num_requests_running",),
    "waiting": ("vllm:num_requests_waiting",),
    "kv_usage": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
    "prefix_hit_rate_gauge": ("vllm:gpu_prefix_cache_hit_rate",),  # vLLM's older engine: a gauge
    "gpu_utilization": ("tokenmill:gpu_utilization_ratio",),
    "peak_flops": ("tokenmill:device_peak_flops_per_second",),
    "peak_bandwidth": ("tokenmill:device_peak_bytes_per_second",),
    "engine_cpus": ("tokenmill:engine_cpus",),
    # the simulator checking itself live (server/live_replay.py, engine/live_cost.py): NaN until it has
    "step_prediction_error": ("tokenmill:step_time_prediction_error",),
    "replay_ttft_predicted": ("tokenmill:replay_predicted_ttft_seconds",),
    "replay_ttft_observed": ("tokenmill:replay_observed_ttft_seconds",),
    "replay_tpot_predicted": ("tokenmill:replay_predicted_tpot_seconds",),
    "replay_tpot_observed": ("tokenmill:replay_observed_tpot_seconds",),
}
COUNTERS = {
    "prompt_tokens": ("vllm:prompt_tokens_total",),
    "generation_tokens": ("vllm:generation_tokens_total",),
    "finished": ("vllm:request_success_total",),
    "preemptions": ("vllm:num_preemptions_total",),
    "prefix_queries": ("vllm:prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries_total"),
    "prefix_hits": ("vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total"),
    "draft_tokens": ("vllm:spec_decode_num_draft_tokens_total",),
    "accepted_tokens": ("vllm:spec_decode_num_accepted_tokens_total",),
    "shed": ("tokenmill:requests_shed_total",),
    "flops": ("tokenmill:model_flops_total",),
    "bytes": ("tokenmill:model_bytes_total",),
    "engine_cpu_seconds": ("tokenmill:engine_cpu_seconds_total",),
    "engine_busy": ("tokenmill:engine_busy_seconds_total",),
    # tokenmill's router (prefill/decode disaggregation): the legs' and the KV pulls' time and number
    "router_prefill_s": ("tokenmill:router_prefill_seconds_sum",),
    "router_prefills": ("tokenmill:router_prefill_seconds_count",),
    "router_decode_first_s": ("tokenmill:router_decode_first_byte_seconds_sum",),
    "router_decodes": ("tokenmill:router_decode_first_byte_seconds_count",),
    "router_kv_transfer_s": ("tokenmill:router_kv_transfer_time_seconds",),
    "router_kv_transfers": ("tokenmill:router_kv_transfers",),
}
HISTOGRAMS = {
    "ttft": ("vllm:time_to_first_token_seconds",),
    "itl": ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"),
}
PHASE_COUNTER = "tokenmill:engine_phase_seconds_total"  # by phase: the device-busy phases are draft, forward
DEVICE_PHASES = ("draft", "forward")
WANTED = ({n for names in (*GAUGES.values(), *COUNTERS.values()) for n in names} | {PHASE_COUNTER}
          | {n + "_bucket" for names in HISTOGRAMS.values() for n in names})


@dataclass
class Scrape:
    time: float  # wall-clock seconds (time.time) when read
    values: dict[str, float] = field(default_factory=dict)  # sample name -> sum over label sets
    phases: dict[str, float] = field(default_factory=dict)  # engine phase -> seconds
    buckets: dict[str, dict[float, float]] = field(default_factory=dict)  # histogram -> le -> cumulative count
    model: str | None = None

    @classmethod
    def from_families(cls, families: Iterable, time: float) -> Scrape:
        """From prometheus_client metric families (a registry's ``collect()``, or the text parser's)."""
        out = cls(time)
        for family in families:
            for s in family.samples:
                name = s.name
                if name not in WANTED:
                    continue
                if out.model is None and "model_name" in s.labels:
                    out.model = s.labels["model_name"]
                if name.endswith("_bucket"):
                    le = float(s.labels["le"])
                    hist = out.buckets.setdefault(name.removesuffix("_bucket"), {})
                    hist[le] = hist.get(le, 0.0) + s.value
                elif name == PHASE_COUNTER:
                    phase = s.labels.get("phase", "")
                    out.phases[phase] = out.phases.get(phase, 0.0) + s.value
                else:
                    out.values[name] = out.values.get(name, 0.0) + s.value
        return out

    @classmethod
    def from_text(cls, text: str, time: float) -> Scrape:
        """From a ``/metrics`` page (Prometheus' text format). ValueError if it is not one."""
        return cls.from_families(text_string_to_metric_families(text), time)

    def get(self, key: str) -> float | None:
        for name in GAUGES.get(key) or COUNTERS.get(key) or ():
            if name in self.values:
                return self.values[name]
        return None

    def histogram(self, key: str) -> dict[float, float] | None:
        for name in HISTOGRAMS[key]:
            if name in self.buckets:
                return self.buckets[name]
        return None

    @property
    def device_seconds(self) -> float | None:
        if not self.phases:
            return None
        return sum(self.phases.get(p, 0.0) for p in DEVICE_PHASES)

    @property
    def is_inference_server(self) -> bool:
        """Whether it exports the request gauges every vLLM-named server has."""
        return "vllm:num_requests_running" in self.values

    @property
    def is_router(self) -> bool:
        """Whether it is tokenmill's prefill/decode router (server/router.py)."""
        return "tokenmill:router_prefill_seconds_count" in self.values


def histogram_quantile(q: float, buckets: dict[float, float]) -> float | None:
    """The q-quantile of a cumulative histogram (le -> count), interpolating linearly inside the bucket it
    falls in, as Prometheus does; in the +Inf bucket, the highest finite bound. None with no observations."""
    bounds = sorted(buckets)
    if not bounds:
        return None
    total = buckets[bounds[-1]]
    if total <= 0:
        return None
    rank = q * total
    prev_le, prev_count = 0.0, 0.0
    for le in bounds:
        count = buckets[le]
        if count >= rank:
            if math.isinf(le):
                return prev_le
            if count == prev_count:
                return le
            return prev_le + (le - prev_le) * (rank - prev_count) / (count - prev_count)
        prev_le, prev_count = le, count
    return prev_le


def _delta(cur: dict[float, float], base: dict[float, float] | None) -> dict[float, float]:
    if base is None:
        return dict(cur)
    out = {le: c - base.get(le, 0.0) for le, c in cur.items()}
    if any(v < 0 for v in out.values()):  # the server restarted between the two: its counts began again
        return dict(cur)
    return out


def frame(cur: Scrape, rate_base: Scrape | None, window_base: Scrape | None) -> dict[str, float | None]:
    """The live figures at ``cur``: gauges as read; rates per second since ``rate_base``; latency percentiles,
    prefix-cache hit rate and speculative acceptance over the observations since ``window_base`` (a longer
    span, so a percentile has enough behind it). None where the server does not export what it needs."""

    def rate(value_now: float | None, value_then: float | None) -> float | None:
        if value_now is None or rate_base is None or value_then is None:
            return None
        dt = cur.time - rate_base.time
        if dt <= 0:
            return None
        return max(0.0, value_now - value_then) / dt

    def counter_rate(key: str) -> float | None:
        return rate(cur.get(key), rate_base.get(key) if rate_base is not None else None)

    def ratio_since(num: str, den: str, base: Scrape | None) -> float | None:
        n, d = cur.get(num), cur.get(den)
        if n is None or d is None:
            return None
        if base is not None and base.get(num) is not None and base.get(den) is not None:
            n, d = n - base.get(num), d - base.get(den)
        return n / d if d > 0 else None

    out: dict[str, float | None] = {"time": cur.time}
    for key in ("running", "waiting", "kv_usage", "gpu_utilization"):
        out[key] = cur.get(key)
    for key in ("step_prediction_error", "replay_ttft_predicted", "replay_ttft_observed", "replay_tpot_predicted",
                "replay_tpot_observed"):
        v = cur.get(key)
        out[key] = None if v is None or math.isnan(v) else v
    out["prompt_tps"] = counter_rate("prompt_tokens")
    out["generation_tps"] = counter_rate("generation_tokens")
    out["finished_per_s"] = counter_rate("finished")
    out["preemptions_per_s"] = counter_rate("preemptions")
    out["shed_per_s"] = counter_rate("shed")
    hit = ratio_since("prefix_hits", "prefix_queries", window_base)
    out["prefix_hit_rate"] = hit if hit is not None else cur.get("prefix_hit_rate_gauge")
    out["spec_acceptance"] = ratio_since("accepted_tokens", "draft_tokens", window_base)
    for key in HISTOGRAMS:
        hist = cur.histogram(key)
        base = window_base.histogram(key) if window_base is not None else None
        d = _delta(hist, base) if hist is not None else None
        out[f"{key}_p50"] = histogram_quantile(0.5, d) if d else None
        out[f"{key}_p99"] = histogram_quantile(0.99, d) if d else None
    # the device: busy share of wall time, and what its busy time achieved against the roofline
    dev_now = cur.device_seconds
    dev_then = rate_base.device_seconds if rate_base is not None else None
    out["device_busy"] = rate(dev_now, dev_then)
    busy = dev_now - dev_then if dev_now is not None and dev_then is not None else None
    for key, peak, name in (("flops", "peak_flops", "flops_utilization"),
                            ("bytes", "peak_bandwidth", "bandwidth_utilization")):
        now_v, then_v, top = cur.get(key), rate_base.get(key) if rate_base is not None else None, cur.get(peak)
        if busy and now_v is not None and then_v is not None and top:
            out[name] = max(0.0, now_v - then_v) / busy / top
        else:
            out[name] = None
    cpu = counter_rate("engine_cpu_seconds")
    cpus = cur.get("engine_cpus")
    out["engine_cpu_utilization"] = cpu / cpus if cpu is not None and cpus else None
    busy_steps = counter_rate("engine_busy")
    out["engine_idle"] = None if busy_steps is None else max(0.0, 1.0 - busy_steps)
    # totals, for the summary (and for checking a view against /metrics)
    for key in ("prompt_tokens", "generation_tokens", "finished", "preemptions"):
        out[f"{key}_total"] = cur.get(key)
    return out
