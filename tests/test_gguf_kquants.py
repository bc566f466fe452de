"""K-quant and Q5 GGUF files, the types llama.cpp's Q4_K_M / Q6_K / Q5 recipes write: dequantized by
gguf-py (the reference), run by the kernels on their own blocks (Q5_0, Q4_K, Q5_K, Q6_K, exactly), on
random blocks against the kernels' torch reference bit for bit, on tiny random models against
transformers and on the embedded model requantized by the recipes (tests/kquants.py writes the blocks)."""

from __future__ import annotations

import os

import gguf
import numpy as np
import pytest
import torch

import kquants
import tiny_models as tm
from helpers import PRECISIONS, activations, needs_kernels, prefill_logits
from tokenmill import LLM, SamplingParams
from tokenmill.layers.panels import PANEL_FORMATS
from tokenmill.layers.quant import (FORMAT_IDS, QuantizedEmbedding, QuantizedLinear, QuantizedTensor, StackedLinear,
                                    common_format, dequantize_rows, q4_k_to_q5_k, q5_0_to_q8_0, ref_qlinear, to_format)

T = gguf.GGMLQuantizationType
K_TYPES = ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]
# scale of each type's random blocks: weights of about 0.1 at most, as in the tiny models
BLOCK_SCALE = {"Q2_K": 2e-3, "Q3_K": 8e-4, "Q4_K": 1e-4, "Q5_K": 5e-5, "Q6_K": 3e-5}
WIDE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)  # rows of 256
# the GGUF types the kernels run on their own blocks (besides Q8_0 and Q4_1), and the shapes tried: rows not
# a multiple of the tiles (4, 2) or panels (16); Q5_0 with 3 and 19 blocks of 32 (a short last group of 8)
NATIVE = {"Q5_0": "q5_0", "Q4_K": "q4_k", "Q5_K": "q5_k", "Q6_K": "q6_k"}
SHAPES = {"Q5_0": [(37, 96), (45, 608)], "Q4_K": [(37, 512), (45, 768)], "Q5_K": [(37, 512), (45, 768)],
          "Q6_K": [(37, 512), (45, 768)]}


def gguf_dequant(blocks: np.ndarray, kind: str, shape: tuple[int, int]) -> torch.Tensor:
    return torch.from_numpy(np.asarray(gguf.quants.dequantize(blocks, getattr(T, kind)), np.float32).reshape(shape))


def _native(kind: str, n: int, k: int, seed: int) -> QuantizedTensor:
    return QuantizedTensor(torch.from_numpy(kquants.random_blocks(kind, n, k, seed=seed, scale=1e-2)), NATIVE[kind],
                           (n, k))


def _layouts(qt: QuantizedTensor) -> list[tuple[QuantizedTensor, torch.Tensor, int]]:
    """(weight, its kernel bytes, kernel format id): the row layout and, for Q4_K, Q5_K and Q6_K, the panels of 8 rows
    on the matrix's first rows down to a multiple of 8 (37 -> 32: two panels of 16; 45 -> 40: a last of 8)."""
    out = [(qt, qt.kernel_layout(), FORMAT_IDS[qt.fmt])]
    if qt.fmt in PANEL_FORMATS:
        n8, k = qt.shape[0] // 8 * 8, qt.shape[1]
        q8 = QuantizedTensor(qt.data[:n8].contiguous(), qt.fmt, (n8, k))
        out.append((q8, q8.kernel_layout(panels=True), FORMAT_IDS[PANEL_FORMATS[qt.fmt]]))
    return out


# ---- the blocks ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", NATIVE)
def test_native_blocks_dequantize_as_gguf_py_does(kind):
    for i, (n, k) in enumerate(SHAPES[kind]):
        qt = _native(kind, n, k, seed=i)
        assert torch.equal(qt.dequantize(), gguf_dequant(qt.data.numpy(), kind, (n, k)))
        assert qt.nbytes == n * k // (32 if kind == "Q5_0" else 256) * kquants.BLOCK_BYTES[kind]  # the file's bytes
        packed = qt.kernel_layout()
        assert packed.shape == qt.data.shape and packed.data_ptr() != qt.data.data_ptr()
        assert torch.equal(QuantizedTensor.from_kernel_layout(packed, qt.fmt, qt.shape).data, qt.data)
    if kind == "Q5_0":  # and blocks from gguf-py's own quantizer
        w = np.random.default_rng(2).standard_normal((5, 96)).astype(np.float32)
        blocks = gguf.quants.quantize(w, T.Q5_0)
        assert torch.equal(dequantize_rows(torch.from_numpy(blocks), "q5_0", 96), gguf_dequant(blocks, "Q5_0", w.shape))


