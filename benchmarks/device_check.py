"""One prepared check for a lent GPU (issue: parallelism on torch.distributed): the NCCL path and the decode
step against its bandwidth floor, in one short run.

    python benchmarks/device_check.py                 # on the GPU machine (CUDA, NCCL)
    python benchmarks/device_check.py --device cpu    # the same code paths here (gloo), to test the script

1. The ceilings, measured: a large device-to-device copy (bytes read + written over time) and a bf16
   matrix product (FLOP/s), medians of timed repeats after a warm-up.
2. The collectives tensor parallelism uses, on tokenmill's own group (distributed/group.py: NCCL on a GPU)
   at world size 1: all-reduce, all-gather and the step broadcast, checked against their inputs on fresh
   random data and timed (at world size 1 this is the call and launch cost the engine pays per collective).
3. The engine on the device: the embedded model with float weights, greedy tokens against the CPU float32
   engine, then the decode step at batch 1 and 32 (median of the engine's own step times) against the
   floor: weight bytes read once per step over the measured copy bandwidth.

Prints a table last; writes everything to $OUT/device_check.json when $OUT is set.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device, repeats: int = 20, warmup: int = 3) -> float:
    """Median seconds of ``fn()`` (synchronized around each call)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        _sync(device)
        t = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def ceilings(device: torch.device) -> dict:
    n = (256 << 20) // 4 if device.type == "cuda" else (32 << 20) // 4
    src = torch.randn(n, device=device)
    dst = torch.empty_like(src)
    copy_s = timed(lambda: dst.copy_(src), device)
    m = 8192 if device.type == "cuda" else 512
    a = torch.randn(m, m, device=device, dtype=torch.bfloat16)
    b = torch.randn(m, m, device=device, dtype=torch.bfloat16)
    mm_s = timed(lambda: a @ b, device, repeats=10)
    assert torch.equal(dst, src), "the copy did not copy"
    return {"copy_bytes_per_s": 2 * src.numel() * 4 / copy_s, "bf16_flops_per_s": 2 * m**3 / mm_s}


def collectives(device: torch.device) -> dict:
    from tokenmill.distributed.group import TPGroup, create_store

    group = TPGroup(create_store(1), 0, 1, device)
    x = torch.randn(4096, 576, device=device)
    ref = x.clone()
    group.all_reduce_(x)
    assert torch.equal(x, ref), "all-reduce at world size 1 changed its input"
    g = group.all_gather(x)
    assert torch.equal(g, ref), "all-gather at world size 1 is not its input"
    msg = os.urandom(4096)
    assert group.broadcast_bytes(msg) == msg, "the step broadcast did not carry its bytes"
    return {"backend": "nccl" if device.type == "cuda" else "gloo",
            "all_reduce_s": timed(lambda: group.all_reduce_(x), device),
            "all_gather_s": timed(lambda: group.all_gather(x), device),
            "broadcast_4KiB_s": timed(lambda: group.broadcast_bytes(msg), device)}


def engine(device: torch.device, bandwidth: float) -> dict:
    from tokenmill import LLM
    from tokenmill.perf.roofline import weight_bytes_read
    from tokenmill.sampling_params import SamplingParams

    prompts = ["The capital of France is", "Once upon a time", "def fibonacci(n):"]
    greedy = SamplingParams(temperature=0, max_tokens=24)
    cpu = LLM("smollm2-135m-instruct", device="cpu", dtype="float32", quantization="none", kv_cache_memory="256MiB")
    ref = [o.outputs[0].token_ids for o in cpu.generate(prompts, greedy, use_tqdm=False)]
    del cpu
    out = {}
    for dtype in ("float32", "bfloat16"):
        llm = LLM("smollm2-135m-instruct", device=str(device), dtype=dtype, quantization="none",
                  kv_cache_memory="1GiB")
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
        agree = sum(a == b for r, g in zip(ref, got) for a, b in zip(r, g)) / sum(len(r) for r in ref)
        weights = weight_bytes_read(llm.engine.runner.model)
        row = {"greedy_agreement_with_cpu_fp32": agree, "weight_bytes": weights,
               "floor_s": weights / bandwidth}
        for batch in (1, 32):
            llm.engine.step_stats.clear()
            llm.generate(["Tell me a story."] * batch, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True),
                         use_tqdm=False)
            steps = [s.duration for s in llm.engine.step_stats if s.num_prefill_tokens == 0 and s.num_decode_tokens]
            row[f"decode_step_batch{batch}_s"] = statistics.median(steps[3:] or steps)
        out[dtype] = row
        llm.engine.shutdown()
        del llm
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = ap.parse_args()
    device = torch.device(a.device)
    report = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "torch": torch.__version__}
    report["ceilings"] = ceil = ceilings(device)
    report["collectives"] = coll = collectives(device)
    report["engine"] = eng = engine(device, ceil["copy_bytes_per_s"])
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "device_check.json"), "w") as f:
            json.dump(report, f, indent=1)
    print(f"\n{report['device']}, torch {report['torch']}")
    print(f"copy {ceil['copy_bytes_per_s'] / 1e9:.0f} GB/s (read + write), bf16 matmul "
          f"{ceil['bf16_flops_per_s'] / 1e12:.1f} TFLOP/s")
    print(f"{coll['backend']} at world size 1: all-reduce {1e6 * coll['all_reduce_s']:.0f} us, all-gather "
          f"{1e6 * coll['all_gather_s']:.0f} us, step broadcast {1e6 * coll['broadcast_4KiB_s']:.0f} us")
    print(f"{'dtype':<10}{'greedy = cpu':>13}{'floor ms':>10}{'batch 1 ms':>12}{'x floor':>9}{'batch 32 ms':>13}"
          f"{'x floor':>9}")
    for dtype, r in eng.items():
        f = r["floor_s"]
        print(f"{dtype:<10}{r['greedy_agreement_with_cpu_fp32']:>13.2f}{1e3 * f:>10.3f}"
              f"{1e3 * r['decode_step_batch1_s']:>12.3f}{r['decode_step_batch1_s'] / f:>9.1f}"
              f"{1e3 * r['decode_step_batch32_s']:>13.3f}{r['decode_step_batch32_s'] / f:>9.1f}")


if __name__ == "__main__":
    main()
