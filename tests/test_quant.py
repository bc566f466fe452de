"""Quantized weights: formats, the AVX2 kernel against its torch reference, the GGUF blocks kept as
they are, and the quantized model against the float one."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import tiny_models as tm
from helpers import PRECISIONS, activations, needs_kernels
from tokenmill.layers.kernels import cpu_kernels, kernels_expected, unavailable_reason
from tokenmill.layers.panels import to_panels
from tokenmill.layers.quant import (FORMAT_IDS, QuantizedLinear, QuantizedTensor, dequantize_rows,
                                    q4_0_to_q4_1, quantize_int4, quantize_int8, quantize_q8_0,
                                    ref_quantize_activations, ref_qlinear)

QUANTIZERS = {"int8": quantize_int8, "q8_0": quantize_q8_0, "int4": quantize_int4}


def test_kernels_build_where_they_should():
    """On x86-64 with AVX2 and a compiler the kernels are the default path: their absence is a failure."""
    if kernels_expected():
        assert cpu_kernels() is not None, unavailable_reason()


def test_activation_precision_is_checked_where_it_is_given(monkeypatch):
    from tokenmill.cli import build_parser
    from tokenmill.config import EngineConfig
    from tokenmill.engine.arg_utils import engine_kwargs
    from tokenmill.layers.kernels import activation_precision_from_env, apply_activation_precision, set_activation_precision

    with pytest.raises(ValueError, match="int16 or int8"):
        EngineConfig(activation_precision="int4")
    with pytest.raises(ValueError, match="must be one of int16, int8"):
        set_activation_precision("fp8")
    monkeypatch.setenv("TOKENMILL_ACTIVATIONS", "fp8")
    with pytest.raises(ValueError, match="TOKENMILL_ACTIVATIONS must be one of int16, int8"):
        activation_precision_from_env()
    monkeypatch.delenv("TOKENMILL_ACTIVATIONS")
    assert activation_precision_from_env() == "int16"
    with pytest.raises(ValueError, match="applies to tokenmill's CPU kernels; on cuda:0 leave it at int16"):
        apply_activation_precision("int8", torch.device("cuda:0"))  # refused before anything touches the GPU
    assert apply_activation_precision(None, torch.device("cuda:0")) == "int16"
    a = build_parser().parse_args(["generate", "hi", "--activation-precision", "int8"])
    assert engine_kwargs(a)["activation_precision"] == "int8"
    assert engine_kwargs(build_parser().parse_args(["generate", "hi"]))["activation_precision"] is None


def test_quantizers_round_trip_within_their_step():
    torch.manual_seed(0)
    w = torch.randn(64, 256)
    for name, q in QUANTIZERS.items():
        qw = q(w)
        err = (qw.dequantize() - w).abs()
        blocks = w.view(64, -1, 32)
        if name == "int4":  # half a step of (max - min) / 15 per block, plus fp16 rounding of d and m
            step = (blocks.amax(-1) - blocks.amin(-1)) / 15
        elif name == "int8":  # one scale per row
            step = (w.abs().amax(1) / 127)[:, None].expand(64, 8)
        else:
            step = blocks.abs().amax(-1) / 127
        assert torch.all(err.view(64, -1, 32) <= (0.5 * step + 2e-3 * blocks.abs().amax(-1))[..., None])
        assert qw.nbytes == 64 * 8 * (20 if name == "int4" else 34)
    # int8 shares one scale per row across its blocks
    d = quantize_int8(w).blocks()[..., 0:2]
    assert torch.equal(d, d[:, :1].expand_as(d))


def test_q4_0_converts_to_q4_1_without_loss():
    import gguf

    rng = np.random.default_rng(0)
    w = rng.standard_normal((8, 64)).astype(np.float32)
    raw = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q4_0)
    want = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q4_0)
    got = dequantize_rows(q4_0_to_q4_1(torch.from_numpy(raw), 64), "q4_1", 64)
    assert torch.equal(got, torch.from_numpy(np.asarray(want, dtype=np.float32)))


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_1"])
def test_our_blocks_are_ggufs_layout(kind):
    import gguf

    rng = np.random.default_rng(1)
    w = rng.standard_normal((4, 96)).astype(np.float32)
    t = getattr(gguf.GGMLQuantizationType, kind)
    raw = gguf.quants.quantize(w, t)
    ours = dequantize_rows(torch.from_numpy(raw), kind.lower(), 96)  # gguf's bytes, read our way
    assert torch.equal(ours, torch.from_numpy(np.asarray(gguf.quants.dequantize(raw, t), np.float32)))
    # and our quantizer lands within one step of gguf's (it rounds with the stored fp16 scale)
    mine = quantize_q8_0(torch.from_numpy(w)) if kind == "Q8_0" else quantize_int4(torch.from_numpy(w))
    step = np.abs(w).max() / (127 if kind == "Q8_0" else 7)
    assert (mine.dequantize() - ours).abs().max() <= step


def test_bad_quantized_data_is_refused():
    with pytest.raises(ValueError, match="divisible by 32"):
        QuantizedTensor(torch.zeros(2, 34, dtype=torch.uint8), "q8_0", (2, 33))
    with pytest.raises(ValueError, match="must be uint8"):
        QuantizedTensor(torch.zeros(2, 30, dtype=torch.uint8), "q8_0", (2, 32))
    with pytest.raises(ValueError, match="unknown quantized format"):
        QuantizedTensor(torch.zeros(2, 34, dtype=torch.uint8), "q3_k", (2, 32))
    with pytest.raises(ValueError, match="divisible by 256"):
        QuantizedTensor(torch.zeros(2, 144, dtype=torch.uint8), "q4_k", (2, 288))


@needs_kernels
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("fmt", ["int8", "q8_0", "int4"])
@pytest.mark.parametrize("m", [1, 2, 5, 17, 70])
@pytest.mark.parametrize("k", [192, 96, 608])
def test_kernel_matches_its_reference(fmt, m, k, precision):
    # N not a multiple of the tile; K / 32 = 6, 3 (odd: an unpaired last block), 19 (a partial scale group)
    torch.manual_seed(m)
    n = 37
    qw = QUANTIZERS[fmt](torch.randn(n, k))
    x = torch.randn(m, k) * 3
    with activations(precision):
        y = cpu_kernels().qlinear(x, qw.kernel_layout(), n, FORMAT_IDS[qw.fmt])
    ref = ref_qlinear(x, qw, int8=precision == "int8")
    assert torch.equal(y, ref), (y - ref).abs().max().item()  # the reference is the kernel's arithmetic, bit for bit
    # and the int16 activations cost almost nothing against the float product with the same weights (int8's
    # 127 steps about 0.6%)
    dense = x @ qw.dequantize().t()
    assert (y - dense).norm() / dense.norm() < (2e-4 if precision == "int16" else 1e-2)


@pytest.mark.parametrize("fmt", ["q8_0", "int4"])
def test_kernel_layout_round_trips(fmt):
    qw = QUANTIZERS[fmt](torch.randn(5, 96))
    packed = qw.kernel_layout()
    assert packed.shape == qw.data.shape and not torch.equal(packed, qw.data)
    back = QuantizedTensor.from_kernel_layout(packed, qw.fmt, qw.shape)
    assert torch.equal(back.data, qw.data)
    assert torch.equal(QuantizedLinear(qw).weight.data, qw.data)


@needs_kernels
@pytest.mark.parametrize("fmt", ["q8_0", "int4"])
def test_a_rows_result_does_not_depend_on_the_batch(fmt):
    """Batch invariance: token m's output row is the same bits whatever M, wherever m sits in the batch
    (tile boundaries) and however many threads share the GEMM."""
    torch.manual_seed(0)
    n, k = 45, 608  # a short last row tile, 19 blocks: a partial group of 8
    qw = QUANTIZERS[fmt](torch.randn(n, k))
    layer = QuantizedLinear(qw, torch.randn(n))
    x = torch.randn(300, k) * 2
    full = layer(x)
    for i, j in [(0, 1), (7, 8), (1, 4), (2, 7), (5, 70), (299, 300), (13, 300)]:
        assert torch.equal(layer(x[i:j]), full[i:j]), (i, j)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(layer(x[3:40]), full[3:40])
    finally:
        torch.set_num_threads(before)


@needs_kernels
@pytest.mark.parametrize("fmt", ["q8_0", "int4"])
def test_every_instruction_set_gives_the_same_bits(fmt):
    """The many-token GEMM has an AVX2 and an AVX512-VNNI form, chosen by CPU and batch size; both must give
    the same bits, or the choice (a batch growing past the threshold) would change a request's result."""
    ops = cpu_kernels()
    if "avx512vnni" not in {ops.kernel_isa(""), _vnni_or_none(ops)}:
        pytest.skip("this CPU has no AVX512-VNNI: only the AVX2 form exists here")
    torch.manual_seed(1)
    n, k = 45, 608
    qw = QUANTIZERS[fmt](torch.randn(n, k))
    x = torch.randn(64, k) * 2
    before = ops.kernel_isa("")
    try:
        ops.kernel_isa("avx2")
        y2 = ops.qlinear(x, qw.kernel_layout(), n, FORMAT_IDS[qw.fmt])
        ops.kernel_isa("avx512vnni")
        y5 = ops.qlinear(x, qw.kernel_layout(), n, FORMAT_IDS[qw.fmt])
    finally:
        ops.kernel_isa(before)
    assert torch.equal(y2, y5)
    with pytest.raises(RuntimeError, match="must be '', 'avx2' or 'avx512vnni'"):
        ops.kernel_isa("sse")


