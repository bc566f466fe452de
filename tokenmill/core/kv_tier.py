"""A second KV tier on local disk, the scheduler's side: which blocks the tier holds (its index, rebuilt from the
directory at start), which evicted blocks go there, which a request reads back, and which file goes when the tier
is full (the least recently used). worker/kv_tier.py moves the bytes.

The flow. A cached block the pool evicts for reuse while a step is scheduled (``BlockPool.on_evict``) joins the
index and the step's ``kv_offload_store``: the runner copies it to host memory before the step's forward pass can
overwrite it, and a background thread writes its file. A block the tier already holds is not written again.
Evictions outside a step's scheduling (a draft's reserved slots, ``score``) are not offloaded: something may write
the block before a launch copies it. A request being admitted looks up the blocks after its pool hits here; a
leading run of hits gets blocks reserved and waits for them as a disaggregated request waits for a producer's KV
(core/remote_kv.py, ``waiting_for_kv``) while a reader thread fills them; when a file fails its check the request
computes its prompt instead (the remote path's recompute) and the load's files are dropped.

Files: ``<path>/<key>/<block hash>.kv``, the key a hash of everything that shapes a block's bytes (the model's
files, dtype, quantization, KV dtype and layout, rank), so no other model or configuration reads them; each file
holds a header (format, the full key, the block hash, the payload size and its sha256) and the payload.
"""

from __future__ import annotations

import hashlib
import logging
import os
import struct
import threading
from collections import OrderedDict
from pathlib import Path
from typing import TYPE_CHECKING

from tokenmill.core.sched_output import KVOffloadStats

if TYPE_CHECKING:
    from tokenmill.config import EngineConfig
    from tokenmill.core.kv_cache import BlockPool
    from tokenmill.core.sched_output import SchedulerOutput

logger = logging.getLogger("tokenmill")

TIER_FORMAT = 1
SUFFIX = ".kv"
# magic, format, tier key, block hash, payload bytes, sha256 of the payload
HEADER = struct.Struct("<8sI32s32sQ32s")
MAGIC = b"TMKVTIER"
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt", ".pth")


def default_path() -> Path:
    """Where the tier lives without --kv-offload-path: the user's cache directory."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "tokenmill" / "kv"


def model_identity(path: str | os.PathLike) -> list[tuple[str, int, int]]:
    """(name, size, mtime) of the model's file, or of a folder's weight and config files: new weights, new key."""
    p = Path(path)
    files = [p] if p.is_file() else sorted(f for f in p.iterdir() if f.is_file() and (
        f.suffix in WEIGHT_SUFFIXES or f.name == "config.json"))
    return [(f.name, (st := f.stat()).st_size, st.st_mtime_ns) for f in files]


def tier_key(model_path: str | os.PathLike, layout: dict) -> bytes:
    """The tier's key: the model's files and every setting that shapes a block's bytes (``layout``)."""
    return hashlib.sha256(repr((TIER_FORMAT, model_identity(model_path), sorted(layout.items()))).encode()).digest()


def pack_header(key: bytes, block_hash: bytes, nbytes: int, digest: bytes) -> bytes:
    return HEADER.pack(MAGIC, TIER_FORMAT, key, block_hash, nbytes, digest)


def check_header(raw: bytes | memoryview, key: bytes, block_hash: bytes, nbytes: int) -> bytes:
    """The payload's sha256 a file's header promises; ValueError naming what does not match."""
    magic, fmt, k, h, n, digest = HEADER.unpack(raw)
    if magic != MAGIC or fmt != TIER_FORMAT:
        raise ValueError("not a tier file of this format")
    if k != key:
        raise ValueError("written for another model or KV layout")
    if h != block_hash:
        raise ValueError("holds another block")
    if n != nbytes:
        raise ValueError(f"payload of {n} bytes, expected {nbytes}")
    return digest


def check_kv_offload(config: EngineConfig, device_type: str) -> None:
    """Refuse the combinations the tier does not support, naming them."""
    if config.cache.kv_offload_size is None:
        return
    why = []
    if not config.cache.enable_prefix_caching:
        why.append("--no-enable-prefix-caching (the tier holds prefix-cache blocks, by their hashes)")
    if config.parallel.world_size > 1:
        why.append("more than one rank (--tensor-parallel-size, --pipeline-parallel-size): the KV is sharded")
    if config.kv_transfer.kv_role is not None:
        why.append(f"--kv-role {config.kv_transfer.kv_role} (disaggregation)")
    if config.speculative.speculative_method == "draft":
        why.append("a draft model (its KV would have to go to the tier too)")
    if device_type != "cpu":
        why.append(f"the {device_type} device (a tier in pinned host memory for GPUs is not built yet)")
    if why:
        raise ValueError("--kv-offload-size does not work with " + "; ".join(why))


