"""GGUF K-quant blocks for the tests: simple Q4_K and Q6_K quantizers (gguf-py only dequantizes them, and
llama.cpp's llama-quantize cannot run here), random valid blocks of every K type, and the embedded model
requantized by llama.cpp's Q4_K_M and Q6_K recipes. Checked against gguf-py's dequantizers, which are
the reference: any valid blocks will do, these are round-to-nearest per (sub-)block."""

from __future__ import annotations

from pathlib import Path

import numpy as np

QK_K = 256
BLOCK_BYTES = {"Q2_K": 84, "Q3_K": 110, "Q4_K": 144, "Q5_K": 176, "Q6_K": 210, "Q5_0": 22}
# where each type keeps its fp16 super-block scale(s) (random bytes there would be NaN or huge)
SCALE_OFFSETS = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "Q5_0": (0,)}
BLOCK_WEIGHTS = {"Q5_0": 32}  # weights per block where not a super-block of 256


def _f16_bytes(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x.astype(np.float16)).view(np.uint8).reshape(-1, 2)


def quantize_q4_k(w: np.ndarray) -> np.ndarray:
    """[rows, K] float -> [rows, K / 256 * 144] Q4_K blocks (w = d sc q - dmin m per sub-block of 32). The
    6-bit min and scale round up, so every sub-block's range is covered and nothing clips."""
    rows, k = w.shape
    x = w.astype(np.float32).reshape(-1, 8, 32)  # super-blocks x sub-blocks
    lo = np.minimum(x.min(-1), 0.0)
    dmin = ((-lo).max(-1) / 63).astype(np.float16).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        m = np.where(dmin[:, None] > 0, np.ceil(-lo / dmin[:, None]), 0).clip(0, 63)
        need = (x.max(-1) + dmin[:, None] * m) / 15  # the step that spans [-dmin m, max]
        d = (need.max(-1) / 63).astype(np.float16).astype(np.float32)
        sc = np.where(d[:, None] > 0, np.ceil(need / d[:, None]), 0).clip(0, 63)
        step = d[:, None, None] * sc[..., None]
        q = np.where(step > 0, np.rint((x + (dmin[:, None] * m)[..., None]) / step), 0).clip(0, 15)
    q, sc, m = q.astype(np.uint8), sc.astype(np.uint8), m.astype(np.uint8)
    scales = np.zeros((len(x), 12), np.uint8)
    scales[:, 0:4] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    scales[:, 4:8] = m[:, :4] | ((m[:, 4:] >> 4) << 6)
    scales[:, 8:12] = (sc[:, 4:] & 0x0F) | ((m[:, 4:] & 0x0F) << 4)
    qs = (q[:, 0::2] | (q[:, 1::2] << 4)).reshape(len(x), 128)  # chunk c: sub-block 2c low, 2c + 1 high
    out = np.concatenate([_f16_bytes(d), _f16_bytes(dmin), scales, qs], axis=1)
    return out.reshape(rows, k // QK_K * 144)


def quantize_q6_k(w: np.ndarray) -> np.ndarray:
    """[rows, K] float -> [rows, K / 256 * 210] Q6_K blocks (w = d sc (q - 32) per sub-block of 16)."""
    rows, k = w.shape
    x = w.astype(np.float32).reshape(-1, 16, 16)
    amax = np.abs(x).max(-1)
    scale = amax / 31
    d = scale.max(-1) / 127
    d16 = d.astype(np.float16).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(d16[:, None] > 0, np.rint(scale / d16[:, None]), 0).clip(-128, 127)
        step = d16[:, None, None] * sc[..., None]
        q = np.where(step > 0, np.rint(x / step), 0).clip(-32, 31)
    q = (q + 32).astype(np.uint8).reshape(-1, 2, 4, 32)  # [block, half, quarter, 32]
    ql = np.concatenate([q[:, :, 0] & 0x0F | (q[:, :, 2] & 0x0F) << 4,
                         q[:, :, 1] & 0x0F | (q[:, :, 3] & 0x0F) << 4], axis=-1).reshape(len(x), 128)
    qh = ((q[:, :, 0] >> 4) | (q[:, :, 1] >> 4) << 2 | (q[:, :, 2] >> 4) << 4 | (q[:, :, 3] >> 4) << 6)
    out = np.concatenate([ql, qh.reshape(len(x), 64), sc.astype(np.int8).view(np.uint8), _f16_bytes(d16)], axis=1)
    return out.reshape(rows, k // QK_K * 210)


def random_blocks(kind: str, rows: int, k: int, seed: int = 0, scale: float = 1e-3) -> np.ndarray:
    """Random bytes as [rows, K / 256 * bytes] blocks of ``kind`` (Q5_0: K / 32), with small positive fp16
    scales."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(rows * k // BLOCK_WEIGHTS.get(kind, QK_K), BLOCK_BYTES[kind]), dtype=np.uint8)
    for off in SCALE_OFFSETS[kind]:
        blocks[:, off:off + 2] = _f16_bytes(rng.uniform(0.2, 1.0, len(blocks)) * scale)
    return blocks.reshape(rows, -1)


def requantize_gguf(src: Path, dst: Path, recipe: str) -> Path:
    """``src`` with its 2-D weights requantized as llama-quantize --allow-requantize does for ``recipe``
    (Q4_K_M or Q6_K), every metadata field copied: Q4_K_M puts Q6_K on attn_v and on ffn_down in every
    other layer, Q4_K elsewhere, Q6_K on the output (here the tied embedding); a tensor whose rows are not a
    multiple of 256 falls back as llama.cpp's does (Q4_K -> Q5_0, Q6_K -> Q8_0)."""
    import gguf

    T = gguf.GGMLQuantizationType
    reader = gguf.GGUFReader(str(src))
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(str(dst), arch)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), vtype, sub_type=sub)
    for t in reader.tensors:
        shape = tuple(int(x) for x in reversed(t.shape))
        w = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
        if len(shape) != 2:
            writer.add_tensor(t.name, w)
            continue
        if recipe == "Q6_K" or t.name == "token_embd.weight" or ".attn_v." in t.name or (
                ".ffn_down." in t.name and int(t.name.split(".")[1]) % 2 == 0):
            kind = T.Q6_K
        else:
            kind = T.Q4_K
        if shape[1] % QK_K:
            kind = {T.Q4_K: T.Q5_0, T.Q6_K: T.Q8_0}[kind]
            data = gguf.quants.quantize(w, kind)
        else:
            data = (quantize_q4_k if kind == T.Q4_K else quantize_q6_k)(w)
        writer.add_tensor(t.name, data, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst
