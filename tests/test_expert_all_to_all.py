"""Expert parallelism with all-to-all dispatch and combine (--enable-expert-parallel --all2all-backend
alltoall, layers/moe.py): tiny random Mixtral, Qwen2-MoE and OLMoE models on 2 ranks (gloo on the CPU)
against transformers, the single-process run and the allreduce dispatch; the bytes the collectives move
against the formula; the router's counts; and the refusals of the flag where it cannot apply.
"""

from __future__ import annotations

import math

import pytest
import torch

import test_tensor_parallel
import tiny_models as tm
from test_tensor_parallel import GREEDY, PROMPTS, TOL, greedy, make_llm, rel_err
from tokenmill.layers.moe import SparseMoE

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.usefixtures("one_thread")
moe_models = test_tensor_parallel.moe_models  # the tiny MoE models (a module-scoped fixture)

ALLTOALL = dict(tp=2, enable_expert_parallel=True, all2all_backend="alltoall")
IDS = PROMPTS[0][:-1]  # 39 tokens: the ranks' shares are unequal (19 and 20 rows)
SINGLE = [PROMPTS[1]]  # one sequence: a 7-token prefill, then one-token decode steps (rank 0's share empty)


def moe_layers(llm) -> list[tuple[int, SparseMoE]]:
    return [(i, layer.mlp) for i, layer in enumerate(llm.engine.core.runner.model.layers)
            if isinstance(layer.mlp, SparseMoE)]


def record_routing(llm) -> dict[int, list[torch.Tensor]]:
    """Wrap each MoE layer's router: layer -> the expert ids [T, k] of each forward pass."""
    seen: dict[int, list[torch.Tensor]] = {}
    for i, moe in moe_layers(llm):
        def route(x, i=i, inner=moe.route):
            ids, weights = inner(x)
            seen.setdefault(i, []).append(ids.clone())
            return ids, weights
        moe.route = route
    return seen


def one_step(llm) -> tuple[torch.Tensor, list[list[int]], dict[str, int]]:
    """prompt_logits(IDS) (one prefill forward pass): the logits, the router's counts of that pass and,
    under tensor parallelism, the driver's collective counters."""
    group = llm.engine.core.runner.executor.group if llm.engine.core.runner.executor is not None else None
    if group is not None:
        group.reset_counters()
    llm.engine.core.runner.model.take_expert_tokens()
    logits = llm.engine.core.prompt_logits(IDS)
    counts = llm.engine.core.runner.model.take_expert_tokens()
    stats = {} if group is None else {k: v for k, v in vars(group).items() if k.endswith(("_bytes", "_calls"))}
    return logits, counts, stats


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "olmoe"])
def test_alltoall_matches_transformers_one_process_and_the_allreduce_dispatch(moe_models, family):
    """EP=2 with the all-to-all dispatch: logits against transformers (39 tokens: unequal shares),
    greedy tokens of a batch (a 47-token prefill, odd) and of one sequence (one-token decode steps, one
    rank with no tokens) against one process; the router's counts whole on the driver and equal to the
    allreduce dispatch's; the driver's bytes against the formula, next to the allreduce dispatch's."""
    ref, path = moe_models[family]
    c = ref.config
    n_experts = getattr(c, "num_local_experts", None) or c.num_experts  # (Mixtral's name)
    k, hidden = c.num_experts_per_tok, c.hidden_size
    one = make_llm(path)
    try:
        routing = record_routing(one)
        _, want_counts, _ = one_step(one)
        for moe in (m for _, m in moe_layers(one)):
            del moe.route  # (the instance attribute: the class's method again)
        want, want_single = greedy(one), greedy_of(one, SINGLE)
    finally:
        one.shutdown()
    assert {i: len(r) for i, r in routing.items()} == {i: 1 for i in routing}
    allreduce = make_llm(path, tp=2, enable_expert_parallel=True)
    try:
        _, ar_counts, ar = one_step(allreduce)
    finally:
        allreduce.shutdown()

    llm = make_llm(path, **ALLTOALL)
    try:
        layers = moe_layers(llm)
        assert all(m.all_to_all and (m.first_expert, m.w_down.shape[0]) == (0, 4) for _, m in layers)
        if family == "qwen2_moe":  # the shared expert whole on every rank (its width not split)
            assert layers[0][1].shared_expert.down_proj.weight.shape == (hidden, c.shared_expert_intermediate_size)
        logits, counts, a2a = one_step(llm)
        err = rel_err(logits, tm.hf_logits(ref, IDS)[:-1])
        assert err < TOL, f"alltoall logits differ from transformers: relative error {err:.2e}"
        assert counts == ar_counts == want_counts  # whole on the driver, though it routed only its share
        assert all(sum(layer) == len(IDS) * k for layer in counts if layer)

        # bytes the driver (rank 0, tokens [0, T0)) sends per MoE layer: its counts to rank 1, the pairs of
        # its tokens whose expert rank 1 holds, and the outputs of rank 1's pairs for its experts back
        # (H x 4 bytes each), then its share padded to the larger one for the all-gather
        n_tok, t0, half = len(IDS), len(IDS) // 2, n_experts // 2
        off = {i: int((r[0][:t0] >= half).sum() + (r[0][t0:] < half).sum()) for i, r in routing.items()}
        assert all(off.values())
        moe_n = len(layers)
        assert a2a["all_to_all_calls"] == 3 * moe_n
        assert a2a["all_to_all_bytes"] == moe_n * n_experts * 8 + sum(off.values()) * hidden * 4
        # against the allreduce dispatch: one all-reduce of T x H x 4 bytes fewer a MoE layer, one
        # all-gather of ceil(T / 2) rows more
        assert a2a["all_reduce_calls"] == ar["all_reduce_calls"] - moe_n
        assert a2a["all_reduce_bytes"] == ar["all_reduce_bytes"] - moe_n * n_tok * hidden * 4
        assert a2a["all_gather_calls"] == ar["all_gather_calls"] + moe_n
        assert a2a["all_gather_bytes"] == ar["all_gather_bytes"] + moe_n * math.ceil(n_tok / 2) * hidden * 4
        assert ar["all_to_all_calls"] == ar["all_to_all_bytes"] == 0

        assert greedy(llm) == want
        group = llm.engine.core.runner.executor.group
        group.reset_counters()
        assert greedy_of(llm, SINGLE) == want_single
        # a one-token decode step: rank 0's share is empty, it still joins every collective
        assert group.all_to_all_calls == 3 * moe_n * len(want_single[0])
    finally:
        llm.shutdown()


