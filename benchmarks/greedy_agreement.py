"""How often quantized greedy decoding agrees with float32 greedy decoding, token for token.

Prompts are consecutive passages of a text file; each engine generates greedily with EOS ignored.
Reports, per mode: sequences identical to float32, and the mean fraction of tokens before the first
divergence (the usual "greedy agreement" figure).

    python benchmarks/greedy_agreement.py --dataset ../shared/data/tinyshakespeare.txt --modes int8 gguf int4
"""

from __future__ import annotations

import argparse
import statistics

from tokenmill import LLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dataset", required=True, help="a text file; prompts are consecutive passages of it")
    ap.add_argument("--modes", nargs="+", default=["int8", "gguf", "int4"], help="--quantization modes to compare")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--prompt-chars", type=int, default=400)
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()
    text = open(args.dataset, encoding="utf-8").read()
    prompts = [text[i * args.prompt_chars:(i + 1) * args.prompt_chars] for i in range(args.num_prompts)]
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)

    def run(mode):
        llm = LLM(quantization=mode)
        return [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]

    ref = run("none")
    print(f"| --quantization | identical sequences | mean agreed prefix |\n|---|---|---|")
    for mode in args.modes:
        got = run(mode)
        prefix = []
        for a, b in zip(ref, got):
            n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
            prefix.append(n / len(a))
        same = sum(a == b for a, b in zip(ref, got))
        print(f"| {mode} | {same}/{len(ref)} | {statistics.mean(prefix):.1%} |")


if __name__ == "__main__":
    main()
