"""
Limits of a queue of plain jobs that hold across every worker (issue #23).

`QueueConfig.queues` bounds what one worker process runs of a queue; a limit
here bounds the whole fleet, and lives in the database (`nasiko_queue_limits`,
migration 0020), so that every replica agrees on it and an operator changes it
without a deploy (`Queue.set_limit`, ``nasiko-queue limit set``, the
dashboard). Both apply: a worker never runs more than its own slots, and the
fleet never more than the limit.

The claim of a limited queue (`nasiko_queue_limited_pick`) holds an advisory
lock of that queue while it counts, so two replicas' claims cannot both see
the last free slot; the counts come from the job rows themselves (running
jobs) and from a ledger of starts written under that lock, so a rescue, a
cancel, a retry or a dead letter frees its slot with the row's state, with no
counter to keep in step.
"""

from __future__ import annotations

import enum
from datetime import datetime
from typing import Any, Final

import attrs

from ..db.database import Database
from ..db.statements import Q

__all__ = ["LIMIT_RECHECK", "PartitionMode", "QueueLimit", "Rate", "clear_limit", "limits",
           "set_limit"]

#: Seconds a worker whose claim found a limited queue's concurrency full waits
#: before it claims again (a worker whose own job ends claims at once, in the
#: same statement as the finish). Short: the recheck is one probe of the limits
#: table, one advisory lock and one count of the queue's running jobs.
LIMIT_RECHECK: Final = 0.5


class PartitionMode(enum.StrEnum):
    """How a partitioned queue shares its claims between keys."""

    #: By priority then due time, whatever the key (a partition only splits the rate).
    NONE = "none"
    #: One job per key in turn in each claim, priority first within a key: a
    #: key's backlog delays another key's first job by one claim round at most.
    ROUND_ROBIN = "round_robin"
    #: As ROUND_ROBIN, and at most one running job per key.
    SERIAL = "serial"


#: What the limits table holds (PostgreSQL's integer), and the span of a rate's
#: window: a millisecond (an interval keeps microseconds; a shorter one is 0)
#: to a hundred years (an infinite one overflows the interval).
MAX_COUNT = 2**31 - 1
MIN_PERIOD = 0.001
MAX_PERIOD = 100 * 365.25 * 24 * 3600


def _count(_inst: object, attribute: attrs.Attribute[Any], value: int | None) -> None:
    if value is not None and not 1 <= value <= MAX_COUNT:
        raise ValueError(f"{attribute.name} must be a whole number from 1 to {MAX_COUNT}, "
                         f"got {value!r}")


def _period(_inst: object, attribute: attrs.Attribute[Any], value: float) -> None:
    if not MIN_PERIOD <= value <= MAX_PERIOD:  # NaN fails too
        raise ValueError(f"{attribute.name} must be from {MIN_PERIOD} s to 100 years, "
                         f"got {value!r}")


@attrs.frozen
class Rate:
    """At most `limit` starts per `per` seconds: ``Rate(10, per=60.0)``."""

    limit: int = attrs.field(validator=_count)
    per: float = attrs.field(kw_only=True, converter=float, validator=_period)


def _mode(value: PartitionMode | str) -> PartitionMode:
    return PartitionMode(value)


@attrs.frozen(kw_only=True)
class QueueLimit:
    """
    The limits of one queue, as `Queue.limits` reads them.

    Args:
        queue: the queue's name.
        concurrency: at most this many of its jobs running across every worker.
        rate: at most so many starts per period across every worker (per
            partition key when `partition_by` is set).
        partition_by: the job arg (a field of the job's args) whose value is
            its partition key; jobs without it share the key "".
        partition_mode: how claims share out between keys.
        running, window_starts: what the limits hold now (read only).
    """

    queue: str
    concurrency: int | None = attrs.field(default=None, validator=_count)
    rate: Rate | None = None
    partition_by: str | None = None
    partition_mode: PartitionMode = attrs.field(default=PartitionMode.NONE, converter=_mode)
    updated_at: datetime | None = None
    running: int = 0
    window_starts: int = 0

    def __attrs_post_init__(self) -> None:
        if self.partition_mode is not PartitionMode.NONE and self.partition_by is None:
            raise ValueError("a partition mode needs partition_by (the job arg to key on)")
        if self.partition_by == "":
            raise ValueError("partition_by names a job arg; it cannot be empty")
        if not self.queue or len(self.queue) > 128 or self.queue == "builds":
            raise ValueError("limits apply to a plain-job queue: 1 to 128 characters, "
                             "not 'builds'")


async def set_limit(db: Database, limit: QueueLimit) -> None:
    """Write `limit` (replacing the queue's limits) for every worker at once."""
    rate = limit.rate
    await db.execute(Q.limit_set, limit.queue, limit.concurrency,
                     None if rate is None else rate.limit, None if rate is None else rate.per,
                     limit.partition_by, str(limit.partition_mode))


async def clear_limit(db: Database, queue: str) -> bool:
    """The queue unlimited again; False if it had no limits."""
    return await db.fetchval(Q.limit_clear, queue) is not None


async def limits(db: Database) -> list[QueueLimit]:
    """Every limited queue, with its running jobs and starts in the window now."""
    return [QueueLimit(queue=r["queue"], concurrency=r["concurrency"],
                       rate=None if r["rate_limit"] is None
                       else Rate(r["rate_limit"], per=r["rate_period"]),
                       partition_by=r["partition_by"], partition_mode=r["partition_mode"],
                       updated_at=r["updated_at"], running=r["running"],
                       window_starts=r["window_starts"])
            for r in await db.fetch(Q.limits_list)]
