"""Sparse mixture-of-experts MLP (Mixtral, Qwen2-MoE, OLMoE): a router picks each token's top-k experts,
tokens are grouped by expert so each expert runs one GEMM over all of its tokens (no per-token loop), and
the weighted expert outputs are added back per token.

Routing follows the reference models: softmax over all experts in float32, top-k, and (Mixtral, or where
the config says norm_topk_prob) the k probabilities renormalised to sum to 1; Qwen2-MoE adds a dense
shared expert gated by a sigmoid. Experts are added to a token's output in ascending expert order, as
transformers does, so float32 results agree to rounding.

``expert_tokens`` counts the tokens routed to each expert since the engine last read it (load balance on
/metrics and in the stats log): the whole batch's counts, on every rank, under either dispatch below.

Under tensor parallelism (``tp``) the module holds this rank's share (distributed/sharding.py): a slice
of every expert's width, or, with expert parallelism, whole experts ``[first_expert, first_expert + E_local)``.
The hidden states arrive replicated on every rank (attention is not data-parallel), and the layer's
output must leave replicated too. Two dispatches (``--all2all-backend``):

allreduce (default): every rank routes every token (the router is whole), runs only the experts it holds
over the tokens routed to them, and one all-reduce of [T, H] sums the partial outputs, the shared
expert's (split by width) included.

alltoall (expert parallelism only): rank r routes only its share of the tokens, rows
[r T / size, (r + 1) T / size), and
  1. sends every rank its per-expert counts (one all-to-all of E integers a rank): each rank then knows
     how many rows it sends and receives, how the rows it receives split by expert (each sender's rows
     are grouped by expert in ascending order, so no expert ids travel), and the whole batch's counts;
  2. sends each (token, slot) pair's hidden state to the rank holding its expert (all-to-all; a pair
     whose expert is here stays here);
  3. runs each held expert once over the rows every rank sent it (one GEMM pair an expert);
  4. sends the expert outputs back (the reverse all-to-all), weights and adds them per token in
     ascending expert order (the routing weights never leave the rank), adds the shared expert, whole on
     every rank and run over the share only (so that it needs no all-reduce of its own; its weights are
     loaded whole: distributed/sharding.py), and one all-gather of the shares, padded to the
     largest (they differ by one row where T does not divide), rebuilds the T rows on every rank.
A rank with no tokens (a one-token decode step on two ranks) still takes part in every collective with
empty splits. Bytes a rank sends per MoE layer: (size - 1) E x 8 for the counts, H x 4 (float32) for
each pair it sends off-rank and for each output it returns, and ceil(T / size) x H x 4 for the
all-gather; the allreduce dispatch all-reduces T x H x 4 instead.
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
        from tokenmill.distributed.sharding import dispatches_all_to_all, expert_range

        self.all_to_all = dispatches_all_to_all(tp)  # the alltoall dispatch (module docstring)
        if self.all_to_all:  # every rank's experts [first, last), in rank order
            self.rank_experts = [expert_range(num_experts, r, tp.size, True) for r in range(tp.size)]

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(top-k expert ids [T, k], their weights [T, k] in x's dtype)."""
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return ids, weights.to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H]
        if self.all_to_all:
            return self._forward_all_to_all(x)
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

    def _forward_all_to_all(self, x: torch.Tensor) -> torch.Tensor:  # [T, H], replicated on every rank
        """The alltoall dispatch and combine (the module docstring's steps 1-4)."""
        tp, size, k, n_experts = self.tp, self.tp.size, self.top_k, self.num_experts
        n_tok, hidden = x.shape
        shares = [(r + 1) * n_tok // size - r * n_tok // size for r in range(size)]
        lo = tp.rank * n_tok // size
        mine = x[lo:lo + shares[tp.rank]]  # this rank's share of the tokens (may be empty)
        n = mine.shape[0]
        ids, weights = self.route(mine)
        flat = ids.flatten()
        order = torch.argsort(flat, stable=True)  # the share's (token, slot) pairs grouped by expert, so by rank
        counts = torch.bincount(flat, minlength=n_experts)
        # 1. every rank's per-expert counts, on every rank: [source rank, expert]
        every = tp.all_to_all(counts.repeat(size), [n_experts] * size, [n_experts] * size).view(size, n_experts)
        self.expert_tokens += every.sum(0)  # the whole batch's, as the allreduce dispatch counts them
        table = every.tolist()
        first, last = self.first_expert, self.first_expert + self.w_down.shape[0]
        send = [sum(table[tp.rank][a:b]) for a, b in self.rank_experts]  # pairs to each rank
        recv = [sum(row[first:last]) for row in table]  # pairs from each rank
        # 2. the pairs' hidden states to their experts' ranks (grouped by expert: rank order)
        got = tp.all_to_all(mine[order // k], recv, send)
        # 3. the held experts over what every rank sent; 4. the outputs back, in the order they left
        back = tp.all_to_all(self._held_experts(got, every[:, first:last]), send, recv)
        # each token's k outputs in ascending expert order, weighted here (the weights never left), added
        # as the one-rank path's index_add_ per expert adds them: (y_1 + y_2) + y_3 ...
        slot = ids.sort(dim=1).indices  # [n, k]: each token's slots by expert id
        row_of = torch.empty_like(order)
        row_of[order] = torch.arange(order.numel(), device=order.device)  # pair t k + j -> its row in back
        pair = torch.arange(n, device=x.device)[:, None] * k + slot
        y = back[row_of[pair].flatten()].view(n, k, hidden) * weights.gather(1, slot)[..., None]
        out = y[:, 0]
        for j in range(1, k):
            out = out + y[:, j]
        if self.shared_expert is not None and n:  # whole on every rank: this share's rows only
            out = out + torch.sigmoid(self.shared_expert_gate(mine)) * self.shared_expert(mine)
        # every rank's share, in rank order: the shares padded to the largest for the all-gather
        m = max(shares)
        if n < m:
            out = torch.cat([out, out.new_zeros(m - n, hidden)])
        full = tp.all_gather(out, dim=0)
        if min(shares) == m:
            return full
        return torch.cat([full[r * m:r * m + shares[r]] for r in range(size)])

    def _held_experts(self, got: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """This rank's experts over the rows ``got`` that every rank sent it, in the order received (by
        source rank, each source's rows grouped by expert): ``counts`` [source, held expert]. The rows are
        regrouped by expert so that each expert runs one GEMM pair over all of its rows."""
        if got.shape[0] == 0:
            return got
        per = counts.flatten()
        start = (per.cumsum(0) - per).view_as(counts).t().flatten()  # each (expert, source) run's first row
        per = counts.t().flatten()  # the runs by expert, then by source
        perm = torch.repeat_interleave(start - (per.cumsum(0) - per), per, output_size=got.shape[0])
        perm += torch.arange(got.shape[0], device=got.device)  # row i of the by-expert order is got[perm[i]]
        xs = got[perm]
        ys = torch.empty_like(xs)
        row = 0
        for i, n in enumerate(counts.sum(0).tolist()):  # one GEMM pair per held expert that has rows
            if n:
                gate, up = F.linear(xs[row:row + n], self.w_gate_up[i]).chunk(2, dim=-1)
                ys[row:row + n] = F.linear(F.silu(gate) * up, self.w_down[i])
            row += n
        out = torch.empty_like(got)
        out[perm] = ys
        return out


def expert_imbalance(expert_tokens: list[list[int]]) -> float:
    """The busiest expert's tokens over the mean per expert, in the most unbalanced MoE layer: 1 when the
    router spreads tokens evenly, num_experts / top_k when every token goes to the same experts."""
    worst = 1.0
    for counts in expert_tokens:
        total = sum(counts)
        if total:
            worst = max(worst, max(counts) * len(counts) / total)
    return worst
