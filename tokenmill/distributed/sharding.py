"""Which slice of each weight tensor-parallel rank r holds, and the checks that a model splits.

Megatron's layout, as vLLM runs it: q/k/v and gate/up are column-parallel (each rank holds whole heads,
a slice of the MLP width: their output rows), o_proj and down_proj row-parallel (the matching input
columns; one all-reduce each sums the partial outputs), the embedding and output head vocab-parallel
(rows of the vocabulary padded up to a multiple of T). Where there are fewer KV heads than ranks, each
rank holds the one KV head its query heads use (replicated). OLMoE's q/k norms over all heads are split
with their heads (the mean square is summed over ranks). Other norms and everything else are whole.

Mixture of experts: by default each expert is split like a dense MLP (its gate/up rows and down columns,
a slice of its width on every rank); with ``--enable-expert-parallel`` rank r holds whole experts
``expert_range`` and no others. The router is whole on every rank. With the default dispatch
(``--all2all-backend allreduce``) every rank routes every token (the hidden states are replicated after
the attention's all-reduce), the shared expert is split like a dense MLP, and one all-reduce sums the
layer's partial outputs, as for a dense MLP. With ``--all2all-backend alltoall`` (expert parallelism
only) each rank routes its share of the tokens and all-to-alls carry them to their experts' ranks and
back (layers/moe.py); the shared expert is then whole on every rank (``whole_shared_expert``), run over
the rank's own share, so that it needs no all-reduce of its own.

The same slices apply to float tensors (``shard_weight``, before load_weights) and to a GGUF file's
quantized blocks (``shard_quantized``, before quantize_model): rows are rows; columns are whole blocks.
"""

from __future__ import annotations

import dataclasses
import re

import torch

from tokenmill.config import ModelConfig

