"""Tiny random models for loader tests: a small byte-level BPE tokenizer, Hugging Face folders
written with transformers' own save_pretrained, and GGUF files written with gguf.GGUFWriter the
way llama.cpp's converter lays them out.
"""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path

import numpy as np
import torch

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world, hello tokenmill! The loader reads GGUF files and Hugging Face folders.",
    "def f(x):\n    return x * 2\n",
    "Once upon a time, in a land far away, there lived a tiny model with random weights.",
    "1, 2, 3, 5, 8, 13, 21, 34, 55",
] * 4
VOCAB_SIZE = 320


@functools.cache
def tokenizer_json() -> str:
    """A byte-level BPE (GPT-2 style) of VOCAB_SIZE tokens: 3 specials, 256 bytes, the rest merges."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    assert tok.get_vocab_size() == VOCAB_SIZE, tok.get_vocab_size()
    return tok.to_str()


def hf_tokenizer():
    from tokenizers import Tokenizer

    return Tokenizer.from_str(tokenizer_json())


def write_tokenizer_files(folder: Path) -> None:
    (folder / "tokenizer.json").write_text(tokenizer_json())
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|endoftext|>", "eos_token": "<|im_end|>", "tokenizer_class": "PreTrainedTokenizerFast"}))


BERT_SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


@functools.cache
def bert_tokenizer_json() -> str:
    """A WordPiece tokenizer with BERT's template ([CLS] a [SEP] b [SEP], the second segment type 1)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    tok.train_from_iterator(CORPUS, trainers.WordPieceTrainer(vocab_size=200, special_tokens=BERT_SPECIALS,
                                                              show_progress=False))
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
                                                       special_tokens=[("[CLS]", cls), ("[SEP]", sep)])
    return tok.to_str()


def random_bert(kind: str = "bert", seed: int = 0, classifier: bool = False):
    """A tiny transformers BertModel / XLMRobertaModel (or its ForSequenceClassification, one label), every
    parameter random."""
    import transformers

    vocab = json.loads(bert_tokenizer_json())["model"]["vocab"]
    common = dict(vocab_size=len(vocab), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, max_position_embeddings=128, pad_token_id=0)
    if kind == "bert":
        config, base, head = (transformers.BertConfig(**common), transformers.BertModel,
                              transformers.BertForSequenceClassification)
    else:
        config, base, head = (transformers.XLMRobertaConfig(**common, type_vocab_size=1),
                              transformers.XLMRobertaModel, transformers.XLMRobertaForSequenceClassification)
    config.num_labels = 1
    torch.manual_seed(seed)
    model = (head if classifier else base)(config).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "LayerNorm" in name and name.endswith("weight"):
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            elif name.endswith("bias"):
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / (p.shape[-1] ** 0.5 if p.dim() > 1 else 1))
    return model


def save_bert_folder(model, folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(folder), safe_serialization=True)
    (folder / "tokenizer.json").write_text(bert_tokenizer_json())
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "BertTokenizerFast"}))
    return folder


def gguf_tokenizer_fields() -> tuple[list[str], list[int], list[str]]:
    """tokens, token_type (1 normal, 3 control) and merges as llama.cpp stores a gpt2 tokenizer."""
    spec = json.loads(tokenizer_json())
    vocab = spec["model"]["vocab"]
    tokens = [None] * len(vocab)
    for t, i in vocab.items():
        tokens[i] = t
    types = [3 if t in SPECIAL_TOKENS else 1 for t in tokens]
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    return tokens, types, merges


# ---- Hugging Face models ----------------------------------------------------------------

BASE = dict(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5)


