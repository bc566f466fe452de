"""What structured outputs cost: output tokens/s of JSON-schema-constrained decoding against the same
requests unconstrained, at batch 1 and 32, in one run on one machine; and the two grammar engines'
time per token mask (llguidance, which tokenmill uses, and xgrammar where it is installed) on the same
schema and tokens.

    python benchmarks/structured_outputs.py

Every request samples (temperature 0.8, seeded) 64 tokens with EOS ignored; the schema is an open
array of objects, so a constrained request never runs out of grammar before its 64 tokens. Each point
alternates which configuration goes first over --rounds rounds; medians.
"""

from __future__ import annotations

import argparse
import statistics
import time

from tokenmill import LLM, SamplingParams, StructuredOutputsParams

SCHEMA = {"type": "array", "items": {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 16}, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
    "required": ["name", "age"], "additionalProperties": False}}
PROMPT = "A JSON list of people with their ages:"


def run(llm: LLM, batch: int, constrained: bool) -> float:
    so = StructuredOutputsParams(json=SCHEMA) if constrained else None
    params = [SamplingParams(temperature=0.8, seed=i, max_tokens=64, ignore_eos=True, structured_outputs=so)
              for i in range(batch)]
    t = time.perf_counter()
    outs = llm.generate([PROMPT] * batch, params, use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t)


def mask_times(llm: LLM, n: int = 200) -> dict[str, float]:
    """Milliseconds per token mask for each grammar engine, walking the same constrained output."""
    so = StructuredOutputsParams(json=SCHEMA)
    out = llm.generate([PROMPT], SamplingParams(temperature=0.8, seed=0, max_tokens=n, structured_outputs=so),
                       use_tqdm=False)[0].outputs[0].token_ids
    grammars = llm.engine.runner.grammars
    m = grammars.matcher(grammars.compile(so))
    t = time.perf_counter()
    for tok in out:
        m.compute_bitmask()
        m.consume_token(tok)
    result = {"llguidance": 1000 * (time.perf_counter() - t) / len(out)}
    try:
        import torch
        import xgrammar as xgr
    except ImportError:
        return result
    tok = llm.tokenizer
    vocab = [None] * llm.engine.model_config.vocab_size
    for piece, i in tok.hf.get_vocab().items():
        if i < len(vocab):
            vocab[i] = piece
    info = xgr.TokenizerInfo(vocab, vocab_type=xgr.VocabType.BYTE_LEVEL, vocab_size=len(vocab),
                             stop_token_ids=[tok.eos_token_id])
    compiled = xgr.GrammarCompiler(info).compile_json_schema(SCHEMA, any_whitespace=True)
    matcher = xgr.GrammarMatcher(compiled)
    bitmask = xgr.allocate_token_bitmask(1, len(vocab))
    t, walked = time.perf_counter(), 0
    for tok_id in out:
        matcher.fill_next_token_bitmask(bitmask)
        walked += 1
        if not matcher.accept_token(tok_id):
            break
    result["xgrammar"] = 1000 * (time.perf_counter() - t) / walked
    if walked < len(out):
        result[f"(xgrammar refused token {walked} of llguidance's output)"] = 0.0
    del torch
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    llm = LLM(kv_cache_memory="512MiB", max_model_len=2048)
    run(llm, 2, True)  # warm-up: the grammar engine's tokenizer is built on first use
    print("| batch | unconstrained tok/s | JSON schema tok/s | change |\n|---|---|---|---|")
    for batch in args.batches:
        rates = {True: [], False: []}
        for r in range(args.rounds):
            for constrained in ((False, True) if r % 2 == 0 else (True, False)):
                rates[constrained].append(run(llm, batch, constrained))
        free, con = statistics.median(rates[False]), statistics.median(rates[True])
        print(f"| {batch} | {free:.1f} | {con:.1f} | {100 * (con / free - 1):+.1f}% |", flush=True)
    print("\nms per token mask (the same 200 constrained tokens):",
          ", ".join(f"{k} {v:.3f}" for k, v in mask_times(llm).items()))


if __name__ == "__main__":
    main()
