"""Float32 linear layers with one summation order for every batch size (``--quantization none`` on the CPU).

torch's float GEMM chooses its blocking by the number of rows, so a token's output changes with what
else is in the batch. ``torch.ops.tokenmill.flinear`` (``csrc/cpu_kernels.cpp``) always sums a dot
product as eight FMA chains over k mod 8 and one fixed tree, on AVX2 and AVX512 alike, reading the
weight as panels of 16 output columns ([ceil(N / 16), K, 16]) so the chains of a panel's columns
advance together. Where the kernels cannot run, ``PanelLinear`` is not used (the model keeps
``torch.nn.Linear``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

PANEL = 16


def to_panels(w: torch.Tensor) -> torch.Tensor:
    """[N, K] -> [ceil(N / 16), K, 16] float32, columns past N zero."""
    n, k = w.shape
    p = -(-n // PANEL)
    padded = torch.zeros(p * PANEL, k, dtype=torch.float32)
    padded[:n] = w.float()
    return padded.view(p, PANEL, k).transpose(1, 2).contiguous()


def from_panels(panels: torch.Tensor, n: int) -> torch.Tensor:
    return panels.transpose(1, 2).reshape(-1, panels.shape[1])[:n]


class PanelLinear(torch.nn.Module):
    """y = x W^T + b in float32 through ``flinear``: a row's result is the same bits for any batch."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, ops) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.register_buffer("panels", to_panels(weight.detach()))
        self.register_buffer("bias", None if bias is None else bias.detach().float().contiguous())
        self.ops = ops

    @property
    def weight(self) -> torch.Tensor:
        return from_panels(self.panels, self.out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.ops is None or x.dtype != torch.float32 or x.device.type != "cpu":
            return F.linear(x, self.weight.to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))
        return self.ops.flinear(x, self.panels, self.out_features, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, panels of {PANEL}"
