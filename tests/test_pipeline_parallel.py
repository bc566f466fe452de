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
    kw.setdefault("kv_cache_memory", "16MiB")
    return LLM(str(path), dtype="float32", pipeline_parallel_size=pp, **kw)


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
            assert model.layer_range == stage_layers(ref.config.num_hidden_layers, 0, 2) == (0, 1)
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


def _watch_steps(core) -> dict:
    """Wrap the runner's launch/finish: check that steps in flight hold disjoint requests and end oldest
    first; count how many were in flight at most, and the launches made while another was in flight."""
    seen = {"max": 0, "overlapped": 0, "steps": 0}
    in_flight: list[tuple[set[str], object]] = []  # (request ids, launched step)
    launch, finish = core.runner.launch, core.runner.finish

    def spy_launch(sched):
        ids = {s.request_id for s in sched.scheduled}
        assert all(not ids & other for other, _ in in_flight), "a request was scheduled while in flight"
        step = launch(sched)
        if step is not None:
            seen["overlapped"] += bool(in_flight)
            seen["steps"] += 1
            in_flight.append((ids, step))
            seen["max"] = max(seen["max"], len(in_flight))
        return step

    def spy_finish(step):
        if step is not None:
            assert in_flight.pop(0)[1] is step  # the oldest step ends first
        return finish(step)

    core.runner.launch, core.runner.finish = spy_launch, spy_finish
    return seen


