"""K-quant and Q5 GGUF files, the types llama.cpp's Q4_K_M / Q6_K / Q5 recipes write: dequantized by
gguf-py (the reference), run on the kernels' blocks where they convert (Q4_K as Q4_1 with fp16-rounded
sub-block scales, Q5_0 as Q8_0 exactly), on tiny random models against transformers and on the
embedded model requantized by the recipes (tests/kquants.py writes the blocks)."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

import kquants
import tiny_models as tm
from helpers import needs_kernels, prefill_logits
from tokenmill import LLM, SamplingParams
from tokenmill.layers.quant import QuantizedLinear, QuantizedTensor, dequantize_rows, q4_k_to_q4_1, q5_0_to_q8_0

T = gguf.GGMLQuantizationType
K_TYPES = ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]
# scale of each type's random blocks: weights of about 0.1 at most, as in the tiny models
BLOCK_SCALE = {"Q2_K": 2e-3, "Q3_K": 8e-4, "Q4_K": 1e-4, "Q5_K": 5e-5, "Q6_K": 3e-5}
WIDE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)  # rows of 256


def gguf_dequant(blocks: np.ndarray, kind: str, shape: tuple[int, int]) -> torch.Tensor:
    return torch.from_numpy(np.asarray(gguf.quants.dequantize(blocks, getattr(T, kind)), np.float32).reshape(shape))


# ---- the conversions -----------------------------------------------------------------------------


def test_q4_k_runs_as_q4_1_within_fp16_rounding_of_its_scales():
    n, k = 6, 768
    blocks = kquants.random_blocks("Q4_K", n, k, seed=1, scale=1e-2)
    ref = gguf_dequant(blocks, "Q4_K", (n, k))
    q41 = q4_k_to_q4_1(torch.from_numpy(blocks), k)
    got = dequantize_rows(q41, "q4_1", k)
    # each 32-weight block's d' and m' are d sc and -dmin m rounded to fp16: a relative 2^-11 at most
    blk = q41.view(n, k // 32, 20)
    d = blk[..., 0:2].contiguous().view(torch.float16).float().abs()
    m = blk[..., 2:4].contiguous().view(torch.float16).float().abs()
    bound = (2.0 ** -11) * (15 * d + m)  # q <= 15
    assert ((got - ref).abs().view(n, k // 32, 32) <= bound + 1e-12).all()
    assert (got - ref).abs().max() > 0  # (it is a rounding, not a copy: the bound is what is checked)
    assert q41.shape == (n, k // 32 * 20)  # 5.0 bits per weight (Q4_K: 4.5)


def test_q5_0_runs_as_q8_0_exactly():
    w = np.random.default_rng(2).standard_normal((5, 96)).astype(np.float32)
    blocks = gguf.quants.quantize(w, T.Q5_0)
    ref = gguf_dequant(blocks, "Q5_0", w.shape)
    assert torch.equal(dequantize_rows(q5_0_to_q8_0(torch.from_numpy(blocks), 96), "q8_0", 96), ref)


def test_test_quantizers_write_blocks_gguf_py_reads_back():
    w = np.random.default_rng(3).standard_normal((4, 512)).astype(np.float32) * 0.05
    for quantize, kind, tol in ((kquants.quantize_q4_k, "Q4_K", 0.1), (kquants.quantize_q6_k, "Q6_K", 0.03)):
        back = gguf_dequant(quantize(w), kind, w.shape).numpy()
        assert np.sqrt(((back - w) ** 2).mean() / (w ** 2).mean()) < tol, kind


@needs_kernels
def test_kernel_on_converted_q4_k_matches_the_dequantized_product():
    from tokenmill.layers.kernels import cpu_kernels
    from tokenmill.layers.quant import FORMAT_IDS, ref_qlinear

    n, k = 37, 512
    qt = QuantizedTensor(q4_k_to_q4_1(torch.from_numpy(kquants.random_blocks("Q4_K", n, k, seed=4, scale=1e-2)), k),
                         "q4_1", (n, k))
    x = torch.randn(5, k) * 3
    y = cpu_kernels().qlinear(x, qt.kernel_layout(), n, FORMAT_IDS["q4_1"])
    ref = ref_qlinear(x, qt)
    assert torch.allclose(y, ref, rtol=1e-5, atol=1e-4 * ref.abs().max().item())  # today's formats' tolerances
    dense = x @ qt.dequantize().t()
    assert (y - dense).norm() / dense.norm() < 2e-4


# ---- tiny random models, every type, against transformers -------------------------------------------


def _kquant_model(tmp_path, kind: str, seed: int = 3):
    """A tiny Llama whose decoder weights are ``kind`` blocks (random ones for the K types, gguf-py's
    quantization for Q5_0/Q5_1; the embedding F32), as a GGUF file, and the transformers model holding
    exactly the values the file does."""
    model = tm.random_hf_model("llama", seed=seed, **WIDE)
    cfg = model.config
    tensors = tm.hf_to_gguf_tensors(model, None, permute=True)  # norms and embedding as they are
    with torch.no_grad():
        for i, (name, p) in enumerate(model.named_parameters()):
            if not name.startswith("model.layers.") or p.dim() != 2:
                continue
            if kind in kquants.BLOCK_BYTES:
                blocks = kquants.random_blocks(kind, *p.shape, seed=seed + i, scale=BLOCK_SCALE[kind])
            else:
                blocks = gguf.quants.quantize(p.numpy(), getattr(T, kind))
            p.copy_(gguf_dequant(blocks, kind, tuple(p.shape)))  # the reference holds the stored values
            if name.endswith("q_proj.weight"):  # rows of blocks permuted as llama.cpp stores q and k
                blocks = tm.llama_cpp_permute(blocks, cfg.num_attention_heads)
            elif name.endswith("k_proj.weight"):
                blocks = tm.llama_cpp_permute(blocks, cfg.num_key_value_heads)
            tensors[tm.gguf_name(name)] = (blocks, getattr(T, kind))
    return model, tm.write_gguf(tmp_path / f"{kind}.gguf", tensors, metadata=tm.llama_metadata(cfg))


@pytest.mark.parametrize("kind", [*K_TYPES, "Q5_0", "Q5_1"])
def test_tiny_model_in_each_type_matches_transformers(kind, tmp_path):
    model, path = _kquant_model(tmp_path, kind)
    ids = list(range(5, 45))
    llm = LLM(str(path), dtype="float32", kv_cache_memory="16MiB", quantization="none")
    ours, ref = prefill_logits(llm.engine, ids), tm.hf_logits(model, ids)
    assert ((ours - ref).abs().max() / ref.abs().max()).item() < 1e-4
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    assert llm.generate([ids], greedy, use_tqdm=False)[0].outputs[0].token_ids == tm.hf_greedy(model, ids, 8)
    # a file of quantized layers runs as gguf by default: on its own blocks where they convert
    auto = LLM(str(path), dtype="float32", kv_cache_memory="16MiB")
    if auto.engine.quantization != "gguf":  # no integer kernels here
        return
    down = auto.engine.runner.model.layers[0].mlp.down_proj
    assert isinstance(down, QuantizedLinear)
    assert down.fmt == {"Q4_K": "q4_1"}.get(kind, "q8_0")  # Q5_0 exactly, the rest dequantized first
    got = prefill_logits(auto.engine, ids)
    rel = ((got - ours).norm(dim=-1) / ours.norm(dim=-1)).max().item()
    assert rel < (0.02 if kind == "Q4_K" else 0.05), rel


# ---- the embedded model, requantized by llama.cpp's recipes ---------------------------------------------


@pytest.fixture(scope="module")
def requantized(gguf_path, tmp_path_factory):
    folder = tmp_path_factory.mktemp("kquants")
    return {recipe: kquants.requantize_gguf(gguf_path, folder / f"smollm2-{recipe}.gguf", recipe)
            for recipe in ("Q4_K_M", "Q6_K")}


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["Q4_K_M", "Q6_K"])
def test_embedded_model_requantized_matches_transformers_and_answers(recipe, requantized):
    import transformers

    path = requantized[recipe]
    types = {t.tensor_type.name for t in gguf_loader_open(path).tensors}
    assert {"Q4_K", "Q6_K", "Q5_0", "Q8_0"} >= types - {"F32"} and ("Q4_K" in types) == (recipe == "Q4_K_M")
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                            dtype=torch.float32).eval()
    llm = LLM(str(path), dtype="float32", kv_cache_memory="64MiB", max_model_len=512, quantization="none")
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    for prompt in ("The capital of France is", "def fibonacci(n):", "Once upon a time, in 1987,"):
        ids = llm.tokenizer.encode(prompt)
        assert llm.generate([ids], greedy, use_tqdm=False)[0].outputs[0].token_ids == tm.hf_greedy(ref, ids, 16)
    # the default mode runs the file's blocks (Q4_K as Q4_1, Q5_0 as Q8_0, Q6_K requantized to Q8_0) and
    # answers as the float weights do. Q6_K keeps the README's answer; Q4_K_M's extra noise loses it on this
    # 135M model in every mode, transformers' too (the float answer above is theirs, token for token), so
    # there the check is that the blocks' answer begins as the floats' does.
    auto = LLM(str(path), kv_cache_memory="64MiB", max_model_len=512)
    assert auto.engine.quantization == "gguf"
    question = [{"role": "user", "content": "What is the capital of France?"}]
    short = SamplingParams(temperature=0.0, max_tokens=24)
    answer = auto.chat(question, short, use_tqdm=False)[0].outputs[0]
    floats = llm.chat(question, short, use_tqdm=False)[0].outputs[0]
    assert answer.token_ids[:8] == floats.token_ids[:8], (answer.text, floats.text)
    if recipe == "Q6_K":
        assert "Paris" in answer.text, answer.text


def gguf_loader_open(path):  # noqa: ANN001, ANN201
    from tokenmill.models.gguf_loader import open_gguf

    return open_gguf(path)


# ---- tokenmill inspect ----------------------------------------------------------------------------


def test_inspect_describes_files_and_folders_from_their_headers(tmp_path, capsys):
    import json

    from tokenmill.cli import main
    from tokenmill.layers.kernels import cpu_kernels

    model, path = _kquant_model(tmp_path, "Q4_K")
    assert main(["inspect", str(path), "--json", "--tensors"]) == 0
    d = json.loads(capsys.readouterr().out)
    cfg = model.config
    assert (d["format"], d["architecture"], d["layers"], d["hidden_size"], d["kv_heads"]) == (
        "gguf", "llama", cfg.num_hidden_layers, cfg.hidden_size, cfg.num_key_value_heads)
    assert d["parameters"] == sum(p.numel() for p in model.parameters())
    assert d["tensor_types"]["Q4_K"] == 7 * cfg.num_hidden_layers and d["unsupported_types"] == []
    assert d["quantization_auto"] == ("gguf" if cpu_kernels() is not None else "none")
    q = next(t for t in d["tensors"] if t["name"] == "blk.0.attn_q.weight")
    assert q["type"] == "Q4_K" and q["shape"] == [cfg.hidden_size, cfg.hidden_size]
    folder = tm.save_hf_folder(model, tmp_path / "hf")
    assert main(["inspect", str(folder)]) == 0
    text = capsys.readouterr().out
    assert "hf (" in text and "F32 x" in text and "--quantization auto runs it as: none" in text
    assert main(["inspect", str(tmp_path / "missing.gguf")]) == 2
    assert "not an existing .gguf file" in capsys.readouterr().err
