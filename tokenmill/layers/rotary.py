"""Rotary position embedding (RoPE), rotate-half layout as in Hugging Face Llama/Qwen2."""

from __future__ import annotations

import math

import torch


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2], with the config's scaling applied."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if not scaling:
        return inv_freq.float()
    kind = scaling.get("rope_type", scaling.get("type", "default"))
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
        inv_freq = inv_freq / scaling["factors"].double()
    else:
        raise ValueError(f"rope_scaling type {kind!r} is not supported (supported: default, linear, llama3)")
    return inv_freq.float()


class RotaryEmbedding(torch.nn.Module):
    """cos/sin tables per position, grown on the CPU a chunk of positions at a time as positions are asked
    for: a 128k-token context's full tables (32-64 MB) are not held for the few thousand positions a
    server reaches. A chunk's values are computed alone, so they are the same bits whenever it is made."""

    CHUNK = 4096

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None) -> None:
        super().__init__()
        self.max_positions = max_positions
        self.register_buffer("inv_freq", rope_inv_freq(head_dim, theta, scaling), persistent=False)
        self.register_buffer("cos", torch.empty(0, head_dim // 2, dtype=torch.float32), persistent=False)
        self.register_buffer("sin", torch.empty(0, head_dim // 2, dtype=torch.float32), persistent=False)
        self._grow(min(self.CHUNK, max_positions))

    def _grow(self, n: int) -> None:
        """Tables for at least n positions (whole chunks, at most max_positions)."""
        have, dev = self.cos.shape[0], self.inv_freq.device
        cos, sin = [self.cos], [self.sin]
        while have < n:
            pos = torch.arange(have, min(have + self.CHUNK, self.max_positions), dtype=torch.float32, device=dev)
            freqs = torch.outer(pos, self.inv_freq)  # [chunk, D/2]
            cos.append(freqs.cos())
            sin.append(freqs.sin())
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
        # q: [T, H, D], k: [T, Hkv, D]
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)
