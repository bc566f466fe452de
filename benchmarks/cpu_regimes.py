"""tokenmill vs llama.cpp in the three CPU regimes, each against this machine's roofline.

Regimes (the quantization issue's speed targets):
- decode: one sequence generating 128 tokens (llama-bench tg128);
- prefill: one 512-token prompt (llama-bench pp512), time to first token;
- batched: 64 sequences of 128 prompt + 128 generated tokens, total tok/s (llama-batched-bench); --batch and
  --batch-len set others (a 1B-8B model: 16 x (64+64) keeps a run within minutes on 2 cores).

Roofline, measured here by the same script so the fractions come from one run:
- memory bandwidth: a read-only sum over a 1 GiB float32 tensor, 2 threads;
- GEMM peak: float32 torch.mm and tokenmill's int8-activation kernel at M=512 on the model's widest shape.
Decode ceiling (tok/s) = bandwidth / bytes of weights one step reads; prefill ceiling = GEMM peak /
(2 x decoder weights) FLOPs per token: the integer kernel's peak for quantized modes (they run it at every
batch size, for batch invariance) and llama.cpp, float32's for none; attention FLOPs ignored, <5% at 512.

    python benchmarks/cpu_regimes.py --quantization gguf none                 # tokenmill only
    python benchmarks/cpu_regimes.py --quantization gguf --llama-bin DIR       # + llama-bench, llama-batched-bench
    python benchmarks/cpu_regimes.py --quantization gguf --llama-bin DIR --paired-rounds 8
    python benchmarks/cpu_regimes.py --model FILE.gguf --llama-bin DIR --paired-rounds 8   # another file, e.g. Q4_K_M

--paired-rounds N then alternates the two engines N more times on decode and on prefill (tokenmill
128 tokens, llama-bench tg128; tokenmill one 512-token prompt, llama-bench pp512; one repetition
each) and prints each round's ratios and their medians: on a shared machine whose speed drifts
within minutes, the paired ratios are the figures to quote.

DIR holds llama.cpp's llama-bench and llama-batched-bench (a native build); they run on the same GGUF file,
with the same thread count, after tokenmill in the same process run.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import time
from pathlib import Path

import torch


def measure_bandwidth(gib: float = 1.0, reps: int = 5) -> float:
    x = torch.ones(int(gib * 2**30 / 4))
    x.sum()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        x.sum()
        ts.append(time.perf_counter() - t)
    return x.numel() * 4 / statistics.median(ts) / 1e9  # GB/s


def measure_gemm_peaks(m: int = 512, k: int = 576, n: int = 3072, reps: int = 10) -> dict[str, float]:
    from tokenmill.layers.kernels import cpu_kernels
    from tokenmill.layers.quant import FORMAT_IDS, quantize_weight

    x, w = torch.randn(m, k), torch.randn(n, k)
    out = {}

    def best(fn):
        fn()
        ts = []
        for _ in range(reps):
            t = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t)
        return 2 * m * k * n / min(ts) / 1e9  # GFLOP/s

    out["fp32_gflops"] = best(lambda: torch.mm(x, w.t()))
    q = quantize_weight(w, "int4")
    ops = cpu_kernels()
    if ops is not None:  # the integer kernel the quantized modes run at every M
        qk = q.kernel_layout()
        out["int_kernel_gflops"] = best(lambda: ops.qlinear(x, qk, n, FORMAT_IDS[q.fmt]))
    return out


def weight_bytes(model) -> int:
    """Bytes one decode step reads: every weight, the embedding only as the tied head (what /metrics
    counts too)."""
    from tokenmill.perf.roofline import weight_bytes_read

    return weight_bytes_read(model)


def decoder_weights(model) -> int:
    """Weights of the decoder's linear layers: 2x this is a prompt token's FLOPs (logits only for the last)."""
    from tokenmill.layers.quant import QuantizedLinear

    return sum(m.in_features * m.out_features for m in model.layers.modules()
               if isinstance(m, (QuantizedLinear, torch.nn.Linear)) or hasattr(m, "panels"))


def run_tokenmill(quantization: str, model: str = "smollm2-135m-instruct", vocab_hi: int = 20000,
                  batch: int = 64, batch_len: int = 128) -> dict:
    from tokenmill import LLM, SamplingParams

    llm = LLM(model=model, quantization=quantization, max_num_batched_tokens=2048,
              max_num_seqs=batch)
    model = llm.engine.runner.model
    g = torch.Generator().manual_seed(0)

    def prompts(n, length):
        return [torch.randint(100, vocab_hi, (length,), generator=g).tolist() for _ in range(n)]

    greedy = dict(temperature=0, ignore_eos=True)
    llm.generate(prompts(2, 64), SamplingParams(max_tokens=8, **greedy), use_tqdm=False)  # warm up
    res = {"quantization": quantization, "weight_bytes": weight_bytes(model), "params": decoder_weights(model)}
    # decode: 128 tokens after a 1-token prompt; rate over the 127 gaps after the first token
    dec = []
    for _ in range(3):
        m = llm.generate(prompts(1, 1), SamplingParams(max_tokens=128, **greedy), use_tqdm=False)[0].metrics[0]
        dec.append(127 / (m.token_times[-1] - m.token_times[0]))
    res["decode_tok_s"] = statistics.median(dec)
    pre = []
    for _ in range(3):
        m = llm.generate(prompts(1, 512), SamplingParams(max_tokens=1, **greedy), use_tqdm=False)[0].metrics[0]
        pre.append(512 / m.ttft)
    res["prefill_tok_s"] = statistics.median(pre)
    t = time.perf_counter()
    llm.generate(prompts(batch, batch_len), SamplingParams(max_tokens=batch_len, **greedy), use_tqdm=False)
    res["batched_total_tok_s"] = batch * 2 * batch_len / (time.perf_counter() - t)
    return res


def paired_rounds(bin_dir: Path, gguf: str, threads: int, quantization: str, rounds: int) -> dict[str, list]:
    """(tokenmill, llama.cpp) tok/s for decode (tg128) and prefill (pp512), alternated round by round."""
    from tokenmill import LLM, SamplingParams

    llm = LLM(model=gguf, quantization=quantization, max_num_batched_tokens=2048)
    greedy = dict(temperature=0, ignore_eos=True)
    g = torch.Generator().manual_seed(1)
    llm.generate([[700]], SamplingParams(max_tokens=8, **greedy), use_tqdm=False)  # warm up

    def llama(p, n):
        r = subprocess.run([str(bin_dir / "llama-bench"), "-m", gguf, "-t", str(threads), "-p", str(p), "-n", str(n),
                            "-r", "1", "-o", "json"], capture_output=True, text=True, check=True)
        return json.loads(r.stdout)[0]["avg_ts"]

    out = {"decode": [], "prefill": []}
    for i in range(rounds):
        m = llm.generate([[700 + i]], SamplingParams(max_tokens=128, **greedy), use_tqdm=False)[0].metrics[0]
        out["decode"].append((127 / (m.token_times[-1] - m.token_times[0]), llama(0, 128)))
        prompt = torch.randint(100, 20000, (512,), generator=g).tolist()
        m = llm.generate([prompt], SamplingParams(max_tokens=1, **greedy), use_tqdm=False)[0].metrics[0]
        out["prefill"].append((512 / m.ttft, llama(512, 0)))
        print(f"round {i + 1}: " + ", ".join(f"{k} tokenmill {v[-1][0]:.1f} / llama.cpp {v[-1][1]:.1f} tok/s "
                                            f"= {v[-1][0] / v[-1][1]:.2f}x" for k, v in out.items()), flush=True)
    return out


def run_llama(bin_dir: Path, gguf: str, threads: int, batch: int = 64, batch_len: int = 128) -> dict:
    out = {}
    r = subprocess.run([str(bin_dir / "llama-bench"), "-m", gguf, "-t", str(threads), "-p", "512", "-n", "128",
                        "-o", "json"], capture_output=True, text=True, check=True)
    for row in json.loads(r.stdout):
        key = "prefill_tok_s" if row["n_prompt"] else "decode_tok_s"
        out[key] = row["avg_ts"]
    r = subprocess.run([str(bin_dir / "llama-batched-bench"), "-m", gguf, "-t", str(threads), "-c", "20000",
                        "-b", "2048", "-ub", "512", "-npp", str(batch_len), "-ntg", str(batch_len), "-npl", str(batch)],
                       capture_output=True, text=True, check=True)
    # table row: |  PP |  TG |  B | N_KV | T_PP s | S_PP t/s | T_TG s | S_TG t/s | T s | S t/s |
    row = next(ln for ln in r.stdout.splitlines()
               if re.match(rf"\|\s+{batch_len}\s+\|\s+{batch_len}\s+\|\s+{batch}\s+\|", ln))
    out["batched_total_tok_s"] = float(row.strip("|").split("|")[-1])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quantization", nargs="+", default=["gguf"], help="tokenmill modes to run (default gguf)")
    ap.add_argument("--llama-bin", type=Path, help="folder with llama-bench and llama-batched-bench")
    ap.add_argument("--model", default="smollm2-135m-instruct",
                    help="a .gguf file both engines run (default: the embedded model), e.g. a Q4_K_M file")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--paired-rounds", type=int, default=0,
                    help="with --llama-bin: alternate both engines' decode and prefill this many more times")
    ap.add_argument("--batch", type=int, default=64, help="batched regime: sequences (default 64)")
    ap.add_argument("--batch-len", type=int, default=128,
                    help="batched regime: prompt and generated tokens each (default 128)")
    ap.add_argument("--json", help="also write the results to this file")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    bw = measure_bandwidth()
    peaks = measure_gemm_peaks()
    print(f"roofline: bandwidth {bw:.1f} GB/s, fp32 GEMM {peaks['fp32_gflops']:.0f} GFLOP/s, "
          f"int kernel {peaks.get('int_kernel_gflops', float('nan')):.0f} GFLOP/s ({args.threads} threads)")
    from tokenmill.layers.kernels import cpu_kernels

    if (ops := cpu_kernels()) is not None:  # TOKENMILL_CPU_ISA, TOKENMILL_ACTIVATIONS
        print(f"tokenmill kernels: {ops.kernel_isa('')}, {ops.activation_precision('')} activations")
    from tokenmill.models.registry import resolve_model

    gguf = str(resolve_model(args.model).path)
    rows = [run_tokenmill(q, gguf, batch=args.batch, batch_len=args.batch_len) for q in args.quantization]
    if args.llama_bin:
        rows.append({"quantization": "llama.cpp", **run_llama(args.llama_bin, gguf, args.threads, args.batch,
                                                              args.batch_len)})
    gguf_row = next((r for r in rows if r["quantization"] in ("gguf", "auto")), rows[0])
    print(f"\n| engine | decode tok/s | (floor) | prefill 512 tok/s | (floor) | {args.batch}x({args.batch_len}+"
          f"{args.batch_len}) total tok/s |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        wb = r.get("weight_bytes", gguf_row["weight_bytes"])
        dec_floor = bw * 1e9 / wb
        # quantized modes (and llama.cpp on the same blocks) run integer GEMMs at every M; none runs float ones
        peak = peaks["fp32_gflops"] if r["quantization"] == "none" else peaks.get("int_kernel_gflops", peaks["fp32_gflops"])
        pre_floor = peak * 1e9 / (2 * gguf_row["params"])
        name = r["quantization"] if r["quantization"] == "llama.cpp" else f"tokenmill {r['quantization']}"
        print(f"| {name} | {r['decode_tok_s']:.1f} | {r['decode_tok_s'] / dec_floor:.0%} of {dec_floor:.0f} "
              f"| {r['prefill_tok_s']:.0f} | {r['prefill_tok_s'] / pre_floor:.0%} of {pre_floor:.0f} "
              f"| {r['batched_total_tok_s']:.1f} |")
    result = {"bandwidth_gbs": bw, **peaks, "rows": rows}
    if args.llama_bin and args.paired_rounds:
        print(f"\npaired rounds, tokenmill {args.quantization[0]} vs llama.cpp (llama-bench tg128 / pp512):")
        paired = paired_rounds(args.llama_bin, gguf, args.threads,
                               args.quantization[0], args.paired_rounds)
        result["paired"] = {}
        for regime, pairs in paired.items():
            ratio = statistics.median(a / b for a, b in pairs)
            print(f"{regime}: median ratio {ratio:.2f}x (tokenmill median {statistics.median(a for a, _ in pairs):.1f}, "
                  f"llama.cpp median {statistics.median(b for _, b in pairs):.1f} tok/s)")
            result["paired"][regime] = {"pairs": pairs, "median_ratio": ratio}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
