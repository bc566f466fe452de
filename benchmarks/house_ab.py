"""Before/after of a change that should not move speed (a restructuring): two source trees of tokenmill, the
same model and workload, alternated round by round in fresh processes on this machine.

Each round runs, for tree A then tree B (B then A on odd rounds), one process that loads the model and measures
- decode: one sequence, 128 tokens after a 1-token prompt (tok/s over the 127 gaps after the first token), and
  the median decode step's time outside its forward pass (what a restructuring of the Python side can move);
- batched: --batch sequences of --batch-len prompt + --batch-len generated tokens, total tok/s, and tokens per
  second of the process's CPU time (all threads): on a VM whose neighbours take cycles (steal), the CPU time
  counts only the cycles the process had, so it is the steadier of the two.
The figures to quote are the medians of the per-round ratios B / A: a shared machine's speed drifts within
minutes, and a ratio from one round compares two runs minutes apart at most.

    git worktree add /tmp/before <commit>            # the tree before the change
    python benchmarks/house_ab.py --before /tmp/before --after . --rounds 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

CHILD = r"""
import json, statistics, sys, time
import torch
from tokenmill import LLM, SamplingParams

model, batch, batch_len = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
llm = LLM(model=model, max_num_batched_tokens=2048, max_num_seqs=batch)
g = torch.Generator().manual_seed(0)
prompts = lambda n, length: [torch.randint(100, 20000, (length,), generator=g).tolist() for _ in range(n)]
greedy = dict(temperature=0, ignore_eos=True)
llm.generate(prompts(2, 64), SamplingParams(max_tokens=8, **greedy), use_tqdm=False)  # warm up
dec = []
llm.engine.step_stats.clear()
for _ in range(3):
    m = llm.generate(prompts(1, 1), SamplingParams(max_tokens=128, **greedy), use_tqdm=False)[0].metrics[0]
    dec.append(127 / (m.token_times[-1] - m.token_times[0]))
# what a decode step spends outside the forward pass (schedule, inputs, sample, apply, outputs): the house's
overhead = statistics.median(s.duration - s.forward_s for s in llm.engine.step_stats if s.num_decode_tokens)
t, cpu = time.perf_counter(), time.process_time()
llm.generate(prompts(batch, batch_len), SamplingParams(max_tokens=batch_len, **greedy), use_tqdm=False)
n = batch * 2 * batch_len
print(json.dumps({"decode_tok_s": statistics.median(dec), "decode_overhead_ms": 1e3 * overhead,
                  "batched_tok_s": n / (time.perf_counter() - t),
                  "batched_tok_per_cpu_s": n / (time.process_time() - cpu)}))
"""


def run(tree: Path, a: argparse.Namespace) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree.resolve())}
    out = subprocess.run([sys.executable, "-c", CHILD, a.model, str(a.batch), str(a.batch_len)], env=env,
                         capture_output=True, text=True, check=True, cwd=tree)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", type=Path, required=True, help="tree A: a checkout of the code before the change")
    ap.add_argument("--after", type=Path, required=True, help="tree B: the code after it")
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--batch-len", type=int, default=128)
    ap.add_argument("--json", help="also write every round to this file")
    a = ap.parse_args()
    rounds = []
    for r in range(a.rounds):
        order = [("before", a.before), ("after", a.after)]
        res = dict((name, run(tree, a)) for name, tree in (order if r % 2 == 0 else order[::-1]))
        ratio = {k: res["after"][k] / res["before"][k] for k in res["after"]}
        rounds.append({**res, "ratio": ratio})
        print(f"round {r + 1}: decode {res['before']['decode_tok_s']:.1f} -> {res['after']['decode_tok_s']:.1f} "
              f"tok/s ({ratio['decode_tok_s']:.3f}x), batched {res['before']['batched_tok_s']:.1f} -> "
              f"{res['after']['batched_tok_s']:.1f} tok/s ({ratio['batched_tok_s']:.3f}x)", flush=True)
    med = {k: statistics.median(r["ratio"][k] for r in rounds) for k in rounds[0]["ratio"]}
    print(f"median after/before over {a.rounds} rounds: decode {med['decode_tok_s']:.3f}x, "
          f"batched {med['batched_tok_s']:.3f}x")
    if a.json:
        Path(a.json).write_text(json.dumps({"rounds": rounds, "median_ratio": med}, indent=1))


if __name__ == "__main__":
    main()
