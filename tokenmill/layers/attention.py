"""Attention over the paged KV cache, for a flat batch that mixes prefill and decode tokens.

The runner lays the batch out as [decode tokens (one per request) | prefill chunks] and builds one
AttentionMetadata a step, which holds what each backend reads. Two backends, in a registry chosen by
``--attention-backend`` (layers/backends.py; ``auto``: ``cpu`` where the CPU kernels run the model, else
``torch``):
- ``cpu`` (CPUPagedAttention): with float32 activations every token (decode or prefill alike) goes through
  one call, ``torch.ops.tokenmill.paged_attention``, which reads the blocks in place (a quantized cache's
  rows dequantized as it reads them) and reduces each token's context in fixed parts: a token's output
  is the same bits however the step is composed (batch invariance; see csrc/cpu_kernels.cpp). It reads
  ``block_tables``, ``seq_of`` and ``ctx_lens``; only it lets a decoder layer run its whole attention half
  as one fused kernel call (``fuses_layers``).
- ``torch`` (TorchPagedAttention), portable (CPU or GPU): decodes run as one batched SDPA call: each request's blocks are gathered into a padded
  [B, Hkv, L, D] tensor and a length mask hides the padding. Grouped-query attention folds
  the query heads that share a KV head into the query-length axis, so K/V are never repeated.
- Each prefill chunk runs as one SDPA call (causal); a chunk that starts after cached context
  (chunked prefill, recompute, prefix hits) attends to the cached blocks too.

Per layer, attention takes the model's softmax scale, a sliding window (a token sees only its last
``window`` positions: Mistral, Gemma 2, Phi-3) and a soft cap on the scores (Gemma 2), in the kernel
and in the torch path alike.

A third, ``flex`` (layers/flex_attention.py), reads the blocks in place through torch's FlexAttention; a GPU
backend (flashinfer) plugs into the registry (layers/backends.py) beside them.

A layer's cache is ``(k_cache, v_cache)`` in the model dtype, or, with ``--kv-cache-dtype int8|fp8``,
``(k_cache, v_cache, k_scale, v_scale)``: int8 values (or fp8 e4m3 bits stored as uint8) with one
float32 scale per token and KV head (amax / 127, or amax / 448), quantized as K/V are written and
dequantized where attention gathers them. The fresh K/V of a chunk go through the same round trip,
so a token's attention sees the same values whether its context came from this step or the cache.
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
    # every token's view of the cache, for paged_attention: token t reads the first ctx_lens[t] tokens
    # (its position + 1) of the sequence whose blocks are block_tables[seq_of[t]]
    block_tables: torch.Tensor | None = None  # [S, W] long, one row per scheduled request
    seq_of: torch.Tensor | None = None  # [T] long
    ctx_lens: torch.Tensor | None = None  # [T] long


_QMAX = {torch.int8: 127.0, torch.uint8: 448.0}  # int8; fp8 e4m3 (stored as its bits)


def quantize_kv(x: torch.Tensor, store: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, Hkv, D] -> (values in the cache's storage dtype, float32 scales [T, Hkv])."""
    xf = x.float()
    scale = xf.abs().amax(-1) / _QMAX[store]
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    y = xf / scale[..., None]
    if store == torch.int8:
        return y.round().clamp_(-127, 127).to(torch.int8), scale
    return y.to(torch.float8_e4m3fn).view(torch.uint8), scale


