"""PNG plots of benchmark runs (matplotlib, no display needed)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from tokenmill.bench.metrics import percentile_key, tpot_s
from tokenmill.bench.runner import RunResult
from tokenmill.bench.timeline import tokens_in_flight


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _name(r: RunResult, over: str) -> str:
    if over == "concurrency":
        return f"{r.label} @ concurrency {r.load.max_concurrency}"
    rate = r.load.request_rate
    return f"{r.label} @ {'inf' if rate is None or math.isinf(rate) else f'{rate:g}'} req/s"


def latency_values(r: RunResult, metric: str) -> np.ndarray:
    ok = [x for x in r.results if x.success]
    if metric == "ttft":
        v = [x.ttft_s for x in ok]
    elif metric == "itl":
        v = [g for x in ok for g in x.itl_s]
    elif metric == "tpot":
        v = [t for x in ok if (t := tpot_s(x)) is not None]
    else:
        v = [x.e2el_s for x in ok]
    return np.sort(np.asarray(v, dtype=float)) * 1000.0


def plot_cdfs(runs: Sequence[RunResult], path: Path, over: str = "rate", metrics: Sequence[str] = ("ttft", "itl"),
              title: str = "") -> Path:
    """Empirical CDFs of each metric, one line per run."""
    plt = _plt()
    fig, axes = plt.subplots(1, len(metrics), figsize=(6 * len(metrics), 4.2), squeeze=False)
    for ax, metric in zip(axes[0], metrics):
        for r in runs:
            v = latency_values(r, metric)
            if len(v):
                ax.step(v, np.arange(1, len(v) + 1) / len(v), where="post", label=_name(r, over))
        ax.set_xscale("log")
        ax.set_xlabel(f"{metric.upper()} (ms, log scale)")
        ax.set_ylabel("fraction of " + ("gaps" if metric == "itl" else "requests"))
        ax.axhline(0.99, color="grey", lw=0.6, ls=":")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title or "latency CDFs")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_sweep(runs: Sequence[RunResult], path: Path, over: str, slos: dict[str, float],
               slo_percentile: float) -> Path:
    """Latency percentiles and goodput against the swept load, one line per server."""
    plt = _plt()
    pk = percentile_key(slo_percentile)
    panels = [("ttft", f"median and {pk} TTFT (ms)"), ("tpot", f"median and {pk} TPOT (ms)"),
              ("goodput", "throughput and goodput (req/s)")]
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.4))
    labels = list(dict.fromkeys(r.label for r in runs))
    for label in labels:
        mine = [r for r in runs if r.label == label]
        x = [r.load.max_concurrency if over == "concurrency" else r.load.request_rate for r in mine]
        for ax, (key, ylabel) in zip(axes, panels):
            if key == "goodput":
                line, = ax.plot(x, [r.metrics["request_throughput"] for r in mine], "o--", label=f"{label} throughput")
                if slos:
                    ax.plot(x, [r.metrics["request_goodput"] for r in mine], "o-", color=line.get_color(),
                            label=f"{label} goodput")
            else:
                line, = ax.plot(x, [r.metrics[f"median_{key}_ms"] for r in mine], "o--", label=f"{label} median")
                ax.plot(x, [r.metrics[f"{pk}_{key}_ms"] for r in mine], "o-", color=line.get_color(),
                        label=f"{label} {pk}")
            ax.set_ylabel(ylabel)
    for ax, (key, _) in zip(axes, panels):
        if key in slos:
            ax.axhline(slos[key], color="red", lw=0.8, ls=":", label=f"SLO {slos[key]:g} ms")
        if key != "goodput":
            ax.set_yscale("log")
        ax.set_xlabel("max concurrency" if over == "concurrency" else "request rate (req/s)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("latency and goodput against offered load")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_tokens_in_flight(runs: Sequence[RunResult], path: Path, over: str = "rate", points: int = 400) -> Path:
    """Prompt plus received output tokens of the requests in flight, over each run's time."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(9, 4.2))
    for r in runs:
        grid = np.linspace(0.0, max(r.duration_s, 1e-3), points)
        ax.plot(grid, tokens_in_flight(r.results, grid), label=_name(r, over))
    ax.set_xlabel("time since the run's start (s)")
    ax.set_ylabel("tokens in flight (prompt + output so far)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_plots(runs: Sequence[RunResult], out_dir: str, over: str, slos: dict[str, float],
                slo_percentile: float) -> list[Path]:
    d = Path(out_dir)
    d.mkdir(parents=True, exist_ok=True)
    paths = [plot_cdfs(runs, d / "latency_cdf.png", over), plot_tokens_in_flight(runs, d / "tokens_in_flight.png", over)]
    if len({(r.load.request_rate, r.load.max_concurrency) for r in runs}) > 1:
        paths.append(plot_sweep(runs, d / "sweep.png", over, slos, slo_percentile))
    return paths
