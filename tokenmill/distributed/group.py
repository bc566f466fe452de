"""The parallel process group: rank, size, the two collectives tensor parallelism needs and the
point-to-point send/recv of pipeline stages.

Built straight on torch.distributed's process-group classes over a TCPStore on 127.0.0.1 (the driver
binds a free port; the workers connect to it), not on the global default group, so an engine can be
made, shut down and made again in one process. gloo on the CPU, NCCL on GPUs: the same calls.

Two groups share the store: ``compute`` for the forward pass's collectives, with a timeout
($TOKENMILL_TP_TIMEOUT_S, default 300 s, read when the group is made) after which a hung rank makes the step fail, and ``control``
for the driver's step messages, which a worker waits on for as long as the engine sits idle.

NCCL by design (the GPU path; gloo takes the same calls): the control group is gloo over host memory on GPUs
too, so an idle worker waits in a socket read, never spinning in a device sync, and a message's length is read
without one. NCCL creates a pair's point-to-point communicator lazily, blocking both ranks until the other
side posts, so pipeline stages ``warm_up`` every pair they will use at startup, in a deadlock-free order (the
forward chain stage by stage, then each stage's return line to rank 0); every later send or receive checks
its pair was warmed and raises otherwise, so the CPU tests (gloo, the same call sequence) catch an order
that would hang on NCCL.
"""

from __future__ import annotations

import datetime
import os
import time

import torch
import torch.distributed as dist



def pipeline_pairs(rank: int, size: int, num_stages: int) -> set[tuple[str, int]]:
    """The (group, peer) pairs rank ``rank`` of a pipeline uses: its neighbours on the forward chain, and the
    return lines between rank 0 and each later stage's first rank."""
    t = size // num_stages
    stage = rank // t
    pairs = {("compute", rank - t)} if stage > 0 else set()
    pairs |= {("compute", rank + t)} if stage < num_stages - 1 else set()
    if rank == 0:
        pairs |= {("back", s * t) for s in range(1, num_stages)}
    elif rank % t == 0:
        pairs.add(("back", 0))
    return pairs


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
        self.control = _new_group(dist.PrefixStore("control/", store), rank, size, torch.device("cpu"), IDLE_TIMEOUT)
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
        self.warmed: set[tuple[str, int]] | None = None  # pipeline: the (group, peer) pairs warm_up opened
        self.reset_counters()

    def warm_up(self) -> None:
        """Open every point-to-point pair a pipeline pass uses, in an order that cannot deadlock while NCCL
        creates each pair's communicator: the forward chain (stage s receives from s - 1, then sends to s + 1,
        each rank with its counterpart), then the return lines (each later stage's first rank to rank 0, in
        stage order: the last stage's logits, every stage's expert counts)."""
        t = self.size // self.num_stages
        one = torch.zeros(1, device=self.device)
        if self.stage > 0:
            self.compute.recv([one], self.rank - t, 0).wait()
        if self.stage < self.num_stages - 1:
            self.compute.send([one], self.rank + t, 0).wait()
        if self.rank == 0:
            for s in range(1, self.num_stages):
                self.back.recv([one], s * t, 0).wait()
        elif self.rank % t == 0:
            self.back.send([one], 0, 0).wait()
        self.warmed = pipeline_pairs(self.rank, self.size, self.num_stages)

    def _check_pair(self, name: str, peer: int) -> None:
        if self.warmed is not None and (name, peer) not in self.warmed:
            raise RuntimeError(f"rank {self.rank}: a point-to-point {name} op with rank {peer}, a pair warm_up did "
                               "not open (NCCL would create its communicator mid-step, blocking, and could hang)")

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
        self._check_pair("back" if back else "compute", dst)
        return (self.back if back else self.compute).send([x], dst, tag)

    def recv(self, buf: torch.Tensor, src: int, tag: int) -> torch.Tensor:
        """Receive rank ``src``'s tensor into ``buf`` (its shape and dtype known to both sides)."""
        self._check_pair("compute", src)
        t = time.perf_counter()
        self.compute.recv([buf], src, tag).wait()
        self.recv_wait_s += time.perf_counter() - t
        return buf

    def irecv_back(self, buf: torch.Tensor, src: int, tag: int):
        """Rank 0: start receiving rank ``src``'s tensor sent ``back`` into ``buf``; wait() completes it."""
        self._check_pair("back", src)
        return self.back.recv([buf], src, tag)

    def send_message(self, data: bytes, dsts: list[int], seq: int) -> list:
        """Start sending the driver's message ``data`` (msgpack) to ranks ``dsts`` on the control group: its
        length, then its bytes. ``seq`` numbers the driver's messages (tags, so several can be in flight);
        returns [(work, buffer)] to wait on before the buffers may go."""
        n = torch.tensor([len(data)], dtype=torch.int64)  # (the control group is gloo: host tensors)
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        tag = 2 * (seq % 2**20)
        return [ws for dst in dsts for ws in ((self.control.send([n], dst, tag), n),
                                               (self.control.send([buf], dst, tag + 1), buf))]

    def recv_message(self, seq: int) -> bytes:
        """The driver's message number ``seq`` (send_message), waiting as long as the engine idles."""
        n = torch.empty(1, dtype=torch.int64)
        tag = 2 * (seq % 2**20)
        self.control.recv([n], 0, tag).wait()
        buf = torch.empty(int(n.item()), dtype=torch.uint8)
        self.control.recv([buf], 0, tag + 1).wait()
        return buf.numpy().tobytes()

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
        uint8 tensors on the control group (messages are msgpack, never pickle; host tensors: it is gloo)."""
        dev = torch.device("cpu")
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
        return buf.numpy().tobytes()
