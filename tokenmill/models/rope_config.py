"""RoPE settings as ModelConfig fields, read from a Hugging Face config.json or a GGUF file's metadata: the base
(and Gemma 3's second base for its sliding layers), the scaling as transformers spells it (completed with what
each type needs, so layers/rotary.py reads one dict whatever the source), the rotated share of each head, SmolLM3's
NoPE layers, and the context length the scaling gives (vLLM's rule: dynamic NTK and YaRN extend the original
context by their factor)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from tokenmill.layers.rotary import ROPE_TYPES

# transformers' default bases where a config names none
_DEFAULT_THETA = {"gemma3": 1_000_000.0, "smollm3": 2_000_000.0}


def _complete(scaling: dict | None, max_pos: int, arch: str) -> tuple[dict | None, int]:
    """The scaling dict with what its type needs filled in as transformers would (dynamic NTK's original context
    is the config's max_position_embeddings; YaRN's and longrope's factor defaults to the context over the
    original one), and the model's context length; refuses a type layers/rotary.py does not implement."""
    if not scaling:
        return None, max_pos
    scaling = dict(scaling)
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if arch == "phi3" and kind in ("su", "yarn"):  # what Phi3Config reads them as
        kind = "longrope"
    if kind == "freq_factors":  # (a GGUF file's rope_freqs tensor: Llama 3.1's scaling, computed already)
        return scaling, max_pos
    if kind not in ROPE_TYPES:
        raise ValueError(f"rope scaling {kind!r} is not supported (supported: {', '.join(ROPE_TYPES)})")
    scaling["rope_type"] = kind
    scaling.pop("type", None)
    if kind == "default":
        return None, max_pos
    if kind == "dynamic":
        scaling["original_max_position_embeddings"] = max_pos
        return scaling, int(max_pos * float(scaling["factor"]))
    if kind in ("yarn", "longrope"):
        orig = scaling.get("original_max_position_embeddings") or max_pos
        scaling["original_max_position_embeddings"] = orig
        if scaling.get("factor") is None:
            scaling["factor"] = max_pos / orig
        if kind == "yarn":
            return scaling, max(max_pos, int(orig * float(scaling["factor"])))
    return scaling, max_pos


def hf_rope_fields(cfg: dict, arch: str, head_dim: int, num_layers: int) -> dict:
    """ModelConfig's RoPE fields and max_position_embeddings from a config.json (transformers 5 keeps RoPE in
    rope_parameters, per layer type for Gemma 3; older configs use rope_theta / rope_scaling at the top)."""
    rope = cfg.get("rope_parameters") or {}
    local = None
    if "full_attention" in rope or "sliding_attention" in rope:  # per layer type (transformers 5's Gemma 3)
        sliding = rope.get("sliding_attention") or {}
        if sliding.get("rope_type", "default") != "default":
            raise ValueError(f"rope scaling {sliding['rope_type']!r} on the sliding-window layers is not supported "
                             "(the local layers take plain RoPE)")
        local, rope = sliding.get("rope_theta"), rope.get("full_attention") or {}
    if arch == "gemma3":
        local = local or cfg.get("rope_local_base_freq", 10_000.0)
    theta = rope.get("rope_theta", cfg.get("rope_theta", _DEFAULT_THETA.get(arch, 10_000.0)))
    scaling = cfg.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
    if scaling and scaling.get("original_max_position_embeddings") is None and cfg.get(
            "original_max_position_embeddings"):  # Phi-3's configs keep it at the top
        scaling = {**scaling, "original_max_position_embeddings": cfg["original_max_position_embeddings"]}
    scaling, context = _complete(scaling, cfg.get("max_position_embeddings", 2048), arch)
    partial = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    rotary = int(head_dim * partial)  # (transformers' rounding)
    no_rope = ()
    if arch == "smollm3":
        flags = cfg.get("no_rope_layers") or [
            int((i + 1) % cfg.get("no_rope_layer_interval", 4) != 0) for i in range(num_layers)]
        no_rope = tuple(int(f) for f in flags[:num_layers])
    return dict(rope_theta=float(theta), rope_scaling=scaling, rotary_dim=0 if rotary == head_dim else rotary,
                rope_local_base_freq=None if local is None else float(local), no_rope_layers=no_rope,
                max_position_embeddings=context)


def gguf_rope_fields(field: Callable[[str], Any], arch: str, head_dim: int, num_layers: int, context: int,
                     tensor: Callable[[str], Any]) -> dict:
    """The same from a GGUF file, the keys as llama.cpp's converter writes them: field(key) reads
    ``{arch}.{key}`` (None where absent), tensor(name) a tensor's values (None where absent). Phi-3's longrope
    comes as rope_factors_long/short tensors with rope.scaling.attn_factor; Llama 3.1's as rope_freqs; YaRN as
    rope.scaling.type yarn with its factor, original context and betas. Gemma 3's local base is llama.cpp's
    fixed 10000 (or rope.freq_base_swa); SmolLM3's NoPE step is llama.cpp's fixed 4 (no key carries either)."""
    scaling = None
    kind = field("rope.scaling.type")
    if kind == "linear":
        scaling = {"rope_type": "linear", "factor": float(field("rope.scaling.factor"))}
    elif kind == "yarn":
        scaling = {"rope_type": "yarn", "factor": float(field("rope.scaling.factor")),
                   "original_max_position_embeddings": int(field("rope.scaling.original_context_length") or context)}
        for key, name in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow"),
                          ("yarn_attn_factor", "attention_factor")):
            if field(f"rope.scaling.{key}") is not None:
                scaling[name] = float(field(f"rope.scaling.{key}"))
    elif kind not in (None, "none", "longrope"):
        raise ValueError(f"GGUF rope scaling {kind!r} is not supported (supported: linear, yarn, longrope "
                         "factor tensors, rope_freqs tensors)")
    freqs, long = tensor("rope_freqs.weight"), tensor("rope_factors_long.weight")
    if kind == "longrope" and long is None:
        raise ValueError("GGUF rope scaling 'longrope' without its rope_factors_long/short tensors is not supported")
    if freqs is not None:
        scaling = {"rope_type": "freq_factors", "factors": freqs}
    elif long is not None:
        short = tensor("rope_factors_short.weight")
        scaling = {"rope_type": "longrope", "long_factor": [float(x) for x in long],
                   "short_factor": [float(x) for x in (long if short is None else short)],
                   "original_max_position_embeddings": int(field("rope.scaling.original_context_length") or context)}
        scaling["factor"] = context / scaling["original_max_position_embeddings"]
        if field("rope.scaling.attn_factor") is not None:
            scaling["attention_factor"] = float(field("rope.scaling.attn_factor"))
    scaling, context = _complete(scaling, context, arch)
    rotary = int(field("rope.dimension_count") or head_dim)
    return dict(rope_theta=float(field("rope.freq_base") or _DEFAULT_THETA.get(arch, 10_000.0)),
                rope_scaling=scaling, rotary_dim=0 if rotary >= head_dim else rotary,
                rope_local_base_freq=float(field("rope.freq_base_swa") or 10_000.0) if arch == "gemma3" else None,
                no_rope_layers=tuple(int((i + 1) % 4 != 0) for i in range(num_layers)) if arch == "smollm3" else (),
                max_position_embeddings=context)


def tensor_values(reader, name: str) -> torch.Tensor | None:
    """A small float tensor's values (RoPE factors), or None where the file has no such tensor."""
    t = next((t for t in reader.tensors if t.name == name), None)
    return None if t is None else torch.from_numpy(np.array(t.data, dtype=np.float32).reshape(-1))
