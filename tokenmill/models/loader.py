"""Build a model and its tokenizer from a ModelSource."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tokenmill.config import ModelConfig
from tokenmill.distributed.pipeline import check_pipeline_parallel, model_stage_layers, stage_name
from tokenmill.distributed.sharding import (check_tensor_parallel, dispatches_all_to_all, holds_weight,
                                            shard_quantized, shard_weight)
from tokenmill.layers.backends import get_backend
from tokenmill.layers.kernels import cpu_kernels, unavailable_reason
from tokenmill.models.bert import ENCODER_TYPES, EncoderModel
from tokenmill.models.gguf_loader import (gguf_layers_quantized, gguf_model_config, gguf_quantized_weights,
                                          gguf_weights, open_gguf, release_file_pages)
from tokenmill.models.hf_loader import hf_model_config, hf_weights
from tokenmill.models.llama import LlamaForCausalLM
from tokenmill.models.quantize import kept_weight_names, panel_model, quantize_model
from tokenmill.models.registry import ModelSource
from tokenmill.tokenizer import Tokenizer

logger = logging.getLogger("tokenmill")


@dataclass
class LoadedModel:
    model: LlamaForCausalLM
    config: ModelConfig
    tokenizer: Tokenizer
    max_model_len: int
    quantization: str  # the --quantization mode in effect ("auto" resolved)


def resolve_quantization(mode: str, reader, device: torch.device, dtype: torch.dtype) -> str:
    """--quantization auto: keep a quantized GGUF file's own blocks (``gguf``) where the integer CPU
    kernels run them, which is llama.cpp's behaviour and on this class of CPU the fastest path by far
    (bandwidth-bound decode reads 4-8x fewer bytes); otherwise float weights (``none``)."""
    if mode != "auto":
        return mode
    fast = device.type == "cpu" and dtype == torch.float32 and cpu_kernels() is not None
    return "gguf" if reader is not None and fast and gguf_layers_quantized(reader) else "none"


def model_config_of(source: ModelSource) -> ModelConfig:
    """The model's architecture, read without loading its weights."""
    if source.format == "gguf":
        return gguf_model_config(open_gguf(source.path))
    return hf_model_config(source.path)


