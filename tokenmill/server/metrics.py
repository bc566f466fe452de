"""Prometheus metrics with vLLM's names, labels and meanings, so vLLM dashboards work as they are.

Each server gets a private CollectorRegistry (several servers can live in one process). The
histograms are fed from the per-request timings the engine records (RequestMetrics) when a
request finishes; the token counters grow as tokens are produced; the gauges are read from the
engine's snapshot at scrape time.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily

from tokenmill.engine.streams import EngineSnapshot
from tokenmill.engine.messages import StepStats
from tokenmill.engine.utilization import PHASES, Nvml, UtilizationMeter
from tokenmill.outputs import RequestOutput

# vLLM's buckets
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0]
TOKEN_LATENCY_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                         20.0, 40.0, 80.0]
REQUEST_LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                           240.0, 480.0, 960.0, 1920.0, 7680.0]
REFUSAL_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0]


def _token_buckets(max_model_len: int) -> list[float]:
    """1, 2, 5, 10, 20, 50, ... up to max_model_len (vLLM's build_1_2_5_buckets)."""
    out, exp = [], 0
    while True:
        for m in (1, 2, 5):
            v = m * 10**exp
            if v > max_model_len:
                return [float(b) for b in out]
            out.append(v)
        exp += 1


class ServerMetrics:
    """The /metrics collectors; an EngineObserver (its on_* methods run on the engine thread)."""

    def __init__(self, model_name: str, snapshot: Callable[[], EngineSnapshot], max_model_len: int = 2048,
                 registry: CollectorRegistry | None = None, utilization: UtilizationMeter | None = None,
                 nvml: Nvml | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        reg, labels = self.registry, ["model_name"]
        self.utilization = utilization
        if utilization is not None:
            reg.register(UtilizationCollector(model_name, utilization, nvml))

        def hist(name: str, doc: str, buckets: list[float]):
            return Histogram(name, doc, labels, buckets=buckets, registry=reg).labels(model_name)

        def counter(name: str, doc: str):
            return Counter(name, doc, labels, registry=reg).labels(model_name)

        def gauge(name: str, doc: str, fn: Callable[[], float]) -> None:
            Gauge(name, doc, labels, registry=reg).labels(model_name).set_function(fn)

        self.add_gauge = gauge  # for the server's other observers (the live cost model)

        gauge("vllm:num_requests_running", "Number of requests in model execution batches.",
              lambda: snapshot().num_running)
        gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
              lambda: snapshot().num_waiting)
        gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
              lambda: snapshot().kv_cache_usage)

        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        self.preemptions = counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.")
        self.prefix_cache_queries = counter(
            "vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.")
        self.prefix_cache_hits = counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached "
                                         "tokens.")
        self._success = Counter("vllm:request_success", "Count of successfully processed requests.",
                                ["model_name", "finished_reason"], registry=reg)
        self._model_name = model_name
        for reason in ("stop", "length", "abort"):
            self._success.labels(model_name, reason)  # present from the start, at 0

        self.ttft = hist("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                         TTFT_BUCKETS)
        self.itl = hist("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                        TOKEN_LATENCY_BUCKETS)
        self.tpot = hist("vllm:request_time_per_output_token_seconds",
                         "Histogram of time_per_output_token_seconds per request.", TOKEN_LATENCY_BUCKETS)
        self.e2e = hist("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                        REQUEST_LATENCY_BUCKETS)
        self.queue = hist("vllm:request_queue_time_seconds",
                          "Histogram of time spent in WAITING phase for request.", REQUEST_LATENCY_BUCKETS)
        self.inference = hist("vllm:request_inference_time_seconds",
                              "Histogram of time spent in RUNNING phase for request.", REQUEST_LATENCY_BUCKETS)
        self.prefill = hist("vllm:request_prefill_time_seconds",
                            "Histogram of time spent in PREFILL phase for request.", REQUEST_LATENCY_BUCKETS)
        self.decode = hist("vllm:request_decode_time_seconds",
                           "Histogram of time spent in DECODE phase for request.", REQUEST_LATENCY_BUCKETS)
        tb = _token_buckets(max_model_len)
        self.req_prompt_tokens = hist("vllm:request_prompt_tokens", "Number of prefill tokens processed.", tb)
        self.req_generation_tokens = hist("vllm:request_generation_tokens",
                                          "Number of generation tokens processed.", tb)
        self.iteration_tokens = hist("vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.",
                                     [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384])
        # time the engine core spent in steps: 1 - its rate is the step loop's idle fraction
        self.engine_busy = counter("tokenmill:engine_busy_seconds", "Seconds the engine core spent running steps.")
        self.forward_fraction = hist("tokenmill:step_forward_fraction", "Per step, the fraction of its time spent "
                                     "running the model (the forward pass and drafting).",
                                     [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99])
        # SLO-aware scheduling (core/step_planner.py): admission outcomes and the planner's targets
        self._admission = Counter("tokenmill:requests_shed", "Requests refused at admission, by reason: ttft_slo "
                                  "(predicted TTFT past its SLO) or queue_full (--max-waiting-requests).",
                                  ["model_name", "reason"], registry=reg)
        for reason in ("ttft_slo", "queue_full"):
            self._admission.labels(model_name, reason)
        # how fast a refused request hears so: measured by the server, from the request's arrival (its body
        # read) to its 503, not what a client sharing the machine sees
        self._refusal = Histogram("tokenmill:request_refusal_seconds", "Seconds from a request's arrival to its "
                                  "503 at admission, by code: slo_overloaded (shed for its TTFT SLO) or overloaded "
                                  "(--max-waiting-requests).", ["model_name", "code"],
                                  buckets=REFUSAL_BUCKETS, registry=reg)
        self.predicted_misses = counter("tokenmill:slo_predicted_misses", "Requests admitted under --slo-policy "
                                        "queue although their predicted TTFT missed the SLO.")
        self.batch_target = Gauge("tokenmill:batch_size_target", "Running requests the planner allows (the "
                                  "TPOT SLO's batch size; --max-num-seqs without one).", labels,
                                  registry=reg).labels(model_name)
        self.token_budget = Gauge("tokenmill:step_token_budget", "Token budget of the last step (adapted to the "
                                  "latency target).", labels, registry=reg).labels(model_name)
        self.step_predicted = Gauge("tokenmill:step_time_predicted_seconds", "Predicted duration of the last "
                                    "step (the planner's cost model, corrected).", labels, registry=reg).labels(model_name)
        self.step_observed = Gauge("tokenmill:step_time_observed_seconds", "Observed duration of the last step.",
                                   labels, registry=reg).labels(model_name)
        self.step_ratio = Gauge("tokenmill:step_time_ratio", "Observed over the cost model's step times, a moving "
                                "average over about 20 steps: the correction plans apply (`tokenmill simulate "
                                "--step-time-scale` takes it).", labels, registry=reg).labels(model_name)
        # speculative decoding (zero while it is off)
        self.spec_drafts = counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.")
        self.spec_draft_tokens = counter("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.")
        self.spec_accepted = counter("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.")
        self._spec_per_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos",
                                     "Accepted tokens per draft position.", ["model_name", "position"], registry=reg)
        # mixture of experts (absent for dense models): the router's load balance
        self._expert_tokens = Counter("tokenmill:moe_expert_tokens", "Tokens the router sent to each expert "
                                      "(a token counts once in each of its top-k experts).",
                                      ["model_name", "layer", "expert"], registry=reg)
        # prefill/decode disaggregation (zero unless --kv-role)
        gauge("tokenmill:num_requests_waiting_for_kv", "Consumer: requests admitted with their blocks reserved, "
              "waiting for their prompt's KV from a producer.", lambda: snapshot().num_waiting_for_kv)
        gauge("tokenmill:num_requests_kv_held", "Producer: prefilled requests whose KV blocks wait for a consumer "
              "to pull them.", lambda: snapshot().num_kv_held)
        directions = ["model_name", "direction"]
        self._kv_bytes = Counter("tokenmill:kv_transfer_bytes", "KV cache bytes sent (producer) or received "
                                 "(consumer), layers x K and V (and scales) of whole blocks.", directions, registry=reg)
        self._kv_blocks = Counter("tokenmill:kv_transfer_blocks", "KV blocks sent or received.", directions,
                                  registry=reg)
        self._kv_failures = Counter("tokenmill:kv_transfer_failures", "KV transfers that failed (a dead peer, a "
                                    "refused pull, a timeout); the blocks went back to the pool.", directions,
                                    registry=reg)
        self._kv_seconds = Histogram("tokenmill:kv_transfer_seconds", "Time per request's KV transfer: the pull on "
                                     "a consumer, the send on a producer.", directions, buckets=TTFT_BUCKETS,
                                     registry=reg)
        for d in ("send", "recv"):
            for c in (self._kv_bytes, self._kv_blocks, self._kv_failures):
                c.labels(model_name, d)
        # the KV tier on local disk (zero unless --kv-offload-size): blocks looked up after the pool's hits
        self.offload_queries = counter("tokenmill:kv_offload_queries", "KV blocks looked up in the KV tier on "
                                       "local disk at admission (those after a request's prefix-cache hits).")
        self.offload_hits = counter("tokenmill:kv_offload_hits", "KV blocks found in the KV tier and read back "
                                    "instead of computed.")
        self.offload_read = counter("tokenmill:kv_offload_bytes_read", "Bytes read from the KV tier.")
        self.offload_written = counter("tokenmill:kv_offload_bytes_written", "Bytes written to the KV tier "
                                       "(blocks evicted from the pool).")
        self.offload_failures = counter("tokenmill:kv_offload_failures", "KV tier files that failed their check "
                                        "(truncated, corrupt, foreign) and were recomputed instead of served.")
        self.offload_read_s = hist("tokenmill:kv_offload_read_seconds", "Time per read from the KV tier (one "
                                   "request's blocks).", TTFT_BUCKETS)
        self.offload_write_s = hist("tokenmill:kv_offload_write_seconds", "Time per write to the KV tier (one "
                                    "step's evicted blocks, on a background thread).", TTFT_BUCKETS)
        self.offload_usage = Gauge("tokenmill:kv_offload_usage_bytes", "Bytes the KV tier's files take.", labels,
                                   registry=reg).labels(model_name)
        self._expert_imbalance = Gauge("tokenmill:moe_load_imbalance", "Over the last step, the busiest expert's "
                                       "tokens over the mean per expert, in the most unbalanced layer (1 = even).",
                                       labels, registry=reg)

    # ---- EngineObserver ----------------------------------------------------------------

    def on_tokens(self, num_prompt_tokens: int, num_generation_tokens: int) -> None:
        if num_prompt_tokens:
            self.prompt_tokens.inc(num_prompt_tokens)
        if num_generation_tokens:
            self.generation_tokens.inc(num_generation_tokens)

    def on_admission(self, outcome: str) -> None:
        if outcome == "predicted_miss":
            self.predicted_misses.inc()
        else:
            self._admission.labels(self._model_name, outcome).inc()

    def on_refused(self, code: str, seconds: float) -> None:
        self._refusal.labels(self._model_name, code).observe(seconds)

    def on_step(self, stats: StepStats) -> None:
        self.engine_busy.inc(stats.duration)
        if self.utilization is not None:
            self.utilization.on_step(stats)
        if stats.duration > 0:
            self.forward_fraction.observe(min(1.0, (stats.forward_s + stats.draft_s) / stats.duration))
        if stats.predicted_duration is not None:
            self.step_predicted.set(stats.predicted_duration)
            self.step_observed.set(stats.duration)
            self.token_budget.set(stats.token_budget)
            self.batch_target.set(stats.batch_target)
            self.step_ratio.set(stats.cost_ratio)
        num_tokens = stats.num_prefill_tokens + stats.num_decode_tokens
        if num_tokens:
            self.iteration_tokens.observe(num_tokens)
        if stats.num_preemptions:
            self.preemptions.inc(stats.num_preemptions)
        if stats.prefix_cache_queries:
            self.prefix_cache_queries.inc(stats.prefix_cache_queries)
            self.prefix_cache_hits.inc(stats.prefix_cache_hits)
        spec = stats.spec
        if spec is not None and spec.num_drafts:
            self.spec_drafts.inc(spec.num_drafts)
            self.spec_draft_tokens.inc(spec.num_draft_tokens)
            self.spec_accepted.inc(spec.num_accepted_tokens)
            for pos, n in enumerate(spec.accepted_per_pos):
                self._spec_per_pos.labels(self._model_name, str(pos)).inc(n)
        offload = stats.kv_offload
        if offload is not None:
            self.offload_queries.inc(offload.queries)
            self.offload_hits.inc(offload.hits)
            self.offload_read.inc(offload.bytes_read)
            self.offload_written.inc(offload.bytes_written)
            self.offload_failures.inc(offload.failures)
            for v in offload.read_seconds:
                self.offload_read_s.observe(v)
            for v in offload.write_seconds:
                self.offload_write_s.observe(v)
            self.offload_usage.set(offload.usage_bytes)
        for t in stats.kv_transfers or ():
            if t.direction == "offload":  # (the KV tier's reads: counted above)
                continue
            if t.error is not None:
                self._kv_failures.labels(self._model_name, t.direction).inc()
                continue
            self._kv_bytes.labels(self._model_name, t.direction).inc(t.num_bytes)
            self._kv_blocks.labels(self._model_name, t.direction).inc(t.num_blocks)
            self._kv_seconds.labels(self._model_name, t.direction).observe(t.seconds)
        if stats.expert_tokens:
            for layer, counts in enumerate(stats.expert_tokens):
                for expert, n in enumerate(counts):
                    if n:
                        self._expert_tokens.labels(self._model_name, str(layer), str(expert)).inc(n)
            from tokenmill.layers.moe import expert_imbalance  # here: layers/ imports torch
            self._expert_imbalance.labels(self._model_name).set(expert_imbalance(stats.expert_tokens))

    def on_request_finished(self, output: RequestOutput, now: float) -> None:
        """One observation per sequence (an n=3 request counts 3), as vLLM does with its n fan-out."""
        for c, m in zip(output.outputs, output.metrics):
            self._success.labels(self._model_name, c.finish_reason or "abort").inc()
            self.req_prompt_tokens.observe(len(output.prompt_token_ids))
            self.req_generation_tokens.observe(len(c.token_ids))
            # A request ended by a stop string reports finished_time None (engine bug, see the
            # server's notes); it ended in the step that just returned, i.e. at `now`.
            finished = m.finished_time if m.finished_time is not None else now
            self.e2e.observe(max(0.0, finished - m.arrival_time))
            if m.first_scheduled_time is not None:
                self.queue.observe(max(0.0, m.first_scheduled_time - m.arrival_time))
                self.inference.observe(max(0.0, finished - m.first_scheduled_time))
            if m.first_token_time is not None:
                self.ttft.observe(max(0.0, m.first_token_time - m.arrival_time))
                if m.first_scheduled_time is not None:
                    self.prefill.observe(max(0.0, m.first_token_time - m.first_scheduled_time))
                self.decode.observe(max(0.0, finished - m.first_token_time))
            for d in m.itls:
                self.itl.observe(d)
            if m.tpot is not None:
                self.tpot.observe(m.tpot)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class UtilizationCollector:
    """The device-utilization families, from one reading of the meter per scrape (engine/utilization.py):
    counters of the engine's time by step phase, of its process's CPU time and of its model FLOPs and
    bytes; gauges of their fractions over the meter's window, against the device's roofline; NVML's
    GPU utilization and memory where there is a GPU to ask (tokenmill:device_info says why not)."""

    def __init__(self, model_name: str, meter: UtilizationMeter, nvml: Nvml | None) -> None:
        self.model_name, self.meter, self.nvml = model_name, meter, nvml

    def collect(self):
        m, name = self.meter, self.model_name
        w = m.recent()
        window = f"over the last {m.window:g} s"

        def family(kind, metric: str, doc: str, value: float | None = None, **extra):
            f = kind(metric, doc, labels=["model_name", *extra])
            if value is not None:
                f.add_metric([name], value)
            return f

        phases = family(CounterMetricFamily, "tokenmill:engine_phase_seconds", "Seconds the engine core spent "
                        "in each step phase: schedule, draft (speculative drafting), forward (the model), sample, "
                        "other (applying the outputs).", phase=True)
        for p in PHASES:
            phases.add_metric([name, p], m.phase_seconds[p])
        yield phases
        fractions = family(GaugeMetricFamily, "tokenmill:engine_time_fraction", f"Fraction of wall time {window} "
                           "the engine core spent in each step phase, and idle.", phase=True)
        for p, v in w.fractions.items():
            fractions.add_metric([name, p], v)
        yield fractions
        yield family(GaugeMetricFamily, "tokenmill:device_busy_ratio", f"Fraction of wall time {window} the "
                     "device spent running the model (forward passes and drafting).", w.device_busy)
        cpu = m.cpu_seconds()
        if cpu is not None and cpu == cpu:
            yield family(CounterMetricFamily, "tokenmill:engine_cpu_seconds", "CPU seconds (user and system) of "
                         "the engine core's process.", cpu)
            yield family(GaugeMetricFamily, "tokenmill:engine_cpus", "CPUs the engine core's process may run on.",
                         m.cpu.num_cpus)
            yield family(GaugeMetricFamily, "tokenmill:engine_cpu_utilization", f"The engine core process's CPU "
                         f"time {window} over the wall time times its CPUs.", w.cpu_utilization)
        yield family(CounterMetricFamily, "tokenmill:model_flops", "Model FLOPs of the steps run (linear layers, "
                     "output head, attention).", m.flops)
        yield family(CounterMetricFamily, "tokenmill:model_bytes", "Bytes the steps moved to and from memory "
                     "(weights once a step, KV context read, new KV written).", m.bytes)
        yield family(GaugeMetricFamily, "tokenmill:achieved_flops_per_second", f"Model FLOP/s while running the "
                     f"model, {window}.", w.achieved_flops)
        yield family(GaugeMetricFamily, "tokenmill:achieved_bytes_per_second", f"Memory bytes/s while running "
                     f"the model, {window}.", w.achieved_bandwidth)
        roof = m.roofline
        if roof is not None:
            yield family(GaugeMetricFamily, "tokenmill:device_peak_flops_per_second", "The device's peak FLOP/s "
                         "(see tokenmill:device_info's roofline_source).", roof.peak_flops)
            yield family(GaugeMetricFamily, "tokenmill:device_peak_bytes_per_second", "The device's peak memory "
                         "bandwidth.", roof.peak_bandwidth)
            yield family(GaugeMetricFamily, "tokenmill:flops_utilization", f"Achieved over peak FLOP/s while "
                         f"running the model, {window} (MFU).", w.achieved_flops / roof.peak_flops)
            yield family(GaugeMetricFamily, "tokenmill:bandwidth_utilization", f"Achieved over peak memory "
                         f"bandwidth while running the model, {window}.", w.achieved_bandwidth / roof.peak_bandwidth)
        gpu = self.nvml.read() if self.nvml is not None else None
        info = {"device": roof.device if roof is not None else "unknown",
                "roofline_source": roof.source if roof is not None else "none",
                "nvml": "available" if gpu is not None else (self.nvml.why if self.nvml is not None else "not asked")}
        dev = InfoMetricFamily("tokenmill:device", "The device the engine runs on, where its roofline comes from "
                               "and whether NVML reports on it (the gpu_* metrics exist only where it does).",
                               labels=["model_name"])
        dev.add_metric([name], info)
        yield dev
        if gpu is not None:
            util, used, total = gpu
            yield family(GaugeMetricFamily, "tokenmill:gpu_utilization_ratio", "NVML's GPU utilization: the "
                         "fraction of its last sample period a kernel ran.", util)
            yield family(GaugeMetricFamily, "tokenmill:gpu_memory_used_bytes", "NVML's GPU memory in use (all "
                         "processes).", used)
            yield family(GaugeMetricFamily, "tokenmill:gpu_memory_total_bytes", "NVML's GPU memory in total.",
                         total)
