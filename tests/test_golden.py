"""The real default model against Hugging Face transformers loading the same GGUF."""

from __future__ import annotations

import pytest
import torch
from helpers import prefill_logits

from tokenmill import SamplingParams

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Once upon a time, in a land far away,",
    "Q: What is 17 times 23?\nA:",
    "Les fleurs du printemps sont",
    "<|im_start|>user\nWrite a haiku about the sea.<|im_end|>\n<|im_start|>assistant\n",
    "1, 2, 3, 5, 8, 13,",
    "import numpy as np\n\n# compute the mean of each row\n",
]
N_TOKENS = 64

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def engine_greedy(llm_fp32):
    params = SamplingParams(temperature=0.0, max_tokens=N_TOKENS, ignore_eos=True, logprobs=0)
    return llm_fp32.generate(PROMPTS, params, use_tqdm=False)


@pytest.fixture(scope="module")
def hf_logits(hf_model, engine_greedy):
    """HF logits over prompt + our greedy continuation, one forward per prompt."""
    out = []
    with torch.inference_mode():
        for r in engine_greedy:
            ids = torch.tensor([r.prompt_token_ids + r.outputs[0].token_ids])
            out.append(hf_model(ids).logits[0].float())
    return out


def test_greedy_matches_transformers_teacher_forced(engine_greedy, hf_logits):
    # HF's argmax at every generated position equals the token we produced: HF greedy decoding
    # would emit exactly our sequence.
    for r, logits in zip(engine_greedy, hf_logits):
        p = len(r.prompt_token_ids)
        ours = r.outputs[0].token_ids
        assert len(ours) == N_TOKENS
        hf_next = logits[p - 1 : p - 1 + N_TOKENS].argmax(-1).tolist()
        assert hf_next == ours, f"prompt {r.prompt!r}"


def test_greedy_matches_transformers_incremental_decoding(hf_model, engine_greedy):
    # HF's own KV-cached decoding loop, token by token, ignoring EOS like our ignore_eos.
    for r in engine_greedy[:1]:
        ids = torch.tensor([r.prompt_token_ids])
        past, out = None, []
        with torch.inference_mode():
            for _ in range(N_TOKENS):
                res = hf_model(ids, past_key_values=past, use_cache=True)
                past = res.past_key_values
                ids = res.logits[:, -1].argmax(-1, keepdim=True)
                out.append(ids.item())
        assert out == r.outputs[0].token_ids


def test_prefill_logits_close_at_every_position(llm_fp32, engine_greedy, hf_logits):
    for r, ref in zip(engine_greedy, hf_logits):
        ids = r.prompt_token_ids + r.outputs[0].token_ids
        ours = prefill_logits(llm_fp32.engine, ids)
        rel = (ours - ref).norm(dim=-1) / ref.norm(dim=-1)
        assert rel.max().item() < 1e-3, f"max relative error {rel.max().item():.2e} for {r.prompt!r}"


def test_decode_logprobs_match_transformers(engine_greedy, hf_logits):
    # The logprobs returned while decoding (the paged decode path) match HF's distribution.
    for r, ref in zip(engine_greedy, hf_logits):
        p = len(r.prompt_token_ids)
        ref_lp = ref.log_softmax(-1)
        c = r.outputs[0]
        for j, (tok, lps) in enumerate(zip(c.token_ids, c.logprobs)):
            assert abs(lps[tok] - ref_lp[p - 1 + j, tok].item()) < 1e-3