def test_four_ranks_one_token_leaves_three_with_nothing(moe_models):
    """EP=4 (2 experts a rank): a 38-token prompt in shares of 9, 10, 9 and 10 rows, and a one-token prompt
    (a 1-row prefill, then 1-row decodes: three ranks route nothing yet join every collective)."""
    ref, path = moe_models["qwen2_moe"]
    one = make_llm(path)
    try:
        want, want_single = greedy(one), greedy_of(one, [[3]])
    finally:
        one.shutdown()
    llm = make_llm(path, **{**ALLTOALL, "tp": 4})
    try:
        ids = PROMPTS[0][:-2]
        err = rel_err(llm.engine.core.prompt_logits(ids), tm.hf_logits(ref, ids)[:-1])
        assert err < TOL, f"EP=4 alltoall logits differ from transformers: relative error {err:.2e}"
        assert greedy(llm) == want
        assert greedy_of(llm, [[3]]) == want_single
    finally:
        llm.shutdown()


def greedy_of(llm, prompts) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


# ---- refusals: before any process starts -------------------------------------------------


@pytest.mark.parametrize("kw, missing", [
    (dict(tensor_parallel_size=2), "add --enable-expert-parallel "),
    (dict(enable_expert_parallel=True), r"add --tensor-parallel-size N \(N > 1\) "),
    ({}, r"add --tensor-parallel-size N \(N > 1\) and --enable-expert-parallel "),
])
def test_alltoall_without_expert_parallelism_over_ranks_is_refused(kw, missing):
    from tokenmill.config import EngineConfig

    with pytest.raises(ValueError, match=r"--all2all-backend alltoall sends .* needs expert parallelism over "
                                         rf"several ranks: {missing}\(or use --all2all-backend allreduce\)"):
        EngineConfig.from_kwargs(all2all_backend="alltoall", **kw)


def test_the_flag_reaches_the_config_and_the_engine_refuses_at_startup(moe_models):
    import argparse

    from tokenmill.config import EngineConfig
    from tokenmill.engine.arg_utils import add_engine_args, engine_kwargs

    p = argparse.ArgumentParser()
    add_engine_args(p)
    a = p.parse_args(["--tensor-parallel-size", "2", "--enable-expert-parallel", "--all2all-backend", "alltoall"])
    assert EngineConfig.from_kwargs(**engine_kwargs(a)).parallel.all2all_backend == "alltoall"
    a = p.parse_args(["--tensor-parallel-size", "2", "--all2all-backend", "alltoall"])
    with pytest.raises(ValueError, match="add --enable-expert-parallel"):
        EngineConfig.from_kwargs(**engine_kwargs(a))
    _, path = moe_models["mixtral"]
    with pytest.raises(ValueError, match="add --enable-expert-parallel"):
        make_llm(path, tp=2, all2all_backend="alltoall")


def test_the_shared_expert_loads_whole_under_the_all_to_all_dispatch():
    """Qwen2-MoE's shared expert: split by width under the allreduce dispatch (its partial sum joins the
    all-reduce), whole on every rank under alltoall (each rank runs it over its own tokens)."""
    from tokenmill.config import ModelConfig
    from tokenmill.distributed.sharding import dispatches_all_to_all, shard_weight

    c = ModelConfig(architecture="qwen2_moe", vocab_size=320, hidden_size=64, intermediate_size=128, num_layers=2,
                    num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=256, num_experts=4,
                    num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=96)
    gate, down = torch.randn(96, 64), torch.randn(64, 96)
    for r in range(2):
        assert shard_weight("model.layers.0.mlp.shared_expert.gate_proj.weight", gate, c, r, 2, True).shape == (48, 64)
        assert shard_weight("model.layers.0.mlp.shared_expert.down_proj.weight", down, c, r, 2, True).shape == (64, 48)
        assert torch.equal(shard_weight("model.layers.0.mlp.shared_expert.gate_proj.weight", gate, c, r, 2, True,
                                        whole_shared_expert=True), gate)
        assert torch.equal(shard_weight("model.layers.0.mlp.shared_expert.down_proj.weight", down, c, r, 2, True,
                                        whole_shared_expert=True), down)
        # the experts themselves are sliced as under expert parallelism either way
        w = torch.randn(4, 64, 64)
        assert torch.equal(shard_weight("model.layers.0.mlp.experts.gate_up_proj", w, c, r, 2, True,
                                        whole_shared_expert=True), w[2 * r:2 * r + 2])

    class Group:
        size, pipeline, expert_parallel, all2all_backend = 2, False, True, "alltoall"

    g = Group()
    assert dispatches_all_to_all(g)
    g.all2all_backend = "allreduce"
    assert not dispatches_all_to_all(g)
    g.all2all_backend, g.expert_parallel = "alltoall", False
    assert not dispatches_all_to_all(g) and not dispatches_all_to_all(None)
