"""The parallel process group: rank, size, the two collectives tensor parallelism needs and the
point-to-point send/recv of pipeline stages.

Built straight on torch.distributed's process-group classes over a TCPStore on 127.0.0.1 (the driver
binds a free port; the workers connect to it), not on the global default group, so an engine can be
made, shut down and made again in one process. gloo on the CPU, NCCL on GPUs: the same calls.

Two groups share the store: ``compute`` for the forward pass's collectives, with a timeout
($TOKENMILL_TP_TIMEOUT_S, default 300 s, read when the group is made) after which a hung rank makes the step fail, and ``control``
for the driver's step messages, which a worker waits on for as long as the engine sits idle.
"""

from __future__ import annotations

import datetime
import os
import time

import torch
import torch.distributed as dist



def compute_timeout_s() -> float:
    """Seconds a collective of the forward pass may wait before the step fails ($TOKENMILL_TP_TIMEOUT_S)."""
    return float(os.environ.get("TOKENMILL_TP_TIMEOUT_S", "300"))

IDLE_TIMEOUT = datetime.timedelta(days=7)  # a worker waiting for the next step: as long as the server idles


def _new_group(store, rank: int, size: int, device: torch.device, timeout: datetime.timedelta):
    if device.type == "cuda":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, size, opts)
    return dist.ProcessGroupGloo(store, rank, size, timeout)


def create_store(size: int) -> dist.TCPStore:
    """The driver's rendezvous store on a free loopback port (``store.port`` tells the workers)."""
    return dist.TCPStore("127.0.0.1", 0, size, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=compute_timeout_s()))


def connect_store(port: int, size: int) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", port, size, is_master=False,
                         timeout=datetime.timedelta(seconds=compute_timeout_s()))


