"""
Blocking code in an ``async def`` executor costs no re-run and no lost result
while the process lives (issue #46): the loop watch renews the lease from a
thread of its own while the event loop is blocked, and names the job that blocks it.

Before it, an executor that held the loop past the lease (``time.sleep`` standing
in for ``requests`` or the Django ORM) was declared dead by the leader, its job
rescued and run again, and its own finished result thrown away by the fence.
Here the blocking worker runs in a thread of its own (`start_worker_thread`: its
own trio loop, as in a FastAPI or Django process), and this test's worker leads
maintenance and serves the same kind: a rescue would show as a second run.
"""

from __future__ import annotations

import logging
import time
from typing import ClassVar

import attrs
import pytest
import trio

from nasiko_queue import (
    Executors,
    JobArgs,
    JobOptions,
    PlainJobContext,
    Queue,
    start_worker_thread,
)
from nasiko_queue.db.database import Database

from .conftest import FAST
from .helpers import TEST_DEADLINE, running

#: A lease of 1.5 s, renewed every 0.5 s; the executor blocks for 2.3 leases.
LEASE = attrs.evolve(FAST, heartbeat_interval=0.5, lease=1.5)
BLOCK = 3.5


@attrs.frozen(kw_only=True)
class Report(JobArgs):
    kind: ClassVar[str] = "report"
    options: ClassVar[JobOptions] = JobOptions(queue="reports", max_attempts=3)
    name: str


async def test_an_async_executor_blocking_past_the_lease_runs_once_and_is_named(
    dsn: str, db: Database, caplog: pytest.LogCaptureFixture,
) -> None:
    runs: list[int] = []
    executors = Executors()

    @executors.register(Report)
    async def render(ctx: PlainJobContext[Report]) -> str:
        runs.append(ctx.attempt)
        time.sleep(BLOCK)  # noqa: ASYNC251 - the mistake under test: blocking the loop
        return f"{ctx.payload.name} rendered"

    caplog.set_level(logging.WARNING, logger="nasiko_queue")
    queue = Queue(db, config=LEASE)
    blocking = await trio.to_thread.run_sync(lambda: start_worker_thread(
        dsn, executors, config=attrs.evolve(LEASE, maintenance=False)))
    try:
        job_id = await queue.enqueue(Report(name="q3"))
        async with running(queue, executors) as leader:  # leads, and would re-run it
            with trio.fail_after(TEST_DEADLINE):
                assert await queue.result(job_id) == "q3 rendered"
            assert leader.stats.done == 0
    finally:
        await trio.to_thread.run_sync(blocking.stop)
    row = await db.fetchrow("SELECT state, attempt FROM nasiko_queue_jobs WHERE id = $1",
                            job_id)
    assert (row["state"], row["attempt"], runs) == ("completed", 1, [1])
    named = [r.getMessage() for r in caplog.records if "event loop has been blocked" in
             r.getMessage()]
    assert named, "the watch named no blocker"
    assert str(job_id) in named[0]
    assert "test_loop_watch.py" in named[0]
    assert "in render" in named[0]
    assert "plain def" in named[0]
