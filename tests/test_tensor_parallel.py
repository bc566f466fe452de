"""Tensor parallelism (--tensor-parallel-size): tiny random Llama and Qwen2 models split over 2 ranks
(gloo on the CPU, worker processes started by the engine) against transformers and the single-process
run; the collectives' bytes against the formula; a killed worker; and the checks that refuse a split.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

import tiny_models as tm
from tokenmill import LLM, SamplingParams
from tokenmill.config import ModelConfig
from tokenmill.distributed.sharding import check_tensor_parallel, padded_vocab, shard_quantized, shard_weight
from tokenmill.layers.quant import quantize_int4, quantize_q8_0

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.usefixtures("one_thread")

N_GEN = 8
PROMPTS = [list(range(5, 45)), [7, 100, 3, 250, 19, 4, 88]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=N_GEN, ignore_eos=True)
TOL = 1e-4


def make_llm(path, tp: int = 1, **kw) -> LLM:
    kw.setdefault("quantization", "none")
    return LLM(str(path), dtype="float32", kv_cache_memory="16MiB", tensor_parallel_size=tp, **kw)


def greedy(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """name -> (transformers model, its folder): Llama (4 heads, 2 KV heads), Qwen2 (q/k/v bias), an
    MQA Llama (1 KV head: replicated on both ranks) and a Llama with an odd vocabulary (321 rows: padded
    to 322, 161 a rank) and untied head."""
    out = {}
    for name, arch, kw in (("llama", "llama", {}), ("qwen2", "qwen2", {}),
                           ("mqa", "llama", {"num_key_value_heads": 1}),
                           ("odd-vocab", "llama", {"vocab_size": 321, "tie_word_embeddings": False})):
        m = tm.random_hf_model(arch, **kw)
        out[name] = m, tm.save_hf_folder(m, tmp_path_factory.mktemp(name))
    return out


@pytest.mark.parametrize("name", ["llama", "qwen2", "mqa", "odd-vocab"])
def test_float_tp2_matches_transformers_and_one_process(models, name):
    ref, path = models[name]
    one = make_llm(path)
    want = greedy(one)
    one.shutdown()
    llm = make_llm(path, tp=2)
    try:
        ids = PROMPTS[0]
        err = rel_err(llm.engine.core.prompt_logits(ids), tm.hf_logits(ref, ids)[:-1])
        assert err < TOL, f"TP=2 logits differ from transformers: relative error {err:.2e}"
        got = greedy(llm)
        assert got == want
        assert got[0] == tm.hf_greedy(ref, PROMPTS[0], N_GEN)
        assert llm.engine.model_config.num_heads == ref.config.num_attention_heads  # the whole model's view
        assert llm.engine.core.runner.model.cfg.num_heads == ref.config.num_attention_heads // 2  # the shard's
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory):
    """Tiny random Mixtral, Qwen2-MoE (shared expert, a dense layer) and OLMoE (q/k norms over all heads),
    8 experts each (tests/tiny_models.py)."""
    out = {}
    for family in ("mixtral", "qwen2_moe", "olmoe"):
        m = tm.random_hf_model(family, seed=7)
        out[family] = m, tm.save_hf_folder(m, tmp_path_factory.mktemp(family))
    return out


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "olmoe"])
def test_moe_tp2_with_and_without_expert_parallelism(moe_models, family):
    """TP=2 splitting every expert's width, and EP=2 (--enable-expert-parallel: 4 whole experts a rank):
    logits against transformers, greedy tokens against one process, the router's counts whole on the
    driver, and one all-reduce per MoE layer as for a dense MLP (OLMoE: one more for its q/k norms)."""
    ref, path = moe_models[family]
    c = ref.config
    one = make_llm(path)
    want = greedy(one)
    one.shutdown()
    ids = PROMPTS[0]
    for ep in (False, True):
        llm = make_llm(path, tp=2, enable_expert_parallel=ep)
        try:
            moe = next(layer.mlp for layer in llm.engine.core.runner.model.layers if hasattr(layer.mlp, "w_down"))
            assert (moe.first_expert, moe.w_down.shape[0]) == ((0, 4) if ep else (0, 8))
            group = llm.engine.core.runner.executor.group
            group.reset_counters()
            llm.engine.core.runner.model.take_expert_tokens()
            err = rel_err(llm.engine.core.prompt_logits(ids), tm.hf_logits(ref, ids)[:-1])
            counts = llm.engine.core.runner.model.take_expert_tokens()
            assert all(sum(layer) == len(ids) * c.num_experts_per_tok for layer in counts if layer)  # all experts'
            assert [bool(layer) for layer in counts] == [i not in (c.mlp_only_layers if family == "qwen2_moe" else [])
                                                         for i in range(c.num_hidden_layers)]
            assert err < TOL, f"TP=2 (ep={ep}) logits differ from transformers: relative error {err:.2e}"
            layers = c.num_hidden_layers
            norms = layers if family == "olmoe" else 0
            assert group.all_reduce_calls == 2 * layers + 1 + norms
            assert group.all_reduce_bytes == len(ids) * ((2 * layers + 1) * c.hidden_size + 2 * norms) * 4
            assert greedy(llm) == want, f"ep={ep}"
        finally:
            llm.shutdown()


def test_int8_tp2_matches_one_process(models):
    """int8 scales are per output row: o_proj and down_proj rows are quantized over each rank's columns,
    so logits are close to (not bit-equal with) the single-process int8 run; greedy tokens equal."""
    _, path = models["llama"]
    one = make_llm(path, quantization="int8")
    want, want_logits = greedy(one), one.engine.core.prompt_logits(PROMPTS[0])
    one.shutdown()
    llm = make_llm(path, tp=2, quantization="int8")
    try:
        assert rel_err(llm.engine.core.prompt_logits(PROMPTS[0]), want_logits) < 2e-2
        assert greedy(llm) == want
    finally:
        llm.shutdown()


def test_speculative_decoding_under_tp2(models):
    """ngram drafts: steps with several logits rows a request (the verify path) on the sharded model."""
    _, path = models["llama"]
    prompts = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7, 8, 5, 6]]
    one = make_llm(path)
    want = [o.outputs[0].token_ids for o in one.generate(prompts, GREEDY, use_tqdm=False)]
    one.shutdown()
    llm = make_llm(path, tp=2, speculative_method="ngram", num_speculative_tokens=3)
    try:
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == want
    finally:
        llm.shutdown()


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.parametrize("split", ["--tensor-parallel-size", "--pipeline-parallel-size"])
def test_two_torchrun_machines_serve_the_single_process_output(models, split):
    """--distributed-executor-backend external_launcher: two "machines" on loopback, each `torchrun --nnodes 2
    --nproc-per-node 1` running the same `tokenmill generate` (env:// rendezvous); rank 0 prints what one
    process prints, rank 1 serves its forward passes (its shard, or its pipeline stage with steps in
    flight) and exits 0 when rank 0's engine shuts down."""
    import subprocess
    import sys

    _, path = models["qwen2"]
    args = ["-m", "tokenmill.cli", "generate", "hello world, once upon a time", "--raw", "--model", str(path),
            "--temperature", "0", "--max-tokens", str(N_GEN), "--ignore-eos", "--dtype", "float32",
            "--quantization", "none", "--kv-cache-memory", "16MiB"]
    env = {**os.environ, "TOKENMILL_TP_THREADS": "1", "OMP_NUM_THREADS": "1"}
    one = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=300, env=env)
    assert one.returncode == 0, one.stderr[-2000:]
    port = str(free_port())
    nodes = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
                               "--node-rank", str(r), "--master-addr", "127.0.0.1", "--master-port", port, *args,
                               split, "2", "--distributed-executor-backend", "external_launcher"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for r in (0, 1)]
    try:
        outs = [n.communicate(timeout=300) for n in nodes]
    finally:
        for n in nodes:
            n.kill()
    assert [n.returncode for n in nodes] == [0, 0], outs[0][1][-2000:] + outs[1][1][-2000:]
    assert outs[0][0] == one.stdout and one.stdout.strip()
    assert outs[1][0] == ""  # a worker rank prints nothing of its own


