"""Read a GGUF file: architecture config and weights under Hugging Face names.

Quantized tensors (Q4_0 ... Q8_0, the K-quants Q2_K ... Q6_K) are dequantized with the ``gguf``
package's reference routines; ``gguf_quantized_weights`` hands the kernels the blocks they run. llama.cpp's converter permutes Llama q/k weights for its interleaved
RoPE; we undo that so the rotate-half RoPE of the Hugging Face layout applies.
"""

from __future__ import annotations

import mmap
import warnings
from collections.abc import Callable, Iterator, Mapping

import numpy as np
import torch

from tokenmill.config import ModelConfig
from tokenmill.models.bert import encoder_gguf_config, encoder_gguf_name
from tokenmill.models.gguf_reader import GGUFError, open_gguf  # noqa: F401 -- re-exported
from tokenmill.models.rope_config import gguf_rope_fields, tensor_values

# (Mistral's files say "llama")
SUPPORTED_ARCHS = ("llama", "qwen2", "qwen3", "gemma2", "gemma3", "phi3", "smollm3", "bert")
_PERMUTED = ("llama", "smollm3")  # where llama.cpp's converter permutes q/k rows for its interleaved RoPE
_ROPE_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")  # (read as config)
FLOAT_TYPES = ("F32", "F16", "BF16")
# Every type gguf-py dequantizes that llama.cpp's quantize recipes write for weights (the K_M/K_S mixes
# included). IQ* (importance-matrix codebooks), TQ* and MXFP4 are refused with this list.
SUPPORTED_TYPES = (*FLOAT_TYPES, "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_q_norm": "self_attn.q_norm",  # Qwen3
    "attn_k_norm": "self_attn.k_norm",
    "attn_qkv": "self_attn.qkv_proj",  # Phi-3: fused in the checkpoint already
}
# where a family names a tensor differently: Gemma 2/3's four norms, Phi-3's fused gate/up (its "ffn_up")
_ARCH_LAYER_NAMES = {
    "gemma2": {"post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
               "post_ffw_norm": "post_feedforward_layernorm"},
    "phi3": {"ffn_up": "mlp.gate_up_proj"},
}
_ARCH_LAYER_NAMES["gemma3"] = _ARCH_LAYER_NAMES["gemma2"]
_GEMMA = ("gemma2", "gemma3")
# llama.cpp's enum llama_pooling_type: 0 none, 1 mean, 2 cls, 3 last (4, rank, is a classifier: refused)
_GGUF_POOLING = {1: "mean", 2: "cls", 3: "last"}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def _file_view(data: np.ndarray) -> torch.Tensor:
    """A uint8 tensor over a tensor's bytes in the file's memory map, not a copy. Read-only: nothing may
    write to it (torch warns that it cannot enforce that; every user here reads it once and copies)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(data.view(np.uint8).reshape(-1))


def release_file_pages(reader) -> None:
    """Drop this process's mapping of the file's pages (madvise DONTNEED: they stay in the page cache,
    and are read back from it if a tensor is looked at again). Weights were copied into the model's
    own layout, so they would only count twice in resident memory."""
    base = reader.data
    while base is not None and not isinstance(base, np.memmap):
        base = base.base
    mm = getattr(base, "_mmap", None)
    if mm is not None and hasattr(mm, "madvise"):
        mm.madvise(mmap.MADV_DONTNEED)


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def gguf_model_config(reader) -> ModelConfig:
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise GGUFError(f"GGUF architecture {arch!r} is not supported (supported: {', '.join(SUPPORTED_ARCHS)})")

    def need(key: str):
        v = _field(reader, f"{arch}.{key}")
        if v is None:
            raise GGUFError(f"GGUF file lacks the metadata key {arch}.{key}")
        return v

    hidden, heads = int(need("embedding_length")), int(need("attention.head_count"))
    tensors = {t.name for t in reader.tensors}
    vocab = _field(reader, f"{arch}.vocab_size")
    if vocab is None:
        if "tokenizer.ggml.tokens" not in reader.fields:
            raise GGUFError(f"GGUF file has no tokenizer (tokenizer.ggml.tokens) and no {arch}.vocab_size")
        vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    pooling = _gguf_pooling(int(_field(reader, f"{arch}.pooling_type", 0) or 0))
    if arch == "bert":  # an encoder (models/bert.py)
        extra = {"vocab_size": vocab, "token_type_count": _field(reader, "tokenizer.ggml.token_type_count")}
        try:
            return encoder_gguf_config(lambda k: extra[k] if k in extra else _field(reader, f"bert.{k}"), pooling)
        except ValueError as e:
            raise GGUFError(str(e)) from None
    layers, gemma = int(need("block_count")), arch in _GEMMA
    head_dim = int(_field(reader, f"{arch}.attention.key_length", hidden // heads))
    try:
        rope = gguf_rope_fields(lambda key: _field(reader, f"{arch}.{key}"), arch, head_dim, layers,
                                int(need("context_length")), lambda name: tensor_values(reader, name))
    except (KeyError, TypeError, ValueError) as e:
        raise GGUFError(f"GGUF RoPE metadata: {e}") from None
    # llama.cpp's Gemma 2/3 scale: 1/sqrt(head_dim), except the 27Bs (46, 62 layers) which use hidden/heads
    big = {"gemma2": 46, "gemma3": 62}.get(arch) == layers
    query_scale = ((hidden // heads if big else head_dim) ** -0.5) if gemma else None
    return ModelConfig(
        architecture=arch,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(need("feed_forward_length")),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=int(_field(reader, f"{arch}.attention.head_count_kv", heads)),
        head_dim=head_dim,
        rms_norm_eps=float(need("attention.layer_norm_rms_epsilon")),
        **rope,
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias="blk.0.attn_q.bias" in tensors or "blk.0.attn_qkv.bias" in tensors,
        qk_norm=_qk_norm(reader, head_dim),
        layer_windows=_windows(reader, arch, layers, rope["max_position_embeddings"]),
        hidden_act="gelu_tanh" if gemma else "silu",
        sandwich_norms=gemma,
        embed_scale=hidden ** 0.5 if gemma else 1.0,
        query_scale=query_scale,
        attn_logit_softcap=_field(reader, f"{arch}.attn_logit_softcapping") if gemma else None,
        final_logit_softcap=_field(reader, f"{arch}.final_logit_softcapping") if gemma else None,
        pooling_type=pooling,
    )


def _windows(reader, arch: str, layers: int, context: int) -> tuple[int, ...]:
    """Each layer's sliding window, by llama.cpp's rules: Gemma 2 slides on even layers, Gemma 3 on five of
    every six (or as attention.sliding_window_pattern says: a period, or a flag per layer), other families
    on every layer. A window as long as the context never bites: dropped (full attention)."""
    window = int(_field(reader, f"{arch}.attention.sliding_window", 0) or 0)
    if not window or window >= context:
        return ()
    pattern = _field(reader, f"{arch}.attention.sliding_window_pattern", {"gemma2": 2, "gemma3": 6}.get(arch, 1))
    if isinstance(pattern, (list, tuple)):
        if len(pattern) != layers:
            raise GGUFError(f"GGUF {arch}.attention.sliding_window_pattern has {len(pattern)} entries for {layers} "
                            "layers")
        return tuple(window if slides else 0 for slides in pattern)
    n = int(pattern)  # llama.cpp's set_swa_pattern(n): the last layer of every n attends globally
    return tuple(window if n <= 1 or i % n < n - 1 else 0 for i in range(layers))


def _gguf_pooling(kind: int) -> str:
    if kind == 4:
        raise GGUFError("GGUF pooling_type 4 (rank: a reranker's classification head) is not supported; a decoder "
                        "reranker that scores a yes/no token runs from its generative file with --task score "
                        "--classifier-from-token no,yes")
    return _GGUF_POOLING.get(kind, "")


def _qk_norm(reader, head_dim: int) -> str:
    """"head" where the q norm is one head wide (Qwen3), "all" where it spans every head, "" without one."""
    t = next((t for t in reader.tensors if t.name == "blk.0.attn_q_norm.weight"), None)
    return "" if t is None else "head" if int(t.shape[0]) == head_dim else "all"


def _hf_name(gguf_name: str, arch: str = "llama") -> str | None:
    parts = gguf_name.split(".")
    if parts[0] == "blk":
        base = _ARCH_LAYER_NAMES.get(arch, {}).get(parts[2]) or _LAYER_NAMES.get(parts[2])
        return None if base is None else f"model.layers.{parts[1]}.{base}.{parts[3]}"
    base = _TOP_NAMES.get(parts[0])
    return None if base is None else f"{base}.{parts[1]}"


def _undo_rope_permute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    # llama.cpp stored rows per head as interleaved pairs; regroup them into two halves.
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def dequantize(t) -> torch.Tensor:
    """A GGUF tensor as float32, in PyTorch's [out, in] order."""
    import gguf

    kind = t.tensor_type.name
    if kind not in SUPPORTED_TYPES:
        raise GGUFError(f"tensor {t.name} has GGUF type {kind}, not supported (supported: {', '.join(SUPPORTED_TYPES)})")
    shape = tuple(int(x) for x in reversed(t.shape))  # GGUF lists dims fastest-first
    arr = gguf.quants.dequantize(t.data, t.tensor_type)
    return torch.from_numpy(np.array(arr, dtype=np.float32).reshape(shape))  # np.array: own, writable copy