@needs_kernels
def test_q4_1_in_panels_gives_the_row_layouts_bits():
    """int4 (Q4_1) weights whose rows are a multiple of 8 and K of 256 run in panels of 8 rows (layers/panels.py):
    the reference's bits for every batch size on each instruction set (direct panels and VNNI's widened ones),
    and the rows come back byte for byte."""
    torch.manual_seed(2)
    n, k = 40, 768  # panels of 16 rows for VNNI: a last one half full
    qw = QUANTIZERS["int4"](torch.randn(n, k))
    layer = QuantizedLinear(qw)
    assert layer.kernel_fmt == "q4_1_x8" and torch.equal(layer.weight.data, qw.data)
    assert torch.equal(layer.qweight, to_panels(qw.data, "q4_1", (n, k)))  # the kernels' repacking is the reference's
    ids = torch.tensor([39, 0, 8, 17])  # and the rows an embedding looks up, out of the panels
    assert torch.equal(cpu_kernels().panel_rows(layer.qweight, FORMAT_IDS["q4_1_x8"], k, ids), qw.data[ids])
    assert QuantizedLinear(QUANTIZERS["int4"](torch.randn(n, 608))).kernel_fmt == "q4_1"  # K not of 256: rows
    x = torch.randn(24, k) * 2
    ops = cpu_kernels()
    before = ops.kernel_isa("")
    try:
        for precision in PRECISIONS:
            ref = ref_qlinear(x, qw, int8=precision == "int8")
            for isa in {"avx2", _vnni_or_none(ops)} - {None}:
                ops.kernel_isa(isa)
                with activations(precision):
                    for m in (1, 2, 3, 4, 7, 24):
                        assert torch.equal(layer(x[:m]), ref[:m]), (precision, isa, m)
    finally:
        ops.kernel_isa(before)


