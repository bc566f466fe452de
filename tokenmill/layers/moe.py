"""Sparse mixture-of-experts MLP (Mixtral, Qwen2-MoE, OLMoE): a router picks each token's top-k experts,
tokens are grouped by expert so each expert runs one GEMM over all of its tokens (no per-token loop), and
the weighted expert outputs are added back per token.

Routing follows the reference models: softmax over all experts in float32, top-k, and (Mixtral, or where
the config says norm_topk_prob) the k probabilities renormalised to sum to 1; Qwen2-MoE adds a dense
shared expert gated by a sigmoid. Experts are added to a token's output in ascending expert order, as
transformers does, so float32 results agree to rounding.

``expert_tokens`` counts the tokens routed to each expert since the engine last read it (load balance on
/metrics and in the stats log).

Under tensor parallelism (``tp``) the module holds this rank's share (distributed/sharding.py): a slice
of every expert's width, or, with expert parallelism, whole experts ``[first_expert, first_expert + E_local)``.
Every rank routes every token (the router is whole), runs only the experts it holds, and one all-reduce
sums the partial outputs, the shared expert's included.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SparseMoE(nn.Module):
    def __init__(self, hidden: int, num_experts: int, top_k: int, intermediate: int, renormalize: bool,
                 shared_expert: nn.Module | None = None, experts: tuple[int, int] | None = None, tp=None) -> None:
        super().__init__()
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.first_expert, last = experts or (0, num_experts)  # the experts this module holds: [first, last)
        self.tp = tp
        self.gate = nn.Linear(hidden, num_experts, bias=False)  # the router
        # each held expert's gate and up projections stacked [E, 2I, H], and its down projection [E, H, I]
        n = last - self.first_expert
        self.w_gate_up = nn.Parameter(torch.empty(n, 2 * intermediate, hidden), requires_grad=False)
        self.w_down = nn.Parameter(torch.empty(n, hidden, intermediate), requires_grad=False)
        self.shared_expert = shared_expert  # Qwen2-MoE: a dense MLP every token takes, gated per token
        if shared_expert is not None:
            self.shared_expert_gate = nn.Linear(hidden, 1, bias=False)
        self.register_buffer("expert_tokens", torch.zeros(num_experts, dtype=torch.long), persistent=False)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(top-k expert ids [T, k], their weights [T, k] in x's dtype)."""
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return ids, weights.to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H]
        ids, weights = self.route(x)
        flat = ids.flatten()
        order = torch.argsort(flat, stable=True)  # the (token, slot) pairs grouped by expert
        counts = torch.bincount(flat, minlength=self.num_experts)
        self.expert_tokens += counts
        token_of = order // self.top_k
        slot_weight = weights.flatten()[order]
        out = torch.zeros_like(x)
        start = 0
        held = range(self.first_expert, self.first_expert + self.w_down.shape[0])
        for e, n in enumerate(counts.tolist()):  # one GEMM pair per held expert that has tokens
            if n and e in held:
                rows = token_of[start:start + n]
                i = e - self.first_expert
                gate, up = F.linear(x[rows], self.w_gate_up[i]).chunk(2, dim=-1)
                y = F.linear(F.silu(gate) * up, self.w_down[i]) * slot_weight[start:start + n, None]
                out.index_add_(0, rows, y)
            start += n
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out if self.tp is None else self.tp.all_reduce_(out)


def expert_imbalance(expert_tokens: list[list[int]]) -> float:
    """The busiest expert's tokens over the mean per expert, in the most unbalanced MoE layer: 1 when the
    router spreads tokens evenly, num_experts / top_k when every token goes to the same experts."""
    worst = 1.0
    for counts in expert_tokens:
        total = sum(counts)
        if total:
            worst = max(worst, max(counts) * len(counts) / total)
    return worst
