"""Quantized weights in GGUF's block formats, their quantizers, and pure-torch reference ops.

A ``QuantizedTensor`` is a weight matrix [N, K] stored as N rows of blocks along K, byte for byte
in one of these GGUF block layouts (blocks of 32 weights; the K-quants' super-blocks of 256 hold 8
sub-blocks of 32, or of 16 for Q6_K, whose scales their header keeps):

- ``q8_0``: fp16 scale d, 32 int8 q; w = d * q (34 bytes: 8.5 bits per weight)
- ``q4_1``: fp16 scale d, fp16 min m, 16 bytes of nibbles; w = d * q + m, q in [0, 15]
  (20 bytes: 5 bits per weight). Weight j of a block is the low nibble of byte j, weight j + 16
  the high nibble.
- ``q5_0``: fp16 d, 4 bytes qh, 16 bytes of nibbles; w = d * (q - 16), q in [0, 31]: nibbles as
  q4_1's, bit j of qh the fifth bit of weight j (22 bytes: 5.5 bits per weight)
- ``q4_k``: per 256: fp16 d, fp16 dmin, 12 bytes of 6-bit scales sc and mins m (one each per sub-block
  of 32), 128 bytes of nibbles; w = d sc q - dmin m (144 bytes: 4.5 bits per weight)
- ``q5_k``: ``q4_k`` plus 32 bytes of fifth bits (176 bytes: 5.5 bits per weight)
- ``q6_k``: per 256: 6-bit q (128 bytes of low nibbles, 64 of high pairs), int8 scales sc (one per 16),
  fp16 d; w = d sc (q - 32) (210 bytes: 6.5625 bits per weight)

``--quantization int8`` quantizes float weights to ``q8_0`` with one scale per output channel
(every block of a row shares it); ``int4`` to ``q4_1`` per group of 32 (scale and zero point);
``gguf`` keeps a GGUF file's own Q8_0, Q4_1, Q5_0, Q4_K, Q5_K and Q6_K blocks as they are, and turns
Q4_0 into Q4_1 without loss (m = -8 d); a weight stored in any other type is quantized to Q8_0. The
K-quants run exactly: a sub-block's scale d sc (and min dmin m) is exact in float32, so the kernels
scale by the file's own values.

The fast path is ``torch.ops.tokenmill.qlinear`` (``csrc/cpu_kernels.cpp``): activations are
quantized per token and per block of 32 to int16 (32767 steps: the weights' own rounding is then all the
error there is, as in weight-only quantization) and multiplied on integer units, one arithmetic for
every batch size, so a token's result never depends on what else is in the batch. It reads the
same bytes reordered within each row (``QuantizedTensor.kernel_layout()``: for q8_0, q4_1 and q5_0 the
row's scales, then its quants; the K-quants' super-blocks as they are), which is how ``QuantizedLinear``
stores them. The functions here are its exact torch emulation (``ref_qlinear``, bit for bit, used by the
tests) and the dequantize path that serves devices without the kernels (``dequantize``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenmill.config import QUANTIZATIONS
from tokenmill.layers.formats import BLOCK_BYTES, BLOCK_WEIGHTS, FORMAT_IDS, QK, QK_K  # noqa: F401 (re-exported)
from tokenmill.layers.kernels import cpu_kernels
from tokenmill.layers.panels import PANEL_FORMATS, ROW_FORMATS, from_panels, panel_format, to_panels

_HEADS = {"q8_0": 2, "q4_1": 4, "q5_0": 2}  # bytes of fp16 scale (and min) that kernel_layout moves to the front


@dataclass
class QuantizedTensor:
    data: torch.Tensor  # uint8 [N, K / block weights * block bytes]
    fmt: str  # a FORMAT_IDS key
    shape: tuple[int, int]  # (N, K) of the float matrix it stands for

    def __post_init__(self) -> None:
        n, k = self.shape
        if self.fmt not in BLOCK_BYTES:
            raise ValueError(f"unknown quantized format {self.fmt!r} (known: {', '.join(BLOCK_BYTES)})")
        if k % BLOCK_WEIGHTS[self.fmt]:
            raise ValueError(f"{self.fmt} weights need in_features divisible by {BLOCK_WEIGHTS[self.fmt]}, got {k}")
        want = (n, k // BLOCK_WEIGHTS[self.fmt] * BLOCK_BYTES[self.fmt])
        if self.data.dtype != torch.uint8 or tuple(self.data.shape) != want:
            raise ValueError(f"{self.fmt} data for a [{n}, {k}] matrix must be uint8 {want}, "
                             f"got {self.data.dtype} {tuple(self.data.shape)}")

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def blocks(self) -> torch.Tensor:
        n, k = self.shape
        return self.data.view(n, k // BLOCK_WEIGHTS[self.fmt], BLOCK_BYTES[self.fmt])

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_rows(self.data, self.fmt, self.shape[1]).to(dtype)

    def to(self, device) -> "QuantizedTensor":
        return QuantizedTensor(self.data.to(device), self.fmt, self.shape)

    def kernel_layout(self, panels: bool = False) -> torch.Tensor:
        """The same bytes as the kernels take them (a new tensor): for q8_0, q4_1 and q5_0 each row's fp16
        scales (then, for q4_1, its fp16 mins), then its quants, so that eight scales load at once; the
        K-quants' super-blocks as they are (each header holds its eight sub-blocks' scales). See
        csrc/cpu_kernels.cpp. ``panels``: in the panel format of ``panel_format(fmt, n, k)`` instead
        (layers/panels.py), which the caller checked there is."""
        if panels:  # in C++ where the kernels are (the torch reference builds large temporaries)
            ops = _ops()
            if ops is None:
                return to_panels(self.data, self.fmt, self.shape)
            return ops.to_panels(self.data.contiguous(), FORMAT_IDS[PANEL_FORMATS[self.fmt]], *self.shape)
        if self.fmt not in _HEADS:
            return self.data.contiguous().clone()
        blk = self.blocks()
        n, nb, size = blk.shape
        cut = _HEADS[self.fmt]
        out = torch.empty(n, nb * size, dtype=torch.uint8)  # filled in place: no temporaries of the matrix
        for i in range(0, cut, 2):  # d (and m)
            out[:, nb * i: nb * (i + 2)].view(n, nb, 2).copy_(blk[..., i:i + 2])
        out[:, nb * cut:].view(n, nb, size - cut).copy_(blk[..., cut:])
        return out

    @classmethod
    def from_kernel_layout(cls, data: torch.Tensor, fmt: str, shape: tuple[int, int]) -> "QuantizedTensor":
        """Inverse of ``kernel_layout``; ``fmt`` the kernel format (a panel format for panels)."""
        if fmt in ROW_FORMATS:
            return cls(from_panels(data, ROW_FORMATS[fmt], shape[1]), ROW_FORMATS[fmt], shape)
        if fmt not in _HEADS:
            return cls(data.contiguous(), fmt, shape)
        n, k = shape
        nb = k // QK
        cut = _HEADS[fmt]
        heads = [data[:, 2 * nb * i: 2 * nb * (i + 1)].reshape(n, nb, 2) for i in range(cut // 2)]
        quants = data[:, cut * nb:].reshape(n, nb, BLOCK_BYTES[fmt] - cut)
        return cls(torch.cat([*heads, quants], -1).reshape(n, -1).contiguous(), fmt, shape)


def _f16(b: torch.Tensor) -> torch.Tensor:
    """[..., 2] uint8 -> [...] float32 (little-endian fp16)."""
    return b.contiguous().view(torch.float16).squeeze(-1).float()


def _nibbles(b: torch.Tensor) -> torch.Tensor:
    """[..., 16] bytes -> [..., 32] (weight j the low nibble of byte j, weight j + 16 its high nibble)."""
    return torch.cat([b & 0x0F, b >> 4], dim=-1)


def _bits(b: torch.Tensor, n: int) -> torch.Tensor:
    """[..., n / 8] bytes -> [..., n] of 0/1: bit j of the little-endian bytes."""
    shifts = torch.arange(8, dtype=torch.uint8)
    return ((b[..., :, None] >> shifts) & 1).reshape(*b.shape[:-1], n)


def _k_scales(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's 12 scale bytes [..., 12] -> (sc, m) [..., 8] uint8 (gguf's Q4_K.get_scale_min)."""
    d, m, md = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mn


