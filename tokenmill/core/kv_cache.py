"""Paged KV-cache bookkeeping: block ids, reference counts, block tables, prefix caching.

Pure Python: the tensors live in the model runner; this module only decides which
block ids a request owns.

Prefix caching: once a block is full, it is registered under a chained hash of
(the parent block's hash, its token ids), seeded with the engine's cache salt (model,
dtype, quantization: anything that changes the KV), and for a request with its own cache_salt
(vLLM's multi-tenant field) by that too, so requests with different salts never share a block. A
new request takes every cached
block of its longest cached prefix (reference count up) and computes only the rest. A
block whose count falls to zero keeps its hash and stays in the free queue: it is evicted,
least recently used first, only when an allocation needs it.

Invariants (checked by ``check_invariants`` in tests):
- a block's ref count equals the number of block tables holding it;
- a block is in the free queue exactly when its ref count is 0, and at most once;
- the hash map and the per-block hashes agree, one block per hash;
- when no request holds blocks, every block is in the free queue.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def hash_block(parent: bytes, token_ids: list[int]) -> bytes:
    """Chained block hash: sha256, so two different prefixes never share KV in practice."""
    return hashlib.sha256(parent + array("q", token_ids).tobytes()).digest()


class BlockPool:
    """A fixed set of block ids with reference counts, an LRU free queue and the prefix-hash map."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_cnt = [0] * num_blocks
        # Free blocks, least recently used at the head: allocation takes (and evicts) from there.
        self.free_blocks: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}
        self.num_evictions = 0
        # told of each cached block evicted for reuse, before its new owner writes it (the KV tier copies it out)
        self.on_evict: Callable[[int, bytes], None] | None = None

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    @property
    def num_cached_blocks(self) -> int:
        return len(self.cached)

    def allocate(self, n: int) -> list[int]:
        if n > len(self.free_blocks):
            raise RuntimeError(f"asked for {n} KV blocks, only {len(self.free_blocks)} free")
        blocks = [self.free_blocks.popitem(last=False)[0] for _ in range(n)]
        for b in blocks:
            self.ref_cnt[b] = 1
            h = self.block_hash[b]
            if h is not None:  # reusing a cached block: its old contents are gone
                del self.cached[h]
                self.block_hash[b] = None
                self.num_evictions += 1
                if self.on_evict is not None:
                    self.on_evict(b, h)
        return blocks

    def touch(self, blocks: list[int]) -> None:
        """Take one more reference on cached blocks (a prefix hit)."""
        for b in blocks:
            if self.ref_cnt[b] == 0:
                del self.free_blocks[b]
            self.ref_cnt[b] += 1

    def free(self, blocks: list[int]) -> None:
        for b in blocks:
            if self.ref_cnt[b] <= 0:
                raise RuntimeError(f"KV block {b} freed twice")
            self.ref_cnt[b] -= 1
            if self.ref_cnt[b] == 0:
                self.free_blocks[b] = None  # most recently used: evicted last

    def register(self, block: int, block_hash: bytes) -> None:
        """Make a full block findable by its hash (first writer wins on a duplicate)."""
        if self.block_hash[block] is None and block_hash not in self.cached:
            self.cached[block_hash] = block
            self.block_hash[block] = block_hash


@dataclass
class PrefixCacheStats:
    """Counted at admission, in tokens (vLLM's prefix_cache_queries / prefix_cache_hits)."""

    requests: int = 0
    queries: int = 0
    hits: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


