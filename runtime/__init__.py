"""Tandem's runtime: engines, runners and the device memory manager.

Heavy parts (torch, transformers, ultralytics) load on first use, so that importing
`runtime.memory` or the CLI's argument parser stays cheap.
"""

from __future__ import annotations

import importlib

_LAZY = {
    "LLM": "runtime.llm.api",
    "SamplingParams": "runtime.llm.sampling_params",
    "RequestOutput": "runtime.llm.outputs",
    "DeviceMemoryManager": "runtime.memory",
    "MemoryConfig": "runtime.memory",
}

__all__ = list(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'runtime' has no attribute {name!r}")