def gguf_weights(reader, cfg: ModelConfig,
                 skip: frozenset[str] = frozenset()) -> Iterator[tuple[str, torch.Tensor | None]]:
    """Every tensor as float32 under its Hugging Face name; those named in ``skip`` (kept as quantized
    blocks, so never read as floats) come as None: not dequantized, not copied anywhere."""
    for t in reader.tensors:
        name = encoder_gguf_name(t.name) if cfg.architecture == "bert" else _hf_name(t.name, cfg.architecture)
        if name is None:
            if t.name in _ROPE_TENSORS:
                continue
            raise GGUFError(f"GGUF tensor {t.name!r} is not understood for architecture {cfg.architecture}")
        if name in skip:
            yield name, None
            continue
        w = dequantize(t)
        if cfg.architecture in _PERMUTED and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = cfg.num_heads if "q_proj" in name else cfg.num_kv_heads
            if w.shape[0] != heads * cfg.head_dim:  # else the un-permute's reshape fails obscurely
                raise GGUFError(f"GGUF tensor {t.name!r} has shape {tuple(w.shape)}, expected "
                                f"{heads * cfg.head_dim} rows ({heads} heads x {cfg.head_dim})")
            w = _undo_rope_permute(w, heads)
        yield name, w


# --quantization gguf runs these on their own blocks, exactly (layers/quant.py): Q8_0, Q4_1, Q5_0, Q4_K,
# Q5_K and Q6_K as they are (the weights take the file's bytes), Q4_0 as Q4_1 (m = -8 d). Any other
# quantized type (Q5_1, Q2_K, Q3_K) is dequantized and quantized to Q8_0.
KEPT_TYPES = {"Q8_0": "q8_0", "Q4_1": "q4_1", "Q4_0": "q4_1", "Q5_0": "q5_0", "Q4_K": "q4_k", "Q5_K": "q5_k",
              "Q6_K": "q6_k"}


