"""The prefix cache's safety with many tenants: keyed hashes that differ per pool, and hits
that need the whole prefix to match, so that no hash collision (forced here by replacing
the hash) ever hands a request a block computed after other tokens."""

from __future__ import annotations

import os
import random

import pytest
from scheduler_harness import KVRunner, drive, token_at

from runtime.block_pool import BlockPool
from schedulers import ContinuousBatchScheduler, Request, SchedulerConfig, StopCriteria

A, B, Z, W = [1, 2], [3, 4], [5, 6], [7, 8]  # blocks of block_size 2


def compute(pool: BlockPool, tokens: list[int]) -> list[int]:
    """Allocate, 'compute' and publish the full blocks of `tokens`, as a request would;
    the blocks stay referenced, like a request still running."""
    n = len(tokens) // pool.block_size
    blocks = pool.allocate(n)
    pool.publish_blocks(tokens, blocks, [], 0, n)
    return blocks


def lookup(pool: BlockPool, tokens: list[int]) -> list[int]:
    hashes: list[bytes] = []
    pool.extend_block_hashes(tokens, hashes)
    return pool.find_cached_prefix(hashes, tokens)


def constant_hash(parent: bytes, token_ids) -> bytes:
    return b"\0" * 16  # every block collides with every other


def parent_blind_hash(parent: bytes, token_ids) -> bytes:
    return repr(tuple(token_ids)).encode()  # equal blocks collide whatever precedes them


def test_different_prefixes_ending_in_the_same_block_never_share_it():
    pool = BlockPool(16, 2)
    x = compute(pool, A + Z)
    y = compute(pool, B + Z)
    assert lookup(pool, B + Z) == y  # its own Z, computed after B
    assert lookup(pool, A + Z) == x
    assert lookup(pool, W + Z) == []
    pool.free(x)
    pool.free(y)
    assert lookup(pool, B + Z) == y and lookup(pool, A + Z) == x  # still so once cached-free
    pool.check_invariants()


def test_forced_constant_hash_never_hands_out_a_wrong_block():
    pool = BlockPool(8, 2)
    pool.hash_block = constant_hash
    first = compute(pool, A)
    # A repeated: the second A has the same tokens and hash but follows A, not the start.
    assert lookup(pool, A + A) == first
    assert lookup(pool, B + A) == []
    held = compute(pool, B + A)  # collides with `first`, which is in use: stays uncached
    assert lookup(pool, B + A) == [] and lookup(pool, A + A) == first
    pool.free(held)
    pool.check_invariants()


def test_forced_parent_blind_hash_never_files_a_block_under_another_prefix():
    pool = BlockPool(16, 2)
    pool.hash_block = parent_blind_hash
    x = compute(pool, A + Z)  # still running: its blocks stay in use
    y = compute(pool, B + Z + W)  # y's Z collides with x's; y's W was computed after B, Z
    assert lookup(pool, B + Z + W) == y[:1]  # B hits, then x's Z must not (it follows A)
    assert lookup(pool, A + Z + W) == x  # and y's W must not extend x's prefix
    pool.check_invariants()


def test_block_id_reused_after_eviction_does_not_adopt_the_evicted_blocks_children():
    pool = BlockPool(3, 2)
    pool.hash_block = parent_blind_hash  # so only the parent check tells prefixes apart
    x = compute(pool, A + Z)
    pool.free(x)
    pool.free_cached.move_to_end(x[1])  # make the parent, A, the least recently used
    other = pool.allocate(2)  # the never-used block, then A's block, evicted
    assert other[1] == x[0] and lookup(pool, A + Z) == []
    pool.publish_blocks(B, [x[0]], [], 0, 1)  # A's old block id now holds B
    assert lookup(pool, B + Z) == [x[0]]  # x's Z is still cached, but it followed A, not B
    pool.free(other)
    pool.check_invariants()


def test_stale_child_of_an_evicted_parent_gives_way_when_its_prefix_is_computed_again():
    pool = BlockPool(3, 2)
    x = compute(pool, A + Z)
    pool.free(x)
    pool.free_cached.move_to_end(x[1])  # make the parent, A, the least recently used
    pool.free(pool.allocate(2))  # evicts A; x's Z stays cached, unreachable
    assert lookup(pool, A + Z) == []
    again = compute(pool, A + Z)
    assert x[1] not in again and lookup(pool, A + Z) == again  # the stale Z made room
    pool.check_invariants()


def test_hash_key_is_random_per_pool(monkeypatch):
    first, second = BlockPool(4, 2), BlockPool(4, 2)
    digest = first.hash_block(b"", A)
    assert len(digest) == 16 and digest == first.hash_block(b"", A)
    assert digest != second.hash_block(b"", A), "two pools must not share a hash key"
    # The key comes from os.urandom: fixing it makes two pools agree.
    monkeypatch.setattr(os, "urandom", lambda n: b"k" * n)
    assert BlockPool(4, 2).hash_block(b"", A) == BlockPool(4, 2).hash_block(b"", A)


@pytest.mark.parametrize("forced_hash", [None, constant_hash, parent_blind_hash])
@pytest.mark.parametrize("seed", [0, 1])
def test_random_workload_only_ever_reads_kv_of_its_own_prefix(forced_hash, seed):
    """Prompts drawn from a few blocks, so the same block recurs after many prefixes; the KV
    runner fails the step any request reads a slot computed after another prefix."""
    rng = random.Random(seed)
    bs = 2
    pool = BlockPool(40, bs)
    if forced_hash is not None:
        pool.hash_block = forced_hash
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64)
    sched = ContinuousBatchScheduler(config, pool)
    pieces = [A, B, Z]
    expected = {}
    for i in range(40):
        prompt = [t for _ in range(rng.randrange(1, 6)) for t in rng.choice(pieces)] + [rng.randrange(9, 50)]
        max_tokens = rng.randrange(1, 6)
        sched.add_request(Request(f"q{i}", prompt, StopCriteria(max_tokens=max_tokens), arrival_time=i))
        expected[f"q{i}"] = (len(prompt), max_tokens)
    _, tokens, _ = drive(sched, KVRunner())
    for rid, (n_prompt, m) in expected.items():
        assert tokens[rid] == [token_at(rid, n_prompt + k) for k in range(m)]
    if forced_hash is None:
        assert pool.num_cache_hits > 20  # the check above had hits to check
