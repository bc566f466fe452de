"""Test helpers that reach into the engine on purpose."""

from __future__ import annotations

import pytest
import torch

from tokenmill.core.scheduler import ScheduledRequest
from tokenmill.layers.kernels import cpu_kernels, kernels_expected, unavailable_reason

# Kernel tests skip only where the kernels cannot exist (not x86 with AVX2, or no compiler); where they
# should, a failed build runs the tests and fails them.
needs_kernels = pytest.mark.skipif(cpu_kernels() is None and not kernels_expected(),
                                   reason=f"CPU kernels unavailable: {unavailable_reason()}")


@torch.inference_mode()
def prefill_logits(engine, token_ids: list[int]) -> torch.Tensor:
    """Logits [T, V] at every position, computed through the engine's paged KV cache with the inputs a
    scheduled step gets (one prefill chunk)."""
    kv = engine.kv_cache
    table = kv.allocate_slots("__probe__", len(token_ids))
    assert table is not None
    try:
        ids, pos, meta = engine.runner._inputs([ScheduledRequest("__probe__", list(token_ids), 0, table, True)])
        return engine.runner.model(ids, pos, engine.runner.kv_caches, meta, pos)
    finally:
        kv.free("__probe__")
