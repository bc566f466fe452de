"""``tokenmill inspect MODEL``: what a .gguf file or Hugging Face folder is, read from its headers without
loading the weights: family, size, tensor types, context length, tokenizer and chat template, and the
--quantization mode tokenmill would run it in on this machine."""

from __future__ import annotations

import argparse
import json
import math
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gguf import GGUFReader

    from tokenmill.config import ModelConfig


def describe(model: str) -> dict:
    from tokenmill.models.registry import resolve_model

    source = resolve_model(model)
    out = {"model": source.name, "path": str(source.path), "format": source.format}
    out.update(_gguf(source.path) if source.format == "gguf" else _hf(source.path))
    return out


def _auto_mode(reader: GGUFReader | None) -> str:
    """--quantization auto's choice for this file with the default --device and --dtype, on this machine."""
    from tokenmill.config import EngineConfig
    from tokenmill.layers.kernels import cpu_kernels
    from tokenmill.models.loader import resolve_quantization
    from tokenmill.platform import resolve_device, resolve_dtype

    device = resolve_device(EngineConfig().device)
    dtype = resolve_dtype("auto", device, cpu_kernels=device.type == "cpu" and cpu_kernels() is not None)
    return resolve_quantization("auto", reader, device, dtype)


def _gguf(path: Path) -> dict:
    from tokenmill.models.gguf_loader import SUPPORTED_TYPES, gguf_model_config, open_gguf

    reader = open_gguf(path)
    cfg = gguf_model_config(reader)
    tensors = [(t.name, t.tensor_type.name, [int(x) for x in reversed(t.shape)], int(t.n_elements), int(t.n_bytes))
               for t in reader.tensors]
    field = reader.fields.get("tokenizer.ggml.model")
    return {
        **_config(cfg),
        "parameters": sum(t[3] for t in tensors),
        "bytes": path.stat().st_size,
        "tensor_types": dict(Counter(t[1] for t in tensors).most_common()),
        "unsupported_types": sorted({t[1] for t in tensors} - set(SUPPORTED_TYPES)),
        "tokenizer": field.contents() if field is not None else None,
        "chat_template": "tokenizer.chat_template" in reader.fields,
        "quantization_auto": _auto_mode(reader),
        "tensors": [{"name": n, "type": k, "shape": s, "bytes": b} for n, k, s, _, b in tensors],
    }


def _hf(folder: Path) -> dict:
    from safetensors import safe_open

    from tokenmill.models.hf_loader import hf_model_config

    cfg = hf_model_config(folder)
    tensors, size = [], 0
    for f in sorted(folder.glob("*.safetensors")):
        size += f.stat().st_size
        with safe_open(str(f), "pt") as st:  # headers only
            for name in st.keys():
                piece = st.get_slice(name)
                shape = list(piece.get_shape())
                tensors.append({"name": name, "type": piece.get_dtype(), "shape": shape, "elements": math.prod(shape)})
    config = folder / "tokenizer_config.json"
    template = (folder / "chat_template.jinja").is_file() or (
        config.is_file() and bool(json.loads(config.read_text()).get("chat_template")))
    return {
        **_config(cfg),
        "parameters": sum(t["elements"] for t in tensors),
        "bytes": size,
        "tensor_types": dict(Counter(t["type"] for t in tensors).most_common()),
        "unsupported_types": [],
        "tokenizer": next((n for n in ("tokenizer.json", "tokenizer.model") if (folder / n).is_file()), None),
        "chat_template": template,
        "quantization_auto": _auto_mode(None),
        "tensors": [{k: v for k, v in t.items() if k != "elements"} for t in tensors],
    }


def _config(cfg: ModelConfig) -> dict:
    return {"architecture": cfg.architecture, "layers": cfg.num_layers, "hidden_size": cfg.hidden_size,
            "heads": cfg.num_heads, "kv_heads": cfg.num_kv_heads, "vocab_size": cfg.vocab_size,
            "context_length": cfg.max_position_embeddings, "tied_embeddings": cfg.tie_word_embeddings,
            "features": _features(cfg)}