def _vnni_or_none(ops):
    before = ops.kernel_isa("")
    try:
        return ops.kernel_isa("avx512vnni")
    except RuntimeError:
        return None
    finally:
        ops.kernel_isa(before)


@needs_kernels
def test_kernel_activation_rounding_is_the_reference():
    x = torch.randn(9, 128) * 5
    x[0] = 0  # an all-zero block gets scale 0
    q, d, s = cpu_kernels().quantize_activations(x)
    rq, rd, rs = ref_quantize_activations(x)
    assert q.dtype == torch.int16 and torch.equal(q, rq) and torch.allclose(d, rd) and torch.allclose(s, rs, atol=1e-3)
    assert q.abs().max() == 32767


def test_layer_falls_back_to_dequantized_weights(monkeypatch):
    import tokenmill.layers.quant as quant

    torch.manual_seed(0)
    w, b, x = torch.randn(40, 64), torch.randn(40), torch.randn(3, 64)
    layer = QuantizedLinear(quantize_int4(w), b)
    monkeypatch.setattr(quant, "_ops", lambda: None)
    y = layer(x)
    assert torch.allclose(y, x @ layer.weight.dequantize().t() + b, atol=1e-5)


def test_tiny_model_quantized_stays_close(tmp_path):
    """int8 and int4 on a tiny random Llama: logits at every position stay close to the float model's."""
    from helpers import prefill_logits
    from tokenmill import LLM

    folder = tm.save_hf_folder(tm.random_hf_model("llama"), tmp_path / "m")
    prompt = list(range(3, 40))
    ref = prefill_logits(LLM(str(folder), dtype="float32", kv_cache_memory="16MiB").engine, prompt)
    for mode, tol in (("int8", 0.04), ("int4", 0.3)):
        engine = LLM(str(folder), dtype="float32", kv_cache_memory="16MiB", quantization=mode).engine
        assert isinstance(engine.runner.model.layers[0].mlp.down_proj, QuantizedLinear)
        got = prefill_logits(engine, prompt)
        rel = ((got - ref).norm(dim=-1) / ref.norm(dim=-1)).max().item()
        assert rel < tol, (mode, rel)
    with pytest.raises(ValueError, match="must be a .gguf file"):
        LLM(str(folder), dtype="float32", kv_cache_memory="16MiB", quantization="gguf")
    with pytest.raises(ValueError, match="quantization must be one of"):
        LLM(str(folder), quantization="int3")