def gguf_layers_quantized(reader) -> bool:
    """Whether every 2-D weight of the decoder layers is stored quantized (a Q4_K_M or Q8_0 file, say, not
    an F16 one): --quantization auto then runs the file's blocks."""
    types = [t.tensor_type.name for t in reader.tensors if t.name.startswith("blk.") and len(t.shape) == 2]
    return bool(types) and not any(k in FLOAT_TYPES for k in types)


class LazyBlocks(Mapping):
    """Name -> QuantizedTensor, each made when it is looked up (and not kept): the model's layout is built
    from one tensor at a time, so a conversion's copy (Q4_0 -> Q4_1, q/k un-permuted rows) never sits
    beside every other tensor's. Membership costs nothing; look a tensor up once."""

    def __init__(self, makers: dict[str, Callable[[], object]]) -> None:
        self._makers = makers

    def __getitem__(self, name: str):
        return self._makers[name]()

    def __iter__(self):
        return iter(self._makers)

    def __len__(self) -> int:
        return len(self._makers)

    def remap(self, fn: Callable[[str], str | None], convert: Callable[[str, object], object] | None = None):
        """Renamed by fn (None drops a tensor) and, when made, converted by convert(old name, tensor)."""
        out = {}
        for name, make in self._makers.items():
            new = fn(name)
            if new is not None:
                out[new] = make if convert is None else (lambda make=make, name=name: convert(name, make()))
        return LazyBlocks(out)


def gguf_quantized_weights(reader, cfg: ModelConfig) -> LazyBlocks:
    """The 2-D tensors stored in a KEPT_TYPES type, as QuantizedTensors under their Hugging Face names, in
    the kernels' formats (converted as KEPT_TYPES says; q/k rows un-permuted like the float path); each is
    made when looked up (LazyBlocks), over the file's mapped bytes where nothing is converted."""
    makers = {}
    for t in reader.tensors:
        name = encoder_gguf_name(t.name) if cfg.architecture == "bert" else _hf_name(t.name, cfg.architecture)
        if t.tensor_type.name in KEPT_TYPES and name is not None and len(t.shape) == 2:
            makers[name] = lambda t=t, name=name: _quantized(t, name, cfg)
    return LazyBlocks(makers)


def _quantized(t, name: str, cfg: ModelConfig):
    from tokenmill.layers.quant import QuantizedTensor, q4_0_to_q4_1

    kind = t.tensor_type.name
    k, n = (int(x) for x in t.shape)  # GGUF lists dims fastest-first
    raw = _file_view(t.data).reshape(n, -1)  # no copy: the kernel layout made from it is the only one
    if kind == "Q4_0":
        try:
            raw = q4_0_to_q4_1(raw, k)
        except ValueError as e:
            raise GGUFError(f"tensor {t.name}: {e}; load it with --quantization int8 or none") from None
    if cfg.architecture in _PERMUTED and name.endswith(("q_proj.weight", "k_proj.weight")):
        raw = _undo_rope_permute(raw, cfg.num_heads if "q_proj" in name else cfg.num_kv_heads)
    return QuantizedTensor(raw.contiguous(), KEPT_TYPES[kind], (n, k))
