"""
When a queue's next job is due, and which jobs wait for a later run_at, read
from the claim's index priority by priority (migrations 0023-0024, issue #25):
the (queue, run_at) index that answered them cost every enqueue an index entry.

What must hold: the answers are those of a plain read of the table, across
priorities and queues; and their cost does not grow with the backlog, due or
scheduled, measured in pages (EXPLAIN's buffers, which do not move with the
machine's load) on the generic plans the engine runs.
"""

from __future__ import annotations

from datetime import timedelta
from typing import ClassVar

import attrs

from nasiko_queue import JobArgs, JobOptions, Queue
from nasiko_queue.admin.operator import scheduled_jobs
from nasiko_queue.db.database import Database
from nasiko_queue.db.statements import Q
from nasiko_queue.plain.store import PlainJobStore

from .conftest import FAST
from .helpers import generic_plan_pages

#: The scheduled listing's page size in the cost test.
PAGE = 50


@attrs.frozen(kw_only=True)
class Tick(JobArgs):
    kind: ClassVar[str] = "tick"
    options: ClassVar[JobOptions] = JobOptions(queue="ticks")
    n: int


async def _add(db: Database, queue: str, n: int, priority: int, in_secs: float) -> None:
    """`n` available jobs of `queue` at `priority`, due `in_secs` from now (each a
    second later than the one before)."""
    await db.execute(
        "INSERT INTO nasiko_queue_jobs (id, queue, kind, payload, priority, max_attempts, run_at) "
        "SELECT gen_random_uuid(), $1, 'tick', '{\"n\": 0}', $2, 5, "
        "now() + make_interval(secs => $3 + g) FROM generate_series(0, $4 - 1) AS g",
        queue, priority, in_secs, n)


async def test_next_due_and_the_scheduled_listing_across_priorities_and_queues(
    queue: Queue, db: Database
) -> None:
    await _add(db, "ticks", 3, priority=0, in_secs=-60)  # due now: not scheduled
    await _add(db, "ticks", 2, priority=0, in_secs=600)
    await _add(db, "ticks", 2, priority=5, in_secs=300)  # the soonest, at a later priority
    await _add(db, "ticks", 1, priority=-3, in_secs=900)
    await _add(db, "other", 1, priority=9, in_secs=100)  # another queue's: the soonest of all
    store = PlainJobStore(db, FAST, "ticks", lambda: None)
    due = await store.next_due()
    assert due is not None
    assert 290 < due <= 300
    assert await PlainJobStore(db, FAST, "empty", lambda: None).next_due() is None

    truth = await db.fetch("SELECT id, queue FROM nasiko_queue_jobs "
                           "WHERE state = 'available' AND run_at > now() ORDER BY run_at, id")
    assert [j.id for j in await scheduled_jobs(db, None, 4)] == [r["id"] for r in truth[:4]]
    assert [j.id for j in await scheduled_jobs(db)] == [r["id"] for r in truth]
    ours = [r["id"] for r in truth if r["queue"] == "ticks"]
    assert [j.id for j in await scheduled_jobs(db, "ticks", 3)] == ours[:3]
    assert [(j.queue, j.priority) for j in await scheduled_jobs(db, None, 2)] == [
        ("other", 9), ("ticks", 5)]


async def test_a_backlog_costs_next_due_and_the_scheduled_listing_nothing(
    queue: Queue, db: Database
) -> None:
    for priority in (-1, 0, 2):
        await _add(db, "ticks", 500, priority=priority, in_secs=-7200)  # due
        await _add(db, "ticks", 500, priority=priority, in_secs=3600)  # later
    await _add(db, "other", 500, priority=0, in_secs=3600)
    await db.execute("VACUUM ANALYZE nasiko_queue_jobs")
    queries = [(Q.plain_next_due, "text, double precision", "'ticks', 1.0"),
               (Q.jobs_scheduled, "text, int", f"'ticks', {PAGE}"),
               (Q.jobs_scheduled, "text, int", f"NULL, {PAGE}")]
    few = [await generic_plan_pages(db, *q) for q in queries]
    for priority in (-1, 0, 2):
        await _add(db, "ticks", 9_000, priority=priority, in_secs=-7200)
        await _add(db, "ticks", 9_000, priority=priority, in_secs=3600)
    await _add(db, "other", 9_000, priority=0, in_secs=3600)
    await db.execute("VACUUM ANALYZE nasiko_queue_jobs")
    many = [await generic_plan_pages(db, *q) for q in queries]
    table = await db.fetchval("SELECT pg_relation_size('nasiko_queue_jobs') / 8192")
    # 19 times the jobs. next_due makes a few probes, each an index level
    # deeper at most. The listing reads its page's rows by primary key, an
    # index descent and a heap page each, so its cost follows the page size,
    # not the backlog. A read of the backlog would take most of the table.
    assert many[0] - few[0] <= 12, (few, many)
    assert all(m <= 5 * PAGE for m in many[1:]), (few, many)
    assert max(many) < table / 10, (many, table)
    # And still the right answer.
    later = await db.fetchval("SELECT min(run_at) FROM nasiko_queue_jobs "
                              "WHERE queue = 'ticks' AND state = 'available' AND run_at > now()")
    due = await PlainJobStore(db, FAST, "ticks", lambda: None).next_due()
    now = await db.fetchval("SELECT now()")
    assert due is not None
    assert abs(timedelta(seconds=due) - (later - now)) < timedelta(seconds=5)