class TPGroup:
    """This rank's place in the tensor-parallel group, with byte counters for the communication test."""

    def __init__(self, store, rank: int, size: int, device: torch.device, expert_parallel: bool = False,
                 pipeline: bool = False, all2all_backend: str = "allreduce") -> None:
        self.rank, self.size, self.device = rank, size, device
        self.expert_parallel = expert_parallel  # a MoE layer's ranks hold whole experts (distributed/sharding.py)
        self.all2all_backend = all2all_backend  # how expert parallelism dispatches tokens (layers/moe.py)
        self.pipeline = pipeline  # the ranks are pipeline stages, not tensor-parallel shards (pipeline.py)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        self.compute = _new_group(dist.PrefixStore("compute/", store), rank, size, device,
                                  datetime.timedelta(seconds=compute_timeout_s()))
        self.control = _new_group(dist.PrefixStore("control/", store), rank, size, device, IDLE_TIMEOUT)
        # Pipeline stages: what goes back to rank 0 (logits, expert counts) on a group of its own, so that
        # each direction keeps its order on a communicator of its own (NCCL matches a pair's sends and
        # receives in the order they are posted, whatever their tags; rank 0 posts a step's receives
        # before it sends the step on)
        self.back = _new_group(dist.PrefixStore("back/", store), rank, size, device,
                               datetime.timedelta(seconds=compute_timeout_s())) if pipeline else None
        self.store = store  # (kept alive: the groups rendezvous through it)
        # pipeline parallelism (pipeline=True; set by executor.new_group): this rank's stage of how many, and
        # the group of its stage's tensor-parallel ranks (None with one rank a stage). Global rank =
        # stage x T + tensor-parallel rank.
        self.stage, self.num_stages, self.tensor = 0, 1, None
        # pipeline stages: the driver's messages and the forward passes, numbered alike on every rank (tags)
        self.message_seq = self.forward_seq = -1
        self.pending_sends: list = []  # a stage's sends of its last forward pass
        self.stage_expert_counts: dict[int, list[list[int]]] = {}  # rank 0: later stages' routed tokens
        self.reset_counters()

    def reset_counters(self) -> None:
        self.all_reduce_bytes = self.all_gather_bytes = self.send_bytes = 0
        self.all_reduce_calls = self.all_gather_calls = self.send_calls = 0
        self.all_to_all_bytes = self.all_to_all_calls = 0  # expert parallelism's dispatch and combine
        self.recv_wait_s = 0.0  # time blocked in recv: a pipeline stage's idle share (the bubble)

    def send(self, x: torch.Tensor, dst: int, tag: int, back: bool = False):
        """Start sending ``x`` to rank ``dst`` (point to point; ``back``: to rank 0, on the return group);
        the returned work's wait() completes it."""
        x = x.contiguous()
        self.send_bytes += x.numel() * x.element_size()
        self.send_calls += 1
        return (self.back if back else self.compute).send([x], dst, tag)

    def recv(self, buf: torch.Tensor, src: int, tag: int) -> torch.Tensor:
        """Receive rank ``src``'s tensor into ``buf`` (its shape and dtype known to both sides)."""
        t = time.perf_counter()
        self.compute.recv([buf], src, tag).wait()
        self.recv_wait_s += time.perf_counter() - t
        return buf

    def irecv_back(self, buf: torch.Tensor, src: int, tag: int):
        """Rank 0: start receiving rank ``src``'s tensor sent ``back`` into ``buf``; wait() completes it."""
        return self.back.recv([buf], src, tag)

    def send_message(self, data: bytes, dsts: list[int], seq: int) -> list:
        """Start sending the driver's message ``data`` (msgpack) to ranks ``dsts`` on the control group: its
        length, then its bytes. ``seq`` numbers the driver's messages (tags, so several can be in flight);
        returns [(work, buffer)] to wait on before the buffers may go."""
        n = torch.tensor([len(data)], dtype=torch.int64, device=self.device)
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self.device)
        tag = 2 * (seq % 2**20)
        return [ws for dst in dsts for ws in ((self.control.send([n], dst, tag), n),
                                               (self.control.send([buf], dst, tag + 1), buf))]

    def recv_message(self, seq: int) -> bytes:
        """The driver's message number ``seq`` (send_message), waiting as long as the engine idles."""
        n = torch.empty(1, dtype=torch.int64, device=self.device)
        tag = 2 * (seq % 2**20)
        self.control.recv([n], 0, tag).wait()
        buf = torch.empty(int(n.item()), dtype=torch.uint8, device=self.device)
        self.control.recv([buf], 0, tag + 1).wait()
        return buf.cpu().numpy().tobytes()

    def all_reduce_(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place; returns it."""
        self.all_reduce_bytes += x.numel() * x.element_size()
        self.all_reduce_calls += 1
        self.compute.allreduce([x]).wait()
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's ``x`` concatenated along ``dim`` in rank order. Counts the bytes this rank sends."""
        x = x.contiguous()
        self.all_gather_bytes += x.numel() * x.element_size()
        self.all_gather_calls += 1
        parts = [torch.empty_like(x) for _ in range(self.size)]
        self.compute.allgather([parts], [x]).wait()
        return torch.cat(parts, dim=dim)

    def all_to_all(self, x: torch.Tensor, out_splits: list[int], in_splits: list[int]) -> torch.Tensor:
        """Rows of ``x`` to every rank: ``in_splits[d]`` consecutive rows (dim 0) to rank d, in rank order;
        returns the ``out_splits[s]`` rows each rank s sent here, in rank order. Zero-row splits (a rank
        with nothing for another, or nothing at all) are fine; every rank must call it. Counts the bytes
        this rank sends to the other ranks (its own split stays here)."""
        x = x.contiguous()
        row = x[0].numel() * x.element_size() if x.shape[0] else 0
        self.all_to_all_bytes += (sum(in_splits) - in_splits[self.rank]) * row
        self.all_to_all_calls += 1
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        self.compute.alltoall_base(out, x, list(out_splits), list(in_splits)).wait()
        return out

    def broadcast_bytes(self, data: bytes | None) -> bytes:
        """The driver's ``data`` on every rank (workers pass None): the length first, then the bytes, as
        uint8 tensors on the control group (messages are msgpack, never pickle)."""
        dev = self.device
        # The driver sends under the compute timeout (a hung worker fails the step); a worker waits for
        # as long as the engine idles (the control group's own timeout).
        wait = dict(timeout=datetime.timedelta(seconds=compute_timeout_s())) if self.rank == 0 else {}
        n = torch.tensor([len(data) if data is not None else 0], dtype=torch.int64, device=dev)
        self.control.broadcast(n, 0, **wait).wait()
        if self.rank == 0:
            buf = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(dev) if data else \
                torch.empty(0, dtype=torch.uint8, device=dev)
        else:
            buf = torch.empty(int(n.item()), dtype=torch.uint8, device=dev)
        if buf.numel():
            self.control.broadcast(buf, 0, **wait).wait()
        return buf.cpu().numpy().tobytes()
