"""A step's sampling inputs: the per-row parameters, penalties' histories, bans, biases and grammar masks the
sampler (layers/sampler.py) reads, built from the runner's request states (worker/model_runner.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from tokenmill.layers.sampler import SamplingBatch
from tokenmill.structured_output import banned_by_bad_words

if TYPE_CHECKING:
    from collections.abc import Sequence


def unpack_bitmask(bits: bytes, vocab_size: int) -> torch.Tensor:
    """llguidance's packed token mask (bit j of byte i: token 8 i + j) as [vocab_size] bool."""
    return torch.from_numpy(np.unpackbits(np.frombuffer(bits, dtype=np.uint8), bitorder="little")[:vocab_size]).bool()


class SamplingInputs:
    """Builds SamplingBatches for one device and vocabulary."""

    def __init__(self, device: torch.device, vocab_size: int) -> None:
        self.device, self.vocab_size = device, vocab_size

    def batch(self, states: Sequence, extras: list[list[int]] | None = None) -> SamplingBatch:
        """One row per state; extras[i]: tokens that follow row i's outputs so far (a drafted position's
        earlier drafts), for its penalties and min_tokens."""
        dev = self.device
        extras = extras or [[] for _ in states]
        ps = [s.params for s in states]
        temp = torch.tensor([p.temperature for p in ps], dtype=torch.float32, device=dev)
        use_k = any(p.top_k > 0 for p in ps)
        use_p = any(p.top_p < 1.0 for p in ps)
        use_min_p = any(p.min_p > 0 for p in ps)
        b = SamplingBatch(
            temperature=temp,
            all_greedy=all(p.greedy for p in ps),
            top_k=torch.tensor([max(p.top_k, 0) for p in ps], device=dev) if use_k else None,
            top_p=torch.tensor([p.top_p for p in ps], dtype=torch.float32, device=dev) if use_p else None,
            min_p=torch.tensor([p.min_p for p in ps], dtype=torch.float32, device=dev) if use_min_p else None,
            generators=[s.generator for s in states],
        )
        if any(p.needs_penalties for p in ps):
            b.output_ids = self._pad([s.output_token_ids + e for s, e in zip(states, extras)])
            b.prompt_ids = self._pad([s.prompt_token_ids for s in states])
            b.repetition_penalty = torch.tensor([p.repetition_penalty for p in ps], dtype=torch.float32, device=dev)
            b.presence_penalty = torch.tensor([p.presence_penalty for p in ps], dtype=torch.float32, device=dev)
            b.frequency_penalty = torch.tensor([p.frequency_penalty for p in ps], dtype=torch.float32, device=dev)
        banned = [(i, s.stop_ids) for i, (s, e) in enumerate(zip(states, extras))
                  if s.stop_ids and len(s.output_token_ids) + len(e) < s.params.min_tokens]
        self._constrain(b, states, extras, banned)
        b.banned = banned or None
        wanted = [p.logprobs for p in ps if p.logprobs is not None]
        b.num_logprobs = max(wanted) if wanted else None
        return b

    def _constrain(self, b: SamplingBatch, states, extras: list[list[int]], banned: list) -> None:
        """logit_bias, allowed_token_ids, bad words (into banned) and grammar masks, for the rows that
        have them; a row's grammar mask follows the tokens before it (its earlier drafts included)."""
        dev = self.device
        bias, allowed, grammar_rows, masks = [], [], [], []
        for i, (s, e) in enumerate(zip(states, extras)):
            p = s.params
            if p.logit_bias:
                ids, vals = zip(*p.logit_bias.items())
                bias.append((i, torch.tensor(ids, device=dev), torch.tensor(vals, dtype=torch.float32, device=dev)))
            if p.allowed_token_ids is not None:
                allowed.append((i, torch.tensor(p.allowed_token_ids, device=dev)))
            c = s.constraints
            if c is not None and c.bad_words_token_ids:
                longest = max(len(w) for w in c.bad_words_token_ids)  # only the output's tail can match
                words = banned_by_bad_words(c.bad_words_token_ids, list(s.output_token_ids[-longest:]) + list(e))
                if words:
                    banned.append((i, words))
            if s.matcher is not None:
                grammar_rows.append(i)
                masks.append(self._grammar_mask(s.matcher, e, s.eos_token_ids))
        b.logit_bias = bias or None
        b.allowed = allowed or None
        if grammar_rows:
            b.grammar_rows = torch.tensor(grammar_rows, device=dev)
            b.grammar_masks = torch.stack(masks).to(dev)

    def _grammar_mask(self, matcher, extra: list[int], eos_token_ids) -> torch.Tensor:
        """[vocab] bool: what the grammar allows after the request's tokens and then ``extra`` (a drafted
        position's earlier drafts). Past a draft the grammar refuses, everything is allowed: verification
        rejects that draft before such a row is read."""
        consumed = matcher.try_consume_tokens(extra) if extra else 0
        bits = matcher.compute_bitmask() if consumed == len(extra) else None
        if consumed:
            matcher.rollback(consumed)
        if bits is None:
            return torch.ones(self.vocab_size, dtype=torch.bool)
        mask = unpack_bitmask(bits, self.vocab_size)
        if not mask.any():  # the grammar is done (or broken): only end-of-sequence is left to say
            mask[[t for t in eos_token_ids if t < self.vocab_size]] = True
        return mask

    def _pad(self, rows: list[list[int]]) -> torch.Tensor:
        width = max(1, max(len(r) for r in rows))
        out = np.full((len(rows), width), self.vocab_size, dtype=np.int64)
        for i, r in enumerate(rows):
            out[i, : len(r)] = r
        return torch.from_numpy(out).to(self.device)
