"""K-quant GGUF files of the embedded model: quality and speed against the file they were made from.

The embedded SmolLM2-135M-Instruct GGUF (Q4_1/Q8_0) is requantized as llama-quantize --allow-requantize
does for Q6_K and Q4_K_M (tests/kquants.py: round-to-nearest blocks, llama.cpp's type recipe and its
fallbacks for rows not a multiple of 256). For each file: perplexity on tinyshakespeare with the weights
dequantized to float32 (`--quantization none`: the file's own quality) and in the default mode (the
kernels on the file's own Q8_0/Q4_1/Q5_0/Q4_K/Q6_K blocks, exactly), the weights' resident bytes, and
single-stream decode plus 512-token prefill speed in the default mode, all files in one run.

    python benchmarks/kquants.py --text ../shared/data/tinyshakespeare.txt
    # llama.cpp's own files (llama-quantize --allow-requantize EMBEDDED.gguf OUT.gguf Q4_K_M, ...)
    python benchmarks/kquants.py --text ../shared/data/tinyshakespeare.txt --no-requantize --gguf DIR/*.gguf
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import kquants  # noqa: E402

from tokenmill import LLM, SamplingParams  # noqa: E402
from tokenmill.eval import perplexity  # noqa: E402
from tokenmill.models.registry import DEFAULT_MODEL, resolve_model  # noqa: E402


def weight_bytes(llm: LLM) -> int:
    from tokenmill.perf.roofline import weight_bytes_read

    return weight_bytes_read(llm.engine.runner.model)


def speed(llm: LLM, rounds: int = 3) -> tuple[float, float]:
    """(decode tokens/s of one sequence over 128 tokens, prefill tokens/s of a 512-token prompt), medians."""
    decode, prefill = [], []
    for r in range(rounds):
        ids = list(range(1000 + 600 * r, 1512 + 600 * r))  # a new prompt each round: no prefix-cache hit
        t = time.perf_counter()
        llm.generate([ids], SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
        prefill.append(512 / (time.perf_counter() - t))
        t = time.perf_counter()
        out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=128, temperature=0, ignore_eos=True),
                           use_tqdm=False)
        decode.append(len(out[0].outputs[0].token_ids) / (time.perf_counter() - t))
    return sorted(decode)[rounds // 2], sorted(prefill)[rounds // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--text", required=True, help="plain text for perplexity (tinyshakespeare)")
    ap.add_argument("--num-tokens", type=int, default=8192)
    ap.add_argument("--output-json", default=None)
    ap.add_argument("--gguf", nargs="*", default=[], type=Path,
                    help="more files in the table, e.g. llama-quantize's own Q2_K ... Q6_K of the embedded model")
    ap.add_argument("--no-requantize", action="store_true",
                    help="leave out the files tests/kquants.py writes (when --gguf brings llama.cpp's)")
    a = ap.parse_args()
    text = Path(a.text).read_text()
    src = resolve_model(DEFAULT_MODEL).path
    tmp = Path(tempfile.mkdtemp(prefix="kquants-"))
    files = {"Q4_1/Q8_0 (embedded)": src}
    for recipe in () if a.no_requantize else ("Q6_K", "Q4_K_M"):
        files[recipe] = kquants.requantize_gguf(src, tmp / f"{recipe}.gguf", recipe)
    files.update({f.stem: f for f in a.gguf})
    rows = {}
    for name, path in files.items():
        row = {"file_MiB": path.stat().st_size / 2**20}
        for mode in ("none", "auto"):
            llm = LLM(str(path), quantization=mode, kv_cache_memory="256MiB", max_model_len=2048)
            row[f"ppl_{mode}"] = perplexity(llm.engine, text, a.num_tokens, 512, progress=False).perplexity
            if mode == "auto":
                row["mode"] = llm.engine.quantization
                row["weights_MiB"] = weight_bytes(llm) / 2**20
                row["decode_tok_s"], row["prefill_tok_s"] = speed(llm)
            del llm
        rows[name] = row
        print(name, json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
    print("\n| file | file MiB | ppl, float weights | ppl, default mode | default mode | weights MiB | decode tok/s "
          "| prefill-512 tok/s |\n|---|---|---|---|---|---|---|---|")
    for name, r in rows.items():
        print(f"| {name} | {r['file_MiB']:.1f} | {r['ppl_none']:.3f} | {r['ppl_auto']:.3f} | {r['mode']} | "
              f"{r['weights_MiB']:.1f} | {r['decode_tok_s']:.1f} | {r['prefill_tok_s']:.0f} |")
    if a.output_json:
        Path(a.output_json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
