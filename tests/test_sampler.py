"""Sampler unit tests on synthetic logits (no model)."""

from __future__ import annotations

import torch

from tokenmill.layers.sampler import Sampler, SamplingBatch

V = 50


def batch(n, temperature=1.0, top_k=None, top_p=None, min_p=None, generators=None, **kw):
    return SamplingBatch(
        temperature=torch.full((n,), float(temperature)),
        all_greedy=temperature == 0,
        top_k=None if top_k is None else torch.full((n,), top_k),
        top_p=None if top_p is None else torch.full((n,), float(top_p)),
        min_p=None if min_p is None else torch.full((n,), float(min_p)),
        generators=generators or [None] * n,
        **kw,
    )


def sampler(seed=0):
    return Sampler(torch.Generator().manual_seed(seed))


def test_greedy_is_argmax():
    logits = torch.randn(8, V)
    out = sampler()(logits, batch(8, temperature=0))
    assert out.token_ids.tolist() == logits.argmax(-1).tolist()


def test_mixed_greedy_and_random_rows():
    logits = torch.randn(2, V)
    b = batch(2)
    b.temperature = torch.tensor([0.0, 1.0])
    for seed in range(5):
        assert sampler(seed)(logits, b).token_ids[0].item() == logits[0].argmax().item()


def test_sampling_follows_the_distribution():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2] + [1e-9] * (V - 3)]))
    s = sampler(1)
    draws = torch.stack([s(logits.expand(200, V), batch(200)).token_ids for _ in range(20)]).flatten()
    freq = torch.bincount(draws, minlength=V)[:3].float() / draws.numel()
    assert torch.allclose(freq, torch.tensor([0.5, 0.3, 0.2]), atol=0.03)


def test_top_k_limits_support():
    logits = torch.randn(1, V)
    top3 = set(logits[0].topk(3).indices.tolist())
    s = sampler(2)
    seen = {s(logits.expand(64, V), batch(64, top_k=3)).token_ids[i].item() for i in range(64)}
    assert seen <= top3 and len(seen) > 1


def test_top_p_keeps_the_nucleus():
    probs = torch.tensor([[0.6, 0.25, 0.1, 0.05] + [0.0] * (V - 4)]) + 1e-12
    logits = probs.log()
    s = sampler(3)
    seen = set(s(logits.expand(256, V), batch(256, top_p=0.8)).token_ids.tolist())
    assert seen == {0, 1}  # 0.6 < 0.8 so token 1 is needed; 0.85 >= 0.8 so token 2 is not


def test_min_p_drops_unlikely_tokens():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05] + [0.0] * (V - 4)]) + 1e-12
    s = sampler(4)
    seen = set(s(probs.log().expand(256, V), batch(256, min_p=0.2)).token_ids.tolist())
    assert seen == {0, 1, 2}  # 0.05 < 0.2 * 0.5


def test_seeded_row_ignores_the_rest_of_the_batch():
    logits = torch.randn(4, V)
    gen = lambda: torch.Generator().manual_seed(42)  # noqa: E731
    a = sampler(0)(logits[:1], batch(1, generators=[gen()])).token_ids[0].item()
    others = torch.cat([logits[1:2], logits[:1], logits[2:3]])  # same row, now in the middle of a batch
    b = sampler(9)(others, batch(3, generators=[None, gen(), None])).token_ids[1].item()
    assert a == b


def test_penalties():
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5]])
    b = batch(1, temperature=0)
    b.output_ids = torch.tensor([[0, 0, 4]])  # token 0 twice; 4 is padding (== vocab size)
    b.prompt_ids = torch.tensor([[1, 4]])
    b.repetition_penalty = torch.tensor([2.0])
    b.presence_penalty = torch.tensor([0.5])
    b.frequency_penalty = torch.tensor([0.25])
    from tokenmill.layers.sampler import apply_penalties

    out = apply_penalties(logits, b)
    # token 0: 2/2 (repetition) - 0.25*2 (frequency) - 0.5 (presence) = 0.0; token 1 (prompt): -2*2 = -4
    assert torch.allclose(out, torch.tensor([[0.0, -4.0, 1.0, 0.5]]))


def test_banned_tokens_never_sampled():
    logits = torch.zeros(1, V)
    logits[0, 7] = 100.0
    b = batch(1, temperature=0, banned=[(0, [7])])
    assert sampler()(logits, b).token_ids.item() != 7


def test_logprobs_are_from_the_raw_distribution():
    logits = torch.randn(3, V)
    b = batch(3, temperature=0.5, top_k=2, num_logprobs=4)
    out = sampler()(logits, b)
    ref = logits.log_softmax(-1)
    assert torch.allclose(out.sampled_logprobs, ref.gather(1, out.token_ids[:, None]).squeeze(1))
    assert torch.allclose(out.top_logprobs, ref.topk(4).values)