def _features(cfg: ModelConfig) -> list[str]:
    """What this family adds to a Llama decoder, in words."""
    out = ["q/k/v bias"] if cfg.attention_bias else []
    out += [{"head": "q/k RMSNorm per head", "all": "q/k RMSNorm"}[cfg.qk_norm]] if cfg.qk_norm else []
    out += [f"q/k/v clipped at {cfg.clip_qkv:g}"] if cfg.clip_qkv else []
    if cfg.num_experts:
        moe = [f"{cfg.num_experts} experts, top {cfg.num_experts_per_tok}"]
        moe += [f"shared expert {cfg.shared_expert_intermediate_size} wide"] if cfg.shared_expert_intermediate_size else []
        moe += [f"{len(cfg.dense_layers)} dense layers"] if cfg.dense_layers else []
        out.append("mixture of experts: " + ", ".join(moe))
    windowed = [w for w in cfg.layer_windows if w]
    if windowed:
        out.append(f"sliding window {max(windowed)} on {len(windowed)} of {cfg.num_layers} layers")
    out += _rope_features(cfg)
    out += ["sandwich norms"] if cfg.sandwich_norms else []
    out += ["GELU (tanh) MLP"] if cfg.hidden_act == "gelu_tanh" else []
    out += [f"embedding scale {cfg.embed_scale:.4g}"] if cfg.embed_scale != 1.0 else []
    out += [f"attention scale {cfg.query_scale:.4g}"] if cfg.query_scale is not None else []
    out += [f"attention logit soft cap {cfg.attn_logit_softcap:g}"] if cfg.attn_logit_softcap else []
    out += [f"final logit soft cap {cfg.final_logit_softcap:g}"] if cfg.final_logit_softcap else []
    if cfg.type_vocab_size:  # a BERT-family encoder (models/bert.py)
        out.append("encoder: bidirectional attention, absolute positions, GELU")
    if cfg.classifier_head:
        out.append(f"cross-encoder ({cfg.num_labels} label{'s' * (cfg.num_labels != 1)}): serves --task score")
    elif cfg.pooling_type:
        out.append(f"embedder: {cfg.pooling_type} pooling{', normalised' if cfg.pooling_normalize else ''}: "
                   "serves --task embed")
    return out


def _rope_features(cfg: ModelConfig) -> list[str]:
    """How the model's RoPE differs from plain RoPE over whole heads with one base."""
    out = [f"partial RoPE: {cfg.rotary_dim} of {cfg.head_dim} dims"] if cfg.rotary_dim else []
    s = cfg.rope_scaling or {}
    kind, factor, orig = s.get("rope_type"), s.get("factor"), s.get("original_max_position_embeddings")
    if kind == "longrope":
        out.append(f"RoPE longrope: short/long factors, original context {orig} (the long ones where "
                   "max_model_len passes it)")
    elif kind == "freq_factors":
        out.append("RoPE frequency factors (rope_freqs, Llama 3.1)")
    elif kind:
        name = {"dynamic": "dynamic NTK"}.get(kind, kind)
        out.append(f"RoPE {name} x{float(factor):g}" + (f" of {orig} positions" if orig else "")
                   + (" (base fixed by max_model_len)" if kind == "dynamic" else "")
                   + (" on the global layers" if cfg.rope_local_base_freq is not None else ""))
    if cfg.rope_local_base_freq is not None:
        local = sum(1 for i in range(cfg.num_layers) if cfg.rope_kind(i) == "local")
        out.append(f"RoPE base {cfg.rope_local_base_freq:g} on the {local} sliding-window layers, "
                   f"{cfg.rope_theta:g} on the others")
    nope = sum(1 for flag in cfg.no_rope_layers if not flag)
    out += [f"no RoPE on {nope} of {cfg.num_layers} layers"] if nope else []
    return out


def render(d: dict, tensors: bool) -> str:
    size = f"{d['parameters'] / 1e6:.1f}M parameters, {d['bytes'] / 2**20:.1f} MiB"
    lines = [f"{d['model']}: {d['format']} ({d['path']})",
             f"  {d['architecture']}: {d['layers']} layers, hidden {d['hidden_size']}, {d['heads']} heads / "
             f"{d['kv_heads']} KV heads, vocabulary {d['vocab_size']}, context {d['context_length']} tokens"
             f"{', tied embeddings' if d['tied_embeddings'] else ''}",
             *([f"  features: {', '.join(d['features'])}"] if d.get("features") else []),
             f"  {size}; tensor types: " + ", ".join(f"{k} x{v}" for k, v in d["tensor_types"].items()),
             f"  tokenizer: {d['tokenizer'] or 'none found'}; chat template: {'yes' if d['chat_template'] else 'no'}",
             f"  --quantization auto runs it as: {d['quantization_auto']} (on this machine)"]
    if d["unsupported_types"]:
        lines.append(f"  not loadable here: tensors in {', '.join(d['unsupported_types'])}")
    if tensors:
        lines += [f"    {t['name']:<40} {t['type']:<6} {t['shape']}" for t in d["tensors"]]
    return "\n".join(lines)


def add_inspect_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None,
                   help="a .gguf file, a Hugging Face folder, or a known alias (default: the embedded model)")
    p.add_argument("--tensors", action="store_true", help="list every tensor with its type and shape")
    p.add_argument("--json", action="store_true", help="print the description as JSON")


def cmd_inspect(a: argparse.Namespace) -> int:
    from tokenmill.models.registry import DEFAULT_MODEL

    d = describe(a.model or DEFAULT_MODEL)
    if a.json:
        if not a.tensors:
            d.pop("tensors")
        print(json.dumps(d, indent=1))
    else:
        print(render(d, a.tensors))
    return 0
