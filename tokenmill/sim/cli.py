"""``tokenmill simulate`` and ``tokenmill profile``."""

from __future__ import annotations

import argparse
import math
import shlex
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokenmill.bench.datasets import SampleRequest
    from tokenmill.bench.runner import RunResult
    from tokenmill.config import ModelConfig
    from tokenmill.perf.cost import RooflineCost, ScaledCost
    from tokenmill.perf.hardware import HardwareProfile
    from tokenmill.perf.step_cost import CalibratedCost
    from tokenmill.sim.simulator import Disaggregation, SimResult, Simulator

from tokenmill.sim.args import add_simulate_args

SEARCH_STEPS = 8  # bisection steps of the rate search once a failing rate is bracketed

def model_config(model: str) -> tuple[ModelConfig, str]:
    """(ModelConfig, name) of a model name, .gguf, HF folder or a config.json file, without weights."""
    from tokenmill.models.hf_loader import hf_model_config

    path = Path(model)
    if path.is_file() and path.suffix == ".json":
        return hf_model_config(path.parent, path.name), path.parent.name or model
    if path.is_dir():
        return hf_model_config(path), path.name
    from tokenmill.models.gguf_loader import gguf_model_config, open_gguf
    from tokenmill.models.registry import resolve_model

    src = resolve_model(model)
    if src.format != "gguf":
        return hf_model_config(src.path), src.name
    return gguf_model_config(open_gguf(src.path)), src.name


