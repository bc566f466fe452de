"""Fit the GPU hardware profiles' efficiencies to published measurements, and check them on figures held out.

The datasheet profiles (tokenmill/perf/hardware.py) are pure rooflines: 100% of peak FLOP/s and bandwidth,
no per-step cost. This fits three numbers per GPU, what a real engine achieves: ``flops_efficiency``,
``bandwidth_efficiency`` and ``step_overhead`` (seconds a step: launches, scheduling, sampling), to the
measured figures in benchmarks/data/gpu_published.json (each cited there: vLLM's CI, TensorRT-LLM's
performance overviews, NVIDIA NIM), and predicts the figures held out from the fit.

How: every figure's workload runs once through the simulator (the real scheduler) on the datasheet
profile, keeping each step's compute, memory and communication seconds. Where all requests arrive at once
or one at a time, the schedule does not depend on how long a step takes, so a profile's prediction is
those steps re-timed: max(compute / flops_eff, memory / bandwidth_eff) + comm + step_overhead. The fit
minimises the squared log error over a grid. Figures measured at a request rate are held out and predicted
by running the simulator again on the fitted profile.

    python benchmarks/fit_gpu_profiles.py [--gpus h100,h200,a100] [--json out.json]

Prints one table per GPU (each figure: measured, datasheet roofline, fitted; train or held out) and the
fitted profiles as JSON (what perf/hardware.py's ``FITTED`` holds).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
DATA = HERE / "data" / "gpu_published.json"

MODELS = {  # the shapes only (the simulator reads a config.json); Llama 3.1's context
    "llama3-8b": {"model_type": "llama", "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336,
                  "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                  "max_position_embeddings": 131072, "rope_theta": 500000.0},
    "llama3-70b": {"model_type": "llama", "vocab_size": 128256, "hidden_size": 8192, "intermediate_size": 28672,
                   "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8,
                   "max_position_embeddings": 131072, "rope_theta": 500000.0},
}
# each engine's batch limits where the figure does not state them: vLLM V0's defaults (256 sequences, no
# chunked prefill: a whole prompt a step); TensorRT-LLM's build defaults (2,048 sequences, 8,192 tokens a step)
ENGINE_LIMITS = {"vLLM": (256, 8192, False), "TensorRT-LLM": (2048, 8192, True), "NIM": (2048, 8192, True)}
HELD_OUT_WORKLOADS = {(1000, 1000)}  # every 1000/1000 row: the regime between the fitted ones
GRID_F = np.linspace(0.1, 1.0, 91)  # flops efficiencies
GRID_B = np.linspace(0.3, 1.0, 71)  # bandwidth efficiency
GRID_O = np.linspace(0.0, 0.01, 101)  # seconds a step
GRID_S = np.linspace(0.0, 20e-6, 41)  # seconds a request in a step
LOSS_SCALE = 0.1  # the robust loss: about squared log error below 10%, about absolute above (one odd figure
# must not drag the others)
LOW_PRECISION = ("fp8", "int8")


def engine_family(engine: str) -> str:
    return next(k for k in ENGINE_LIMITS if k in engine)


def fittable(fig: dict) -> str | None:
    """Why a figure cannot be reproduced, or None."""
    w = fig["workload"]
    if w["input_len"] is None or w["output_len"] is None:
        return "prompt and output lengths not published (a ShareGPT sample)"
    return None


def held_out(fig: dict) -> bool:
    w = fig["workload"]
    at_rate = w["request_rate"] not in ("inf", None)
    return at_rate or (w["input_len"], w["output_len"]) in HELD_OUT_WORKLOADS or (
        fig["metric"] == "batch_latency_s" and fig["model"] == "llama3-70b")


def kv_dtype(fig: dict) -> str:
    """The KV cache's dtype; where the source does not state it (NIM), the weights' (an fp8 profile keeps
    fp8 KV; with one request at a time it barely matters)."""
    return fig["kv_dtype"] or fig["weight_dtype"]


def no_evict_seqs(fig: dict, seqs: int, cfg_path: Path) -> int:
    """TensorRT-LLM's default scheduler (GUARANTEED_NO_EVICT) admits a request only with KV for its whole
    length reserved: at most the pool over (input + output) tokens run at once, never preempted."""
    from tokenmill.perf.cost import RooflineCost
    from tokenmill.perf.hardware import KNOWN
    from tokenmill.sim.cli import model_config

    cfg, _ = model_config(str(cfg_path))
    hw, tp = KNOWN[fig["gpu"]], fig["tensor_parallel"]
    cost = RooflineCost(cfg, hw, fig["weight_dtype"], kv_dtype(fig), fig["compute_dtype"], tensor_parallel_size=tp)
    pool = 0.9 * hw.memory_bytes * tp - cost.weight_bytes  # as `tokenmill simulate` sizes it
    w = fig["workload"]
    return max(1, min(seqs, int(pool // (cost.kv_token_bytes * (w["input_len"] + w["output_len"])))))


def sim_args(fig: dict, workdir: Path, hardware: str) -> list[str]:
    w = fig["workload"]
    cfg = workdir / f"{fig['model']}.json"
    if not cfg.exists():
        cfg.write_text(json.dumps(MODELS[fig["model"]]))
    family = engine_family(fig["engine"])
    seqs, tokens, chunked = ENGINE_LIMITS[family]
    seqs = w.get("max_num_seqs") or seqs
    if family != "vLLM":
        seqs = no_evict_seqs(fig, seqs, cfg)
    tokens = max(w.get("max_num_batched_tokens") or tokens, 0 if chunked else w["input_len"])
    closed_loop = w.get("concurrency") == 1 or w["num_prompts"] is None
    rate = w["request_rate"]
    args = ["--model", str(cfg), "--hardware", hardware, "--tokenizer", "smollm2-135m-instruct",
            "--tensor-parallel-size", str(fig["tensor_parallel"]),
            "--weight-dtype", fig["weight_dtype"], "--kv-dtype", kv_dtype(fig), "--compute-dtype", fig["compute_dtype"],
            "--dataset", "random", "--input-len", str(w["input_len"]), "--output-len", str(w["output_len"]),
            "--num-prompts", str(1 if closed_loop else w["num_prompts"]),
            "--request-rate", "inf" if closed_loop or rate in ("inf", None) else str(rate),
            "--max-num-seqs", str(seqs), "--max-num-batched-tokens", str(tokens),
            "--max-model-len", str(w["input_len"] + w["output_len"] + 16),
            "--no-enable-prefix-caching", "--duration", "0", "--seed", "0"]
    if not chunked:
        args.append("--no-enable-chunked-prefill")
    return args


def simulate(args: list[str]):
    from tokenmill.sim.cli import add_simulate_args, build, run_at, workload

    p = argparse.ArgumentParser()
    add_simulate_args(p)
    a = p.parse_args(args)
    _, sim, _, _ = build(a)
    run, out = run_at(sim, workload(a), a.request_rate, a, {})
    return run, out


@dataclasses.dataclass
class Steps:
    """A figure's steps on the datasheet profile: seconds of compute, memory and communication each, and
    the requests each step ran."""
    compute: np.ndarray
    memory: np.ndarray
    comm: np.ndarray
    seqs: np.ndarray
    prefill: np.ndarray  # bool: the step computed prompt tokens (with one request alone: before its first token)
    output_tokens: int
    total_tokens: int
    preemptions: int


CACHE_FORMAT = 2


def record(fig: dict, workdir: Path, cache: Path | None) -> Steps:
    """The figure's steps on the datasheet profile (from ``cache`` when it holds them: a simulation of
    30,000 requests takes two minutes)."""
    path = cache / f"{fig['id']}.v{CACHE_FORMAT}.npz" if cache is not None else None
    if path is not None and path.exists():
        z = np.load(path)
        return Steps(**{f.name: (z[f.name] if z[f.name].ndim else int(z[f.name])) for f in dataclasses.fields(Steps)})
    st = _record(fig, workdir)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        np.savez(path, **dataclasses.asdict(st))
    return st


def _record(fig: dict, workdir: Path) -> Steps:
    run, out = simulate(sim_args(fig, workdir, fig["gpu"]))
    bd = [s.breakdown for s in out.steps]
    outputs = sum(r.output_len for r in out.results)
    return Steps(np.array([x["compute_s"] for x in bd]), np.array([x["memory_s"] for x in bd]),
                 np.array([x["comm_s"] for x in bd]), np.array([len(s.scheduled) for s in out.steps]),
                 np.array([s.prefill_tokens > 0 for s in out.steps]),
                 outputs, outputs + sum(r.prompt_len for r in out.results), out.num_preemptions)


@dataclasses.dataclass(frozen=True)
class Params:
    flops: float  # of the bf16/fp16 peak
    low_flops: float  # of the fp8/int8 peak
    bandwidth: float
    overhead: float  # seconds a step
    seq_overhead: float  # seconds a request in a step

    def flops_for(self, fig: dict) -> float:
        return self.low_flops if fig["compute_dtype"] in LOW_PRECISION else self.flops


ROOFLINE = Params(1.0, 1.0, 1.0, 0.0, 0.0)


def predict_from_steps(fig: dict, st: Steps, p: Params) -> float:
    t = (np.maximum(st.compute / p.flops_for(fig), st.memory / p.bandwidth) + st.comm + p.overhead
         + p.seq_overhead * st.seqs)
    m = fig["metric"]
    if m == "batch_latency_s":
        return float(t.sum())
    if m == "output_tok_per_s":
        return st.output_tokens / float(t.sum())
    if m == "total_tok_per_s":
        return st.total_tokens / float(t.sum())
    if m == "ttft_ms_mean":  # one request alone: its prefill steps
        return 1e3 * float(t[st.prefill].sum())
    if m == "itl_ms_mean":
        return 1e3 * float(t[~st.prefill].mean())
    raise ValueError(f"no prediction for {m}")


def predict_by_simulation(fig: dict, profile, workdir: Path) -> float:
    path = workdir / f"profile-{fig['gpu']}.json"
    path.write_text(json.dumps(dataclasses.asdict(profile)))
    run, _ = simulate(sim_args(fig, workdir, str(path)))
    key = {"ttft_ms_mean": "mean_ttft_ms", "itl_ms_mean": "mean_itl_ms", "output_tok_per_s": "output_throughput",
           "total_tok_per_s": "total_token_throughput"}[fig["metric"]]
    return float(run.metrics[key])


def loss(figs: list[dict], steps: dict[str, Steps], p: Params) -> float:
    err = np.array([np.log(predict_from_steps(f, steps[f["id"]], p) / f["value"]) for f in figs])
    return float(np.sum(np.sqrt(1 + (err / LOSS_SCALE) ** 2) - 1))


def fit(figs: list[dict], steps: dict[str, Steps]) -> Params:
    """Coordinate descent over each parameter's grid, from the middle, until nothing moves; the fp8/int8
    efficiency follows the 16-bit one where no figure computes in them."""
    p = Params(0.6, 0.6, 0.7, 0.002, 0.0)
    low = any(f["compute_dtype"] in LOW_PRECISION for f in figs)
    grids = (("flops", GRID_F), ("low_flops", GRID_F), ("bandwidth", GRID_B), ("overhead", GRID_O),
             ("seq_overhead", GRID_S))
    for _ in range(20):
        before = p
        for name, grid in grids:
            if name == "low_flops" and not low:
                continue
            trials = [dataclasses.replace(p, **{name: float(v)}) for v in grid]
            p = min(trials, key=lambda q: loss(figs, steps, q))
        if not low:
            p = dataclasses.replace(p, low_flops=p.flops)
        if p == before:
            break
    return p


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpus", default="h100,h200,a100")
    ap.add_argument("--json", default=None, help="write the figures' predictions and the fitted profiles here")
    ap.add_argument("--cache", default=None, help="keep each figure's simulated steps in this folder (a rerun "
                                                   "of the fit then takes seconds)")
    args = ap.parse_args()
    from tokenmill.perf.hardware import KNOWN

    figs = json.loads(DATA.read_text())
    gpus = args.gpus.split(",")
    report = {"profiles": {}, "figures": []}
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        for gpu in gpus:
            mine = [f for f in figs if f["gpu"] == gpu]
            usable = [f for f in mine if fittable(f) is None]
            train = [f for f in usable if not held_out(f)]
            steps: dict[str, Steps] = {}
            for fig in usable:
                if fig["workload"]["request_rate"] in ("inf", None):
                    t0 = time.perf_counter()
                    steps[fig["id"]] = record(fig, workdir, Path(args.cache) if args.cache else None)
                    st = steps[fig["id"]]
                    print(f"  simulated {fig['id']}: {len(st.compute)} steps, {st.preemptions} preemptions, in "
                          f"{time.perf_counter() - t0:.1f} s", file=sys.stderr)
            p = fit(train, steps)
            profile = dataclasses.replace(KNOWN[gpu], flops_efficiency=p.flops, bandwidth_efficiency=p.bandwidth,
                                          low_precision_flops_efficiency=p.low_flops, step_overhead=p.overhead,
                                          sequence_overhead=p.seq_overhead)
            report["profiles"][gpu] = {**dataclasses.asdict(p), "fitted_on": [x["id"] for x in train]}
            print(f"\n== {KNOWN[gpu].name}: flops_efficiency {p.flops:.3f} (fp8/int8 {p.low_flops:.3f}), "
                  f"bandwidth_efficiency {p.bandwidth:.3f}, step_overhead {p.overhead * 1e3:.2f} ms + "
                  f"{p.seq_overhead * 1e6:.1f} us a request (fitted on "
                  f"{len(train)} figures)")
            print("| figure | metric | measured | roofline | ratio | fitted | error | set |")
            print("|---|---|---:|---:|---:|---:|---:|---|")
            for fig in mine:
                why = fittable(fig)
                if why is not None:
                    print(f"| {fig['id']} | {fig['metric']} | {fig['value']:g} | | | | | not reproducible: {why} |")
                    continue
                if fig["id"] in steps:
                    roof = predict_from_steps(fig, steps[fig["id"]], ROOFLINE)
                    fitted = predict_from_steps(fig, steps[fig["id"]], p)
                else:
                    roof = predict_by_simulation(fig, KNOWN[gpu], workdir)
                    fitted = predict_by_simulation(fig, profile, workdir)
                err = fitted / fig["value"] - 1
                kind = "held out" if held_out(fig) else "train"
                print(f"| {fig['id']} | {fig['metric']} | {fig['value']:g} | {roof:.4g} | "
                      f"{roof / fig['value']:.2f} | {fitted:.4g} | {100 * err:+.1f}% | {kind} |")
                report["figures"].append({"id": fig["id"], "gpu": gpu, "metric": fig["metric"],
                                          "measured": fig["value"], "roofline": roof, "fitted": fitted,
                                          "error": err, "set": kind})
    held = [x for x in report["figures"] if x["set"] == "held out"]
    within = sum(abs(x["error"]) <= 0.15 for x in held)
    print(f"\nheld out: {within} of {len(held)} within 15%; median |error| "
          f"{100 * float(np.median([abs(x['error']) for x in held])):.1f}%" if held else "")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
