"""Hugging Face checkpoints keep their own dtype: a bf16 (or fp16) folder run in bf16 (fp16) is read tensor by
tensor into parameters of that dtype, bit for bit, with no float32 copy on the way (benchmarks/load_memory.py
measures the peak memory this saves on a 1.1B checkpoint)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

import tiny_models as tm
from tokenmill import LLM, SamplingParams
from tokenmill.layers.rotary import RotaryEmbedding
from tokenmill.models.hf_loader import hf_model_config, hf_weights

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module", params=[torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def folder(request, tmp_path_factory):
    model = tm.random_hf_model("llama", seed=2).to(request.param)
    return request.param, model, tm.save_hf_folder(model, tmp_path_factory.mktemp(str(request.param)[6:]))


def test_weights_come_in_their_stored_dtype(folder):
    dtype, _, path = folder
    got = dict(hf_weights(path, hf_model_config(path)))
    assert got and all(t.dtype == dtype for t in got.values())


def test_parameters_are_the_checkpoint_bits(folder):
    dtype, model, path = folder
    name = str(dtype).removeprefix("torch.")
    llm = LLM(str(path), dtype=name, quantization="none", kv_cache_memory="8MiB")
    ours = llm.engine.runner.model
    stored = {}
    for f in path.glob("*.safetensors"):
        stored.update(load_file(str(f)))
    layer = ours.layers[1]
    assert all(p.dtype == dtype for p in ours.parameters())
    assert torch.equal(layer.mlp.down_proj.weight, stored["model.layers.1.mlp.down_proj.weight"])
    qkv = torch.cat([stored[f"model.layers.1.self_attn.{n}_proj.weight"] for n in "qkv"])
    assert torch.equal(layer.self_attn.qkv_proj.weight, qkv)
    # RoPE tables stay float32 whatever the dtype, never rounded through it
    cfg = llm.engine.model_config
    fresh = RotaryEmbedding(cfg.head_dim, ours.rope.cos.shape[0], cfg.rope_theta, cfg.rope_scaling)
    assert ours.rope.cos.dtype == torch.float32 and torch.equal(ours.rope.cos, fresh.cos)
    # and it runs: greedy tokens close to transformers' in the same dtype (ties may differ late)
    ids = tm.hf_tokenizer().encode("The quick brown fox, hello world! Once upon a time").ids
    out = llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    ref = tm.hf_greedy(model, ids, 8)
    assert out[0].outputs[0].token_ids[:4] == ref[:4]
