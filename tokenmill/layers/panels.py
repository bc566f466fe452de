"""Q4_K, Q6_K, Q4_1 and Q5_K matrices in panels of 8 rows: the layout the kernels' fastest GEMM reads.

The kernels (``csrc/panels_x8.h``) multiply 8 weight rows at once, one row per 32-bit lane, so that a
32-byte load holds four consecutive weights of each of 8 rows and needs no horizontal sums. Here the
same bytes are reordered into that layout and back; nothing is requantized (``from_panels(to_panels(x))``
is ``x`` byte for byte). Per panel of 8 rows and super-block of 256 weights:

- ``q4_k`` (1152 bytes, the same as 8 rows): fp16 d[8] | fp16 dmin[8] | the 12 bytes of packed 6-bit scales
  and mins [12][8 rows] | quants [4 pairs of blocks][8 steps][8 rows][4]: row r's byte 32 p + 4 s + k of
  the super-block's 128 quant bytes.
- ``q6_k`` (1680 bytes, the same as 8 rows): fp16 d[8] | int8 scales [16 halves][8 rows] |
  low nibbles [4 pairs][8 steps][8 rows][4] (block 2 p low, block 2 p + 1 high) |
  high bit pairs [2 quads][8 steps][8 rows][4] (block 4 t + i in bits 2 i, 2 i + 1).
- ``q5_k`` (1408 bytes): ``q4_k``'s 1152 | high-bit bytes [8 steps][8 rows][4]: row r's byte 4 s + k of the
  super-block's 32 (bit j: the fifth bit of weight 4 s + k of block j).
- ``q4_1`` (1280 bytes per 8 blocks of 32, the same as 8 rows): fp16 d [8 blocks][8 rows] | fp16 m [8][8] |
  quants as ``q4_k``'s (the low nibble weight 4 s + k of block 2 p, the high nibble that of block 2 p + 1).

Imports nothing of tokenmill but the formats (quant.py imports it).
"""

from __future__ import annotations

import torch

from tokenmill.layers.formats import QK_K

PANEL_ROWS = 8
PANEL_FORMATS = {"q4_k": "q4_k_x8", "q6_k": "q6_k_x8", "q4_1": "q4_1_x8", "q5_k": "q5_k_x8"}  # row -> panel format
ROW_FORMATS = {v: k for k, v in PANEL_FORMATS.items()}
_ROW_BYTES = {"q4_k": 144, "q6_k": 210, "q4_1": 160, "q5_k": 176}  # per row and 256 weights


def panel_format(fmt: str, n: int, k: int) -> str:
    """The kernel format a [n, k] matrix in ``fmt`` is kept in: its panel format where there is one, n is a
    multiple of 8 and k of 256, else ``fmt`` itself (the kernels' row layout)."""
    return PANEL_FORMATS[fmt] if fmt in PANEL_FORMATS and n % PANEL_ROWS == 0 and k % QK_K == 0 else fmt


