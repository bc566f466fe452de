"""GGUF files with random weights in the shapes of models people run, for tokenmill vs llama.cpp speed runs.

Speed depends on shapes and formats, not on trained values, so nothing is downloaded: ``make`` writes an
F16 GGUF per shape with seeded random weights (normal, std 0.02; norms 1 + noise) under llama.cpp's tensor
names and metadata keys, with the tokenizer of the embedded default model copied in, then (given
``--llama-bin``) quantizes it with llama.cpp's ``llama-quantize``. ``bench`` runs cpu_regimes.py on each
file (decode, prefill, batched; paired rounds against llama-bench) and measures, in a fresh process per
engine, the wall time to load and generate one token and the peak resident memory: a wrapper process runs
the engine (tokenmill: LLM(FILE) with --kv-cache-memory; llama.cpp: llama-simple -n 1, else llama-completion
or llama-cli -no-cnv) and reports RUSAGE_CHILDREN's ru_maxrss. llama.cpp maps the file, so its RSS counts
the weight pages it touched. Each file gets a markdown table: both engines, their ratio, the paired medians.

Shapes (the real configs): llama-3.2-1b, llama-3.2-3b, llama-3.1-8b (arch llama, llama3 rope_freqs),
qwen2.5-7b (arch qwen2, q/k/v biases); tiny and tiny-qwen2 (two layers, 30-55 MB: 256 wide, the K-quants'
block) check the script itself. The vocabulary is the embedded model's, 49,152 tokens, smaller than the real
ones (Llama 3: 128,256; Qwen2.5: 152,064), so token_embd/output have fewer rows than the real models' (at
F16, 0.65 GB less per matrix for the 8B, 0.74 GB for Qwen2.5-7B), the parameter counts run below the names
(7.4B, 6.9B, 3.0B, 1.1B) and the logits step is cheaper: the decoder layers are the real size.

    python benchmarks/real_shapes.py make --shapes tiny                      # F16 only, load-checked
    python benchmarks/real_shapes.py make --shapes llama-3.2-1b llama-3.1-8b qwen2.5-7b --llama-bin DIR
    python benchmarks/real_shapes.py make --shapes llama-3.2-3b --types Q4_K_M Q6_K --keep-f16 --check
    python benchmarks/real_shapes.py bench --llama-bin DIR --paired-rounds 8  # every .gguf in --out-dir
    python benchmarks/real_shapes.py bench results/real_shapes/tiny-f16.gguf --threads 2   # tokenmill only
    python benchmarks/real_shapes.py bench FILE --llama-bin DIR --load-only   # load time and peak RSS only

Beside the peak RSS the run prints a bare ``import torch``'s (the interpreter and torch, before any model).

Files are OUT_DIR/<shape>-f16.gguf and OUT_DIR/<shape>-<TYPE>.gguf (default OUT_DIR results/real_shapes);
existing files are skipped. The F16 is deleted after quantizing unless --keep-f16 (an 8B F16 is ~15 GB).
Writing holds one tensor at a time (the largest, qwen2.5-7b's embedding, is 0.35 GB at F16).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

TYPES = ("Q4_K_M", "Q4_0", "Q8_0", "Q5_K_M", "Q6_K")
CHUNK = 1 << 24  # values generated per call


@dataclass(frozen=True)
class Shape:
    arch: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    ctx: int
    rope_theta: float
    eps: float
    tied: bool
    bias: bool = False  # qwen2: q/k/v biases
    head_dim: int | None = None  # set where the HF config names it: the converter then writes key_length
    llama3_factor: float | None = None  # llama3 rope scaling: rope_freqs.weight (low 1, high 4, original 8192)

    @property
    def hd(self) -> int:
        return self.head_dim or self.hidden // self.heads


SHAPES = {
    "tiny": Shape("llama", 256, 2, 4, 2, 768, 2048, 500000.0, 1e-5, tied=True, head_dim=64, llama3_factor=32.0),
    "tiny-qwen2": Shape("qwen2", 256, 2, 4, 2, 768, 2048, 1e6, 1e-6, tied=False, bias=True),
    "llama-3.2-1b": Shape("llama", 2048, 16, 32, 8, 8192, 131072, 500000.0, 1e-5, tied=True, head_dim=64,
                          llama3_factor=32.0),
    "llama-3.2-3b": Shape("llama", 3072, 28, 24, 8, 8192, 131072, 500000.0, 1e-5, tied=True, head_dim=128,
                          llama3_factor=32.0),
    "llama-3.1-8b": Shape("llama", 4096, 32, 32, 8, 14336, 131072, 500000.0, 1e-5, tied=False, llama3_factor=8.0),
    "qwen2.5-7b": Shape("qwen2", 3584, 28, 28, 4, 18944, 32768, 1e6, 1e-6, tied=False, bias=True),
}


def tokenizer_fields() -> list[tuple[str, object, list]]:
    """(key, value, GGUF types) of every tokenizer.* field of the embedded default model's GGUF."""
    import gguf

    from tokenmill.models.registry import DEFAULT_MODEL, resolve_model

    reader = gguf.GGUFReader(str(resolve_model(DEFAULT_MODEL).path))
    return [(k, f.contents(), f.types) for k, f in reader.fields.items() if k.startswith("tokenizer.")]


