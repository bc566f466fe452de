"""Pipeline parallelism: decode throughput and the measured bubble at --pipeline-parallel-size 1 and 2,
one step at a time with 1 to 8 micro-batches (beside the formula (P - 1) / (m + P - 1)) and with several
steps in flight (--pipeline-batches-in-flight, the default: one per stage).

    python benchmarks/pipeline_parallel.py [--model M] [--batch 16] [--micro-batches 1,2,4,8] [--in-flight 2]

A batch of requests decodes together (each: a 16-token prompt, 64 greedy tokens). Every process runs one
torch thread (the engine's own and each stage's), so P stages use P cores; P=1 also runs once on 2
threads, for scale. The bubble is measured on
rank 0 (stage 0, which also schedules and samples): the share of the run's wall time it spends blocked
waiting for the last stage's logits (TPGroup.recv_wait_s).
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from tokenmill import LLM, SamplingParams
from tokenmill.distributed.pipeline import bubble_fraction


def run(model: str, batch: int, p: int, m: int, n: int, threads: int = 1) -> None:
    torch.set_num_threads(threads)
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    prompts = [[5 + i] + list(range(20, 35)) for i in range(batch)]
    llm = LLM(model, kv_cache_memory="128MiB", enable_prefix_caching=False, pipeline_parallel_size=p,
              pipeline_micro_batches=m, pipeline_batches_in_flight=n)
    try:
        llm.generate(prompts, params, use_tqdm=False)  # warm-up
        engine, executor = llm.engine, llm.engine.core.executor
        engine.step_stats.clear()
        if executor is not None:
            executor.group.reset_counters()
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - start
        decode = [s for s in engine.step_stats if not s.num_prefill_tokens]
        decode_tps = sum(s.num_decode_tokens for s in decode) / sum(s.duration for s in decode)
        line = (f"P={p} m={m} in flight {n}{f' ({threads} threads)' if threads > 1 else ''}: {batch * params.max_tokens / wall:7.1f} output tok/s, decode steps "
                f"{decode_tps:7.1f} tok/s")
        if executor is not None:
            line += (f", rank 0 waits {100 * executor.group.recv_wait_s / wall:.0f}% of the run (one step at a "
                     f"time, equal stages: {100 * bubble_fraction(p, m):.0f}%), sent "
                     f"{executor.group.send_bytes / 2**20:.1f} MiB")
        print(line, flush=True)
    finally:
        llm.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--micro-batches", default="1,2,4,8", help="one step at a time, cut into m micro-batches")
    ap.add_argument("--in-flight", default="2", help="steps in flight (one micro-batch each)")
    a = ap.parse_args()
    os.environ["TOKENMILL_TP_THREADS"] = "1"
    torch.set_num_threads(1)
    run(a.model, a.batch, 1, 1, 1)
    run(a.model, a.batch, 1, 1, 1, threads=2)  # one process on both cores, for scale
    for m in map(int, a.micro_batches.split(",")):
        run(a.model, a.batch, 2, m, 1)
    for n in map(int, a.in_flight.split(",")):
        run(a.model, a.batch, 2, 1, n)


if __name__ == "__main__":
    main()
