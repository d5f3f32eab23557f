"""Tandem's runtime: engines, runners and the device memory manager.

Heavy parts (torch, transformers, ultralytics) load on first use, so that importing
`runtime.memory` or the CLI's argument parser stays cheap.
"""

from __future__ import annotations

from runtime.lazy import lazy_getattr

_LAZY = {
    "LLM": "runtime.llm.api",
    "SamplingParams": "runtime.llm.sampling_params",
    "RequestOutput": "runtime.llm.outputs",
    "DeviceMemoryManager": "runtime.memory",
    "MemoryConfig": "runtime.memory",
    "Runtime": "runtime.runtime",
    "GenerationHandle": "runtime.handles",
    "RequestError": "runtime.handles",
    "DeadlineExceededError": "runtime.handles",
    "RuntimeClosedError": "runtime.handles",
}

__all__ = list(_LAZY)
__getattr__ = lazy_getattr("runtime", _LAZY)
