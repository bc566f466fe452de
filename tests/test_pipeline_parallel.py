"""Pipeline parallelism (--pipeline-parallel-size): tiny random models split into 2 stages (gloo on the
CPU, worker processes started by the engine) against the single-process run and transformers, with 1 to
3 micro-batches in flight; the bytes sent between stages against the formula; the real model; a killed
stage; and the pieces (layer split, renamed weights, micro-batches, refusals)."""

from __future__ import annotations

import os
import signal

import pytest
import torch

import tiny_models as tm
from tokenmill import LLM, SamplingParams
from tokenmill.config import EngineConfig, ModelConfig
from tokenmill.distributed.pipeline import (bubble_fraction, check_pipeline_parallel, micro_batches, stage_config,
                                            stage_layers, stage_name)

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.usefixtures("one_thread")

N_GEN = 8
PROMPTS = [list(range(5, 45)), [7, 100, 3, 250, 19, 4, 88], [9, 9, 9, 1, 2, 3], [44, 3, 17]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=N_GEN, ignore_eos=True)
TOL = 1e-4


def make_llm(path, pp: int = 1, **kw) -> LLM:
    kw.setdefault("quantization", "none")
    return LLM(str(path), dtype="float32", kv_cache_memory="16MiB", pipeline_parallel_size=pp, **kw)


