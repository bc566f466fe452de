"""``--attention-backend flex``: paged attention through torch's FlexAttention, reading the KV blocks in place.

The whole pool is one long key sequence ([1, Hkv, num_blocks x block_size, D], a view of the cache, never a
copy), and the step's tokens (decodes and prefill chunks alike) one query sequence. A mask over that grid says
which slots each token sees: a slot belongs to the token's request when its block is in the request's table
(``phys_to_logical``), and the token sees it when its logical position is before the token's own (and within
a sliding window). Grouped-query heads share their KV head (``enable_gqa``); Gemma 2's soft cap is a score
modifier. One mask per step and window, shared by every layer.

On a GPU, flex_attention compiles to fused kernels that skip the blocks the mask rules out; on a CPU it runs
torch's reference implementation (slow, but the same mask logic: what CI checks against the reference
attention). The mask is evaluated over the whole pool each step (create_block_mask), which costs
O(tokens x pool) on the host side; building the BlockMask straight from the block tables is the GPU's next
step. Quantized caches (int8/fp8) fall back to the gathering path (``TorchPagedAttention``).
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

import torch

from tokenmill.layers.attention import TorchPagedAttention

if TYPE_CHECKING:
    from tokenmill.layers.attention import AttentionMetadata


def phys_to_logical(block_tables: torch.Tensor, num_valid: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """[S, num_blocks] long: the logical index of each physical block in each request's table, -1 where the
    block is not the request's (a table's padding past its ``num_valid`` blocks names no block)."""
    s, w = block_tables.shape
    logical = torch.arange(w, device=block_tables.device).expand(s, w)
    valid = logical < num_valid[:, None]
    out = torch.full((s, num_blocks + 1), -1, dtype=torch.long, device=block_tables.device)
    out.scatter_(1, torch.where(valid, block_tables, num_blocks), torch.where(valid, logical, -1))
    return out[:, :num_blocks]


class FlexPagedAttention(TorchPagedAttention):
    """FlexAttention over the paged cache; the torch path's for quantized caches."""

    name = "flex"

    def __init__(self) -> None:
        super().__init__()
        self._masks: dict[tuple[int, int], object] = {}  # (id of the step's metadata, window) -> BlockMask
        self._meta = None  # (whose masks those are; kept alive so its id is not reused within the step)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: tuple[torch.Tensor, ...],
               meta: AttentionMetadata, scale: float, window: int, softcap: float | None) -> torch.Tensor:
        if len(kv) != 2:
            return super().attend(q, k, v, kv, meta, scale, window, softcap)
        from torch.nn.attention.flex_attention import flex_attention

        n_blocks, bs, hkv, d = kv[0].shape
        keys = kv[0].view(n_blocks * bs, hkv, d).permute(1, 0, 2).unsqueeze(0)  # views of the pool
        vals = kv[1].view(n_blocks * bs, hkv, d).permute(1, 0, 2).unsqueeze(0)
        score_mod = None
        if softcap:
            def score_mod(score, b, h, qi, ki):
                return torch.tanh(score / softcap) * softcap
        with warnings.catch_warnings():  # (uncompiled on a CPU: torch warns that it is slow, which we know)
            warnings.simplefilter("ignore", UserWarning)
            out = flex_attention(q.transpose(0, 1).unsqueeze(0), keys, vals, score_mod=score_mod,
                                 block_mask=self._mask(meta, window, n_blocks, bs, q.shape[0]), scale=scale,
                                 enable_gqa=q.shape[1] != hkv)
        return out[0].transpose(0, 1)

    def _mask(self, meta: AttentionMetadata, window: int, n_blocks: int, bs: int, num_tokens: int):
        from torch.nn.attention.flex_attention import create_block_mask

        if self._meta is not meta:
            self._masks, self._meta = {}, meta
        key = (id(meta), window)
        if key not in self._masks:
            ctx = meta.ctx_lens  # a token at position p sees positions < p + 1
            num_valid = torch.zeros(meta.block_tables.shape[0], dtype=torch.long, device=ctx.device)
            num_valid.scatter_reduce_(0, meta.seq_of, (ctx + bs - 1) // bs, reduce="amax")
            p2l, seq_of = phys_to_logical(meta.block_tables, num_valid, n_blocks), meta.seq_of

            def mask_mod(b, h, qi, ki):
                logical = p2l[seq_of[qi], ki // bs]
                pos = logical * bs + ki % bs
                seen = (logical >= 0) & (pos < ctx[qi])
                return seen & (pos >= ctx[qi] - window) if window else seen

            self._masks[key] = create_block_mask(mask_mod, None, None, num_tokens, n_blocks * bs,
                                                 device=ctx.device, BLOCK_SIZE=max(bs, 16))
        return self._masks[key]
