"""``tokenmill explain``: a served request's time, as measured, as the simulator replays it, and what other
settings would have given it.

The server keeps each request's timeline and a step-cost model fitted on the steps it served
(engine/timelines.py, engine/live_cost.py). This reads the traffic around one request from
``GET /v1/requests/{id}/window`` (every kept request that arrived from the first one in flight with it to
its end: arrivals, prompt, cached and output tokens) and replays it through the simulator (the real
scheduler, a clock the fitted cost model advances) twice: with the server's own settings, and with the
``--what-if`` flags changed. Prompts are replayed as token ids that share a common head as long as each
request's prefix-cache hit, so the replay's cache hits are the served ones.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys

import httpx
import numpy as np

from tokenmill.sim.explain_args import WHAT_IF_FLAGS, what_if_parser
from tokenmill.sim.replay import replay

def changed_settings(engine: dict, flags: str) -> tuple[dict, str]:
    """The served settings with ``flags`` applied, and the flags as said back."""
    try:
        a, rest = what_if_parser().parse_known_args(shlex.split(flags))
    except (argparse.ArgumentError, ValueError) as e:
        raise ValueError(f"--what-if {flags!r}: {e}") from None
    if rest:
        raise ValueError(f"--what-if cannot change {' '.join(rest)}: it takes {', '.join(WHAT_IF_FLAGS)}")
    sched = dict(engine["scheduler"])
    names = {"max_num_batched_tokens": "max_num_batched_tokens", "max_num_seqs": "max_num_seqs",
             "enable_chunked_prefill": "enable_chunked_prefill", "scheduling_policy": "policy",
             "itl_target_ms": "itl_target_ms", "slo_ttft_ms": "slo_ttft_ms", "slo_tpot_ms": "slo_tpot_ms"}
    for flag, field in names.items():
        v = getattr(a, flag)
        if v is not None:
            sched[field] = v
    out = {**engine, "scheduler": sched, "speculative": what_if_speculation(engine.get("speculative") or {}, a)}
    if a.kv_blocks is not None:
        out["num_blocks"] = a.kv_blocks
    return out, flags


def what_if_speculation(served: dict, a: argparse.Namespace) -> dict:
    """Speculative decoding with the what-if's flags over the served settings."""
    spec = dict(served)
    if a.speculative_method is not None:
        spec["method"] = None if a.speculative_method == "off" else a.speculative_method
    for flag, key in (("num_speculative_tokens", "k"), ("speculative_acceptance_rate", "acceptance"),
                      ("speculative_draft_cost", "draft_cost")):
        if getattr(a, flag) is not None:
            spec[key] = getattr(a, flag)
    if spec.get("method") is None:
        return spec
    spec.setdefault("k", 3)
    if spec["k"] < 1:
        raise ValueError(f"--num-speculative-tokens must be positive, got {spec['k']}")
    if spec.get("acceptance") is not None and not 0 <= spec["acceptance"] <= 1:
        raise ValueError(f"--speculative-acceptance-rate is a probability in [0, 1], got {spec['acceptance']}")
    if spec["method"] == "draft" and served.get("method") != "draft" and not spec.get("draft_cost"):
        raise ValueError("a draft model the server did not run needs --speculative-draft-cost: its pass's time "
                         "as a share of a target step's of the same shape (about its weight bytes over the "
                         "target's, e.g. 0.15)")
    return spec


def _p(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def summary(per_request: dict[str, dict], target: str) -> dict:
    """The target's TTFT and end-to-end latency, and the window's TTFT and ITL percentiles."""
    ttfts = [v["ttft_s"] for v in per_request.values() if v.get("ttft_s") is not None]
    itls = [g for v in per_request.values() for g in v.get("itl_s", [])]
    me = per_request.get(target, {})
    return {"ttft_s": me.get("ttft_s"), "e2e_s": me.get("e2e_s"),
            "itl_p99_s": _p(me.get("itl_s", []), 99), "window_ttft_p50_s": _p(ttfts, 50),
            "window_ttft_p99_s": _p(ttfts, 99), "window_itl_p50_s": _p(itls, 50), "window_itl_p99_s": _p(itls, 99)}


def explain(window: dict, what_if: str | None = None) -> dict:
    target = window["request_id"]
    rows = window["requests"]
    me = next(r for r in rows if r["request_id"] == target)
    if not me["finished"]:
        raise ValueError(f"request {target} has not finished: explain it once it has")
    measured = {r["request_id"]: r for r in rows if r["finished"]}
    columns = {"served (measured)": summary(measured, target),
               "replayed as served": summary(replay(window, window["engine"]), target)}
    if what_if:
        engine, said = changed_settings(window["engine"], what_if)
        columns[f"with {said}"] = summary(replay(window, engine), target)
    cm = window["cost_model"]
    return {"request_id": target, "prompt_tokens": me["prompt_tokens"], "cached_tokens": me["cached_tokens"],
            "output_tokens": me["output_tokens"], "window_requests": len(rows),
            "window_s": max(r["arrival_s"] for r in rows), "cost_model_steps": cm.get("steps_fitted"),
            "cost_model_error": cm.get("prediction_error"), "columns": columns}


def render(r: dict) -> str:
    err = r["cost_model_error"]
    lines = [f"request {r['request_id']}: {r['prompt_tokens']} prompt tokens ({r['cached_tokens']} cached), "
             f"{r['output_tokens']} output tokens; {r['window_requests']} requests in its window (arrivals over "
             f"{r['window_s']:.2f} s); cost model fitted live on {r['cost_model_steps']} steps"
             + (f", its recent step prediction error {100 * err:.1f}%" if err is not None else "")]
    cols = list(r["columns"])
    rows = [("its TTFT", "ttft_s"), ("its end-to-end latency", "e2e_s"), ("its p99 gap between tokens", "itl_p99_s"),
            ("window TTFT p50", "window_ttft_p50_s"), ("window TTFT p99", "window_ttft_p99_s"),
            ("window ITL p50", "window_itl_p50_s"), ("window ITL p99", "window_itl_p99_s")]
    width = max(24, *(len(c) + 2 for c in cols))
    lines.append(" " * 28 + "".join(c.ljust(width) for c in cols))
    for label, key in rows:
        cells = [r["columns"][c][key] for c in cols]
        lines.append(label.ljust(28) + "".join(("-" if v is None else f"{1e3 * v:.1f} ms").ljust(width)
                                              for v in cells))
    return "\n".join(lines)


def cmd_explain(a: argparse.Namespace) -> int:
    import os

    key = a.api_key or os.environ.get("TOKENMILL_API_KEY")
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    url = f"{a.url.rstrip('/')}/v1/requests/{a.request}/window"
    try:
        resp = httpx.get(url, headers=headers, timeout=30)
    except httpx.HTTPError as e:
        print(f"tokenmill explain: cannot reach {a.url} ({e})", file=sys.stderr)
        return 1
    if resp.status_code != 200:
        try:
            why = resp.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            why = resp.text[:200]
        hint = " (pass --api-key)" if resp.status_code == 401 else ""
        print(f"tokenmill explain: {url} answered {resp.status_code}: {why}{hint}", file=sys.stderr)
        return 1
    try:
        result = explain(resp.json(), a.what_if)
    except ValueError as e:
        print(f"tokenmill explain: {e}", file=sys.stderr)
        return 1
    print(json.dumps(result, indent=1) if a.json else render(result))
    return 0