def test_mixed_fused_parts_convert_exactly_where_one_format_holds_both():
    """A fused q/k/v whose parts differ (llama.cpp gives v more bits) runs in one format where that is exact."""
    q50 = _native("Q5_0", 6, 256, seed=5)
    q8 = QuantizedTensor(torch.from_numpy(gguf.quants.quantize(np.random.default_rng(6).standard_normal(
        (3, 256)).astype(np.float32), T.Q8_0)), "q8_0", (3, 256))
    q4k, q5k, q6k = (_native(kind, 4, 256, seed=7) for kind in ("Q4_K", "Q5_K", "Q6_K"))
    assert common_format(["q5_0", "q5_0", "q8_0"]) == "q8_0" and common_format(["q4_k", "q5_k"]) == "q5_k"
    assert common_format(["q4_k", "q6_k"]) is None and common_format(["q4_1", "q8_0"]) is None
    for part, fmt in ((q50, "q8_0"), (q8, "q8_0"), (q4k, "q5_k"), (q5k, "q5_k")):
        assert torch.equal(to_format(part, fmt).dequantize(), part.dequantize())
    assert torch.equal(dequantize_rows(q5_0_to_q8_0(q50.data, 256), "q8_0", 256), q50.dequantize())
    assert torch.equal(dequantize_rows(q4_k_to_q5_k(q4k.data, 256), "q5_k", 256), q4k.dequantize())
    assert q6k.fmt == "q6_k"


def test_test_quantizers_write_blocks_gguf_py_reads_back():
    w = np.random.default_rng(3).standard_normal((4, 512)).astype(np.float32) * 0.05
    for quantize, kind, tol in ((kquants.quantize_q4_k, "Q4_K", 0.1), (kquants.quantize_q6_k, "Q6_K", 0.03)):
        back = gguf_dequant(quantize(w), kind, w.shape).numpy()
        assert np.sqrt(((back - w) ** 2).mean() / (w ** 2).mean()) < tol, kind


# ---- the kernels on them --------------------------------------------------------------------------------


def _isas(ops) -> list[str]:
    before = ops.kernel_isa("")
    try:
        return ["avx2", ops.kernel_isa("avx512vnni")]
    except RuntimeError:
        return ["avx2"]
    finally:
        ops.kernel_isa(before)


@needs_kernels
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("kind", NATIVE)
def test_kernel_on_native_blocks_is_its_reference_bit_for_bit(kind, precision):
    """The kernel's result is ref_qlinear's, bit for bit, for every batch size from 1 to 40 (so a token's row
    does not depend on the batch) and on both instruction sets (AVX2 below the crossing, AVX512-VNNI panels
    from it where the CPU has them, VNNI for every batch size, and AVX2 throughout when forced), in the row
    layout and, for Q4_K, Q5_K and Q6_K, in panels of 8 rows (whose GEMV, many-token GEMM and VNNI widening differ);
    with int16 activations and with int8 (the panels then skip the low byte's products)."""
    from tokenmill.layers.kernels import cpu_kernels

    ops = cpu_kernels()
    before, crossing = ops.kernel_isa(""), ops.vnni_min_tokens(0)
    cases = [(i, *layout) for i, (n, k) in enumerate(SHAPES[kind]) for layout in _layouts(_native(kind, n, k, 10 + i))]
    for i, qt, packed, fid in cases:
        n, k = qt.shape
        torch.manual_seed(i)
        x = torch.randn(40, k) * 3
        x[3] = 0  # a token of zeros, and a zero block
        x[5, :32] = 0
        ref = ref_qlinear(x, qt, int8=precision == "int8")
        with activations(precision):
            try:
                for isa, first in [(isa, first) for isa in _isas(ops) for first in (crossing, 1)]:
                    ops.kernel_isa(isa)
                    ops.vnni_min_tokens(first)
                    full = ops.qlinear(x, packed, n, fid)
                    assert torch.equal(full, ref), (isa, first, fid, (full - ref).abs().max().item())
                    for m in range(1, 40):
                        assert torch.equal(ops.qlinear(x[:m], packed, n, fid), full[:m]), (isa, first, fid, m)
                    assert torch.equal(ops.qlinear(x[17:35], packed, n, fid), full[17:35]), (isa, first, fid)
            finally:
                ops.kernel_isa(before)
                ops.vnni_min_tokens(crossing)
            threads = torch.get_num_threads()
            try:
                torch.set_num_threads(1)
                assert torch.equal(ops.qlinear(x[2:30], packed, n, fid), ref[2:30])
            finally:
                torch.set_num_threads(threads)
        # and the int16 activations cost almost nothing against the float product with the same weights (int8's
        # 127 steps about 0.6%)
        dense = x.double() @ qt.dequantize().double().t()
        assert ((ref - dense).norm() / dense.norm()).item() < (2e-4 if precision == "int16" else 1e-2)


