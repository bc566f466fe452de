"""Executors: how the driver's forward passes reach every rank. The engine core is rank 0, the driver
(scheduler, KV bookkeeping, sampling, and its own Worker); an executor runs each pass there and on the other
ranks, whatever started them:

- ``uni`` (base.py): one process, one rank; the pass runs in place.
- ``mp`` (multiproc.py): tensor/pipeline parallelism on this machine; the executor spawns the other ranks.
- ``external_launcher`` (torchrun.py): the ranks are processes ``torchrun`` started, here or on other machines.

``start_executor`` picks one from the registry below (``--distributed-executor-backend``, ``uni`` for one rank).
A new backend (ray, say) is a class with ``start(config, device)`` and the Executor protocol's methods, added
to EXECUTORS."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tokenmill.executor.base import Executor, UniprocExecutor
from tokenmill.executor.multiproc import MultiprocExecutor
from tokenmill.executor.torchrun import ExternalLauncherExecutor

if TYPE_CHECKING:
    import torch

    from tokenmill.config import EngineConfig

EXECUTORS: dict[str, type] = {"uni": UniprocExecutor, "mp": MultiprocExecutor,
                              "external_launcher": ExternalLauncherExecutor}


def executor_backend(config: EngineConfig) -> str:
    """The backend that runs ``config``: ``uni`` for one rank, else --distributed-executor-backend."""
    return "uni" if config.parallel.world_size == 1 else config.parallel.distributed_executor_backend


def start_executor(config: EngineConfig, device: torch.device) -> Executor:
    """Start the ranks ``config`` asks for; the executor's ``device`` is this rank's (cuda:r on GPUs)."""
    return EXECUTORS[executor_backend(config)].start(config, device)


__all__ = ["EXECUTORS", "Executor", "executor_backend", "start_executor"]
