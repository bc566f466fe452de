"""Offline throughput: tokenmill's LLM.generate against Hugging Face transformers' generate.

Both engines get the same random-token prompts and produce the same number of tokens per
request (EOS ignored). transformers runs static batches (left-padded, each batch decoding
until its longest request is done); only the requested tokens count toward its throughput.

    python benchmarks/offline_throughput.py                       # both workloads, both engines
    python benchmarks/offline_throughput.py --workload fixed --skip-hf
"""

from __future__ import annotations

import argparse
import json
import random
import time

import torch


def make_workload(kind: str, n: int, vocab: int, seed: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    reqs = []
    for _ in range(n):
        if kind == "fixed":
            p_len, o_len = 128, 128
        else:  # mixed: lengths drawn uniformly from 32-1024 in, 32-512 out
            p_len, o_len = rng.randint(32, 1024), rng.randint(32, 512)
        # skip the low ids, where this vocabulary keeps its special tokens
        reqs.append(([rng.randrange(100, vocab) for _ in range(p_len)], o_len))
    return reqs


def run_tokenmill(llm, reqs) -> float:
    from tokenmill import SamplingParams

    params = [SamplingParams(temperature=0, max_tokens=o, ignore_eos=True) for _, o in reqs]
    start = time.perf_counter()
    outs = llm.generate([p for p, _ in reqs], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    assert [len(o.outputs[0].token_ids) for o in outs] == [o for _, o in reqs]
    return elapsed


def run_hf(model, reqs, batch_size: int) -> float:
    start = time.perf_counter()
    for i in range(0, len(reqs), batch_size):
        chunk = reqs[i : i + batch_size]
        width = max(len(p) for p, _ in chunk)
        ids = torch.zeros(len(chunk), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for j, (p, _) in enumerate(chunk):
            ids[j, width - len(p):] = torch.tensor(p)
            mask[j, width - len(p):] = 1
        n_new = max(o for _, o in chunk)
        with torch.inference_mode():
            model.generate(ids, attention_mask=mask, max_new_tokens=n_new, min_new_tokens=n_new,
                           do_sample=False, pad_token_id=0)
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--workload", choices=["fixed", "mixed", "all"], default="all")
    ap.add_argument("--num-prompts", type=int, default=64, help="requests in the fixed workload (default 64)")
    ap.add_argument("--num-mixed", type=int, default=32, help="requests in the mixed workload (default 32)")
    ap.add_argument("--dtype", default="auto", help="dtype for both engines (default auto: what tokenmill picks)")
    ap.add_argument("--hf-batch-size", type=int, default=32)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--skip-hf", action="store_true", help="measure tokenmill only")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="also write the results to this file")
    a = ap.parse_args()

    from tokenmill import LLM

    llm = LLM(a.model, dtype=a.dtype, max_num_seqs=a.max_num_seqs, kv_cache_memory="2GiB",
              max_num_batched_tokens=16384)
    vocab = llm.engine.model_config.vocab_size
    hf = None
    if not a.skip_hf:
        from transformers import AutoModelForCausalLM

        path = llm.engine.config.model
        from tokenmill.models.registry import resolve_model

        src = resolve_model(path).path
        hf = AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name,
                                                  dtype=llm.engine.dtype).eval()
    print(f"dtype {llm.engine.dtype}, torch threads {torch.get_num_threads()}", flush=True)
    workloads = ["fixed", "mixed"] if a.workload == "all" else [a.workload]
    results = []
    run_tokenmill(llm, make_workload("fixed", 4, vocab, 999))  # warm-up
    for kind in workloads:
        reqs = make_workload(kind, a.num_prompts if kind == "fixed" else a.num_mixed, vocab, a.seed)
        n_in = sum(len(p) for p, _ in reqs)
        n_out = sum(o for _, o in reqs)
        row = {"workload": kind, "requests": len(reqs), "input_tokens": n_in, "output_tokens": n_out}
        t = run_tokenmill(llm, reqs)
        row["tokenmill_s"] = t
        row["tokenmill_output_tok_s"] = n_out / t
        row["tokenmill_total_tok_s"] = (n_in + n_out) / t
        if hf is not None:
            t_hf = run_hf(hf, reqs, a.hf_batch_size)
            row["hf_s"] = t_hf
            row["hf_output_tok_s"] = n_out / t_hf
            row["hf_total_tok_s"] = (n_in + n_out) / t_hf
            row["speedup"] = t_hf / t
        results.append(row)
        print(json.dumps(row), flush=True)

    print(f"\n{'workload':8} {'reqs':>5} {'in':>7} {'out':>7} | {'tokenmill out/s':>15} {'total/s':>9}"
          + ("" if hf is None else f" | {'HF out/s':>9} {'total/s':>9} | {'speedup':>7}"))
    for r in results:
        line = (f"{r['workload']:8} {r['requests']:5d} {r['input_tokens']:7d} {r['output_tokens']:7d} | "
                f"{r['tokenmill_output_tok_s']:15.1f} {r['tokenmill_total_tok_s']:9.1f}")
        if hf is not None:
            line += f" | {r['hf_output_tok_s']:9.1f} {r['hf_total_tok_s']:9.1f} | {r['speedup']:6.2f}x"
        print(line)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"dtype": str(llm.engine.dtype), "torch_threads": torch.get_num_threads(), "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
