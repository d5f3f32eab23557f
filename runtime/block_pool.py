"""The KV block pool: fixed-size blocks, reference counts, a free list in eviction order and
the prefix-cache map. Pure Python (no torch): the runner owns the tensor these ids index.

    block id:   0    1    2    3    4    5    6    7
    ref count:  2    1    0    0    1    0    0    0
                ^ shared prefix     ^ in use   ^ free
    free_uncached = [7, 6, 5]      never published: handed out first
    free_cached   = {2, 3}         unreferenced but still a prefix-cache hit; LRU first,
                                   evicted only when free_uncached is empty

A block's hash chains its parent's: hash((parent_hash, tokens)). A lookup also compares the
stored token ids, so a hash collision cannot hand out the wrong cache.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

_ROOT_HASH = 0x7A4D  # parent of the first block; any fixed value works


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_cnt = [0] * num_blocks
        # Popped from the end, so low ids go out first (easier to read in tests and dumps).
        self.free_uncached: list[int] = list(range(num_blocks - 1, -1, -1))
        self.free_cached: OrderedDict[int, None] = OrderedDict()
        self.cached: dict[int, int] = {}  # block hash -> block id
        self.block_hash: list[int | None] = [None] * num_blocks
        self.block_tokens: list[tuple[int, ...] | None] = [None] * num_blocks
        self.num_evictions = 0
        self.num_cache_hits = 0  # blocks served from the prefix cache

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_uncached) + len(self.free_cached)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def allocate(self, num_blocks: int) -> list[int] | None:
        if num_blocks > len(self.free_uncached) + len(self.free_cached):
            return None
        uncached = self.free_uncached
        if num_blocks <= len(uncached):  # the common case: no eviction
            out = uncached[len(uncached) - num_blocks :]
            del uncached[len(uncached) - num_blocks :]
            out.reverse()
        else:
            out = uncached[::-1]
            uncached.clear()
            while len(out) < num_blocks:
                block_id, _ = self.free_cached.popitem(last=False)  # least recently used
                self._evict(block_id)
                out.append(block_id)
        ref = self.ref_cnt
        for b in out:
            ref[b] = 1
        return out

    def free(self, block_ids: Sequence[int]) -> None:
        """Release in reverse, so a sequence's last blocks (least shared) are evicted first."""
        ref = self.ref_cnt
        for b in reversed(block_ids):
            count = ref[b]
            if count <= 0:
                raise RuntimeError(f"block {b} freed twice")
            ref[b] = count - 1
            if count == 1:
                if self.block_hash[b] is None:
                    self.free_uncached.append(b)
                else:
                    self.free_cached[b] = None

    def extend_block_hashes(self, token_ids: Sequence[int], hashes: list[int]) -> None:
        """Append to `hashes` one chained hash per further full block of `token_ids`."""
        bs = self.block_size
        parent = hashes[-1] if hashes else _ROOT_HASH
        for start in range(len(hashes) * bs, len(token_ids) - bs + 1, bs):
            parent = hash((parent, tuple(token_ids[start : start + bs])))
            hashes.append(parent)

    def publish_blocks(
        self, token_ids: Sequence[int], block_ids: Sequence[int], hashes: list[int], start: int, end: int
    ) -> None:
        """Publish full blocks [start, end) of a sequence, extending its `hashes` as needed."""
        bs = self.block_size
        for i in range(start, end):
            tokens = tuple(token_ids[i * bs : (i + 1) * bs])
            if i == len(hashes):
                hashes.append(hash((hashes[-1] if hashes else _ROOT_HASH, tokens)))
            self.publish(block_ids[i], hashes[i], tokens)

    def find_cached_prefix(self, block_hashes: Sequence[int], token_ids: Sequence[int]) -> list[int]:
        if not self.enable_prefix_caching:
            return []
        out: list[int] = []
        bs = self.block_size
        for i, h in enumerate(block_hashes):
            b = self.cached.get(h)
            if b is None or self.block_tokens[b] != tuple(token_ids[i * bs : (i + 1) * bs]):
                break
            out.append(b)
        return out

    def num_evictable(self, block_ids: Sequence[int]) -> int:
        return sum(1 for b in block_ids if self.ref_cnt[b] == 0)

    def touch(self, block_ids: Sequence[int]) -> None:
        ref = self.ref_cnt
        for b in block_ids:
            if ref[b] == 0:
                del self.free_cached[b]
            ref[b] += 1
        self.num_cache_hits += len(block_ids)

    def publish(self, block_id: int, block_hash: int, token_ids: Sequence[int]) -> None:
        if not self.enable_prefix_caching or block_hash in self.cached:
            return  # another request computed the same block first; keep that one
        if self.block_hash[block_id] is not None:
            return  # already published (a prefix-cache hit being re-published)
        self.cached[block_hash] = block_id
        self.block_hash[block_id] = block_hash
        self.block_tokens[block_id] = tuple(token_ids)

    def _evict(self, block_id: int) -> None:
        h = self.block_hash[block_id]
        if h is not None and self.cached.get(h) == block_id:
            del self.cached[h]
        self.block_hash[block_id] = None
        self.block_tokens[block_id] = None
        self.num_evictions += 1

    def reset_prefix_cache(self) -> None:
        """Forget every unreferenced cached block (e.g. after new weights are loaded)."""
        for b in list(self.free_cached):
            self._evict(b)
            self.free_uncached.append(b)
        self.free_cached.clear()

    def check_invariants(self) -> None:
        """Raise AssertionError if the pool's books do not balance (used by tests)."""
        free = set(self.free_uncached) | set(self.free_cached)
        assert len(free) == len(self.free_uncached) + len(self.free_cached), "a block is free twice"
        used = {b for b in range(self.num_blocks) if self.ref_cnt[b] > 0}
        assert not (free & used), f"blocks both free and used: {sorted(free & used)[:8]}"
        assert len(free) + len(used) == self.num_blocks, "free + used != total"
        assert all(c >= 0 for c in self.ref_cnt), "negative reference count"
        for h, b in self.cached.items():
            assert self.block_hash[b] == h, f"cache map and block {b} disagree"
        for b in self.free_cached:
            assert self.block_hash[b] is not None, f"block {b} in the cached free list has no hash"