def decode_blocks(data: torch.Tensor, fmt: str, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """uint8 [..., blocks bytes] (GGUF layout) -> per block of 32 weights: (q float32 [..., K/32, 32] the
    integers the kernels multiply, scale float32 [..., K/32, 1] (q6_k: [..., K/32, 2], one per 16 weights),
    min float32 [..., K/32] or None), w = scale * q + min. Every scale and min is exact in float32 (a
    K-quant's d sc is an fp16 times a small integer), as the kernels compute them."""
    lead = data.shape[:-1]
    blk = data.reshape(*lead, k // BLOCK_WEIGHTS[fmt], BLOCK_BYTES[fmt])
    nb = k // QK
    if fmt == "q8_0":
        return blk[..., 2:].contiguous().view(torch.int8).float(), _f16(blk[..., 0:2])[..., None], None
    if fmt == "q4_1":
        return _nibbles(blk[..., 4:]).float(), _f16(blk[..., 0:2])[..., None], _f16(blk[..., 2:4])
    if fmt == "q5_0":
        q = _nibbles(blk[..., 6:]) | (_bits(blk[..., 2:6], 32) << 4)
        return q.float() - 16, _f16(blk[..., 0:2])[..., None], None
    if fmt in ("q4_k", "q5_k"):
        d, dmin = _f16(blk[..., 0:2])[..., None], _f16(blk[..., 2:4])[..., None]
        sc, mn = _k_scales(blk[..., 4:16])
        off = 16 if fmt == "q4_k" else 48
        qs = blk[..., off:off + 128].reshape(*lead, -1, 4, 1, 32)  # sub-block 2c + h: nibble h of chunk c
        q = ((qs >> torch.tensor([0, 4], dtype=torch.uint8).view(2, 1)) & 0x0F).reshape(*lead, nb, 32)
        if fmt == "q5_k":  # bit j of qh[l]: the fifth bit of sub-block j's weight l
            qh = blk[..., 16:48].reshape(*lead, -1, 1, 32) >> torch.arange(8, dtype=torch.uint8).view(8, 1)
            q = q | ((qh & 1) << 4).reshape(*lead, nb, 32)
        scale = (d * sc.float()).reshape(*lead, nb, 1)
        low = -(dmin * mn.float()).reshape(*lead, nb)
        return q.float(), scale, low
    assert fmt == "q6_k", fmt
    ql = blk[..., 0:128].reshape(*lead, -1, 2, 1, 64) >> torch.tensor([0, 4], dtype=torch.uint8).view(2, 1)
    qh = blk[..., 128:192].reshape(*lead, -1, 2, 1, 32) >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(4, 1)
    q = (ql & 0x0F).reshape(*lead, nb, 32) | ((qh & 0x03) << 4).reshape(*lead, nb, 32)
    sc = blk[..., 192:208].contiguous().view(torch.int8).float()
    scale = (_f16(blk[..., 208:210])[..., None] * sc).reshape(*lead, nb, 2)
    return q.float() - 32, scale, None


def dequantize_rows(data: torch.Tensor, fmt: str, k: int) -> torch.Tensor:
    """uint8 [..., blocks bytes] (GGUF layout) -> float32 [..., K]: gguf-py's values, bit for bit."""
    lead = data.shape[:-1]
    q, scale, low = decode_blocks(data, fmt, k)
    w = (q.view(*q.shape[:-1], scale.shape[-1], -1) * scale[..., None]).view(q.shape)
    if low is not None:
        w = w + low[..., None]
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


def q4_k_to_q5_k(raw: torch.Tensor, k: int) -> torch.Tensor:
    """GGUF Q4_K rows as Q5_K rows, exactly: the same header and nibbles, every fifth bit 0."""
    lead = raw.shape[:-1]
    blk = raw.reshape(-1, 144)
    out = torch.cat([blk[:, 0:16], torch.zeros(len(blk), 32, dtype=torch.uint8), blk[:, 16:]], dim=-1)
    return out.reshape(*lead, k // QK_K * 176).contiguous()


# Exact conversions between kept formats, for a fused layer whose parts a file stores in different ones
# (llama.cpp's recipes give v_proj more bits than q and k; rows not a multiple of 256 fall back to Q5_0 or
# Q8_0): (from, to) -> the converter of GGUF block rows.
_EXACT = {("q5_0", "q8_0"): q5_0_to_q8_0, ("q4_k", "q5_k"): q4_k_to_q5_k}


def common_format(fmts) -> str | None:
    """The format that weights in ``fmts`` can all be held in exactly (one of them), or None."""
    fmts = set(fmts)
    for to in sorted(fmts):
        if all(f == to or (f, to) in _EXACT for f in fmts):
            return to
    return None


def to_format(w: QuantizedTensor, fmt: str) -> QuantizedTensor:
    """``w`` in ``fmt``, exactly (see common_format)."""
    if w.fmt == fmt:
        return w
    return QuantizedTensor(_EXACT[(w.fmt, fmt)](w.data, w.shape[1]), fmt, w.shape)


def cat_rows(parts: list[QuantizedTensor]) -> QuantizedTensor:
    """Stack the rows of same-format, same-K matrices (fusing q/k/v or gate/up)."""
    fmt, k = parts[0].fmt, parts[0].shape[1]
    assert all(p.fmt == fmt and p.shape[1] == k for p in parts)
    return QuantizedTensor(torch.cat([p.data for p in parts], 0), fmt, (sum(p.shape[0] for p in parts), k))


# ---- the kernel's arithmetic, in torch --------------------------------------------------------

def ref_quantize_activations(x: torch.Tensor, int8: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x float32 [M, K] -> (q int16 [M, K], d [M, K/32], d * sum(q) [M, K/32]) exactly as the kernel
    does: d = amax / 32767 per token and block of 32, q = round(x / d). ``int8`` (the kernels'
    ``TOKENMILL_ACTIVATIONS=int8``): 127 steps, q8 = round(x / d8) with d8 = amax / 127, held as
    q = 256 q8 and d = d8 / 256."""
    m, k = x.shape
    g = x.float().reshape(m, k // QK, QK)
    steps = 127 if int8 else 32767
    d = g.abs().amax(-1) / steps
    inv = torch.where(d != 0, 1 / d, torch.zeros_like(d))
    q = torch.round(g * inv[..., None]).clamp(-steps, steps)  # round half to even, like the kernel
    if int8:
        q, d = q * 256, d / 256
    return q.to(torch.int16).reshape(m, k), d, d * q.sum(-1)


def _fma(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """float32 a * b + c rounded once, as an FMA instruction does. a * b is exact in float64; the float64
    sum is made round-to-odd (its rounding error from TwoSum; on an inexact even result, one step toward
    the exact value), which then rounds to float32 as the exact sum would (53 >= 2 * 24 + 2 bits)."""
    p, c = a.double() * b.double(), c.double()
    s = p + c
    bp = s - c
    err = (p - bp) + (c - (s - bp))
    even = (s.view(torch.int64) & 1) == 0
    toward = torch.where(err > 0, torch.full_like(s, float("inf")), torch.full_like(s, float("-inf")))
    return torch.where((err != 0) & even, torch.nextafter(s, toward), s).float()


def ref_qlinear(x: torch.Tensor, w: QuantizedTensor, int8: bool = False) -> torch.Tensor:
    """y = x W^T with int16 activations (int8 steps with ``int8``), exactly as ``torch.ops.tokenmill.qlinear`` computes it, bit for
    bit: per (token, row) eight float32 accumulators, lane j taking blocks j, j + 8, ... (the short last
    group padded with zeros), each block one FMA of its exact integer sum by d_w * d_x (q6_k: one per
    half, first then second), after the min term's FMA m_w * d_x * sum(q_x) where there is one; then the
    kernels' tree over the eight lanes."""
    n, k = w.shape
    lead = x.shape[:-1]
    q, dx, sx = ref_quantize_activations(x.reshape(-1, k), int8)
    m, nb = q.shape[0], k // QK
    qw, dw, mw = decode_blocks(w.data, w.fmt, k)  # [N, nb, 32], [N, nb, S], [N, nb] or None
    halves = dw.shape[-1]
    # the integer dot per (token, row, block or half) is exact in float64 (|sum| < 2^31), as in the kernel's
    # int32 lanes; one rounding to float32, as its conversion does
    isum = torch.einsum("mbsk,nbsk->mnbs", q.double().view(m, nb, halves, -1),
                        qw.double().view(n, nb, halves, -1)).float()
    isum, dw, dx, sx = _groups(isum, 2), _groups(dw, 1), _groups(dx, 1), _groups(sx, 1)
    mw = None if mw is None else _groups(mw, 1)
    acc = torch.zeros(m, n, 8)
    for g in range(dx.shape[1]):
        if mw is not None:
            acc = _fma(mw[None, :, g], sx[:, None, g], acc)
        for h in range(halves):
            acc = _fma(isum[:, :, g, :, h], dw[None, :, g, :, h] * dx[:, None, g], acc)
    a = acc.unbind(-1)
    y = ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]))
    return y.reshape(*lead, n)


def _groups(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Blocks along ``dim`` as (groups, 8), the last group padded with zeros, as the kernels group them."""
    pad = -t.shape[dim] % 8
    if pad:
        shape = list(t.shape)
        shape[dim] = pad
        t = torch.cat([t, t.new_zeros(shape)], dim)
    return t.unflatten(dim, (-1, 8))


# ---- the layer --------------------------------------------------------------------------------

class QuantizedLinear(torch.nn.Module):
    """y = x W^T + b with W in one of the block formats above (FORMAT_IDS).

    On the CPU it runs ``torch.ops.tokenmill.qlinear`` (integer dot products on the blocks). Where
    the kernels cannot run (another device, or no compiler) it dequantizes W once, on first use,
    and keeps the float copy: correct, but without the memory saving; the loader logs that.
    """

    def __init__(self, weight: QuantizedTensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.fmt = weight.fmt
        # panels of 8 rows where the kernels run (they alone read them faster)
        self.kernel_fmt = panel_format(weight.fmt, *weight.shape) if _ops() is not None else weight.fmt
        self.register_buffer("qweight", weight.kernel_layout(panels=self.kernel_fmt != self.fmt))  # what the kernels read
        self.register_buffer("bias", None if bias is None else bias.detach().clone())
        self._dense: torch.Tensor | None = None

    @property
    def weight(self) -> QuantizedTensor:
        return QuantizedTensor.from_kernel_layout(self.qweight, self.kernel_fmt, (self.out_features, self.in_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ops = _ops() if x.device.type == "cpu" else None
        if ops is not None:  # the same integer arithmetic for any number of tokens (batch invariance)
            y = ops.qlinear(x.float(), self.qweight, self.out_features, FORMAT_IDS[self.kernel_fmt]).to(x.dtype)
            return y if self.bias is None else y + self.bias
        if self._dense is None or self._dense.device != x.device or self._dense.dtype != x.dtype:
            self._dense = self.weight.dequantize(torch.float32).to(device=x.device, dtype=x.dtype)
        return torch.nn.functional.linear(x, self._dense, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, format={self.fmt}"


class StackedLinear(torch.nn.Module):
    """A fused layer (q/k/v) whose parts a file holds in formats no one format holds exactly (llama.cpp's
    Q4_K_M: Q4_K q and k, Q6_K v in some layers): each group of parts a QuantizedLinear on its own blocks, the
    outputs side by side, then the bias. Each part's output is its own layer's bits (the activations are
    quantized per token alone), so this is the fused kernels' arithmetic too (attention_half's w[4])."""

    def __init__(self, parts: list[QuantizedTensor], bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.parts = torch.nn.ModuleList(QuantizedLinear(p) for p in parts)
        self.in_features = parts[0].shape[1]
        self.out_features = sum(p.shape[0] for p in parts)
        self.register_buffer("bias", None if bias is None else bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.cat([p(x) for p in self.parts], -1)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"formats={', '.join(p.fmt for p in self.parts)}"


class QuantizedEmbedding(torch.nn.Module):
    """Token embedding lookups from quantized blocks: a tied output head's (a GGUF file's Q8_0 embedding,
    say), or, ``own``, the file's own embedding of an untied model (a Q4_K token_embd beside a Q6_K output).
    Only the looked-up rows are dequantized, so the model holds no float copy of the matrix (113 MB for the
    default model, 4 bytes x vocabulary x hidden for an untied one). The values are those a float copy
    would hold: the same dequantization."""

    def __init__(self, head: QuantizedLinear, own: bool = False) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = head.out_features, head.in_features
        self.fmt = head.fmt
        if own:
            self.blocks = head  # a submodule: model.to() moves it and its bytes count here
        object.__setattr__(self, "_head", head)  # (not a submodule when it is the head's: counted there)

    @property
    def qweight(self) -> torch.Tensor:
        return self._head.qweight  # wherever model.to() moved it

    @property
    def weight(self) -> torch.Tensor:
        """The whole matrix as floats (a new tensor; only for code that wants it all)."""
        return QuantizedTensor.from_kernel_layout(self.qweight, self._head.kernel_fmt,
                                                  (self.num_embeddings, self.embedding_dim)).dequantize()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        shape, ids = ids.shape, ids.reshape(-1)
        if self._head.kernel_fmt in ROW_FORMATS:  # panels of 8 rows (only where the kernels load): each id's row
            rows = _ops().panel_rows(self.qweight, FORMAT_IDS[self._head.kernel_fmt], self.embedding_dim, ids)
        else:
            rows = QuantizedTensor.from_kernel_layout(self.qweight.index_select(0, ids), self.fmt,
                                                      (ids.numel(), self.embedding_dim)).data
        x = QuantizedTensor(rows, self.fmt, (ids.numel(), self.embedding_dim)).dequantize()
        return x.view(*shape, self.embedding_dim)

    def extra_repr(self) -> str:
        whose = "its own blocks" if hasattr(self, "blocks") else "the head's blocks"
        return f"{self.num_embeddings}, {self.embedding_dim}, format={self.fmt} ({whose})"


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
