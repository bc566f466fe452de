"""Model loaders: Hugging Face folders and GGUF files against transformers, on tiny random models.

Every model here is written by the test itself (see tiny_models.py): a 2-layer, hidden-64 Llama or
Qwen2 with random weights and a 320-token byte-level BPE. The references are transformers' own
forward pass and a greedy loop over its KV cache.
"""

from __future__ import annotations

import copy
import json
import os
import shutil

import gguf
import numpy as np
import pytest
import torch
from helpers import needs_kernels, prefill_logits

import tiny_models as tm
from tokenmill import LLM, SamplingParams
from tokenmill.models import gguf_loader

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.usefixtures("one_thread")

T = gguf.GGMLQuantizationType
N_GEN = 16
TEXT = "The quick brown fox, hello world! Once upon a time 1, 2, 3"
GREEDY = SamplingParams(temperature=0.0, max_tokens=N_GEN, ignore_eos=True)
TOL = 1e-4


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def make_llm(path, **kw) -> LLM:
    kw.setdefault("quantization", "none")  # float weights: what the reference comparisons check
    return LLM(str(path), dtype="float32", kv_cache_memory="16MiB", **kw)


def engine_greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def check_against(llm: LLM, ref_model, ids: list[int]) -> None:
    """Logits at every position within TOL of transformers', and identical greedy tokens."""
    ours = prefill_logits(llm.engine, ids)
    ref = tm.hf_logits(ref_model, ids)
    assert ours.shape == ref.shape == (len(ids), ref_model.config.vocab_size)
    err = rel_err(ours, ref)
    assert err < TOL, f"logits differ from transformers: relative error {err:.2e}"
    assert engine_greedy(llm, [ids])[0] == tm.hf_greedy(ref_model, ids, N_GEN)


@pytest.fixture(scope="module")
def prompt_ids() -> list[int]:
    ids = tm.hf_tokenizer().encode(TEXT).ids
    assert len(ids) > 32  # spans several 16-token KV blocks, and positions where RoPE scaling matters
    return ids


# ---- Hugging Face folders -----------------------------------------------------------------

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16, "rope_theta": 10000.0}
LINEAR_ROPE = {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}

# case -> (architecture, random_hf_model kwargs)
HF_CASES = {
    "llama-gqa": ("llama", {}),  # 4 heads, 2 KV heads
    "llama-mqa": ("llama", {"num_key_value_heads": 1}),
    "llama-tied": ("llama", {"tie_word_embeddings": True, "embed_std": 0.3}),
    "qwen2-bias": ("qwen2", {}),
    "llama3-rope": ("llama", {"rope_parameters": LLAMA3_ROPE}),
    "linear-rope": ("llama", {"rope_parameters": LINEAR_ROPE}),
    "rope-theta": ("llama", {"rope_parameters": {"rope_type": "default", "rope_theta": 300.0}}),
    "head-dim": ("llama", {"head_dim": 32}),  # head_dim != hidden / heads
}


@pytest.fixture(scope="module")
def hf_built(tmp_path_factory):
    """case -> (transformers model, folder, tokenmill LLM), built once per module."""
    cache = {}

    def get(case):
        if case not in cache:
            arch, kw = HF_CASES[case]
            model = tm.random_hf_model(arch, **kw)
            folder = tm.save_hf_folder(model, tmp_path_factory.mktemp(case))
            cache[case] = (model, folder, make_llm(folder))
        return cache[case]

    return get


@pytest.mark.parametrize("case", list(HF_CASES))
def test_hf_folder_matches_transformers(case, hf_built, prompt_ids):
    model, folder, llm = hf_built(case)
    cfg = llm.engine.model_config
    assert cfg.architecture == HF_CASES[case][0]
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (
        model.config.num_attention_heads, model.config.num_key_value_heads, tm.head_dim(model.config))
    assert (llm.engine.runner.model.lm_head is None) == model.config.tie_word_embeddings
    assert cfg.attention_bias == (case == "qwen2-bias")
    check_against(llm, model, prompt_ids)


