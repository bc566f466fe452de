"""Verification of drafted tokens against the target's distributions, keeping them exactly.

For draft positions j = 0..d-1 with target distributions p_j (after temperature, top-k/top-p/min-p and
penalties) and a drafter distribution q_j, accept draft x_j with probability min(1, p_j(x_j) / q_j(x_j));
at the first rejection emit a sample of the normalised residual max(0, p_j - q_j); if all d are accepted
emit a bonus sample of p_d. Every emitted token is then distributed as the target alone would sample it
(Leviathan et al. 2023; Chen et al. 2023). The n-gram drafter is deterministic (q_j is a point mass on
x_j), so the acceptance probability is p_j(x_j) and the residual is p_j with x_j removed. Greedy rows
accept while the draft equals the target's argmax and emit the argmax at the first difference.
"""

from __future__ import annotations

import torch


def verify_point_drafts(probs: torch.Tensor, greedy_tokens: torch.Tensor, drafts: list[int], greedy: bool,
                        generator: torch.Generator | None) -> list[int]:
    """probs / greedy_tokens: the target's [d + 1, V] distributions and argmaxes at the d draft positions
    and the one after; returns the emitted tokens (accepted drafts, then one more)."""
    out: list[int] = []
    for j, x in enumerate(drafts):
        if greedy:
            target = int(greedy_tokens[j])
            out.append(target)
            if target != x:
                return out
            continue
        u = torch.rand((), generator=generator, device=probs.device)
        if u < probs[j, x]:
            out.append(x)
            continue
        residual = probs[j].clone()
        residual[x] = 0.0
        out.append(_sample(residual, generator))
        return out
    out.append(int(greedy_tokens[len(drafts)]) if greedy else _sample(probs[len(drafts)], generator))
    return out


def _sample(weights: torch.Tensor, generator: torch.Generator | None) -> int:
    """One draw from unnormalised non-negative weights (the exponential race the sampler uses)."""
    noise = torch.empty_like(weights).exponential_(generator=generator)
    return int((weights / noise).argmax())
