"""
Rows whose run_at PostgreSQL holds as ±infinity (written by SQL, or by an
enqueue that passed `datetime.min`/`max`, which asyncpg writes as such), and a
lane that raises (found by a bug hunt: such a row crashed the lane's producer,
and the worker then hung instead of ending with the error).
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime, timedelta
from typing import Any, ClassVar

import attrs
import pytest
import trio

from nasiko_queue import Executors, Job, JobArgs, PlainJobContext, Queue, Worker
from nasiko_queue.admin.operator import queue_overview
from nasiko_queue.admin.status import queue_status, unserved_queues
from nasiko_queue.db.statements import Q
from nasiko_queue.engine.producer import Producer

from .helpers import TEST_DEADLINE, running


@attrs.frozen
class Tick(JobArgs):
    kind: ClassVar[str] = "tick"
    n: int = 0


def _ticks(ran: list[int]) -> Executors:
    executors = Executors()

    @executors.register(Tick)
    async def tick(ctx: PlainJobContext[Tick]) -> None:
        ran.append(ctx.payload.n)

    return executors


async def _insert(queue: Queue, n: int, run_at: str) -> Any:
    return await queue.db.fetchval(
        "INSERT INTO nasiko_queue_jobs (id, queue, kind, payload, max_attempts, run_at) "
        "VALUES (gen_random_uuid(), 'default', 'tick', jsonb_build_object('kind', 'tick', "
        "'n', $1::int), 3, $2::text::timestamptz) RETURNING id", n, run_at)


async def test_jobs_due_at_infinities_neither_crash_the_worker_nor_the_views(
    queue: Queue, caplog: pytest.LogCaptureFixture
) -> None:
    """
    A job due at -infinity runs like any due job; one due at +infinity waits
    for ever. The worker's claim took the first and raised comparing a naive
    datetime.min with an aware time, and its read of the next due job failed
    every 5 s on the second; `status` failed on either.
    """
    caplog.set_level(logging.WARNING)
    ran: list[int] = []
    never = await _insert(queue, 1, "infinity")
    await _insert(queue, 2, "-infinity")
    await queue.enqueue(Tick(n=3))
    async with running(queue, _ticks(ran)) as worker:
        with trio.fail_after(TEST_DEADLINE):
            await worker.wait_for(lambda s: s.done >= 2)
    # When the next job is due, as each drain reads it: none (no finite time).
    assert await queue.db.fetchval(Q.plain_next_due, "default", 0.5) is None
    assert sorted(ran) == [2, 3]
    assert await queue.db.fetchval("SELECT state FROM nasiko_queue_jobs WHERE id = $1",
                                   never) == "available"
    assert "next job is due" not in caplog.text
    await _insert(queue, 4, "-infinity")  # waiting, for the views' ages
    status = await queue_status(queue.db)
    assert status is not None
    await unserved_queues(queue.db)
    await queue_overview(queue.db)
    await queue.db.fetch(Q.metrics_jobs)


@pytest.mark.parametrize("run_at", [
    datetime.max.replace(tzinfo=UTC),
    datetime.min.replace(tzinfo=UTC),
    datetime.now(UTC) + timedelta(days=365 * 101),
])
async def test_a_run_at_past_what_the_queue_keeps_is_refused(queue: Queue,
                                                              run_at: datetime) -> None:
    with pytest.raises(ValueError, match="run_at must be within 100 years"):
        await queue.enqueue(Tick(n=1), run_at=run_at)
    with pytest.raises(ValueError, match="within 100 years"):
        await queue.enqueue_many([Job(Tick(n=1), run_at=run_at)])
    assert await queue.db.fetchval("SELECT count(*) FROM nasiko_queue_jobs") == 0


async def test_a_lane_that_raises_ends_the_worker_with_its_error(
    queue: Queue, monkeypatch: pytest.MonkeyPatch
) -> None:
    """
    A bug in the producer (planted: its claim's answer raises) ended its loop;
    its wind-down then waited for the slots, which waited for jobs it would
    never hand them, so `Worker.run` never returned. It now raises the error.
    """
    async def planted(self: Producer, *args: object) -> None:
        raise RuntimeError("planted bug")

    monkeypatch.setattr(Producer, "_accept", planted)
    await queue.enqueue(Tick(n=1))
    worker = Worker(queue, _ticks([]))
    with trio.fail_after(TEST_DEADLINE), pytest.raises(BaseExceptionGroup) as caught:
        await worker.run()
    planted_bugs, others = caught.value.split(RuntimeError)
    assert others is None, others
    assert planted_bugs is not None
