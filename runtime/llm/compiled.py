"""A captured decode step: the model's decode-only forward compiled once by torch.compile.

Eager, a decode step dispatches some 400 small ops from Python (norms, RoPE, SiLU, residual
adds, views) beside its 121 matmuls; at small batch they cost as much as the matmuls. Inductor
fuses them into a few dozen C++ loops. The matmuls and attention stay opaque ops
(runtime/llm/graph_ops.py: the weights as eager holds them, packed or 4-bit, one copy), so one
graph spans all layers.

Shapes: one graph serves every batch. The batch size, the block-table width and the cache's
block count are marked dynamic at the first (warm-up) call; the runner pads a lone sequence to
two rows and a one-block table to two blocks, because torch specialises sizes 0 and 1.

Start-up: compiling a 30-layer model takes 35 s or more on two cores, so it runs on a
background thread (`start`) while the engine serves eagerly; the runner switches to the graph
once `ready` is set. Inductor's caches (FX graphs, AOT autograd, the C++ builds) live under
the Tandem cache folder (`<cache>/inductor/torch-<version>`; a user's own
TORCHINDUCTOR_CACHE_DIR wins), and their keys already hold the graph, the torch version, the
compiler and the CPU's vector ISA, so a second start of the same model and dtype on the same
machine loads the compiled code instead of building it. If the compile fails, the engine stays
eager, and `failed` says why.
"""

from __future__ import annotations

import logging
import os
import threading
import time

import torch

from runtime.llm import graph_ops
from runtime.llm.model import PackedLinear

log = logging.getLogger(__name__)


def inductor_cache_dir(cache_dir: str | None = None) -> str:
    root = cache_dir or os.environ.get("TANDEM_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "tandem")
    return os.path.join(root, "inductor", f"torch-{torch.__version__}")


def _use_cache_dir(path: str) -> None:
    """Point inductor at `path` unless the user chose a folder. Inductor writes its default
    (a temporary folder, gone at reboot) into the environment the first time it looks, so that
    value counts as unset."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    current = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if current is None or os.path.abspath(current) == os.path.abspath(default_cache_dir()):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = path


class CompiledDecode:
    """`model.forward_decode` under torch.compile, warmed up off the engine's thread."""

    def __init__(self, model, *, block_size: int, cache_dir: str | None = None) -> None:
        self.model = model
        self.block_size = block_size
        self.cache_dir = cache_dir
        # dynamic=False with sizes marked at the warm-up call: only those dimensions become
        # symbols, so the hidden sizes stay constants the C++ loops are specialised to.
        for m in model.modules():  # the matmuls enter the graph as eager runs them
            if isinstance(m, PackedLinear):
                m.graph_handle = graph_ops.register_linear(m)
        self._fn = torch.compile(model.forward_decode, fullgraph=True, dynamic=False)
        self.ready = threading.Event()  # set once the graph is compiled and checked
        self.done = threading.Event()  # set when the warm-up ends, ready or failed
        self.failed: str | None = None
        self.compile_seconds: float | None = None
        self._thread: threading.Thread | None = None
        self._closed = False
        self._threads = torch.get_num_threads()

    def close(self) -> None:
        """The runner let go (release_memory): a compile still running cannot be stopped, but it
        will not be marked ready, and it drops its model when it ends."""
        self._closed = True

    def start(self, background: bool = True) -> None:
        """Compile at a warm-up call on dummy inputs: on a daemon thread, or here and now."""
        _use_cache_dir(inductor_cache_dir(self.cache_dir))
        # torch's thread count is per thread (OpenMP's), and dynamo guards on it: the warm-up
        # thread takes the starting thread's, and __call__ runs at it, or every call would miss
        # the guard and recompile on the engine's thread.
        self._threads = torch.get_num_threads()
        if background:
            self._thread = threading.Thread(target=self._warm_up, name="tandem-compile", daemon=True)
            self._thread.start()
        else:
            self._warm_up()

    def _dummy_inputs(self) -> tuple[torch.Tensor, ...]:
        """Two sequences over a three-block cache of the real one's dtype, device and layout."""
        m = self.model
        s, bs = m.spec, self.block_size
        dev, dtype = m.cos.device, m.dtype
        kv = torch.zeros((s.num_layers, 2, 3, bs, s.num_kv_heads, s.head_dim), dtype=dtype, device=dev)
        ids = torch.zeros(2, dtype=torch.long, device=dev)
        pos = torch.tensor([0, 1], dtype=torch.long, device=dev)
        slots = torch.tensor([0, 1], dtype=torch.long, device=dev)
        tables = torch.zeros((2, 2), dtype=torch.int32, device=dev)
        ctx = torch.tensor([1, 2], dtype=torch.int32, device=dev)
        mask = torch.zeros((2, 1, 1, 2 * bs), dtype=dtype, device=dev)
        mask[0, ..., 1:] = float("-inf")
        mask[1, ..., 2:] = float("-inf")
        return ids, pos, kv, slots, tables, ctx, mask

    def _warm_up(self) -> None:
        t0 = time.perf_counter()
        try:
            torch.set_num_threads(self._threads)
            with torch.no_grad():
                logits = self(*self._dummy_inputs())
            if not bool(torch.isfinite(logits).all()):
                raise RuntimeError("the compiled decode step gave non-finite logits at warm-up")
            self.compile_seconds = time.perf_counter() - t0
            log.info("compiled the decode step in %.1f s", self.compile_seconds)
            if not self._closed:
                self.ready.set()
        except Exception as exc:  # noqa: BLE001  (any failure leaves the engine eager, never down)
            self.failed = f"{type(exc).__name__}: {exc}"
            log.warning("compiling the decode step failed, staying eager: %s", self.failed)
        finally:
            if self._closed:
                self.model = self._fn = None
            self.done.set()

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        mask: torch.Tensor,
    ) -> torch.Tensor:
        """LlamaModel.forward_decode's contract (B >= 2 rows, M >= 2 table columns)."""
        if torch.get_num_threads() != self._threads:
            torch.set_num_threads(self._threads)
        for t in (input_ids, positions, slot_mapping, block_tables, context_lens, mask):
            torch._dynamo.maybe_mark_dynamic(t, 0)
        torch._dynamo.maybe_mark_dynamic(block_tables, 1)
        torch._dynamo.maybe_mark_dynamic(mask, 3)
        torch._dynamo.maybe_mark_dynamic(kv_cache, 2)
        return self._fn(input_ids, positions, kv_cache, slot_mapping, block_tables, context_lens, mask)