@pytest.mark.parametrize("in_flight", [2, 3])
def test_steps_in_flight_overlap_and_give_the_same_tokens(models, in_flight):
    """Several steps in flight (the default: one per stage): rank 0 launches step n + 1 (other requests)
    before step n comes back from the last stage; the tokens equal one step at a time's and one process's."""
    _, path = models["llama"]
    prompts = PROMPTS * 3
    one = make_llm(path)
    want = [o.outputs[0].token_ids for o in one.generate(prompts, GREEDY, use_tqdm=False)]
    one.shutdown()
    for n in (1, in_flight):
        llm = make_llm(path, pp=2, pipeline_batches_in_flight=n)
        try:
            seen = _watch_steps(llm.engine.core)
            got = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
            assert got == want, f"{n} steps in flight"
            assert seen["max"] == n and (seen["overlapped"] > seen["steps"] // 2 if n > 1 else not seen["overlapped"])
            core = llm.engine.core
            assert not core.has_unfinished() and not core.scheduler.in_flight
            core.kv_cache.check_invariants()
        finally:
            llm.shutdown()


def test_a_request_aborted_in_flight_and_preemption_between_steps_in_flight(models):
    """A request aborted while its step is in flight frees its blocks at once (later steps reuse them
    only after, in every stage's order) and the others' tokens are unchanged; a KV pool too small for
    everyone preempts only requests not in flight; no block or state outlives the run."""
    _, path = models["llama"]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    one = make_llm(path, kv_cache_memory="2MiB")
    want = [o.outputs[0].token_ids for o in one.generate(PROMPTS, params, use_tqdm=False)]
    one.shutdown()
    # stage 0 holds 1 of the 3 layers: 256 bytes a token, 4 KiB a block of 16; 8 blocks for the 14 the
    # requests take at their longest make them preempt one another
    llm = make_llm(path, pp=2, pipeline_batches_in_flight=2, kv_cache_memory="32KiB")
    try:
        engine, core = llm.engine, llm.engine.core
        assert core.kv_cache.num_blocks == 8
        seen = _watch_steps(core)
        rids = [engine.add_request(p, params) for p in PROMPTS]
        doomed = engine.add_request(list(range(60, 100)), params)
        outs: dict[str, list[int]] = {}
        aborted = False
        while engine.has_unfinished_requests():
            for o in engine.step():
                outs[o.request_id] = o.outputs[0].token_ids
            if not aborted and doomed in core.scheduler.in_flight:
                assert engine.abort_request(doomed).outputs[0].finish_reason == "abort"
                assert doomed not in core.kv_cache.block_tables
                aborted = True
        assert aborted and seen["max"] == 2
        assert [outs[r] for r in rids] == want
        assert core.scheduler.num_preemptions > 0
        assert not core.scheduler.in_flight
        core.kv_cache.check_invariants()
        assert core.kv_cache.num_free_blocks == core.kv_cache.num_blocks
    finally:
        llm.shutdown()


@pytest.mark.parametrize("name,quantization", [("llama", "none"), ("qwen2_moe", "none"), ("llama", "int8")])
def test_tp2_x_pp2_matches_one_process_and_transformers(models, name, quantization):
    """Four ranks: two stages of two tensor-parallel ranks each (global rank = stage x 2 + rank in the
    stage); each stage's ranks all-reduce among themselves, and each sends its hidden states to its
    counterpart in the next stage. Float: logits within tolerance of transformers; greedy tokens equal
    to one process's, float and int8."""
    ref, path = models[name]
    one = make_llm(path, quantization=quantization)
    want = greedy(one)
    one.shutdown()
    llm = make_llm(path, pp=2, tensor_parallel_size=2, quantization=quantization)
    try:
        core = llm.engine.core
        group = core.executor.group
        assert (group.size, group.stage, group.num_stages, group.tensor.size, group.tensor.rank) == (4, 0, 2, 2, 0)
        model = core.runner.model
        assert model.tp is group.tensor and model.cfg.num_heads == ref.config.num_attention_heads // 2
        if quantization == "none":
            logits = core.prompt_logits(PROMPTS[0])
            err = ((logits - tm.hf_logits(ref, PROMPTS[0])[:-1]).abs().max() / logits.abs().max()).item()
            assert err < TOL, f"TP=2 x PP=2 logits differ from transformers: relative error {err:.2e}"
        group.tensor.reset_counters()
        assert greedy(llm) == want
        assert group.tensor.all_reduce_calls > 0  # the stage's layers ran split over its two ranks
    finally:
        llm.shutdown()
    assert not any(w.is_alive() for w in core.executor.workers)


def _expert_totals(llm) -> list[list[int]]:
    totals: list[list[int]] = []
    for st in llm.engine.step_stats:
        if st.expert_tokens:
            totals = totals or [[0] * len(c) for c in st.expert_tokens]
            totals = [[a + b for a, b in zip(t, c)] for t, c in zip(totals, st.expert_tokens)]
    return totals


def test_every_stage_reports_its_experts(models):
    """The per-expert token counts (/metrics, stats log) cover every stage's layers: the later stages send
    theirs to rank 0 with each pass. One step at a time they equal one process's; with steps in flight
    each MoE layer still counts top-k per token computed."""
    ref, path = models["qwen2_moe"]
    c = ref.config
    one = make_llm(path)
    greedy(one)
    want = _expert_totals(one)
    one.shutdown()
    assert len(want) == c.num_hidden_layers and [] in want  # its dense layer
    for n in (1, 2):
        llm = make_llm(path, pp=2, pipeline_batches_in_flight=n)
        try:
            greedy(llm)
            got = _expert_totals(llm)
            assert [len(x) for x in got] == [len(x) for x in want]
            tokens = sum(len(p) + N_GEN - 1 for p in PROMPTS)
            assert all(sum(x) == tokens * c.num_experts_per_tok for x in got if x)
            if n == 1:
                assert got == want
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
    assert (par.world_size, par.micro_batches, par.batches_in_flight) == (2, 4, 2)
    par = EngineConfig.from_kwargs(pipeline_parallel_size=3).parallel
    assert (par.micro_batches, par.batches_in_flight) == (1, 3)
    assert EngineConfig.from_kwargs(pipeline_parallel_size=3, pipeline_batches_in_flight=1).parallel.batches_in_flight == 1
    with pytest.raises(ValueError, match="--pipeline-batches-in-flight must be a positive integer"):
        EngineConfig.from_kwargs(pipeline_parallel_size=2, pipeline_batches_in_flight=-1)
    assert EngineConfig.from_kwargs(tensor_parallel_size=2, pipeline_parallel_size=2).parallel.world_size == 4
    with pytest.raises(ValueError, match="--pipeline-parallel-size must be a positive integer"):
        EngineConfig.from_kwargs(pipeline_parallel_size=0)


def test_every_point_to_point_pair_is_opened_at_startup():
    """NCCL creates a pair's communicator at its first send or receive, blocking both ranks: the stages open
    theirs at startup (TPGroup.warm_up) and any other pair raises (the tests above run every pass through
    that check, on gloo, in NCCL's call sequence). TP 2 x PP 3: the chain to each counterpart, the return lines
    from each later stage's first rank to rank 0."""
    from types import SimpleNamespace

    from tokenmill.distributed.group import TPGroup, pipeline_pairs

    assert pipeline_pairs(0, 6, 3) == {("compute", 2), ("back", 2), ("back", 4)}
    assert pipeline_pairs(3, 6, 3) == {("compute", 1), ("compute", 5)}
    assert pipeline_pairs(4, 6, 3) == {("compute", 2), ("back", 0)}
    assert pipeline_pairs(1, 6, 3) == {("compute", 3)}  # (rank 1 sends nothing back: its stage's first does)
    group = SimpleNamespace(rank=1, warmed=pipeline_pairs(1, 6, 3))
    TPGroup._check_pair(group, "compute", 3)
    with pytest.raises(RuntimeError, match="NCCL would create its communicator mid-step"):
        TPGroup._check_pair(group, "back", 0)
