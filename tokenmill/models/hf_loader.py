"""Read a Hugging Face model folder: config.json and *.safetensors."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch

from tokenmill.config import ModelConfig
from tokenmill.models.bert import ENCODER_TYPES, encoder_model_config
from tokenmill.models.rope_config import hf_rope_fields

_ARCHS = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "phi3", "smollm3", "mixtral", "qwen2_moe",
          "olmoe")
_GEMMA = ("gemma2", "gemma3")  # (a Gemma 3 text model's model_type is gemma3_text; it is "gemma3" here, as in GGUF)


def _moe(cfg: dict, model_type: str) -> dict:
    """ModelConfig's mixture-of-experts fields, by each family's config names and defaults."""
    if model_type == "mixtral":
        return dict(num_experts=cfg.get("num_local_experts", 8), num_experts_per_tok=cfg.get("num_experts_per_tok", 2),
                    moe_intermediate_size=cfg["intermediate_size"], norm_topk_prob=True)
    if model_type == "olmoe":
        return dict(num_experts=cfg.get("num_experts", 64), num_experts_per_tok=cfg.get("num_experts_per_tok", 8),
                    moe_intermediate_size=cfg["intermediate_size"], norm_topk_prob=cfg.get("norm_topk_prob", False))
    if model_type == "qwen2_moe":
        n, step = cfg["num_hidden_layers"], cfg.get("decoder_sparse_step", 1)
        dense = tuple(i for i in range(n) if i in cfg.get("mlp_only_layers", []) or (i + 1) % step)
        return dict(num_experts=cfg.get("num_experts", 60), num_experts_per_tok=cfg.get("num_experts_per_tok", 4),
                    moe_intermediate_size=cfg.get("moe_intermediate_size", 1408),
                    norm_topk_prob=cfg.get("norm_topk_prob", False),
                    shared_expert_intermediate_size=cfg.get("shared_expert_intermediate_size", 5632),
                    dense_layers=dense)
    return {}


def _pooling(folder: Path, cfg: dict) -> dict:
    """ModelConfig's pooling fields: a sentence-transformers folder's, or last-token pooling for a checkpoint
    saved without its language-model head (``Qwen3Model``: an embedder)."""
    found = sentence_transformers_pooling(Path(folder))
    if found is None and any(a.endswith("Model") for a in cfg.get("architectures") or ()):
        found = ("last", True)
    return {} if found is None else dict(pooling_type=found[0], pooling_normalize=found[1])


def _layer_windows(cfg: dict, model_type: str, num_layers: int, context: int) -> tuple[int, ...]:
    """Each layer's sliding window (0: full attention), by transformers' rules for each family. A window as
    long as the context never bites (Phi-4-mini's 262144): it is dropped, so the layer runs as full attention."""
    window = cfg.get("sliding_window") or 0
    if model_type == "smollm3" and not cfg.get("use_sliding_window"):
        window = 0
    types = cfg.get("layer_types")
    if types is None:
        if model_type == "gemma2":  # even layers slide, odd ones see everything
            types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)]
        elif model_type == "gemma3":  # five local layers, then a global one
            n = cfg.get("sliding_window_pattern", 6)
            types = ["sliding_attention" if (i + 1) % n else "full_attention" for i in range(num_layers)]
        elif model_type in ("qwen2", "qwen3", "qwen2_moe"):
            slide = cfg.get("use_sliding_window", False)
            first = cfg.get("max_window_layers", num_layers)
            types = ["sliding_attention" if slide and i >= first else "full_attention" for i in range(num_layers)]
        else:  # Mistral, Phi-3: sliding_window (when set) applies to every layer
            types = ["sliding_attention"] * num_layers
    if len(types) != num_layers:
        raise ValueError(f"layer_types has {len(types)} entries for {num_layers} layers")
    windows = tuple(window if t == "sliding_attention" and window < context else 0 for t in types)
    return windows if any(windows) else ()


