"""DeviceMemoryManager: one budget, owners for every byte, the KV pool from what is left."""

from __future__ import annotations

import pytest

from runtime.memory import DeviceMemoryManager, MemoryConfig


def test_reservations_and_kv_pool_take_the_rest():
    mm = DeviceMemoryManager(MemoryConfig(budget_bytes=10_000))
    mm.reserve("llm.weights", 3_000)
    mm.reserve("vision.batch_buffers", 1_000)
    pool = mm.create_kv_pool(bytes_per_block=500, block_size=16)
    assert pool.num_blocks == 12  # 6,000 bytes left / 500
    stats = mm.stats()
    assert stats["owners"] == {"llm.weights": 3_000, "vision.batch_buffers": 1_000, "llm.kv_cache": 6_000}
    assert stats["free_bytes"] == 0 and stats["kv_blocks"]["total"] == 12
    assert stats["reserved_bytes"] + stats["free_bytes"] == stats["total_bytes"]


def test_over_reservation_is_refused_with_owners_named():
    mm = DeviceMemoryManager(MemoryConfig(budget_bytes=2 * 2**20))
    mm.reserve("llm.weights", 2**20)
    with pytest.raises(MemoryError, match="llm.weights=1.0 MiB"):
        mm.reserve("vision.activations", 2 * 2**20)
    mm.reserve("llm.weights", 2**20)  # reservations add up: one's own to the whole budget is fine
    assert mm.stats()["owners"] == {"llm.weights": 2 * 2**20}
    assert mm.release("llm.weights") == 2 * 2**20
    assert mm.free_bytes == 2 * 2**20


def test_owner_instances_never_share_a_reservation():
    mm = DeviceMemoryManager(MemoryConfig(budget_bytes=10_000))
    first, second = mm.claim("vision"), mm.claim("vision")
    assert (first, second) == ("vision", "vision#2")
    mm.reserve(f"{first}.weights", 1_000)
    mm.reserve(f"{second}.weights", 2_000)
    mm.reserve(f"{second}.activations", 500)
    assert mm.stats()["owners"] == {"vision.weights": 1_000, "vision#2.weights": 2_000, "vision#2.activations": 500}
    assert mm.release(second) == 2_500  # the instance and everything below it, nothing of the other
    assert mm.stats()["owners"] == {"vision.weights": 1_000}
    assert mm.claim("vision") == "vision#2"  # a released instance name is free again
    llm = mm.claim("llm")
    pool = mm.create_kv_pool(bytes_per_block=1_000, block_size=16, owner=f"{llm}.kv_cache")
    assert pool.num_blocks == 9 and mm.kv_pool is pool
    mm.release(llm)
    assert mm.kv_pool is None and mm.free_bytes == 9_000
    with pytest.raises(ValueError, match="kind"):
        mm.claim("a.b")


def test_kv_pool_with_explicit_block_count_and_errors():
    mm = DeviceMemoryManager(MemoryConfig(budget_bytes=1_000))
    with pytest.raises(MemoryError, match="no room for a single KV block"):
        mm.create_kv_pool(bytes_per_block=2_000, block_size=16)
    pool = mm.create_kv_pool(bytes_per_block=100, block_size=16, num_blocks=4)
    assert pool.num_blocks == 4 and mm.free_bytes == 600
    with pytest.raises(RuntimeError, match="already has a KV pool"):
        mm.create_kv_pool(bytes_per_block=100, block_size=16)
    with pytest.raises(ValueError, match="budget_bytes"):
        MemoryConfig(budget_bytes=0)
    with pytest.raises(ValueError, match="memory_utilization"):
        MemoryConfig(memory_utilization=1.5)


def test_block_pool_books_balance_and_double_free_is_caught():
    mm = DeviceMemoryManager(MemoryConfig(budget_bytes=1_000))
    pool = mm.create_kv_pool(bytes_per_block=100, block_size=4)
    a = pool.allocate(3)
    assert pool.allocate(8) is None  # all or nothing
    assert pool.num_used_blocks == 3 and pool.num_free_blocks == 7
    pool.free(a)
    pool.check_invariants()
    with pytest.raises(RuntimeError, match="freed twice"):
        pool.free(a[:1])