@pytest.mark.slow
def test_gguf_mode_keeps_the_files_blocks(gguf_path):
    """--quantization gguf on the default model: each kept weight dequantizes to exactly what the float
    loader produced from the same file."""
    from tokenmill.config import ModelConfig  # noqa: F401 -- the loader's types
    from tokenmill.models.gguf_loader import gguf_model_config, gguf_quantized_weights, gguf_weights, open_gguf

    reader = open_gguf(gguf_path)
    cfg = gguf_model_config(reader)
    raw = gguf_quantized_weights(reader, cfg)
    assert {q.fmt for q in raw.values()} >= {"q4_1"}
    floats = dict(gguf_weights(reader, cfg))
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.3.mlp.down_proj.weight",
                 "model.embed_tokens.weight"):
        assert torch.equal(raw[name].dequantize(), floats[name]), name


def test_only_weights_whose_blocks_are_kept_skip_dequantization():
    """The loader leaves undequantized exactly the float weights quantize_model will not read: a fused
    layer's parts count only when all are kept (in one format or side by side), and the embedding is always
    read."""
    from tokenmill.models.quantize import kept_weight_names

    def q(fmt, n=32, k=64):
        return quantize_q8_0(torch.randn(n, k)) if fmt == "q8_0" else quantize_int4(torch.randn(n, k))

    assert q("q4_1").fmt == "q4_1"
    names = {f"model.layers.{i}.{m}.weight" for i in range(2)
             for m in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")}
    raw = {n: q("q4_1") for n in names} | {"model.layers.0.self_attn.v_proj.weight": q("q8_0"),
                                           "model.embed_tokens.weight": q("q8_0")}
    del raw["model.layers.1.self_attn.k_proj.weight"]  # a part in a format not kept (Q5_1, say)
    kept = kept_weight_names(raw, num_layers=2)
    assert {n for n in names if "layers.0" in n} <= kept  # layer 0's q/k Q4_1 beside a Q8_0 v, o_proj alone
    assert "model.layers.1.self_attn.o_proj.weight" in kept
    assert not any("layers.1.self_attn." + p in n for n in kept for p in ("q_proj", "k_proj", "v_proj"))
    assert "model.embed_tokens.weight" not in kept


# ---------------------------------------------------------------- KV-cache quantization

def test_kv_quantization_round_trip():
    from tokenmill.layers.attention import dequantize_kv, quantize_kv

    torch.manual_seed(0)
    x = torch.randn(7, 3, 64) * 4
    x[0, 0] = 0  # an all-zero head keeps a usable scale
    for store, tol in ((torch.int8, 0.5 / 127), (torch.uint8, 1 / 16)):  # int8: half a step; e4m3: 3 mantissa bits
        values, scale = quantize_kv(x, store)
        assert values.dtype == store and scale.shape == (7, 3)
        back = dequantize_kv(values, scale, torch.float32)
        amax = x.abs().amax(-1, keepdim=True)
        assert torch.all((back - x).abs() <= tol * torch.maximum(amax, x.abs()) + 1e-6)
        assert torch.equal(back[0, 0], torch.zeros(64))


def test_quantized_kv_cache_holds_more_and_stays_close(tmp_path):
    from helpers import prefill_logits
    from tokenmill import LLM, SamplingParams

    folder = tm.save_hf_folder(tm.random_hf_model("llama"), tmp_path / "m")
    prompt = list(range(3, 60))
    base = LLM(str(folder), dtype="float32", kv_cache_memory="4MiB")
    ref = prefill_logits(base.engine, prompt)
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)
    for kv_dtype in ("int8", "fp8"):
        llm = LLM(str(folder), dtype="float32", kv_cache_memory="4MiB", kv_cache_dtype=kv_dtype)
        # 1-byte values plus a 4-byte scale per head of 16 values, against 4-byte floats
        d = llm.engine.model_config.head_dim
        assert llm.engine.kv_bytes_per_token * 4 * d == base.engine.kv_bytes_per_token * (d + 4)
        assert llm.engine.kv_cache.num_blocks >= base.engine.kv_cache.num_blocks * 4 * d // (d + 4) - 1
        got = prefill_logits(llm.engine, prompt)
        rel = ((got - ref).norm(dim=-1) / ref.norm(dim=-1)).max().item()
        assert rel < (0.02 if kv_dtype == "int8" else 0.1), (kv_dtype, rel)
        # decode reads the quantized cache one token at a time: each greedy token is the float cache's
        # choice on the same tokens (teacher forced; a near-tie may go either way) and its logprob is close
        c = llm.generate([prompt], greedy, use_tqdm=False)[0].outputs[0]
        ref_lp = torch.log_softmax(prefill_logits(base.engine, prompt + c.token_ids)[len(prompt) - 1:-1], -1)
        chosen = ref_lp[torch.arange(len(c.token_ids)), torch.tensor(c.token_ids)]
        assert (ref_lp.max(-1).values - chosen).max().item() < 0.05, kv_dtype
        got_lp = torch.tensor([lp[t] for lp, t in zip(c.logprobs, c.token_ids)])
        assert (got_lp - chosen).abs().max().item() < (0.01 if kv_dtype == "int8" else 0.05), (kv_dtype, got_lp, chosen)
        assert llm.engine.kv_cache.num_free_blocks == llm.engine.kv_cache.num_blocks
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        LLM(str(folder), kv_cache_dtype="int4")