def _q6_values(blk: torch.Tensor) -> torch.Tensor:
    """Q6_K super-blocks [..., 210] -> q [..., 8 blocks, 32] in 0..63 (gguf's layout: block j = 4 h + r takes
    nibble r // 2 of ql bytes 64 h + 32 (r % 2) + i and bits 2 r of qh byte 32 h + i)."""
    ql = blk[..., :128].reshape(*blk.shape[:-1], 2, 2, 32)
    qh = blk[..., 128:192].reshape(*blk.shape[:-1], 2, 1, 32)
    low = torch.stack([ql[..., r % 2, :] >> (4 * (r // 2)) & 0x0F for r in range(4)], dim=-2)
    high = torch.cat([qh >> (2 * r) & 0x03 for r in range(4)], dim=-2)
    return (low | (high << 4)).reshape(*blk.shape[:-1], 8, 32)


def _q6_bytes(q: torch.Tensor) -> torch.Tensor:
    """Inverse of _q6_values: q [..., 8, 32] -> ql, qh bytes [..., 192]."""
    q = q.reshape(*q.shape[:-2], 2, 4, 32)
    low, high = q & 0x0F, q >> 4
    ql = torch.stack([low[..., 0, :] | (low[..., 2, :] << 4), low[..., 1, :] | (low[..., 3, :] << 4)], dim=-2)
    qh = high[..., 0, :] | (high[..., 1, :] << 2) | (high[..., 2, :] << 4) | (high[..., 3, :] << 6)
    return torch.cat([ql.reshape(*q.shape[:-3], 128), qh.reshape(*q.shape[:-3], 64)], dim=-1)


def to_panels(data: torch.Tensor, fmt: str, shape: tuple[int, int]) -> torch.Tensor:
    """A [n, K] matrix's row blocks (uint8 [n, row bytes], GGUF layout) -> its panels [n / 8, panel bytes]."""
    n, k = shape
    p, nsb = n // PANEL_ROWS, k // QK_K
    if fmt == "q4_1":  # groups of 8 blocks for super-blocks
        blk = data.reshape(p, PANEL_ROWS, nsb, 8, 20).permute(0, 2, 1, 3, 4)  # [panel, group, row, block, bytes]
        nib = blk[..., 4:]
        w = torch.cat([nib & 0x0F, nib >> 4], dim=-1).reshape(p, nsb, 8, 8, 8, 4)  # [.., row, block, step, k]
        qs = (w[:, :, :, 0::2] | (w[:, :, :, 1::2] << 4)).permute(0, 1, 3, 4, 2, 5)
        parts = [blk[..., 0:2].transpose(2, 3), blk[..., 2:4].transpose(2, 3), qs]
        return torch.cat([t.reshape(p, nsb, -1) for t in parts], dim=-1).reshape(p, -1)
    blk = data.reshape(p, PANEL_ROWS, nsb, _ROW_BYTES[fmt]).permute(0, 2, 1, 3)  # [panel, super-block, row, bytes]
    if fmt in ("q4_k", "q5_k"):  # (Q5_K: the quants after its 32 high-bit bytes, which follow them here)
        q0 = 16 if fmt == "q4_k" else 48
        qs = blk[..., q0:].reshape(p, nsb, 8, 4, 8, 4).permute(0, 1, 3, 4, 2, 5)
        parts = [blk[..., 0:2], blk[..., 2:4], blk[..., 4:16].transpose(-1, -2), qs]
        if fmt == "q5_k":
            parts.append(blk[..., 16:48].reshape(p, nsb, 8, 8, 4).transpose(2, 3))  # [.., step, row, 4]
    else:
        q = _q6_values(blk).reshape(p, nsb, 8, 8, 8, 4)  # [.., row, block, step, k]
        low, high = q & 0x0F, q >> 4
        ql = (low[:, :, :, 0::2] | (low[:, :, :, 1::2] << 4)).permute(0, 1, 3, 4, 2, 5)
        qh = (high[:, :, :, 0::4] | (high[:, :, :, 1::4] << 2) | (high[:, :, :, 2::4] << 4)
              | (high[:, :, :, 3::4] << 6)).permute(0, 1, 3, 4, 2, 5)
        parts = [blk[..., 208:210], blk[..., 192:208].transpose(-1, -2), ql, qh]
    return torch.cat([t.reshape(p, nsb, -1) for t in parts], dim=-1).reshape(p, -1)


def from_panels(panels: torch.Tensor, fmt: str, k: int) -> torch.Tensor:
    """Inverse of to_panels: panels [p, panel bytes] -> row blocks [8 p, row bytes] (``fmt`` the row format)."""
    p, nsb = panels.shape[0], k // QK_K
    x = panels.reshape(p, nsb, -1)
    if fmt == "q4_1":
        d = x[..., 0:128].reshape(p, nsb, 8, 8, 2).transpose(2, 3)  # [.., row, block, 2]
        m = x[..., 128:256].reshape(p, nsb, 8, 8, 2).transpose(2, 3)
        qs = x[..., 256:].reshape(p, nsb, 4, 8, 8, 4).permute(0, 1, 4, 2, 3, 5)  # [.., row, pair, step, k]
        w = torch.stack([qs & 0x0F, qs >> 4], dim=4).reshape(p, nsb, 8, 8, 32)  # [.., row, block, weight]
        blk = torch.cat([d, m, w[..., :16] | (w[..., 16:] << 4)], dim=-1)
        return blk.permute(0, 2, 1, 3, 4).reshape(p * PANEL_ROWS, -1).contiguous()
    if fmt in ("q4_k", "q5_k"):
        d, dmin = x[..., 0:16].reshape(p, nsb, 8, 2), x[..., 16:32].reshape(p, nsb, 8, 2)
        scales = x[..., 32:128].reshape(p, nsb, 12, 8).transpose(-1, -2)
        qs = x[..., 128:1152].reshape(p, nsb, 4, 8, 8, 4).permute(0, 1, 4, 2, 3, 5).reshape(p, nsb, 8, 128)
        high = [x[..., 1152:].reshape(p, nsb, 8, 8, 4).transpose(2, 3).reshape(p, nsb, 8, 32)] if fmt == "q5_k" else []
        blk = torch.cat([d, dmin, scales, *high, qs], dim=-1)
    else:
        d = x[..., 0:16].reshape(p, nsb, 8, 2)
        sc = x[..., 16:144].reshape(p, nsb, 16, 8).transpose(-1, -2)
        ql = x[..., 144:1168].reshape(p, nsb, 4, 8, 8, 4).permute(0, 1, 4, 2, 3, 5)  # [.., row, pair, step, k]
        qh = x[..., 1168:].reshape(p, nsb, 2, 8, 8, 4).permute(0, 1, 4, 2, 3, 5)  # [.., row, quad, step, k]
        low = torch.stack([ql & 0x0F, ql >> 4], dim=4).reshape(p, nsb, 8, 8, 8, 4)
        high = torch.stack([qh >> (2 * i) & 0x03 for i in range(4)], dim=4).reshape(p, nsb, 8, 8, 8, 4)
        q = (low | (high << 4)).reshape(p, nsb, 8, 8, 32)
        blk = torch.cat([_q6_bytes(q), sc, d], dim=-1)
    return blk.permute(0, 2, 1, 3).reshape(p * PANEL_ROWS, -1).contiguous()