def test_external_launcher_outside_torchrun_says_how_to_start(models, monkeypatch):
    _, path = models["llama"]
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    with pytest.raises(ValueError, match="RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT not set; start every rank "
                                         "with torchrun"):
        make_llm(path, tp=2, distributed_executor_backend="external_launcher")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "1")
    with pytest.raises(ValueError, match=r"torchrun started 3 ranks \(WORLD_SIZE\) but --tensor-parallel-size x "
                                         r"--pipeline-parallel-size is 2"):
        make_llm(path, tp=2, distributed_executor_backend="external_launcher")


def test_dropping_the_engine_stops_the_workers(models):
    import gc

    _, path = models["llama"]
    llm = make_llm(path, tp=2)
    workers = list(llm.engine.core.executor.workers)
    del llm
    gc.collect()
    assert not any(w.is_alive() for w in workers)


def test_bytes_all_reduced_per_step(models):
    """Each layer all-reduces twice (o_proj, down_proj) and the embedding once: (2 L + 1) x tokens x hidden
    x 4 bytes (float32 activations); the head all-gathers each rank's logits rows: rows x V_pad / T x 4."""
    ref, path = models["llama"]
    c = ref.config
    llm = make_llm(path, tp=2, enable_prefix_caching=False)
    try:
        group = llm.engine.core.runner.executor.group
        group.reset_counters()
        n = len(PROMPTS[0])
        llm.generate([PROMPTS[0]], GREEDY, use_tqdm=False)
        steps, tokens = N_GEN, n + N_GEN - 1  # a prefill step, then N_GEN - 1 one-token decode steps
        per_token = (2 * c.num_hidden_layers + 1) * c.hidden_size * 4
        assert group.all_reduce_calls == (2 * c.num_hidden_layers + 1) * steps
        assert group.all_reduce_bytes == tokens * per_token
        assert group.all_gather_calls == steps  # one logits row a step
        assert group.all_gather_bytes == steps * padded_vocab(c.vocab_size, 2) // 2 * 4
        # a decode step of one token: 2 L + 1 all-reduces of hidden x 4 bytes
        assert per_token == (2 * 2 + 1) * 64 * 4
    finally:
        llm.shutdown()