@pytest.mark.parametrize("case", ["llama3-rope", "linear-rope", "rope-theta"])
def test_rope_cases_are_sensitive(case, hf_built, prompt_ids):
    """Guard for the test above: ignoring the RoPE setting would break the tolerance by far."""
    model, _, _ = hf_built(case)
    cfg = copy.deepcopy(model.config)
    cfg.rope_parameters = {"rope_type": "default", "rope_theta": 10000.0}
    plain = type(model)(cfg).eval()
    plain.load_state_dict(model.state_dict())
    assert rel_err(tm.hf_logits(plain, prompt_ids), tm.hf_logits(model, prompt_ids)) > 100 * TOL


@pytest.mark.parametrize("case, rope_scaling", [
    ("linear-rope", {"type": "linear", "factor": 2.0}),  # oldest spelling: "type"
    ("llama3-rope", {k: v for k, v in LLAMA3_ROPE.items() if k != "rope_theta"}),
])
def test_hf_folder_legacy_rope_config(case, rope_scaling, hf_built, prompt_ids, tmp_path):
    """transformers 4.x config.json: rope_theta and rope_scaling at top level, no rope_parameters."""
    model, folder, _ = hf_built(case)
    legacy = shutil.copytree(folder, tmp_path / "legacy")
    cfg = json.loads((legacy / "config.json").read_text())
    rope = cfg.pop("rope_parameters")
    cfg.update(rope_theta=rope["rope_theta"], rope_scaling=rope_scaling)
    (legacy / "config.json").write_text(json.dumps(cfg))
    llm = make_llm(legacy)
    assert rel_err(prefill_logits(llm.engine, prompt_ids), tm.hf_logits(model, prompt_ids)) < TOL


def test_mixed_length_batch_matches_single(hf_built, prompt_ids):
    model, _, llm = hf_built("llama-gqa")
    prompts = [prompt_ids[:1], prompt_ids[:5], prompt_ids, prompt_ids[7:19], prompt_ids[3:20] + prompt_ids[:16],
               tm.hf_tokenizer().encode("def f(x):\n    return x").ids]
    batched = engine_greedy(llm, prompts)
    alone = [engine_greedy(llm, [p])[0] for p in prompts]
    assert batched == alone
    assert batched == [tm.hf_greedy(model, p, N_GEN) for p in prompts]
    assert all(len(t) == N_GEN for t in batched)


# ---- GGUF: dequantization -----------------------------------------------------------------

def _blocks(x: np.ndarray, size: int = 32) -> np.ndarray:
    return x.reshape(-1, size)


def test_dequantize_recovers_weights_within_quantization_error(tmp_path):
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((8, 128)) * np.exp(rng.uniform(-3, 1, size=(8, 1)))).astype(np.float32)
    w[2, 5] = 40.0  # an outlier block
    w[5, 64:96] += 3.0  # an all-positive block (Q4_1's min matters)
    types = [T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1]
    path = tm.write_gguf(tmp_path / "types.gguf", {f"w.{t.name}": (w, t) for t in types}, tokenizer=False)
    reader = gguf_loader.open_gguf(path)
    got = {t.name.removeprefix("w."): gguf_loader.dequantize(t) for t in reader.tensors}
    assert set(got) == {t.name for t in types}
    for name, x in got.items():
        assert x.dtype == torch.float32 and tuple(x.shape) == w.shape, name  # PyTorch [out, in] order
    ref = torch.from_numpy(w)
    assert torch.equal(got["F32"], ref)
    assert ((got["F16"] - ref).abs() <= ref.abs() * 2**-11 + 2**-24).all()
    assert ((got["BF16"] - ref).abs() <= ref.abs() * 2**-8).all()

    def block_err(name):
        return _blocks((got[name] - ref).abs().numpy()).max(axis=1)

    b = _blocks(w)
    amax, lo, hi = np.abs(b).max(axis=1), b.min(axis=1), b.max(axis=1)
    # Q8_0: x = d*q, d = amax/127 stored as fp16: half a step plus the rounding of d over |q| <= 127.
    assert (block_err("Q8_0") <= amax * (0.5 / 127 + 2**-11) * 1.0001).all()
    # Q4_0: x = d*(q-8), d = -max/8; the extreme opposite the max clips to q=15: one step at worst.
    assert (block_err("Q4_0") <= amax * (1 / 8 + 2**-11) * 1.0001).all()
    assert _blocks((got["Q4_0"] - ref).abs().numpy()).mean(axis=1).max() <= amax.max() / 16
    # Q4_1: x = d*q + m, d = (max-min)/15, m = min: half a step plus the fp16 rounding of d and m.
    d = (hi - lo) / 15
    assert (block_err("Q4_1") <= (d * (0.5 + 15 * 2**-11) + np.abs(lo) * 2**-11) * 1.0001 + 1e-7).all()