QK = 32  # the block width of q8_0 / q4_1 (and of the int8 / int4 modes)
QK_K = 256  # a K-quant super-block
K_QUANT_PREFIXES = ("q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "q8_k", "iq")


def block_width(fmt: str) -> int:
    return QK_K if fmt.lower().startswith(K_QUANT_PREFIXES) else QK


def padded_vocab(vocab_size: int, t: int) -> int:
    return -(-vocab_size // t) * t


def _sizes_that_work(cfg: ModelConfig, quantized: bool, expert_parallel: bool) -> list[int]:
    return [t for t in range(1, cfg.num_heads + 1) if not _problem(cfg, t, quantized, expert_parallel)]


def _has_dense_mlp(cfg: ModelConfig) -> bool:
    return not cfg.num_experts or bool(cfg.dense_layers)


def _problem(cfg: ModelConfig, t: int, quantized: bool, expert_parallel: bool = False) -> str | None:
    h, hkv, d, inter = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size
    if h % t:
        return f"the model's {h} query heads do not divide by --tensor-parallel-size {t}"
    if hkv % t and t % hkv:
        return (f"the model's {hkv} KV heads neither divide by --tensor-parallel-size {t} nor divide it (KV heads "
                "are split over ranks, or replicated when there are fewer than ranks)")
    if cfg.qk_norm == "all" and hkv % t:
        return (f"a q/k norm over all heads ({cfg.architecture}) needs the {hkv} KV heads split over the ranks, "
                f"not replicated: they do not divide by --tensor-parallel-size {t}")
    if _has_dense_mlp(cfg) and inter % t:
        return f"the model's MLP width (intermediate size {inter}) does not divide by --tensor-parallel-size {t}"
    if cfg.num_experts:
        if expert_parallel and cfg.num_experts % t:
            return (f"expert parallelism gives each rank whole experts: the model's {cfg.num_experts} experts do "
                    f"not divide by --tensor-parallel-size {t}")
        if not expert_parallel and cfg.moe_intermediate_size % t:
            return (f"each expert's width ({cfg.moe_intermediate_size}) does not divide by --tensor-parallel-size "
                    f"{t} (--enable-expert-parallel splits the experts instead)")
        if cfg.shared_expert_intermediate_size % t:
            return (f"the shared expert's width ({cfg.shared_expert_intermediate_size}) does not divide by "
                    f"--tensor-parallel-size {t}")
    if quantized:  # (experts and the shared expert stay float: models/quantize.py)
        for what, k in (("o_proj", h * d), ("down_proj", inter)):
            if what == "down_proj" and not _has_dense_mlp(cfg):
                continue
            if (k // t) % QK:
                return (f"quantized row-parallel weights shard their input on whole {QK}-weight blocks: {what}'s "
                        f"{k} inputs / {t} ranks = {k // t}, not a multiple of {QK}")
    return None


def check_tensor_parallel(cfg: ModelConfig, t: int, quantized: bool, expert_parallel: bool = False) -> None:
    """Raise a ValueError saying what does not divide (and which sizes would) if the model cannot run
    on ``t`` tensor-parallel ranks. ``quantized``: the decoder weights will be in 32-weight blocks."""
    if t == 1:
        return
    why = _problem(cfg, t, quantized, expert_parallel)
    if why:
        ok = [s for s in _sizes_that_work(cfg, quantized, expert_parallel) if s > 1]
        hint = (f"use --tensor-parallel-size {' or '.join(map(str, ok))}" if ok else
                "this model cannot be split; use --tensor-parallel-size 1")
        if quantized and not _problem(cfg, t, False, expert_parallel):
            hint += " (or --quantization none)"
        raise ValueError(f"{why}: {hint}")


def local_config(cfg: ModelConfig, t: int, expert_parallel: bool = False) -> ModelConfig:
    """The per-rank view of the decoder layers: its query heads, KV heads and MLP widths (the vocabulary,
    hidden size and router stay whole: the embedding and head pad and split the vocabulary themselves;
    under expert parallelism each expert keeps its width and the rank holds ``expert_range``)."""
    if t == 1:
        return cfg
    dense = cfg.intermediate_size // t if _has_dense_mlp(cfg) else cfg.intermediate_size
    return dataclasses.replace(cfg, num_heads=cfg.num_heads // t, num_kv_heads=max(cfg.num_kv_heads // t, 1),
                               intermediate_size=dense,
                               moe_intermediate_size=cfg.moe_intermediate_size // (1 if expert_parallel else t),
                               shared_expert_intermediate_size=cfg.shared_expert_intermediate_size // t)


def dispatches_all_to_all(tp) -> bool:
    """Whether a MoE layer on TPGroup ``tp`` sends its tokens to the experts' ranks by all-to-all
    (``--enable-expert-parallel --all2all-backend alltoall`` over more than one rank; layers/moe.py)."""
    return (tp is not None and tp.size > 1 and not getattr(tp, "pipeline", False)
            and getattr(tp, "expert_parallel", False) and getattr(tp, "all2all_backend", "allreduce") == "alltoall")


def expert_range(num_experts: int, rank: int, t: int, expert_parallel: bool) -> tuple[int, int]:
    """[first, last) of the experts rank ``rank`` holds: all of them, or its 1/T under expert parallelism."""
    if not expert_parallel:
        return 0, num_experts
    return rank * num_experts // t, (rank + 1) * num_experts // t


# an expert's matrix: one expert's (checkpoints; Mixtral's w1/w3/w2) or all stacked (transformers 5)
_EXPERT_NAME = re.compile(r"layers\.\d+\.(?:mlp|block_sparse_moe)\.experts\."
                          r"(?:(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight|(gate_up_proj|down_proj))$")


def holds_weight(name: str, cfg: ModelConfig, rank: int, t: int, expert_parallel: bool) -> bool:
    """Whether rank ``rank`` loads tensor ``name`` at all (under expert parallelism: only its experts')."""
    m = _EXPERT_NAME.search(name)
    if not expert_parallel or m is None or m.group(1) is None:
        return True
    first, last = expert_range(cfg.num_experts, rank, t, True)
    return first <= int(m.group(1)) < last


def _slice(n: int, rank: int, t: int) -> tuple[int, int]:
    return rank * n // t, (rank + 1) * n // t


def _expert_spec(m: re.Match, cfg: ModelConfig, rank: int, t: int, expert_parallel: bool):
    """How rank ``rank`` slices an expert's matrix (see _spec)."""
    one, part, stacked = m.groups()
    if expert_parallel:  # whole experts: one expert's matrix whole, the stacked ones on their expert axis
        return None if one is not None else (0, [expert_range(cfg.num_experts, rank, t, True)])
    width = _slice(cfg.moe_intermediate_size, rank, t)
    if one is not None:  # gate/up: output rows; down: input columns
        return (1, [width]) if part in ("down_proj", "w2") else (0, [width])
    return (1, [width, width]) if stacked == "gate_up_proj" else (2, [width])  # [E, 2I, H] / [E, H, I]


def _spec(name: str, cfg: ModelConfig, rank: int, t: int, expert_parallel: bool = False,
          whole_shared_expert: bool = False) -> tuple[int, list[tuple[int, int]]] | None:
    """How rank ``rank`` slices HF tensor ``name``: (dim, [(start, stop) per fused part, in the part's own
    coordinates]) or None for a whole tensor. dim 0: output rows; 1: input columns. ``whole_shared_expert``:
    Qwen2-MoE's shared expert stays whole (the all-to-all dispatch: ``dispatches_all_to_all``)."""
    h, hkv, d, inter = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size
    expert = _EXPERT_NAME.search(name)
    if expert is not None:
        return _expert_spec(expert, cfg, rank, t, expert_parallel)
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
    if parts[-3] == "shared_expert":  # Qwen2-MoE's shared expert: a dense MLP of its own width
        if whole_shared_expert:
            return None
        mlp = _slice(cfg.shared_expert_intermediate_size, rank, t)
    rows = {"q_proj": [q], "k_proj": [kv], "v_proj": [kv], "qkv_proj": [q, kv, kv],  # qkv: Phi-3's fused
            "gate_proj": [mlp], "up_proj": [mlp], "gate_up_proj": [mlp, mlp]}
    if cfg.qk_norm == "all":  # OLMoE: the norms' weights go with their heads
        rows.update(q_norm=[q], k_norm=[kv])
    if module in rows:
        return 0, rows[module]
    if module in ("o_proj", "down_proj") and parts[-1] == "weight":
        return 1, [q if module == "o_proj" else mlp]
    return None


def _part_sizes(name: str, cfg: ModelConfig) -> list[int]:
    if name.endswith("experts.gate_up_proj"):
        return [cfg.moe_intermediate_size] * 2
    if ".qkv_proj." in name:
        return [cfg.num_heads * cfg.head_dim] + [cfg.num_kv_heads * cfg.head_dim] * 2
    if ".gate_up_proj." in name:
        return [cfg.intermediate_size] * 2
    return []


def shard_weight(name: str, w: torch.Tensor, cfg: ModelConfig, rank: int, t: int,
                 expert_parallel: bool = False, whole_shared_expert: bool = False) -> torch.Tensor:
    """Rank ``rank``'s slice of float tensor ``name`` (HF naming; cfg is the whole model's)."""
    spec = _spec(name, cfg, rank, t, expert_parallel, whole_shared_expert)
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
    blocks (32 weights, 256 for a K-quant super-block), refused with a clear error where they are not. (Its
    slices are made as ``type(qt)``: this package sits below layers/.)"""
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
        return type(qt)(data[:, a // w * per: b // w * per].contiguous(), qt.fmt, (n, b - a))
    sizes = _part_sizes(name, cfg)
    parts = list(data.split(sizes, dim=0)) if len(ranges) > 1 else [data]
    out = []
    for p, (a, b) in zip(parts, ranges):
        if b > p.shape[0]:  # vocabulary padding: all-zero blocks are zero weights in every GGUF format
            p = torch.cat([p, torch.zeros((b - p.shape[0], p.shape[1]), dtype=p.dtype)], dim=0)
        out.append(p[a:b])
    rows = torch.cat(out, dim=0).contiguous()
    return type(qt)(rows, qt.fmt, (rows.shape[0], k))
