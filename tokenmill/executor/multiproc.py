"""The multi-process executor for tensor and pipeline parallelism (``--tensor-parallel-size T``,
``--pipeline-parallel-size P``, ``--distributed-executor-backend mp``, the default; distributed/pipeline.py
says what a stage does with a forward pass).

The driver (rank 0, the engine core) starts T - 1 worker processes (multiprocessing spawn; the EngineConfig
msgspec-encoded, as engine/core_process.py sends it). Each runs a Worker (worker/worker.py): it loads its
shard, allocates its KV shard with the block count the driver broadcasts, then runs the driver's forward
passes until Stop. What a worker receives each step is the forward-pass part of the step's SchedulerOutput
(distributed/messages.py): each scheduled chunk's token ids, start position and block table, in the runner's
order (decodes first), and the rows that need logits (the output head is vocab-parallel, so every rank
computes its slice of those rows). Sampling state (parameters, grammars, drafts) stays on the driver, the
only rank that samples.

Failure: a worker that dies makes the driver's next collective fail (gloo raises when a peer's socket
closes) or time out (the compute group's timeout, group.py); the driver then stops every worker and
the step raises, which the engine core's failure path reports. Workers watch their parent and exit
once it is gone, so no rank outlives the engine.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import threading
import time
import traceback
import weakref
from typing import TYPE_CHECKING, TypeVar

import msgspec
import torch

from tokenmill.config import EngineConfig
from tokenmill.distributed.group import connect_store, create_store
from tokenmill.distributed.messages import (Forward, encoder, new_group, post_message, rank_device, send_stop,
                                            worker_threads)
from tokenmill.platform import resolve_device
from tokenmill.worker.worker import run_rank

if TYPE_CHECKING:
    from collections.abc import Callable

    from tokenmill.core.sched_output import ForwardRow
    from tokenmill.distributed.group import TPGroup
    from tokenmill.distributed.pipeline import PendingLogits
    from tokenmill.executor.base import LocalForward

logger = logging.getLogger("tokenmill")
T = TypeVar("T")
WATCHDOG_S = 0.2
JOIN_TIMEOUT_S = 120.0  # how long the driver waits for the workers to reach the rendezvous


class MultiprocExecutor:
    """The driver's side: starts the workers, sends each forward pass, stops them."""

    group: TPGroup

    def __init__(self, config: EngineConfig, device: torch.device) -> None:
        self.size = config.parallel.world_size
        self.device = device
        self.failed: str | None = None
        self._closed = False
        self._message_sends: list = []  # pipeline: messages to busy stages, kept until they are taken
        self.store = create_store(self.size)
        ctx = multiprocessing.get_context("spawn")  # the engine may hold threads a fork would copy broken
        payload = msgspec.msgpack.encode(config)
        self.workers = [ctx.Process(target=run_worker, name=f"tokenmill-tp-rank{r}", daemon=True,
                                    args=(payload, r, self.store.port, os.getpid(),
                                          logging.getLogger("tokenmill").level))
                        for r in range(1, self.size)]
        for w in self.workers:
            w.start()
        # an engine dropped without shutdown() still takes its workers with it
        weakref.finalize(self, _terminate, self.workers)
        try:
            self._wait_joined()
            self.group = new_group(config, self.store, 0, device)
        except BaseException:
            self.shutdown()
            raise

    @classmethod
    def start(cls, config: EngineConfig, device: torch.device) -> MultiprocExecutor:
        executor = cls(config, rank_device(device, 0))
        what = "pipeline" if config.parallel.pipeline_parallel_size > 1 else "tensor"
        logger.info("%s parallelism: %d ranks (%s), workers %s", what, executor.size,
                    "nccl" if executor.device.type == "cuda" else "gloo", executor.worker_pids)
        return executor

    def _wait_joined(self) -> None:
        """Until every worker has connected to the store; a worker that dies first fails the start."""
        deadline = time.monotonic() + JOIN_TIMEOUT_S
        keys = [f"joined/{r}" for r in range(1, self.size)]
        while not self.store.check(keys):
            self._raise_if_dead("starting")
            if time.monotonic() > deadline:
                raise RuntimeError(f"tensor-parallel workers did not connect within {JOIN_TIMEOUT_S:.0f} s")
            time.sleep(0.05)

    def _dead(self) -> list[str]:
        return [f"rank {r} (pid {w.pid}) exited with code {w.exitcode}"
                for r, w in enumerate(self.workers, start=1) if not w.is_alive()]

    def _raise_if_dead(self, when: str) -> None:
        dead = self._dead()
        if dead:
            raise RuntimeError(f"tensor-parallel worker {', '.join(dead)} while {when} (its log says why)")

    def start_workers(self, num_blocks: int) -> None:
        """Tell the workers (loading their shards meanwhile) how many KV blocks to allocate, and wait
        until every one has its KV shard: a worker that failed to load fails the start, not a later step."""
        self._call(lambda: (self.group.broadcast_bytes(str(num_blocks).encode()),
                            self.group.all_reduce_(torch.zeros(1, device=self.device))))
        self.group.reset_counters()

    def run_forward(self, order: list[ForwardRow], logits_rows: list[int], local_forward: LocalForward):
        """Send one forward pass to the workers, run the driver's share: the logits, or under pipeline
        parallelism the pass in flight (distributed/pipeline.py's PendingLogits; ``wait`` for it)."""
        msg = Forward([(list(s.token_ids), s.start_pos, list(s.block_table)) for s in order], logits_rows)

        def run() -> object:
            self._message_sends = [(w, b) for w, b in self._message_sends if not w.is_completed()]
            self._message_sends += post_message(self.group, encoder.encode(msg))
            return local_forward(order, logits_rows)

        return self._call(run)

    def wait(self, pending: PendingLogits) -> torch.Tensor:
        """A pipelined forward pass's logits, once the last stage has sent them."""
        return self._call(pending.wait)

    def _call(self, fn: Callable[[], T]) -> T:
        if self.failed:
            raise RuntimeError(self.failed)
        try:
            return fn()
        except RuntimeError as e:  # a collective failed: a rank died or hung
            time.sleep(0.2)  # (a killed worker's exit code shows a moment after its sockets close)
            dead = self._dead()
            who = f"worker {', '.join(dead)}" if dead else "a worker stopped answering"
            self.failed = (f"tensor parallelism failed: {who}; the engine cannot run the model any more and "
                           f"must be restarted ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else e!r})")
            logger.error("%s", self.failed)
            self.shutdown(timeout=0)
            raise RuntimeError(self.failed) from e

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the workers: Stop to each, join them, terminate (then kill) stragglers. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        if not self.failed and hasattr(self, "group") and not self._dead():
            send_stop(self.group)
        deadline = time.monotonic() + timeout
        for w in self.workers:
            w.join(max(0.0, deadline - time.monotonic()))
        for w in self.workers:
            if w.is_alive():
                w.terminate()
                w.join(2)
            if w.is_alive():
                w.kill()
                w.join(2)

    @property
    def worker_pids(self) -> list[int]:
        return [w.pid for w in self.workers]