def rope_factors(s: Shape) -> np.ndarray:
    """The rope_freqs.weight llama.cpp's converter writes for rope_type llama3."""
    low, high, old = 1.0, 4.0, 8192
    freqs = 1.0 / s.rope_theta ** (np.arange(0, s.hd, 2, dtype=np.float32) / s.hd)
    out = []
    for wavelen in 2 * np.pi / freqs:
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(s.llama3_factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / s.llama3_factor + smooth))
    return np.array(out, dtype=np.float32)


def tensor_plan(s: Shape, vocab: int) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, numpy shape [out, in], kind) in the converter's order; the writer reverses dims for GGUF."""
    q, kv = s.heads * s.hd, s.kv_heads * s.hd
    plan = [("rope_freqs.weight", (s.hd // 2,), "rope")] if s.llama3_factor else []
    plan.append(("token_embd.weight", (vocab, s.hidden), "matrix"))
    for i in range(s.layers):
        b = f"blk.{i}"
        plan += [(f"{b}.attn_norm.weight", (s.hidden,), "norm"), (f"{b}.attn_q.weight", (q, s.hidden), "matrix"),
                 (f"{b}.attn_k.weight", (kv, s.hidden), "matrix"), (f"{b}.attn_v.weight", (kv, s.hidden), "matrix")]
        if s.bias:
            plan += [(f"{b}.attn_q.bias", (q,), "bias"), (f"{b}.attn_k.bias", (kv,), "bias"),
                     (f"{b}.attn_v.bias", (kv,), "bias")]
        plan += [(f"{b}.attn_output.weight", (s.hidden, q), "matrix"), (f"{b}.ffn_norm.weight", (s.hidden,), "norm"),
                 (f"{b}.ffn_gate.weight", (s.ffn, s.hidden), "matrix"), (f"{b}.ffn_up.weight", (s.ffn, s.hidden), "matrix"),
                 (f"{b}.ffn_down.weight", (s.hidden, s.ffn), "matrix")]
    plan.append(("output_norm.weight", (s.hidden,), "norm"))
    if not s.tied:
        plan.append(("output.weight", (vocab, s.hidden), "matrix"))
    return plan


def make_tensor(s: Shape, shape: tuple[int, ...], kind: str, g: torch.Generator) -> np.ndarray:
    if kind == "rope":
        return rope_factors(s)
    # norms F32 like the converter's 1-D tensors, 1 + noise: activations stay a real model's size
    out = np.empty(shape, dtype=np.float16 if kind == "matrix" else np.float32)
    flat = torch.from_numpy(out.reshape(-1))
    for i in range(0, flat.numel(), CHUNK):  # filled in place: memory is the tensor itself (torch: 4x numpy's speed)
        flat[i:i + CHUNK].normal_(1.0 if kind == "norm" else 0.0, 0.02, generator=g)
    return out


def write_f16(name: str, s: Shape, path: Path, seed: int) -> None:
    import gguf

    tok = tokenizer_fields()
    vocab = next(len(v) for k, v, _ in tok if k == "tokenizer.ggml.tokens")
    part = path.with_name(path.name + ".part")  # renamed when complete: an interrupted write is not skipped later
    w = gguf.GGUFWriter(str(part), s.arch)
    w.add_name(f"random {name}")
    w.add_block_count(s.layers)
    w.add_context_length(s.ctx)
    w.add_embedding_length(s.hidden)
    w.add_feed_forward_length(s.ffn)
    w.add_head_count(s.heads)
    w.add_head_count_kv(s.kv_heads)
    w.add_rope_freq_base(s.rope_theta)
    w.add_layer_norm_rms_eps(s.eps)
    if s.head_dim:
        w.add_key_length(s.head_dim)
        w.add_value_length(s.head_dim)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    if s.arch == "llama":  # LlamaModel.set_gguf_parameters adds these two; Qwen2Model does not
        w.add_vocab_size(vocab)
        w.add_rope_dimension_count(s.hd)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    for key, value, types in tok:
        w.add_key_value(key, value, types[0], sub_type=types[-1] if len(types) > 1 else None)
    plan = tensor_plan(s, vocab)
    for tname, shape, kind in plan:
        dtype = np.float16 if kind == "matrix" else np.float32
        w.add_tensor_info(tname, shape, np.dtype(dtype), int(np.prod(shape)) * np.dtype(dtype).itemsize)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    t = time.perf_counter()
    for i, (tname, shape, kind) in enumerate(plan):
        # a generator per tensor: each tensor's values depend on the seed and its index only
        g = torch.Generator().manual_seed(int(np.random.SeedSequence([seed, i]).generate_state(1)[0]))
        w.write_tensor_data(make_tensor(s, shape, kind, g))
    w.close()
    part.rename(path)
    print(f"wrote {path} ({path.stat().st_size / 2**30:.2f} GiB, {len(plan)} tensors, {time.perf_counter() - t:.0f} s)")


def check_file(path: Path) -> None:
    """Load with tokenmill, generate a few greedy tokens (gibberish: random weights), and inspect."""
    from tokenmill import LLM, SamplingParams

    t = time.perf_counter()
    llm = LLM(str(path), kv_cache_memory="64MiB", max_model_len=256)
    try:
        out = llm.generate(["The capital of France is"], SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)
        print(f"check {path.name}: loaded and generated in {time.perf_counter() - t:.1f} s: "
              f"{out[0].outputs[0].token_ids} {out[0].outputs[0].text!r}")
    finally:
        llm.shutdown()
    r = subprocess.run([sys.executable, "-m", "tokenmill.cli", "inspect", str(path)], capture_output=True, text=True)
    print(r.stdout.rstrip() or r.stderr.rstrip())
    if r.returncode:
        raise SystemExit(f"tokenmill inspect failed on {path} (exit {r.returncode})")


def cmd_make(args) -> None:
    args.out_dir.mkdir(parents=True, exist_ok=True)
    quantize = args.llama_bin / "llama-quantize" if args.llama_bin else None
    if quantize and not quantize.is_file():
        raise SystemExit(f"{quantize} not found: build llama.cpp's tools first")
    for name in args.shapes:
        s = SHAPES[name]
        f16 = args.out_dir / f"{name}-f16.gguf"
        targets = [args.out_dir / f"{name}-{t}.gguf" for t in args.types] if quantize else []
        missing = [p for p in targets if not p.exists()]
        if f16.exists() or (quantize and not missing):
            print(f"skip {f16}: " + ("exists" if f16.exists() else "every quantized file exists"))
        else:
            write_f16(name, s, f16, args.seed)
        for ty, out in zip(args.types, targets):
            if out.exists():
                print(f"skip {out}: exists")
                continue
            part = out.with_name(out.name + ".part")
            t = time.perf_counter()
            subprocess.run([str(quantize), str(f16), str(part), ty], check=True, stdout=subprocess.DEVNULL)
            part.rename(out)
            print(f"wrote {out} ({out.stat().st_size / 2**30:.2f} GiB, {time.perf_counter() - t:.0f} s)")
        if quantize and not args.keep_f16 and f16.exists():
            f16.unlink()
            print(f"deleted {f16} (--keep-f16 keeps it)")
        if name.startswith("tiny") or args.check:
            for p in [f16, *targets]:
                if p.exists():
                    check_file(p)


# ---- bench --------------------------------------------------------------------------------------

# Runs argv, prints its wall time and peak RSS. A wrapper process per measurement because RUSAGE_CHILDREN's
# ru_maxrss is the largest of every child ever waited for: in this process it would include cpu_regimes.py.
WRAPPER = """import json, resource, subprocess, sys, time
t = time.perf_counter()
r = subprocess.run(sys.argv[1:], stdin=subprocess.DEVNULL, capture_output=True, text=True)
print(json.dumps({"rc": r.returncode, "wall_s": time.perf_counter() - t, "out": r.stdout[-2000:],
                  "err": r.stderr[-2000:], "maxrss_kib": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss}))"""

TOKENMILL_CHILD = """import json, sys, time
t = time.perf_counter()
from tokenmill import LLM, SamplingParams
llm = LLM(sys.argv[1], kv_cache_memory=sys.argv[2])
load = time.perf_counter() - t
llm.generate(["Hello"], SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
print(json.dumps({"load_s": load}))"""


def measure(argv: list[str]) -> dict:
    r = subprocess.run([sys.executable, "-c", WRAPPER, *argv], capture_output=True, text=True, check=True)
    res = json.loads(r.stdout)
    if res["rc"]:
        print(f"  {Path(argv[0]).name} exited {res['rc']}: {res['err'][-600:]}")
    return res


def llama_load_argv(bin_dir: Path, model: str) -> list[str] | None:
    """A llama.cpp command that loads the file and generates one token, or None: llama-simple takes the prompt
    as its last argument; llama-completion (or an older llama-cli) needs -no-cnv to not wait for a chat."""
    if (bin_dir / "llama-simple").is_file():
        return [str(bin_dir / "llama-simple"), "-m", model, "-n", "1", "Hello"]
    for name in ("llama-completion", "llama-cli"):
        if (bin_dir / name).is_file():
            return [str(bin_dir / name), "-m", model, "-n", "1", "-p", "Hello", "-no-cnv"]
    return None


def cpu_summary() -> str:
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model = re.search(r"^model name\s*:\s*(.*)$", text, re.M)
    flags = re.search(r"^flags\s*:\s*(.*)$", text, re.M)
    flags = set(flags.group(1).split()) if flags else set()
    return (f"CPU: {model.group(1) if model else 'unknown'}; "
            + ", ".join(f"{f} {'yes' if f in flags else 'no'}" for f in ("avx2", "avx512f", "avx512_vnni")))


def fmt(v, spec: str = ".1f") -> str:
    return "-" if v is None else format(v, spec)


def ratio(a, b) -> str:
    return f"{a / b:.2f}x" if a is not None and b else "-"


def bench_file(path: Path, args) -> dict:
    m = re.fullmatch(r"(.+)-(f16|Q\w+)", path.stem)
    model, form = (m.group(1), m.group(2)) if m else (path.stem, "?")
    regimes = args.out_dir / f"{path.stem}.regimes.json"
    cmd = [sys.executable, str(Path(__file__).with_name("cpu_regimes.py")), "--model", str(path),
           "--quantization", "auto", "--json", str(regimes), "--batch", str(args.batch),
           "--batch-len", str(args.batch_len)]
    if args.llama_bin:
        cmd += ["--llama-bin", str(args.llama_bin), "--paired-rounds", str(args.paired_rounds)]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    regimes.unlink(missing_ok=True)  # so a failed run cannot report an old file's numbers
    if not args.load_only:
        print(f"\n$ {' '.join(cmd)}", flush=True)
        if subprocess.run(cmd).returncode:
            print(f"cpu_regimes.py failed on {path}")
    res = json.loads(regimes.read_text()) if regimes.exists() else {"rows": []}
    rows = {("llama.cpp" if r["quantization"] == "llama.cpp" else "tokenmill"): r for r in res["rows"]}
    loads = {"tokenmill": measure([sys.executable, "-c", TOKENMILL_CHILD, str(path), args.kv_cache_memory])}
    argv = llama_load_argv(args.llama_bin, str(path)) if args.llama_bin else None
    if argv:
        loads["llama.cpp"] = measure(argv)
    elif args.llama_bin:
        print(f"no llama-simple, llama-completion or llama-cli in {args.llama_bin}: no llama.cpp load/RSS figure")

    print(f"\n### {model}, {form}, {path.stat().st_size / 2**30:.2f} GiB ({path.name})\n")
    keys = ("decode_tok_s", "prefill_tok_s", "batched_total_tok_s")
    print(f"| engine | decode tok/s | prefill 512 tok/s | {args.batch}x({args.batch_len}+{args.batch_len}) tok/s "
          "| load+1 token s | peak RSS GiB |")
    print("|---|---|---|---|---|---|")
    vals = {}
    for eng in ("tokenmill", "llama.cpp"):
        if eng not in rows and eng not in loads:
            continue
        ld = loads.get(eng) or {}
        ok = ld.get("rc") == 0
        vals[eng] = [rows.get(eng, {}).get(k) for k in keys] + [
            ld["wall_s"] if ok else None, ld["maxrss_kib"] / 2**20 if ok else None]
        print(f"| {eng} | " + " | ".join(fmt(v, ".0f" if i == 1 else ".2f" if i > 2 else ".1f")
                                         for i, v in enumerate(vals[eng])) + " |")
    if len(vals) == 2:
        print("| tokenmill / llama.cpp | " + " | ".join(ratio(a, b) for a, b in zip(vals["tokenmill"], vals["llama.cpp"])) + " |")
    for regime, p in res.get("paired", {}).items():
        print(f"paired {regime}: median ratio {p['median_ratio']:.2f}x over {len(p['pairs'])} rounds")
    return {"file": str(path), "model": model, "format": form, "bytes": path.stat().st_size, "regimes": res,
            "load": loads}


def cmd_bench(args) -> None:
    files = args.files or sorted(args.out_dir.glob("*.gguf"))
    if not files:
        raise SystemExit(f"no .gguf files given or in {args.out_dir}: run make first")
    if args.llama_bin and not (args.llama_bin / "llama-bench").is_file():
        raise SystemExit(f"{args.llama_bin / 'llama-bench'} not found (cpu_regimes.py runs llama-bench)")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    print(cpu_summary())
    # tokenmill's resident memory above the file: Python and torch alone take this much (ru_maxrss)
    bare = measure([sys.executable, "-c", "import torch"])["maxrss_kib"] / 2**20
    print(f"a bare `import torch` peaks at {bare:.2f} GiB")
    summary = [bench_file(Path(f), args) for f in files]
    (args.out_dir / "bench_summary.json").write_text(json.dumps(summary, indent=2))
    print(f"\nwrote {args.out_dir / 'bench_summary.json'}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    mk = sub.add_parser("make", help="write random-weight GGUFs in real shapes, quantize them")
    mk.add_argument("--shapes", nargs="+", default=["tiny"], choices=list(SHAPES))
    mk.add_argument("--types", nargs="+", default=["Q4_K_M", "Q4_0", "Q8_0"], choices=TYPES)
    mk.add_argument("--keep-f16", action="store_true", help="keep the F16 file after quantizing")
    mk.add_argument("--check", action="store_true", help="load-check every shape with tokenmill (tiny always is)")
    mk.add_argument("--seed", type=int, default=0)
    bn = sub.add_parser("bench", help="cpu_regimes.py, load time and peak RSS per file")
    bn.add_argument("files", nargs="*", type=Path, help="default: every .gguf in --out-dir")
    bn.add_argument("--paired-rounds", type=int, default=4, help="with --llama-bin (cpu_regimes.py)")
    bn.add_argument("--threads", type=int, help="cpu_regimes.py's --threads (default: its own, all torch threads)")
    bn.add_argument("--batch", type=int, default=16, help="batched regime's sequences (default 16)")
    bn.add_argument("--batch-len", type=int, default=64, help="batched regime's prompt and output tokens (default 64)")
    bn.add_argument("--load-only", action="store_true",
                    help="only the load/peak-RSS run of each engine (no cpu_regimes.py)")
    bn.add_argument("--kv-cache-memory", default="512MiB",
                    help="tokenmill's KV cache in the load/RSS run (llama.cpp sizes its own context)")
    for p in (mk, bn):
        p.add_argument("--out-dir", type=Path, default=Path("results/real_shapes"))
        p.add_argument("--llama-bin", type=Path, help="folder with llama.cpp's binaries (llama-quantize, "
                       "llama-bench, llama-batched-bench, llama-simple)")
    args = ap.parse_args()
    if args.cmd == "make":
        cmd_make(args)
    else:
        cmd_bench(args)


if __name__ == "__main__":
    main()
