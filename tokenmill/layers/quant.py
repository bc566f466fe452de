"""Quantized weights in GGUF's block formats, their quantizers, and pure-torch reference ops.

A ``QuantizedTensor`` is a weight matrix [N, K] stored as N rows of K/32 blocks, byte for byte
in one of two GGUF block layouts (32 weights along K per block):

- ``q8_0``: fp16 scale d, 32 int8 q; w = d * q (34 bytes: 8.5 bits per weight)
- ``q4_1``: fp16 scale d, fp16 min m, 16 bytes of nibbles; w = d * q + m, q in [0, 15]
  (20 bytes: 5 bits per weight). Weight j of a block is the low nibble of byte j, weight j + 16
  the high nibble.

``--quantization int8`` quantizes float weights to ``q8_0`` with one scale per output channel
(every block of a row shares it); ``int4`` to ``q4_1`` per group of 32 (scale and zero point);
``gguf`` keeps a GGUF file's own Q8_0 and Q4_1 blocks as they are, and turns Q4_0 into Q4_1
without loss (m = -8 d); a weight stored in any other type is quantized to Q8_0.

The fast path is ``torch.ops.tokenmill.qlinear`` (``csrc/cpu_kernels.cpp``): activations are
quantized per token and per block of 32 to int16 (32767 steps: the weights' own rounding is then all the
error there is, as in weight-only quantization) and multiplied on integer units, one arithmetic for
every batch size, so a token's result never depends on what else is in the batch. It reads the
same bytes reordered within each row (``QuantizedTensor.kernel_layout()``: the row's scales, then
its quants), which is how ``QuantizedLinear`` stores them. The functions here are its exact torch
emulation (``ref_qlinear``, used by the tests) and the dequantize path that serves devices
without the kernels (``dequantize``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenmill.config import QUANTIZATIONS
from tokenmill.layers.kernels import cpu_kernels

QK = 32
BLOCK_BYTES = {"q8_0": 34, "q4_1": 20}
FORMAT_IDS = {"q8_0": 0, "q4_1": 1}  # the kernel's fmt argument


@dataclass
class QuantizedTensor:
    data: torch.Tensor  # uint8 [N, K / 32 * block bytes]
    fmt: str  # "q8_0" | "q4_1"
    shape: tuple[int, int]  # (N, K) of the float matrix it stands for

    def __post_init__(self) -> None:
        n, k = self.shape
        if self.fmt not in BLOCK_BYTES:
            raise ValueError(f"unknown quantized format {self.fmt!r} (known: {', '.join(BLOCK_BYTES)})")
        if k % QK:
            raise ValueError(f"quantized weights need in_features divisible by {QK}, got {k}")
        want = (n, k // QK * BLOCK_BYTES[self.fmt])
        if self.data.dtype != torch.uint8 or tuple(self.data.shape) != want:
            raise ValueError(f"{self.fmt} data for a [{n}, {k}] matrix must be uint8 {want}, "
                             f"got {self.data.dtype} {tuple(self.data.shape)}")

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def blocks(self) -> torch.Tensor:
        n, k = self.shape
        return self.data.view(n, k // QK, BLOCK_BYTES[self.fmt])

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_rows(self.data, self.fmt, self.shape[1]).to(dtype)

    def to(self, device) -> "QuantizedTensor":
        return QuantizedTensor(self.data.to(device), self.fmt, self.shape)

    def kernel_layout(self) -> torch.Tensor:
        """The same bytes as the kernels take them: each row's fp16 scales (then, for q4_1, its fp16
        mins), then its quants, so that eight scales load at once (see csrc/cpu_kernels.cpp)."""
        blk = self.blocks()
        heads = [blk[..., 0:2], blk[..., 2:4]] if self.fmt == "q4_1" else [blk[..., 0:2]]  # d (and m)
        quants = blk[..., 2 * len(heads):]
        return torch.cat([p.reshape(self.shape[0], -1) for p in [*heads, quants]], 1).contiguous()

    @classmethod
    def from_kernel_layout(cls, data: torch.Tensor, fmt: str, shape: tuple[int, int]) -> "QuantizedTensor":
        """Inverse of ``kernel_layout``."""
        n, k = shape
        nb = k // QK
        cut = 4 if fmt == "q4_1" else 2
        heads = [data[:, 2 * nb * i: 2 * nb * (i + 1)].reshape(n, nb, 2) for i in range(cut // 2)]
        quants = data[:, cut * nb:].reshape(n, nb, BLOCK_BYTES[fmt] - cut)
        return cls(torch.cat([*heads, quants], -1).reshape(n, -1).contiguous(), fmt, shape)


def _f16(b: torch.Tensor) -> torch.Tensor:
    """[..., 2] uint8 -> [...] float32 (little-endian fp16)."""
    return b.contiguous().view(torch.float16).squeeze(-1).float()


def dequantize_rows(data: torch.Tensor, fmt: str, k: int) -> torch.Tensor:
    """uint8 [..., K/32 * bytes] blocks -> float32 [..., K]."""
    lead = data.shape[:-1]
    blk = data.reshape(*lead, k // QK, BLOCK_BYTES[fmt])
    d = _f16(blk[..., 0:2])[..., None]
    if fmt == "q8_0":
        q = blk[..., 2:].contiguous().view(torch.int8).float()
        w = d * q
    else:
        m = _f16(blk[..., 2:4])[..., None]
        nib = blk[..., 4:]
        q = torch.cat([nib & 0x0F, nib >> 4], dim=-1).float()
        w = d * q + m
    return w.reshape(*lead, k)


def _pack_f16(x: torch.Tensor) -> torch.Tensor:
    """float [...] -> uint8 [..., 2] (its fp16 bytes)."""
    return x.to(torch.float16).contiguous().view(torch.uint8).reshape(*x.shape, 2)


def quantize_int8(w: torch.Tensor) -> QuantizedTensor:
    """Symmetric int8 with one scale per output channel (row), stored as q8_0 blocks."""
    w = w.float()
    n, k = w.shape
    d = (w.abs().amax(1) / 127).to(torch.float16).float()  # the scale as stored
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    q = torch.round(w * inv[:, None]).clamp(-127, 127).to(torch.int8).view(n, k // QK, QK)
    dd = _pack_f16(d)[:, None, :].expand(n, k // QK, 2)
    data = torch.cat([dd, q.view(torch.uint8)], dim=-1).reshape(n, -1).contiguous()
    return QuantizedTensor(data, "q8_0", (n, k))


def quantize_q8_0(w: torch.Tensor) -> QuantizedTensor:
    """Symmetric int8 with one scale per block of 32 (GGUF Q8_0)."""
    w = w.float()
    n, k = w.shape
    g = w.view(n, k // QK, QK)
    d = (g.abs().amax(-1) / 127).to(torch.float16).float()
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    q = torch.round(g * inv[..., None]).clamp(-127, 127).to(torch.int8)
    data = torch.cat([_pack_f16(d), q.view(torch.uint8)], dim=-1).reshape(n, -1).contiguous()
    return QuantizedTensor(data, "q8_0", (n, k))


def quantize_int4(w: torch.Tensor) -> QuantizedTensor:
    """Asymmetric int4 per group of 32 (scale and zero point), stored as q4_1 blocks."""
    w = w.float()
    n, k = w.shape
    g = w.view(n, k // QK, QK)
    lo, hi = g.amin(-1), g.amax(-1)
    m = lo.to(torch.float16).float()
    d = ((hi - m) / 15).to(torch.float16).float()
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    q = torch.round((g - m[..., None]) * inv[..., None]).clamp(0, 15).to(torch.uint8)
    nib = q[..., :16] | (q[..., 16:] << 4)
    data = torch.cat([_pack_f16(d), _pack_f16(m), nib], dim=-1).reshape(n, -1).contiguous()
    return QuantizedTensor(data, "q4_1", (n, k))


def q4_0_to_q4_1(raw: torch.Tensor, k: int) -> torch.Tensor:
    """GGUF Q4_0 rows (fp16 d, 16 nibble bytes; w = d * (q - 8)) as Q4_1 rows, exactly: m = -8 d."""
    lead = raw.shape[:-1]
    blk = raw.reshape(*lead, k // QK, 18)
    d = _f16(blk[..., 0:2])
    m = -8 * d  # a power-of-two multiple: exact in fp16 unless it overflows
    if torch.isinf(m.to(torch.float16)).any():
        raise ValueError("a Q4_0 scale is too large to convert to Q4_1 without overflow")
    out = torch.cat([blk[..., 0:2], _pack_f16(m), blk[..., 2:]], dim=-1)
    return out.reshape(*lead, k // QK * 20).contiguous()


QK_K = 256  # a K-quant super-block


def q4_k_to_q4_1(raw: torch.Tensor, k: int) -> torch.Tensor:
    """GGUF Q4_K rows as Q4_1 rows. A Q4_K super-block (fp16 d and dmin, 6-bit scale sc and min m for each
    of its 8 sub-blocks of 32, 4-bit q; w = d sc q - dmin m) is 8 Q4_1 blocks with d' = d sc and
    m' = -dmin m. The quants move over unchanged; d' and m' are rounded to fp16 (d sc has up to 17
    significant bits): a relative change of at most 2^-11 in a sub-block's scale and min, 5.0 bits per
    weight instead of 4.5. ValueError if a product overflows fp16."""
    import numpy as np
    from gguf.quants import Q4_K

    lead = raw.shape[:-1]
    blk = raw.reshape(-1, 144)
    d, dmin = _f16(blk[:, 0:2]), _f16(blk[:, 2:4])
    sc, mn = (torch.from_numpy(x.astype(np.float32)) for x in Q4_K.get_scale_min(blk[:, 4:16].numpy()))
    scale, low = d[:, None] * sc, -dmin[:, None] * mn  # [blocks, 8], exact in float32
    if torch.isinf(scale.to(torch.float16)).any() or torch.isinf(low.to(torch.float16)).any():
        raise ValueError("a Q4_K scale is too large for an fp16 Q4_1 block")
    # sub-block 2c + h is nibble h of bytes 32c .. 32c + 31; Q4_1 wants weight j low, j + 16 high in byte j
    qs = blk[:, 16:].reshape(-1, 4, 1, 32)
    q = ((qs >> torch.tensor([0, 4], dtype=torch.uint8).view(1, 1, 2, 1)) & 0x0F).reshape(-1, 8, 32)
    nib = q[..., :16] | (q[..., 16:] << 4)
    out = torch.cat([_pack_f16(scale), _pack_f16(low), nib], dim=-1)  # [blocks, 8, 20]
    return out.reshape(*lead, k // QK * 20).contiguous()


def q5_0_to_q8_0(raw: torch.Tensor, k: int) -> torch.Tensor:
    """GGUF Q5_0 rows (fp16 d, 32 high bits, 16 nibble bytes; w = d (q - 16)) as Q8_0 rows, exactly:
    q - 16 is an int8 under the same d (8.5 bits per weight instead of 5.5)."""
    lead = raw.shape[:-1]
    blk = raw.reshape(-1, 22)
    high = blk[:, 2:6].contiguous().view(torch.int32)  # bit j: the fifth bit of weight j
    bits = ((high >> torch.arange(32, dtype=torch.int32)) & 1).to(torch.uint8)
    nib = blk[:, 6:]
    low = torch.cat([nib & 0x0F, nib >> 4], dim=-1)
    q = (low | (bits << 4)).to(torch.int16) - 16
    out = torch.cat([blk[:, 0:2], q.to(torch.int8).view(torch.uint8)], dim=-1)
    return out.reshape(*lead, k // QK * 34).contiguous()


def cat_rows(parts: list[QuantizedTensor]) -> QuantizedTensor:
    """Stack the rows of same-format, same-K matrices (fusing q/k/v or gate/up)."""
    fmt, k = parts[0].fmt, parts[0].shape[1]
    assert all(p.fmt == fmt and p.shape[1] == k for p in parts)
    return QuantizedTensor(torch.cat([p.data for p in parts], 0), fmt, (sum(p.shape[0] for p in parts), k))


# ---- the kernel's arithmetic, in torch --------------------------------------------------------

def ref_quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x float32 [M, K] -> (q int16 [M, K], d [M, K/32], d * sum(q) [M, K/32]) exactly as the kernel
    does: d = amax / 32767 per token and block of 32, q = round(x / d)."""
    m, k = x.shape
    g = x.float().reshape(m, k // QK, QK)
    d = g.abs().amax(-1) / 32767
    inv = torch.where(d != 0, 1 / d, torch.zeros_like(d))
    q = torch.round(g * inv[..., None]).clamp(-32767, 32767)  # round half to even, like the kernel
    return q.to(torch.int16).reshape(m, k), d, d * q.sum(-1)


def ref_qlinear(x: torch.Tensor, w: QuantizedTensor) -> torch.Tensor:
    """y = x W^T with int16 activations, as ``torch.ops.tokenmill.qlinear`` computes it (up to fp32
    summation order)."""
    n, k = w.shape
    lead = x.shape[:-1]
    q, dx, sx = ref_quantize_activations(x.reshape(-1, k))
    blk = w.blocks()
    dw = _f16(blk[..., 0:2])  # [N, nb]
    if w.fmt == "q8_0":
        qw = blk[..., 2:].contiguous().view(torch.int8).float()
    else:
        nib = blk[..., 4:]
        qw = torch.cat([nib & 0x0F, nib >> 4], dim=-1).float()
    # integer dot per (token, row, block): exact in float64 (|sum| < 2^31), as in the kernel's int32 lanes
    isum = torch.einsum("mbk,nbk->mnb", q.double().view(-1, k // QK, QK), qw.double()).float()
    y = ((isum * dx[:, None, :]) * dw[None]).sum(-1)
    if w.fmt == "q4_1":
        y = y + sx @ _f16(blk[..., 2:4]).t()
    return y.reshape(*lead, n)


# ---- the layer --------------------------------------------------------------------------------

class QuantizedLinear(torch.nn.Module):
    """y = x W^T + b with W in q8_0 or q4_1 blocks.

    On the CPU it runs ``torch.ops.tokenmill.qlinear`` (integer dot products on the blocks). Where
    the kernels cannot run (another device, or no compiler) it dequantizes W once, on first use,
    and keeps the float copy: correct, but without the memory saving; the loader logs that.
    """

    def __init__(self, weight: QuantizedTensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.fmt = weight.fmt
        self.register_buffer("qweight", weight.kernel_layout())  # what the kernels read
        self.register_buffer("bias", None if bias is None else bias.detach().clone())
        self._dense: torch.Tensor | None = None

    @property
    def weight(self) -> QuantizedTensor:
        return QuantizedTensor.from_kernel_layout(self.qweight, self.fmt, (self.out_features, self.in_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ops = _ops() if x.device.type == "cpu" else None
        if ops is not None:  # the same integer arithmetic for any number of tokens (batch invariance)
            y = ops.qlinear(x.float(), self.qweight, self.out_features, FORMAT_IDS[self.fmt]).to(x.dtype)
            return y if self.bias is None else y + self.bias
        if self._dense is None or self._dense.device != x.device or self._dense.dtype != x.dtype:
            self._dense = self.weight.dequantize(torch.float32).to(device=x.device, dtype=x.dtype)
        return torch.nn.functional.linear(x, self._dense, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, format={self.fmt}"


class QuantizedEmbedding(torch.nn.Module):
    """Token embedding lookups from a tied output head's own blocks (a GGUF file's Q8_0 embedding, say):
    only the looked-up rows are dequantized, so the model holds no float copy of the matrix (113 MB for
    the default model). The values are those a float copy would hold: the same dequantization."""

    def __init__(self, head: QuantizedLinear) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = head.out_features, head.in_features
        self.fmt = head.fmt
        object.__setattr__(self, "_head", head)  # not a submodule: the blocks are the head's, counted there

    @property
    def qweight(self) -> torch.Tensor:
        return self._head.qweight  # wherever model.to() moved it

    @property
    def weight(self) -> torch.Tensor:
        """The whole matrix as floats (a new tensor; only for code that wants it all)."""
        return QuantizedTensor.from_kernel_layout(self.qweight, self.fmt, (self.num_embeddings,
                                                                           self.embedding_dim)).dequantize()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.qweight.index_select(0, ids.reshape(-1))
        x = QuantizedTensor.from_kernel_layout(rows, self.fmt, (rows.shape[0], self.embedding_dim)).dequantize()
        return x.view(*ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, format={self.fmt} (the head's blocks)"


def _ops():
    return cpu_kernels()  # cached after the first call


def quantize_weight(w: torch.Tensor, mode: str) -> QuantizedTensor:
    """A float [N, K] weight in the format a --quantization mode uses (gguf: Q8_0 for weights the file
    did not quantize in a kept format)."""
    if mode == "int8":
        return quantize_int8(w)
    if mode == "int4":
        return quantize_int4(w)
    if mode == "gguf":
        return quantize_q8_0(w)
    raise ValueError(f"--quantization must be one of {', '.join(QUANTIZATIONS)}, got {mode!r}")