def _terminate(workers: list) -> None:
    for w in workers:
        if w.is_alive():
            w.kill()
            w.join(2)


# ---- the worker processes ------------------------------------------------------------


def _watch_parent(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(WATCHDOG_S)
    os._exit(0)


def run_worker(config_bytes: bytes, rank: int, port: int, parent_pid: int, log_level: int) -> None:
    """A tensor-parallel worker's main: join, load this rank's shard, run forward passes until Stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the driver stops us (or our watchdog does)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    threading.Thread(target=_watch_parent, args=(parent_pid,), name="parent-watchdog", daemon=True).start()
    logging.basicConfig(format=f"%(asctime)s %(levelname)s [tp rank {rank}] %(name)s: %(message)s")
    logging.getLogger("tokenmill").setLevel(log_level or logging.WARNING)
    try:
        config = msgspec.msgpack.decode(config_bytes, type=EngineConfig)
        size = config.parallel.world_size
        torch.set_num_threads(worker_threads(size))
        device = rank_device(resolve_device(config.device), rank)
        store = connect_store(port, size)
        store.set(f"joined/{rank}", "1")
        run_rank(config, new_group(config, store, rank, device))
    except BaseException as e:  # noqa: BLE001 - say why, then exit: the driver's collectives fail
        logging.getLogger("tokenmill").error("tensor-parallel worker rank %d died: %r\n%s", rank, e,
                                             traceback.format_exc())
        os._exit(1)
    os._exit(0)
