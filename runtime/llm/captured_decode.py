"""The runner's decode-only steps through a captured graph (enforce_eager=False): on CPU one
torch.compile graph (runtime/llm/compiled.py), compiled on a background thread while steps run
eagerly and used once it is ready; on CUDA one CUDA graph per batch bucket
(runtime/llm/cuda_graphs.py), captured at start. A mixin of ModelRunner, whose state it reads
(model, KV cache, input batch, the sampling step); steps with a prefill chunk stay eager.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from kernels.paged_attention import decode_mask
from schedulers.plan import StepPlan, StepResult

log = logging.getLogger(__name__)


class CapturedDecode:
    def _capture_cuda_graphs(self) -> None:
        """CUDA: capture one decode graph per batch bucket, now, over the KV cache just made. A
        capture that fails leaves the runner eager, not down."""
        from runtime.llm.cuda_graphs import CudaGraphDecode

        self.cuda_graphs = CudaGraphDecode(
            self.model,
            self.kv_cache,
            max_num_seqs=self._max_num_seqs,
            max_blocks=-(-self.max_model_len // self.block_size),
            pad_block=self.pad_block,
        )
        try:
            self.cuda_graphs.capture()
        except Exception as exc:  # noqa: BLE001 - a failed capture leaves the engine eager, not down
            log.warning("capturing CUDA graphs failed, staying eager: %s: %s", type(exc).__name__, exc)
            self.cuda_graphs = None
            torch.cuda.synchronize(self.device)

    def _start_compiled_decode(self, cache_dir: str | None, in_background: bool) -> None:
        """CPU: start compiling the decode step with torch.compile (on a background thread
        unless told otherwise); steps stay eager until it is ready."""
        from runtime.llm.compiled import CompiledDecode

        self.graph = CompiledDecode(self.model, block_size=self.block_size, cache_dir=cache_dir)
        self.graph.start(background=in_background)

    def _graph_ready(self) -> bool:
        g = self.graph
        if g is None or not g.done.is_set():
            return False
        if g.failed is not None:  # stay eager for good
            self.graph = None
            return False
        return True

    def _execute_graph(self, plan: StepPlan, states, decodes: list[int], failed: dict[str, str]) -> StepResult:
        """A decode-only step through the captured graph; None if the graph raised (it is then
        dropped for good, and the caller runs the step eagerly: rewriting the same K/V slots is
        harmless). The graph takes at least two rows and two table columns (sizes 0 and 1 are
        specialised by torch): a lone sequence gets a padding row, whose K/V write is skipped
        (slot -1) and which is never sampled."""
        bs, pad = self.block_size, self.pad_block
        ids, pos, slots, tables = self._decode_arrays(plan, states, decodes)
        n = len(decodes)
        b, m = max(n, 2), max(tables.shape[1], 2)
        table = np.full((b, m), pad, dtype=np.int32)
        table[:n, : tables.shape[1]] = tables
        if b > n:
            ids.append(0)
            pos = np.append(pos, 0)
            slots = np.append(slots, -1)
        ctx = (pos + 1).astype(np.int32)
        dev = self.device
        # Inputs made outside inference mode: the graph writes the cache in place, which
        # torch refuses to do beside inference tensors ("Cannot set version_counter").
        with torch.inference_mode(False), torch.no_grad():
            ctx_t = torch.from_numpy(ctx)
            try:
                logits = self._run_graph(
                    torch.tensor(ids, dtype=torch.long, device=dev),
                    torch.from_numpy(pos).to(dev),
                    self.kv_cache,
                    torch.from_numpy(slots).to(dev),
                    torch.from_numpy(table).to(dev),
                    ctx_t.to(dev),
                    decode_mask(ctx_t, m * bs, self.dtype).to(dev),
                )
            except Exception as exc:  # noqa: BLE001 - the graph's failure must not fail the step
                log.warning("the captured decode step failed, staying eager: %s: %s", type(exc).__name__, exc)
                self.graph.failed = f"{type(exc).__name__}: {exc}"
                self.graph = None
                return None
        return self._sample_decodes(plan, states, decodes, logits, failed)

    def _run_graph(self, *inputs: torch.Tensor) -> torch.Tensor:
        return self.graph(*inputs)

    def _decode_arrays(self, plan: StepPlan, states, decodes: list[int]):
        """(token ids, positions, slots, block tables) of the decode rows, host-side."""
        num_computed, batch = plan.num_computed_tokens, self.batch
        n = len(decodes)
        pos = np.fromiter((num_computed[i] for i in decodes), dtype=np.int64, count=n)
        rows = np.fromiter((batch.row_of[plan.req_ids[i]] for i in decodes), dtype=np.int64, count=n)
        ids = [states[i].token_ids[num_computed[i]] for i in decodes]
        slots, tables = batch.decode_inputs(rows, pos)
        return ids, pos, slots, tables

    def _execute_cuda_graph(self, plan: StepPlan, states, decodes: list[int], failed: dict[str, str]) -> StepResult:
        logits = self.cuda_graphs(*self._decode_arrays(plan, states, decodes))
        return self._sample_decodes(plan, states, decodes, logits, failed)

    def _sample_decodes(self, plan: StepPlan, states, decodes: list[int], logits, failed) -> StepResult:
        """Sample a graph's logits [len(decodes), vocab] for the decode rows that sample."""
        n = len(decodes)
        self.num_graph_steps += 1
        keep = [k for k, i in enumerate(decodes) if plan.sample[i]]
        logits = logits[:n] if len(keep) == n else logits[keep] if keep else None
        self.last_logits = logits
        return self._sample(plan, states, [decodes[k] for k in keep], logits, failed)