def build(a: argparse.Namespace) -> tuple[CalibratedCost | RooflineCost | ScaledCost, Simulator, str, float]:
    """(cost model, simulator, description) for one configuration's flags."""
    from tokenmill.config import SchedulerConfig, parse_memory
    from tokenmill.perf.step_cost import CalibratedCost
    from tokenmill.perf.cost import RooflineCost, ScaledCost, draft_weight_ratio, kv_bytes_per_token
    from tokenmill.perf.hardware import load_hardware
    from tokenmill.sim.simulator import Simulator
    from tokenmill.sim.spec import DEFAULT_ACCEPTANCE, SpecDecoding

    cfg, name = model_config(a.model)
    hw = None  # a calibrated profile has no datasheet
    max_len = a.max_model_len or cfg.max_position_embeddings
    if (a.hardware is None) == (a.profile is None):
        raise ValueError("give one of --hardware (a datasheet roofline) or --profile (a `tokenmill profile` file)")
    method, draft_cfg = speculative(a, cfg, max_len)
    drafter = None
    if a.profile is not None:
        cost = CalibratedCost.load(a.profile)
        kv_token = cost.meta.get("kv_bytes_per_token") or kv_bytes_per_token(cfg, "fp32")
        transfer_token = kv_token  # what a request ships when disaggregated (a draft model catches up itself)
        pool = cost.meta.get("kv_cache_bytes", 2**30)
        what = f"{name} on this machine (calibrated: {a.profile})"
        budget = 256
        if draft_cfg is not None:  # the profile's step over the same shape, by the weight bytes it reads
            ratio = draft_weight_ratio(cfg, draft_cfg, a.weight_dtype, a.speculative_weight_dtype or a.weight_dtype)
            drafter = ScaledCost(cost, ratio)
            kv_token += kv_token * kv_bytes_per_token(draft_cfg) / kv_bytes_per_token(cfg)  # its KV rides along
            what += f"; draft passes at {ratio:.3g} x its steps"
    else:
        hw = load_hardware(a.hardware)
        devices = a.tensor_parallel_size * a.pipeline_parallel_size
        cost = RooflineCost(cfg, hw, a.weight_dtype, a.kv_dtype, a.compute_dtype,
                            tensor_parallel_size=a.tensor_parallel_size, pipeline_parallel_size=a.pipeline_parallel_size,
                            micro_batches=a.pipeline_micro_batches)
        kv_token = transfer_token = cost.kv_token_bytes
        pool = 0.9 * hw.memory_bytes * devices - cost.weight_bytes
        if draft_cfg is not None:  # its own roofline; its KV rides on the target's blocks, as in the engine
            drafter = RooflineCost(draft_cfg, hw, a.speculative_weight_dtype or a.weight_dtype, a.kv_dtype,
                                   a.compute_dtype, tensor_parallel_size=a.tensor_parallel_size)
            kv_token += drafter.kv_token_bytes
            pool -= drafter.weight_bytes
        if pool <= 0:
            weights = cost.weight_bytes + (drafter.weight_bytes if drafter is not None else 0)
            raise ValueError(f"{name}'s weights ({weights / 1e9:.1f} GB{' with the draft model' if drafter else ''}) "
                             f"do not fit in {devices} x {hw.name}; raise --tensor-parallel-size or "
                             "--pipeline-parallel-size, or lower --weight-dtype")
        what = f"{name} on {devices} x {hw.name} (roofline; {hw.source})"
        budget = 8192
    if a.step_time_scale != 1.0:
        cost = ScaledCost(cost, a.step_time_scale)
        drafter = ScaledCost(drafter, a.step_time_scale) if drafter is not None else None
        what += f", step times x {a.step_time_scale:g}"
    spec = None
    if method is not None:
        acceptance = a.speculative_acceptance_rate
        spec = SpecDecoding(method, a.num_speculative_tokens,
                            DEFAULT_ACCEPTANCE if acceptance is None else acceptance, drafter)
        what += (f"; speculative {method}{f' ({a.speculative_model})' if draft_cfg is not None else ''}, "
                 f"up to {spec.k} drafts, acceptance {spec.acceptance:g}")
    if a.kv_cache_memory is not None:
        kind, value = parse_memory(a.kv_cache_memory)
        if kind != "bytes":
            raise ValueError("--kv-cache-memory takes bytes here, e.g. 40GiB")
        pool = value
    num_blocks = int(pool // (kv_token * a.block_size))
    if num_blocks < 1:
        raise ValueError("the KV pool holds no block; raise --kv-cache-memory")
    targets = dict(itl_target_ms=a.itl_target_ms or None, slo_ttft_ms=a.slo_ttft_ms, slo_tpot_ms=a.slo_tpot_ms,
                   slo_policy=a.slo_policy, policy=a.scheduling_policy)
    plans = bool(targets["itl_target_ms"] or a.slo_ttft_ms or a.slo_tpot_ms)
    sched = SchedulerConfig(max_num_seqs=a.max_num_seqs,
                            max_num_batched_tokens=a.max_num_batched_tokens or (None if plans else budget),
                            enable_chunked_prefill=a.enable_chunked_prefill, **targets)
    dis = disaggregation(a, hw, transfer_token)
    if dis is not None:
        what += (f"; disaggregated {dis.prefill}:{dis.decode} (prefill:decode instances), "
                 f"{transfer_token:.0f} B of KV a token over an instance's {dis.link_bandwidth * 8 / 1e9:g} Gb/s "
                 f"link + {dis.link_latency * 1e6:g} us a transfer")
    in_flight = 1
    if hw is not None and a.pipeline_parallel_size > 1:
        in_flight = a.pipeline_batches_in_flight or a.pipeline_parallel_size
        if in_flight > 1:
            what += f"; {in_flight} steps in flight across {a.pipeline_parallel_size} stages"
    if len(a.request_overhead_ms) > 2:
        raise ValueError("--request-overhead-ms takes FIXED and optionally PER_1K (ms a thousand prompt tokens)")
    fixed, per_1k = (list(a.request_overhead_ms) + [0.0])[:2]
    sim = Simulator(cost, sched, num_blocks, a.block_size, max_len, a.enable_prefix_caching, keep_breakdown=True,
                    spec=spec, disaggregation=dis, steps_in_flight=in_flight,
                    request_overhead_s=fixed / 1000, request_overhead_per_token_s=per_1k / 1e6,
                    front_end_shares_cpu=a.front_end_shares_cpu)
    if fixed or per_1k:
        what += f"; {fixed:g} ms + {per_1k:g} ms per 1k prompt tokens of front end a request"
    return cost, sim, what, kv_token


def disaggregation(a: argparse.Namespace, hw: HardwareProfile | None, kv_token: float) -> Disaggregation | None:
    """The Disaggregation of --disaggregated P:D and the KV link flags, or None without them. The link is
    the hardware profile's NIC (or --kv-link-gbps) times the devices of an instance: each ships its shard."""
    from tokenmill.sim.simulator import Disaggregation

    if a.disaggregated is None:
        if a.kv_link_gbps is not None or a.kv_link_latency_us is not None:
            raise ValueError("--kv-link-gbps and --kv-link-latency-us price the KV transfer of --disaggregated "
                             "P:D; pass it too")
        return None
    try:
        p, d = (int(v) for v in a.disaggregated.split(":"))
    except ValueError:
        raise ValueError(f"--disaggregated takes P:D, prefill and decode instances, e.g. 1:1; got "
                         f"{a.disaggregated!r}") from None
    if a.kv_link_gbps is not None:
        if not a.kv_link_gbps > 0:
            raise ValueError(f"--kv-link-gbps must be positive, got {a.kv_link_gbps:g}")
        per_device = a.kv_link_gbps * 1e9 / 8
    elif hw is not None and hw.kv_link_bandwidth > 0:
        per_device = hw.kv_link_bandwidth
    else:
        raise ValueError("--disaggregated needs the network between instances: pass --kv-link-gbps (e.g. 400 "
                         "for InfiniBand NDR, 100 for Ethernet)" + ("" if hw is None else f"; {hw.name}'s "
                                                                      "profile has no kv_link_bandwidth"))
    latency = (a.kv_link_latency_us * 1e-6 if a.kv_link_latency_us is not None else
               hw.kv_link_latency if hw is not None else 0.0)
    if latency < 0:
        raise ValueError(f"--kv-link-latency-us cannot be negative, got {a.kv_link_latency_us:g}")
    devices = a.tensor_parallel_size * a.pipeline_parallel_size if hw is not None else 1
    return Disaggregation(p, d, kv_token, per_device * devices, latency)


def speculative(a: argparse.Namespace, cfg: ModelConfig, max_len: int) -> tuple[str | None, ModelConfig | None]:
    """(method or None, the draft model's ModelConfig or None) of the speculative flags, checked as the
    engine checks them (config.SpeculativeConfig, and a draft model must share the target's vocabulary
    and reach its context)."""
    from tokenmill.config import SpeculativeConfig
    from tokenmill.perf.cost import DTYPE_BYTES

    sc = SpeculativeConfig(a.speculative_method, a.num_speculative_tokens, speculative_model=a.speculative_model)
    if sc.speculative_method is None:
        if a.speculative_acceptance_rate is not None:
            raise ValueError("--speculative-acceptance-rate needs speculative decoding: pass --speculative-method "
                             "ngram or --speculative-model")
        return None, None
    if a.speculative_weight_dtype is not None and a.speculative_weight_dtype not in DTYPE_BYTES:
        raise ValueError(f"unknown --speculative-weight-dtype {a.speculative_weight_dtype!r}: one of "
                         f"{', '.join(DTYPE_BYTES)}")
    if sc.num_speculative_tokens >= max_len:
        raise ValueError(f"--num-speculative-tokens {sc.num_speculative_tokens} leaves no room in the "
                         f"{max_len}-token context; use fewer")
    if sc.speculative_method != "draft":
        return sc.speculative_method, None
    draft, draft_name = model_config(sc.speculative_model)
    if draft.vocab_size != cfg.vocab_size:
        raise ValueError(f"--speculative-model {draft_name} has {draft.vocab_size} token ids, the target "
                         f"{cfg.vocab_size}: a draft model must share the target's vocabulary")
    if draft.max_position_embeddings < max_len:
        raise ValueError(f"--speculative-model reaches {draft.max_position_embeddings} tokens of context, the "
                         f"target {max_len}: pass --max-model-len {draft.max_position_embeddings} or less")
    return "draft", draft


def workload(a: argparse.Namespace) -> list[SampleRequest]:
    from tokenmill.bench.datasets import PromptMaker, sample_requests
    from tokenmill.models.tokenizer_loader import load_tokenizer
    from tokenmill.bench.datasets import dataset_spec

    spec = dataset_spec(a)
    spec.check()
    tokenizer = a.tokenizer or (a.model if not a.model.endswith(".json") and not Path(a.model).is_dir() else
                                "smollm2-135m-instruct")
    return sample_requests(spec, PromptMaker(load_tokenizer(tokenizer)))


MAX_REQUESTS = 100_000  # the rate search stops where a window would need more


def window(requests: list[SampleRequest], rate: float | None, a: argparse.Namespace) -> list[SampleRequest]:
    """The requests of --duration seconds at ``rate``: the workload cycled to rate x duration of them."""
    if rate is None or math.isinf(rate) or requests[0].arrival_s is not None:
        return requests
    n = max(len(requests), math.ceil(rate * a.duration))
    return [requests[i % len(requests)] for i in range(n)]


def run_at(sim: Simulator, requests: list[SampleRequest], rate: float | None, a: argparse.Namespace, slos: dict,
           ) -> tuple[RunResult, SimResult]:
    from tokenmill.bench.arrivals import schedule
    from tokenmill.bench.metrics import calculate_metrics
    from tokenmill.bench.runner import LoadSpec, RunResult

    requests = window(requests, rate, a)
    times = schedule(requests, rate, a.burstiness, a.seed, a.time_scale)
    out = sim.run(requests, times.tolist(), seed=a.seed)
    load = LoadSpec(rate, a.burstiness, None, a.time_scale, a.seed)
    metrics = calculate_metrics(out.results, out.duration, slos, sorted({50, 90, 99, a.slo_percentile}))
    return RunResult("simulated", load, out.results, out.duration, metrics), out


def search(sim: Simulator, requests: list[SampleRequest], a: argparse.Namespace, slos: dict[str, float],
           ) -> tuple[tuple[RunResult, SimResult] | None, tuple[RunResult, SimResult] | None]:
    """The highest Poisson/gamma rate whose SLO percentile holds: double until one fails, then bisect."""
    from tokenmill.bench.metrics import meets_slo_percentile

    ok = lambda r: meets_slo_percentile(r[0].metrics, slos, a.slo_percentile)  # noqa: E731
    lo, hi, best, rate = None, None, None, 0.25
    for _ in range(24):
        if len(window(requests, rate, a)) > MAX_REQUESTS:
            print(f"the search stops at {rate / 2:g} req/s: a {a.duration:g} s window at {rate:g} req/s would be "
                  f"more than {MAX_REQUESTS} requests (lower --duration to go on); the answer is a lower bound",
                  file=sys.stderr)
            break
        r = run_at(sim, requests, rate, a, slos)
        if ok(r):
            lo, best = rate, r
            rate *= 2
        else:
            hi = rate
            break
    if lo is None:
        return None, r
    for _ in range(SEARCH_STEPS if hi is not None else 0):
        mid = (lo + hi) / 2
        r = run_at(sim, requests, mid, a, slos)
        if ok(r):
            lo, best = mid, r
        else:
            hi = mid
    return best, None


def report(label: str, run: RunResult, out: SimResult, what: str, kv_token: float, a: argparse.Namespace,
           slos: dict[str, float]) -> str:
    from tokenmill.bench.report import run_block

    m = run.metrics
    lines = [f"== {label}: {what}", run_block(run, sorted({50, 90, 99, a.slo_percentile}), slos)]
    running = [s.num_running for s in out.steps] or [0]
    peak_blocks = max((s.kv_blocks_used for s in out.steps), default=0)
    mean_latency = m.get("mean_e2el_ms", 0.0) / 1e3
    if run.load.request_rate is not None and not math.isinf(run.load.request_rate):
        users = run.load.request_rate * (a.think_time + mean_latency)
        lines.append(f"users supported: {users:.0f} (at {run.load.request_rate:.3g} req/s, a {a.think_time:g} s "
                     f"think time and {mean_latency:.2f} s mean latency)")
    if out.transfers is None:
        lines.append(f"batch: mean {sum(running) / len(running):.1f}, max {max(running)} running requests; "
                     f"KV memory: peak {peak_blocks * out.block_size * kv_token / 2**30:.2f} GiB of "
                     f"{out.num_blocks * out.block_size * kv_token / 2**30:.2f} GiB; preemptions {out.num_preemptions}")
    else:
        lines.extend(disaggregation_lines(run, out, kv_token))
    parts: dict[str, float] = {}
    for s in out.steps:
        for k, v in (s.breakdown or {}).items():
            if k != "seconds":
                parts[k] = parts.get(k, 0.0) + v
    if "compute_s" in parts:
        bound = {"compute": 0.0, "memory": 0.0}
        for s in out.steps:
            b = s.breakdown
            bound["compute" if b["compute_s"] >= b["memory_s"] else "memory"] += b["seconds"]
        total = sum(bound.values()) or 1.0
        lines.append(f"where the time goes: {100 * bound['compute'] / total:.0f}% of step time in compute-bound steps "
                     f"(prefill-heavy), {100 * bound['memory'] / total:.0f}% in bandwidth-bound ones (decode); "
                     f"communication (all-reduces, stage transfers) {parts.get('comm_s', 0):.2f} s"
                     + (f", pipeline bubble {parts['bubble_s']:.2f} s" if "bubble_s" in parts else ""))
    elif parts:
        total = (parts.get("prefill_s", 0) + parts.get("decode_s", 0)) or 1.0
        lines.append(f"where the time goes: prefill {100 * parts.get('prefill_s', 0) / total:.0f}%, decode "
                     f"{100 * parts.get('decode_s', 0) / total:.0f}% of the token-dependent step time")
    if out.spec is not None:
        sp = out.spec
        busy = sum(s.duration for s in out.steps) or 1.0
        drafting = sum(s.draft_s for s in out.steps)
        lines.append(f"speculative decoding: {sp['spec_num_draft_tokens']} drafts, {100 * sp['spec_acceptance_rate']:.1f}% "
                     f"accepted (vLLM's acceptance rate), mean acceptance length "
                     f"{sp['spec_mean_acceptance_length']:.2f} tokens a drafted step; the draft model's passes "
                     f"{100 * drafting / busy:.0f}% of step time")
    return "\n".join(lines)


def disaggregation_lines(run: RunResult, out: SimResult, kv_token: float) -> list[str]:
    """Where a disaggregated request's time to its first token went (means and p99 over those whose KV
    was shipped), and each kind of instance's batch and KV pool."""
    import numpy as np

    tr = out.transfers
    res = {r.index: r for r in run.results}

    def ms(values: list[float]) -> str:
        v = 1e3 * np.asarray(values, dtype=float)
        return f"mean {v.mean():.2f} ms, p99 {np.percentile(v, 99):.2f} ms" if len(v) else "none"

    first = [res[t.index].ttft_s + t.arrival - t.end for t in tr if res[t.index].success]
    p, d = out.roles.count("prefill"), out.roles.count("decode")
    mb = np.mean([t.bytes for t in tr] or [0]) / 1e6
    lines = [f"disaggregated {p}:{d}: KV shipped for {len(tr)} request{'' if len(tr) == 1 else 's'}, mean {mb:.1f} "
             f"MB each; prefill (queue + compute) {ms([t.prefilled - t.arrival for t in tr])}; queued for a decode "
             f"instance {ms([t.admitted - t.prefilled for t in tr])}; waiting for a link "
             f"{ms([t.start - t.admitted for t in tr])}; transfer {ms([t.end - t.start for t in tr])}; from its "
             f"end to the first token {ms(first)}"]
    for role in ("prefill", "decode"):
        steps = [s for s in out.steps if out.roles[s.instance] == role]
        running = [s.num_running for s in steps] or [0]
        peak = max((s.kv_blocks_used for s in steps), default=0)
        lines.append(f"{role} instances: batch mean {sum(running) / len(running):.1f}, max {max(running)} running "
                     f"requests; KV memory: peak {peak * out.block_size * kv_token / 2**30:.2f} GiB of "
                     f"{out.num_blocks * out.block_size * kv_token / 2**30:.2f} GiB an instance")
    lines[-1] += f"; preemptions {out.num_preemptions}"
    return lines


def cmd_simulate(a: argparse.Namespace) -> int:
    from tokenmill.bench.metrics import parse_goodput

    slos = parse_goodput(a.slo) if a.slo else {}
    configs = [("A" if a.compare else "simulated", a)]
    if a.compare:
        parser = argparse.ArgumentParser(prog="tokenmill simulate --compare", add_help=False)
        add_simulate_args(parser)
        # the second configuration: the first's values, with the --compare flags parsed over them
        b = parser.parse_args(shlex.split(a.compare), namespace=argparse.Namespace(**vars(a)))
        b.compare = None
        configs.append(("B", b))
    requests = workload(a)
    for label, c in configs:
        _, sim, what, kv_token = build(c)
        if c.request_rate is not None or not slos:
            run, out = run_at(sim, requests, c.request_rate, c, slos)
        else:
            best, worst = search(sim, requests, c, slos)
            if best is None:
                w = worst[0].metrics
                print(f"== {label}: no rate meets the SLOs, not even {worst[0].load.request_rate:g} req/s: there "
                      f"p{c.slo_percentile:g} TTFT {w[_key(c, 'ttft')]:.0f} ms, TPOT {w[_key(c, 'tpot')]:.1f} ms "
                      f"(the best this configuration does)")
                continue
            run, out = best
            print(f"== {label}: highest rate meeting the SLOs at p{c.slo_percentile:g}: "
                  f"{run.load.request_rate:.3g} req/s")
        print(report(label, run, out, what, kv_token, c, slos))
        if c.save_result:
            path = save_result(run, c, c.save_result if not a.compare else f"-{label}".join(
                [str(Path(c.save_result).with_suffix("")), Path(c.save_result).suffix or ".json"]))
            print(f"result {path}", file=sys.stderr)
        if c.plot:
            from tokenmill.bench.plots import write_plots

            for path in write_plots([run], str(Path(c.plot) / label), "rate", slos, c.slo_percentile):
                print(f"plot {path}", file=sys.stderr)
    return 0


def save_result(run: RunResult, a: argparse.Namespace, path: str) -> Path:
    """The run in `tokenmill bench serve --save-result`'s (vLLM's flat) layout, with what was simulated."""
    import json

    from tokenmill.bench.datasets import dataset_spec
    from tokenmill.bench.serve import flat_result

    doc = {**flat_result(run, a, dataset_spec(a)), "backend": "tokenmill-simulate",
           "simulated": {"hardware": a.hardware, "profile": a.profile, "tensor_parallel_size": a.tensor_parallel_size,
                         "weight_dtype": a.weight_dtype, "kv_dtype": a.kv_dtype, "compute_dtype": a.compute_dtype}}
    out = Path(path)
    out.write_text(json.dumps(doc))
    return out


def _key(a: argparse.Namespace, name: str) -> str:
    from tokenmill.bench.metrics import percentile_key

    return f"{percentile_key(a.slo_percentile)}_{name}_ms"