def test_the_layer_halves_are_forward_layers_one_call_at_a_time(llm_default, monkeypatch):
    """A tensor-parallel rank runs each decoder layer as its two fused halves (attention_half, mlp_half: one
    kernel call each) with the all-reduce between them (DecoderLayer); forward_layers runs the same halves in
    one call. With a group of one (the all-reduce the identity) the two give the same bits: tokens and
    logprobs of the real model, default mode."""
    model = llm_default.engine.runner.model
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=3)
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land far away,"]
    calls = []
    one_call = type(model)._fused_layers
    monkeypatch.setattr(model, "_fused_layers", lambda *a: calls.append("one call") or one_call(model, *a))
    ref = llm_default.generate(prompts, params, use_tqdm=False)
    assert calls and all(a is not None and m is not None for a, m in (layer.fused_halves() for layer in model.layers))

    class Alone:  # a tensor-parallel group of one
        def all_reduce_(self, x):
            calls.append(x.shape)
            return x

    calls.clear()
    monkeypatch.setattr(model, "_fused_layers", lambda *a: None)  # a rank with collectives: layer by layer
    for layer in model.layers:
        monkeypatch.setattr(layer, "tp", Alone())
    got = llm_default.generate(prompts, params, use_tqdm=False)
    assert calls and len(calls) % (2 * model.cfg.num_layers) == 0  # the halves ran, two all-reduces a layer
    for r, g in zip(ref, got):
        assert g.outputs[0].token_ids == r.outputs[0].token_ids
        assert g.outputs[0].logprobs == r.outputs[0].logprobs  # the same bits


def test_killed_worker_fails_the_next_generate_and_leaves_no_process(models):
    _, path = models["llama"]
    llm = make_llm(path, tp=2)
    executor = llm.engine.core.executor
    try:
        assert greedy(llm)
        (pid,) = executor.worker_pids
        os.kill(pid, signal.SIGKILL)
        t = time.monotonic()
        with pytest.raises(RuntimeError, match=r"tensor parallelism failed: worker rank 1 .* exited with code -9"):
            llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert time.monotonic() - t < 30, "a dead worker must fail the step, not hang it"
        assert not any(w.is_alive() for w in executor.workers)
        with pytest.raises(RuntimeError, match="tensor parallelism failed"):  # and every later step
            llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    finally:
        llm.shutdown()
    assert not any(w.is_alive() for w in executor.workers)


def test_a_hung_worker_times_the_step_out(models, monkeypatch):
    """A worker that stops answering (SIGSTOP) fails the step after $TOKENMILL_TP_TIMEOUT_S; none is left."""
    _, path = models["llama"]
    monkeypatch.setenv("TOKENMILL_TP_TIMEOUT_S", "3")
    llm = make_llm(path, tp=2)
    executor = llm.engine.core.executor
    try:
        assert greedy(llm)
        os.kill(executor.worker_pids[0], signal.SIGSTOP)
        t = time.monotonic()
        with pytest.raises(RuntimeError, match="tensor parallelism failed: a worker stopped answering"):
            llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert time.monotonic() - t < 20
    finally:
        llm.shutdown()
    assert not any(w.is_alive() for w in executor.workers)


def test_shutdown_joins_the_workers(models):
    _, path = models["llama"]
    llm = make_llm(path, tp=2)
    workers = llm.engine.core.executor.workers
    llm.shutdown()
    assert all(w.exitcode == 0 for w in workers)


