"""DeviceMemoryManager: one byte budget per device, and every byte of it has an owner.

    budget (memory_utilization x device memory on CUDA, a configured size on CPU)
    ├── reservations, per owner instance: "vision.weights", "vision.batch_buffers",
    │   "llm.weights", "llm.activations", ... (a second vision engine on the same device
    │   reserves as "vision#2.weights": two engines never share a reservation by name)
    └── the rest: the KV block pool, carved into fixed-size blocks (runtime/block_pool.py)

An engine claims an instance name once (`claim("vision")`), reserves under it
(`reserve("vision.weights", n)`, additive) and gives everything back with one
`release("vision")`. The Runtime builds the vision path first, so the KV pool is sized from
what its measured peak leaves.

Importing this module does not import torch; it asks torch for device memory only when the
budget is not given and the device is CUDA.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from runtime.block_pool import BlockPool

DEFAULT_CPU_BUDGET_BYTES = 2 * 1024**3


@dataclass(slots=True)
class MemoryConfig:
    device: str = "cpu"
    budget_bytes: int | None = None  # required meaning on CPU; on CUDA overrides the fraction
    memory_utilization: float = 0.9  # fraction of the device's memory on CUDA

    def __post_init__(self) -> None:
        if self.budget_bytes is not None and (not isinstance(self.budget_bytes, int) or self.budget_bytes <= 0):
            raise ValueError(f"budget_bytes must be a positive integer, got {self.budget_bytes!r}")
        if not 0.0 < self.memory_utilization <= 1.0:
            raise ValueError(f"memory_utilization must be in (0, 1], got {self.memory_utilization!r}")


class DeviceMemoryManager:
    KV_OWNER = "llm.kv_cache"

    def __init__(self, config: MemoryConfig | None = None) -> None:
        self.config = config or MemoryConfig()
        self.total_bytes = self._budget(self.config)
        self._reservations: dict[str, int] = {}
        self._claimed: set[str] = set()
        self._lock = threading.Lock()  # vision and LLM paths may reserve from different threads
        self.kv_pool: BlockPool | None = None
        self.kv_owner: str | None = None
        self.kv_bytes_per_block = 0

    @staticmethod
    def _budget(config: MemoryConfig) -> int:
        if config.budget_bytes is not None:
            return config.budget_bytes
        if config.device.startswith("cuda"):
            import torch

            _, total = torch.cuda.mem_get_info(torch.device(config.device))
            return int(total * config.memory_utilization)
        return DEFAULT_CPU_BUDGET_BYTES

    @property
    def reserved_bytes(self) -> int:
        return sum(self._reservations.values())

    @property
    def free_bytes(self) -> int:
        return self.total_bytes - self.reserved_bytes

    def claim(self, kind: str) -> str:
        """A name for one engine instance of `kind` ("vision", then "vision#2", ...), so that
        two engines on one device never add to or release each other's reservations."""
        if not kind or "." in kind:
            raise ValueError(f"kind must be a non-empty name without '.', got {kind!r}")
        with self._lock:
            name, n = kind, 1
            while name in self._claimed:
                n += 1
                name = f"{kind}#{n}"
            self._claimed.add(name)
            return name

    def reserve(self, owner: str, num_bytes: int) -> None:
        """Add `num_bytes` to `owner`'s reservation; MemoryError (naming every owner) if the
        budget cannot hold it, and then nothing changes."""
        if not isinstance(num_bytes, int) or num_bytes < 0:
            raise ValueError(f"num_bytes must be an integer >= 0, got {num_bytes!r}")
        with self._lock:
            if num_bytes > self.free_bytes:
                raise MemoryError(
                    f"cannot reserve {num_bytes / 2**20:.1f} MiB more for {owner!r}: "
                    f"{self.free_bytes / 2**20:.1f} MiB free of {self.total_bytes / 2**20:.1f} MiB "
                    f"({self._describe()})"
                )
            self._reservations[owner] = self._reservations.get(owner, 0) + num_bytes

    def release(self, owner: str) -> int:
        """Give back `owner`'s reservation and those below it ("vision" releases
        "vision.weights" too, not "vision#2.weights"); returns the bytes freed. Releasing the
        KV pool's owner drops the pool. An instance name claimed with `claim` is free again."""
        with self._lock:
            names = [k for k in self._reservations if k == owner or k.startswith(owner + ".")]
            if self.kv_pool is not None and self.kv_owner in names:
                self.kv_pool = None
                self.kv_owner = None
            self._claimed.discard(owner)
            return sum(self._reservations.pop(k) for k in names)

    def create_kv_pool(
        self,
        bytes_per_block: int,
        block_size: int,
        num_blocks: int | None = None,
        enable_prefix_caching: bool = True,
        owner: str = KV_OWNER,
    ) -> BlockPool:
        """Turn the unreserved rest of the budget (or exactly `num_blocks`) into KV blocks,
        reserved under `owner` (the LLM engine passes "<its instance>.kv_cache")."""
        if bytes_per_block <= 0:
            raise ValueError(f"bytes_per_block must be > 0, got {bytes_per_block}")
        if self.kv_pool is not None:
            raise RuntimeError("this device already has a KV pool; release it first")
        if num_blocks is None:
            num_blocks = self.free_bytes // bytes_per_block
        if num_blocks < 1:
            raise MemoryError(
                f"no room for a single KV block of {bytes_per_block} bytes: "
                f"{self.free_bytes} bytes free ({self._describe()})"
            )
        self.reserve(owner, num_blocks * bytes_per_block)
        self.kv_owner = owner
        self.kv_bytes_per_block = bytes_per_block
        self.kv_pool = BlockPool(num_blocks, block_size, enable_prefix_caching)
        return self.kv_pool

    def stats(self) -> dict:
        """Bytes by owner, and the KV pool's block counts."""
        out = {
            "total_bytes": self.total_bytes,
            "reserved_bytes": self.reserved_bytes,
            "free_bytes": self.free_bytes,
            "owners": dict(self._reservations),
        }
        pool = self.kv_pool
        if pool is not None:
            out["kv_blocks"] = {
                "total": pool.num_blocks,
                "free": pool.num_free_blocks,
                "used": pool.num_used_blocks,
                "cached_free": len(pool.free_cached),
                "block_size": pool.block_size,
                "bytes_per_block": self.kv_bytes_per_block,
                "prefix_cache_hits": pool.num_cache_hits,
                "evictions": pool.num_evictions,
            }
        return out

    def _describe(self) -> str:
        return ", ".join(f"{k}={v / 2**20:.1f} MiB" for k, v in self._reservations.items()) or "nothing reserved"
