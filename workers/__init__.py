"""Celery workers on Redis and the LLM text-job queue API.

    from workers import JobClient          # submit / status / result / stream / cancel
    celery -A workers.app worker -P threads -Q llm,vision    # or: tandem worker

Importing this package loads neither Celery nor torch; each name loads on first use.
"""

from __future__ import annotations

from runtime.lazy import lazy_getattr

_LAZY = {
    "JobClient": "workers.client",
    "JobError": "workers.client",
    "JobCancelledError": "workers.client",
    "JobNotFoundError": "workers.client",
    "JobSettings": "workers.settings",
}

__all__ = list(_LAZY)
__getattr__ = lazy_getattr("workers", _LAZY)