@needs_kernels
@pytest.mark.parametrize("kind", ["Q4_K", "Q5_K", "Q6_K"])
def test_panels_hold_the_rows_byte_for_byte(kind):
    """Panels of 8 rows are the row blocks reordered: back to rows exactly; a layer keeps them where its rows
    are a multiple of 8, and its weight, the embedding looked up from it and its output are the row layout's."""
    from tokenmill.layers.kernels import cpu_kernels
    from tokenmill.layers.panels import to_panels

    qt = _native(kind, 40, 768, seed=3)
    panels = qt.kernel_layout(panels=True)  # the kernels' repacking, against the torch reference
    assert torch.equal(panels, to_panels(qt.data, qt.fmt, qt.shape))
    assert panels.numel() == qt.data.numel() and not torch.equal(panels.reshape(-1), qt.data.reshape(-1))
    assert torch.equal(QuantizedTensor.from_kernel_layout(panels, PANEL_FORMATS[qt.fmt], (40, 768)).data, qt.data)
    lin, odd = QuantizedLinear(qt), QuantizedLinear(QuantizedTensor(qt.data[:37].contiguous(), qt.fmt, (37, 768)))
    assert (lin.kernel_fmt, odd.kernel_fmt) == (PANEL_FORMATS[qt.fmt], qt.fmt)
    assert torch.equal(lin.weight.data, qt.data)
    ids = torch.tensor([[0, 7, 8, 39], [15, 16, 33, 8]])
    assert torch.equal(QuantizedEmbedding(lin)(ids), qt.dequantize()[ids])
    ops, fid = cpu_kernels(), FORMAT_IDS[PANEL_FORMATS[qt.fmt]]  # the rows the embedding takes out of panels
    assert torch.equal(ops.panel_rows(panels, fid, 768, torch.arange(40).flip(0)), qt.data.flip(0))
    with pytest.raises(RuntimeError, match=r"row 40 outside \[0, 40\)"):
        ops.panel_rows(panels, fid, 768, torch.tensor([3, 40]))
    x = torch.randn(3, 768)
    assert torch.equal(lin(x), ref_qlinear(x, qt))
    # a matrix of over a MiB: its GEMV takes chunks of panels in turn across threads (gemm_x8), the same bits
    big = _native(kind, 2048, 1024, seed=4)
    x = torch.randn(3, 1024)
    ref = ref_qlinear(x, big)
    for m in (1, 2, 3):
        assert torch.equal(QuantizedLinear(big)(x[:m]), ref[:m]), m


def _extreme_blocks(kind: str, n: int, k: int) -> np.ndarray:
    """Blocks whose every product is as large as the type allows (the int32 sums' worst case)."""
    blocks = kquants.random_blocks(kind, n, k, seed=0, scale=1.0)
    if kind == "Q5_0":
        blocks.reshape(-1, 22)[:, 2:] = 0  # q - 16 = -16 everywhere
    elif kind in ("Q4_K", "Q5_K"):
        blocks.reshape(-1, kquants.BLOCK_BYTES[kind])[:, 4:] = 0xFF  # sc = m = 63, q = 15 (31)
    else:
        b = blocks.reshape(-1, 210)
        b[:, :192] = 0  # q - 32 = -32
        b[:, 192:208] = 0x80  # scales -128
        b[1::2, :192] = 0xFF  # and q - 32 = 31 on every other row (the panels' products of q = 63 and 255)
    return blocks