# What a tiny model of each family needs beyond BASE: head_dim where the config's default is a big
# model's, a sliding window shorter than the test prompts so that it matters, soft caps small enough to
# bite on random weights, and a pad id inside the tiny vocabulary.
FAMILY_DEFAULTS = {
    "qwen3": {"head_dim": 16},
    "mistral": {"head_dim": 16, "sliding_window": 8},
    "gemma2": {"head_dim": 16, "query_pre_attn_scalar": 24, "sliding_window": 8, "attn_logit_softcapping": 5.0,
               "final_logit_softcapping": 10.0, "pad_token_id": 0},
    "phi3": {"sliding_window": 8, "pad_token_id": 0},
    # Gemma 3: six layers (five local, one global), the global one's RoPE linearly scaled as the 4B+ models'
    "gemma3": {"head_dim": 16, "query_pre_attn_scalar": 24, "sliding_window": 8, "final_logit_softcapping": 10.0,
               "num_hidden_layers": 6, "rope_parameters": {
                   "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
                   "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}}},
    # SmolLM3: four layers, the fourth without RoPE
    "smollm3": {"num_hidden_layers": 4, "pad_token_id": 0, "bos_token_id": 0, "eos_token_id": 2,
                "tie_word_embeddings": False},
    # mixtures of 8 experts, top 2 (Qwen2-MoE: top 4 of 8 with its shared expert and a dense layer)
    "mixtral": {"num_local_experts": 8, "num_experts_per_tok": 2},
    "qwen2_moe": {"num_experts": 8, "num_experts_per_tok": 4, "moe_intermediate_size": 32,
                  "shared_expert_intermediate_size": 96, "num_hidden_layers": 3, "mlp_only_layers": [1]},
    "olmoe": {"num_experts": 8, "num_experts_per_tok": 2, "pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 0},
}


def random_hf_model(arch: str = "llama", seed: int = 0, embed_std: float = 1.0, **overrides):
    """A transformers model from a tiny config, with every parameter (norms and biases too) random."""
    import transformers

    cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config,
           "mistral": transformers.MistralConfig, "gemma2": transformers.Gemma2Config,
           "phi3": transformers.Phi3Config, "mixtral": transformers.MixtralConfig,
           "gemma3": transformers.Gemma3TextConfig, "smollm3": transformers.SmolLM3Config,
           "qwen2_moe": transformers.Qwen2MoeConfig, "olmoe": transformers.OlmoeConfig}[arch]
    config = cls(**{**BASE, **FAMILY_DEFAULTS.get(arch, {}), **overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            elif name.endswith("bias"):
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
            elif "embed_tokens" in name:
                p.copy_(embed_std * torch.randn(p.shape, generator=g))
            else:  # [out, in]: unit-variance outputs, so logits are well separated for greedy decoding
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[1] ** 0.5)
    return model.eval()


def save_hf_folder(model, folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(folder), safe_serialization=True)
    write_tokenizer_files(folder)
    return folder


@torch.inference_mode()
def hf_logits(model, ids: list[int]) -> torch.Tensor:
    return model(torch.tensor([ids])).logits[0].float()


def _cache_kwargs(out) -> dict:
    # transformers 5.x renamed past_key_values to cache; accept either.
    cache = getattr(out, "cache", None)
    return {"cache": cache} if cache is not None else {"past_key_values": out.past_key_values}


@torch.inference_mode()
def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    """Greedy decoding with transformers' KV cache, one token per forward after the prompt."""
    out = model(torch.tensor([ids]), use_cache=True)
    tokens = []
    for i in range(n):
        nxt = int(out.logits[0, -1].argmax())
        tokens.append(nxt)
        if i + 1 < n:
            out = model(torch.tensor([[nxt]]), use_cache=True, **_cache_kwargs(out))
    return tokens


# ---- GGUF ---------------------------------------------------------------------------------

_GGUF_LAYER = {
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py's LlamaModel.permute for q/k weights."""
    rows = w.shape[0]
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# llama.cpp's names where a family differs (gemma2/3's four norms, phi3's fused tensors)
_GGUF_ARCH_LAYER = {
    "gemma2": {"post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
               "post_feedforward_layernorm": "post_ffw_norm"},
    "phi3": {"self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"},
}
_GGUF_ARCH_LAYER["gemma3"] = _GGUF_ARCH_LAYER["gemma2"]
GGUF_ARCH = {"mistral": "llama", "gemma3_text": "gemma3"}  # transformers' model_type -> llama.cpp's architecture
_GGUF_LAYER.update({"self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"})


def gguf_name(hf_name: str, arch: str = "llama") -> str:
    hf_name = hf_name.removeprefix("model.")
    top = {"embed_tokens.weight": "token_embd.weight", "norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    if hf_name in top:
        return top[hf_name]
    _, layer, *rest = hf_name.split(".")
    base, suffix = ".".join(rest[:-1]), rest[-1]
    return f"blk.{layer}.{_GGUF_ARCH_LAYER.get(arch, {}).get(base) or _GGUF_LAYER[base]}.{suffix}"


def encode_tensor(w: np.ndarray, qtype):
    """(array to store, raw_dtype) for gguf.GGUFWriter.add_tensor."""
    import gguf

    T = gguf.GGMLQuantizationType
    if w.dtype == np.uint8:  # already encoded blocks, [rows, bytes per row]
        return w, qtype
    w = np.ascontiguousarray(w, dtype=np.float32)
    if qtype == T.F32:
        return w, None
    if qtype == T.F16:
        return w.astype(np.float16), None
    return gguf.quants.quantize(w, qtype), qtype


def stored_value(w: np.ndarray, qtype) -> np.ndarray:
    """The float32 values a reader recovers from w stored as qtype."""
    import gguf

    arr, _ = encode_tensor(w, qtype)
    return np.asarray(gguf.quants.dequantize(arr, qtype), dtype=np.float32).reshape(w.shape)


def write_gguf(path: Path, tensors: dict[str, tuple[np.ndarray, object]], *, arch: str = "llama",
               metadata: dict | None = None, tokenizer: bool = True) -> Path:
    """Write a GGUF file. tensors: gguf name -> (float32 array in PyTorch [out, in] order, GGML type).

    metadata: {suffix: value} written as "{arch}.{suffix}" with the matching writer type.
    """
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    for key, value in (metadata or {}).items():
        full = f"{arch}.{key}"
        if isinstance(value, str):
            w.add_string(full, value)
        elif isinstance(value, float):
            w.add_float32(full, value)
        else:
            w.add_uint32(full, int(value))
    if tokenizer:
        tokens, types, merges = gguf_tokenizer_fields()
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("gpt2")
        w.add_token_list(tokens)
        w.add_token_types(types)
        w.add_token_merges(merges)
        w.add_bos_token_id(tokens.index("<|endoftext|>"))
        w.add_eos_token_id(tokens.index("<|im_end|>"))
    for name, (arr, qtype) in tensors.items():
        data, raw_dtype = encode_tensor(arr, qtype)
        w.add_tensor(name, data, raw_dtype=raw_dtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def llama_metadata(config) -> dict:
    meta = {
        "context_length": config.max_position_embeddings, "embedding_length": config.hidden_size,
        "feed_forward_length": config.intermediate_size, "block_count": config.num_hidden_layers,
        "attention.head_count": config.num_attention_heads,
        "attention.head_count_kv": config.num_key_value_heads,
        "attention.layer_norm_rms_epsilon": float(config.rms_norm_eps),
        "rope.freq_base": float(global_rope(config)["rope_theta"]),
        "rope.dimension_count": head_dim(config), "vocab_size": config.vocab_size,
    }
    return meta


def global_rope(config) -> dict:
    """The RoPE parameters of the global layers (Gemma 3 keeps one set per layer type)."""
    rope = config.rope_parameters
    return rope.get("full_attention", rope)


def rope_gguf_metadata(config) -> tuple[dict, dict]:
    """The RoPE metadata (and tensors) llama.cpp's converter writes for ``config``: TextModel.set_gguf_parameters'
    freq_base (the global layers'), freq_base_swa, linear and YaRN keys; Phi3MiniModel's rotated dims, original
    context, attn_factor and rope_factors_long/short tensors (it writes no rope.scaling.type). Dynamic NTK has no
    GGUF form: the converter writes nothing for it."""
    import gguf

    rope, meta, tensors = global_rope(config), {}, {}
    meta["rope.freq_base"] = float(rope["rope_theta"])
    if "sliding_attention" in config.rope_parameters:
        meta["rope.freq_base_swa"] = float(config.rope_parameters["sliding_attention"]["rope_theta"])
    kind, factor = rope.get("rope_type"), rope.get("factor")
    if kind == "linear":
        meta.update({"rope.scaling.type": "linear", "rope.scaling.factor": float(factor)})
    elif kind == "yarn":
        meta.update({"rope.scaling.type": "yarn", "rope.scaling.factor": float(factor),
                     "rope.scaling.original_context_length": rope["original_max_position_embeddings"]})
        for key, name in (("yarn_attn_factor", "attention_factor"), ("yarn_beta_fast", "beta_fast"),
                          ("yarn_beta_slow", "beta_slow")):
            if rope.get(name) is not None:
                meta[f"rope.scaling.{key}"] = float(rope[name])
    if config.model_type == "phi3":
        n_embd, n_head = config.hidden_size, config.num_attention_heads
        max_pos = config.max_position_embeddings
        orig = rope.get("original_max_position_embeddings") or getattr(config, "original_max_position_embeddings",
                                                                         max_pos)
        meta["rope.dimension_count"] = int(rope.get("partial_rotary_factor", 1.0) * n_embd) // n_head
        meta["rope.scaling.original_context_length"] = orig
        if rope.get("long_factor"):
            scale = max_pos / orig
            meta["rope.scaling.attn_factor"] = math.sqrt(1 + math.log(scale) / math.log(orig)) if scale > 1 else 1.0
            for which in ("long", "short"):
                tensors[f"rope_factors_{which}.weight"] = (np.array(rope[f"{which}_factor"], dtype=np.float32),
                                                           gguf.GGMLQuantizationType.F32)
    return meta, tensors


def llama3_rope_factors(config) -> np.ndarray:
    """The rope_freqs.weight tensor llama.cpp's converter writes for rope_type llama3."""
    rope = config.rope_parameters
    dim, base = head_dim(config), rope["rope_theta"]
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor, low, high = rope["factor"], rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    old_len = rope["original_max_position_embeddings"]
    factors = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < old_len / high:
            factors.append(1.0)
        elif wavelen > old_len / low:
            factors.append(factor)
        else:
            smooth = (old_len / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def hf_to_gguf_tensors(model, types=None, permute: bool = True) -> dict[str, tuple[np.ndarray, object]]:
    """A transformers Llama model's weights under GGUF names, q/k permuted as llama.cpp does.

    types: function (gguf name, array) -> GGML type; default F32 everywhere.
    """
    import gguf

    cfg = model.config
    arch = GGUF_ARCH.get(cfg.model_type, cfg.model_type)
    permute = permute and arch in ("llama", "smollm3")  # llama.cpp permutes q/k for its interleaved RoPE there only
    out = {}
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        w = t.detach().float().numpy()
        if arch in ("gemma2", "gemma3") and name.endswith("norm.weight"):
            w = w + 1  # llama.cpp's converter stores Gemma's norms as multipliers (transformers: 1 + w)
        if permute and name.endswith("q_proj.weight"):
            w = llama_cpp_permute(w, cfg.num_attention_heads)
        elif permute and name.endswith("k_proj.weight"):
            w = llama_cpp_permute(w, cfg.num_key_value_heads)
        g = gguf_name(name, arch)
        qtype = gguf.GGMLQuantizationType.F32 if types is None or w.ndim == 1 else types(g, w)
        out[g] = (w, qtype)
    return out
