"""Prefix caching in the default configuration: time to first token with the cache on and off, and
whether the outputs are the same bits, on prompts of several kinds.

Each kind is a few prompts that share a long prefix and differ after it. Both engines (the default
configuration, one with --no-enable-prefix-caching) get the same prompts one at a time, so TTFT is
the prefill alone; the cache-on engine has seen the first prompt of the kind (the warm-up both get),
so the others hit its blocks. Each prompt's greedy tokens and logprobs are compared bit for bit.

    python benchmarks/prefix_caching.py --dataset ../shared/data/tinyshakespeare.txt

Kinds: prose (a passage of --dataset and a question), code (a tokenmill source file and an
instruction), chat (a long system prompt through the chat template, different user turns),
multi-turn (one conversation growing by a turn at a time), short (a 128-token prefix, 16-token tails).
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from tokenmill import LLM, SamplingParams

ROOT = Path(__file__).resolve().parent.parent


def kinds(llm: LLM, dataset: str, prefix_tokens: int) -> dict[str, list]:
    """Per kind: prompts (token ids), the first one the warm-up."""
    tok = llm.tokenizer

    def head(text: str, n: int) -> str:
        return tok.decode(tok.encode(text)[:n])

    prose = head(Path(dataset).read_text(encoding="utf-8"), prefix_tokens)
    code = head((ROOT / "tokenmill" / "core" / "scheduler.py").read_text(encoding="utf-8"), prefix_tokens)
    readme = head((ROOT / "README.md").read_text(encoding="utf-8"), prefix_tokens)
    questions = ["Who speaks first?", "Summarize this in one line.", "What happens next?",
                 "Name every person mentioned.", "Is this a comedy or a tragedy?"]
    chat = [tok.apply_chat_template([{"role": "system", "content": readme}, {"role": "user", "content": q}])
            for q in questions]
    turns = [{"role": "system", "content": readme}]
    multi = []
    for q in questions:
        turns = turns + [{"role": "user", "content": q}]
        multi.append(tok.apply_chat_template(turns))
        turns = turns + [{"role": "assistant", "content": "I read the text and " + q.lower()}]
    short = head(prose, 128)
    return {
        "prose": [tok.encode(f"{prose}\n\nQuestion: {q}\nAnswer:") for q in questions],
        "code": [tok.encode(f"{code}\n# {q}\n") for q in questions],
        "chat": [tok.encode(p) for p in chat],
        "multi-turn": [tok.encode(p) for p in multi],
        "short": [tok.encode(f"{short} {q}") for q in questions],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dataset", required=True, help="a prose text file (tinyshakespeare.txt)")
    ap.add_argument("--prefix-tokens", type=int, default=1000, help="shared prefix length of the long kinds")
    ap.add_argument("--max-tokens", type=int, default=16)
    args = ap.parse_args()
    kw = dict(kv_cache_memory="512MiB", max_model_len=4096)
    on, off = LLM(**kw), LLM(enable_prefix_caching=False, **kw)
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True, logprobs=1)
    print(f"default configuration: quantization {on.engine.quantization}, dtype {on.engine.dtype}\n")
    print("| kind | prompt tokens (median) | TTFT cache off (ms, median) | TTFT cache on (ms, median) | off / on "
          "| prefix-cache hit tokens | same tokens and logprobs |\n|---|---|---|---|---|---|---|")
    for kind, prompts in kinds(on, args.dataset, args.prefix_tokens).items():
        for llm in (on, off):  # the warm-up: fills the cache-on engine's cache with the shared prefix
            llm.generate([prompts[0]], sp, use_tqdm=False)
        ttft = {"on": [], "off": []}
        same = True
        hits0 = on.engine.kv_cache.stats.hits
        for p in prompts[1:]:
            outs = {}
            for name, llm in (("off", off), ("on", on)):
                o = llm.generate([p], sp, use_tqdm=False)[0]
                ttft[name].append(o.metrics[0].ttft)
                outs[name] = (o.outputs[0].token_ids, o.outputs[0].logprobs)
            same &= outs["on"] == outs["off"]
        hit_tokens = on.engine.kv_cache.stats.hits - hits0
        t_off, t_on = statistics.median(ttft["off"]), statistics.median(ttft["on"])
        print(f"| {kind} | {statistics.median(len(p) for p in prompts[1:]):.0f} | {t_off * 1e3:.1f} | "
              f"{t_on * 1e3:.1f} | {t_off / t_on:.1f}x | {hit_tokens} | {'yes' if same else 'NO'} |", flush=True)


if __name__ == "__main__":
    main()
