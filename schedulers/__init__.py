"""Scheduling policy: which requests run at each step. Pure Python; never imports torch."""

from schedulers.batch_queue import BatchQueue, QueueFullError
from schedulers.config import DynamicBatchConfig, SchedulerConfig
from schedulers.continuous import ContinuousBatchScheduler
from schedulers.dynamic import DynamicBatchScheduler
from schedulers.interface import BlockAllocator, Scheduler, SchedulerStats
from schedulers.plan import Batch, NewRequestData, StepOutputs, StepPlan, StepResult
from schedulers.request import Request, RequestStatus, StopCriteria
from schedulers.static import StaticBatchScheduler

__all__ = [
    "Batch",
    "BatchQueue",
    "BlockAllocator",
    "ContinuousBatchScheduler",
    "DynamicBatchConfig",
    "DynamicBatchScheduler",
    "NewRequestData",
    "QueueFullError",
    "Request",
    "RequestStatus",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerStats",
    "StaticBatchScheduler",
    "StepOutputs",
    "StepPlan",
    "StepResult",
    "StopCriteria",
]
