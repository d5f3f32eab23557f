"""Native thread pools are process-wide and settled by their first user.

oneDNN (behind torch's CPU convolutions and prepacked linears) sizes itself on first use, from
the OpenMP thread count of the thread that gets there first. The vision engine runs its model
on single-threaded worker threads; if one of those were first, every later oneDNN call in the
process (an LLM's decode step included) would run as if on one core: measured, a 16-sequence
SmolLM2 decode step went from 99 ms to 175 ms, and stayed there after the vision engine closed.
So each engine calls `settle_native_pools()` on its caller's thread before starting any of its
own threads.
"""

from __future__ import annotations

import threading

_lock = threading.Lock()
_settled = False


def settle_native_pools() -> None:
    """Touch oneDNN's convolution and linear paths once, on this thread and at its thread count."""
    global _settled
    with _lock:
        if _settled:
            return
        import torch

        with torch.inference_mode():
            torch.nn.functional.conv2d(torch.ones(1, 3, 8, 8), torch.ones(4, 3, 3, 3))
            if torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
                w = torch.ops.mkldnn._reorder_linear_weight(torch.ones(8, 8), 1)
                torch.ops.mkldnn._linear_pointwise(torch.ones(1, 8), w, None, "none", [], "")
        _settled = True


def run_in_thread(fn, threads: int | None, name: str = "tandem-setup"):
    """fn() on a fresh thread with `threads` torch threads: the caller's thread count stays
    its own, and with 1 thread no OpenMP pool is created."""
    out: dict = {}

    def run() -> None:
        if threads is not None:
            import torch

            torch.set_num_threads(threads)
        try:
            out["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised on the caller's thread
            out["error"] = exc

    t = threading.Thread(target=run, name=name)
    t.start()
    t.join()
    if "error" in out:
        raise out["error"]
    return out["value"]
