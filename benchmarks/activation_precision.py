"""How precise must the activations be? int16 (tokenmill's integer kernels today) against int8 (llama.cpp's).

The integer kernels multiply quantized weights by activations quantized per token and per block: tokenmill
uses int16 steps (32767 per block of 32), llama.cpp int8 (Q8_0/Q8_1: 127 steps per block of 32 for the
legacy formats; Q8_K: 127 steps per block of 256 for the K-quants). int8 doubles the multiply rate on AVX2
(vpmaddubsw), so the choice is speed against quality, decided by measurement. This script emulates each
choice in float on a real model's quantized weights (the weights dequantized exactly, the activations
quantized and dequantized as the kernel would; only the float summation order differs from an integer
kernel, far below the quantization error) and reports, per text:

- perplexity (the second half of each window scored) for: the kernels as they are (int16) and with
  ``--activation-precision int8`` (int8), float
  activations (weight-only quantization: the bound), int8 per 32 (Q8_0 style, every format), and int8
  as llama.cpp picks it (per 256 for K-quant weights, per 32 for the others);
- teacher-forced top-1 agreement of each with the int16 kernels and with float activations: the share
  of positions whose argmax is the same.

    python benchmarks/activation_precision.py --text ../shared/data/tinyshakespeare.txt --code tokenmill
    python benchmarks/activation_precision.py --model FILE.gguf --text T.txt --windows 8 --json out.json

``--code DIR`` scores the concatenated .py files under DIR (code is the other kind of text people send).
The model runs its decoder layers op by op (``set_layer_fusion(False)``) so each linear layer's activations
pass through the emulation; the ``int16`` and ``int8`` rows use the real kernel (``torch.ops.tokenmill.qlinear``).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from helpers import prefill_logits  # noqa: E402  (the engine's paged prefill, every position's logits)

from tokenmill import LLM  # noqa: E402
from tokenmill.layers.kernels import set_activation_precision  # noqa: E402
from tokenmill.layers.quant import BLOCK_WEIGHTS, QuantizedLinear  # noqa: E402
from tokenmill.models.registry import DEFAULT_MODEL  # noqa: E402

MODES = ("int16", "int8", "float", "int8/32", "int8/llama.cpp")
KERNEL_MODES = ("int16", "int8")  # the kernels themselves (--activation-precision); the others emulated


def fake_quant(x: torch.Tensor, block: int, steps: int) -> torch.Tensor:
    """x [..., K] quantized per token and block of ``block`` to integers in [-steps, steps] and back."""
    xb = x.float().unflatten(-1, (-1, block))
    d = xb.abs().amax(-1, keepdim=True) / steps
    q = torch.where(d > 0, torch.round(xb / torch.where(d > 0, d, 1)), 0)
    return (q * d).flatten(-2)


class Emulation:
    """Swaps QuantizedLinear.forward for the mode under test; the dequantized weights are cached."""

    def __init__(self) -> None:
        self.mode = "int16"
        self._dense: dict[int, torch.Tensor] = {}
        self._kernel = QuantizedLinear.forward
        emu = self

        def forward(lin: QuantizedLinear, x: torch.Tensor) -> torch.Tensor:
            if emu.mode in KERNEL_MODES:
                return emu._kernel(lin, x)
            w = emu._dense.get(id(lin))
            if w is None:
                w = emu._dense[id(lin)] = lin.weight.dequantize(torch.float32)
            if emu.mode == "int8/32":
                x = fake_quant(x, 32, 127)
            elif emu.mode == "int8/llama.cpp":
                x = fake_quant(x, 256 if BLOCK_WEIGHTS[lin.fmt] == 256 else 32, 127)
            y = F.linear(x.float(), w)
            return y if lin.bias is None else y + lin.bias

        QuantizedLinear.forward = forward


def windows(ids: list[int], n: int, length: int) -> list[list[int]]:
    return [ids[i * length:(i + 1) * length] for i in range(min(n, len(ids) // length))]


def score(engine, emu: Emulation, wins: list[list[int]]) -> dict:
    """Per mode: perplexity over the second half of every window; top-1 agreement with int16 and float."""
    nll = {m: 0.0 for m in MODES}
    same = {m: {"int16": 0, "float": 0} for m in MODES}
    count = 0
    for w in wins:
        first = len(w) // 2
        target = torch.tensor(w[first:])
        logits = {}
        for m in MODES:
            emu.mode = m
            set_activation_precision("int8" if m == "int8" else "int16")
            lg = prefill_logits(engine, w)[first - 1:-1].float()
            logits[m] = lg
            nll[m] -= float(torch.log_softmax(lg, -1).gather(-1, target[:, None]).double().sum())
        top = {m: lg.argmax(-1) for m, lg in logits.items()}
        for m in MODES:
            for ref in ("int16", "float"):
                same[m][ref] += int((top[m] == top[ref]).sum())
        count += len(target)
    emu.mode = "int16"
    set_activation_precision("int16")
    return {m: {"perplexity": math.exp(nll[m] / count), "top1_vs_int16": same[m]["int16"] / count,
                "top1_vs_float": same[m]["float"] / count} for m in MODES} | {"positions": count}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_MODEL, help="a GGUF file the default mode runs on its blocks")
    ap.add_argument("--text", type=Path, help="a plain-text file (e.g. tinyshakespeare.txt)")
    ap.add_argument("--code", type=Path, help="a folder whose .py files, concatenated, are the code text")
    ap.add_argument("--windows", type=int, default=16, help="windows scored per text (default 16)")
    ap.add_argument("--window-len", type=int, default=512, help="tokens per window (default 512)")
    ap.add_argument("--json", type=Path, help="also write the figures here")
    a = ap.parse_args()
    texts = {}
    if a.text:
        texts["text"] = a.text.read_text(errors="replace")
    if a.code:
        texts["code"] = "\n\n".join(p.read_text(errors="replace") for p in sorted(a.code.rglob("*.py")))
    if not texts:
        ap.error("give --text FILE and/or --code DIR")
    llm = LLM(a.model, kv_cache_memory="64MiB", max_model_len=max(1024, a.window_len))
    engine = llm.engine
    if engine.quantization != "gguf":
        ap.error(f"{a.model} runs as {engine.quantization!r} here, not on the integer kernels")
    engine.runner.model.set_layer_fusion(False)
    emu = Emulation()
    out = {"model": str(a.model)}
    for name, text in texts.items():
        ids = engine.tokenizer.encode(text, add_special_tokens=False)
        wins = windows(ids, a.windows, a.window_len)
        out[name] = r = score(engine, emu, wins)
        print(f"\n{name}: {len(wins)} windows of {a.window_len}, {r['positions']} positions scored")
        print(f"{'activations':<16} {'perplexity':>10} {'vs int16':>9} {'top-1 = int16':>14} {'top-1 = float':>14}")
        for m in MODES:
            x = r[m]
            rel = x["perplexity"] / r["int16"]["perplexity"] - 1
            print(f"{m:<16} {x['perplexity']:>10.4f} {100 * rel:>+8.2f}% {100 * x['top1_vs_int16']:>13.2f}% "
                  f"{100 * x['top1_vs_float']:>13.2f}%")
    if a.json:
        a.json.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