class OffloadCounters:
    """The tier's counters, added to by the engine thread and the tier's threads, taken once a step."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stats = KVOffloadStats()
        self._write_failed: list[bytes] = []

    def looked_up(self, queries: int, hits: int) -> None:
        with self._lock:
            self._stats.queries += queries
            self._stats.hits += hits

    def read(self, nbytes: int, seconds: float) -> None:
        with self._lock:
            self._stats.bytes_read += nbytes
            self._stats.read_seconds.append(seconds)

    def wrote(self, nbytes: int, seconds: float) -> None:
        with self._lock:
            self._stats.bytes_written += nbytes
            self._stats.write_seconds.append(seconds)

    def failed(self, n: int = 1) -> None:
        """Files that failed their check (or could not be read) and were not served."""
        with self._lock:
            self._stats.failures += n

    def write_failed(self, block_hash: bytes) -> None:
        with self._lock:
            self._write_failed.append(block_hash)

    def take_write_failures(self) -> list[bytes]:
        with self._lock:
            out, self._write_failed = self._write_failed, []
        return out

    def take(self, usage_bytes: int) -> KVOffloadStats:
        with self._lock:
            out, self._stats = self._stats, KVOffloadStats()
        out.usage_bytes = usage_bytes
        return out


class KVTier:
    """The tier's index: the block hashes it holds, least recently used first, within ``capacity_bytes`` of files
    of ``file_bytes`` each, in ``directory`` (this key's subdirectory), under ``pool`` (told of its evictions)."""

    def __init__(self, directory: str | os.PathLike, capacity_bytes: int, file_bytes: int, key: bytes,
                 pool: BlockPool | None = None) -> None:
        self.directory, self.pool = Path(directory), pool
        self.key, self.file_bytes = key, file_bytes
        self.max_files = capacity_bytes // file_bytes
        if self.max_files < 1:
            raise ValueError(f"--kv-offload-size {capacity_bytes / 2**30:g} GiB holds no KV block of "
                             f"{file_bytes} bytes; raise it")
        self.files: OrderedDict[bytes, None] = OrderedDict()  # least recently used first
        self.reading: dict[str, list[bytes]] = {}  # request -> the hashes its read holds (kept until it ends)
        self._pinned: dict[bytes, int] = {}
        self.counters = OffloadCounters()
        self._collecting = False  # only while a step is scheduled (see the module's docstring)
        self._stores: list[tuple[int, bytes]] = []
        self._evictions: list[bytes] = []
        self._lookups: dict[str, tuple[int, list[bytes]]] = {}  # this step's lookups: request -> (queried, found)
        self._lock_file = None
        self._open()
        if pool is not None:
            pool.on_evict = self.evicted

    def path(self, block_hash: bytes) -> Path:
        return self.directory / (block_hash.hex() + SUFFIX)

    @property
    def usage_bytes(self) -> int:
        return len(self.files) * self.file_bytes

    def _open(self) -> None:
        """Lock the directory (one engine at a time) and index its files, oldest first by modification time; a
        file of the wrong size (a truncated write) and an unfinished write are deleted."""
        self.directory.mkdir(parents=True, exist_ok=True)
        try:
            import fcntl
        except ImportError:  # (not POSIX: no lock)
            fcntl = None
        self._lock_file = open(self.directory / "lock", "a")
        if fcntl is not None:
            try:
                fcntl.flock(self._lock_file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                self._lock_file.close()
                raise ValueError(f"the KV tier directory {self.directory} is in use by another engine; give this "
                                 "one its own --kv-offload-path") from None
        found, dropped = [], 0
        for entry in os.scandir(self.directory):
            name = entry.name
            if name.endswith(".tmp"):
                os.unlink(entry.path)
                continue
            if not name.endswith(SUFFIX):
                continue
            try:
                block_hash = bytes.fromhex(name[:-len(SUFFIX)])
            except ValueError:
                continue
            st = entry.stat()
            if len(block_hash) != 32 or st.st_size != self.file_bytes:
                os.unlink(entry.path)
                dropped += 1
                continue
            found.append((st.st_mtime_ns, block_hash))
        for _, h in sorted(found):
            self.files[h] = None
        while len(self.files) > self.max_files:  # (a smaller --kv-offload-size than last time)
            h, _ = self.files.popitem(last=False)
            self.path(h).unlink(missing_ok=True)
        if dropped:
            logger.warning("KV tier: deleted %d truncated or foreign files in %s", dropped, self.directory)
            self.counters.failed(dropped)
        logger.info("KV tier %s: %d blocks (%.1f of %.1f MiB)", self.directory, len(self.files),
                    self.usage_bytes / 2**20, self.max_files * self.file_bytes / 2**20)

    @property
    def lock_held(self) -> bool:
        """Open, and this engine's (``close`` lets it go)."""
        return self._lock_file is not None

    def close(self) -> None:
        if self._lock_file is not None:
            self._lock_file.close()
            self._lock_file = None

    # ---- a step's scheduling ------------------------------------------------------------

    def open_step(self) -> None:
        for h in self.counters.take_write_failures():  # (a write that failed: the block is not there)
            self.files.pop(h, None)
        for _, found in self._lookups.values():  # (left by a scheduling that raised)
            self._unpin(found)
        self._stores, self._evictions, self._lookups = [], [], {}
        self._collecting = True

    def close_step(self, out: SchedulerOutput) -> None:
        self._collecting = False
        for _, found in self._lookups.values():  # looked up, not admitted
            self._unpin(found)
        self._lookups = {}
        out.kv_offload_store = self._stores
        # a hash evicted and stored again this step stays (its write comes first, then the deletes)
        out.kv_offload_evict = [h for h in self._evictions if h not in self.files]

    def evicted(self, block: int, block_hash: bytes) -> None:
        """BlockPool.on_evict: a cached block is reused; while a step is scheduled, it goes to the tier."""
        if not self._collecting:
            return
        if block_hash in self.files:  # held already: not written again
            self.files.move_to_end(block_hash)
            return
        if not self._make_room():
            return
        self.files[block_hash] = None
        self._stores.append((block, block_hash))

    def _make_room(self) -> bool:
        while len(self.files) >= self.max_files:
            victim = next((h for h in self.files if h not in self._pinned), None)
            if victim is None:  # every file is being read
                return False
            del self.files[victim]
            self._evictions.append(victim)
        return True

    # ---- admission ------------------------------------------------------------------------

    def lookup(self, request_id: str, hashes: list[bytes]) -> list[bytes]:
        """The leading run of ``hashes`` (the blocks after a request's pool hits) the tier holds, kept from eviction
        while the step is scheduled; counted, and kept until read, once the request is admitted (``admitted``)."""
        found = []
        for h in hashes:
            if h not in self.files:
                break
            found.append(h)
            self.files.move_to_end(h)
            self._pinned[h] = self._pinned.get(h, 0) + 1
        self._lookups[request_id] = (len(hashes), found)
        return found

    def admitted(self, request_id: str, reading: bool = False) -> None:
        """The request looked up this step was admitted; ``reading``: it reads its hits (kept until ``loaded``)."""
        queried, found = self._lookups.pop(request_id, (0, []))
        self.counters.looked_up(queried, len(found) if reading else 0)
        if reading:
            self.reading[request_id] = found
        else:
            self._unpin(found)

    def loaded(self, request_id: str, error: str | None) -> None:
        """The request's read ended; on an error its files are gone (the reader deleted them)."""
        found = self.reading.pop(request_id, [])
        self._unpin(found)
        if error is not None:
            for h in found:
                self.files.pop(h, None)

    def _unpin(self, hashes: list[bytes]) -> None:
        for h in hashes:
            n = self._pinned.pop(h) - 1
            if n:
                self._pinned[h] = n

    def persist(self) -> tuple[list[tuple[int, bytes]], list[bytes]]:
        """At shutdown: the pool's cached blocks the tier lacks, to write (least recently used first, so the
        tier keeps the most recent), and the files that make room for them, as a step's stores and evictions."""
        pool = self.pool
        self.open_step()
        for b in [*pool.free_blocks, *(b for b in range(pool.num_blocks) if pool.ref_cnt[b] > 0)]:
            if pool.block_hash[b] is not None:
                self.evicted(b, pool.block_hash[b])
        self._collecting = False
        return self._stores, [h for h in self._evictions if h not in self.files]

    def take_stats(self) -> KVOffloadStats:
        return self.counters.take(self.usage_bytes)
