"""What verifying speculative tokens costs: the time of a step that runs k + 1 tokens of one sequence against a
1-token step, on a model of real size (the issue's target: a 5-token step at most 1.3x a 1-token step).

Decode is bandwidth-bound: a step reads every weight once, whatever its token count, so a few more tokens
should ride on the same read. Each point is `tokenmill profile`'s measurement (engine/calibration.py `measure`): the
engine's ModelRunner executing one step of n new tokens of one sequence after --context tokens (forward pass
and sampling of the last), the median of --repeats; the counts are alternated over --rounds and the medians of
the rounds reported, each against the 1-token step of its round.

    python benchmarks/step_tokens.py                                   # the embedded model
    python benchmarks/step_tokens.py --model results/real_shapes/llama-3.2-1b-Q4_K_M.gguf --tokens 1,2,3,5,8
    TOKENMILL_CPU_ISA=avx2 python benchmarks/step_tokens.py --model FILE   # the AVX2 kernels only
"""

from __future__ import annotations

import argparse
import statistics


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a GGUF file or HF folder (default: the embedded model)")
    ap.add_argument("--tokens", default="1,2,3,4,5,8", help="new tokens a step, comma-separated (1 first)")
    ap.add_argument("--context", type=int, default=128, help="tokens already in the sequence's cache (default 128)")
    ap.add_argument("--rounds", type=int, default=3, help="alternations of the counts (default 3)")
    ap.add_argument("--repeats", type=int, default=5, help="steps timed per point (default 5)")
    args = ap.parse_args()
    import torch

    from tokenmill.config import EngineConfig
    from tokenmill.engine.llm_engine import LLMEngine
    from tokenmill.engine.calibration import measure

    kwargs = {"kv_cache_memory": "512MiB"}
    if args.model:
        kwargs["model"] = args.model
    engine = LLMEngine(EngineConfig.from_kwargs(**kwargs))
    counts = [int(t) for t in args.tokens.split(",")]
    if counts[0] != 1:
        raise SystemExit("--tokens must start with 1: every figure is against the 1-token step")
    ratios: dict[int, list[float]] = {n: [] for n in counts}
    seconds: dict[int, list[float]] = {n: [] for n in counts}
    for _ in range(args.rounds):
        one = None
        for n in counts:
            _, t = measure(engine, (0, 0, n, args.context), repeats=args.repeats)
            one = t if n == 1 else one
            seconds[n].append(t)
            ratios[n].append(t / one)
    print(f"model {engine.config.model} ({engine.quantization}), {torch.get_num_threads()} threads, kernels "
          f"{torch.ops.tokenmill.kernel_isa('')}, context {args.context}")
    print("| tokens a step | step ms (median of rounds) | against 1 token |")
    print("|---|---|---|")
    for n in counts:
        print(f"| {n} | {statistics.median(seconds[n]) * 1e3:.1f} | {statistics.median(ratios[n]):.2f}x |")


if __name__ == "__main__":
    main()
