"""
The claim costs the same however much else the table holds (issue #13): the
plain-job claim reads its queue priority by priority, so the jobs scheduled for
later at a more urgent priority than the due ones are never walked through.

Measured in pages (EXPLAIN's buffers), not in time: a page count does not move
with the machine's load. The claim's generic plan is the one measured, as the
engine runs it.
"""

from __future__ import annotations

from typing import Any, ClassVar

import attrs
import pytest

from nasiko_queue import JobArgs, JobOptions, Queue
from nasiko_queue.builds.payloads import BUILTIN_PAYLOAD_TYPES
from nasiko_queue.db.database import Database
from nasiko_queue.db.statements import Q
from nasiko_queue.plain.store import PlainJobStore

from .conftest import FAST
from .helpers import generic_plan_pages

KINDS = [t.kind for t in BUILTIN_PAYLOAD_TYPES]


@attrs.frozen(kw_only=True)
class Tick(JobArgs):
    kind: ClassVar[str] = "tick"
    options: ClassVar[JobOptions] = JobOptions(queue="ticks")
    n: int


async def _schedule_later(db: Database, n: int, priority: int) -> None:
    """`n` jobs of queue 'ticks' due tomorrow, at `priority`."""
    await db.execute(
        "INSERT INTO nasiko_queue_jobs (id, queue, kind, payload, priority, max_attempts, run_at) "
        "SELECT gen_random_uuid(), 'ticks', 'tick', '{\"n\": 0}', $1, 5, "
        "now() + interval '1 day' + make_interval(secs => g) FROM generate_series(1, $2) AS g",
        priority, n)
    await db.execute("VACUUM ANALYZE nasiko_queue_jobs")


async def _claim_pages(db: Database) -> int:
    """Pages one claim of queue 'ticks' reads, on the generic plan (rolled back)."""
    return await generic_plan_pages(db, Q.plain_claim,
                                    "text, int, uuid, uuid, int, uuid[], uuid[]",
                                    "'ticks', 1, gen_random_uuid(), NULL, 1000000, '{}', '{}'")


async def test_jobs_scheduled_later_at_a_more_urgent_priority_cost_the_claim_nothing(
    queue: Queue, db: Database
) -> None:
    due = [await queue.enqueue(Tick(n=n), options=JobOptions(queue="ticks", priority=p))
           for n, p in [(1, 3), (2, 0), (3, 0)]]
    # A backlog of due jobs behind them, so that the claim is planned as an
    # ordered walk of the queue (few due jobs would be found by due time).
    await db.execute(
        "INSERT INTO nasiko_queue_jobs (id, queue, kind, payload, priority, max_attempts, run_at) "
        "SELECT gen_random_uuid(), 'ticks', 'tick', '{\"n\": 0}', 4, 5, now() "
        "FROM generate_series(1, 2000)")
    await _schedule_later(db, 2_000, priority=-5)
    few = await _claim_pages(db)
    await _schedule_later(db, 18_000, priority=-5)
    many = await _claim_pages(db)
    # One ordered scan by (priority, run_at) read every one of them first:
    # about a hundred more pages for 18,000 more jobs. Priority by priority, the
    # index only grows a level deeper at most.
    assert many - few <= 8, (few, many)
    # And the order still holds: the most urgent due job first, oldest first
    # within a priority; none of tomorrow's.
    store = PlainJobStore(db, FAST, "ticks", lambda: None)
    claimed = [job.id for job in await store.claim(2)] + [job.id for job in await store.claim(1)]
    assert claimed == [due[1], due[2], due[0]]


async def test_a_paused_queue_claims_nothing_priority_by_priority_too(
    queue: Queue, db: Database
) -> None:
    for p in (2, 1, 0):
        await queue.enqueue(Tick(n=p), options=JobOptions(queue="ticks", priority=p))
    await db.execute("INSERT INTO nasiko_queue_paused_queues (queue) VALUES ('ticks')")
    store = PlainJobStore(db, FAST, "ticks", lambda: None)
    assert await store.claim(5) == []
    await db.execute("DELETE FROM nasiko_queue_paused_queues")
    assert [job.priority for job in await store.claim(5)] == [0, 1, 2]


async def test_the_queue_statements_run_without_jit(db: Database) -> None:
    """A generic plan's cost estimate grows with the backlog; past `jit_above_cost`
    the server would compile the claim, milliseconds for a 0.1 ms statement."""
    assert [r[0] for r in await db.fetch_generic("SHOW jit")] == ["off"]


@pytest.mark.parametrize("lane", ["all kinds", "some kinds", "plain"])
async def test_a_plan_made_while_the_queue_was_empty_still_reads_the_indexes(
    db: Database, lane: str
) -> None:
    """
    The engine's connections keep the generic plan of a statement's first run.
    Made on an empty table, it used to be sequential scans and sorts, kept until
    an ANALYZE: every claim then read the whole backlog that arrived. With the
    engine's session settings it reads the indexes from the start.
    """
    kinds = "{" + ",".join(sorted(KINDS)) + "}"
    if lane == "plain":
        sql, types = Q.plain_claim, "text, int, uuid, uuid, int, uuid[], uuid[]"
        call = "EXECUTE nq_empty('ticks', 5, gen_random_uuid(), NULL, 1000000, '{}', '{}')"
        fill = ("INSERT INTO nasiko_queue_jobs (id, queue, kind, payload, max_attempts) "
                "SELECT gen_random_uuid(), 'ticks', 'tick', '{}', 5 "
                "FROM generate_series(1, 3000)")
        table, index = "nasiko_queue_jobs", "nasiko_queue_jobs_claim"
    else:
        runs = "{Upload}" if lane == "some kinds" else kinds
        sql = Q.job_claim_kinds if lane == "some kinds" else Q.job_claim
        types = "int, text[], text[], int, uuid, uuid"
        call = f"EXECUTE nq_empty(5, '{runs}', '{kinds}', 1000000, gen_random_uuid(), NULL)"
        fill = ("WITH a AS (INSERT INTO agents (owner_id, name) "
                "VALUES (gen_random_uuid(), 'backlog') RETURNING id) "
                "INSERT INTO build_jobs (agent_id, owner_id, payload) "
                "SELECT a.id, gen_random_uuid(), jsonb_build_object('kind', "
                "CASE WHEN g % 2 = 0 THEN 'Upload' ELSE 'Update' END) "
                "FROM a, generate_series(1, 3000) AS g")
        table = "build_jobs"
        index = "build_jobs_pending_kind" if lane == "some kinds" else "build_jobs_work_queue"

    async def plan_then_fill(conn: Any) -> str:
        await conn.execute(f"PREPARE nq_empty({types}) AS\n{sql}")
        try:
            await conn.fetch(call)  # the first run, on the empty table: the plan is made
            await conn.execute(fill)
            tx = conn.transaction()
            await tx.start()
            try:
                rows = await conn.fetch("EXPLAIN (ANALYZE) " + call)
            finally:
                await tx.rollback()
        finally:
            await conn.execute("DEALLOCATE nq_empty")
        return "\n".join(r[0] for r in rows)

    # Known to be empty, as autovacuum finds a drained queue in a new table.
    await db.execute(f"VACUUM ANALYZE {table}")
    plan = await db.run_bounded(plan_then_fill, bound=30, generic=True)
    assert f"Seq Scan on {table}" not in plan, plan
    assert index in plan, plan
    # The few rows it gathered may sort; never the backlog.
    assert "rows=3000 " not in plan, plan
    assert "rows=1500 " not in plan, plan
