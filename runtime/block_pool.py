"""The KV block pool: fixed-size blocks, reference counts, a free list in eviction order and
the prefix-cache map. Pure Python (no torch): the runner owns the tensor these ids index.

    block id:   0    1    2    3    4    5    6    7
    ref count:  2    1    0    0    1    0    0    0
                ^ shared prefix     ^ in use   ^ free
    free_uncached = [7, 6, 5]      never published: handed out first
    free_cached   = {2, 3}         unreferenced but still a prefix-cache hit; LRU first,
                                   evicted only when free_uncached is empty

Prefix caching, safe when tenants share one pool:

    block hash  = blake2b(key=secret, parent block hash + the block's token ids as int64)
    cached      = {block hash: block id}
    cache entry = (tokens, parent prefix id) -> prefix id    (ids from a counter, never reused)

The secret is 32 bytes of os.urandom drawn when the pool is made (so per process, and per
pool): no tenant can predict a hash, let alone craft one that collides with another tenant's
prefix (cf. vLLM CVE-2025-25183, where Python's `hash` made that possible). A lookup does not
trust the hash either: a block matches only if its own tokens and its parent's prefix id
match, so a hit always holds the same whole prefix, even under a forced collision. Prefix ids
are never reused: when a parent is evicted, its cached children become unreachable instead
of matching whatever block takes over the parent's id.
"""

from __future__ import annotations

import hashlib
import os
import struct
from collections import OrderedDict
from collections.abc import Sequence

_ROOT_PREFIX = 0  # the prefix id "parent" of every sequence's first block


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
        self.cached: dict[bytes, int] = {}  # block hash -> block id
        self.block_hash: list[bytes | None] = [None] * num_blocks  # set while in `cached`
        self.block_tokens: list[tuple[int, ...] | None] = [None] * num_blocks
        self.block_parent: list[int | None] = [None] * num_blocks  # parent's prefix id, if cached
        # The prefix id whose KV a block holds: set for cached blocks and for a request's own
        # copies of them (the same prefix computed twice); None for anything else.
        self.prefix_id: list[int | None] = [None] * num_blocks
        self._next_prefix_id = _ROOT_PREFIX + 1
        # A copy of a keyed hasher costs 0.65 us a block against 0.12 us for Python's `hash`
        # of a tuple: `tandem bench scheduler`, prefix cache on, went 0.164 -> 0.180 ms a
        # step at 256 running and 0.84 -> 0.89 ms at 1024 (interleaved runs, same load).
        self._hasher = hashlib.blake2b(key=os.urandom(32), digest_size=16)
        self._pack_block = struct.Struct(f"<{block_size}q").pack
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
                    self.prefix_id[b] = None  # a copy of a cached block: its KV is no one's now
                    self.free_uncached.append(b)
                else:
                    self.free_cached[b] = None

    def share(self, block_ids: Sequence[int]) -> None:
        """Take one more reference on blocks already in use: a forked choice shares its
        parent's prompt blocks (copy on write is the scheduler's: a block still being written
        is never shared, it is copied)."""
        ref = self.ref_cnt
        for b in block_ids:
            if ref[b] <= 0:
                raise RuntimeError(f"block {b} is shared but nobody holds it")
            ref[b] += 1

    def hash_block(self, parent_hash: bytes, token_ids: Sequence[int]) -> bytes:
        """The chained hash of one full block; the first block's parent is b"". The only
        hash in the pool, so tests can replace it to force collisions."""
        h = self._hasher.copy()
        h.update(parent_hash)
        h.update(self._pack_block(*token_ids))
        return h.digest()

    def extend_block_hashes(self, token_ids: Sequence[int], hashes: list[bytes]) -> None:
        """Append to `hashes` one chained hash per further full block of `token_ids`."""
        bs = self.block_size
        parent = hashes[-1] if hashes else b""
        for start in range(len(hashes) * bs, len(token_ids) - bs + 1, bs):
            parent = self.hash_block(parent, token_ids[start : start + bs])
            hashes.append(parent)

    def find_cached_prefix(self, block_hashes: Sequence[bytes], token_ids: Sequence[int]) -> list[int]:
        """Block ids of the longest cached prefix: each block's tokens and parent must match."""
        if not self.enable_prefix_caching:
            return []
        out: list[int] = []
        bs = self.block_size
        parent = _ROOT_PREFIX
        for i, h in enumerate(block_hashes):
            b = self.cached.get(h)
            if (
                b is None
                or self.block_parent[b] != parent
                or self.block_tokens[b] != tuple(token_ids[i * bs : (i + 1) * bs])
            ):
                break
            out.append(b)
            parent = self.prefix_id[b]
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

    def publish_blocks(
        self, token_ids: Sequence[int], block_ids: Sequence[int], hashes: list[bytes], start: int, end: int
    ) -> None:
        """Publish computed full blocks [start, end) of a sequence, extending its `hashes` as
        needed. Blocks [0, start) must have been published (or hit) by earlier calls."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        parent = self.prefix_id[block_ids[start - 1]] if start else _ROOT_PREFIX
        for i in range(start, end):
            if parent is None:
                return  # the chain broke at a block that could not be cached: nothing below can be
            tokens = tuple(token_ids[i * bs : (i + 1) * bs])
            if i == len(hashes):
                hashes.append(self.hash_block(hashes[-1] if hashes else b"", tokens))
            parent = self._publish(block_ids[i], hashes[i], tokens, parent)

    def _publish(self, block_id: int, block_hash: bytes, tokens: tuple[int, ...], parent: int) -> int | None:
        """Enter one computed block under `parent`; return the prefix id its KV holds, or None
        if it cannot be cached (its hash is held by a live block of another prefix)."""
        if self.block_hash[block_id] is not None:
            return self.prefix_id[block_id]  # a prefix-cache hit: already entered
        existing = self.cached.get(block_hash)
        if existing is not None:
            if self.block_parent[existing] == parent and self.block_tokens[existing] == tokens:
                # Another request computed the same prefix first: keep its block, share its id.
                pid = self.prefix_id[block_id] = self.prefix_id[existing]
                return pid
            if self.ref_cnt[existing]:
                return None  # a collision with a block in use: leave ours uncached
            # Unreferenced and not ours: a collision, or a child whose parent was evicted
            # (unreachable now). Drop it so the hash serves the live prefix.
            del self.free_cached[existing]
            self._evict(existing)
            self.free_uncached.append(existing)
        pid = self.prefix_id[block_id] = self._next_prefix_id
        self._next_prefix_id = pid + 1
        self.cached[block_hash] = block_id
        self.block_hash[block_id] = block_hash
        self.block_tokens[block_id] = tokens
        self.block_parent[block_id] = parent
        return pid

    def _evict(self, block_id: int) -> None:
        h = self.block_hash[block_id]
        if h is not None and self.cached.get(h) == block_id:
            del self.cached[h]
        self.block_hash[block_id] = None
        self.block_tokens[block_id] = None
        self.block_parent[block_id] = None
        self.prefix_id[block_id] = None
        self.num_evictions += 1

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
            assert self.prefix_id[b] is not None and self.block_parent[b] is not None, f"cached block {b} has no prefix"
        for b in self.free_cached:
            assert self.block_hash[b] is not None, f"block {b} in the cached free list has no hash"
        for b in self.free_uncached:
            assert self.block_hash[b] is None and self.prefix_id[b] is None, f"free block {b} still holds a prefix"
