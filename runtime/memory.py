"""DeviceMemoryManager: one byte budget per device, and every byte of it has an owner.

    budget (memory_utilization x device memory on CUDA, a configured size on CPU)
    ├── reservations: "llm.weights", "llm.activations", "vision.batch_buffers", ...
    └── the rest: the KV block pool, carved into fixed-size blocks (runtime/block_pool.py)

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
        self._lock = threading.Lock()  # vision and LLM paths may reserve from different threads
        self.kv_pool: BlockPool | None = None
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

    def reserve(self, owner: str, num_bytes: int) -> None:
        """Take `num_bytes` for `owner` (growing an existing reservation to that size)."""
        if num_bytes < 0:
            raise ValueError(f"num_bytes must be >= 0, got {num_bytes}")
        with self._lock:
            extra = num_bytes - self._reservations.get(owner, 0)
            if extra > self.free_bytes:
                raise MemoryError(
                    f"cannot reserve {num_bytes / 2**20:.1f} MiB for {owner!r}: "
                    f"{self.free_bytes / 2**20:.1f} MiB free of {self.total_bytes / 2**20:.1f} MiB "
                    f"({self._describe()})"
                )
            self._reservations[owner] = num_bytes

    def release(self, owner: str) -> None:
        with self._lock:
            if owner == self.KV_OWNER:
                self.kv_pool = None
            self._reservations.pop(owner, None)

    def create_kv_pool(
        self,
        bytes_per_block: int,
        block_size: int,
        num_blocks: int | None = None,
        enable_prefix_caching: bool = True,
    ) -> BlockPool:
        """Turn the unreserved rest of the budget (or exactly `num_blocks`) into KV blocks."""
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
        self.reserve(self.KV_OWNER, num_blocks * bytes_per_block)
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
