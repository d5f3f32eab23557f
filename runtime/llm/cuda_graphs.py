"""Captured decode steps on CUDA: one CUDA graph per batch-size bucket over persistent inputs.

An eager decode step launches some 400 kernels from Python; at small batch the GPU waits on
the launches, not on the math. A CUDA graph replays the whole step (the Triton attention
kernels inside it, through the same tandem::decode_attention op the CPU graph uses) with one
launch. A graph's shapes and addresses are fixed at capture, so the step's inputs live in
buffers allocated once at the largest bucket, and a step of n sequences runs the smallest
bucket b >= n with rows n..b-1 as padding: token 0 at position 0, slot -1 (the Triton write
skips it, so the pad block stays zero), attending to one key of the pad block. Block tables
are captured at full width (max_model_len / block_size); the kernel stops at each sequence's
context length, so stale entries past it are never read.

The buckets are 1, 2, 4, ... up to max_num_seqs (and max_num_seqs itself), as vLLM and
nano-vllm capture them; all graphs share one memory pool, captured largest first.

Not run on a GPU in this project yet: benchmarks/gpu_engine.py is the check to run when one is
lent (BENCHMARKS.md says what it printed).
"""

from __future__ import annotations

import numpy as np
import torch

from runtime.llm import graph_ops  # noqa: F401  (registers tandem::decode_attention)


def buckets(max_num_seqs: int) -> list[int]:
    out, b = [], 1
    while b < max_num_seqs:
        out.append(b)
        b *= 2
    return [*out, max_num_seqs]


class CudaGraphDecode:
    def __init__(self, model, kv_cache: torch.Tensor, *, max_num_seqs: int, max_blocks: int, pad_block: int) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = kv_cache.shape[3]
        self.pad_block = pad_block
        self.buckets = buckets(max_num_seqs)
        dev = kv_cache.device
        n = self.buckets[-1]
        self.pad_slot = -1  # skipped by the K/V write
        self.ids = torch.zeros(n, dtype=torch.long, device=dev)
        self.pos = torch.zeros(n, dtype=torch.long, device=dev)
        self.slots = torch.full((n,), self.pad_slot, dtype=torch.long, device=dev)
        self.tables = torch.full((n, max_blocks), pad_block, dtype=torch.int32, device=dev)
        self.ctx = torch.ones(n, dtype=torch.int32, device=dev)
        self.mask = torch.zeros((1, 1, 1, 1), dtype=model.dtype, device=dev)  # the CUDA path reads no mask
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    def _forward(self, b: int) -> torch.Tensor:
        return self.model.forward_decode(
            self.ids[:b], self.pos[:b], self.kv_cache, self.slots[:b], self.tables[:b], self.ctx[:b], self.mask
        )

    @torch.no_grad()
    def capture(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        for b in reversed(self.buckets):
            self._forward(b)  # compiles the Triton kernels and settles the allocator outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            # thread_local: CUDA work another thread issues meanwhile (a vision engine) does not
            # invalidate this capture.
            with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                self.outputs[b] = self._forward(b)
            self.graphs[b] = graph
        torch.cuda.synchronize()

    def __call__(self, ids: list[int], pos: np.ndarray, slots: np.ndarray, tables: np.ndarray) -> torch.Tensor:
        """Float32 logits [n, vocab] of the n decode rows given (a view into the graph's output:
        valid until the next step)."""
        n, w = tables.shape
        if n > self.buckets[-1]:
            raise ValueError(f"{n} decode rows exceed the largest captured bucket ({self.buckets[-1]})")
        b = next(x for x in self.buckets if x >= n)
        self.ids[:n].copy_(torch.tensor(ids, dtype=torch.long))
        self.pos[:n].copy_(torch.from_numpy(pos))
        self.slots[:n].copy_(torch.from_numpy(slots))
        self.tables[:n, :w].copy_(torch.from_numpy(tables.astype(np.int32)))
        self.ctx[:n].copy_(torch.from_numpy((pos + 1).astype(np.int32)))
        if b > n:  # padding rows: see the module docstring
            self.ids[n:b].zero_()
            self.pos[n:b].zero_()
            self.slots[n:b].fill_(self.pad_slot)
            self.tables[n:b, :1].fill_(self.pad_block)
            self.ctx[n:b].fill_(1)
        self.graphs[b].replay()
        return self.outputs[b][:n]
