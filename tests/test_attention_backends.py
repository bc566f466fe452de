"""The attention backends' registry (layers/attention.py): ``--attention-backend`` picks one; both give the
default model's greedy tokens, the torch one without the kernels' fused attention layers."""

from __future__ import annotations

import pytest

from tokenmill.config import ATTENTION_BACKEND_CHOICES, EngineConfig
from tokenmill.layers.attention import CPUPagedAttention, TorchPagedAttention
from tokenmill.layers.backends import ATTENTION_BACKENDS, get_backend
from tokenmill.layers.kernels import cpu_kernels
from tokenmill.sampling_params import SamplingParams

PROMPTS = ["The capital of France is", "Once upon a time, in a land far away,"]


def test_the_flag_lists_the_registry():
    assert set(ATTENTION_BACKEND_CHOICES) == {"auto", *ATTENTION_BACKENDS}
    assert isinstance(get_backend("auto", kernels=True), CPUPagedAttention)
    assert type(get_backend("auto", kernels=False)) is TorchPagedAttention
    assert type(get_backend("torch", kernels=True)) is TorchPagedAttention


def test_a_backend_that_cannot_run_is_refused_with_what_to_do():
    with pytest.raises(ValueError, match="--attention-backend auto or torch"):
        get_backend("cpu", kernels=False)
    with pytest.raises(ValueError, match="attention_backend must be one of auto, torch, cpu, flex"):
        EngineConfig(attention_backend="flash")


@pytest.mark.slow
@pytest.mark.skipif(cpu_kernels() is None, reason="the CPU kernels did not build here")
def test_the_torch_backend_gives_the_kernels_greedy_tokens(llm_default):
    from tokenmill import LLM

    sp = SamplingParams(temperature=0, max_tokens=24, logprobs=0)
    model = llm_default.engine.runner.model
    assert isinstance(model.attention_backend, CPUPagedAttention)  # auto, with the kernels
    assert model.layers[0].fused_halves()[0] is not None  # the whole attention half in one kernel call
    torch_llm = LLM(kv_cache_memory="64MiB", max_model_len=1024, attention_backend="torch")
    other = torch_llm.engine.runner.model
    assert type(other.attention_backend) is TorchPagedAttention
    assert other.layers[0].fused_halves()[0] is None and other.layers[0].fused_halves()[1] is not None
    want = [o.outputs[0] for o in llm_default.generate(PROMPTS, sp, use_tqdm=False)]
    got = [o.outputs[0] for o in torch_llm.generate(PROMPTS, sp, use_tqdm=False)]
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    for a, b in zip(got, want):  # other arithmetic (SDPA over gathered blocks), the same distribution
        assert a.cumulative_logprob == pytest.approx(b.cumulative_logprob, abs=1e-2)
        assert a.cumulative_logprob != b.cumulative_logprob  # (it did run other code)


def test_the_flex_backend_reads_the_pool_in_place_as_the_reference_attention(tmp_path, family="gemma2"):
    """FlexAttention's mask over the whole pool (block tables, positions, Gemma 2's window and soft cap, GQA)
    against the torch backend's gathered blocks: decodes and prefill chunks in one step, chunked prompts after
    cached context, a prefix-cache hit (the fourth prompt extends the first)."""
    import torch

    from tiny_models import random_hf_model, save_hf_folder
    from tokenmill import LLM
    from tokenmill.layers.flex_attention import FlexPagedAttention

    folder = save_hf_folder(random_hf_model(family, seed=2), tmp_path / family)
    prompts = [[5 + i % 50 for i in range(n)] for n in (40, 23, 9)] + [[5 + i % 50 for i in range(44)]]
    sp = SamplingParams(temperature=0, max_tokens=6, logprobs=3)
    outs = {}
    for backend in ("torch", "flex"):
        llm = LLM(str(folder), attention_backend=backend, quantization="none", dtype="float32",
                  max_num_batched_tokens=16, kv_cache_memory="2MiB")
        try:
            if backend == "flex":
                assert isinstance(llm.engine.runner.model.attention_backend, FlexPagedAttention)
            outs[backend] = [o.outputs[0] for o in llm.generate(prompts, sp, use_tqdm=False)]
        finally:
            llm.shutdown()
    for a, b in zip(outs["flex"], outs["torch"]):
        assert a.token_ids == b.token_ids
        for la, lb in zip(a.logprobs, b.logprobs):
            assert la.keys() == lb.keys()
            assert max(abs(la[t] - lb[t]) for t in la) < 1e-4
    # a wrong mask (every token seeing every slot) would not pass: a negative control on the mask itself
    from tokenmill.layers.flex_attention import phys_to_logical

    p2l = phys_to_logical(torch.tensor([[3, 1, 0], [2, 0, 0]]), torch.tensor([3, 1]), 5)
    assert p2l.tolist() == [[2, 1, -1, 0, -1], [-1, -1, 0, -1, -1]]
