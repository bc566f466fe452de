"""``tokenmill bench offline``: engine-only throughput through ``LLM.generate`` (no HTTP).

Presets are the core engine's benchmark workloads: ``fixed`` is 128 prompt / 128 output tokens,
``mixed`` draws prompts of 32-1024 and outputs of 32-512 tokens. ``--dataset`` and its flags build
any other workload. Every request generates exactly its output length (EOS ignored, greedy).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from tokenmill.bench.args import PRESETS
from tokenmill.bench.datasets import DatasetSpec, dataset_spec, sample_requests


def build_requests(a: argparse.Namespace, tokenizer) -> list[tuple[list[int], int]]:
    """(prompt token ids, output length) per request."""
    spec = dataset_spec(a)
    if a.workload == "dataset":
        return [(r.prompt_ids, r.output_len) for r in sample_requests(spec, tokenizer)]
    i, o, ri, ro = PRESETS[a.workload]
    # Prompts and output lengths are drawn separately: their range ratios differ.
    ins = sample_requests(DatasetSpec("random", num_prompts=spec.num_prompts, input_len=i, output_len=1,
                                      range_ratio=ri, seed=spec.seed), tokenizer)
    outs = sample_requests(DatasetSpec("random", num_prompts=spec.num_prompts, input_len=1, output_len=o,
                                       range_ratio=ro, seed=spec.seed + 1), tokenizer)
    return [(r.prompt_ids, s.output_len) for r, s in zip(ins, outs)]


def cmd_bench_offline(a: argparse.Namespace) -> int:
    from tokenmill.engine.arg_utils import engine_kwargs
    from tokenmill.engine.llm import LLM
    from tokenmill.sampling_params import SamplingParams

    llm = LLM(**engine_kwargs(a))
    reqs = build_requests(a, llm.tokenizer)
    if a.warmup:
        warm = [ids[:32] for ids, _ in reqs[:a.warmup]]
        llm.generate(warm, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False,
                     add_special_tokens=False)
    params = [SamplingParams(temperature=0, max_tokens=o, ignore_eos=True) for _, o in reqs]
    preempted = llm.engine.num_preemptions
    llm.engine.step_stats.clear()
    start = time.perf_counter()
    outs = llm.generate([ids for ids, _ in reqs], params, use_tqdm=not a.no_progress, add_special_tokens=False)
    elapsed = time.perf_counter() - start
    n_in = sum(len(ids) for ids, _ in reqs)
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    if n_out != sum(o for _, o in reqs):
        raise RuntimeError("an offline request stopped short of its output length; this is a bug")
    row = {"workload": a.workload, "requests": len(reqs), "input_tokens": n_in, "output_tokens": n_out,
           "elapsed_s": elapsed, "request_throughput": len(reqs) / elapsed, "output_throughput": n_out / elapsed,
           "total_token_throughput": (n_in + n_out) / elapsed, "dtype": str(llm.engine.dtype).removeprefix("torch."),
           "max_num_seqs": a.max_num_seqs, "max_num_batched_tokens": llm.engine.config.scheduler.max_num_batched_tokens}
    row["preemptions"] = llm.engine.num_preemptions - preempted
    print(f"{len(reqs)} requests, {n_in} prompt + {n_out} output tokens in {elapsed:.2f} s: "
          f"{row['request_throughput']:.2f} req/s, {row['output_throughput']:.1f} output tok/s, "
          f"{row['total_token_throughput']:.1f} total tok/s ({row['dtype']})")
    if llm.engine.core.proposer is not None:
        from tokenmill.spec_decode.stats import summarize

        row.update(summarize([s.spec for s in llm.engine.step_stats if s.spec is not None]))
        print(f"speculative decoding: acceptance rate {row['spec_acceptance_rate']:.1%}, mean acceptance length "
              f"{row['spec_mean_acceptance_length']:.2f}, per position "
              + " ".join(f"{r:.2f}" for r in row["spec_acceptance_rate_per_pos"]))
    if a.output_json:
        Path(a.output_json).write_text(json.dumps(row, indent=1))
        print(f"saved {a.output_json}", file=sys.stderr)
    return 0
