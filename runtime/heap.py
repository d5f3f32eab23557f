"""A serving process's heap after start-up: frozen out of the garbage collector's full passes.

Loading a model leaves hundreds of thousands of long-lived objects (imports, the tokenizer, the
model's modules and parameters' wrappers, Celery's and FastAPI's machinery). CPython's full
(generation 2) collection traverses every tracked object, so each one took 180-280 ms in a
`tandem worker` serving SmolLM2, and it ran every so often while serving: one of them inside a
chat's first step made that chat's TTFT 330-430 ms against 80-120 ms for the same chats in other
rounds (BENCHMARKS.md, issue 31). `gc.freeze()` moves everything alive now into the permanent
generation, which collections skip; what serving creates is still collected as before. Call it
once the process is ready to serve, after the model is loaded.
"""

from __future__ import annotations

import gc


def freeze_startup_heap() -> int:
    """Collect once, then freeze the survivors (start-up garbage is not frozen with them);
    returns how many objects the collector now skips."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