@needs_kernels
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("kind", NATIVE)
def test_kernel_on_extreme_blocks_and_activations(kind, precision):
    from tokenmill.layers.kernels import cpu_kernels

    ops = cpu_kernels()
    n, k = 17, 512
    qt = QuantizedTensor(torch.from_numpy(_extreme_blocks(kind, n, k)), NATIVE[kind], (n, k))
    x = torch.ones(20, k)  # every activation 32767 (or -32767) steps; int8: 127 steps, held as 32512
    x[1::2] = -1
    ref = ref_qlinear(x, qt, int8=precision == "int8")
    before, crossing = ops.kernel_isa(""), ops.vnni_min_tokens(0)
    try:
        with activations(precision):
            for isa, first in [(isa, first) for isa in _isas(ops) for first in (crossing, 1)]:
                ops.kernel_isa(isa)
                ops.vnni_min_tokens(first)
                for q, packed, fid in _layouts(qt):
                    for m in (1, 5, 20):
                        got = ops.qlinear(x[:m], packed, q.shape[0], fid)
                        assert torch.equal(got, ref[:m, :q.shape[0]]), (isa, fid, m)
    finally:
        ops.kernel_isa(before)
        ops.vnni_min_tokens(crossing)
    dense = x.double() @ qt.dequantize().double().t()
    assert ((ref - dense).abs() <= 1e-5 * dense.abs()).all()


@needs_kernels
def test_the_vnni_crossing_is_timed_or_set(monkeypatch):
    """Timing the crossing leaves the kernels as they were; forcing AVX2 skips it; the variable is read and
    checked (a bad value is an error for the user, not a reason to run without the kernels)."""
    from tokenmill.layers.kernels import _vnni_crossing, cpu_kernels, vnni_min_tokens_from_env

    ops = cpu_kernels()
    before, crossing = ops.kernel_isa(""), ops.vnni_min_tokens(0)
    try:
        found = _vnni_crossing(ops)
        assert (ops.kernel_isa(""), ops.vnni_min_tokens(0)) == (before, crossing)
        assert 4 <= found <= 16 if before == "avx512vnni" else found == 16
        ops.kernel_isa("avx2")
        assert _vnni_crossing(ops) == 16 and ops.kernel_isa("") == "avx2"
    finally:
        ops.kernel_isa(before)
    monkeypatch.delenv("TOKENMILL_VNNI_MIN_TOKENS", raising=False)
    assert vnni_min_tokens_from_env() is None
    monkeypatch.setenv("TOKENMILL_VNNI_MIN_TOKENS", "12")
    assert vnni_min_tokens_from_env() == 12
    for bad in ("many", "0", "²"):
        monkeypatch.setenv("TOKENMILL_VNNI_MIN_TOKENS", bad)
        with pytest.raises(ValueError, match="TOKENMILL_VNNI_MIN_TOKENS must be a positive integer"):
            vnni_min_tokens_from_env()
    with pytest.raises(RuntimeError, match="n must be >= 0"):
        ops.vnni_min_tokens(-1)
    # in a fresh process: the bad value stops the load with its message; a good one is the crossing
    import subprocess
    import sys

    code = "from tokenmill.layers.kernels import cpu_kernels; print(cpu_kernels().vnni_min_tokens(0))"
    for value, ok in (("many", False), ("5", True)):
        run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             env={**os.environ, "TOKENMILL_VNNI_MIN_TOKENS": value})
        if ok:
            assert run.returncode == 0 and run.stdout.strip() == "5", run.stderr[-500:]
        else:
            assert run.returncode != 0 and "TOKENMILL_VNNI_MIN_TOKENS must be a positive integer" in run.stderr


# ---- tiny random models, every type, against transformers -------------------------------------------


