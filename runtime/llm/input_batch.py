"""The runner's per-request host arrays, kept between steps (the idea of vLLM's InputBatch).

Plans are diffs: a running request's block table and tokens arrive once and then grow by a
block or a token at a time. Each request the runner holds gets a row of preallocated numpy
arrays; a step writes only what changed (new blocks, the token it sampled) and reads the
rows of its decodes with a few vectorized numpy ops, instead of building block tables,
positions and slot lists from Python lists. The step's tensors are `torch.from_numpy` views
of those results (no copy on CPU; one host-to-device copy each on a GPU).
"""

from __future__ import annotations

import numpy as np


class InputBatch:
    def __init__(self, max_rows: int, max_model_len: int, block_size: int, pad_block: int) -> None:
        self.block_size = block_size
        self.pad_block = pad_block
        self.max_blocks = -(-max_model_len // block_size)
        self.max_model_len = max_model_len
        self.row_of: dict[str, int] = {}
        self._free: list[int] = []
        self._alloc(max(1, max_rows))

    def _alloc(self, rows: int) -> None:
        old = getattr(self, "block_table", None)
        # Unused entries point at the zeroed pad block, so a row sliced to a longer table than
        # its own reads zeros (see kernels/paged_attention.py).
        self.block_table = np.full((rows, self.max_blocks), self.pad_block, dtype=np.int64)
        self.num_blocks = np.zeros(rows, dtype=np.int64)
        start = 0
        if old is not None:
            start = old.shape[0]
            self.block_table[:start] = old
            self.num_blocks[:start] = self._old_num_blocks
        self._free.extend(range(rows - 1, start - 1, -1))

    def _grow(self) -> None:
        self._old_num_blocks = self.num_blocks
        self._alloc(2 * self.block_table.shape[0])

    def __len__(self) -> int:
        return len(self.row_of)

    def add(self, request_id: str, block_ids: list[int]) -> int:
        if request_id in self.row_of:
            self.remove(request_id)
        if not self._free:
            self._grow()
        row = self._free.pop()
        self.row_of[request_id] = row
        self.num_blocks[row] = 0
        self.append_blocks(row, block_ids)
        return row

    def remove(self, request_id: str) -> None:
        row = self.row_of.pop(request_id, None)
        if row is not None:
            self.block_table[row, : self.num_blocks[row]] = self.pad_block
            self.num_blocks[row] = 0
            self._free.append(row)

    def append_blocks(self, row: int, block_ids: list[int]) -> None:
        n = int(self.num_blocks[row])
        if n + len(block_ids) > self.max_blocks:
            raise RuntimeError(f"block table of row {row} would exceed {self.max_blocks} blocks (max_model_len)")
        self.block_table[row, n : n + len(block_ids)] = block_ids
        self.num_blocks[row] = n + len(block_ids)

    def trim_blocks(self, row: int, keep: int) -> None:
        """Cut the row's table back to its first `keep` blocks (speculation's rollback)."""
        n = int(self.num_blocks[row])
        if keep < n:
            self.block_table[row, keep:n] = self.pad_block
            self.num_blocks[row] = keep

    def decode_inputs(self, rows: np.ndarray, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(slot mapping [B], block tables [B, nblk]) of decode rows whose query sits at
        `positions`; nblk covers the longest context."""
        bs = self.block_size
        nblk = int(positions.max()) // bs + 1
        tables = self.block_table[rows, :nblk]
        slots = tables[np.arange(len(rows)), positions // bs] * bs + positions % bs
        return slots, tables