def test_dequantize_hand_built_blocks(tmp_path):
    """Blocks laid out by hand from ggml's documented formats, independent of gguf's quantizers."""
    rng = np.random.default_rng(1)
    rows, cols = 3, 64
    nb = rows * cols // 32
    d = (2.0 ** rng.integers(-6, 2, size=(nb, 1)) * rng.choice([1, -1, 1.5], size=(nb, 1))).astype(np.float16)
    m = (rng.integers(-64, 64, size=(nb, 1)) / 32).astype(np.float16)
    q4 = rng.integers(0, 16, size=(nb, 32)).astype(np.uint8)
    nibbles = q4[:, :16] | (q4[:, 16:] << 4)  # low nibbles: elements 0-15, high nibbles: 16-31
    q8 = rng.integers(-128, 128, size=(nb, 32)).astype(np.int8)

    def raw(*parts):  # [blocks, bytes] -> [rows, bytes per row]
        return np.concatenate([p.view(np.uint8) for p in parts], axis=1).reshape(rows, -1)

    df, mf = d.astype(np.float32), m.astype(np.float32)
    cases = {
        "q4_1": (raw(d, m, nibbles), T.Q4_1, df * q4.astype(np.float32) + mf),
        "q4_0": (raw(d, nibbles), T.Q4_0, df * (q4.astype(np.float32) - 8)),
        "q8_0": (raw(d, q8), T.Q8_0, df * q8.astype(np.float32)),
    }
    assert cases["q4_1"][0].shape == (rows, cols // 32 * 20)
    path = tm.write_gguf(tmp_path / "blocks.gguf", {k: (v[0], v[1]) for k, v in cases.items()}, tokenizer=False)
    for t in gguf_loader.open_gguf(path).tensors:
        expected = torch.from_numpy(cases[t.name][2].reshape(rows, cols))
        assert torch.equal(gguf_loader.dequantize(t), expected), t.name


def test_undo_rope_permute_inverts_llama_cpp_permute():
    w = torch.randn(64, 24)
    for n_head in (1, 2, 4):
        permuted = torch.from_numpy(tm.llama_cpp_permute(w.numpy(), n_head))
        assert not torch.equal(permuted, w)
        assert torch.equal(gguf_loader._undo_rope_permute(permuted, n_head), w)


# ---- GGUF: whole models -------------------------------------------------------------------

QUANT_TYPES = {"token_embd": T.Q8_0, "attn_q": T.Q4_0, "attn_k": T.Q4_1, "attn_v": T.F16, "attn_output": T.Q8_0,
               "ffn_gate": T.Q4_1, "ffn_up": T.Q4_0, "ffn_down": T.BF16, "output": T.F16}


def _quant_type(name, _w):
    return QUANT_TYPES[name.split(".")[-2]]


# case -> (architecture, random_hf_model kwargs, tensor types, extra GGUF metadata)
GGUF_CASES = {
    "llama-f32": ("llama", {}, None, {}),
    "llama-quantized": ("llama", {}, _quant_type, {}),
    "llama-mqa-tied-f16": ("llama", {"num_key_value_heads": 1, "tie_word_embeddings": True, "embed_std": 0.3},
                           lambda n, w: T.F16, {}),
    "llama-linear-rope": ("llama", {"rope_parameters": LINEAR_ROPE}, None,
                          {"rope.scaling.type": "linear", "rope.scaling.factor": 2.0}),
    "llama3-rope-freqs": ("llama", {"rope_parameters": LLAMA3_ROPE}, None, {}),
    "qwen2-f32": ("qwen2", {"rope_parameters": {"rope_type": "default", "rope_theta": 1000.0}}, None, {}),
}


@pytest.fixture(scope="module")
def gguf_built(tmp_path_factory):
    """case -> (reference transformers model with the weights as stored, .gguf path, tokenmill LLM)."""
    cache = {}

    def get(case):
        if case not in cache:
            arch, kw, types, extra = GGUF_CASES[case]
            model = tm.random_hf_model(arch, seed=3, **kw)
            tensors = tm.hf_to_gguf_tensors(model, types, permute=arch == "llama")
            if case == "llama3-rope-freqs":
                tensors["rope_freqs.weight"] = (tm.llama3_rope_factors(model.config), T.F32)
            if types is not None:  # the reference sees exactly the values the file holds
                with torch.no_grad():
                    for name, p in model.named_parameters():
                        qtype = tensors[tm.gguf_name(name)][1]
                        p.copy_(torch.from_numpy(tm.stored_value(p.detach().numpy(), qtype)))
            path = tm.write_gguf(tmp_path_factory.mktemp(case) / f"{case}.gguf", tensors, arch=arch,
                                 metadata={**tm.llama_metadata(model.config), **extra})
            cache[case] = (model, path, make_llm(path))
        return cache[case]

    return get


@pytest.mark.parametrize("case", list(GGUF_CASES))
def test_gguf_model_matches_transformers(case, gguf_built, prompt_ids):
    model, path, llm = gguf_built(case)
    assert llm.engine.model_config.architecture == GGUF_CASES[case][0]
    assert (llm.engine.runner.model.lm_head is None) == model.config.tie_word_embeddings
    assert llm.tokenizer.encode(TEXT) == prompt_ids  # the GGUF tokenizer section rebuilds the same BPE
    check_against(llm, model, prompt_ids)


def test_gguf_permutation_matches_transformers_gguf_loader(gguf_built, prompt_ids):
    """transformers reads our tiny GGUF too (undoing llama.cpp's q/k permute its own way)."""
    model, path, _ = gguf_built("llama-f32")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    assert rel_err(tm.hf_logits(theirs, prompt_ids), tm.hf_logits(model, prompt_ids)) < TOL


@needs_kernels
def test_quantization_auto_keeps_a_quantized_files_blocks(gguf_built, hf_built, tmp_path, prompt_ids):
    """--quantization auto (the default): a GGUF file whose layers are all Q4_0/Q4_1/Q8_0 runs as gguf
    (llama.cpp's behaviour, the fast path); a float or mixed-format file, a folder, or a device or dtype
    the integer kernels do not serve, stays float."""
    from tokenmill.layers.quant import QuantizedLinear
    from tokenmill.models.loader import resolve_quantization

    model = tm.random_hf_model("llama", seed=3)
    kept = {"attn_q": T.Q4_0, "attn_k": T.Q4_1, "attn_v": T.Q8_0, "attn_output": T.Q8_0,
            "ffn_gate": T.Q4_1, "ffn_up": T.Q4_0, "ffn_down": T.Q8_0}
    path = tm.write_gguf(tmp_path / "q.gguf", tm.hf_to_gguf_tensors(model, lambda n, w: kept.get(n.split(".")[-2],
                                                                                                  T.F32)),
                         metadata=tm.llama_metadata(model.config))
    auto = LLM(str(path), dtype="float32", kv_cache_memory="16MiB")
    assert auto.engine.quantization == "gguf"
    assert isinstance(auto.engine.runner.model.layers[0].mlp.down_proj, QuantizedLinear)
    explicit = make_llm(path, quantization="gguf")
    assert torch.equal(prefill_logits(auto.engine, prompt_ids), prefill_logits(explicit.engine, prompt_ids))
    assert make_llm(path).engine.quantization == "none"  # an explicit mode is kept
    reader = gguf_loader.open_gguf(path)
    cpu = torch.device("cpu")
    assert resolve_quantization("auto", reader, cpu, torch.bfloat16) == "none"
    assert resolve_quantization("auto", reader, torch.device("cuda"), torch.float32) == "none"
    assert resolve_quantization("auto", None, cpu, torch.float32) == "none"  # a Hugging Face folder
    for case in ("llama-f32", "llama-quantized"):  # float, and a mix with F16/BF16 layers
        assert not gguf_loader.gguf_layers_quantized(gguf_loader.open_gguf(gguf_built(case)[1]))
        assert LLM(str(gguf_built(case)[1]), dtype="float32", kv_cache_memory="16MiB").engine.quantization == "none"
    _, folder, _ = hf_built("llama-gqa")
    assert LLM(str(folder), dtype="float32", kv_cache_memory="16MiB").engine.quantization == "none"


# ---- errors -------------------------------------------------------------------------------

@pytest.fixture()
def hub_offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    try:
        import huggingface_hub.constants as hub_constants
    except ImportError:
        return
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True, raising=False)


