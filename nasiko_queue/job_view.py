"""
One job's view: moved to `nasiko_queue.admin.view` (issue #20, the package's
layout). This module keeps the documented path `nasiko_queue.job_view` working.
"""

from .admin.view import (
    BUILD_STATES,
    JobView,
    job_view,
    mask_payload,
)

__all__ = [
    "BUILD_STATES",
    "JobView",
    "job_view",
    "mask_payload",
]
