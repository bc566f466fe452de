"""Speculative decoding on vs off, same machine, one run: output tokens/s at batch 1, 8 and 32 on text
where n-grams recur and on random prompts, with acceptance rates per draft position.

--method ngram (default): both engines are the default configuration; one adds --speculative-method
ngram. --method draft: both are the float model (--quantization none, the exact reference); one adds the
same file on its own blocks as the draft model (--speculative-model), and a third column runs that
quantized model alone for scale. Each point runs the same greedy requests on both (alternating which goes
first, --rounds times; medians), so their outputs are identical and only the time differs.

    python benchmarks/spec_decode.py --dataset ../shared/data/tinyshakespeare.txt
    python benchmarks/spec_decode.py --dataset ../shared/data/tinyshakespeare.txt --method draft \
        --num-speculative-tokens 12

Workloads: "recurring": chat requests asking to copy a 400-character passage of --dataset (the answer
repeats the prompt: prompt lookup has something to find); "random": 64 random token ids, 128 tokens
generated with EOS ignored (nothing recurs).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from tokenmill import LLM, SamplingParams
from tokenmill.spec_decode.stats import summarize


def workloads(llm: LLM, text: str, batch: int) -> dict[str, tuple[list, SamplingParams]]:
    rng = random.Random(batch)
    starts = [rng.randrange(0, len(text) - 400) for _ in range(batch)]
    tok = llm.tokenizer
    recurring = [tok.encode(tok.apply_chat_template([{"role": "user", "content": "Copy this passage exactly:\n\n"
                                                      + text[s:s + 400]}])) for s in starts]
    rand = [[rng.randrange(100, 20000) for _ in range(64)] for _ in range(batch)]
    return {"recurring": (recurring, SamplingParams(max_tokens=128, temperature=0)),
            "random": (rand, SamplingParams(max_tokens=128, temperature=0, ignore_eos=True))}


def run(llm: LLM, prompts: list, sp: SamplingParams) -> tuple[float, float]:
    """(output tokens/s end to end, decode tokens/s: the tokens after each request's first over the time
    from the first first token to the last finish, prefill left out)."""
    t = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    seconds = time.perf_counter() - t
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    first = min(o.metrics[0].first_token_time for o in outs)
    last = max(o.metrics[0].finished_time for o in outs)
    return tokens / seconds, (tokens - len(outs)) / (last - first)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dataset", required=True)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--num-speculative-tokens", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--method", choices=["ngram", "draft"], default="ngram")
    ap.add_argument("--kv-cache-memory", default="1GiB")
    args = ap.parse_args()
    text = open(args.dataset, encoding="utf-8").read()
    # room for batch 32 without preemption in every engine (a draft model's KV shares the pool, so at equal
    # memory it holds fewer tokens: the preemption counts are printed at the end)
    kw = dict(kv_cache_memory=args.kv_cache_memory, max_model_len=2048)
    k = args.num_speculative_tokens
    drafter = None
    if args.method == "ngram":
        off = LLM(**kw)
        on = LLM(**kw, speculative_method="ngram", num_speculative_tokens=k)
    else:
        off = LLM(**kw, quantization="none")
        on = LLM(**kw, quantization="none", speculative_model=off.engine.model_path, num_speculative_tokens=k)
        drafter = LLM(**kw)
    cost = on.engine.scheduler.proposer.draft_cost
    print(f"the off rule's cost of {k} drafts (decode steps), measured at startup, at batch 1/8/32: "
          + "/".join(f"{cost(b)(k):.2f}" for b in (1, 8, 32)) + "; of one draft: "
          + "/".join(f"{cost(b)(1):.2f}" for b in (1, 8, 32)))
    print("tok/s as output (end to end) / decode (after each request's first token)")
    print(f"| workload | batch | off tok/s | on tok/s | on / off | acceptance rate | mean accepted length "
          f"| accepted at positions 1..{k} (of drafts) |" + (" drafter alone tok/s |" if drafter else "")
          + "\n|---|---|---|---|---|---|---|---|" + ("---|" if drafter else ""))
    for batch in args.batches:
        for name, (prompts, sp) in workloads(off, text, batch).items():
            rates = {"off": [], "on": []}
            on.engine.step_stats.clear()
            for r in range(args.rounds):
                order = [("off", off), ("on", on)] if r % 2 == 0 else [("on", on), ("off", off)]
                for label, llm in order:
                    rates[label].append(run(llm, prompts, sp))
            spec = summarize([s.spec for s in on.engine.step_stats if s.spec is not None])
            a, b = (tuple(statistics.median(x[i] for x in rates[label]) for i in (0, 1)) for label in ("off", "on"))
            alone = ""
            if drafter is not None:
                alone = " {:.1f} / {:.1f} |".format(*run(drafter, prompts, sp))
            print(f"| {name} | {batch} | {a[0]:.1f} / {a[1]:.1f} | {b[0]:.1f} / {b[1]:.1f} | {b[0] / a[0]:.2f}x / "
                  f"{b[1] / a[1]:.2f}x | {spec['spec_acceptance_rate']:.1%} | "
                  f"{spec['spec_mean_acceptance_length']:.2f} | "
                  f"{' '.join(f'{r:.2f}' for r in spec['spec_acceptance_rate_per_pos'])} |{alone}", flush=True)
    print("preemptions: off %d, on %d" % (off.engine.num_preemptions, on.engine.num_preemptions))


if __name__ == "__main__":
    main()
