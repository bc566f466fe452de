"""Paged KV-cache bookkeeping: block ids, reference counts, per-request block tables.

Pure Python: the tensors live in the model runner; this module only decides which
block ids a request owns. Invariants (checked by ``check_invariants`` in tests):
- every block is either free (ref count 0, in the free list exactly once) or referenced;
- a block's ref count equals the number of block tables holding it;
- when no request holds blocks, every block is free.
"""

from __future__ import annotations

from collections import deque


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class BlockPool:
    """A fixed set of block ids with reference counts and a free list."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_cnt = [0] * num_blocks
        self.free_blocks: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    def allocate(self, n: int) -> list[int]:
        if n > len(self.free_blocks):
            raise RuntimeError(f"asked for {n} KV blocks, only {len(self.free_blocks)} free")
        blocks = [self.free_blocks.popleft() for _ in range(n)]
        for b in blocks:
            self.ref_cnt[b] = 1
        return blocks

    def free(self, blocks: list[int]) -> None:
        for b in blocks:
            if self.ref_cnt[b] <= 0:
                raise RuntimeError(f"KV block {b} freed twice")
            self.ref_cnt[b] -= 1
            if self.ref_cnt[b] == 0:
                self.free_blocks.append(b)


class KVCacheManager:
    """Owns every request's block table; the scheduler asks it for room."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.block_tables: dict[str, list[int]] = {}

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks in use (vLLM's kv_cache_usage_perc)."""
        return 1.0 - self.pool.num_free_blocks / self.pool.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def allocate_slots(self, request_id: str, num_total_tokens: int) -> list[int] | None:
        """Grow the request's block table to hold ``num_total_tokens`` tokens.

        Returns the block table, or None (and changes nothing) when the pool lacks room.
        """
        table = self.block_tables.setdefault(request_id, [])
        need = self.blocks_needed(num_total_tokens) - len(table)
        if need > self.pool.num_free_blocks:
            if not table:
                del self.block_tables[request_id]
            return None
        if need > 0:
            table.extend(self.pool.allocate(need))
        return table

    def free(self, request_id: str) -> None:
        table = self.block_tables.pop(request_id, None)
        if table:
            # Tail blocks go back first-out-last so recently used ones are reused last (matters once blocks are cached).
            self.pool.free(table[::-1])

    def check_invariants(self) -> None:
        counts = [0] * self.pool.num_blocks
        for table in self.block_tables.values():
            for b in table:
                assert 0 <= b < self.pool.num_blocks, f"a block table holds {b!r}, which is not a block id"
                counts[b] += 1
        free = list(self.pool.free_blocks)
        free_set = set(free)
        assert len(free) == len(free_set), "a block is in the free list twice"
        assert all(0 <= b < self.pool.num_blocks for b in free), "the free list holds an id that is not a block"
        for b in range(self.pool.num_blocks):
            assert counts[b] == self.pool.ref_cnt[b], f"block {b}: ref count {self.pool.ref_cnt[b]} != {counts[b]} holders"
            assert (b in free_set) == (counts[b] == 0), f"block {b}: free-list membership disagrees with ref count"