def _kquant_model(tmp_path, kind: str, seed: int = 3, v_kind: str | None = None, top: dict | None = None,
                  **overrides):
    """A tiny Llama whose decoder weights are ``kind`` blocks (random ones for the K types, gguf-py's
    quantization for Q5_0/Q5_1; the embedding F32; v_proj ``v_kind`` where given; ``top``: the embedding's
    and an untied head's types by HF name), as a GGUF file, and the transformers model holding exactly the
    values the file does."""
    model = tm.random_hf_model("llama", seed=seed, **WIDE, **overrides)
    cfg, base, top = model.config, kind, top or {}
    tensors = tm.hf_to_gguf_tensors(model, None, permute=True)  # norms and embedding as they are
    with torch.no_grad():
        for i, (name, p) in enumerate(model.named_parameters()):
            if name not in top and (not name.startswith("model.layers.") or p.dim() != 2):
                continue
            kind = top.get(name) or (v_kind if v_kind and name.endswith("v_proj.weight") else base)
            if kind in K_TYPES:
                blocks = kquants.random_blocks(kind, *p.shape, seed=seed + i, scale=BLOCK_SCALE[kind])
            else:
                blocks = gguf.quants.quantize(p.numpy(), getattr(T, kind))
            p.copy_(gguf_dequant(blocks, kind, tuple(p.shape)))  # the reference holds the stored values
            if name.endswith("q_proj.weight"):  # rows of blocks permuted as llama.cpp stores q and k
                blocks = tm.llama_cpp_permute(blocks, cfg.num_attention_heads)
            elif name.endswith("k_proj.weight"):
                blocks = tm.llama_cpp_permute(blocks, cfg.num_key_value_heads)
            tensors[tm.gguf_name(name)] = (blocks, getattr(T, kind))
    return model, tm.write_gguf(tmp_path / f"{base}.gguf", tensors, metadata=tm.llama_metadata(cfg))


@pytest.mark.parametrize("kind", [*K_TYPES, "Q5_0", "Q5_1"])
def test_tiny_model_in_each_type_matches_transformers(kind, tmp_path):
    model, path = _kquant_model(tmp_path, kind)
    ids = list(range(5, 45))
    llm = LLM(str(path), dtype="float32", kv_cache_memory="16MiB", quantization="none")
    ours, ref = prefill_logits(llm.engine, ids), tm.hf_logits(model, ids)
    assert ((ours - ref).abs().max() / ref.abs().max()).item() < 1e-4
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    assert llm.generate([ids], greedy, use_tqdm=False)[0].outputs[0].token_ids == tm.hf_greedy(model, ids, 8)
    # a file of quantized layers runs as gguf by default: on its own blocks where the kernels have them
    auto = LLM(str(path), dtype="float32", kv_cache_memory="16MiB")
    if auto.engine.quantization != "gguf":  # no integer kernels here
        return
    down = auto.engine.runner.model.layers[0].mlp.down_proj
    assert isinstance(down, QuantizedLinear)
    assert down.fmt == NATIVE.get(kind, "q8_0")  # Q5_1, Q2_K, Q3_K dequantized and requantized to Q8_0
    got = prefill_logits(auto.engine, ids)
    rel = ((got - ours).norm(dim=-1) / ours.norm(dim=-1)).max().item()
    assert rel < 0.02, rel  # mostly the float (F32) tied head, which this mode quantizes to Q8_0


