"""Batched sampler: penalties, temperature, top-k/top-p/min-p, seeded draws, logprobs.

One call handles every row of the batch with tensor ops; per-row Python work is limited
to rows that carry a private seed (each has its own torch.Generator, so its draws do not
depend on what else is in the batch) or need penalties.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SamplingBatch:
    temperature: torch.Tensor  # [N] float32, 0 = greedy
    all_greedy: bool
    top_k: torch.Tensor | None  # [N] long, 0 = off; None when no row uses it
    top_p: torch.Tensor | None  # [N] float32, 1 = off
    min_p: torch.Tensor | None  # [N] float32, 0 = off
    generators: list[torch.Generator | None]  # per row; None uses the engine's generator
    # penalties (None when no row uses any)
    output_ids: torch.Tensor | None = None  # [N, Lo] long, padded with vocab_size
    prompt_ids: torch.Tensor | None = None  # [N, Lp] long, padded with vocab_size
    repetition_penalty: torch.Tensor | None = None  # [N]
    presence_penalty: torch.Tensor | None = None
    frequency_penalty: torch.Tensor | None = None
    banned: list[tuple[int, list[int]]] | None = None  # (row, token ids) masked out (min_tokens, bad words)
    logit_bias: list[tuple[int, torch.Tensor, torch.Tensor]] | None = None  # (row, token ids, added values)
    allowed: list[tuple[int, torch.Tensor]] | None = None  # (row, the only token ids it may sample)
    grammar_rows: torch.Tensor | None = None  # [G] rows under a grammar ...
    grammar_masks: torch.Tensor | None = None  # ... [G, V] bool, True where the grammar allows the token
    num_logprobs: int | None = None  # top-n logprobs wanted by some row (max over rows)


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [N] long
    sampled_logprobs: torch.Tensor | None  # [N] float32 (raw model distribution)
    top_ids: torch.Tensor | None  # [N, k]
    top_logprobs: torch.Tensor | None  # [N, k]


def apply_penalties(logits: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
    n, v = logits.shape
    counts = torch.zeros(n, v + 1, device=logits.device)
    counts.scatter_add_(1, b.output_ids, torch.ones_like(b.output_ids, dtype=counts.dtype))
    counts = counts[:, :v]
    in_prompt = torch.zeros(n, v + 1, dtype=torch.bool, device=logits.device)
    in_prompt.scatter_(1, b.prompt_ids, True)
    seen = in_prompt[:, :v] | (counts > 0)
    rep = b.repetition_penalty[:, None]
    # repetition penalty (CTRL): shrink seen tokens' logits toward "less likely" whatever their sign
    logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
    logits = logits - b.frequency_penalty[:, None] * counts
    return logits - b.presence_penalty[:, None] * (counts > 0)


def apply_top_k_top_p_min_p(logits: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
    v = logits.shape[-1]
    if b.min_p is not None:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < b.min_p[:, None] * probs.amax(-1, keepdim=True), -float("inf"))
    if b.top_k is None and b.top_p is None:
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    drop = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if b.top_k is not None:
        k = torch.where(b.top_k > 0, b.top_k, v).clamp(max=v)
        drop |= torch.arange(v, device=logits.device)[None, :] >= k[:, None]
    if b.top_p is not None:
        probs = sorted_logits.masked_fill(drop, -float("inf")).softmax(-1)
        # drop a token when the mass before it already reaches top_p (the top token always stays)
        drop |= (probs.cumsum(-1) - probs) >= b.top_p[:, None]
    sorted_logits = sorted_logits.masked_fill(drop, -float("inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def _probs(logits: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
    """Each row's sampling distribution: temperature (greedy rows at 1), then top-k/top-p/min-p."""
    temp = torch.where(b.temperature == 0, 1.0, b.temperature)
    return apply_top_k_top_p_min_p(logits / temp[:, None], b).softmax(-1)


class Sampler:
    def __init__(self, generator: torch.Generator) -> None:
        self.generator = generator

    @staticmethod
    def _penalized(logits: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
        """Penalties, then the constraints: logit_bias, allowed_token_ids, banned tokens, grammar masks."""
        raw = logits
        if b.output_ids is not None:
            logits = apply_penalties(logits, b)
        if b.banned or b.logit_bias or b.allowed or b.grammar_rows is not None:
            logits = logits.clone() if logits is raw else logits
        for row, ids, vals in b.logit_bias or ():
            logits[row, ids] += vals
        for row, ids in b.allowed or ():
            keep = torch.zeros(logits.shape[1], dtype=torch.bool, device=logits.device)
            keep[ids] = True
            logits[row].masked_fill_(~keep, -float("inf"))
        for row, ids in b.banned or ():
            logits[row, ids] = -float("inf")
        if b.grammar_rows is not None:
            logits[b.grammar_rows] = logits[b.grammar_rows].masked_fill(~b.grammar_masks, -float("inf"))
        return logits

    def distributions(self, logits: torch.Tensor, b: SamplingBatch) -> tuple[torch.Tensor | None, torch.Tensor]:
        """(each row's sampling distribution [N, V], None when every row is greedy; each row's argmax):
        what speculative verification compares drafts against."""
        logits = self._penalized(logits, b)
        greedy_tokens = logits.argmax(-1)
        return (None if b.all_greedy else _probs(logits, b)), greedy_tokens

    def __call__(self, logits: torch.Tensor, b: SamplingBatch) -> SamplerOutput:
        raw = logits
        logits = self._penalized(logits, b)
        if b.all_greedy:
            tokens = logits.argmax(-1)
        else:
            tokens = self._sample(logits, b)
        if b.num_logprobs is None:
            return SamplerOutput(tokens, None, None, None)
        logprobs = raw.log_softmax(-1)
        sampled = logprobs.gather(1, tokens[:, None]).squeeze(1)
        top_lp, top_ids = logprobs.topk(b.num_logprobs, dim=-1) if b.num_logprobs else (None, None)
        return SamplerOutput(tokens, sampled, top_ids, top_lp)

    def _sample(self, logits: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
        greedy = b.temperature == 0
        probs = _probs(logits, b)
        # Exponential race: argmax(p / E) with E ~ Exp(1) draws exactly from p, and lets each
        # seeded row use its own generator without a per-row multinomial.
        noise = torch.empty_like(probs)
        noise.exponential_(generator=self.generator)
        for row, gen in enumerate(b.generators):
            if gen is not None:
                noise[row].exponential_(generator=gen)
        sampled = (probs / noise).argmax(-1)
        return torch.where(greedy, logits.argmax(-1), sampled)
