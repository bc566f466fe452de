"""Swap a loaded model's linear layers (and output head) for quantized ones (--quantization), or, for
``none`` on the CPU kernels, for float32 ones in one summation order (``panel_model``).

``int8``/``int4`` quantize the float weights; ``gguf`` keeps the file's own blocks where they are in
a kept format (fused q/k/v and gate/up need all parts in one format, or in formats that convert to one
of them exactly: Q5_0 into Q8_0, Q4_K into Q5_K) and quantizes the rest to Q8_0. Embedding lookups stay
float: they read one row per token, not the whole matrix.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from tokenmill.layers.panel_linear import PanelLinear
from tokenmill.layers.quant import (QUANTIZATIONS, QuantizedEmbedding, QuantizedLinear, QuantizedTensor, StackedLinear,
                                    cat_rows, common_format, quantize_weight, to_format)

logger = logging.getLogger("tokenmill")

# fused module -> the Hugging Face weights it stacks, in order
_FUSED = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
          "self_attn.o_proj": ("self_attn.o_proj",),
          "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
          "mlp.down_proj": ("mlp.down_proj",)}


def _part_names(raw: dict, i: int, path: str, sources: tuple[str, ...]) -> list[str]:
    """The checkpoint weights fused module ``path`` of layer i stacks: the module's own name where the file
    stores it fused already (Phi-3's attn_qkv and gate/up), else its parts."""
    fused = f"model.layers.{i}.{path}.weight"
    return [fused] if fused in raw else [f"model.layers.{i}.{s}.weight" for s in sources]


def _paths(layer) -> dict[str, tuple[str, ...]]:
    """The fused linear layers of a decoder layer this module swaps. A mixture-of-experts MLP keeps its
    experts, router and shared expert as they are (float: no quantized expert kernels yet)."""
    from tokenmill.layers.moe import SparseMoE

    if isinstance(layer.mlp, SparseMoE):
        return {p: s for p, s in _FUSED.items() if not p.startswith("mlp.")}
    return _FUSED


def _keeps(parts: list[QuantizedTensor | None]) -> bool:
    """Whether gguf mode uses the file's own blocks for a (fused) layer: all parts kept (in one format, in
    formats one of them holds exactly -- a Q5_0 q/k with a Q8_0 v runs all as Q8_0 -- or, where none does,
    as groups side by side: _groups)."""
    return all(p is not None for p in parts)


def _groups(parts: list[QuantizedTensor]) -> list[QuantizedTensor]:
    """Consecutive parts merged while one of their formats holds them all exactly: [q, k, v] in Q4_K, Q4_K,
    Q6_K -> [q|k in Q4_K, v in Q6_K]."""
    groups = [[parts[0]]]
    for p in parts[1:]:
        if common_format(q.fmt for q in [*groups[-1], p]) is not None:
            groups[-1].append(p)
        else:
            groups.append([p])
    out = []
    for g in groups:
        fmt = common_format(p.fmt for p in g)
        g = [to_format(p, fmt) for p in g]
        out.append(cat_rows(g) if len(g) > 1 else g[0])
    return out


def kept_weight_names(raw: dict[str, QuantizedTensor], num_layers: int, tied: bool = False,
                      embedding: bool = False) -> set[str]:
    """The float weights quantize_model(mode="gguf") never reads, because their blocks are kept; the
    loader need not dequantize them. A tied embedding kept as the head's blocks is looked up from them
    (QuantizedEmbedding), so it is not read as floats either; nor, with ``embedding`` (quantize_model's
    flag), an untied one kept in its own blocks."""
    names = set()
    for i in range(num_layers):
        for path, sources in _FUSED.items():
            parts = _part_names(raw, i, path, sources)
            if all(n in raw for n in parts):  # (membership: raw may make its tensors when looked up)
                names.update(parts)
    if "lm_head.weight" in raw:
        names.add("lm_head.weight")
    if (tied or embedding) and "model.embed_tokens.weight" in raw:
        names.add("model.embed_tokens.weight")
    return names


def _pick(float_w: torch.Tensor, parts: list[QuantizedTensor | None],
          mode: str) -> tuple[list[QuantizedTensor], bool]:
    """(the weight to use, as groups of rows in one format each; whether it is the file's own blocks)."""
    if mode == "gguf" and _keeps(parts):
        return _groups(parts), True
    return [quantize_weight(float_w, mode)], False


def _layer(groups: list[QuantizedTensor], bias: torch.Tensor | None) -> QuantizedLinear | StackedLinear:
    return QuantizedLinear(groups[0], bias) if len(groups) == 1 else StackedLinear(groups, bias)


def quantize_model(model, mode: str, raw: dict[str, QuantizedTensor] | None = None,
                   after_weight: Callable[[], None] = lambda: None, embedding: bool = False) -> None:
    """Replace every decoder linear layer and the output head of ``model`` in place; after_weight() runs
    as each of them is built (the loader drops the file pages read for it: at most one matrix's pages are
    resident beside the model's own layout). ``embedding`` (gguf, an untied model on one rank): look tokens up in the file's embedding blocks
    where they are kept, instead of a float copy (the loader did not read one: kept_weight_names)."""
    if mode not in QUANTIZATIONS:
        raise ValueError(f"--quantization must be one of {', '.join(QUANTIZATIONS)}, got {mode!r}")
    if mode == "none":
        return
    if mode == "gguf" and raw is None:
        raise ValueError("--quantization gguf keeps a GGUF file's own quantized blocks: the model must be a "
                         ".gguf file; for a Hugging Face folder use int8 or int4")
    raw = raw or {}
    if model.cfg.hidden_size % 32 or model.cfg.intermediate_size % 32:
        raise ValueError("quantized weights need hidden and intermediate sizes divisible by 32")
    requantized = 0
    if model.cfg.num_experts:
        logger.warning("--quantization %s: the experts of a mixture-of-experts model stay in float; attention "
                       "and dense layers are quantized", mode)
    for i, layer in enumerate(model.layers):
        for path, sources in _paths(layer).items():
            owner_name, attr = path.rsplit(".", 1)
            owner = layer.get_submodule(owner_name)
            lin = getattr(owner, attr)
            parts = [raw.get(n) for n in _part_names(raw, i, path, sources)]
            qw, kept = _pick(lin.weight.data, parts, mode)
            requantized += mode == "gguf" and not kept
            setattr(owner, attr, _layer(qw, lin.bias))
            after_weight()
    head_name = "model.embed_tokens.weight" if model.lm_head is None else "lm_head.weight"
    head = model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
    qw, kept = _pick(head.data, [raw.get(head_name)], mode)
    requantized += mode == "gguf" and not kept
    model.head = QuantizedLinear(qw[0])
    after_weight()
    if kept and model.lm_head is None:  # the tied embedding is the head's own blocks: look rows up there
        model.embed_tokens = QuantizedEmbedding(model.head)
    elif mode == "gguf" and embedding and model.lm_head is not None and "model.embed_tokens.weight" in raw:
        model.embed_tokens = QuantizedEmbedding(QuantizedLinear(raw["model.embed_tokens.weight"]), own=True)
        after_weight()
    if requantized:
        logger.info("--quantization gguf: %d linear layers were not in a kept GGUF format and use Q8_0", requantized)


def panel_model(model, ops) -> None:
    """--quantization none on the CPU kernels: every decoder linear layer and the output head become a
    PanelLinear (float32, the same bits for a row whatever the batch). The embedding stays for lookups;
    a tied head gets its own panel copy of it."""
    for layer in model.layers:
        for path in _paths(layer):
            owner_name, attr = path.rsplit(".", 1)
            owner = layer.get_submodule(owner_name)
            lin = getattr(owner, attr)
            setattr(owner, attr, PanelLinear(lin.weight.data, lin.bias, ops))
    if model.lm_head is None:
        model.head = PanelLinear(model.embed_tokens.weight.data, None, ops)
    else:  # the untied head's weight lives in its panels only
        model.lm_head = model.head = PanelLinear(model.lm_head.weight.data, None, ops)


def quantized_weight_bytes(model) -> int:
    """Bytes of every quantized weight (what a decode step reads for them)."""
    return sum(m.qweight.numel() for m in model.modules() if isinstance(m, QuantizedLinear))
