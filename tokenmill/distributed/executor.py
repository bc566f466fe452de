"""The multi-process executor for tensor and pipeline parallelism (``--tensor-parallel-size T``,
``--pipeline-parallel-size P``: the same ranks and messages; distributed/pipeline.py says what a stage
does with a forward pass).

The engine core is rank 0, the driver: scheduler, KV-cache bookkeeping, its own shard of the model and
sampling. It starts T - 1 worker processes (multiprocessing spawn; the EngineConfig msgspec-encoded, as
engine/core_process.py sends it). Each worker loads its shard, allocates its KV shard with the block
count the driver broadcasts, then loops: receive a forward pass, run it, repeat, until Stop.

What a worker receives each step is the forward-pass part of the step's SchedulerOutput, as plain data
in msgpack (never pickle) broadcast in a uint8 tensor: each scheduled chunk's token ids, start position
and block table, in the runner's order (decodes first), and the rows that need logits (the output head
is vocab-parallel, so every rank computes its slice of those rows). Sampling state (parameters,
grammars, drafts) stays on the driver, the only rank that samples.

Failure: a worker that dies makes the driver's next collective fail (gloo raises when a peer's socket
closes) or time out (the compute group's timeout, group.py); the driver then stops every worker and
the step raises, which the engine core's failure path reports. Workers watch their parent and exit
once it is gone, so no rank outlives the engine.

``--distributed-executor-backend external_launcher``: the ranks are processes ``torchrun`` started, on
one machine or several (env:// rendezvous: MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE; the groups are
built on torchrun's own store). Every rank runs the same command; rank 0 is the driver and runs it, the
others serve its forward passes from inside the engine's construction and exit (status 0) when rank 0's
engine shuts down, or with an error when rank 0 dies (their next collective fails).
"""

from __future__ import annotations

import datetime
import logging
import multiprocessing
import os
import signal
import threading
import time
import traceback
import weakref

import msgspec
import torch
import torch.distributed as dist

from tokenmill.config import EngineConfig
from tokenmill.distributed.group import TPGroup, compute_timeout_s, connect_store, create_store

logger = logging.getLogger("tokenmill")
WATCHDOG_S = 0.2
JOIN_TIMEOUT_S = 120.0  # how long the driver waits for the workers to reach the rendezvous
STOP_WAIT_S = 10.0  # how long shutdown waits for busy pipeline stages to take Stop


class Forward(msgspec.Struct, tag="fwd", array_like=True):
    scheduled: list[tuple[list[int], int, list[int]]]  # (token ids, start position, block table)
    logits_rows: list[int]


class Stop(msgspec.Struct, tag="stop", array_like=True):
    pass


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Forward | Stop)


def new_group(config: EngineConfig, store, rank: int, device: torch.device) -> TPGroup:
    """This rank's group of all the ranks; under pipeline parallelism with T > 1, also its stage's
    tensor-parallel group (``.tensor``: ranks stage x T .. stage x T + T - 1, on their own store prefix)."""
    par = config.parallel
    t, p = par.tensor_parallel_size, par.pipeline_parallel_size
    group = TPGroup(store, rank, par.world_size, device, par.enable_expert_parallel, p > 1, par.all2all_backend)
    if p > 1:
        group.stage, group.num_stages = rank // t, p
        if t > 1:
            group.tensor = TPGroup(dist.PrefixStore(f"stage{group.stage}/", store), rank % t, t, device,
                                   par.enable_expert_parallel, False, par.all2all_backend)
    return group


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank r's device: cuda:r on GPUs (one per rank), the CPU otherwise."""
    return torch.device("cuda", rank) if device.type == "cuda" else device