def dequantize_kv(values: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if values.dtype == torch.uint8:
        values = values.view(torch.float8_e4m3fn)
    return (values.float() * scale[..., None]).to(dtype)


def gather_kv(kv: tuple, which: int, index: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Blocks ``index`` of the K (which=0) or V (1) cache, in ``dtype``."""
    if len(kv) == 2:
        return kv[which][index]
    return dequantize_kv(kv[which][index], kv[which + 2][index], dtype)


class TorchPagedAttention:
    """Portable backend: torch indexing plus scaled_dot_product_attention (CPU or GPU). It reads the metadata's
    ``num_decodes``, ``decode_block_tables``, ``decode_seq_lens`` and ``prefills``."""

    name = "torch"
    fuses_layers = False  # a decoder layer's fused attention half (C++) would not run this backend's code
    ops = None  # torch.ops.tokenmill, set by the model's use_fused_ops (this backend does not use it)

    @property
    def reads_only_written_slots(self) -> bool:
        """Whether attention never reads a slot no token wrote: then the KV pool need not be cleared. The torch
        path gathers whole blocks and masks the padding, and a masked NaN of stale memory still poisons it."""
        return False

    def forward(
        self,
        q: torch.Tensor,  # [T, H, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        kv: tuple[torch.Tensor, ...],  # k_cache, v_cache [num_blocks, block_size, Hkv, D] (+ scales)
        meta: AttentionMetadata,
        scale: float | None = None,  # the softmax scale; None: D ** -0.5
        window: int = 0,  # sliding window: a token sees only the last `window` positions (0: all)
        softcap: float | None = None,  # Gemma 2: scores become softcap * tanh(scores / softcap)
    ) -> torch.Tensor:  # [T, H, D]
        scale = kv[0].shape[-1] ** -0.5 if scale is None else scale
        k, v = store_kv(k, v, kv, meta, q.dtype)
        return self.attend(q, k, v, kv, meta, scale, window, softcap)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: tuple[torch.Tensor, ...],
               meta: AttentionMetadata, scale: float, window: int, softcap: float | None) -> torch.Tensor:
        """The step's queries over the cache, their own K/V written to it already (``store_kv``)."""
        out = torch.empty_like(q)
        group = q.shape[1] // kv[0].shape[2]
        nd = meta.num_decodes
        if nd:
            out[:nd] = self._decode(q[:nd], kv, meta, group, scale, window, softcap)
        for c in meta.prefills:
            out[c.start : c.end] = self._prefill(q[c.start : c.end], k[c.start : c.end], v[c.start : c.end],
                                                 kv, c, group, scale, window, softcap)
        return out

    @staticmethod
    def _decode(q, kv, meta, group, scale=None, window=0, softcap=None):
        b, h, d = q.shape
        hkv = kv[0].shape[2]
        scale = d ** -0.5 if scale is None else scale
        n_blk = -(-meta.decode_max_len // kv[0].shape[1])
        tables = meta.decode_block_tables[:, :n_blk]
        # [B, n_blk, bs, Hkv, D] -> [B, Hkv, L, D]
        keys = gather_kv(kv, 0, tables, q.dtype).flatten(1, 2).transpose(1, 2)
        vals = gather_kv(kv, 1, tables, q.dtype).flatten(1, 2).transpose(1, 2)
        pos = torch.arange(keys.shape[2], device=q.device)
        mask = pos < meta.decode_seq_lens[:, None]  # [B, L]
        if window:  # the new token sits at seq_len - 1 and sees positions > seq_len - 1 - window
            mask &= pos > meta.decode_seq_lens[:, None] - 1 - window
        qg = q.view(b, hkv, group, d)  # query heads sharing a KV head ride the query-length axis
        o = _attend(qg, keys, vals, mask[:, None, None, :], scale, softcap)
        return o.reshape(b, h, d)

    @staticmethod
    def _prefill(q, k, v, kv, c: PrefillChunk, group, scale=None, window=0, softcap=None):
        n, h, d = q.shape
        scale = d ** -0.5 if scale is None else scale
        if c.context_len == 0:
            keys, vals = k, v  # nothing cached before this chunk: use the fresh K/V directly
        else:
            total = c.context_len + n
            hkv = kv[0].shape[2]
            keys = gather_kv(kv, 0, c.block_table, q.dtype).reshape(-1, hkv, d)[:total]
            vals = gather_kv(kv, 1, c.block_table, q.dtype).reshape(-1, hkv, d)[:total]
        # [n, H, D] -> [Hkv, group*n, D] would need a custom mask; repeating K/V keeps the fast causal kernel.
        keys = keys.transpose(0, 1).repeat_interleave(group, dim=0)  # [H, L, D]
        vals = vals.transpose(0, 1).repeat_interleave(group, dim=0)
        qh = q.transpose(0, 1)  # [H, n, D]
        if c.context_len == 0 and not window and not softcap:
            o = F.scaled_dot_product_attention(qh, keys, vals, is_causal=True, scale=scale)
        else:
            # query i sits at position context_len + i and sees keys 0..context_len + i (the last `window`)
            rows = torch.arange(n, device=q.device)[:, None] + c.context_len
            cols = torch.arange(keys.shape[1], device=q.device)[None, :]
            mask = cols <= rows
            if window:
                mask &= cols > rows - window
            o = _attend(qh, keys, vals, mask, scale, softcap)
        return o.transpose(0, 1)


def _attend(q, k, v, mask, scale: float, softcap: float | None):
    """softmax(q k^T * scale) v under a boolean mask; with a soft cap the scores are capped first
    (SDPA has no hook for that, so the scores are materialised, as transformers' eager Gemma 2 does)."""
    if not softcap:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), v.float()).to(q.dtype)


class CPUPagedAttention(TorchPagedAttention):
    """The CPU kernels' backend: ``paged_attention`` reads the blocks in place for every token of the step
    (``block_tables``, ``seq_of``, ``ctx_lens``), the same bits however the step is composed; where the
    kernels do not apply (none loaded, activations not float32) it runs the torch path."""

    name = "cpu"
    fuses_layers = True

    @property
    def reads_only_written_slots(self) -> bool:
        return self.ops is not None  # (without the kernels it runs the torch path)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: tuple[torch.Tensor, ...],
               meta: AttentionMetadata, scale: float, window: int, softcap: float | None) -> torch.Tensor:
        if self.ops is None or q.dtype != torch.float32 or q.is_cuda:
            return super().attend(q, k, v, kv, meta, scale, window, softcap)
        # (a quantized cache dequantized row by row as it reads, as gather_kv would)
        return self.ops.paged_attention(q, kv[0], kv[1], meta.block_tables, meta.seq_of, meta.ctx_lens, scale,
                                        *kv[2:], window=window, softcap=softcap or 0.0)


def store_kv(k: torch.Tensor, v: torch.Tensor, kv: tuple[torch.Tensor, ...], meta: AttentionMetadata,
             dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Write the step's K/V into their slots; returns them as the cache will give them back (a quantized
    cache's values dequantized, so a token sees the same values from this step or from the cache)."""
    hkv, d = kv[0].shape[2], kv[0].shape[3]
    if len(kv) == 2:
        kv[0].view(-1, hkv, d).index_copy_(0, meta.slot_mapping, k)
        kv[1].view(-1, hkv, d).index_copy_(0, meta.slot_mapping, v)
        return k, v
    fresh = []
    for i, x in enumerate((k, v)):
        values, row_scale = quantize_kv(x, kv[i].dtype)
        kv[i].view(-1, hkv, d).index_copy_(0, meta.slot_mapping, values)
        kv[i + 2].view(-1, hkv).index_copy_(0, meta.slot_mapping, row_scale)
        fresh.append(dequantize_kv(values, row_scale, dtype))
    return fresh[0], fresh[1]
