"""Encoder models for embeddings and cross-encoder scores: BERT, RoBERTa and XLM-RoBERTa (bidirectional
attention, absolute position embeddings, post-layer LayerNorm), as transformers' BertModel and RobertaModel lay
them out, with a sequence-classification head where the checkpoint has one (BERT's pooler and classifier,
RoBERTa's dense and out_proj: the cross-encoders behind /v1/score and /v1/rerank).

They run behind the same scheduler and runner as the decoders: each request's prompt is one whole prefill chunk
(the builder turns chunked prefill and the prefix cache off for an encoder: every token attends to every other,
so no part of a prompt can be computed before the rest), attention is per request over its own tokens, and no KV
is kept. On the CPU kernels the linear layers are PanelLinear (fixed-order float32 GEMMs), so a request's vector
is the same bits alone or batched."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.config import ModelConfig

ENCODER_TYPES = ("bert", "roberta", "xlm-roberta")


def encoder_model_config(cfg: dict, pooling: dict) -> ModelConfig:
    """ModelConfig of a BERT-family config.json; ``pooling``: the sentence-transformers pooling fields, if any."""
    model_type = cfg["model_type"]
    act = cfg.get("hidden_act", "gelu")
    if act != "gelu":
        raise ValueError(f"{model_type} hidden activation {act!r} is not supported (supported: gelu)")
    archs = cfg.get("architectures") or ()
    classifier = any(a.endswith("ForSequenceClassification") for a in archs)
    labels = (len(cfg.get("id2label") or {}) or cfg.get("num_labels", 2)) if classifier else 0
    roberta = model_type != "bert"
    heads = cfg["num_attention_heads"]
    if not pooling:
        pooling = dict(pooling_type="cls", pooling_normalize=not classifier)
    return ModelConfig(
        architecture=model_type, vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"], num_layers=cfg["num_hidden_layers"], num_heads=heads,
        num_kv_heads=heads, head_dim=cfg["hidden_size"] // heads,
        # RoBERTa counts positions from padding_idx + 1, so its table has that many more rows than the context
        max_position_embeddings=cfg["max_position_embeddings"] - (cfg.get("pad_token_id", 1) + 1 if roberta else 0),
        rms_norm_eps=cfg.get("layer_norm_eps", 1e-12), hidden_act="gelu", tie_word_embeddings=True,
        type_vocab_size=cfg.get("type_vocab_size", 2),
        position_offset=cfg.get("pad_token_id", 1) + 1 if roberta else 0,
        num_labels=labels, classifier_head=("roberta" if roberta else "bert") if classifier else "",
        **pooling)


# llama.cpp's names for a BERT GGUF's tensors (its converter's BertModel), and ours
_GGUF_TOP = {"token_embd": "embeddings.word_embeddings", "token_types": "embeddings.token_type_embeddings",
             "position_embd": "embeddings.position_embeddings", "token_embd_norm": "embeddings.LayerNorm"}
_GGUF_LAYER = {"attn_q": "attention.self.query", "attn_k": "attention.self.key", "attn_v": "attention.self.value",
               "attn_output": "attention.output.dense", "attn_output_norm": "attention.output.LayerNorm",
               "ffn_up": "intermediate.dense", "ffn_down": "output.dense", "layer_output_norm": "output.LayerNorm"}


def encoder_gguf_name(name: str) -> str | None:
    parts = name.split(".")
    if parts[0] == "blk":
        base = _GGUF_LAYER.get(parts[2])
        return None if base is None else f"encoder.layer.{parts[1]}.{base}.{parts[3]}"
    base = _GGUF_TOP.get(parts[0])
    return None if base is None else f"{base}.{parts[-1]}"


def encoder_gguf_config(field: Callable[[str], Any], pooling_type: str) -> ModelConfig:
    """ModelConfig of a BERT GGUF; ``field(key)`` reads ``bert.{key}`` (None where absent)."""
    def need(key: str):
        v = field(key)
        if v is None:
            raise ValueError(f"GGUF file lacks the metadata key bert.{key}")
        return v

    hidden, heads = int(need("embedding_length")), int(need("attention.head_count"))
    return ModelConfig(
        architecture="bert", vocab_size=int(need("vocab_size")), hidden_size=hidden,
        intermediate_size=int(need("feed_forward_length")), num_layers=int(need("block_count")), num_heads=heads,
        num_kv_heads=heads, head_dim=hidden // heads, max_position_embeddings=int(need("context_length")),
        rms_norm_eps=float(need("attention.layer_norm_epsilon")), hidden_act="gelu", tie_word_embeddings=True,
        type_vocab_size=int(field("token_type_count") or 2), pooling_type=pooling_type or "cls")


def _linear(n_in: int, n_out: int) -> nn.Linear:
    return nn.Linear(n_in, n_out, device="meta").to_empty(device="cpu")


class _Dense(nn.Module):  # BERT's "output" blocks: a linear layer, then LayerNorm over it plus the residual
    def __init__(self, n_in: int, n_out: int, eps: float) -> None:
        super().__init__()
        self.dense = _linear(n_in, n_out)
        self.LayerNorm = nn.LayerNorm(n_out, eps=eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(x) + residual)


class _SelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.query, self.key, self.value = _linear(h, h), _linear(h, h), _linear(h, h)


class _Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.add_module("self", _SelfAttention(cfg))  # (transformers' name)
        self.output = _Dense(cfg.hidden_size, cfg.hidden_size, cfg.rms_norm_eps)


class _Intermediate(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.dense = _linear(cfg.hidden_size, cfg.intermediate_size)


class BertLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attention = _Attention(cfg)
        self.intermediate = _Intermediate(cfg)
        self.output = _Dense(cfg.intermediate_size, cfg.hidden_size, cfg.rms_norm_eps)
        self.h, self.d = cfg.num_heads, cfg.head_dim

    def forward(self, x: torch.Tensor, spans: list[tuple[int, int]]) -> torch.Tensor:
        sa = self.attention.get_submodule("self")
        q, k, v = sa.query(x), sa.key(x), sa.value(x)
        o = torch.empty_like(q)
        for start, end in spans:  # each request attends over its own tokens only, in both directions
            qs, ks, vs = (t[start:end].view(end - start, self.h, self.d).transpose(0, 1) for t in (q, k, v))
            o[start:end] = F.scaled_dot_product_attention(qs, ks, vs).transpose(0, 1).reshape(end - start, -1)
        x = self.attention.output(o, x)
        return self.output(F.gelu(self.intermediate.dense(x)), x)


class _Embeddings(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.word_embeddings = nn.Embedding(cfg.vocab_size, h, _weight=torch.empty(cfg.vocab_size, h))
        rows = cfg.max_position_embeddings + cfg.position_offset
        self.position_embeddings = nn.Embedding(rows, h, _weight=torch.empty(rows, h))
        self.token_type_embeddings = nn.Embedding(cfg.type_vocab_size, h, _weight=torch.empty(cfg.type_vocab_size, h))
        self.LayerNorm = nn.LayerNorm(h, eps=cfg.rms_norm_eps)


class _Encoder(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(cfg) for _ in range(cfg.num_layers))


class _Pooler(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.dense = _linear(cfg.hidden_size, cfg.hidden_size)


class _RobertaHead(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.dense = _linear(cfg.hidden_size, cfg.hidden_size)
        self.out_proj = _linear(cfg.hidden_size, cfg.num_labels)


class _NoBackend:
    reads_only_written_slots = True  # no KV is kept: the pool the engine allocates is never touched


class EncoderModel(nn.Module):
    """A BERT-family encoder over a flat batch of whole prompts: ``forward`` returns the final hidden states of
    the rows asked for (no logits: it has no language-model head)."""

    is_encoder = True

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = self.whole_cfg = cfg
        self.embeddings = _Embeddings(cfg)
        self.encoder = _Encoder(cfg)
        self.attention_backend = _NoBackend()
        if cfg.classifier_head == "bert":
            self.pooler = _Pooler(cfg)
            self.classifier_layer = _linear(cfg.hidden_size, cfg.num_labels)
        elif cfg.classifier_head == "roberta":
            self.classifier_layer = _RobertaHead(cfg)
        self.requires_grad_(False)

    @property
    def classifier(self):
        """The sequence-classification head over a pooled ([CLS]) hidden state, or None (an embedder)."""
        if not self.cfg.classifier_head:
            return None
        if self.cfg.classifier_head == "bert":
            return lambda x: self.classifier_layer(torch.tanh(self.pooler.dense(x)))
        head = self.classifier_layer
        return lambda x: head.out_proj(torch.tanh(head.dense(x)))

    def forward(self, input_ids, positions, kv_caches, meta, logits_indices, hidden_indices=None, token_types=None):
        e = self.embeddings
        # (RoBERTa has one token type: its pairs are told apart by separators alone)
        types = torch.zeros_like(input_ids) if token_types is None or self.cfg.type_vocab_size < 2 else token_types
        x = (e.word_embeddings(input_ids) + e.position_embeddings(positions + self.cfg.position_offset)
             + e.token_type_embeddings(types))
        x = e.LayerNorm(x)
        spans = [(p.start, p.end) for p in meta.prefills] + [(i, i + 1) for i in range(meta.num_decodes)]
        for layer in self.encoder.layer:
            x = layer(x, spans)
        logits = x.new_zeros(len(logits_indices), 0)
        return logits if hidden_indices is None else (logits, x[hidden_indices].float())

    def panel(self, ops) -> None:
        """Every linear layer a PanelLinear (float32, the same bits for a row whatever the batch)."""
        from tokenmill.layers.panel_linear import PanelLinear

        for name, m in list(self.named_modules()):
            if isinstance(m, nn.Linear):
                owner, _, attr = name.rpartition(".")
                setattr(self.get_submodule(owner) if owner else self, attr, PanelLinear(m.weight.data, m.bias, ops))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """transformers' names (a ``bert.``/``roberta.`` prefix on a classifier's encoder); the pooler of a
        checkpoint without a classifier is unused and skipped."""
        params = dict(self.named_parameters())
        loaded = set()
        for name, t in weights:
            name = name.removeprefix("bert.").removeprefix("roberta.").removeprefix("model.")
            if name.endswith("position_ids") or (name.startswith("pooler.") and not hasattr(self, "pooler")):
                continue
            if name.startswith("classifier."):
                name = "classifier_layer." + name.removeprefix("classifier.")
            if name.startswith("lm_head."):
                continue  # a masked-LM head: not used for embeddings
            if name not in params:
                raise ValueError(f"checkpoint tensor {name!r} has no place in the {self.cfg.architecture} encoder")
            if tuple(params[name].shape) != tuple(t.shape):
                raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(t.shape)}, expected "
                                 f"{tuple(params[name].shape)}")
            params[name].data.copy_(t)
            loaded.add(name)
        missing = set(params) - loaded
        if missing:
            raise ValueError(f"checkpoint is incomplete: missing {sorted(missing)[:8]}")