def greedy(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Llama with 3 layers (stages of 1 and 2), Gemma 2 (windowed and global layers alternate, so the
    stages' layer settings must follow their layers), Qwen2-MoE (its dense layer 1 falls in stage 0)."""
    out = {}
    for name, arch, kw in (("llama", "llama", {"num_hidden_layers": 3}), ("gemma2", "gemma2", {}),
                           ("qwen2_moe", "qwen2_moe", {})):
        m = tm.random_hf_model(arch, seed=3, **kw)
        out[name] = m, tm.save_hf_folder(m, tmp_path_factory.mktemp(name))
    return out


@pytest.mark.parametrize("name", ["llama", "gemma2", "qwen2_moe"])
def test_pp2_matches_one_process_and_transformers(models, name):
    ref, path = models[name]
    one = make_llm(path)
    want, want_logits = greedy(one), one.engine.core.prompt_logits(PROMPTS[0])
    one.shutdown()
    for m in (1, 2, 3):
        llm = make_llm(path, pp=2, pipeline_micro_batches=m)
        try:
            model = llm.engine.core.runner.model
            assert model.layer_range == stage_layers(ref.config.num_hidden_layers, 0, 2)
            assert len(model.layers) == len(llm.engine.core.runner.kv_caches) < ref.config.num_hidden_layers
            logits = llm.engine.core.prompt_logits(PROMPTS[0])
            err = ((logits - tm.hf_logits(ref, PROMPTS[0])[:-1]).abs().max() / logits.abs().max()).item()
            assert err < TOL, f"PP=2 logits differ from transformers: relative error {err:.2e}"
            assert torch.equal(logits, want_logits)  # the kernels are batch invariant: the same bits
            assert greedy(llm) == want, f"micro-batches {m}"
        finally:
            llm.shutdown()


def test_bytes_sent_between_stages(models):
    """Stage 0 sends each micro-batch's hidden states to stage 1: tokens x hidden x 4 bytes a step, in
    min(m, requests) messages; the last stage sends the logits rows back (counted on its side)."""
    ref, path = models["llama"]
    c = ref.config
    llm = make_llm(path, pp=2, pipeline_micro_batches=2, enable_prefix_caching=False)
    try:
        group = llm.engine.core.executor.group
        group.reset_counters()
        llm.engine.core.prompt_logits(PROMPTS[0])  # one request: one micro-batch
        assert (group.send_calls, group.send_bytes) == (1, len(PROMPTS[0]) * c.hidden_size * 4)
        group.reset_counters()
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        tokens = sum(len(p) + N_GEN - 1 for p in PROMPTS)  # every prompt token, then each sampled one but the last
        assert group.send_bytes == tokens * c.hidden_size * 4
        assert group.all_reduce_calls == 0
    finally:
        llm.shutdown()


def test_killed_stage_fails_the_next_generate(models):
    _, path = models["llama"]
    llm = make_llm(path, pp=2)
    executor = llm.engine.core.executor
    try:
        assert greedy(llm)
        os.kill(executor.worker_pids[0], signal.SIGKILL)
        with pytest.raises(RuntimeError, match=r"tensor parallelism failed: worker rank 1 .* exited with code -9"):
            llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    finally:
        llm.shutdown()
    assert not any(w.is_alive() for w in executor.workers)


@pytest.mark.slow
def test_pp2_on_the_real_model_gives_the_single_process_tokens(llm_default):
    """The embedded model (30 layers: 15 a stage) in the default gguf mode."""
    prompts = ["What is the capital of France?", "Write a haiku about the sea."]
    params = SamplingParams(temperature=0.0, max_tokens=16)
    want = [o.outputs[0].token_ids for o in llm_default.generate(prompts, params, use_tqdm=False)]
    llm = LLM(kv_cache_memory="64MiB", max_model_len=2048, pipeline_parallel_size=2)
    try:
        assert llm.engine.quantization == llm_default.engine.quantization
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == want
    finally:
        llm.shutdown()


# ---- the pieces --------------------------------------------------------------------------


def test_stage_layers_names_and_config():
    assert [stage_layers(30, s, 4) for s in range(4)] == [(0, 7), (7, 15), (15, 22), (22, 30)]
    assert stage_name("model.layers.16.self_attn.q_proj.weight", 15, 30) == "model.layers.1.self_attn.q_proj.weight"
    assert stage_name("model.layers.3.mlp.down_proj.weight", 15, 30) is None
    assert stage_name("model.embed_tokens.weight", 15, 30) == "model.embed_tokens.weight"
    cfg = ModelConfig(architecture="gemma2", vocab_size=320, hidden_size=64, intermediate_size=128, num_layers=4,
                      num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=256,
                      layer_windows=(8, 0, 8, 0), num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      dense_layers=(0, 3))
    stage = stage_config(cfg, 1, 4)
    assert (stage.num_layers, stage.layer_windows, stage.dense_layers) == (3, (0, 8, 0), (2,))
    with pytest.raises(ValueError, match="--pipeline-parallel-size 5 exceeds the model's 4 layers"):
        check_pipeline_parallel(cfg, 5)


class _Req:
    def __init__(self, n: int) -> None:
        self.token_ids = [0] * n


def test_micro_batches_are_whole_requests_balanced_by_tokens():
    order = [_Req(1) for _ in range(6)] + [_Req(30), _Req(10)]
    for m in (1, 2, 3, 4, 8, 20):
        groups = micro_batches(order, m)
        assert [r for g in groups for r in g] == order  # each request once, in order (decodes first)
        assert len(groups) == min(m, len(order)) and all(groups)
    # a group closes once it holds its share (23 of 46 tokens): the largest, which sets the pace, is 36 (not 40)
    assert [sum(len(r.token_ids) for r in g) for g in micro_batches(order, 2)] == [36, 10]
    assert bubble_fraction(2, 1) == 0.5 and bubble_fraction(4, 8) == 3 / 11


def test_flags_and_refusals():
    import argparse

    from tokenmill.engine.arg_utils import add_engine_args, engine_kwargs

    p = argparse.ArgumentParser()
    add_engine_args(p)
    par = EngineConfig.from_kwargs(**engine_kwargs(p.parse_args(["--pipeline-parallel-size", "2",
                                                                 "--pipeline-micro-batches", "4"]))).parallel
    assert (par.world_size, par.micro_batches) == (2, 4)
    assert EngineConfig.from_kwargs(pipeline_parallel_size=3).parallel.micro_batches == 3
    with pytest.raises(ValueError, match="both above 1 is not built yet"):
        EngineConfig.from_kwargs(tensor_parallel_size=2, pipeline_parallel_size=2)
    with pytest.raises(ValueError, match="--pipeline-parallel-size must be a positive integer"):
        EngineConfig.from_kwargs(pipeline_parallel_size=0)
