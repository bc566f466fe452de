"""Which slice of each weight tensor-parallel rank r holds, and the checks that a model splits.

Megatron's layout, as vLLM runs it: q/k/v and gate/up are column-parallel (each rank holds whole heads,
a slice of the MLP width: their output rows), o_proj and down_proj row-parallel (the matching input
columns; one all-reduce each sums the partial outputs), the embedding and output head vocab-parallel
(rows of the vocabulary padded up to a multiple of T). Where there are fewer KV heads than ranks, each
rank holds the one KV head its query heads use (replicated). Norms and everything else are whole.

The same slices apply to float tensors (``shard_weight``, before load_weights) and to a GGUF file's
quantized blocks (``shard_quantized``, before quantize_model): rows are rows; columns are whole blocks.
"""

from __future__ import annotations

import dataclasses

import torch

from tokenmill.config import ModelConfig

QK = 32  # the block width of q8_0 / q4_1 (and of the int8 / int4 modes)
QK_K = 256  # a K-quant super-block
K_QUANT_PREFIXES = ("q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "q8_k", "iq")


def block_width(fmt: str) -> int:
    return QK_K if fmt.lower().startswith(K_QUANT_PREFIXES) else QK


def padded_vocab(vocab_size: int, t: int) -> int:
    return -(-vocab_size // t) * t


def _sizes_that_work(cfg: ModelConfig, quantized: bool) -> list[int]:
    return [t for t in range(1, cfg.num_heads + 1) if not _problem(cfg, t, quantized)]


def _problem(cfg: ModelConfig, t: int, quantized: bool) -> str | None:
    h, hkv, d, inter = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size
    if h % t:
        return f"the model's {h} query heads do not divide by --tensor-parallel-size {t}"
    if hkv % t and t % hkv:
        return (f"the model's {hkv} KV heads neither divide by --tensor-parallel-size {t} nor divide it (KV heads "
                "are split over ranks, or replicated when there are fewer than ranks)")
    if inter % t:
        return f"the model's MLP width (intermediate size {inter}) does not divide by --tensor-parallel-size {t}"
    if quantized:
        for what, k in (("o_proj", h * d), ("down_proj", inter)):
            if (k // t) % QK:
                return (f"quantized row-parallel weights shard their input on whole {QK}-weight blocks: {what}'s "
                        f"{k} inputs / {t} ranks = {k // t}, not a multiple of {QK}")
    return None


def check_tensor_parallel(cfg: ModelConfig, t: int, quantized: bool) -> None:
    """Raise a ValueError saying what does not divide (and which sizes would) if the model cannot run
    on ``t`` tensor-parallel ranks. ``quantized``: the decoder weights will be in 32-weight blocks."""
    if t == 1:
        return
    if cfg.num_experts:
        raise ValueError(f"--tensor-parallel-size {t}: {cfg.architecture} is a mixture-of-experts model, and "
                         "expert parallelism (and tensor-parallel experts) is not built yet; run it with "
                         "--tensor-parallel-size 1")
    if cfg.qk_norm == "all":
        raise ValueError(f"--tensor-parallel-size {t}: a q/k norm over all heads ({cfg.architecture}) needs a "
                         "cross-rank reduction that is not built yet; run it with --tensor-parallel-size 1")
    why = _problem(cfg, t, quantized)
    if why:
        ok = [s for s in _sizes_that_work(cfg, quantized) if s > 1]
        hint = (f"use --tensor-parallel-size {' or '.join(map(str, ok))}" if ok else
                "this model cannot be split; use --tensor-parallel-size 1")
        if quantized and not _problem(cfg, t, False):
            hint += " (or --quantization none)"
        raise ValueError(f"{why}: {hint}")


def local_config(cfg: ModelConfig, t: int) -> ModelConfig:
    """The per-rank view of the decoder layers: its query heads, KV heads and MLP width (the vocabulary
    and hidden size stay whole: the embedding and head pad and split the vocabulary themselves)."""
    if t == 1:
        return cfg
    return dataclasses.replace(cfg, num_heads=cfg.num_heads // t, num_kv_heads=max(cfg.num_kv_heads // t, 1),
                               intermediate_size=cfg.intermediate_size // t)


def _spec(name: str, cfg: ModelConfig, rank: int, t: int) -> tuple[int, list[tuple[int, int]]] | None:
    """How rank ``rank`` slices HF tensor ``name``: (dim, [(start, stop) per fused part, in the part's own
    coordinates]) or None for a whole tensor. dim 0: output rows; 1: input columns."""
    h, hkv, d, inter = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size
    q = (rank * h // t * d, (rank + 1) * h // t * d)
    if hkv >= t:
        kv = (rank * hkv // t * d, (rank + 1) * hkv // t * d)
    else:  # replicated: the KV head of this rank's query heads
        g = rank * hkv // t
        kv = (g * d, (g + 1) * d)
    mlp = (rank * inter // t, (rank + 1) * inter // t)
    v = padded_vocab(cfg.vocab_size, t) // t
    base = name.removeprefix("model.")
    if base in ("embed_tokens.weight", "lm_head.weight"):
        return 0, [(rank * v, (rank + 1) * v)]
    parts = base.split(".")
    if len(parts) < 4 or parts[0] != "layers":
        return None
    module = parts[-2]
    rows = {"q_proj": [q], "k_proj": [kv], "v_proj": [kv], "qkv_proj": [q, kv, kv],  # qkv: Phi-3's fused
            "gate_proj": [mlp], "up_proj": [mlp], "gate_up_proj": [mlp, mlp]}
    if module in rows:
        return 0, rows[module]
    if module in ("o_proj", "down_proj") and parts[-1] == "weight":
        return 1, [q if module == "o_proj" else mlp]
    return None


def _part_sizes(name: str, cfg: ModelConfig) -> list[int]:
    if ".qkv_proj." in name:
        return [cfg.num_heads * cfg.head_dim] + [cfg.num_kv_heads * cfg.head_dim] * 2
    if ".gate_up_proj." in name:
        return [cfg.intermediate_size] * 2
    return []


def shard_weight(name: str, w: torch.Tensor, cfg: ModelConfig, rank: int, t: int) -> torch.Tensor:
    """Rank ``rank``'s slice of float tensor ``name`` (HF naming; cfg is the whole model's)."""
    spec = _spec(name, cfg, rank, t)
    if spec is None or t == 1:
        return w
    dim, ranges = spec
    parts = w.split(_part_sizes(name, cfg), dim=dim) if len(ranges) > 1 else [w]
    out = []
    for p, (a, b) in zip(parts, ranges):
        if b > p.shape[dim]:  # the vocabulary's padding: zero rows past the end
            pad = torch.zeros((b - p.shape[dim], *p.shape[1:]), dtype=p.dtype)
            p = torch.cat([p, pad], dim=0)
        out.append(p.narrow(dim, a, b - a))
    return (torch.cat(out, dim=dim) if len(out) > 1 else out[0]).contiguous()


def shard_quantized(name: str, qt, cfg: ModelConfig, rank: int, t: int):
    """Rank ``rank``'s slice of a QuantizedTensor (layers/quant.py): rows are data rows; columns are whole
    blocks (32 weights, 256 for a K-quant super-block), refused with a clear error where they are not."""
    from tokenmill.layers.quant import QuantizedTensor

    spec = _spec(name, cfg, rank, t)
    if spec is None or t == 1:
        return qt
    dim, ranges = spec
    n, k = qt.shape
    data = qt.data
    if dim == 1:
        (a, b), = ranges
        w = block_width(qt.fmt)
        if a % w or b % w:
            raise ValueError(f"{name} ({qt.fmt}) cannot be split over {t} tensor-parallel ranks on whole "
                             f"{w}-weight blocks: each rank's {b - a} input columns start at {a}; use another "
                             "--tensor-parallel-size or --quantization none / int8")
        per = data.shape[1] * w // k  # bytes per block
        return QuantizedTensor(data[:, a // w * per: b // w * per].contiguous(), qt.fmt, (n, b - a))
    sizes = _part_sizes(name, cfg)
    parts = list(data.split(sizes, dim=0)) if len(ranges) > 1 else [data]
    out = []
    for p, (a, b) in zip(parts, ranges):
        if b > p.shape[0]:  # vocabulary padding: all-zero blocks are zero weights in every GGUF format
            p = torch.cat([p, torch.zeros((b - p.shape[0], p.shape[1]), dtype=p.dtype)], dim=0)
        out.append(p[a:b])
    rows = torch.cat(out, dim=0).contiguous()
    return QuantizedTensor(rows, qt.fmt, (rows.shape[0], k))