def size_kv_pool(spec: tuple[str, float], free_bytes: float, block_bytes: int, block_size: int, max_num_seqs: int,
                 max_model_len: int) -> tuple[int, str]:
    """How many KV blocks to allocate, and why (for the startup log).

    ``--kv-cache-memory`` as bytes is taken as it is. As a fraction of free memory (the default, 0.1) it
    is a ceiling: the pool is the smaller of that and what the configuration can use at once,
    max_num_seqs sequences of max_model_len tokens, so a small model with a short context is not handed
    gigabytes it cannot fill."""
    kind, value = spec
    if kind == "bytes":
        return int(value // block_bytes), f"--kv-cache-memory {value / 2**20:.0f} MiB"
    by_fraction = int(value * free_bytes // block_bytes)
    usable = max_num_seqs * cdiv(max_model_len, block_size)
    if usable < by_fraction:
        return usable, (f"what {max_num_seqs} sequences of {max_model_len} tokens can use, under {value:g} of free "
                        f"memory ({by_fraction * block_bytes / 2**20:.0f} MiB)")
    return by_fraction, (f"{value:g} of free memory, under what {max_num_seqs} sequences of {max_model_len} tokens "
                         f"could use ({usable * block_bytes / 2**20:.0f} MiB)")


class KVCacheManager:
    """Owns every request's block table; the scheduler asks it for room."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False,
                 cache_salt: bytes = b"") -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.block_tables: dict[str, list[int]] = {}
        self.enable_prefix_caching = enable_prefix_caching
        self.cache_salt = hashlib.sha256(cache_salt).digest()
        # per request: its own cache_salt's seed for its first block (the scheduler sets and drops it); the
        # whole chain hangs off the first block's hash, so a different salt shares no block at all
        self.request_salts: dict[str, bytes] = {}
        self.stats = PrefixCacheStats()
        self._hashes: dict[str, list[bytes]] = {}  # per request: hashes of its full blocks so far
        self._num_registered: dict[str, int] = {}  # per request: leading table blocks already in the map
        self._num_taken: dict[str, int] = {}  # per request: leading table blocks the runner was told of

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests (vLLM's kv_cache_usage_perc); cached free blocks count as free."""
        return 1.0 - self.pool.num_free_blocks / self.pool.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    # ---- prefix caching ----------------------------------------------------------------

    def _block_hashes(self, request_id: str, token_ids: list[int], num_blocks: int) -> list[bytes]:
        hashes = self._hashes.setdefault(request_id, [])
        bs = self.block_size
        while len(hashes) < num_blocks:
            i = len(hashes)
            parent = hashes[-1] if hashes else self.request_salts.get(request_id, self.cache_salt)
            hashes.append(hash_block(parent, token_ids[i * bs:(i + 1) * bs]))
        return hashes

    def set_request_salt(self, request_id: str, salt: str | None) -> None:
        """Salt the request's block hashes with its own ``salt`` (None: the engine's salt alone). Kept until
        ``drop_request_salt``: a preempted request hashes its blocks again when it is readmitted."""
        if salt is None:
            self.request_salts.pop(request_id, None)
        else:
            self.request_salts[request_id] = hashlib.sha256(self.cache_salt + b"\0" + salt.encode()).digest()
        self._hashes.pop(request_id, None)

    def drop_request_salt(self, request_id: str) -> None:
        self.request_salts.pop(request_id, None)

    def prefix_block_hashes(self, request_id: str, token_ids: list[int]) -> list[bytes]:
        """The hashes of the request's full blocks a prefix hit may cover (it leaves at least one token)."""
        return self._block_hashes(request_id, token_ids, (len(token_ids) - 1) // self.block_size)

    def get_computed_blocks(self, request_id: str, token_ids: list[int]) -> list[int]:
        """Cached blocks of the longest cached prefix of ``token_ids``, leaving at least one
        token to compute (the request needs fresh logits). Changes no reference count."""
        if not self.enable_prefix_caching:
            return []
        blocks = []
        for h in self.prefix_block_hashes(request_id, token_ids):
            b = self.pool.cached.get(h)
            if b is None:
                break
            blocks.append(b)
        return blocks

    def cache_full_blocks(self, request_id: str, token_ids: list[int], num_computed_tokens: int) -> None:
        """Register the request's blocks that ``num_computed_tokens`` has filled."""
        if not self.enable_prefix_caching:
            return
        num_full = num_computed_tokens // self.block_size
        done = self._num_registered.get(request_id, 0)
        if num_full <= done:
            return
        table = self.block_tables[request_id]
        hashes = self._block_hashes(request_id, token_ids, num_full)
        for i in range(done, num_full):
            self.pool.register(table[i], hashes[i])
        self._num_registered[request_id] = num_full

    # ---- allocation ----------------------------------------------------------------------

    def allocate_slots(self, request_id: str, num_total_tokens: int,
                       computed_blocks: list[int] = ()) -> list[int] | None:
        """Grow the request's block table to hold ``num_total_tokens`` tokens, first taking
        ``computed_blocks`` (prefix hits, for a request that holds no blocks yet).

        Returns the block table, or None (and changes nothing) when the pool lacks room.
        """
        table = self.block_tables.get(request_id, [])
        need = self.blocks_needed(num_total_tokens) - len(table) - len(computed_blocks)
        # Hit blocks nobody holds sit in the free queue: taking them uses up free room too.
        idle_hits = sum(1 for b in computed_blocks if self.pool.ref_cnt[b] == 0)
        if max(need, 0) + idle_hits > self.pool.num_free_blocks:
            return None
        if computed_blocks:
            self.pool.touch(computed_blocks)
            table = table + list(computed_blocks)
            self._num_registered[request_id] = len(table)
        if need > 0:
            table.extend(self.pool.allocate(need))
        self.block_tables[request_id] = table
        return table

    def take_new_blocks(self, request_id: str) -> tuple[list[int], bool]:
        """The blocks added to the request's table since the last call, and whether its table is new since
        then (its first call, or its blocks were freed between: they are the whole table)."""
        table = self.block_tables[request_id]
        taken = self._num_taken.get(request_id)
        self._num_taken[request_id] = len(table)
        return (list(table) if taken is None else table[taken:]), taken is None

    def free(self, request_id: str) -> None:
        table = self.block_tables.pop(request_id, None)
        self._num_taken.pop(request_id, None)
        self._hashes.pop(request_id, None)
        self._num_registered.pop(request_id, None)
        if table:
            # Tail first: a prefix's later blocks are evicted before its head, which more requests share.
            self.pool.free(table[::-1])

    def check_invariants(self) -> None:
        pool = self.pool
        counts = [0] * pool.num_blocks
        for table in self.block_tables.values():
            for b in table:
                assert 0 <= b < pool.num_blocks, f"a block table holds {b!r}, which is not a block id"
                counts[b] += 1
        free = list(pool.free_blocks)
        assert all(0 <= b < pool.num_blocks for b in free), "the free queue holds an id that is not a block"
        free_set = set(free)
        for b in range(pool.num_blocks):
            assert counts[b] == pool.ref_cnt[b], f"block {b}: ref count {pool.ref_cnt[b]} != {counts[b]} holders"
            assert (b in free_set) == (counts[b] == 0), f"block {b}: free-queue membership disagrees with ref count"
        for h, b in pool.cached.items():
            assert pool.block_hash[b] == h, f"block {b} is cached under a hash it does not carry"
        assert sum(h is not None for h in pool.block_hash) == len(pool.cached), "a block carries a hash not in the map"
        if not self.enable_prefix_caching:
            assert not pool.cached, "blocks were cached with prefix caching off"
