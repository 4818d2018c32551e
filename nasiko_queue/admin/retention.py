"""
Retention: delete finished jobs older than a given age, in small batches.

The queue table keeps every done and failed job (docs/rules.md §1: the row is the job's
history). Left alone, a year of history is millions of rows; the claim stays
fast (it reads the partial index of pending jobs only), but the table, its
backups and `status` grow without bound. `prune` deletes done/failed rows whose
`completed_at` is older than `older_than`, `batch_size` rows per statement and
transaction, so that no single delete holds many row locks or writes a burst of
WAL, and concurrent claims and finishes are never blocked for long. Pending and
in_progress rows are never touched.

Run it from the CLI (`nasiko-queue prune --older-than 30d`), from your own
scheduler, or let the worker do it: `QueueConfig(retention=timedelta(days=30))`
makes each recovery tick prune as well.
"""

from __future__ import annotations

import logging
import re
from datetime import timedelta

from ..db.database import Database
from ..db.statements import Q

log = logging.getLogger("nasiko_queue.retention")

#: Rows deleted per statement.
BATCH_SIZE = 1000

_UNITS = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days", "w": "weeks"}
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw])\s*$", re.IGNORECASE)


#: The longest duration `parse_duration` takes.
MAX_DURATION = timedelta(days=36525)


def parse_duration(text: str) -> timedelta:
    """
    ``30d``, ``12h``, ``90m``, ``45s``, ``2w`` (one number, one unit) as a timedelta.

    Raises:
        ValueError: anything else, or a duration that is not positive.
    """
    match = _DURATION.match(text)
    if match is None:
        raise ValueError(f"{text!r} is not a duration like 30d, 12h, 90m, 45s or 2w")
    try:
        value = timedelta(**{_UNITS[match.group(2).lower()]: float(match.group(1))})
    except OverflowError:
        value = timedelta.max
    if value <= timedelta(0):
        raise ValueError(f"{text!r}: the duration must be positive")
    if value > MAX_DURATION:
        # The database subtracts it from now(): past its timestamps' range.
        raise ValueError(f"{text!r}: the duration is at most 100 years")
    return value


async def prune(db: Database, older_than: timedelta, batch_size: int = BATCH_SIZE) -> int:
    """
    Delete done/failed build jobs, and completed/discarded/cancelled plain jobs,
    that ended more than `older_than` ago; return how many. Copies of failed
    build jobs deleted with their target, older than that, go too; so do the
    errors kept of crashed attempts and the operator actions recorded in the
    jobs' timelines, once older than that and their job is gone. A job kept
    (waiting, running, or ended more recently) keeps all of its history.

    Loops over batches of at most `batch_size` rows, each its own statement (and
    transaction), until a batch comes back short. Ages are measured on the
    database's clock. Rows locked by someone else (a target's cascading delete)
    are skipped, for the next run.
    """
    if older_than <= timedelta(0):
        raise ValueError("older_than must be positive")
    if batch_size < 1:
        raise ValueError("batch_size must be >= 1")
    total = 0
    # Build jobs and plain jobs count; the copies of deleted failed build jobs
    # (0010) go at the same age; then the errors kept of crashed attempts (0009)
    # and the operator actions of the jobs' timelines (0015) of the jobs gone.
    for statement, counted in ((Q.jobs_prune, True), (Q.plain_prune, True),
                               (Q.deleted_build_jobs_prune, False),
                               (Q.job_errors_prune, False), (Q.job_events_prune, False)):
        while True:
            status = await db.execute(statement, older_than, batch_size)
            deleted = int(status.split()[-1])  # "DELETE <n>"
            total += deleted if counted else 0
            if deleted < batch_size:
                break
    if total:
        log.info("pruned %d finished jobs older than %s", total, older_than)
    return total