def test_perplexity_eval_on_a_tiny_model(tmp_path, capsys):
    from tokenmill.cli import main

    folder = tm.save_hf_folder(tm.random_hf_model("llama"), tmp_path / "m")
    text = tmp_path / "t.txt"
    text.write_text("to be or not to be, that is the question. " * 40)
    out = tmp_path / "ppl.json"
    args = ["eval", "perplexity", "--dataset", str(text), "--model", str(folder), "--dtype", "float32",
            "--kv-cache-memory", "8MiB", "--context-len", "64", "--num-tokens", "256", "--no-progress"]
    assert main(args + ["--output-json", str(out)]) == 0
    import json

    r = json.loads(out.read_text())
    assert r["windows"] == 4 and r["scored_tokens"] == 4 * 32
    assert 1 < r["perplexity"] < 10 * tm.VOCAB_SIZE
    # the same figure from the engine's own scores, computed here independently
    from tokenmill import LLM

    llm = LLM(str(folder), dtype="float32", kv_cache_memory="8MiB")
    ids = llm.tokenizer.encode(text.read_text(), add_special_tokens=False)[:256]
    nll = [-llm.engine.score(ids[i:i + 64])[31:].double() for i in range(0, 256, 64)]
    assert r["perplexity"] == pytest.approx(float(torch.cat(nll).mean().exp()), rel=1e-6)
    # prompt_logits (what score() reads): row i follows ids[:i + 1], as greedy decoding reads it
    from tokenmill import SamplingParams

    lg = llm.engine.prompt_logits(ids[:20])
    assert lg.shape == (19, llm.engine.model_config.vocab_size)
    first = llm.generate([ids[:19]], SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
    assert first[0].outputs[0].token_ids == [int(lg[-1].argmax())]
    assert llm.engine.kv_cache.num_free_blocks == llm.engine.kv_cache.num_blocks
    assert main(args[:3] + [str(tmp_path / "missing.txt")] + args[4:]) == 2
    assert "is not a file" in capsys.readouterr().err
