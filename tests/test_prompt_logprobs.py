"""Prompt logprobs (vLLM's ``prompt_logprobs``; the server's ``echo`` with ``logprobs``), computed in the
prefill's own forward pass: against transformers' log-softmax, through chunked prefill, and with a
cached prefix (which has no logits, so such a request computes its whole prompt)."""

from __future__ import annotations

import pytest
import torch

from tokenmill import SamplingParams

pytestmark = pytest.mark.slow


TEXT = " ".join(f"Line {i}: the king rode north, and the queen sent {i % 7} letters after him." for i in range(60))


def long_prompt(tokenizer, n: int = 300) -> list[int]:
    ids = tokenizer.encode(TEXT)[:n]
    assert len(ids) == n
    return ids


def test_prompt_logprobs_match_transformers_through_chunked_prefill(llm_fp32, hf_model):
    ids = long_prompt(llm_fp32.tokenizer)  # > the 256-token step budget: two prefill chunks
    out = llm_fp32.generate([ids], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=3), use_tqdm=False)[0]
    plp = out.prompt_logprobs
    assert len(plp) == len(ids) and plp[0] is None
    with torch.inference_mode():
        ref = hf_model(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    for pos in range(1, len(ids)):
        entry = plp[pos]
        assert abs(entry[ids[pos]] - float(ref[pos - 1, ids[pos]])) < 2e-3, pos
        top = ref[pos - 1].topk(3)
        for t, lp in zip(top.indices.tolist(), top.values.tolist()):
            if t in entry:
                assert abs(entry[t] - lp) < 2e-3
        assert len(entry) in (3, 4)  # the top 3, plus the prompt token where it is not among them


def test_default_mode_prompt_logprobs_are_the_scoring_paths_bits(llm_default):
    """Chunked, in a batch with other requests: the same bits as LLM.score's one whole prefill."""
    ids = long_prompt(llm_default.tokenizer)
    outs = llm_default.generate([ids, "Hello there"], [SamplingParams(max_tokens=4, prompt_logprobs=0),
                                                       SamplingParams(max_tokens=8)], use_tqdm=False)
    got = [outs[0].prompt_logprobs[p][ids[p]] for p in range(1, len(ids))]
    assert got == llm_default.engine.score(ids).tolist()
    assert outs[1].prompt_logprobs is None


def test_a_cached_prefix_is_computed_again_for_prompt_logprobs(llm_default):
    ids = long_prompt(llm_default.tokenizer, 200)
    llm_default.generate([ids], SamplingParams(max_tokens=1), use_tqdm=False)  # now cached
    stats = llm_default.engine.kv_cache.stats
    hits = stats.hits
    sp = SamplingParams(max_tokens=1, prompt_logprobs=1, n=2, temperature=1.0, seed=0)
    first = llm_default.generate([ids], sp, use_tqdm=False)[0].prompt_logprobs
    assert stats.hits == hits  # no prefix hit taken: every prompt token got its logprob
    assert all(first[p] is not None for p in range(1, len(ids)))
    assert llm_default.generate([ids], sp, use_tqdm=False)[0].prompt_logprobs == first
