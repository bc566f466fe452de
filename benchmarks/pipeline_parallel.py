"""Pipeline parallelism: decode throughput and the measured bubble at --pipeline-parallel-size 1 and 2
with 1 to 8 micro-batches, beside the formula (P - 1) / (m + P - 1).

    python benchmarks/pipeline_parallel.py [--model M] [--batch 16] [--micro-batches 1,2,4,8]

A batch of requests decodes together (each: a 16-token prompt, 64 greedy tokens). Every process runs one
torch thread (the engine's own and each stage's), so P stages use P cores. The bubble is measured on
rank 0 (stage 0, which also samples): the share of its forward passes it spends waiting for the last
stage's logits (TPGroup.recv_wait_s), over the decode-only steps.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from tokenmill import LLM, SamplingParams
from tokenmill.distributed.pipeline import bubble_fraction


def run(model: str, batch: int, p: int, m: int) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    prompts = [[5 + i] + list(range(20, 35)) for i in range(batch)]
    llm = LLM(model, kv_cache_memory="128MiB", enable_prefix_caching=False, pipeline_parallel_size=p,
              pipeline_micro_batches=m)
    try:
        llm.generate(prompts, params, use_tqdm=False)  # warm-up
        engine, executor = llm.engine, llm.engine.core.executor
        engine.step_stats.clear()
        if executor is not None:
            executor.group.reset_counters()
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - start
        steps = engine.step_stats
        decode = [s for s in steps if not s.num_prefill_tokens]
        line = (f"P={p} m={m}: {batch * params.max_tokens / wall:7.1f} output tok/s, decode step median "
                f"{1e3 * statistics.median(s.duration for s in decode):.2f} ms")
        if executor is not None:
            forward = sum(s.forward_s for s in steps)
            line += (f", rank 0 waits {100 * executor.group.recv_wait_s / forward:.0f}% of its forward time "
                     f"(formula {100 * bubble_fraction(p, m):.0f}%), sent {executor.group.send_bytes / 2**20:.1f} MiB")
        print(line, flush=True)
    finally:
        llm.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--micro-batches", default="1,2,4,8")
    a = ap.parse_args()
    os.environ["TOKENMILL_TP_THREADS"] = "1"
    torch.set_num_threads(1)
    run(a.model, a.batch, 1, 1)
    for m in map(int, a.micro_batches.split(",")):
        run(a.model, a.batch, 2, m)


if __name__ == "__main__":
    main()
