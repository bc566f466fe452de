"""Tensor parallelism: the decode step at --tensor-parallel-size 1 and T, and the bytes the driver's
collectives move per step (TPGroup's counters), on one 16-token prompt and 64 greedy tokens.

    python benchmarks/tensor_parallel.py --model /path/to/hf-folder --quantization none --sizes 1,2
    python benchmarks/tensor_parallel.py --sizes 1,3     # the embedded model, default (gguf) mode

Every process runs one torch thread (the engine's own process and each worker), so T ranks use T cores.
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch

from tokenmill import LLM, SamplingParams


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--quantization", default="auto")
    p.add_argument("--sizes", default="1,2")
    a = p.parse_args()
    os.environ["TOKENMILL_TP_THREADS"] = "1"
    torch.set_num_threads(1)
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    prompt = list(range(5, 21))
    for t in map(int, a.sizes.split(",")):
        llm = LLM(a.model, quantization=a.quantization, kv_cache_memory="64MiB", enable_prefix_caching=False,
                  tensor_parallel_size=t)
        try:
            llm.generate([prompt], params, use_tqdm=False)  # warm-up
            engine, executor = llm.engine, llm.engine.core.executor
            if executor is not None:
                executor.group.reset_counters()
            engine.step_stats.clear()
            llm.generate([prompt], params, use_tqdm=False)
            decode = [s for s in engine.step_stats if s.num_decode_tokens == 1 and not s.num_prefill_tokens]
            print(f"T={t}: decode step median {1e3 * statistics.median(s.duration for s in decode):.3f} ms "
                  f"(forward {1e3 * statistics.median(s.forward_s for s in decode):.3f} ms), {len(decode)} steps")
            if executor is not None:
                g = executor.group
                print(f"  driver, {len(engine.step_stats)} steps ({len(prompt)} + 63 tokens): {g.all_reduce_calls} "
                      f"all-reduces, {g.all_reduce_bytes} bytes; {g.all_gather_calls} all-gathers, "
                      f"{g.all_gather_bytes} bytes sent")
        finally:
            llm.shutdown()


if __name__ == "__main__":
    main()