def worker_threads(t: int) -> int:
    """Torch threads for each of the T processes: the cores shared out ($TOKENMILL_TP_THREADS overrides)."""
    forced = os.environ.get("TOKENMILL_TP_THREADS")
    return int(forced) if forced else max(1, (os.cpu_count() or 1) // t)


class TPExecutor:
    """The driver's side: starts the workers, sends each forward pass, stops them."""

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

    def run_forward(self, order, logits_rows: list[int], local_forward):
        """Send one forward pass to the workers, run the driver's share: the logits, or under pipeline
        parallelism the pass in flight (distributed/pipeline.py's PendingLogits; ``wait`` for it)."""
        msg = Forward([(list(s.token_ids), s.start_pos, list(s.block_table)) for s in order], logits_rows)

        def run():
            self._message_sends = [(w, b) for w, b in self._message_sends if not w.is_completed()]
            self._message_sends += post_message(self.group, _encoder.encode(msg))
            return local_forward(order, logits_rows)

        return self._call(run)

    def wait(self, pending) -> torch.Tensor:
        """A pipelined forward pass's logits, once the last stage has sent them."""
        return self._call(pending.wait)

    def _call(self, fn):
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
            _send_stop(self.group)
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


class ExternalLauncherExecutor(TPExecutor):
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
        self._stop = weakref.finalize(self, _send_stop, group)

    def _dead(self) -> list[str]:
        return []

    def shutdown(self, timeout: float = 10.0) -> None:
        if not self._closed:
            self._closed = True
            if self.failed:
                self._stop.detach()
            else:
                self._stop()


def _send_stop(group: TPGroup) -> None:
    try:
        deadline = time.monotonic() + STOP_WAIT_S
        for work, _ in post_message(group, _encoder.encode(Stop())):  # (stages finish their passes first)
            work.wait(datetime.timedelta(seconds=max(0.1, deadline - time.monotonic())))
    except RuntimeError:  # a rank is gone already
        pass


def post_message(group: TPGroup, data: bytes) -> list:
    """The driver's message to every worker: a broadcast where the ranks take every step together
    (tensor parallelism), point to point where they may still be busy with earlier steps (pipeline
    stages; returns the sends in flight, to keep until they complete)."""
    if not group.pipeline:
        group.broadcast_bytes(data)
        return []
    group.message_seq += 1
    return group.send_message(data, list(range(1, group.size)), group.message_seq)


def receive_message(group: TPGroup) -> bytes:
    """A worker's next message from the driver (post_message's other side)."""
    if not group.pipeline:
        return group.broadcast_bytes(None)
    group.message_seq += 1
    return group.recv_message(group.message_seq)


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


def run_torchrun_worker(config: EngineConfig, device: torch.device) -> None:
    """A torchrun rank other than 0: serve the driver's forward passes until it stops, then return."""
    group = torchrun_group(config, device)
    logger.info("torchrun rank %d of %d: serving forward passes for rank 0", group.rank, group.size)
    _serve(config, group)


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
        _worker(msgspec.msgpack.decode(config_bytes, type=EngineConfig), rank, port)
    except BaseException as e:  # noqa: BLE001 - say why, then exit: the driver's collectives fail
        logging.getLogger("tokenmill").error("tensor-parallel worker rank %d died: %r\n%s", rank, e,
                                             traceback.format_exc())
        os._exit(1)
    os._exit(0)


def _worker(config: EngineConfig, rank: int, port: int) -> None:
    from tokenmill.platform import resolve_device

    size = config.parallel.world_size
    torch.set_num_threads(worker_threads(size))
    device = rank_device(resolve_device(config.device), rank)
    store = connect_store(port, size)
    store.set(f"joined/{rank}", "1")
    _serve(config, new_group(config, store, rank, device))


@torch.inference_mode()
def _serve(config: EngineConfig, group: TPGroup) -> None:
    """Load this rank's shard, allocate its KV shard, run the driver's forward passes until Stop."""
    from tokenmill.core.sched_output import ScheduledRequest
    from tokenmill.layers.kernels import apply_activation_precision, cpu_kernels
    from tokenmill.models.loader import load_model
    from tokenmill.models.registry import resolve_model
    from tokenmill.platform import resolve_dtype
    from tokenmill.worker.model_runner import ModelRunner, allocate_kv_cache

    torch.manual_seed(config.seed)
    device = group.device
    dtype = resolve_dtype(config.dtype, device, cpu_kernels=device.type == "cpu" and cpu_kernels() is not None)
    apply_activation_precision(config.activation_precision, device)  # as the driver did (engine/builder.py)
    loaded = load_model(resolve_model(config.model), dtype, device, config.max_model_len,
                        quantization=config.quantization, tp=group)
    num_blocks = int(group.broadcast_bytes(None))
    cache = config.cache
    kv = allocate_kv_cache(loaded.model.cfg, num_blocks, cache.block_size, dtype, device, cache.kv_cache_dtype,
                           zeroed=loaded.model.ops is None)
    runner = ModelRunner(loaded.model, kv, cache.block_size, device, config.seed)
    if group.pipeline:
        runner.pipeline = (group, config.parallel.micro_batches)
    group.all_reduce_(torch.zeros(1, device=device))  # ready (the driver waits for every rank)
    while True:
        msg = _decoder.decode(receive_message(group))
        if isinstance(msg, Stop):
            return
        order = [ScheduledRequest("", ids, start, table, False) for ids, start, table in msg.scheduled]
        runner._local_forward(order, msg.logits_rows)
