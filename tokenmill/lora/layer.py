"""A projection with adapters: the base projection once for the whole batch (its quantized blocks, its own
arithmetic), then each adapter's low-rank delta on its own rows, added to them.

Each adapter in the working set sits in a slot (manager.py) holding, per projection, the A matrices of the parts
it adapts stacked ([parts x rank, fan_in]) and each part's B ([part out, rank]), the rank padded with zeros to a
multiple of 8. A step runs, per adapter and over that adapter's rows, one shrink x A^T for all its parts and one
expand per part (x A_p^T) B_p^T, added to the part's columns. On the CPU kernels both are ``flinear``
(layers/panel_linear.py): eight FMA chains over k mod 8 and one fixed tree, the same for any number of rows, and
the padding adds exact zeros. So a row's delta depends on its own activations and
its adapter alone: the same bits alone, batched with any adapters, in any slot, and batch invariance holds with
adapters as without. (Off the kernels: torch's GEMMs, which promise no such thing.)"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.layers.panel_linear import to_panels

if TYPE_CHECKING:
    import numpy as np

RANK_ALIGN = 8  # flinear's FMA chains: a rank padded to a multiple of 8 keeps each part's terms on the same chains


class LoRAStep:
    """One step's adapters, shared by every wrapped projection: per adapter the step runs, (its slot, its rows as
    runs [start, end) of the batch, and their index where there are several runs); empty when it runs none."""

    def __init__(self) -> None:
        self.groups: list[tuple[int, list[tuple[int, int]], torch.Tensor | None]] = []


class LoRALinear(nn.Module):
    """``base`` (any projection: QuantizedLinear, StackedLinear, PanelLinear, nn.Linear) plus the deltas of the
    adapters in its slots, on its output's parts (q/k/v of a fused qkv_proj: ``part_outs`` their widths)."""

    def __init__(self, base: nn.Module, fan_in: int, part_outs: tuple[int, ...], step: LoRAStep, ops,
                 num_slots: int) -> None:
        super().__init__()
        self.base = base
        self.fan_in, self.part_outs = fan_in, part_outs
        self.offsets = [sum(part_outs[:i]) for i in range(len(part_outs) + 1)]
        self.step, self.ops = step, ops
        # slot -> (A [k, fan_in], k, [(A's rows of the part, its output columns and width, B [width, rank])...]) as
        # flinear reads them (panels); None: the adapter there does not adapt this projection
        self.slots: list[tuple[torch.Tensor, int, list[tuple[slice | None, slice | None, int, torch.Tensor]]] | None] \
            = [None] * num_slots

    @property
    def bias(self) -> torch.Tensor | None:
        return getattr(self.base, "bias", None)  # (the base adds it; the model's fused-kernel checks read it)

    def write(self, slot: int, parts: list[tuple[int, np.ndarray, np.ndarray]] | None, device: torch.device) -> None:
        """Put an adapter's (part, A [r, fan_in], B [part out, r]) pairs in ``slot``; None or [] empties it."""
        if not parts:
            self.slots[slot] = None
            return
        r = -(-max(a.shape[0] for _, a, _ in parts) // RANK_ALIGN) * RANK_ALIGN
        k = r * len(parts)
        a_all = torch.zeros(k, self.fan_in, dtype=torch.float32)
        expands = []
        for i, (p, a, b) in enumerate(sorted(parts, key=lambda t: t[0])):
            a_all[i * r: i * r + a.shape[0]] = torch.from_numpy(a)
            b_p = torch.zeros(self.part_outs[p], r, dtype=torch.float32)
            b_p[:, : b.shape[1]] = torch.from_numpy(b)
            cols = None if len(parts) == 1 else slice(i * r, (i + 1) * r)  # None: all of x A^T
            out = None if len(self.part_outs) == 1 else slice(self.offsets[p], self.offsets[p + 1])  # None: all of y
            expands.append((cols, out, self.part_outs[p], (to_panels(b_p) if self.ops is not None else b_p).to(device)))
        self.slots[slot] = ((to_panels(a_all) if self.ops is not None else a_all).to(device), k, expands)

    def _mm(self, x: torch.Tensor, w: torch.Tensor, n: int) -> torch.Tensor:
        if self.ops is not None:  # (the manager gives the kernels only to a model on the CPU)
            return self.ops.flinear(x if x.dtype == torch.float32 else x.float(), w, n, None)
        return F.linear(x.float(), w)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        mm = self._mm
        for slot, runs, index in self.step.groups:
            held = self.slots[slot]
            if held is None:
                continue
            a, k, expands = held
            xa = mm(x[runs[0][0]: runs[0][1]] if index is None else x.index_select(0, index), a, k)
            for cols, out, width, b in expands:
                d = mm(xa if cols is None else xa[:, cols], b, width)
                if d.dtype != y.dtype:
                    d = d.to(y.dtype)
                at = 0
                for start, end in runs:  # (slices: a scatter into the columns of a part costs more than the GEMMs)
                    rows = y[start:end] if out is None else y[start:end, out]
                    rows.add_(d if index is None else d[at: at + end - start])
                    at += end - start
        return y

    def extra_repr(self) -> str:
        return f"parts={self.part_outs}, slots held={sum(s is not None for s in self.slots)}/{len(self.slots)}"
