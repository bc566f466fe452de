"""A second KV tier on local disk, the bytes (core/kv_tier.py keeps the index and decides what moves).

Blocks leaving the pool are copied to host memory in the step that evicts them, before its forward pass
(``before_forward``, from the runner's launch), and written to their files on a background thread. A request's
blocks are read on reader threads into the blocks reserved for it, and each read ends through the KV connector's
interface (``start_receive``, ``poll``, ``wait``, ``pending``), which the engine core already drives for
disaggregation (engine/core.py): the scheduler then runs the request or, when a file failed its check, computes
its prompt; a file that fails is never served. A block whose write is still queued is read from its host copy.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import torch

from tokenmill.core.kv_tier import HEADER, KVTier, check_header, pack_header
from tokenmill.core.sched_output import KVTransferStats

if TYPE_CHECKING:
    from tokenmill.core.kv_cache import BlockPool
    from tokenmill.core.sched_output import KVRecv, KVSend, SchedulerOutput

logger = logging.getLogger("tokenmill")
READ_THREADS = 2
# host copies waiting for the writer, at most: past it (a disk slower than the evictions) blocks are dropped, not kept
MAX_BACKLOG_BYTES = 256 * 2**20


def block_payload_bytes(kv_caches: list[tuple[torch.Tensor, ...]]) -> int:
    """One block's bytes over every layer's K and V (and their scales): a tier file's payload."""
    return sum(t[0].numel() * t.element_size() for layer in kv_caches for t in layer)


def _rows(host: list[torch.Tensor], i: int) -> list:
    """Block ``i`` of each host tensor as bytes (numpy views, no copy)."""
    return [h[i].view(torch.uint8).numpy() for h in host]


