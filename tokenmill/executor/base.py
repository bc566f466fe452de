"""The executor interface, and the one-process executor."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from tokenmill.worker.model_runner import Forwarder

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch

    from tokenmill.config import EngineConfig
    from tokenmill.core.sched_output import ForwardRow
    from tokenmill.distributed.group import TPGroup
    from tokenmill.distributed.pipeline import PendingLogits

    LocalForward = Callable[[list[ForwardRow], list[int]], object]


class Executor(Forwarder, Protocol):
    """What the builder and the engine core use of an executor; the runner uses only its Forwarder part."""

    device: torch.device  # this rank's (the driver's)
    group: TPGroup | None  # every rank's group; None in one process
    workers: list  # the processes this executor started (multiproc.py), to watch and stop
    failed: str | None  # why the ranks can no longer run a pass (the engine must be restarted)

    def start_workers(self, num_blocks: int) -> None:
        """Tell the other ranks how many KV blocks to allocate; return once every one is ready."""

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the other ranks. Safe to call twice."""


class UniprocExecutor:
    """One rank, in this process: the pass runs in place and there is nothing to start or stop."""

    group = None
    failed = None

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.workers: list = []

    @classmethod
    def start(cls, config: EngineConfig, device: torch.device) -> UniprocExecutor:
        return cls(device)

    def start_workers(self, num_blocks: int) -> None:
        pass

    def run_forward(self, order: list[ForwardRow], logits_rows: list[int], local_forward: LocalForward):
        return local_forward(order, logits_rows)

    def wait(self, pending: PendingLogits) -> torch.Tensor:
        raise RuntimeError("one rank runs no pass in flight (pipeline parallelism does)")

    def shutdown(self, timeout: float = 10.0) -> None:
        pass
