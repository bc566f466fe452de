"""Microbenchmark of the linear-layer kernels torch offers on this machine, on the model's real shapes.

Candidates (each computes y = x @ W^T for x [M, K], W [N, K]):
- fp32     F.linear with float32 weights (MKL sgemm)
- fp32_t   torch.mm with the weight pre-transposed to a contiguous [K, N]
- bf16     F.linear in bfloat16 (x and W bf16)
- int8w    torch._weight_int8pack_mm: int8 weights, one scale per output channel, float activations
- int4w    torch._weight_int4pack_mm_for_cpu: int4 weights, group-32 scale and zero, float activations
- int8dyn  fbgemm quantized.linear_dynamic: activations quantized per call, int8 x int8 GEMM
- int4dyn  torch._dyn_quant_matmul_4bit (KleidiAI on Arm; a reference path elsewhere)
- tm_q8_ISA  tokenmill's integer kernel (torch.ops.tokenmill.qlinear), q8_0 blocks, one scale per channel
             (--quantization int8); activations int16 per token and block of 32
- tm_q4_ISA  the same kernel on q4_1 blocks (--quantization int4, and GGUF Q4_0/Q4_1 with gguf)
- tm_f32_ISA flinear, tokenmill's float32 GEMM in one summation order (--quantization none on the kernels)
  ISA is each instruction set this CPU can run it with (avx2; avx512vnni, which takes calls from the
  crossing timed at load, `vnni_min_tokens`, when selected): the same bits, so only the time differs.

    python benchmarks/linear_kernels.py                       # all shapes, M = 1, 64, 512
    python benchmarks/linear_kernels.py --m 1 --json results/linear.json

Prints, per (M, K, N), the median time of each kernel and its effective GB/s (weight bytes
read per call / time) and GFLOP/s (2*M*K*N / time).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

# (K, N, what): the SmolLM2-135M linear layers as the model runs them (q/k/v and gate/up fused)
SHAPES = [
    (576, 576, "o_proj"),
    (576, 192, "k_proj/v_proj (unfused)"),
    (576, 960, "qkv_proj (fused)"),
    (576, 1536, "gate_proj/up_proj (unfused)"),
    (576, 3072, "gate_up_proj (fused)"),
    (1536, 576, "down_proj"),
    (576, 49152, "lm_head (tied embedding)"),
]
GROUP = 32


def timeit(fn, min_time: float, min_reps: int = 5) -> float:
    fn()
    fn()  # warm up: packing caches, thread pools
    times = []
    start = time.perf_counter()
    while len(times) < min_reps or time.perf_counter() - start < min_time:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def make_kernels(w: torch.Tensor):
    """Build each candidate for weight w [N, K] float32; returns {name: (fn(x) -> y, weight bytes)}."""
    n, k = w.shape
    out = {}
    out["fp32"] = (lambda x: F.linear(x, w), w.numel() * 4)
    wt = w.t().contiguous()
    out["fp32_t"] = (lambda x: torch.mm(x, wt), w.numel() * 4)
    wb = w.to(torch.bfloat16)
    out["bf16"] = (lambda x: F.linear(x.to(torch.bfloat16), wb), w.numel() * 2)
    # int8 per output channel (symmetric)
    s8 = w.abs().amax(1).clamp(min=1e-8) / 127
    q8 = torch.round(w / s8[:, None]).clamp(-127, 127).to(torch.int8)
    out["int8w"] = (lambda x: torch._weight_int8pack_mm(x, q8, s8), q8.numel() + s8.numel() * 4)
    # int4 group-wise asymmetric: w = (q - 8) * scale + zero, q in [0, 15]
    g = w.view(n, k // GROUP, GROUP)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = ((hi - lo) / 15).clamp(min=1e-8)
    q4 = torch.round((g - lo[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int32).view(n, k)
    zero = lo + 8 * scale
    packed = torch._convert_weight_to_int4pack_for_cpu(q4, 1)
    sz = torch.stack([scale.t(), zero.t()], -1).contiguous()  # [K/G, N, 2]
    out["int4w"] = (lambda x: torch._weight_int4pack_mm_for_cpu(x, packed, GROUP, sz),
                    packed.numel() + sz.numel() * 4)
    # fbgemm dynamic int8 (per-channel weight scales)
    import warnings

    warnings.filterwarnings("ignore", message=".*quantize_per_tensor.*")
    qw = torch.quantize_per_channel(w, s8.double(), torch.zeros(n, dtype=torch.long), 0, torch.qint8)
    pk = torch.ops.quantized.linear_prepack(qw, None)
    out["int8dyn"] = (lambda x: torch.ops.quantized.linear_dynamic(x, pk, True), q8.numel() + s8.numel() * 4)
    try:
        q4u = (q4 - 8 + 8).to(torch.uint8)  # unsigned 0..15
        pw = torch._dyn_quant_pack_4bit_weight(q4u, scale.contiguous(), torch.zeros(n), GROUP, k, n)
        torch._dyn_quant_matmul_4bit(torch.zeros(1, k), pw, GROUP, k, n)  # does this build run it?
        out["int4dyn"] = (lambda x: torch._dyn_quant_matmul_4bit(x, pw, GROUP, k, n), q4.numel() // 2)
    except Exception as e:  # noqa: BLE001 -- report and go on: not every build has it
        print(f"# int4dyn unavailable: {type(e).__name__}: {str(e)[:100]}")
    from tokenmill.layers import quant
    from tokenmill.layers.kernels import cpu_kernels, unavailable_reason
    from tokenmill.layers.panel_linear import to_panels

    ops = cpu_kernels()
    if ops is None:
        print(f"# tokenmill kernels unavailable: {unavailable_reason()}")
    else:
        for name, qt in (("tm_q8", quant.quantize_int8(w)), ("tm_q4", quant.quantize_int4(w))):
            for isa in instruction_sets(ops):
                def run(x, qk=qt.kernel_layout(), fmt=quant.FORMAT_IDS[qt.fmt], isa=isa):
                    ops.kernel_isa(isa)  # a flag store: nothing beside the call itself is timed
                    return ops.qlinear(x, qk, n, fmt)
                out[f"{name}_{isa}"] = (run, qt.nbytes)
        panels = to_panels(w)
        for isa in instruction_sets(ops):
            def run_f32(x, isa=isa):
                ops.kernel_isa(isa)
                return ops.flinear(x, panels, n, None)
            out[f"tm_f32_{isa}"] = (run_f32, w.numel() * 4)
    return out, {"int8w": (q8.float() * s8[:, None]),
                 "int4w": ((q4.view(n, k // GROUP, GROUP).float() - 8) * scale[..., None] + zero[..., None]).view(n, k)}


def instruction_sets(ops) -> list[str]:
    """The many-token GEMM forms this CPU runs (the kernels pick the last by default)."""
    default = ops.kernel_isa("")
    found = ["avx2"]
    try:
        found.append(ops.kernel_isa("avx512vnni"))
    except RuntimeError:
        pass
    ops.kernel_isa(default)
    return found


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--m", type=int, action="append", help="rows (tokens) per call; repeatable (default 1, 64, 512)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    ap.add_argument("--min-time", type=float, default=0.4, help="seconds to time each kernel per shape (default 0.4)")
    ap.add_argument("--kernels", default=None, help="comma-separated subset of kernels to run")
    ap.add_argument("--json", default=None, help="write the results here as JSON")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    ms = a.m or [1, 64, 512]
    rows = []
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"CPU capability {torch.backends.cpu.get_cpu_capability()}")
    print(f"{'M':>4} {'K':>5} {'N':>6} {'kernel':>8} {'ms':>9} {'GB/s':>7} {'GFLOP/s':>8} {'rel.err':>8}")
    for k, n, what in SHAPES:
        w = torch.randn(n, k) * 0.05
        kernels, deq = make_kernels(w)
        for m in ms:
            x = torch.randn(m, k)
            ref = F.linear(x, w)
            for name, (fn, nbytes) in kernels.items():
                if a.kernels and name not in a.kernels.split(","):
                    continue
                y = fn(x).float()
                # error against the float GEMM on the kernel's own dequantized weights (kernel exactness),
                # where one exists; else against the float weights (includes quantization error)
                target = F.linear(x, deq[name]) if name in deq else ref
                err = ((y - target).norm() / target.norm()).item()
                t = timeit(lambda: fn(x), a.min_time)
                gbs, gfl = nbytes / t / 1e9, 2 * m * k * n / t / 1e9
                rows.append(dict(m=m, k=k, n=n, layer=what, kernel=name, ms=t * 1e3, gb_s=gbs, gflop_s=gfl,
                                 rel_err=err))
                print(f"{m:>4} {k:>5} {n:>6} {name:>8} {t * 1e3:>9.3f} {gbs:>7.1f} {gfl:>8.1f} {err:>8.1e}",
                      flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