# ---- refusals: before any process starts -------------------------------------------------


def test_a_size_that_does_not_divide_is_a_clear_error(models):
    _, path = models["llama"]  # 4 query heads, 2 KV heads
    with pytest.raises(ValueError, match=r"4 query heads do not divide by --tensor-parallel-size 3: use "
                                         r"--tensor-parallel-size 2 or 4"):
        make_llm(path, tp=3)


def cfg(**kw) -> ModelConfig:
    base = dict(architecture="llama", vocab_size=320, hidden_size=64, intermediate_size=128, num_layers=2,
                num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=256)
    return ModelConfig(**{**base, **kw})


def test_checks_name_the_sizes():
    check_tensor_parallel(cfg(), 2, quantized=True)
    check_tensor_parallel(cfg(num_kv_heads=1), 4, quantized=False)  # 1 KV head: replicated
    check_tensor_parallel(cfg(num_heads=8, num_kv_heads=4, head_dim=8), 8, quantized=False)  # 2 ranks a KV head
    with pytest.raises(ValueError, match="4 KV heads neither divide by --tensor-parallel-size 6 nor divide it"):
        check_tensor_parallel(cfg(num_heads=12, num_kv_heads=4, head_dim=8, intermediate_size=120), 6, False)
    with pytest.raises(ValueError, match=r"intermediate size 90\) does not divide by --tensor-parallel-size 4"):
        check_tensor_parallel(cfg(intermediate_size=90), 4, quantized=False)
    with pytest.raises(ValueError, match=r"o_proj's 64 inputs / 4 ranks = 16, not a multiple of 32.*"
                                         r"--quantization none"):
        check_tensor_parallel(cfg(), 4, quantized=True)
    moe = dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32, intermediate_size=90)
    check_tensor_parallel(cfg(**moe), 2, quantized=False)  # no dense MLP: intermediate_size is not split
    check_tensor_parallel(cfg(**moe), 2, quantized=False, expert_parallel=True)
    with pytest.raises(ValueError, match=r"6 experts do not divide by --tensor-parallel-size 4: use "
                                         r"--tensor-parallel-size 2$"):
        check_tensor_parallel(cfg(**moe, num_heads=8, num_kv_heads=4, head_dim=8), 4, False, expert_parallel=True)
    with pytest.raises(ValueError, match=r"each expert's width \(30\) does not divide .*\(--enable-expert-parallel"):
        check_tensor_parallel(cfg(**{**moe, "moe_intermediate_size": 30}, num_heads=8, num_kv_heads=4,
                                  head_dim=8), 4, False)
    with pytest.raises(ValueError, match=r"shared expert's width \(90\) does not divide"):
        check_tensor_parallel(cfg(**moe, shared_expert_intermediate_size=90, num_heads=8, num_kv_heads=4,
                                  head_dim=8), 4, False)
    with pytest.raises(ValueError, match="q/k norm over all heads .* not replicated"):
        check_tensor_parallel(cfg(num_kv_heads=1, qk_norm="all"), 2, False)


