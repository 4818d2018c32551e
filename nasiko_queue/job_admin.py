"""
Job listings and dead letters: moved to `nasiko_queue.admin.jobs` (issue #20, the package's
layout). This module keeps the documented path `nasiko_queue.job_admin` working.
"""

from .admin.jobs import (
    BUILDS_QUEUE,
    DEFAULT_LIMIT,
    DEFAULT_STATE,
    FINISHED_STATES,
    STATES,
    BulkResult,
    JobFilter,
    JobNotFound,
    JobRefused,
    JobSummary,
    cancel,
    count_jobs,
    count_matching,
    discard,
    discard_matching,
    list_jobs,
    pause_queue,
    paused_queues,
    resume_queue,
    retry,
    retry_matching,
)

__all__ = [
    "BUILDS_QUEUE",
    "DEFAULT_LIMIT",
    "DEFAULT_STATE",
    "FINISHED_STATES",
    "STATES",
    "BulkResult",
    "JobFilter",
    "JobNotFound",
    "JobRefused",
    "JobSummary",
    "cancel",
    "count_jobs",
    "count_matching",
    "discard",
    "discard_matching",
    "list_jobs",
    "pause_queue",
    "paused_queues",
    "resume_queue",
    "retry",
    "retry_matching",
]
