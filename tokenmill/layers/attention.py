"""Attention over the paged KV cache, for a flat batch that mixes prefill and decode tokens.

The runner lays the batch out as [decode tokens (one per request) | prefill chunks].
- Decodes run as one batched SDPA call: each request's blocks are gathered into a padded
  [B, Hkv, L, D] tensor and a length mask hides the padding. Grouped-query attention folds
  the query heads that share a KV head into the query-length axis, so K/V are never repeated.
- Each prefill chunk runs as one SDPA call (causal); a chunk that starts after cached context
  (chunked prefill, recompute, prefix hits) attends to the cached blocks too.

Backends are chosen by name through ``get_backend``; a GPU backend plugs in beside this one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class PrefillChunk:
    start: int  # offset in the flat batch
    end: int
    context_len: int  # tokens already in the cache before this chunk
    block_table: torch.Tensor  # [num_blocks] long


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] long: where each new token's K/V goes in the flat cache
    num_decodes: int  # the first num_decodes tokens are decodes
    decode_block_tables: torch.Tensor | None  # [B, max_blocks] long
    decode_seq_lens: torch.Tensor | None  # [B] long, including the new token
    decode_max_len: int
    prefills: list[PrefillChunk]


class TorchPagedAttention:
    """Portable backend: torch indexing plus scaled_dot_product_attention (CPU or GPU)."""

    name = "torch"

    def forward(
        self,
        q: torch.Tensor,  # [T, H, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, H, D]
        num_blocks, block_size, hkv, d = k_cache.shape
        k_cache.view(-1, hkv, d).index_copy_(0, meta.slot_mapping, k)
        v_cache.view(-1, hkv, d).index_copy_(0, meta.slot_mapping, v)
        out = torch.empty_like(q)
        group = q.shape[1] // hkv
        nd = meta.num_decodes
        if nd:
            out[:nd] = self._decode(q[:nd], k_cache, v_cache, meta, group)
        for c in meta.prefills:
            out[c.start : c.end] = self._prefill(q[c.start : c.end], k[c.start : c.end], v[c.start : c.end],
                                                 k_cache, v_cache, c, group)
        return out

    @staticmethod
    def _decode(q, k_cache, v_cache, meta, group):
        b, h, d = q.shape
        hkv = k_cache.shape[2]
        n_blk = -(-meta.decode_max_len // k_cache.shape[1])
        tables = meta.decode_block_tables[:, :n_blk]
        # [B, n_blk, bs, Hkv, D] -> [B, Hkv, L, D]
        keys = k_cache[tables].flatten(1, 2).transpose(1, 2)
        vals = v_cache[tables].flatten(1, 2).transpose(1, 2)
        mask = torch.arange(keys.shape[2], device=q.device) < meta.decode_seq_lens[:, None]  # [B, L]
        qg = q.view(b, hkv, group, d)  # query heads sharing a KV head ride the query-length axis
        o = F.scaled_dot_product_attention(qg, keys, vals, attn_mask=mask[:, None, None, :])
        return o.reshape(b, h, d)

    @staticmethod
    def _prefill(q, k, v, k_cache, v_cache, c: PrefillChunk, group):
        n, h, d = q.shape
        if c.context_len == 0:
            keys, vals = k, v  # nothing cached before this chunk: use the fresh K/V directly
        else:
            total = c.context_len + n
            hkv = k_cache.shape[2]
            keys = k_cache[c.block_table].reshape(-1, hkv, d)[:total]
            vals = v_cache[c.block_table].reshape(-1, hkv, d)[:total]
        # [n, H, D] -> [Hkv, group*n, D] would need a custom mask; repeating K/V keeps the fast causal kernel.
        keys = keys.transpose(0, 1).repeat_interleave(group, dim=0)  # [H, L, D]
        vals = vals.transpose(0, 1).repeat_interleave(group, dim=0)
        qh = q.transpose(0, 1)  # [H, n, D]
        if c.context_len == 0:
            o = F.scaled_dot_product_attention(qh, keys, vals, is_causal=True)
        else:
            # query i sits at position context_len + i and sees keys 0..context_len + i
            rows = torch.arange(n, device=q.device)[:, None] + c.context_len
            mask = torch.arange(keys.shape[1], device=q.device)[None, :] <= rows
            o = F.scaled_dot_product_attention(qh, keys, vals, attn_mask=mask)
        return o.transpose(0, 1)


_BACKENDS = {"torch": TorchPagedAttention}


def get_backend(name: str = "torch") -> TorchPagedAttention:
    try:
        return _BACKENDS[name]()
    except KeyError:
        raise ValueError(f"unknown attention backend {name!r}; available: {', '.join(_BACKENDS)}") from None