def _gguf_variant(tmp_path, model, edit=None, arch="llama", drop_meta=(), tokenizer=True, vocab_size=True):
    tensors = tm.hf_to_gguf_tensors(model)
    if edit:
        edit(tensors)
    meta = {k: v for k, v in tm.llama_metadata(model.config).items() if k not in drop_meta}
    if not vocab_size:
        meta.pop("vocab_size")
    return tm.write_gguf(tmp_path / "bad.gguf", tensors, arch=arch, metadata=meta, tokenizer=tokenizer)


def _hf_variant(tmp_path, folder, edit_config=None, edit_tensors=None, safetensors_bytes=None):
    from safetensors.torch import load_file, save_file

    out = shutil.copytree(folder, tmp_path / "bad")
    if edit_config:
        cfg = json.loads((out / "config.json").read_text())
        edit_config(cfg)
        (out / "config.json").write_text(json.dumps(cfg))
    st = out / "model.safetensors"
    if edit_tensors:
        sd = load_file(str(st))
        edit_tensors(sd)
        save_file({k: v.contiguous() for k, v in sd.items()}, str(st), metadata={"format": "pt"})
    if safetensors_bytes:
        st.write_bytes(safetensors_bytes(st.read_bytes()))
    return out


def _set(d, key, fn):
    d[key] = fn(d[key])


