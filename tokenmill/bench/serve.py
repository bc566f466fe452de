"""``tokenmill bench serve``: the workload, the runs (one, a sweep, or two servers alternately), the
report, the JSON and the plots."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from tokenmill.bench.client import ApiConfig, wait_until_ready
from tokenmill.bench.datasets import dataset_spec, sample_requests
from tokenmill.models.tokenizer_loader import load_tokenizer
from tokenmill.bench.metrics import parse_goodput, parse_percentiles
from tokenmill.bench.report import compare_table, run_block, sustainable_point, sweep_table
from tokenmill.bench.runner import LoadSpec, RunResult, run_async

if TYPE_CHECKING:
    from tokenmill.bench.datasets import DatasetSpec


def _points(a: argparse.Namespace) -> list[LoadSpec]:
    base = dict(burstiness=a.burstiness, time_scale=a.time_scale, seed=a.seed)
    if not a.sweep:
        rate = None if a.dataset == "trace" and math.isinf(a.request_rate) else a.request_rate
        return [LoadSpec(rate, max_concurrency=a.max_concurrency, **base)]
    try:
        values = [float(v) for v in a.sweep.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"--sweep takes comma-separated numbers, e.g. 0.5,1,2; got {a.sweep!r}") from None
    if not values or any(not v > 0 for v in values):
        raise ValueError(f"--sweep values must be positive numbers; got {a.sweep!r}")
    values.sort()
    if a.sweep_over == "concurrency":
        if any(v != int(v) for v in values):
            raise ValueError("--sweep-over concurrency takes whole numbers")
        return [LoadSpec(a.request_rate, max_concurrency=int(v), **base) for v in values]
    return [LoadSpec(v, max_concurrency=a.max_concurrency, **base) for v in values]


def _check(a: argparse.Namespace) -> None:
    if a.max_concurrency is not None and a.max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be at least 1, got {a.max_concurrency}")
    if not 0 < a.slo_percentile <= 100:
        raise ValueError(f"--slo-percentile must be in (0, 100], got {a.slo_percentile}")
    if a.timeout <= 0:
        raise ValueError(f"--timeout must be positive, got {a.timeout}")


async def _bench(a: argparse.Namespace, apis: list[ApiConfig], workloads: list, warmup, points: list[LoadSpec],
                 slos: dict, percentiles: list[float]) -> list[list[RunResult]]:
    for api in apis:
        await wait_until_ready(api, warmup, a.ready_timeout)
    per_point: list[list[RunResult]] = []
    for k, load in enumerate(points):
        order = apis if k % 2 == 0 else apis[::-1]  # ABBA: neither server always goes first
        got = {}
        for api in order:
            got[api.label] = await run_async(api, workloads[k], load, timeout=a.timeout, progress=not a.no_progress,
                                             slos=slos, percentiles=percentiles)
        runs = [got[api.label] for api in apis]
        per_point.append(runs)
        for r in runs:
            print(run_block(r, percentiles, slos), flush=True)
        if a.sweep and slos and not a.sweep_keep_going and k < len(points) - 1:
            from tokenmill.bench.metrics import meets_slo_percentile

            if not any(meets_slo_percentile(r.metrics, slos, a.slo_percentile) for r in runs):
                print(f"every server misses the SLOs at {load.describe()}: the sweep stops here "
                      "(--sweep-keep-going runs the rest)", file=sys.stderr)
                break
    return per_point


def result_path(a: argparse.Namespace) -> Path | None:
    """Where --save-result writes: its own value, else --result-dir/--result-filename (vLLM's flags),
    else vLLM's kind of name; None when no result file is asked for."""
    if a.save_result is None and a.result_filename is None:
        return None
    name = a.save_result or a.result_filename
    if not name:
        rate = "inf" if math.isinf(a.request_rate) else f"{a.request_rate:g}"
        name = f"tokenmill-{rate}qps-{a.model.replace('/', '_')}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    return Path(a.result_dir or ".") / name


def flat_result(run: RunResult, a: argparse.Namespace, spec: DatasetSpec) -> dict:
    """One run in `vllm bench serve`'s layout: its keys at the top level, per-request lists beside."""
    ok = [r for r in run.results if r.success]
    return {
        "date": time.strftime("%Y%m%d-%H%M%S"), "backend": "openai", "label": run.label,
        "model_id": a.model, "tokenizer_id": a.tokenizer or a.model, "num_prompts": len(run.results),
        "request_rate": run.load.request_rate if run.load.request_rate is not None else "trace",
        "burstiness": run.load.burstiness, "max_concurrency": run.load.max_concurrency,
        **{k: v for k, v in run.metrics.items() if k != "errors"},
        "error_counts": run.metrics["errors"],
        "input_lens": [r.prompt_tokens if r.prompt_tokens is not None else r.prompt_len for r in ok],
        "output_lens": [r.completion_tokens if r.completion_tokens is not None else len(r.itl_s) + 1 for r in ok],
        "ttfts": [r.ttft_s for r in ok], "itls": [r.itl_s for r in ok],
        "generated_texts": [r.generated_text for r in ok],
        "errors": [r.error or "" for r in run.results],
        "requests": run.to_json()["requests"],
    }


def cmd_bench_serve(a: argparse.Namespace) -> int:
    _check(a)
    slos = parse_goodput(a.goodput)
    percentiles = parse_percentiles(a.percentiles)
    if a.slo_percentile not in percentiles:
        percentiles = sorted({*percentiles, a.slo_percentile})
    points = _points(a)
    apis = [ApiConfig(a.base_url, a.model, a.endpoint, a.api_key, a.ignore_eos, a.temperature, label=a.label or "")]
    if a.compare:
        apis.append(ApiConfig(a.compare, a.compare_model or a.model, a.endpoint, a.api_key, a.ignore_eos,
                              a.temperature, label=a.compare_label or ""))
        if apis[0].label == apis[1].label:
            raise ValueError("--base-url and --compare name the same server; give two servers, or "
                             "--label/--compare-label to tell them apart")
    spec = dataset_spec(a)
    spec.check()
    # Every sweep point gets prompts of its own (the same for both servers at that point), and the
    # readiness probe one from outside the workload: a server's prompt cache must not turn a later
    # point, or the first request, into cache hits.
    from dataclasses import replace

    from tokenmill.bench.datasets import PromptMaker

    maker = PromptMaker(load_tokenizer(a.tokenizer or a.model))
    workloads = [sample_requests(replace(spec, seed=spec.seed + k), maker) for k in range(len(points))]
    warmup = sample_requests(replace(spec, seed=spec.seed + 7919, num_prompts=1), maker)[0]
    per_point = asyncio.run(_bench(a, apis, workloads, warmup, points, slos, percentiles))
    runs = [r for point in per_point for r in point]
    over = a.sweep_over if a.sweep else "rate"
    if len(per_point) > 1 or len(apis) > 1:
        print(sweep_table(runs, over, slos, a.slo_percentile))
    if len(apis) > 1:
        print(compare_table([(p[0], p[1]) for p in per_point], over))
    if a.sweep and slos:
        for i, api in enumerate(apis):
            best = sustainable_point([p[i] for p in per_point], slos, a.slo_percentile)
            what = "concurrency" if over == "concurrency" else "request rate"
            print(f"{api.label}: highest {what} meeting the SLOs: "
                  + (f"{(best.load.max_concurrency if over == 'concurrency' else best.load.request_rate):g}"
                     f" ({best.metrics['request_throughput']:.2f} req/s, {best.metrics['output_throughput']:.1f}"
                     " output tok/s)" if best else "none of those swept"))
    path = result_path(a)
    if path is not None:
        doc = {"tool": "tokenmill bench serve", "argv": sys.argv[1:], "dataset": vars(spec), "slos_ms": slos,
               "slo_percentile": a.slo_percentile}
        if len(runs) == 1:
            doc = {**flat_result(runs[0], a, spec), **doc}
        else:
            doc["runs"] = [r.to_json() for r in runs]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(doc, indent=1, default=str))
        print(f"saved {path}", file=sys.stderr)
    if a.plot:
        from tokenmill.bench.plots import write_plots

        for path in write_plots(runs, a.plot, over, slos, a.slo_percentile):
            print(f"plot {path}", file=sys.stderr)
    return 0
