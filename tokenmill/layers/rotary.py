"""Rotary position embedding (RoPE), rotate-half layout as in Hugging Face Llama/Qwen2, with the scalings
transformers implements (linear, llama3, yarn, dynamic NTK, Phi-3's longrope) and partial rotary (the leading
dims of each head rotate, the rest pass)."""

from __future__ import annotations

import math

import torch

ROPE_TYPES = ("default", "linear", "llama3", "yarn", "dynamic", "longrope")


def rope_parameters(dim: int, theta: float, scaling: dict | None,
                    max_positions: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [dim // 2] (dim: the rotated dims of a head) with the config's scaling applied, and
    the factor cos and sin are multiplied by (YaRN's and longrope's attention factor; 1 otherwise).

    transformers changes two of the scalings with the length of the sequence in each forward pass: dynamic NTK
    grows its base past the original context, longrope switches from its short to its long factors there. A
    request's tokens would then depend on what else is in its batch, so here max_positions (the engine's
    max_model_len) fixes them once, as vLLM does: dynamic NTK takes the base transformers takes at a sequence of
    max_positions tokens (the plain base up to the original context), longrope its long factors where
    max_positions passes the original context and its short ones otherwise."""
    exps = torch.arange(0, dim, 2, dtype=torch.float64) / dim
    inv_freq = 1.0 / (theta ** exps)
    if not scaling:
        return inv_freq.float(), 1.0
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    scale = 1.0
    if kind == "default":
        pass
    elif kind == "linear":
        inv_freq = inv_freq / float(scaling["factor"])
    elif kind == "llama3":
        # Llama 3.1: leave high frequencies, divide low ones by factor, blend in between.
        factor = float(scaling["factor"])
        low, high = float(scaling.get("low_freq_factor", 1.0)), float(scaling.get("high_freq_factor", 4.0))
        old_len = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_len / wavelen - low) / (high - low)
        blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        inv_freq = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        mid = (wavelen <= old_len / low) & (wavelen >= old_len / high)
        inv_freq = torch.where(mid, blended, inv_freq)
    elif kind == "freq_factors":
        # GGUF files carry Llama 3.1-style scaling as a per-frequency divisor tensor (rope_freqs).
        inv_freq = inv_freq / torch.as_tensor(scaling["factors"]).double()
    elif kind == "dynamic":
        factor, orig = float(scaling["factor"]), scaling["original_max_position_embeddings"]
        length = max(max_positions, orig)
        base = theta * ((factor * length / orig) - (factor - 1)) ** (dim / (dim - 2))
        inv_freq = 1.0 / (base ** exps)
    elif kind == "yarn":
        inv_freq, scale = _yarn(dim, theta, scaling, exps)
    elif kind == "longrope":
        orig = scaling["original_max_position_embeddings"]
        factors = scaling["long_factor" if max_positions > orig else "short_factor"]
        if len(factors) != dim // 2:
            raise ValueError(f"longrope factors have {len(factors)} entries, the rotated dims {dim // 2} frequencies")
        inv_freq = inv_freq / torch.tensor(factors, dtype=torch.float64)
        factor = float(scaling["factor"])
        scale = scaling.get("attention_factor") or (
            1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(orig)))
    else:
        raise ValueError(f"rope_scaling type {kind!r} is not supported (supported: {', '.join(ROPE_TYPES)})")
    return inv_freq.float(), float(scale)


def _yarn(dim: int, theta: float, scaling: dict, exps: torch.Tensor) -> tuple[torch.Tensor, float]:
    """YaRN (transformers' _compute_yarn_parameters): frequencies interpolated by factor below a ramp between
    beta_slow and beta_fast rotations over the original context, kept above it; attention factor 0.1 ln(s) + 1."""
    factor, orig = float(scaling["factor"]), scaling["original_max_position_embeddings"]

    def mscale(s: float, m: float = 1.0) -> float:
        return 1.0 if s <= 1 else 0.1 * m * math.log(s) + 1.0

    scale = scaling.get("attention_factor")
    if scale is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        scale = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    fast, slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(fast), correction_dim(slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # (transformers' guard against a zero-width ramp)
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** exps
    keep = 1 - ramp  # the share of each frequency extrapolated (kept) rather than interpolated
    return (1.0 / (factor * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep, float(scale)


class RotaryEmbedding(torch.nn.Module):
    """cos/sin tables per position, grown on the CPU a chunk of positions at a time as positions are asked
    for: a 128k-token context's full tables (32-64 MB) are not held for the few thousand positions a
    server reaches. A chunk's values are computed alone, so they are the same bits whenever it is made.
    dim: the dims of a head that rotate (all of it, or a partial rotary's leading share)."""

    CHUNK = 4096

    def __init__(self, dim: int, max_positions: int, theta: float, scaling: dict | None) -> None:
        super().__init__()
        self.max_positions = max_positions
        inv_freq, self.scale = rope_parameters(dim, theta, scaling, max_positions)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.register_buffer("cos", torch.empty(0, dim // 2, dtype=torch.float32), persistent=False)
        self.register_buffer("sin", torch.empty(0, dim // 2, dtype=torch.float32), persistent=False)
        self._grow(min(self.CHUNK, max_positions))

    def _grow(self, n: int) -> None:
        """Tables for at least n positions (whole chunks, at most max_positions)."""
        have, dev = self.cos.shape[0], self.inv_freq.device
        cos, sin = [self.cos], [self.sin]
        while have < n:
            pos = torch.arange(have, min(have + self.CHUNK, self.max_positions), dtype=torch.float32, device=dev)
            freqs = torch.outer(pos, self.inv_freq)  # [chunk, D/2]
            c, s = freqs.cos(), freqs.sin()
            if self.scale != 1.0:  # (as transformers scales them: after cos/sin, in float32)
                c, s = c * self.scale, s * self.scale
            cos.append(c)
            sin.append(s)
            have += pos.numel()
        if len(cos) > 1:
            self.cos, self.sin = torch.cat(cos), torch.cat(sin)

    def _apply(self, fn, recurse: bool = True):
        out = super()._apply(fn, recurse)
        if self.cos.device.type != "cpu":  # elsewhere whole up front: a lookup must not wait on the device
            self._grow(self.max_positions)
        return out

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin per token, [T, 1, D/2]: gathered once per forward, shared by every layer."""
        if positions.numel() and positions.device.type == "cpu":
            need = int(positions.max()) + 1
            if need > self.cos.shape[0]:
                if need > self.max_positions:
                    raise IndexError(f"position {need - 1} is past the model's {self.max_positions} positions")
                self._grow(need)
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)

    @staticmethod
    def apply(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        # q: [T, H, D], k: [T, Hkv, D]; cos/sin [T, 1, R/2] (or [T, R/2]), R <= D the rotated dims
        if cos.dim() == 2:
            cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    r = 2 * cos.shape[-1]
    if r < x.shape[-1]:  # partial rotary: the rest of each head passes unrotated
        return torch.cat((_rotate(x[..., :r], cos, sin), x[..., r:]), dim=-1)
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)