def _truncated(fraction):
    def make(tmp_path, gguf_file, hf_folder, model):
        data = gguf_file.read_bytes()
        n = fraction if isinstance(fraction, int) else int(len(data) * fraction)
        (tmp_path / "cut.gguf").write_bytes(data[:n])
        return tmp_path / "cut.gguf"
    return make


def _relative_missing(tmp_path, *_):
    os.chdir(tmp_path)  # undone by the test through monkeypatch
    return "no_such_dir/model.gguf"


ERROR_CASES = {
    "missing-path": (lambda tmp, *_: tmp / "missing" / "model.gguf", r"not an existing \.gguf file or model folder"),
    "missing-relative-path": (_relative_missing, r"not an existing \.gguf file or model folder"),
    "unknown-alias": (lambda *_: "smollm9-1t-instruct", r"unknown model 'smollm9-1t-instruct'.*smollm2-135m-instruct"),
    "not-gguf-file": (lambda tmp, *_: (tmp / "weights.bin").write_bytes(b"\0" * 64) and tmp / "weights.bin",
                      r"not a \.gguf file"),
    "random-bytes-gguf": (lambda tmp, *_: (tmp / "r.gguf").write_bytes(os.urandom(4096)) and tmp / "r.gguf",
                          r"not a readable GGUF file"),
    "truncated-gguf-header": (_truncated(30), r"not a readable GGUF file"),
    "truncated-gguf-metadata": (_truncated(2000), r"not a readable GGUF file"),
    "truncated-gguf-tensors": (_truncated(0.5), r"not a readable GGUF file"),
    "truncated-gguf-tail": (_truncated(0.999), r"not a readable GGUF file"),
    "gguf-unsupported-arch": (lambda tmp, g, h, m: _gguf_variant(tmp, m, arch="gpt2"),
                              r"architecture 'gpt2' is not supported.*llama"),
    "gguf-missing-metadata": (lambda tmp, g, h, m: _gguf_variant(tmp, m, drop_meta=("block_count",)),
                              r"lacks the metadata key llama\.block_count"),
    "gguf-no-tokenizer": (lambda tmp, g, h, m: _gguf_variant(tmp, m, tokenizer=False, vocab_size=False),
                          r"tokenizer"),
    "gguf-unsupported-type": (lambda tmp, g, h, m: _gguf_variant(  # random IQ4_NL blocks: 18 bytes per 32
        tmp, m, edit=lambda t: _set(t, "blk.0.ffn_up.weight", lambda x: (
            np.random.default_rng(0).integers(0, 256, (x[0].shape[0], x[0].shape[1] // 32 * 18), np.uint8),
            T.IQ4_NL))), r"IQ4_NL, not supported \(supported: .*Q4_K, Q5_K, Q6_K\)"),
    "gguf-wrong-shape-q": (lambda tmp, g, h, m: _gguf_variant(
        tmp, m, edit=lambda t: _set(t, "blk.0.attn_q.weight", lambda x: (x[0][:60], x[1]))), r"attn_q.*shape"),
    "gguf-wrong-shape-up": (lambda tmp, g, h, m: _gguf_variant(
        tmp, m, edit=lambda t: _set(t, "blk.1.ffn_up.weight", lambda x: (x[0][:, :32], x[1]))),
        r"up_proj.*shape \(128, 32\), expected \(128, 64\)"),
    "gguf-missing-tensor": (lambda tmp, g, h, m: _gguf_variant(tmp, m, edit=lambda t: t.pop("blk.1.ffn_down.weight")),
                            r"incomplete.*down_proj"),
    "folder-without-config": (lambda tmp, *_: (tmp / "empty").mkdir() or tmp / "empty", r"has no config\.json"),
    "unsupported-model-type": (lambda tmp, g, h, m: _hf_variant(tmp, h, edit_config=lambda c: c.update(
        model_type="gpt2")), r"model_type 'gpt2' is not supported"),
    "missing-safetensors": (lambda tmp, g, h, m: _hf_variant(
        tmp, h, safetensors_bytes=None) and ((tmp / "bad" / "model.safetensors").unlink() or tmp / "bad"),
        r"no \*\.safetensors files"),
    "corrupt-safetensors": (lambda tmp, g, h, m: _hf_variant(tmp, h, safetensors_bytes=lambda b: b[:len(b) // 2]),
                            r"model\.safetensors.*safetensors"),
    "wrong-shape-o_proj": (lambda tmp, g, h, m: _hf_variant(tmp, h, edit_tensors=lambda sd: _set(
        sd, "model.layers.0.self_attn.o_proj.weight", lambda x: x[:16])), r"o_proj.*shape \(16, 64\)"),
    "wrong-shape-k_proj": (lambda tmp, g, h, m: _hf_variant(tmp, h, edit_tensors=lambda sd: _set(
        sd, "model.layers.0.self_attn.k_proj.weight", lambda x: x[:16])),
        r"k_proj.*shape \(16, 64\), expected \(32, 64\)"),
    "wrong-shape-up_proj": (lambda tmp, g, h, m: _hf_variant(tmp, h, edit_tensors=lambda sd: _set(
        sd, "model.layers.1.mlp.up_proj.weight", lambda x: x[:, :32])), r"up_proj.*shape \(128, 32\)"),
    "missing-tensor": (lambda tmp, g, h, m: _hf_variant(tmp, h, edit_tensors=lambda sd: sd.pop(
        "model.layers.1.mlp.down_proj.weight")), r"incomplete.*down_proj"),
    "hub-id-offline": (lambda *_: "tokenmill-tests/no-such-model",
                       r"could not fetch 'tokenmill-tests/no-such-model'.*pass a local \.gguf file or model folder"),
}


@pytest.mark.parametrize("case", list(ERROR_CASES))
def test_load_errors_are_clear_value_errors(case, tmp_path, monkeypatch, hub_offline, hf_built, gguf_built):
    monkeypatch.chdir(os.getcwd())  # restores the working directory after cases that change it
    model, gguf_file, _ = gguf_built("llama-f32")
    _, hf_folder, _ = hf_built("llama-gqa")
    make, pattern = ERROR_CASES[case]
    target = make(tmp_path, gguf_file, hf_folder, model)
    with pytest.raises(ValueError, match=pattern) as info:
        make_llm(target)
    err = info.value
    # no chained low-level traceback ("During handling of the above exception...")
    assert err.__cause__ is None and (err.__context__ is None or err.__suppress_context__), repr(err.__context__)
    assert len(str(err)) < 1000
