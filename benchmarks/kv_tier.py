"""The KV tier on local disk (--kv-offload-size): multi-turn sessions whose prefixes exceed the KV pool, with and
without the tier, and after a restart.

Each of --sessions sessions has its own long system prompt (--system-tokens of a text: the README by default) and
--turns user turns; turn t's prompt is the system prompt and the conversation so far (fixed assistant answers, so
the prompts are the same in every run), through the model's chat template. The sessions take turns round robin,
one request at a time, so a session's prefix has been pushed out of the pool by the others when it comes back (the
pool, --kv-cache-memory, holds less than all the system prompts). Three runs of the same workload:

  recompute  no tier: a re-visited prefix is computed again
  tier       --kv-offload-size on an empty directory: evicted blocks go to disk, re-visits read them back
  restart    a new engine on the tier's directory after the first shut down: every prompt, first turns too,
             finds its prefix on disk

Per run: TTFT p50/p99 (ms) of re-visited prompts (a session's turns after its first; in the restart run every
prompt) and of first visits, throughput over the whole workload (requests/s, prompt tokens/s), the tier's hits and
bytes, and whether every request's greedy tokens and logprobs are the same bits as the recompute run's.

    python benchmarks/kv_tier.py                                   # 8 sessions x 4 turns, 1024-token prompts
    python benchmarks/kv_tier.py --sessions 4 --turns 3 --system-tokens 256 --kv-cache-memory 16MiB   # small
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from tokenmill import LLM, SamplingParams

ROOT = Path(__file__).resolve().parent.parent
QUESTIONS = ["Summarize the above in one line.", "What is the most important flag?", "Name one thing it refuses.",
             "What would you benchmark first?", "Which part would you change?", "Explain it to a newcomer."]


def workload(llm: LLM, text: str, sessions: int, turns: int, system_tokens: int) -> list[tuple[int, int, list[int]]]:
    """(session, turn, prompt token ids), round robin over the sessions."""
    tok = llm.tokenizer
    ids = tok.encode(text)
    if len(ids) < sessions * system_tokens:
        ids = ids * (sessions * system_tokens // max(len(ids), 1) + 1)
    systems = [tok.decode(ids[i * system_tokens:(i + 1) * system_tokens]) for i in range(sessions)]
    out = []
    for t in range(turns):
        for s in range(sessions):
            messages = [{"role": "system", "content": systems[s]}]
            for k in range(t + 1):
                messages.append({"role": "user", "content": QUESTIONS[k % len(QUESTIONS)]})
                if k < t:
                    messages.append({"role": "assistant", "content": f"Here is my answer to question {k + 1}."})
            out.append((s, t, tok.encode(tok.apply_chat_template(messages))))
    return out


def run(llm: LLM, work, params: SamplingParams, all_revisits: bool) -> dict:
    revisit, first, outputs = [], [], []
    t0 = time.perf_counter()
    steps0 = len(llm.engine.step_stats)
    for _, turn, prompt in work:
        o = llm.generate([prompt], params, use_tqdm=False)[0]
        (revisit if turn > 0 or all_revisits else first).append(o.metrics[0].ttft)
        outputs.append((o.outputs[0].token_ids, o.outputs[0].logprobs))
    wall = time.perf_counter() - t0
    hits = bytes_read = bytes_written = failures = 0
    for s in list(llm.engine.step_stats)[steps0:]:
        if s.kv_offload is not None:
            hits += s.kv_offload.hits
            bytes_read += s.kv_offload.bytes_read
            bytes_written += s.kv_offload.bytes_written
            failures += s.kv_offload.failures
    prompt_tokens = sum(len(p) for _, _, p in work)

    def pct(xs, q):
        return 1e3 * statistics.quantiles(xs, n=100, method="inclusive")[q - 1] if len(xs) > 1 else (
            1e3 * xs[0] if xs else float("nan"))

    return {"ttft_revisit_p50_ms": pct(revisit, 50), "ttft_revisit_p99_ms": pct(revisit, 99),
            "ttft_first_p50_ms": pct(first, 50), "requests_per_s": len(work) / wall,
            "prompt_tokens_per_s": prompt_tokens / wall, "wall_s": wall, "tier_hit_blocks": hits,
            "tier_read_mib": bytes_read / 2**20, "tier_written_mib": bytes_written / 2**20,
            "tier_failures": failures, "outputs": outputs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--sessions", type=int, default=8)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--system-tokens", type=int, default=1024, help="each session's system prompt, in tokens")
    ap.add_argument("--text", default=str(ROOT / "README.md"), help="the text the system prompts are cut from")
    ap.add_argument("--kv-cache-memory", default="64MiB",
                    help="the KV pool: less than the sessions' prompts together (default 64MiB: about 1,450 tokens "
                         "of the default model's float32 KV)")
    ap.add_argument("--kv-offload-size", type=float, default=4.0, help="the tier's GiB")
    ap.add_argument("--kv-offload-path", default=None, help="the tier's directory (default: a temporary one, "
                    "deleted at the end)")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--json", default=None, help="also write the figures to this file")
    a = ap.parse_args()
    path = Path(a.kv_offload_path or tempfile.mkdtemp(prefix="tokenmill-kv-tier-"))
    kw = dict(model=a.model, kv_cache_memory=a.kv_cache_memory, max_model_len=a.max_model_len)
    tier_kw = dict(kv_offload_size=a.kv_offload_size, kv_offload_path=str(path))
    params = SamplingParams(temperature=0, max_tokens=a.max_tokens, ignore_eos=True, logprobs=1)
    results = {}
    try:
        for name, extra, all_revisits in (("recompute", {}, False), ("tier", tier_kw, False),
                                          ("restart", tier_kw, True)):
            llm = LLM(**kw, **extra)
            if name == "recompute":
                work = workload(llm, Path(a.text).read_text(encoding="utf-8"), a.sessions, a.turns,
                                a.system_tokens)
                pool_tokens = llm.engine.kv_cache.num_blocks * llm.engine.kv_cache.block_size
                print(f"{a.sessions} sessions x {a.turns} turns, prompts {min(len(p) for *_, p in work)}-"
                      f"{max(len(p) for *_, p in work)} tokens; KV pool {pool_tokens} tokens; "
                      f"{llm.engine.quantization} weights\n", flush=True)
            results[name] = run(llm, work, params, all_revisits)
            llm.shutdown()  # (the tier writes what its pool holds: the restart finds it)
    finally:
        if a.kv_offload_path is None:
            shutil.rmtree(path, ignore_errors=True)
    base = results["recompute"]
    print("| run | TTFT re-visited p50 (ms) | p99 (ms) | TTFT first visit p50 (ms) | p50 speed-up | requests/s | "
          "prompt tokens/s | tier hits (blocks) | read / written (MiB) | same bits as recompute |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, r in results.items():
        same = r["outputs"] == base["outputs"]
        r["same_bits"] = same
        print(f"| {name} | {r['ttft_revisit_p50_ms']:.1f} | {r['ttft_revisit_p99_ms']:.1f} | "
              f"{r['ttft_first_p50_ms']:.1f} | {base['ttft_revisit_p50_ms'] / r['ttft_revisit_p50_ms']:.1f}x | "
              f"{r['requests_per_s']:.2f} | {r['prompt_tokens_per_s']:.0f} | {r['tier_hit_blocks']} | "
              f"{r['tier_read_mib']:.1f} / {r['tier_written_mib']:.1f} | {'yes' if same else 'NO'} |")
    if a.json:
        Path(a.json).write_text(json.dumps({k: {f: v for f, v in r.items() if f != "outputs"}
                                            for k, r in results.items()}, indent=1))


if __name__ == "__main__":
    main()
