"""The fused CPU kernels of a decoder layer (RMSNorm, RoPE, SwiGLU, paged decode attention) against
the torch reference code they replace, op by op and through a whole engine."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F

import tiny_models as tm
from tokenmill.layers.attention import AttentionMetadata, TorchPagedAttention
from tokenmill.layers.kernels import cpu_kernels, unavailable_reason
from tokenmill.layers.rotary import RotaryEmbedding

pytestmark = pytest.mark.skipif(cpu_kernels() is None, reason=f"CPU kernels unavailable: {unavailable_reason()}")


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


@pytest.mark.parametrize("h,hkv", [(9, 3), (4, 1), (4, 4)])  # GQA, MQA, MHA
def test_paged_decode_attention_matches_the_gathering_path(h, hkv):
    ops = cpu_kernels()
    torch.manual_seed(0)
    nb, bs, d = 50, 16, 32
    kc, vc = torch.randn(nb, bs, hkv, d), torch.randn(nb, bs, hkv, d)
    lens = torch.tensor([1, 16, 17, 100, 33])
    tables = torch.stack([torch.randperm(nb)[:7] for _ in lens])  # scattered, out-of-order blocks
    q = torch.randn(len(lens), h, d)
    meta = AttentionMetadata(None, len(lens), tables, lens, int(lens.max()), [])
    ref = TorchPagedAttention._decode(q, (kc, vc), meta, h // hkv)
    got = ops.paged_decode_attention(q, kc, vc, tables, lens, d ** -0.5)
    assert torch.allclose(got, ref, atol=1e-5)
    with pytest.raises(RuntimeError, match="does not fit the block table"):
        ops.paged_decode_attention(q, kc, vc, tables, torch.tensor([1, 1, 1, 1, 7 * bs + 1]), d ** -0.5)


@pytest.mark.parametrize("h,hkv", [(9, 3), (4, 1)])
@pytest.mark.parametrize("length", [1, 64, 65, 130, 317])
def test_paged_decode_attention_splits_a_long_context_exactly(h, hkv, length):
    """One sequence has fewer (sequence, KV head) pairs than twice the threads: past 64 tokens the kernel
    splits its context into parts attended in parallel and merged by their maxima and sums."""
    ops = cpu_kernels()
    torch.manual_seed(length)
    nb, bs, d = 40, 16, 64
    kc, vc = torch.randn(nb, bs, hkv, d), torch.randn(nb, bs, hkv, d) * 2
    lens = torch.tensor([length])
    tables = torch.randperm(nb)[:20][None]
    q = torch.randn(1, h, d) * 3  # peaked softmax: the parts' maxima differ
    meta = AttentionMetadata(None, 1, tables, lens, length, [])
    ref = TorchPagedAttention._decode(q, (kc, vc), meta, h // hkv)
    for threads in (1, 2, 3):  # 1: no split; 2 and 3: two or more parts
        with torch_threads(threads):
            got = ops.paged_decode_attention(q, kc, vc, tables, lens, d ** -0.5)
        assert torch.allclose(got, ref, atol=1e-5), threads


def test_engine_with_fused_ops_matches_the_torch_ops(tmp_path):
    """Fused ops on vs off on a float tiny model: same greedy tokens over a mixed batch (prefills, then
    batched decodes over several blocks) and the same logprobs within float rounding. (Quantized models
    turn them on by themselves; int8 activation rounding would amplify the last-bit differences.)"""
    from tokenmill import LLM, SamplingParams

    folder = tm.save_hf_folder(tm.random_hf_model("llama"), tmp_path / "m")
    assert LLM(str(folder), dtype="float32", kv_cache_memory="16MiB", quantization="int8").engine.runner.model.ops
    llm = LLM(str(folder), dtype="float32", kv_cache_memory="16MiB")
    model = llm.engine.runner.model
    assert model.ops is None  # the float path keeps the torch ops unless asked
    model.use_fused_ops(cpu_kernels())
    assert model.layers[0].self_attn.backend.ops is not None
    prompts = [list(range(3, 3 + n)) for n in (5, 23, 40)]
    sp = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=0)
    fused = llm.generate(prompts, sp, use_tqdm=False)
    model.use_fused_ops(None)
    plain = llm.generate(prompts, sp, use_tqdm=False)
    for a, b in zip(fused, plain):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        la = torch.tensor([lp[t] for lp, t in zip(a.outputs[0].logprobs, a.outputs[0].token_ids)])
        lb = torch.tensor([lp[t] for lp, t in zip(b.outputs[0].logprobs, b.outputs[0].token_ids)])
        assert torch.allclose(la, lb, atol=1e-4)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_one_call_decode_gives_the_layer_by_layer_bits(tmp_path, arch, quantization):
    """decode_layers runs every layer of a decode-only step in one call; it must give exactly the
    tokens and logprobs of the layer-by-layer path with the same kernels (qwen2: q/k/v bias)."""
    from tokenmill import LLM, SamplingParams

    folder = tm.save_hf_folder(tm.random_hf_model(arch), tmp_path / "m")
    llm = LLM(str(folder), dtype="float32", kv_cache_memory="16MiB", quantization=quantization)
    model = llm.engine.runner.model
    calls = []
    one_call = model._fused_decode

    def counting(*args):
        out = one_call(*args)
        calls.append(out is not None)
        return out

    model._fused_decode = counting
    prompts = [list(range(3, 3 + n)) for n in (5, 23, 40)]
    sp = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=0)
    fused = llm.generate(prompts, sp, use_tqdm=False)
    assert any(calls) and not all(calls)  # decode steps took it, the prefill steps did not
    model._fused_decode = lambda *args: None
    plain = llm.generate(prompts, sp, use_tqdm=False)
    for a, b in zip(fused, plain):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs
