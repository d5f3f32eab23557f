"""Import Ultralytics without its process-wide side effect.

On import, `ultralytics/__init__.py` sets OMP_NUM_THREADS=1 when it is unset (a default meant
for training data loaders). PyTorch reads that variable lazily, when the process first needs its
intra-op thread count (and Ultralytics' own import gets there), so a process that imported
Ultralytics first would run every torch op single-threaded, the LLM path's included (measured: a 16-sequence decode
step went from 127 ms to 226 ms). Every import of Ultralytics in Tandem goes through here.
"""

from __future__ import annotations

import os
import types


def import_ultralytics() -> types.ModuleType:
    """The `ultralytics` module, imported with the caller's OMP_NUM_THREADS left as it was."""
    import torch

    torch.get_num_threads()  # settle torch's thread count from the environment as it is now
    had = os.environ.get("OMP_NUM_THREADS")
    import ultralytics

    if had is None:
        os.environ.pop("OMP_NUM_THREADS", None)
    else:
        os.environ["OMP_NUM_THREADS"] = had
    return ultralytics
