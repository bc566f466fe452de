"""Multi-LoRA serving (--enable-lora): offline output throughput with 1, 4 and 16 adapters mixed round robin over
the requests, against the base model alone on the same workload, and the time to load an adapter.

Random PEFT adapters are written as ``save_pretrained`` would (adapter_config.json and adapter_model.safetensors;
no peft needed) for the default model, rank --rank on --targets. The workload: --requests prompts of
--prompt-len random tokens, --max-tokens greedy tokens each (EOS ignored). One engine with --max-loras the
largest adapter count serves every run with adapters, each warmed up first (its adapters loaded) so that the
figure is the steady state; "base, LoRA off" is an engine without --enable-lora. The configurations take turns,
--repeats times, and the best run of each counts (on a shared machine the others' load only slows a run down).

Load time: an adapter's files read and checked against the model (host memory), then written into a slot of
the working set (the first step that runs it), each the median over --load-repeats fresh adapters.

    python benchmarks/lora.py                                   # 1, 4, 16 adapters, rank 16 on every projection
    python benchmarks/lora.py --adapters 1,4 --requests 16 --max-tokens 32 --targets q_proj,v_proj   # small
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from tokenmill import LLM, LoRARequest, SamplingParams
from tokenmill.lora.adapter import PARTS, TARGETS, projection_shapes

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapter(folder: Path, cfg, rank: int, targets: tuple[str, ...], seed: int) -> Path:
    """A random PEFT LoRA adapter for the model ``cfg`` describes (B scaled so that the delta is a few percent)."""
    rng = np.random.default_rng(seed)
    shapes, tensors = projection_shapes(cfg), {}
    for layer in range(cfg.num_layers):
        for t in targets:
            module, parts = TARGETS[t]
            fan_in, outs = shapes[module]
            out = sum(outs[PARTS[module].index(p)] for p in parts)
            where = "self_attn" if module in ("qkv_proj", "o_proj") else "mlp"
            key = f"base_model.model.model.layers.{layer}.{where}.{t}"
            tensors[f"{key}.lora_A.weight"] = (rng.standard_normal((rank, fan_in)) / fan_in ** 0.5).astype(np.float32)
            tensors[f"{key}.lora_B.weight"] = (0.02 * rng.standard_normal((out, rank)) / rank ** 0.5).astype(np.float32)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
                                                            "target_modules": list(targets), "bias": "none"}))
    return folder


def throughput(llm: LLM, prompts, params, loras) -> tuple[float, float]:
    """(output tokens per second, seconds) of one generate over the workload."""
    start = time.perf_counter()
    outs = llm.generate(prompts, params, lora_request=loras, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outs) / elapsed, elapsed


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--adapters", default="1,4,16", help="adapter counts to mix, comma separated (default 1,4,16)")
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--targets", default="all", help="all, or comma-separated PEFT module names")
    p.add_argument("--repeats", type=int, default=3, help="runs of each configuration, interleaved (best counts)")
    p.add_argument("--load-repeats", type=int, default=5)
    p.add_argument("--quantization", default="auto")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    a = p.parse_args()
    if a.threads:
        import torch

        torch.set_num_threads(a.threads)
    counts = [int(x) for x in a.adapters.split(",")]
    targets = ALL if a.targets == "all" else tuple(a.targets.split(","))
    engine_kw = dict(kv_cache_memory="256MiB", max_model_len=1024, max_num_seqs=a.max_num_seqs,
                     quantization=a.quantization, enable_prefix_caching=False)
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 49000) for _ in range(a.prompt_len)] for _ in range(a.requests)]
    params = SamplingParams(temperature=0, max_tokens=a.max_tokens, ignore_eos=True)
    warm = [p[:16] for p in prompts]
    warm_params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    results = {"config": vars(a), "runs": []}

    plain = LLM(**engine_kw)
    llm = LLM(enable_lora=True, max_loras=max(counts), max_cpu_loras=max(counts), max_lora_rank=a.rank, **engine_kw)
    cfg = llm.engine.info.model_config
    with tempfile.TemporaryDirectory(prefix="tokenmill-lora-") as tmp:
        folders = [write_adapter(Path(tmp) / f"ad{i}", cfg, a.rank, targets, i) for i in range(max(counts))]
        runs = [("base, LoRA off", plain, None), ("base, --enable-lora", llm, None)]
        for k in counts:
            loras = [LoRARequest(f"ad{i % k}", i % k + 1, str(folders[i % k])) for i in range(a.requests)]
            runs.append((f"{k} adapter{'s' if k > 1 else ''} round robin", llm, loras))
        speeds: dict[str, list[float]] = {name: [] for name, _, _ in runs}
        for _ in range(a.repeats):  # interleaved: a busy spell on a shared machine hits every configuration
            for name, engine, loras in runs:
                engine.generate(warm, warm_params, lora_request=loras, use_tqdm=False)  # (loads its adapters)
                speeds[name].append(throughput(engine, prompts, params, loras)[0])
        base = max(speeds["base, LoRA off"])
        for name, got in speeds.items():
            best = max(got)
            results["runs"].append({"config": name, "tokens_per_s": got, "best": best, "vs_base": best / base})
            print(f"{name:28s} best {best:7.1f} tok/s ({', '.join(f'{v:.0f}' for v in got)}): "
                  f"{best / base:6.1%} of the base", flush=True)

        # load time: fresh adapters (ids never used) read into host memory, then into a slot
        manager = llm.engine.runner.lora
        host, slot = [], []
        for r in range(a.load_repeats):
            folder = write_adapter(Path(tmp) / f"load{r}", cfg, a.rank, targets, 1000 + r)
            lora = LoRARequest(f"load{r}", 1000 + r, str(folder))
            t = time.perf_counter()
            manager.acquire(f"probe{r}", lora)
            host.append(time.perf_counter() - t)
            t = time.perf_counter()
            manager._activate({lora.lora_int_id})
            slot.append(time.perf_counter() - t)
            manager.release(f"probe{r}")
        size = sum(f.stat().st_size for f in folders[0].iterdir()) / 2**20
        results["load"] = {"host_ms": statistics.median(host) * 1e3, "slot_ms": statistics.median(slot) * 1e3,
                           "adapter_mib": size}
        print(f"adapter load ({size:.1f} MiB files): read and checked {results['load']['host_ms']:.1f} ms, into a "
              f"slot {results['load']['slot_ms']:.1f} ms (medians of {a.load_repeats})")
    if a.out:
        Path(a.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
