"""Test helpers that reach into the engine on purpose."""

from __future__ import annotations

import pytest
import torch

from tokenmill.layers.attention import AttentionMetadata, PrefillChunk
from tokenmill.layers.kernels import cpu_kernels, kernels_expected, unavailable_reason

# Kernel tests skip only where the kernels cannot exist (not x86 with AVX2, or no compiler); where they
# should, a failed build runs the tests and fails them.
needs_kernels = pytest.mark.skipif(cpu_kernels() is None and not kernels_expected(),
                                   reason=f"CPU kernels unavailable: {unavailable_reason()}")


@torch.inference_mode()
def prefill_logits(engine, token_ids: list[int]) -> torch.Tensor:
    """Logits [T, V] at every position, computed through the engine's paged KV cache."""
    kv, bs = engine.kv_cache, engine.kv_cache.block_size
    table = kv.allocate_slots("__probe__", len(token_ids))
    assert table is not None
    try:
        pos = torch.arange(len(token_ids))
        t = torch.tensor(table)
        slots = t[pos // bs] * bs + pos % bs
        meta = AttentionMetadata(slots, 0, None, None, 0, [PrefillChunk(0, len(token_ids), 0, t)],
                                 block_tables=t[None], seq_of=torch.zeros_like(pos), ctx_lens=pos + 1)
        return engine.runner.model(torch.tensor(token_ids), pos, engine.runner.kv_caches, meta, pos)
    finally:
        kv.free("__probe__")
