"""Verification of drafted tokens against the target's distributions, keeping them exactly.

For draft positions j = 0..d-1 with target distributions p_j (after temperature, top-k/top-p/min-p and
penalties) and a drafter distribution q_j, accept draft x_j with probability min(1, p_j(x_j) / q_j(x_j));
at the first rejection emit a sample of the normalised residual max(0, p_j - q_j); if all d are accepted
emit a bonus sample of p_d. Every emitted token is then distributed as the target alone would sample it
(Leviathan et al. 2023; Chen et al. 2023). A deterministic drafter (n-gram, or a draft model's argmax)
passes no q: q_j is then a point mass on x_j, the acceptance probability p_j(x_j) and the residual p_j
with x_j removed. Greedy rows accept while the draft equals the target's argmax and emit the argmax at
the first difference.
"""

from __future__ import annotations

import torch


def verify_drafts(probs: torch.Tensor, greedy_tokens: torch.Tensor, drafts: list[int], greedy: bool,
                  generator: torch.Generator | None, draft_probs: torch.Tensor | None = None) -> list[int]:
    """probs / greedy_tokens: the target's [d + 1, V] distributions and argmaxes at the d draft positions
    and the one after; draft_probs: the drafter's [d, V] distributions the drafts were sampled from (None:
    point drafts). Returns the emitted tokens (accepted drafts, then one more)."""
    out: list[int] = []
    for j, x in enumerate(drafts):
        if greedy:
            target = int(greedy_tokens[j])
            out.append(target)
            if target != x:
                return out
            continue
        u = torch.rand((), generator=generator, device=probs.device)
        q = 1.0 if draft_probs is None else draft_probs[j, x]
        if u * q < probs[j, x]:  # u < p / q, without dividing by a q that rounds to 0
            out.append(x)
            continue
        if draft_probs is None:
            residual = probs[j].clone()
            residual[x] = 0.0
        else:
            residual = (probs[j] - draft_probs[j]).clamp_(min=0.0)
            if not residual.any():  # p == q up to rounding: the rejection had probability ~0; p stands in
                residual = probs[j]
        out.append(sample_from(residual, generator))
        return out
    out.append(int(greedy_tokens[len(drafts)]) if greedy else sample_from(probs[len(drafts)], generator))
    return out


def sample_from(weights: torch.Tensor, generator: torch.Generator | None) -> int:
    """One draw from unnormalised non-negative weights (the exponential race the sampler uses)."""
    noise = torch.empty_like(weights).exponential_(generator=generator)
    return int((weights / noise).argmax())
