"""How often quantized greedy decoding agrees with float32 greedy decoding.

Prompts are consecutive passages of a text file; the float32 model generates greedily from each
(EOS ignored). Two figures per mode:

- free-running: each engine generates on its own; sequences identical to float32, and the mean
  fraction of tokens before the first divergence. One flipped near-tie changes everything after it,
  so this measures the first flip more than the rate of flips.
- teacher-forced (top-1 agreement): both models read the same text (prompt plus the float32
  continuation) and we compare their argmax at every continuation position, so each position counts
  once. The quantized layers run their integer (decode) kernels on every row here, as in decode.
  Disagreements are reported with float32's own top-1/top-2 logit gap at those positions, which says
  whether they are near-ties or real changes of mind.

    python benchmarks/greedy_agreement.py --dataset ../shared/data/tinyshakespeare.txt --modes int8 gguf int4

--text-tokens N instead reads each --dataset file's own first N tokens (in windows of --context-len
scored positions) with float32 and with each mode, and counts the positions where their argmax agrees:
teacher-forced on the text itself, so a near-tie flip cannot carry on into later positions. This is
the default configuration's quality bar (>= 99.5% over 8,192 tokens of prose and of code):

    python benchmarks/greedy_agreement.py --text-tokens 8192 --modes auto int8 int4 \
        --dataset ../shared/data/tinyshakespeare.txt tokenmill/server/app.py
"""

from __future__ import annotations

import argparse
import statistics

import torch

from tokenmill import LLM, SamplingParams


def continuation_logits(llm: LLM, prompts: list[list[int]], conts: list[list[int]]) -> list[torch.Tensor]:
    """Logits predicting each continuation token given the prompt and the continuation before it."""
    # Every mode runs one arithmetic for any number of rows, so teacher-forced rows see what decode sees.
    return [llm.engine.prompt_logits(p + c)[len(p) - 1:] for p, c in zip(prompts, conts)]


def mode_kwargs(mode: str) -> dict:
    """A --modes entry as LLM keyword arguments: a --quantization mode, or kv-int8 / kv-fp8 (the default
    weights with a 1-byte KV cache)."""
    return {"kv_cache_dtype": mode[3:]} if mode.startswith("kv-") else {"quantization": mode}


def text_agreement(llms: dict[str, LLM], path: str, num_tokens: int, context_len: int) -> None:
    """Top-1 agreement with float32 ("none") at each of num_tokens positions of the file's own text."""
    ref = llms["none"]
    ids = ref.tokenizer.encode(open(path, encoding="utf-8").read())
    windows = [ids[i:i + context_len + 1] for i in range(0, num_tokens, context_len)]
    if len(windows[-1]) < context_len + 1:
        raise SystemExit(f"{path} has {len(ids)} tokens; --text-tokens {num_tokens} needs {num_tokens + 1}")
    ref_logits = [ref.engine.prompt_logits(w) for w in windows]
    gap = torch.cat([lg.topk(2, -1).values for lg in ref_logits])
    gap = gap[:, 0] - gap[:, 1]
    print(f"\n{path}: {len(windows) * context_len} positions, windows of {context_len}; float32's median "
          f"top-1/top-2 gap {gap.median():.3f}\n")
    print("| --quantization | top-1 agreement with float32 | positions that differ | median float32 gap there "
          "| max abs logit difference (median over positions) |\n|---|---|---|---|---|")
    for mode, llm in llms.items():
        if mode == "none":
            continue
        got = [llm.engine.prompt_logits(w) for w in windows]
        differ = torch.cat([(a.argmax(-1) != b.argmax(-1)) for a, b in zip(got, ref_logits)])
        dmax = torch.cat([(a - b).abs().amax(-1) for a, b in zip(got, ref_logits)])
        where = f"{gap[differ].median():.3f}" if differ.any() else "-"
        print(f"| {mode} ({llm.engine.quantization}) | {1 - differ.float().mean().item():.2%} | "
              f"{int(differ.sum())} of {differ.numel()} | {where} | {dmax.median():.4f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dataset", required=True, nargs="+",
                    help="text files; prompts are consecutive passages of the first (with --text-tokens: each)")
    ap.add_argument("--text-tokens", type=int, default=0,
                    help="teacher-forced agreement over each file's first N tokens instead of generation")
    ap.add_argument("--context-len", type=int, default=512, help="with --text-tokens: positions per window")
    ap.add_argument("--modes", nargs="+", default=["int8", "gguf", "int4"],
                    help="--quantization modes to compare, or kv-int8 / kv-fp8 (default weights, 1-byte KV cache)")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--prompt-chars", type=int, default=400)
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()
    if args.text_tokens:
        llms = {mode: LLM(**mode_kwargs(mode), kv_cache_memory="256MiB", max_model_len=2048)
                for mode in ["none", *args.modes]}
        for path in args.dataset:
            text_agreement(llms, path, args.text_tokens, args.context_len)
        return
    text = open(args.dataset[0], encoding="utf-8").read()
    prompts = [text[i * args.prompt_chars:(i + 1) * args.prompt_chars] for i in range(args.num_prompts)]
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)

    def run(mode):
        llm = LLM(**mode_kwargs(mode))
        outs = llm.generate(prompts, sp, use_tqdm=False)
        return llm, [o.prompt_token_ids for o in outs], [o.outputs[0].token_ids for o in outs]

    ref_llm, prompt_ids, ref = run("none")
    ref_logits = continuation_logits(ref_llm, prompt_ids, ref)
    del ref_llm
    ref_top = torch.cat([lg.argmax(-1) for lg in ref_logits])
    top2 = torch.cat([lg.topk(2, -1).values for lg in ref_logits])
    gap = top2[:, 0] - top2[:, 1]  # float32's margin for its own choice
    # float32 read through the prefill path should pick its own generated tokens
    self_agree = (ref_top == torch.tensor([t for c in ref for t in c])).float().mean().item()
    print(f"float32 teacher-forced vs its own greedy output: {self_agree:.1%} of {ref_top.numel()} positions; "
          f"median top-1/top-2 logit gap {gap.median():.3f}\n")
    print("| --quantization | identical sequences | mean agreed prefix | teacher-forced top-1 agreement "
          "| median float32 gap where they differ |\n|---|---|---|---|---|")
    for mode in args.modes:
        llm, _, got = run(mode)
        prefix = []
        for a, b in zip(ref, got):
            n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
            prefix.append(n / len(a))
        same = sum(a == b for a, b in zip(ref, got))
        top = torch.cat([lg.argmax(-1) for lg in continuation_logits(llm, prompt_ids, ref)])
        differ = top != ref_top
        where = f"{gap[differ].median():.3f}" if differ.any() else "-"
        print(f"| {mode} | {same}/{len(ref)} | {statistics.mean(prefix):.1%} | "
              f"{1 - differ.float().mean().item():.1%} ({int(differ.sum())} of {differ.numel()} differ) | {where} |")
        del llm


if __name__ == "__main__":
    main()
