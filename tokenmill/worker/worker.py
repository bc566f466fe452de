"""One rank's share of the model: its device, its weights (this rank's shard under tensor or pipeline
parallelism), its KV cache and the runner over them. The driver (rank 0, engine/builder.py) and every other
rank (executor/) start the same Worker; only the driver's runner samples, the others serve its forward
passes (``serve``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from tokenmill.distributed.messages import Stop, receive_message
from tokenmill.core.sched_output import ForwardRow
from tokenmill.layers.kernels import apply_activation_precision, cpu_kernels
from tokenmill.models.loader import load_model
from tokenmill.models.registry import resolve_model
from tokenmill.platform import resolve_dtype
from tokenmill.worker.model_runner import Forwarder, ModelRunner, allocate_kv_cache

if TYPE_CHECKING:
    from collections.abc import Callable

    from tokenmill.config import EngineConfig
    from tokenmill.distributed.group import TPGroup
    from tokenmill.models.loader import LoadedModel
    from tokenmill.models.registry import ModelSource


def worker_dtype(config: EngineConfig, device: torch.device) -> torch.dtype:
    """The activations' dtype: on the CPU kernels every mode takes float32 activations and is batch invariant
    (integer GEMMs on quantized blocks, fixed-order float GEMMs on float weights): --dtype auto picks float32."""
    return resolve_dtype(config.dtype, device, cpu_kernels=device.type == "cpu" and cpu_kernels() is not None)


class Worker:
    """Loads this rank's weights at construction; ``init_kv_cache`` then allocates its KV blocks and makes the
    runner over them."""

    def __init__(self, config: EngineConfig, source: ModelSource, device: torch.device, dtype: torch.dtype,
                 group: TPGroup | None = None, phase: Callable[[str], None] | None = None) -> None:
        self.config, self.device, self.dtype, self.group = config, device, dtype, group
        # the kernels' activation precision, the same on every rank (int8 off the CPU is refused here)
        self.activation_precision = apply_activation_precision(config.activation_precision, device)
        self.loaded: LoadedModel = load_model(source, dtype, device, config.max_model_len,
                                              attention_backend=config.attention_backend,
                                              quantization=config.quantization, phase=phase or (lambda name: None),
                                              tp=group)
        self.runner: ModelRunner | None = None

    def init_kv_cache(self, num_blocks: int, executor: Forwarder | None = None) -> ModelRunner:
        """Allocate ``num_blocks`` KV blocks for this rank's layers and heads and make the runner over them.
        Where every token's attention reads only the slots its context has written (the CPU kernels'
        paged_attention), the pool need not be cleared: its pages are touched as blocks fill."""
        cache, model = self.config.cache, self.loaded.model
        kv = allocate_kv_cache(model.cfg, num_blocks, cache.block_size, self.dtype, self.device,
                               cache.kv_cache_dtype, zeroed=not model.attention_backend.reads_only_written_slots)
        self.runner = ModelRunner(model, kv, cache.block_size, self.device, self.config.seed, executor)
        if self.group is not None and self.group.pipeline:
            self.runner.pipeline = (self.group, self.config.parallel.micro_batches)
        return self.runner

    @torch.inference_mode()
    def serve(self) -> None:
        """A rank other than the driver: run the driver's forward passes on this rank's shard until Stop."""
        while not isinstance(msg := receive_message(self.group), Stop):
            order = [ForwardRow(ids, start, table) for ids, start, table in msg.scheduled]
            self.runner.local_forward(order, msg.logits_rows)


@torch.inference_mode()
def run_rank(config: EngineConfig, group: TPGroup) -> None:
    """A rank other than the driver, from start to Stop: load this rank's shard, allocate the KV shard with the
    block count the driver broadcasts, say ready (the driver waits for every rank), serve its forward passes."""
    torch.manual_seed(config.seed)
    worker = Worker(config, resolve_model(config.model), group.device, worker_dtype(config, group.device), group)
    worker.init_kv_cache(int(group.broadcast_bytes(None)))
    group.all_reduce_(torch.zeros(1, device=group.device))
    worker.serve()
