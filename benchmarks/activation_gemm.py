"""The panel GEMM with int16 against int8 activations (``--activation-precision``), per instruction set.

Times ``torch.ops.tokenmill.qlinear`` on random Q4_K / Q6_K matrices in panels of 8 rows in the Llama-3.2-1B
shape (16384x2048, the fused gate/up; 2048x8192, down_proj), alternating the two precisions call by call,
best of --rounds, and prints GMAC/s and the int8 / int16 speed-up per (format, shape, ISA, tokens).

    python benchmarks/activation_gemm.py
    python benchmarks/activation_gemm.py --tokens 1,2,3,4,5 --isas avx2 --formats Q4_K
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from test_gguf_kquants import _layouts, _native  # noqa: E402  (seeded native blocks, every kernel layout)

from tokenmill.layers.kernels import cpu_kernels  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="1,4,16,64,256", help="tokens a call, comma-separated")
    ap.add_argument("--isas", default="avx2,avx512vnni", help="instruction sets (avx512vnni where the CPU has it)")
    ap.add_argument("--formats", default="Q4_K,Q6_K")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    ops = cpu_kernels()
    if ops is None:
        sys.exit("the CPU kernels are unavailable here")
    torch.set_num_threads(a.threads)
    isas = [i for i in a.isas.split(",") if i == "avx2" or _has_vnni(ops)]
    cases = [(kind, n, k, packed, fid) for kind in a.formats.split(",") for n, k in ((16384, 2048), (2048, 8192))
             for _, packed, fid in _layouts(_native(kind, n, k, 1)) if fid >= 6]  # the panel layouts
    before = ops.kernel_isa(""), ops.activation_precision("")
    best: dict[tuple, float] = {}
    try:
        for _ in range(a.rounds):
            for kind, n, k, w, f in cases:
                for isa in isas:
                    ops.kernel_isa(isa)
                    for m in map(int, a.tokens.split(",")):
                        x = torch.randn(m, k)
                        reps = max(2, min(20, 2000 // m))
                        for prec in ("int16", "int8"):
                            ops.activation_precision(prec)
                            ops.qlinear(x, w, n, f)
                            t0 = time.perf_counter()
                            for _ in range(reps):
                                ops.qlinear(x, w, n, f)
                            key = (kind, n, k, isa, m, prec)
                            best[key] = min(best.get(key, 1e9), (time.perf_counter() - t0) / reps)
    finally:
        ops.kernel_isa(before[0])
        ops.activation_precision(before[1])
    print("| format | matrix | ISA | tokens | int16 GMAC/s | int8 GMAC/s | int8 / int16 |\n|---|---|---|---|---|---|---|")
    for kind, n, k, _, _ in cases:
        for isa in isas:
            for m in map(int, a.tokens.split(",")):
                t16, t8 = best[kind, n, k, isa, m, "int16"], best[kind, n, k, isa, m, "int8"]
                print(f"| {kind} | {n}x{k} | {isa} | {m} | {n * k * m / t16 / 1e9:.1f} | {n * k * m / t8 / 1e9:.1f} | "
                      f"{t16 / t8:.2f}x |")


def _has_vnni(ops) -> bool:  # noqa: ANN001
    before = ops.kernel_isa("")
    try:
        ops.kernel_isa("avx512vnni")
        return True
    except RuntimeError:
        return False
    finally:
        ops.kernel_isa(before)


if __name__ == "__main__":
    main()
