"""The fused CPU kernels of a decoder layer (RMSNorm, RoPE, SwiGLU, paged attention) against the torch
reference code they replace, op by op and through a whole engine, and their batch invariance."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F

import tiny_models as tm
from helpers import needs_kernels
from tokenmill.layers.attention import AttentionMetadata, PrefillChunk, TorchPagedAttention
from tokenmill.layers.kernels import cpu_kernels
from tokenmill.layers.rotary import RotaryEmbedding

pytestmark = needs_kernels


def test_rms_norm_and_silu_mul_match_torch():
    from tokenmill.models.llama import RMSNorm

    ops = cpu_kernels()
    torch.manual_seed(0)
    norm = RMSNorm(96, 1e-5)
    norm.weight.data = torch.randn(96)
    x = torch.randn(7, 96) * 3
    assert torch.allclose(ops.rms_norm(x, norm.weight, 1e-5), norm(x), rtol=1e-5, atol=1e-5)
    gu = torch.randn(5, 2 * 40) * 4
    assert torch.allclose(ops.silu_mul(gu), F.silu(gu[:, :40]) * gu[:, 40:], rtol=1e-5, atol=1e-6)


def test_rope_rotates_q_and_k_heads_in_place_and_leaves_v():
    ops = cpu_kernels()
    torch.manual_seed(0)
    t, h, hkv, d = 6, 4, 2, 16
    rope = RotaryEmbedding(d, 64, 10000.0, None)
    cos, sin = rope.tables(torch.tensor([0, 3, 9, 10, 30, 63]))
    qkv = torch.randn(t, (h + 2 * hkv) * d)
    q_ref, k_ref = RotaryEmbedding.apply(qkv[:, : h * d].reshape(t, h, d), qkv[:, h * d : (h + hkv) * d]
                                         .reshape(t, hkv, d), cos, sin)
    v_before = qkv[:, (h + hkv) * d :].clone()
    ops.rope_(qkv, cos.squeeze(1), sin.squeeze(1), h + hkv, d)
    assert torch.allclose(qkv[:, : h * d].reshape(t, h, d), q_ref, atol=1e-6)
    assert torch.allclose(qkv[:, h * d : (h + hkv) * d].reshape(t, hkv, d), k_ref, atol=1e-6)
    assert torch.equal(qkv[:, (h + hkv) * d :], v_before)


@contextlib.contextmanager
def torch_threads(n):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def decode_inputs(lens):
    """paged_attention's view of a decode step: token i is sequence i's last position."""
    return torch.arange(len(lens)), lens


@pytest.mark.parametrize("h,hkv", [(9, 3), (4, 1), (4, 4)])  # GQA, MQA, MHA
def test_paged_attention_on_decodes_matches_the_gathering_path(h, hkv):
    ops = cpu_kernels()
    torch.manual_seed(0)
    nb, bs, d = 50, 16, 32
    kc, vc = torch.randn(nb, bs, hkv, d), torch.randn(nb, bs, hkv, d)
    lens = torch.tensor([1, 16, 17, 100, 33])
    tables = torch.stack([torch.randperm(nb)[:7] for _ in lens])  # scattered, out-of-order blocks
    q = torch.randn(len(lens), h, d)
    meta = AttentionMetadata(None, len(lens), tables, lens, int(lens.max()), [])
    ref = TorchPagedAttention._decode(q, (kc, vc), meta, h // hkv)
    got = ops.paged_attention(q, kc, vc, tables, *decode_inputs(lens), d ** -0.5)
    assert torch.allclose(got, ref, atol=1e-5)
    with pytest.raises(RuntimeError, match="does not fit the block table"):
        ops.paged_attention(q, kc, vc, tables, torch.arange(5), torch.tensor([1, 1, 1, 1, 7 * bs + 1]), d ** -0.5)


@pytest.mark.parametrize("h,hkv", [(9, 3), (4, 1)])
@pytest.mark.parametrize("context", [0, 5, 300])
def test_paged_attention_on_a_prefill_chunk_matches_causal_sdpa(h, hkv, context):
    """A chunk of 40 tokens after `context` cached ones: each attends causally to the cache and the chunk."""
    ops = cpu_kernels()
    torch.manual_seed(context)
    nb, bs, d, n = 40, 16, 64, 40
    kc, vc = torch.randn(nb, bs, hkv, d), torch.randn(nb, bs, hkv, d)
    table = torch.randperm(nb)[:23]
    q = torch.randn(n, h, d) * 2
    k = kc.view(-1, hkv, d)[(table[None] * bs + torch.arange(bs)[:, None]).t().reshape(-1)][context:context + n]
    v = vc.view(-1, hkv, d)[(table[None] * bs + torch.arange(bs)[:, None]).t().reshape(-1)][context:context + n]
    ref = TorchPagedAttention._prefill(q, k, v, (kc, vc), PrefillChunk(0, n, context, table), h // hkv)
    pos = torch.arange(context, context + n)
    got = ops.paged_attention(q, kc, vc, table[None], torch.zeros(n, dtype=torch.long), pos + 1, d ** -0.5)
    assert torch.allclose(got, ref, atol=2e-5)


@pytest.mark.parametrize("h,hkv", [(9, 3), (4, 1)])
def test_paged_attention_is_batch_invariant(h, hkv):
    """A token's output is the same bits as a decode alone, inside a prefill chunk, beside other sequences,
    and with any thread count (contexts past one part of 256 tokens are split and merged)."""
    ops = cpu_kernels()
    torch.manual_seed(1)
    nb, bs, d = 80, 16, 64
    kc, vc = torch.randn(nb, bs, hkv, d), torch.randn(nb, bs, hkv, d) * 2
    tables = torch.stack([torch.randperm(nb)[:40] for _ in range(3)])
    q = torch.randn(600, h, d) * 3  # peaked softmax: the parts' maxima differ
    seq0 = torch.zeros(600, dtype=torch.long)
    chunk = ops.paged_attention(q, kc, vc, tables[:1], seq0, torch.arange(1, 601), d ** -0.5)  # one prefill
    for t in (0, 255, 256, 511, 599):  # decodes alone, at part boundaries
        for threads in (1, 2, 3):
            with torch_threads(threads):
                alone = ops.paged_attention(q[t:t + 1], kc, vc, tables[:1], seq0[:1], torch.tensor([t + 1]), d ** -0.5)
            assert torch.equal(alone, chunk[t:t + 1]), (t, threads)
    # in a mixed step: two other sequences' decodes, then tokens 100..399 of sequence 0 as a chunk
    mixed_q = torch.cat([torch.randn(2, h, d), q[100:400]])
    seq_of = torch.tensor([1, 2] + [0] * 300)
    ctx = torch.cat([torch.tensor([37, 500]), torch.arange(101, 401)])
    mixed = ops.paged_attention(mixed_q, kc, vc, tables[[0, 1, 2]], seq_of, ctx, d ** -0.5)
    assert torch.equal(mixed[2:], chunk[100:400])


@pytest.mark.parametrize("window,softcap", [(8, None), (300, None), (0, 5.0), (40, 2.0)])
def test_paged_attention_with_a_window_and_a_soft_cap(window, softcap):
    """Sliding windows (Mistral, Gemma 2, Phi-3) and soft caps (Gemma 2): the kernel against the torch path
    (decodes and a chunk after cached context), and batch invariant: a token's output is the same bits
    alone as inside a chunk, windows crossing the 256-token part boundaries included."""
    ops = cpu_kernels()
    torch.manual_seed(window)
    h, hkv, nb, bs, d, n, context = 4, 2, 60, 16, 32, 40, 500
    kc, vc = torch.randn(nb, bs, hkv, d), torch.randn(nb, bs, hkv, d)
    scale = 0.3  # not D ** -0.5: the query scale is the model's (Gemma 2's query_pre_attn_scalar)
    kw = dict(window=window, softcap=softcap or 0.0)
    # decodes
    lens = torch.tensor([1, 9, 17, 260, 513])
    tables = torch.stack([torch.randperm(nb)[:33] for _ in lens])
    q = torch.randn(len(lens), h, d) * 3
    meta = AttentionMetadata(None, len(lens), tables, lens, int(lens.max()), [])
    ref = TorchPagedAttention._decode(q, (kc, vc), meta, h // hkv, scale, window, softcap)
    got = ops.paged_attention(q, kc, vc, tables, *decode_inputs(lens), scale, **kw)
    assert torch.allclose(got, ref, atol=2e-5)
    # a chunk after cached context
    table = torch.randperm(nb)[:36]
    rows = (table[None] * bs + torch.arange(bs)[:, None]).t().reshape(-1)
    qc = torch.randn(n, h, d) * 3
    k, v = kc.view(-1, hkv, d)[rows][context:context + n], vc.view(-1, hkv, d)[rows][context:context + n]
    ref = TorchPagedAttention._prefill(qc, k, v, (kc, vc), PrefillChunk(0, n, context, table), h // hkv, scale,
                                       window, softcap)
    ctx = torch.arange(context + 1, context + n + 1)
    chunk = ops.paged_attention(qc, kc, vc, table[None], torch.zeros(n, dtype=torch.long), ctx, scale, **kw)
    assert torch.allclose(chunk, ref, atol=2e-5)
    for i in (0, 11, 39):
        alone = ops.paged_attention(qc[i:i + 1], kc, vc, table[None], torch.zeros(1, dtype=torch.long),
                                    ctx[i:i + 1], scale, **kw)
        assert torch.equal(alone, chunk[i:i + 1])
    plain = ops.paged_attention(qc, kc, vc, table[None], torch.zeros(n, dtype=torch.long), ctx, scale)
    assert (plain - chunk).abs().max() > 1e-3  # the window and cap change the result


@pytest.mark.parametrize("store", [torch.int8, torch.uint8])  # --kv-cache-dtype int8, fp8 (e4m3 bits)
def test_paged_attention_reads_a_quantized_cache_as_dequantize_kv_does(store):
    """The kernel on 1-byte values and per-token scales gives the bits it gives on the float cache
    dequantize_kv makes of them (every e4m3 code converts as torch converts it), so the quantized-cache
    modes share the float path's batch invariance."""
    from tokenmill.layers.attention import dequantize_kv, quantize_kv

    ops = cpu_kernels()
    torch.manual_seed(2)
    nb, bs, hkv, h, d = 30, 16, 3, 9, 64
    kq, ks = quantize_kv(torch.randn(nb * bs, hkv, d) * 3, store)
    vq, vs = quantize_kv(torch.randn(nb * bs, hkv, d), store)
    if store == torch.uint8:  # every code, NaN included, reaches the conversion
        kq[: 256 // d + 1].view(-1)[:256] = torch.arange(256, dtype=torch.uint8)
    caches = [t.view(nb, bs, *t.shape[1:]) for t in (kq, vq, ks, vs)]
    deq = [dequantize_kv(caches[i], caches[i + 2], torch.float32).contiguous() for i in (0, 1)]
    tables = torch.stack([torch.randperm(nb)[:20] for _ in range(2)])
    q = torch.randn(50, h, d)
    seq_of, ctx = torch.tensor([0] * 49 + [1]), torch.cat([torch.arange(251, 300), torch.tensor([320])])
    ref = ops.paged_attention(q, *deq, tables, seq_of, ctx, d ** -0.5)
    got = ops.paged_attention(q, caches[0], caches[1], tables, seq_of, ctx, d ** -0.5, caches[2], caches[3])
    assert torch.equal(got.isnan(), ref.isnan()) and torch.equal(got.nan_to_num(), ref.nan_to_num())
    with pytest.raises(RuntimeError, match="both k_scale and v_scale"):
        ops.paged_attention(q, caches[0], caches[1], tables, seq_of, ctx, d ** -0.5, caches[2])


@pytest.mark.parametrize("k,n", [(576, 960), (1536, 576), (40, 37)])
def test_flinear_is_the_float_product_in_one_order_for_any_batch(k, n):
    """--quantization none's GEMM: within float rounding of the float64 product, a row's bits do not
    depend on the rows beside it, and the AVX2 and AVX512 forms agree to the bit."""
    from tokenmill.layers.panel_linear import from_panels, to_panels

    ops = cpu_kernels()
    torch.manual_seed(k)
    w, b, x = torch.randn(n, k), torch.randn(n), torch.randn(70, k)
    wp = to_panels(w)
    assert torch.equal(from_panels(wp, n), w)
    ref = F.linear(x.double(), w.double(), b.double())
    before = ops.kernel_isa("")
    forms = {}
    try:
        for isa in ("avx2", "avx512vnni"):
            try:
                ops.kernel_isa(isa)
            except RuntimeError:
                continue  # this CPU has no AVX512
            y = ops.flinear(x, wp, n, b)
            assert torch.allclose(y.double(), ref, rtol=1e-5, atol=1e-4 * k ** 0.5)
            for i, m in [(0, 1), (5, 2), (7, 3), (20, 17), (3, 64)]:
                assert torch.equal(ops.flinear(x[i:i + m], wp, n, b), y[i:i + m]), (isa, i, m)
            forms[isa] = y
    finally:
        ops.kernel_isa(before)
    assert all(torch.equal(y, forms["avx2"]) for y in forms.values())
    with pytest.raises(RuntimeError, match="panels"):
        ops.flinear(x, w, n, None)


def test_engine_with_fused_ops_matches_the_torch_ops(tmp_path):
    """Fused ops on vs off on a float tiny model: same greedy tokens over a mixed batch (prefills, then
    batched decodes over several blocks) and the same logprobs within float rounding. (Every float32 CPU
    model turns them on by itself, float weights through PanelLinear's fixed-order GEMM.)"""
    from tokenmill import LLM, SamplingParams

    folder = tm.save_hf_folder(tm.random_hf_model("llama"), tmp_path / "m")
    assert LLM(str(folder), dtype="float32", kv_cache_memory="16MiB", quantization="int8").engine.runner.model.ops
    # no prefix cache: the second run must compute its prompts, not reuse the first run's KV
    llm = LLM(str(folder), dtype="float32", kv_cache_memory="16MiB", enable_prefix_caching=False)
    model = llm.engine.runner.model
    assert model.ops is not None and type(model.layers[0].mlp.down_proj).__name__ == "PanelLinear"
    assert model.layers[0].self_attn.backend.ops is not None
    prompts = [list(range(3, 3 + n)) for n in (5, 23, 40)]
    sp = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=0)
    fused = llm.generate(prompts, sp, use_tqdm=False)
    model.use_fused_ops(None)
    # The torch path reads padding slots, which a fused-ops engine leaves uninitialized (whatever memory it
    # got: NaNs sometimes, depending on what ran before): switched at run time, it needs a cleared pool.
    for layer in llm.engine.runner.kv_caches:
        for t in layer:
            t.zero_()
    plain = llm.generate(prompts, sp, use_tqdm=False)
    for a, b in zip(fused, plain):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        la = torch.tensor([lp[t] for lp, t in zip(a.outputs[0].logprobs, a.outputs[0].token_ids)])
        lb = torch.tensor([lp[t] for lp, t in zip(b.outputs[0].logprobs, b.outputs[0].token_ids)])
        assert torch.allclose(la, lb, atol=1e-4)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_one_call_forward_gives_the_layer_by_layer_bits(tmp_path, arch, quantization):
    """forward_layers runs every layer of a step (prefills and decodes) in one call; it must give exactly
    the tokens and logprobs of the layer-by-layer path with the same kernels (qwen2: q/k/v bias)."""
    from tokenmill import LLM, SamplingParams

    folder = tm.save_hf_folder(tm.random_hf_model(arch), tmp_path / "m")
    llm = LLM(str(folder), dtype="float32", kv_cache_memory="16MiB", quantization=quantization)
    model = llm.engine.runner.model
    calls = []
    one_call = model._fused_layers

    def counting(*args):
        out = one_call(*args)
        calls.append(out is not None)
        return out

    model._fused_layers = counting
    prompts = [list(range(3, 3 + n)) for n in (5, 23, 40)]
    sp = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=0)
    fused = llm.generate(prompts, sp, use_tqdm=False)
    assert calls and all(calls)  # every step took it, prefill and decode
    model._fused_layers = lambda *args: None
    model.set_layer_fusion(False)  # every half op by op (the kernels' single ops)
    plain = llm.generate(prompts, sp, use_tqdm=False)
    for a, b in zip(fused, plain):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs


