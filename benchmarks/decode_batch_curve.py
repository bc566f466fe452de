"""Decode step time against batch size on the default model, with the many-token GEMM's VNNI crossing at
16 tokens (the fixed value before it was timed at load) and at the crossing timed on this CPU,
alternated in one process (the same bits either way; only the time differs).

    python benchmarks/decode_batch_curve.py --batches 1,2,4,6,8,10,12,14,16,24,32 --rounds 2

Each point is `tokenmill profile`'s measurement: the engine's ModelRunner executing one step of that many
decodes at --context tokens each (forward pass and sampling), the median of 5.
"""

from __future__ import annotations

import argparse
import statistics


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,2,4,6,8,10,12,14,16,24,32", help="decodes a step, comma-separated")
    ap.add_argument("--context", type=int, default=128, help="tokens of context each decode attends to (default 128)")
    ap.add_argument("--rounds", type=int, default=2, help="alternations of the two crossings (default 2)")
    args = ap.parse_args()
    import torch

    from tokenmill.config import EngineConfig
    from tokenmill.engine.llm_engine import LLMEngine
    from tokenmill.engine.calibration import measure

    engine = LLMEngine(EngineConfig.from_kwargs(kv_cache_memory="1GiB"))
    for layer in engine.runner.kv_caches:
        for t in layer:
            t.zero_()
    ops = torch.ops.tokenmill
    if ops.kernel_isa("") != "avx512vnni":
        raise SystemExit("this CPU runs the AVX2 GEMM only (no AVX512-VNNI): there is no crossing to compare")
    tuned = ops.vnni_min_tokens(0)
    batches = [int(b) for b in args.batches.split(",")]
    times: dict[tuple[int, int], list[float]] = {}
    for _ in range(args.rounds):
        for crossing in (16, tuned):
            ops.vnni_min_tokens(crossing)
            for b in batches:
                _, s = measure(engine, (b, args.context, 0, 0), repeats=5)
                times.setdefault((crossing, b), []).append(s)
    ops.vnni_min_tokens(tuned)
    print(f"decode step ms at {args.context} tokens of context, median of {args.rounds} rounds; "
          f"crossing timed at load: {tuned} tokens")
    print(f"{'batch':>6} {'at 16':>8} {'at ' + str(tuned):>8} {'ratio':>6}")
    for b in batches:
        old, new = (statistics.median(times[c, b]) for c in (16, tuned))
        print(f"{b:6d} {1000 * old:8.2f} {1000 * new:8.2f} {new / old:6.2f}")


if __name__ == "__main__":
    main()