@pytest.mark.parametrize("expert_parallel", [False, True])
def test_expert_shards_cover_each_expert_once(expert_parallel):
    """Per-expert tensors (Qwen2-MoE/OLMoE names and Mixtral's) and transformers 5's stacked ones: the
    ranks' slices put back together are the whole, and under expert parallelism a rank loads only its own."""
    from tokenmill.distributed.sharding import expert_range, holds_weight

    c = cfg(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    gate_up, down = torch.randn(4, 64, 64), torch.randn(4, 64, 32)  # [E, 2I, H], [E, H, I]
    stacked = [(shard_weight("model.layers.0.mlp.experts.gate_up_proj", gate_up, c, r, 2, expert_parallel),
                shard_weight("model.layers.0.mlp.experts.down_proj", down, c, r, 2, expert_parallel))
               for r in range(2)]
    if expert_parallel:
        assert [expert_range(4, r, 2, True) for r in range(2)] == [(0, 2), (2, 4)]
        assert torch.equal(torch.cat([g for g, _ in stacked]), gate_up)
        assert torch.equal(torch.cat([d for _, d in stacked]), down)
    else:  # each rank: its half of every expert's gate rows, up rows and down columns
        halves = [g.split(16, dim=1) for g, _ in stacked]
        assert torch.equal(torch.cat([halves[0][0], halves[1][0], halves[0][1], halves[1][1]], dim=1), gate_up)
        assert torch.equal(torch.cat([d for _, d in stacked], dim=2), down)
    w1, w2 = torch.randn(32, 64), torch.randn(64, 32)
    for e in range(4):
        for name, w, dim in ((f"model.layers.1.block_sparse_moe.experts.{e}.w1.weight", w1, 0),
                             (f"model.layers.1.mlp.experts.{e}.down_proj.weight", w2, 1)):
            owners = [r for r in range(2) if holds_weight(name, c, r, 2, expert_parallel)]
            parts = [shard_weight(name, w, c, r, 2, expert_parallel) for r in owners]
            assert owners == ([e // 2] if expert_parallel else [0, 1])
            assert torch.equal(torch.cat(parts, dim=dim), w)


# ---- sharding --------------------------------------------------------------------------


@pytest.mark.parametrize("quantize", [quantize_q8_0, quantize_int4])
def test_quantized_shards_are_the_float_shards(quantize):
    """Slicing the blocks (rows; columns on whole blocks) gives the blocks of the float slice."""
    c = cfg()
    g = torch.Generator().manual_seed(0)
    for name, shape in (("model.layers.0.self_attn.q_proj.weight", (64, 64)),
                        ("model.layers.0.self_attn.o_proj.weight", (64, 64)),
                        ("model.layers.1.mlp.down_proj.weight", (64, 128)),
                        ("model.embed_tokens.weight", (321, 64))):
        w = torch.randn(shape, generator=g)
        qt = quantize(w)
        for rank in range(2):
            got = shard_quantized(name, qt, c, rank, 2).dequantize()
            want = shard_weight(name, qt.dequantize(), c, rank, 2)
            assert torch.equal(got, want), (name, rank)


def test_vocab_padding_and_replicated_kv_rows():
    c = cfg(vocab_size=321, num_kv_heads=1)
    emb = torch.arange(321.0)[:, None].expand(321, 64)
    shards = [shard_weight("model.embed_tokens.weight", emb, c, r, 2) for r in range(2)]
    assert [s.shape[0] for s in shards] == [161, 161]
    assert torch.equal(torch.cat(shards)[:321], emb) and not torch.cat(shards)[321:].any()
    k = torch.randn(16, 64)
    for r in range(2):  # both ranks hold the one KV head
        assert torch.equal(shard_weight("model.layers.0.self_attn.k_proj.weight", k, c, r, 2), k)


def test_cli_flags():
    import argparse

    from tokenmill.config import EngineConfig
    from tokenmill.engine.arg_utils import add_engine_args, engine_kwargs

    p = argparse.ArgumentParser()
    add_engine_args(p)
    a = p.parse_args(["--tensor-parallel-size", "2", "--distributed-executor-backend", "mp"])
    assert EngineConfig.from_kwargs(**engine_kwargs(a)).parallel.tensor_parallel_size == 2
    with pytest.raises(ValueError, match="--tensor-parallel-size must be a positive integer"):
        EngineConfig.from_kwargs(tensor_parallel_size=0)


def test_engine_core_process_starts_and_stops_its_workers(models):
    """--engine-core-process: the core process is rank 0 and starts the workers itself."""
    from tokenmill.config import EngineConfig
    from tokenmill.engine.llm_engine import LLMEngine

    _, path = models["llama"]
    one = make_llm(path)
    want = greedy(one)
    one.shutdown()
    remote = LLMEngine(EngineConfig.from_kwargs(model=str(path), dtype="float32", kv_cache_memory="16MiB",
                                                quantization="none", tensor_parallel_size=2), core_process=True)
    try:
        for i, ids in enumerate(PROMPTS):
            remote.add_request(ids, GREEDY, request_id=str(i))
        done = {}
        while remote.has_unfinished_requests():
            for out in remote.step():
                if out.finished:
                    done[out.request_id] = out.outputs[0].token_ids
        assert [done[str(i)] for i in range(len(PROMPTS))] == want
    finally:
        remote.shutdown()
    assert remote.core.process.exitcode is not None


@pytest.mark.slow
def test_tp3_on_the_real_model_gives_the_single_process_tokens(llm_default):
    """The embedded model (9 query heads, 3 KV heads, hidden 576) in the default gguf mode on 3 ranks:
    o_proj's 576 inputs split into 192 (6 whole Q8_0/Q4_1 blocks), the MLP's 1536 into 512."""
    from tokenmill.models.registry import DEFAULT_MODEL

    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in llm_default.generate(prompts, params, use_tqdm=False)]
    llm = LLM(DEFAULT_MODEL, kv_cache_memory="256MiB", max_model_len=2048, tensor_parallel_size=3)
    try:
        assert llm.engine.quantization == llm_default.engine.quantization
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert got == want
    finally:
        llm.shutdown()
