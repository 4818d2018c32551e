"""
Retention: moved to `nasiko_queue.admin.retention` (issue #20, the package's
layout). This module keeps the documented path `nasiko_queue.retention` working.
"""

from .admin.retention import (
    BATCH_SIZE,
    parse_duration,
    prune,
)

__all__ = [
    "BATCH_SIZE",
    "parse_duration",
    "prune",
]