def load_model(source: ModelSource, dtype: torch.dtype, device: torch.device, max_model_len: int | None = None,
               attention_backend: str = "auto", quantization: str = "none",
               phase: Callable[[str], None] = lambda name: None, tp=None) -> LoadedModel:
    """phase(name) is called as each startup phase ends (tokenizer, weights). ``tp`` (a TPGroup): load
    this tensor-parallel rank's shard (distributed/sharding.py)."""
    raw = reader = None
    one_rank = tp is None or tp.size == 1  # an untied embedding runs on its blocks (not sharded by vocabulary)
    if source.format == "gguf":
        reader = open_gguf(source.path)
        cfg = gguf_model_config(reader)
        tokenizer = Tokenizer.from_gguf(reader)
    else:
        cfg = hf_model_config(source.path)
        tokenizer = Tokenizer.from_hf_folder(source.path)
        weights = hf_weights(source.path, cfg)
    phase("tokenizer")
    if cfg.architecture in ENCODER_TYPES and quantization == "auto":
        quantization = "none"  # encoders run float weights (a quantized file is dequantized)
    quantization = resolve_quantization(quantization, reader, device, dtype)
    if reader is not None:
        if quantization == "gguf":  # (not a GGUF file: quantize_model says what to do)
            raw = gguf_quantized_weights(reader, cfg)
        kept = kept_weight_names(raw, cfg.num_layers, cfg.tie_word_embeddings, one_rank) if raw else ()
        weights = gguf_weights(reader, cfg, frozenset(kept))
    group = tp  # the model's: its stage under pipeline parallelism; tp becomes the stage's tensor group
    if tp is not None and tp.size > 1 and tp.pipeline:  # this stage's layers, renumbered from 0
        check_pipeline_parallel(cfg, tp.num_stages)
        first, last = model_stage_layers(cfg, tp.stage, tp.num_stages)
        weights = ((new, w) for n, w in weights if (new := stage_name(n, first, last)) is not None)
        if raw:
            raw = raw.remap(lambda n: stage_name(n, first, last))
        tp = tp.tensor
    if tp is not None and tp.size > 1:
        rank, size, ep, whole = tp.rank, tp.size, tp.expert_parallel, dispatches_all_to_all(tp)
        check_tensor_parallel(cfg, size, quantized=quantization != "none", expert_parallel=ep)
        weights = ((n, w if w is None else shard_weight(n, w, cfg, rank, size, ep, whole))
                   for n, w in weights if holds_weight(n, cfg, rank, size, ep))
        if raw:
            raw = raw.remap(lambda n: n, lambda n, q: shard_quantized(n, q, cfg, rank, size))
    elif group is not None and not group.pipeline:
        group = None
    if max_model_len is not None and max_model_len > cfg.max_position_embeddings:
        raise ValueError(f"max_model_len {max_model_len} exceeds the model's context length "
                         f"{cfg.max_position_embeddings}")
    max_model_len = max_model_len or cfg.max_position_embeddings
    # Built in the compute dtype: each checkpoint tensor is converted as it is copied in, so a bf16
    # checkpoint run in bf16 never takes float32 memory (RoPE tables are float32 whatever the default).
    # On the CPU in float32 every mode runs the kernels (fused elementwise ops, paged attention, and for
    # none float32 GEMMs in one summation order): batch invariant whatever the weights.
    kernels = device.type == "cpu" and dtype == torch.float32 and cpu_kernels() is not None
    if cfg.architecture in ENCODER_TYPES:
        return _load_encoder(cfg, weights, tokenizer, max_model_len, quantization, device, dtype, kernels, tp, phase)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        model = LlamaForCausalLM(cfg, get_backend(attention_backend, kernels), max_model_len, group)
    finally:
        torch.set_default_dtype(default)
    model.load_weights(weights)
    quantize_model(model, quantization, raw, embedding=one_rank,
                   after_weight=(lambda: release_file_pages(reader)) if reader is not None else (lambda: None))
    if quantization != "none" and (device.type != "cpu" or cpu_kernels() is None):
        why = f"the device is {device}" if device.type != "cpu" else unavailable_reason()
        logger.warning("--quantization %s: no quantized kernels here (%s); weights are dequantized on first "
                       "use, so they take float memory", quantization, why)
    model.to(device=device)  # (parameters are in the compute dtype already; RoPE tables stay float32)
    if kernels:
        if quantization == "none":
            panel_model(model, cpu_kernels())
        model.use_fused_ops(cpu_kernels())
    model.eval()
    if reader is not None:
        release_file_pages(reader)  # the weights live in the model's own tensors now
    phase("weights")
    return LoadedModel(model, cfg, tokenizer, max_model_len, quantization)


def _load_encoder(cfg: ModelConfig, weights, tokenizer: Tokenizer, max_model_len: int, quantization: str,
                  device: torch.device, dtype: torch.dtype, kernels: bool, tp, phase) -> LoadedModel:
    """A BERT-family encoder (models/bert.py): float weights, one rank."""
    if quantization != "none":
        raise ValueError(f"--quantization {quantization}: encoder models ({cfg.architecture}) run float weights; "
                         "use --quantization none (or auto)")
    if tp is not None and tp.size > 1:
        raise ValueError(f"{cfg.architecture} encoders run on one rank: drop --tensor-parallel-size and "
                         "--pipeline-parallel-size")
    model = EncoderModel(cfg)
    model.load_weights(weights)
    model.to(device=device, dtype=dtype)
    if kernels:
        model.panel(cpu_kernels())
    model.eval()
    phase("weights")
    return LoadedModel(model, cfg, tokenizer, max_model_len, quantization)
