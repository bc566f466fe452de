"""torch.compile trial for the decode step (the quantization issue's "consider torch.compile").

Runs single-stream greedy decode (2-token prompt, 64 tokens, EOS ignored) in one of three modes:
- eager:   the float32 model on plain torch ops (TOKENMILL_DISABLE_CPU_KERNELS=1);
- compile: the same, with the model's forward wrapped in torch.compile(dynamic=True);
- kernels: the float32 model as tokenmill runs it by default (its CPU kernels on).
and prints the one-off time of the first call (compilation included), decode tok/s over three
runs, and the first tokens (all modes must agree).

    for m in eager compile kernels; do python benchmarks/compile_trial.py $m; done
"""

import argparse
import os
import statistics
import time

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("mode", choices=["eager", "compile", "kernels"])
parser.add_argument("--max-tokens", type=int, default=64, help="tokens generated per run")
args = parser.parse_args()
if args.mode != "kernels":
    os.environ["TOKENMILL_DISABLE_CPU_KERNELS"] = "1"  # read when the model loads

import torch  # noqa: E402

from tokenmill import LLM, SamplingParams  # noqa: E402

llm = LLM(model="smollm2-135m-instruct", quantization="none")  # the float32 model
model = llm.engine.runner.model
if args.mode == "compile":
    model.forward = torch.compile(model.forward, dynamic=True)
sp = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
prompt = [[700, 701]]
t0 = time.perf_counter()
llm.generate(prompt, sp, use_tqdm=False)
print(f"{args.mode}: first call {time.perf_counter() - t0:.1f} s")
rates = []
for _ in range(3):
    out = llm.generate(prompt, sp, use_tqdm=False)[0]
    tt = out.metrics[0].token_times
    rates.append((len(tt) - 1) / (tt[-1] - tt[0]))
print(f"{args.mode}: decode tok/s {[round(r, 1) for r in rates]}, median {statistics.median(rates):.1f}")
print(f"{args.mode}: first tokens {out.outputs[0].token_ids[:12]}")
