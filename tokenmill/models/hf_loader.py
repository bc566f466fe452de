"""Read a Hugging Face model folder: config.json and *.safetensors."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch

from tokenmill.config import ModelConfig

_ARCHS = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2"}


def hf_model_config(folder: Path, file_name: str = "config.json") -> ModelConfig:
    folder = Path(folder)
    try:
        cfg = json.loads((folder / file_name).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read {folder / file_name}: {e}") from None
    model_type = cfg.get("model_type")
    if model_type not in _ARCHS:
        raise ValueError(f"model_type {model_type!r} is not supported (supported: {', '.join(_ARCHS)})")
    # transformers >= 5 keeps RoPE settings in rope_parameters; older configs use rope_theta/rope_scaling.
    rope = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
    heads = cfg["num_attention_heads"]
    arch = _ARCHS[model_type]
    try:
        return ModelConfig(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))),
            rope_scaling=scaling,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=arch == "qwen2" or bool(cfg.get("attention_bias", False)),
        )
    except KeyError as e:
        raise ValueError(f"{folder / file_name} lacks the key {e.args[0]!r}") from None


def hf_weights(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import SafetensorError
    from safetensors.torch import safe_open

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors files in {folder} (PyTorch .bin checkpoints are not supported)")
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as st:
                for name in st.keys():
                    yield name, st.get_tensor(name).float()
        except SafetensorError as e:  # damaged or truncated file
            raise ValueError(f"{f} is not a readable safetensors file ({e})") from None