class KVTierStore:
    """The tier's file I/O over the runner's KV tensors; the engine core's ``kv_connector`` where the tier is on."""

    address = None  # (the connector's interface: nothing listens)

    def __init__(self, kv_caches: list[tuple[torch.Tensor, ...]], tier: KVTier) -> None:
        self.tensors = [t for layer in kv_caches for t in layer]
        self.row_bytes = [t[0].numel() * t.element_size() for t in self.tensors]
        self.payload_bytes = sum(self.row_bytes)
        self.file_bytes = HEADER.size + self.payload_bytes
        if tier.file_bytes != self.file_bytes:
            raise ValueError(f"the KV tier's files are {tier.file_bytes} bytes, the pool's blocks {self.file_bytes}")
        self.tier, self.counters = tier, tier.counters
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="tokenmill-kv-tier-write")
        self._readers = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="tokenmill-kv-tier-read")
        self._lock = threading.Lock()
        self._unwritten: dict[bytes, tuple[list[torch.Tensor], int]] = {}  # hash -> (host copies, row): queued
        self._queued: list[KVRecv] = []  # reads started at the next launch, after its copies out
        self._reading = 0  # reads not yet polled
        self._events: list[tuple[str, str, str | None, KVTransferStats]] = []
        self.wakeup = threading.Event()
        self._warned = False
        self._backlog = 0  # bytes of host copies not yet written

    # ---- the runner's step ----------------------------------------------------------------

    def before_forward(self, sched: SchedulerOutput) -> None:
        """Copy the step's evicted blocks to host memory and queue their writes (then the evicted files'
        deletion); then start the reads the step asked for, whose blocks may have been among those copied."""
        self._copy_out(sched.kv_offload_store, sched.kv_offload_evict)
        if self._queued:
            with self._lock:
                queued, self._queued = self._queued, []
            for recv in queued:
                self._readers.submit(self._read, recv)

    def _copy_out(self, stores: list[tuple[int, bytes]], evict: list[bytes]) -> None:
        if not stores and not evict:
            return
        hashes, host = [h for _, h in stores], []
        with self._lock:
            full = self._backlog + len(hashes) * self.payload_bytes > MAX_BACKLOG_BYTES
            if not full:
                self._backlog += len(hashes) * self.payload_bytes
        if full:  # the writer is behind: these blocks are not offloaded (the index forgets them next step)
            for h in hashes:
                self.counters.write_failed(h)
            hashes, stores = [], []
        if hashes:
            idx = torch.tensor([b for b, _ in stores], dtype=torch.long)
            host = [t.index_select(0, idx) for t in self.tensors]  # a copy: the step may overwrite the blocks
            with self._lock:
                for i, h in enumerate(hashes):
                    self._unwritten[h] = (host, i)
        self._writer.submit(self._write, hashes, host, list(evict))

    # ---- the KV connector's interface (engine/core.py) ----------------------------------------

    def start_receive(self, recv: KVRecv) -> None:
        """Read a request's blocks from the tier into its reserved blocks, from the runner's next launch on."""
        with self._lock:
            self._queued.append(recv)
            self._reading += 1

    def poll(self) -> list[tuple[str, str, str | None, KVTransferStats]]:
        """Reads that ended since the last call: ("received", request id, error or None, record)."""
        with self._lock:
            events, self._events = self._events, []
            self._reading -= len(events)
            self.wakeup.clear()
        return events

    def pending(self) -> bool:
        with self._lock:
            return bool(self._reading)

    def wait(self, timeout: float) -> None:
        self.wakeup.wait(timeout)

    def offer(self, send: KVSend) -> None:
        raise RuntimeError("the KV tier sends no blocks to a consumer")

    def shutdown(self) -> None:
        """Write the pool's cached blocks the tier lacks and finish the queued writes (the tier outlives the
        engine: a restart finds what this one computed), then let the directory go."""
        self._readers.shutdown(wait=True, cancel_futures=True)
        if self.tier.pool is not None and self.tier.lock_held:
            stores, evict = self.tier.persist()
            if stores:
                logger.info("KV tier: writing the pool's %d cached blocks it lacks", len(stores))
            self._copy_out([], evict)
            step = max(1, MAX_BACKLOG_BYTES // self.payload_bytes // 2)
            for i in range(0, len(stores), step):  # within the backlog's bound, the writer draining in between
                self._writer.submit(lambda: None).result()
                self._copy_out(stores[i:i + step], [])
        self._writer.shutdown(wait=True)
        self.tier.close()

    # ---- the threads ------------------------------------------------------------------------

    def _write(self, hashes: list[bytes], host: list[torch.Tensor], evict: list[bytes]) -> None:
        t0, written = time.perf_counter(), 0
        for i, h in enumerate(hashes):
            path = self.tier.path(h)
            tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
            try:
                rows = _rows(host, i)
                digest = hashlib.sha256()
                for r in rows:
                    digest.update(r)
                with open(tmp, "wb") as f:
                    f.write(pack_header(self.tier.key, h, self.payload_bytes, digest.digest()))
                    for r in rows:
                        f.write(r)
                os.replace(tmp, path)  # whole or absent: a reader never sees a file being written
                written += self.file_bytes
            except OSError as e:
                tmp.unlink(missing_ok=True)
                self.counters.write_failed(h)
                if not self._warned:
                    self._warned = True
                    logger.warning("KV tier: could not write %s (%s); such blocks are recomputed", path, e)
            finally:
                with self._lock:
                    self._backlog -= self.payload_bytes
                    if self._unwritten.get(h, (None,))[0] is host:
                        del self._unwritten[h]
        self._delete(evict)
        if hashes:
            self.counters.wrote(written, time.perf_counter() - t0)

    def _delete(self, hashes: list[bytes]) -> None:
        for h in hashes:
            self.tier.path(h).unlink(missing_ok=True)

    def _read_file(self, h: bytes) -> memoryview:
        """A block's payload, checked: its size, header (tier key, block hash, payload size) and sha256."""
        buf = bytearray(self.file_bytes)
        with open(self.tier.path(h), "rb") as f:
            n = f.readinto(buf)
            longer = f.read(1)
        if n != self.file_bytes or longer:
            raise ValueError(f"{n}{' or more' if longer else ''} bytes, expected {self.file_bytes}")
        view = memoryview(buf)
        digest = check_header(view[:HEADER.size], self.tier.key, h, self.payload_bytes)
        if hashlib.sha256(view[HEADER.size:]).digest() != digest:
            raise ValueError("its payload does not match its checksum")
        return view[HEADER.size:]

    @torch.inference_mode()
    def _read(self, recv: KVRecv) -> None:
        t0, nbytes, error = time.perf_counter(), 0, None
        h = b""
        try:
            for block, h in zip(recv.block_ids, recv.block_hashes, strict=True):
                with self._lock:
                    held = self._unwritten.get(h)
                if held is not None:  # its write is queued: the host copy is the same bytes
                    host, i = held
                    for t, src in zip(self.tensors, host):
                        t[block].copy_(src[i])
                    continue
                payload = self._read_file(h)
                off = 0
                for t, n in zip(self.tensors, self.row_bytes):
                    t[block].view(torch.uint8).view(-1).copy_(torch.frombuffer(payload, dtype=torch.uint8, count=n,
                                                                               offset=off))
                    off += n
                nbytes += self.file_bytes
                try:
                    os.utime(self.tier.path(h))  # recently used: the order survives a restart
                except OSError:
                    pass
        except Exception as e:  # noqa: BLE001 -- whatever went wrong, the blocks are not served
            error = f"KV tier file {h.hex()[:16]}... not served: {e}"
            self.counters.failed()
            try:  # the load's files go, after any write of them still queued
                self._writer.submit(self._delete, list(recv.block_hashes)).result()
            except RuntimeError:  # (shutting down)
                pass
        seconds = time.perf_counter() - t0
        if error is None:
            self.counters.read(nbytes, seconds)
        record = KVTransferStats("offload", recv.request_id, len(recv.block_ids), nbytes, seconds, error)
        with self._lock:
            self._events.append(("received", recv.request_id, error, record))
            self.wakeup.set()


def open_kv_tier(kv_caches: list[tuple[torch.Tensor, ...]], pool: BlockPool, directory: str | os.PathLike,
                 capacity_bytes: int, key: bytes) -> KVTierStore:
    """The tier in ``directory`` (its index rebuilt from the files there) under ``pool``, over the runner's KV
    tensors."""
    file_bytes = HEADER.size + block_payload_bytes(kv_caches)
    return KVTierStore(kv_caches, KVTier(directory, capacity_bytes, file_bytes, key, pool))