def sentence_transformers_pooling(folder: Path) -> tuple[str, bool] | None:
    """(pooling type, normalize) from a sentence-transformers folder's modules.json and its Pooling module's
    config (Qwen3-Embedding, gte-Qwen2 ship these); None where the folder has no Pooling module."""
    try:
        modules = json.loads((folder / "modules.json").read_text())
        pooling = next(m for m in modules if m.get("type", "").endswith("Pooling"))
        cfg = json.loads((folder / pooling.get("path", "") / "config.json").read_text())
    except (OSError, json.JSONDecodeError, StopIteration, AttributeError):
        return None
    modes = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls"}
    chosen = [kind for key, kind in modes.items() if cfg.get(key)]
    if len(chosen) != 1:
        raise ValueError(f"{folder / pooling.get('path', '')} asks for pooling {cfg}: one of last-token, mean or "
                         "CLS pooling is supported")
    return chosen[0], any(m.get("type", "").endswith("Normalize") for m in modules)


def hf_model_config(folder: Path, file_name: str = "config.json") -> ModelConfig:
    folder = Path(folder)
    try:
        cfg = json.loads((folder / file_name).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read {folder / file_name}: {e}") from None
    model_type = cfg.get("model_type")
    if model_type == "gemma3" and "text_config" in cfg:
        raise ValueError("model_type 'gemma3' is Gemma 3's multimodal checkpoint, which is not supported; its "
                         "text-only variants (model_type gemma3_text, Gemma3ForCausalLM) are")
    if model_type in ENCODER_TYPES:  # BERT-family embedders and cross-encoders
        try:
            return encoder_model_config(cfg, _pooling(folder, {}))
        except KeyError as e:
            raise ValueError(f"{folder / file_name} lacks the key {e.args[0]!r}") from None
    if model_type not in _ARCHS:
        raise ValueError(f"model_type {model_type!r} is not supported (supported: "
                         f"{', '.join(_ARCHS + ENCODER_TYPES)})")
    model_type = {"gemma3_text": "gemma3"}.get(model_type, model_type)
    if cfg.get("use_bidirectional_attention"):
        raise ValueError(f"{model_type} with use_bidirectional_attention (an encoder, EmbeddingGemma) is not "
                         "supported: decoders attend causally")
    gemma = model_type in _GEMMA
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu"
    acts = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}
    if act not in acts:
        raise ValueError(f"hidden activation {act!r} is not supported (supported: {', '.join(acts)})")
    heads = cfg["num_attention_heads"]
    try:
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        rope = hf_rope_fields(cfg, model_type, head_dim, cfg["num_hidden_layers"])
        return ModelConfig(
            architecture=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            **rope,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", gemma)),
            attention_bias=model_type in ("qwen2", "qwen2_moe") or bool(cfg.get("attention_bias", False)),
            qk_norm={"qwen3": "head", "gemma3": "head", "olmoe": "all"}.get(model_type, ""),
            clip_qkv=cfg.get("clip_qkv") if model_type == "olmoe" else None,
            layer_windows=_layer_windows(cfg, model_type, cfg["num_hidden_layers"], rope["max_position_embeddings"]),
            hidden_act=acts[act],
            sandwich_norms=gemma,
            embed_scale=cfg["hidden_size"] ** 0.5 if gemma else 1.0,
            query_scale=cfg.get("query_pre_attn_scalar", 256) ** -0.5 if gemma else None,
            attn_logit_softcap=cfg.get("attn_logit_softcapping") if gemma else None,
            final_logit_softcap=cfg.get("final_logit_softcapping") if gemma else None,
            **_moe(cfg, model_type),
            **_pooling(folder, cfg),
        )
    except KeyError as e:
        raise ValueError(f"{folder / file_name} lacks the key {e.args[0]!r}") from None


def hf_weights(folder: Path, cfg: ModelConfig | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor in its stored dtype (bf16 stays bf16), read one at a time from the memory-mapped
    files: the model copies each into its own parameters (converting to the compute dtype there), so
    the host never holds a float32 copy of the checkpoint. Gemma's norms are stored as offsets from 1
    (transformers multiplies by 1 + w): they come back as the multipliers, as llama.cpp's converter
    writes them into GGUF files."""
    from safetensors import SafetensorError
    from safetensors.torch import safe_open

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors files in {folder} (PyTorch .bin checkpoints are not supported)")
    norm_offset = cfg is not None and cfg.architecture in _GEMMA
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as st:
                for name in st.keys():
                    t = st.get_tensor(name)
                    if norm_offset and name.endswith("norm.weight"):
                        t = t.float() + 1
                    yield name, t
        except SafetensorError as e:  # damaged or truncated file
            raise ValueError(f"{f} is not a readable safetensors file ({e})") from None