def test_a_fused_layer_in_two_formats_runs_each_part_on_its_own_blocks(tmp_path):
    """llama.cpp's Q4_K_M gives v_proj Q6_K beside Q4_K q and k, and no one format holds both exactly: q|k run on
    their Q4_K blocks and v on its Q6_K ones, side by side (StackedLinear), with the file's bytes; the fused
    kernels (forward_layers, attention_half's w[4]) give the op-by-op bits; against transformers as above."""
    model, path = _kquant_model(tmp_path, "Q4_K", v_kind="Q6_K")
    ids = list(range(5, 45))
    llm = LLM(str(path), dtype="float32", kv_cache_memory="16MiB")
    if llm.engine.quantization != "gguf":  # no integer kernels here
        pytest.skip("the CPU kernels are unavailable")
    net = llm.engine.runner.model
    qkv = net.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, StackedLinear) and [p.fmt for p in qkv.parts] == ["q4_k", "q6_k"]
    file_bytes = {t.name: int(t.n_bytes) for t in gguf_loader_open(path).tensors}
    assert qkv.parts[1].qweight.numel() == file_bytes["blk.0.attn_v.weight"]
    assert net.layers[0].fused_halves()[0] is not None
    fused = prefill_logits(llm.engine, ids)
    net.set_layer_fusion(False)
    try:
        assert torch.equal(prefill_logits(llm.engine, ids), fused)
    finally:
        net.set_layer_fusion(True)
    ref = tm.hf_logits(model, ids)
    rel = ((fused - ref).norm(dim=-1) / ref.norm(dim=-1)).max().item()
    assert rel < 0.02, rel  # mostly the float (F32) tied head, which this mode quantizes to Q8_0


def test_an_untied_embedding_is_looked_up_in_the_files_own_blocks(tmp_path):
    """An untied model (Llama 3.1 8B, Qwen2.5 7B) in gguf mode keeps its Q4_K token_embd as the file's bytes and
    looks rows up there, as the tied head's embedding is: no float copy (4 bytes x vocabulary x hidden, 805 MB
    at the 8B shape here). The rows are exactly the float loader's; the model against transformers as above."""
    top = {"model.embed_tokens.weight": "Q4_K", "lm_head.weight": "Q6_K"}
    model, path = _kquant_model(tmp_path, "Q4_K", top=top, tie_word_embeddings=False, vocab_size=512)
    llm = LLM(str(path), dtype="float32", kv_cache_memory="16MiB")
    if llm.engine.quantization != "gguf":  # no integer kernels here
        pytest.skip("the CPU kernels are unavailable")
    net = llm.engine.runner.model
    emb = net.embed_tokens
    assert isinstance(emb, QuantizedEmbedding) and emb.fmt == "q4_k" and emb.blocks is not net.head
    assert emb.qweight.numel() == {t.name: int(t.n_bytes) for t in gguf_loader_open(path).tensors}["token_embd.weight"]
    ids = torch.tensor([0, 5, 17, 300, 511, 5])
    assert torch.equal(net.embed(ids), model.model.embed_tokens.weight[ids])  # the file's values, exactly
    ref, ours = tm.hf_logits(model, list(range(5, 45))), prefill_logits(llm.engine, list(range(5, 45)))
    assert ((ours - ref).norm(dim=-1) / ref.norm(dim=-1)).max().item() < 0.01


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
    # the default mode runs the file's own blocks, all of them exactly (a fused q/k/v of Q5_0 q and k with a
    # Q8_0 v as Q8_0), so the weights take the file's bytes, and answers as the float weights do. Q6_K keeps
    # the README's answer; Q4_K_M's extra noise loses it on this 135M model in every mode, transformers' too
    # (the float answer above is theirs, token for token), so there the check is that the blocks' answer
    # begins as the floats' does.
    auto = LLM(str(path), kv_cache_memory="64MiB", max_model_len=512)
    assert auto.engine.quantization == "gguf"
    model = auto.engine.runner.model
    layer = model.layers[0]
    fmts = (layer.self_attn.qkv_proj.fmt, layer.self_attn.o_proj.fmt, layer.mlp.gate_up_proj.fmt)
    assert fmts == (("q8_0", "q5_0", "q5_0") if recipe == "Q4_K_M" else ("q8_0",) * 3), fmts
    downs = [lyr.mlp.down_proj.fmt for lyr in model.layers[:2]]  # rows of 1536: the K types themselves
    assert downs == (["q6_k", "q4_k"] if recipe == "Q4_K_M" else ["q6_k", "q6_k"]), downs
    file_bytes = {t.name: int(t.n_bytes) for t in gguf_loader_open(path).tensors}
    assert layer.mlp.gate_up_proj.qweight.numel() == file_bytes["blk.0.ffn_gate.weight"] + file_bytes[
        "blk.0.ffn_up.weight"]
    assert model.layers[1].mlp.down_proj.qweight.numel() == file_bytes["blk.1.ffn_down.weight"]
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
