"""The configuration a user gets with no flags, on the real model: its answers, its distance from the
float reference, and batch invariance (a request's tokens and logprobs are the same bits whatever else
the engine runs, however its prompt is chunked, and whether its prefix came from the cache)."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from helpers import needs_kernels, prefill_logits

from tokenmill import SamplingParams
from tokenmill.layers.kernels import cpu_kernels

pytestmark = pytest.mark.slow

WORDS = ("the river carried salt and silver past the mill while seven bakers argued over bread "
         "a lantern swung in the tower and the clerk wrote numbers in a green ledger ").split()


def shared_prefix_prompts(n: int = 6, prefix_words: int = 600) -> list[str]:
    rng = random.Random(7)
    prefix = " ".join(rng.choice(WORDS) for _ in range(prefix_words))
    return [f"{prefix}\nQuestion {i}: what did the {rng.choice(WORDS)} do next?" for i in range(n)]


def run(llm, prompts, budget: int | None = None, stagger: int = 0):
    """Greedy 16-token continuations with their logprobs; budget: max_num_batched_tokens for this run
    (chunk boundaries); stagger: steps between arrivals (mixes prefills into running decodes)."""
    engine = llm.engine
    saved = engine.scheduler.config
    if budget is not None:
        engine.scheduler.config = dataclasses.replace(saved, max_num_batched_tokens=budget)
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=2)
    try:
        pending = list(prompts)
        ids, results = {}, {}
        while pending or engine.has_unfinished_requests():
            if pending:
                ids[engine.add_request(pending[0], params)] = len(ids)
                pending.pop(0)
            for _ in range(stagger if pending else 1):
                for out in engine.step():
                    if out.finished:
                        c = out.outputs[0]
                        results[ids[out.request_id]] = (c.token_ids, c.logprobs)
        return [results[i] for i in range(len(prompts))]
    finally:
        engine.scheduler.config = saved


def test_default_is_the_gguf_blocks_in_float32(llm_default):
    if cpu_kernels() is not None:
        assert llm_default.engine.quantization == "gguf" and llm_default.engine.dtype == torch.float32


def test_readme_question_gets_a_right_answer(llm_default):
    """The README's first command: `tokenmill generate "What is the capital of France?"` (chat template,
    the CLI's default sampling)."""
    from tokenmill.cli import build_parser, sampling_params

    a = build_parser().parse_args(["generate", "What is the capital of France?"])
    out = llm_default.chat([{"role": "user", "content": a.prompts[0]}], sampling_params(a), use_tqdm=False)
    c = out[0].outputs[0]
    assert "Paris" in c.text and c.finish_reason == "stop", c.text


def test_logits_close_to_the_float_reference(llm_default, llm_fp32):
    """Same weights, dequantized (--quantization none) vs their blocks with int16 activations."""
    ids = llm_default.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 4 + "In 1492, Columbus")
    got = prefill_logits(llm_default.engine, ids)
    ref = prefill_logits(llm_fp32.engine, ids)
    assert (got - ref).abs().max() < 0.05  # measured here: ~1e-3 (summation order only)
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() == 1.0


@needs_kernels
def test_prefix_caching_on_and_off_give_the_same_bits(llm_default):
    prompts = shared_prefix_prompts()
    kv = llm_default.engine.kv_cache
    saved = kv.enable_prefix_caching
    try:
        kv.enable_prefix_caching = False
        off = run(llm_default, prompts)
        kv.enable_prefix_caching = True
        warm = run(llm_default, prompts[:1])  # caches the shared prefix
        on = run(llm_default, prompts)
    finally:
        kv.enable_prefix_caching = saved
    assert warm[0] == off[0]
    assert on == off


def invariance_violations(llm, trials: int, seed: int) -> int:
    """Random batch compositions and token budgets against each prompt run alone; how many differ."""
    rng = random.Random(seed)
    texts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 120))) for _ in range(5)]
    alone = {t: run(llm, [t])[0] for t in texts}
    bad = 0
    for _ in range(trials):
        batch = rng.sample(texts, rng.randint(2, len(texts)))
        got = run(llm, batch, budget=rng.choice([16, 37, 64, 256, 2048]), stagger=rng.randint(0, 3))
        bad += sum(g != alone[t] for g, t in zip(got, batch))
    return bad


@needs_kernels
def test_batch_invariance_property(llm_default):
    assert invariance_violations(llm_default, trials=6, seed=0) == 0


@needs_kernels
def test_batch_invariance_property_catches_a_broken_kernel(llm_default):
    """Negative control: the torch attention paths (batched SDPA for decodes, one call per prefill chunk)
    reduce a token's context differently by step composition; the property must notice."""
    model = llm_default.engine.runner.model
    backends = [layer.self_attn.backend for layer in model.layers]
    fused = model._fused_layers
    try:
        model._fused_layers = lambda *args: None
        for b in backends:
            b.ops = None
        assert invariance_violations(llm_default, trials=6, seed=0) > 0
    finally:
        model._fused_layers = fused
        for b in backends:
            b.ops = cpu_kernels()
