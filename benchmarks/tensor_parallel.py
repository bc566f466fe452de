"""Tensor parallelism: the decode step at --tensor-parallel-size 1 and T, and the bytes the driver's
collectives move per step (TPGroup's counters), on one 16-token prompt and 64 greedy tokens.

    python benchmarks/tensor_parallel.py --model /path/to/hf-folder --quantization none --sizes 1,2
    python benchmarks/tensor_parallel.py --sizes 1,3     # the embedded model, default (gguf) mode
    python benchmarks/tensor_parallel.py --moe mixtral --sizes 1,2 --expert-parallel

``--moe FAMILY`` writes a random mixture-of-experts model of that family (mixtral, qwen2_moe, olmoe; 8
experts, hidden 512, 4 layers) to a temporary folder and runs it; ``--expert-parallel`` runs each T > 1
three times: splitting every expert's width, then whole experts with each dispatch of
``--all2all-backend`` (default both, side by side: allreduce, then alltoall). Besides the decode step,
a batch of 8 prompts reports output tokens per second, and the bytes the driver's collectives send in
one decode step (one token) are reported.

Every process runs one torch thread (the engine's own process and each worker), so T ranks use T cores.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from tokenmill import LLM, SamplingParams


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--quantization", default="auto")
    p.add_argument("--sizes", default="1,2")
    p.add_argument("--moe", choices=["mixtral", "qwen2_moe", "olmoe"], help="a random MoE model of this family")
    p.add_argument("--expert-parallel", action="store_true", help="also run each T > 1 with --enable-expert-parallel")
    p.add_argument("--all2all-backend", choices=["allreduce", "alltoall", "both"], default="both",
                   help="the expert-parallel runs' dispatch (default: both, one run each)")
    a = p.parse_args()
    os.environ["TOKENMILL_TP_THREADS"] = "1"
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        model = write_moe(a.moe, Path(tmp)) if a.moe else a.model
        backends = ["allreduce", "alltoall"] if a.all2all_backend == "both" else [a.all2all_backend]
        runs = [(t, ep, b) for t in map(int, a.sizes.split(","))
                for ep, b in ([(False, "allreduce")] + [(True, b) for b in backends] if a.expert_parallel and t > 1
                              else [(False, "allreduce")])]
        for t, ep, backend in runs:
            run(model, a.quantization, t, ep, backend)


def write_moe(family: str, folder: Path) -> str:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    import tiny_models

    m = tiny_models.random_hf_model(family, hidden_size=512, intermediate_size=1024, moe_intermediate_size=512,
                                    num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                                    head_dim=64, mlp_only_layers=[], shared_expert_intermediate_size=1024)
    print(f"{family}: {sum(p.numel() for p in m.parameters()) / 1e6:.0f}M parameters, "
          f"{m.config.num_experts_per_tok} of 8 experts a token")
    return str(tiny_models.save_hf_folder(m, folder))


def run(model: str, quantization: str, t: int, ep: bool, backend: str = "allreduce") -> None:
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    prompt = list(range(5, 21))
    name = f"T={t}{f' EP {backend}' if ep else ''}"
    llm = LLM(model, quantization=quantization, kv_cache_memory="64MiB", enable_prefix_caching=False,
              tensor_parallel_size=t, enable_expert_parallel=ep, all2all_backend=backend)
    try:
        llm.generate([prompt], params, use_tqdm=False)  # warm-up
        engine, executor = llm.engine, llm.engine.core.executor
        if executor is not None:
            executor.group.reset_counters()
        engine.step_stats.clear()
        llm.generate([prompt], params, use_tqdm=False)
        decode = [s for s in engine.step_stats if s.num_decode_tokens == 1 and not s.num_prefill_tokens]
        print(f"{name}: decode step median {1e3 * statistics.median(s.duration for s in decode):.3f} ms "
              f"(forward {1e3 * statistics.median(s.forward_s for s in decode):.3f} ms), {len(decode)} steps")
        if executor is not None:
            g = executor.group
            print(f"  driver, {len(engine.step_stats)} steps ({len(prompt)} + 63 tokens): {g.all_reduce_calls} "
                  f"all-reduces, {g.all_reduce_bytes} bytes; {g.all_gather_calls} all-gathers, "
                  f"{g.all_gather_bytes} bytes sent; {g.all_to_all_calls} all-to-alls, {g.all_to_all_bytes} bytes "
                  "sent off-rank")
            print(f"  one decode step (1 token): {decode_step_bytes(llm, prompt)} bytes sent by the driver")
        batch = [[5 + i] + prompt for i in range(8)]
        start = time.perf_counter()
        llm.generate(batch, params, use_tqdm=False)
        print(f"  batch of 8: {8 * params.max_tokens / (time.perf_counter() - start):.1f} output tok/s")
    finally:
        llm.shutdown()


def decode_step_bytes(llm: LLM, prompt: list[int]) -> int:
    """The bytes the driver's collectives send in one one-token decode step: a prefill and one decode,
    less the prefill alone (the same prompt, so the same routing)."""
    g = llm.engine.core.executor.group
    sent = []
    for n in (1, 2):
        g.reset_counters()
        llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True), use_tqdm=False)
        sent.append(g.all_reduce_bytes + g.all_gather_bytes + g.all_to_all_bytes)
    return sent[1] - sent[0]


if __name__ == "__main__":
    main()
