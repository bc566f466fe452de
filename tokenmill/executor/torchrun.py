"""``--distributed-executor-backend external_launcher``: the ranks are processes ``torchrun`` started, on one
machine or several (env:// rendezvous: MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE; the groups are built on
torchrun's own store). Every rank runs the same command; rank 0 is the driver and runs it, the others serve
its forward passes from inside the engine's construction (``start``) and exit (status 0) when rank 0's engine
shuts down, or with an error when rank 0 dies (their next collective fails)."""

from __future__ import annotations

import datetime
import logging
import os
import weakref
from typing import TYPE_CHECKING

import torch.distributed as dist

from tokenmill.distributed.group import TPGroup, compute_timeout_s
from tokenmill.distributed.messages import new_group, rank_device, send_stop
from tokenmill.executor.multiproc import MultiprocExecutor
from tokenmill.worker.worker import run_rank

if TYPE_CHECKING:
    import torch

    from tokenmill.config import EngineConfig

logger = logging.getLogger("tokenmill")


class ExternalLauncherExecutor(MultiprocExecutor):
    """The driver's side under torchrun: the workers are other torchrun ranks (maybe other machines), so
    there is nothing to start, join or watch here; a rank that dies shows as a failed collective."""

    def __init__(self, config: EngineConfig, device: torch.device, group: TPGroup) -> None:
        self.size, self.device, self.group = group.size, device, group
        self.failed: str | None = None
        self._closed = False
        self._message_sends: list = []
        self.workers = []
        # The other ranks wait for Stop (and torchrun's agents for every rank before they exit): sent by
        # shutdown(), or when the engine is dropped or the interpreter exits without it.
        self._stop = weakref.finalize(self, send_stop, group)

    @classmethod
    def start(cls, config: EngineConfig, device: torch.device) -> ExternalLauncherExecutor:
        """Rank 0's executor; on any other rank, serve rank 0's forward passes, then leave (SystemExit 0)."""
        rank, local_rank = torchrun_rank(config)
        device = rank_device(device, local_rank)
        group = torchrun_group(config, device)
        if rank != 0:
            logger.info("torchrun rank %d of %d: serving forward passes for rank 0", group.rank, group.size)
            run_rank(config, group)
            logger.info("torchrun rank %d: rank 0's engine shut down; exiting", rank)
            raise SystemExit(0)
        what = "pipeline" if config.parallel.pipeline_parallel_size > 1 else "tensor"
        logger.info("%s parallelism: %d torchrun ranks (%s)", what, group.size,
                    "nccl" if device.type == "cuda" else "gloo")
        return cls(config, device, group)

    def _dead(self) -> list[str]:
        return []

    def shutdown(self, timeout: float = 10.0) -> None:
        if not self._closed:
            self._closed = True
            if self.failed:
                self._stop.detach()
            else:
                self._stop()


def torchrun_rank(config: EngineConfig) -> tuple[int, int]:
    """(RANK, LOCAL_RANK) torchrun gave this process, checked against --tensor-parallel-size."""
    env = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    missing = [k for k, v in env.items() if v is None]
    if missing:
        raise ValueError(f"--distributed-executor-backend external_launcher: {', '.join(missing)} not set; start "
                         "every rank with torchrun (e.g. torchrun --nproc-per-node T -m tokenmill.cli serve ...), "
                         "or use the default backend mp, which starts the ranks itself")
    size = config.parallel.world_size
    if int(env["WORLD_SIZE"]) != size:
        raise ValueError(f"torchrun started {env['WORLD_SIZE']} ranks (WORLD_SIZE) but --tensor-parallel-size x "
                         f"--pipeline-parallel-size is {size}: they must be equal")
    return int(env["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))


def torchrun_group(config: EngineConfig, device: torch.device) -> TPGroup:
    """This torchrun rank's TPGroup, on torchrun's store (env:// rendezvous)."""
    rank, _ = torchrun_rank(config)
    store, r, size = next(dist.rendezvous("env://", timeout=datetime.timedelta(seconds=compute_timeout_s())))
    if r != rank:
        raise RuntimeError(f"torchrun rendezvous gave rank {r}, but RANK is {rank}")
    return new_group(config, dist.PrefixStore("tokenmill/", store), rank, device)
