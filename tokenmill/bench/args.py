"""The benchmark commands' flags (``bench serve``, ``bench offline``, and the workload flags ``simulate``
shares), apart from the code that runs them: building the CLI's parser imports no HTTP client or
tokenizer, so every command starts without them."""

from __future__ import annotations

import argparse
import math

ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
DATASETS = ("random", "shared-prefix", "text", "trace", "sharegpt")


def _endpoint(value: str) -> str:
    """completions or chat; vLLM's paths (/v1/completions, /v1/chat/completions) name them too."""
    return {path: name for name, path in ENDPOINTS.items()}.get(value, value)


def add_dataset_args(p: argparse.ArgumentParser, seed: bool = True) -> None:
    g = p.add_argument_group("workload")
    g.add_argument("--dataset", "--dataset-name", default="random", choices=DATASETS,
                   help="random: random tokens of --input-len/--output-len; shared-prefix: a --prefix-len common "
                        "system prompt plus a --question-len question; text: windows of --dataset-path (plain text); "
                        "trace: the lengths and arrival times of an Azure-format CSV; sharegpt: ShareGPT JSON")
    g.add_argument("--dataset-path", default=None, help="the file for text, trace and sharegpt")
    g.add_argument("--num-prompts", type=int, default=100, help="requests in the workload (default 100)")
    g.add_argument("--input-len", "--random-input-len", type=int, default=None, help="prompt tokens (random, text; default 128)")
    g.add_argument("--output-len", "--random-output-len", type=int, default=None,
                   help="max_tokens of each request (default 128; sharegpt: the recorded reply's length)")
    g.add_argument("--range-ratio", "--random-range-ratio", type=float, default=0.0,
                   help="lengths drawn uniformly from len*(1-r) .. len*(1+r) (default 0: fixed)")
    g.add_argument("--long-input-every", type=int, default=0, metavar="N",
                   help="random: every N-th prompt is --long-input-len tokens (long prompts among short ones)")
    g.add_argument("--long-input-len", type=int, default=2048, help="random: tokens of the long prompts (default 2048)")
    g.add_argument("--prefix-len", type=int, default=1000, help="shared-prefix: tokens of the common prefix")
    g.add_argument("--question-len", type=int, default=32, help="shared-prefix: tokens of each question")
    g.add_argument("--num-prefixes", type=int, default=1, help="shared-prefix: distinct prefixes, round robin")
    g.add_argument("--trace-start", type=int, default=0, help="trace: first row to replay")
    g.add_argument("--trace-length-scale", type=float, default=1.0,
                   help="trace: multiply every recorded length by this (a CPU cannot serve GPU-sized requests)")
    g.add_argument("--trace-max-input-len", type=int, default=None, help="trace: cap on prompt tokens")
    g.add_argument("--trace-max-output-len", type=int, default=None, help="trace: cap on output tokens")
    if seed:  # the offline benchmark shares the engine's --seed
        g.add_argument("--seed", type=int, default=0, help="seed of the workload and the arrivals (default 0)")


def add_serve_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    g.add_argument("--base-url", required=True, help="the server, e.g. http://127.0.0.1:8000")
    g.add_argument("--model", required=True, help="the model name to send (see the server's /v1/models)")
    g.add_argument("--tokenizer", default=None,
                   help="tokenizer that builds the prompts: built-in alias, .gguf or HF folder (default: --model)")
    g.add_argument("--endpoint", default="completions", choices=list(ENDPOINTS), type=_endpoint,
                   help="completions (/v1/completions, default) or chat (/v1/chat/completions)")
    g.add_argument("--api-key", default=None, help="sent as a bearer token")
    g.add_argument("--label", default=None, help="name of the server in reports (default: host:port)")
    g.add_argument("--compare", default=None, metavar="URL2",
                   help="a second server: the same workload runs against both, alternating, and the report "
                        "puts them side by side with ratios")
    g.add_argument("--compare-model", default=None, help="model name on the second server (default: --model)")
    g.add_argument("--compare-label", default=None, help="name of the second server in reports")
    g.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="let requests stop at end-of-sequence (default: ignore_eos, so lengths are as asked)")
    g.add_argument("--temperature", type=float, default=0.0, help="sampling temperature sent (default 0)")
    g.add_argument("--timeout", type=float, default=600.0, help="seconds one request may take (default 600)")
    g.add_argument("--ready-timeout", type=float, default=120.0,
                   help="seconds to wait for each server to answer a first request (default 120)")

    g = p.add_argument_group("load")
    g.add_argument("--request-rate", type=float, default=math.inf,
                   help="mean requests per second (default inf: all at once); a trace keeps its own clock "
                        "unless this is given")
    g.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of the gaps: 1 = Poisson (default), <1 burstier, >1 more regular")
    g.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight from the client")
    g.add_argument("--time-scale", type=float, default=1.0, help="trace: stretch the recorded clock (2 = half rate)")
    g.add_argument("--sweep", default=None, metavar="V1,V2,...",
                   help="run once per value (request rates, or concurrencies with --sweep-over concurrency), "
                        "lowest first, and report the highest that meets the SLOs")
    g.add_argument("--sweep-over", default="rate", choices=["rate", "concurrency"], help="what --sweep varies")
    g.add_argument("--sweep-keep-going", action="store_true",
                   help="run every sweep point (default: stop after the first point where every server misses)")

    g = p.add_argument_group("metrics and output")
    g.add_argument("--goodput", nargs="+", default=None, metavar="NAME:MS",
                   help="SLOs in milliseconds, e.g. ttft:1000 tpot:100 (names: ttft, tpot, e2el)")
    g.add_argument("--slo-percentile", type=float, default=99.0,
                   help="a sweep point meets the SLOs when this percentile of each is within bound (default 99)")
    g.add_argument("--percentiles", "--metric-percentiles", default="50,90,99", help="latency percentiles to report (default 50,90,99)")
    g.add_argument("--save-result", nargs="?", const="", default=None, metavar="FILE.json",
                   help="write the metrics and every request's raw timings as JSON. One run writes vLLM's flat "
                        "layout (its keys at the top level, so scripts for `vllm bench serve` results read it); a "
                        "sweep or --compare nests its runs under \"runs\". Given alone, as vLLM's flag, the file "
                        "is --result-dir/--result-filename (default: a name from the model, rate and time)")
    g.add_argument("--result-filename", default=None, help="vLLM's spelling of the --save-result file name")
    g.add_argument("--result-dir", default=None, help="folder for the --save-result file (vLLM's flag)")
    g.add_argument("--ignore-eos", dest="ignore_eos", action="store_true", default=True,
                   help="accepted for vLLM compatibility: EOS is ignored by default (--no-ignore-eos stops at it)")
    g.add_argument("--plot", default=None, metavar="DIR", help="write PNG plots (latency CDFs, tokens in flight, sweep)")
    g.add_argument("--no-progress", "--disable-tqdm", action="store_true", help="hide the progress bar")
    add_dataset_args(p)


# (input_len, output_len, input range ratio, output range ratio)
PRESETS = {"fixed": (128, 128, 0.0, 0.0), "mixed": (528, 272, 496 / 528, 240 / 272)}


def add_offline_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workload", choices=[*PRESETS, "dataset"], default="fixed",
                   help="fixed: 128 in / 128 out (default); mixed: 32-1024 in / 32-512 out; "
                        "dataset: what --dataset and its flags describe")
    p.add_argument("--warmup", type=int, default=4, help="short requests run first, not timed (default 4)")
    p.add_argument("--output-json", default=None, metavar="FILE", help="write the figures as JSON")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    add_dataset_args(p, seed=False)
