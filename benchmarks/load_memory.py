"""Peak host memory while loading a model: the embedded GGUF and a synthetic 1B-parameter bf16 checkpoint.

The benchmark writes a Llama-shaped checkpoint of about 1.1B parameters (TinyLlama's shape: hidden 2048,
22 layers, intermediate 5632, 32000-token vocabulary) as bf16 safetensors shards with random weights,
then loads each model in a fresh process (``tokenmill.models.loader.load_model``, the loader alone: no
KV cache, no warm-up) and reports that process's peak resident memory (ru_maxrss) beside the bytes of
the model's own tensors and of an idle process that imported torch and tokenmill. ``--tree DIR`` runs the
loader from another checkout (an older commit, to compare), everything else the same.

    python benchmarks/load_memory.py [--keep DIR] [--tree OLD_CHECKOUT]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHAPE = dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
             num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=2048)
GIB = 2**30


def write_checkpoint(folder: Path, shard_bytes: int = 2 * GIB) -> int:
    """A bf16 Llama checkpoint in shards of at most shard_bytes, as hub checkpoints are; returns parameters."""
    import torch
    from safetensors.torch import save_file

    sys.path.insert(0, str(ROOT / "tests"))
    import tiny_models

    folder.mkdir(parents=True, exist_ok=True)
    s = SHAPE
    h, f = s["hidden_size"], s["intermediate_size"]
    kv = s["num_key_value_heads"] * h // s["num_attention_heads"]  # K/V rows: KV heads x head_dim
    shapes = {"model.embed_tokens.weight": (s["vocab_size"], h), "model.norm.weight": (h,),
              "lm_head.weight": (s["vocab_size"], h)}
    for i in range(s["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                       p + "self_attn.q_proj.weight": (h, h), p + "self_attn.k_proj.weight": (kv, h),
                       p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, h),
                       p + "mlp.gate_proj.weight": (f, h), p + "mlp.up_proj.weight": (f, h),
                       p + "mlp.down_proj.weight": (h, f)})
    g = torch.Generator().manual_seed(0)
    shard, size, n, params = {}, 0, 0, 0
    for name, shape in shapes.items():
        t = torch.randn(shape, generator=g, dtype=torch.float32).mul_(0.02).to(torch.bfloat16)
        shard[name], size, params = t, size + t.numel() * 2, params + t.numel()
        if size >= shard_bytes:
            save_file(shard, str(folder / f"model-{n:05d}.safetensors"))
            shard, size, n = {}, 0, n + 1
    if shard:
        save_file(shard, str(folder / f"model-{n:05d}.safetensors"))
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "torch_dtype": "bfloat16",
                                                    "rms_norm_eps": 1e-5, **SHAPE}))
    tiny_models.write_tokenizer_files(folder)
    return params


def child(model: str, dtype: str) -> None:
    """Load once and print JSON: peak RSS and the model's tensor bytes."""
    import torch

    import tokenmill  # noqa: F401 -- what a server imports before loading
    from tokenmill.models.loader import load_model
    from tokenmill.models.registry import resolve_model

    idle = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    dt = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    loaded = load_model(resolve_model(model), dt, torch.device("cpu"), quantization="none")
    m = loaded.model
    tensor_bytes = sum(t.numel() * t.element_size() for t in [*m.parameters(), *m.buffers()])
    print(json.dumps({"peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "idle_rss": idle,
                      "model_bytes": tensor_bytes,
                      "param_dtype": str(next(m.layers[0].parameters()).dtype)}))


def measure(model: str, dtype: str, tree: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree), "TOKENMILL_DISABLE_CPU_KERNELS": "1"}
    out = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", model, dtype],
                         env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--keep", type=Path, help="write (or reuse) the synthetic checkpoint here instead of a temp dir")
    ap.add_argument("--tree", type=Path, default=ROOT, help="the checkout whose loader to measure")
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(*args.child)
    with tempfile.TemporaryDirectory() as tmp:
        folder = args.keep or Path(tmp) / "llama-1b"
        if not (folder / "config.json").exists():
            params = write_checkpoint(folder)
            print(f"wrote a {params / 1e9:.2f}B-parameter bf16 checkpoint", flush=True)
        files = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
        rows = [("embedded GGUF (Q4_1 file -> float32)", "smollm2-135m-instruct", "float32", None),
                ("1.1B bf16 checkpoint, --dtype bfloat16", str(folder), "bfloat16", files),
                ("1.1B bf16 checkpoint, --dtype float32", str(folder), "float32", files)]
        print("| model | peak RSS GiB | idle process GiB | model tensors GiB | file GiB | params |")
        print("|---|---|---|---|---|---|")
        for label, model, dtype, size in rows:
            r = measure(model, dtype, args.tree)
            size_s = f"{size / GIB:.2f}" if size else "-"
            print(f"| {label} | {r['peak_rss'] / GIB:.2f} | {r['idle_rss'] / GIB:.2f} | "
                  f"{r['model_bytes'] / GIB:.2f} | {size_s} | {r['param_dtype']} |", flush=True)


if __name__ == "__main__":
    main()