@pytest.mark.parametrize("arch,fused", [("qwen3", {(False, True)}), ("qwen2_moe", {(True, False), (True, True)}),
                                        ("gemma2", {(False, False)}), ("mistral", {(True, True)})])
def test_a_family_runs_the_fused_halves_its_extras_allow(tmp_path, arch, fused):
    """One layer definition (DecoderLayer): each half runs as one fused kernel call where it has no extras
    (Qwen3's q/k norms keep its attention op by op, Qwen2-MoE's experts the MLP of its MoE layers but not
    of its dense one, Gemma 2's sandwich norms both), and gives the bits of the same half op by op."""
    from tokenmill import LLM, SamplingParams

    kw = {"sliding_window": None} if arch == "mistral" else {}
    folder = tm.save_hf_folder(tm.random_hf_model(arch, **kw), tmp_path / "m")
    # (no prefix caching: the second run must compute the same steps; a MoE's float experts are not batch invariant)
    llm = LLM(str(folder), dtype="float32", kv_cache_memory="16MiB", quantization="int8", enable_prefix_caching=False)
    model = llm.engine.runner.model
    assert {tuple(h is not None for h in layer.fused_halves()) for layer in model.layers} == fused
    prompts = [list(range(3, 3 + n)) for n in (5, 23)]
    sp = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=0)
    a = llm.generate(prompts, sp, use_tqdm=False)
    model.set_layer_fusion(False)
    assert all(h is None for layer in model.layers for h in layer.fused_halves())
    b = llm.generate(prompts, sp, use_tqdm=False)
    for x, y in zip(a, b):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        assert x.outputs[0].logprobs == y.outputs[0].logprobs



def test_rope_tables_grow_a_chunk_at_a_time_with_the_same_bits():
    """A 128k-context model holds cos/sin for the positions it has reached, a chunk at a time (32-64 MB
    less at start), and a grown table is the same bits as one computed whole."""
    chunk = RotaryEmbedding.CHUNK
    rope = RotaryEmbedding(64, 5 * chunk, 500000.0, None)
    assert rope.cos.shape[0] == chunk
    pos = torch.tensor([3, 2 * chunk + 7, chunk - 1, chunk])
    cos, sin = rope.tables(pos)
    assert rope.cos.shape[0] == 3 * chunk  # grown to the highest position's chunk, not to the whole context
    whole = torch.outer(torch.arange(5 * chunk, dtype=torch.float32), rope.inv_freq)
    assert torch.equal(cos.squeeze(1), whole.cos()[pos]) and torch.equal(sin.squeeze(1), whole.sin()[pos])
    with pytest.raises(IndexError, match="past the model's"):
        rope.tables(torch.tensor([5 * chunk]))
