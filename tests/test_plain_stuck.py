"""
Plain jobs get the stuck-row rule build jobs have (issue 20, item 5): a running
plain job that no live worker holds and that has run past `stuck_job_mins` goes
back to available (attempt counted), or is discarded on its last attempt, or
cancelled if asked; run by the recovery sweep. Rows are aged in SQL, never by
waiting.
"""

from __future__ import annotations

import uuid
from typing import Any, ClassVar
from uuid import UUID

import attrs
import trio

from nasiko_queue import Executors, JobArgs, JobOptions, PlainJobContext, Queue
from nasiko_queue.builds.store import PgJobStore
from nasiko_queue.engine.contracts import RecoveryResult, WorkerIdentity
from nasiko_queue.engine.maintenance import StuckJobSweeper, SweeperConfig
from nasiko_queue.engine.state import WorkerStats
from nasiko_queue.plain.store import PlainJobStore

from .helpers import TEST_DEADLINE, running


@attrs.frozen(kw_only=True)
class Chore(JobArgs):
    kind: ClassVar[str] = "stuck_chore"
    n: int


def _store(queue: Queue) -> PgJobStore:
    return PgJobStore(queue.db, queue.config, runnable_kinds=frozenset(),
                      known_kinds=frozenset())


async def _worker(queue: Queue, *, dead_minutes_ago: int | None) -> UUID:
    """A registered worker: live, or declared dead that long ago."""
    store = _store(queue)
    worker_id = uuid.uuid4()
    await store.register_worker(WorkerIdentity(id=worker_id, host="h", pid=1, kinds=()))
    if dead_minutes_ago is not None:
        await queue.db.execute(
            "UPDATE nasiko_queue_workers SET dead_at = now() - make_interval(mins => $2), "
            "heartbeat_at = now() - make_interval(mins => $2) WHERE id = $1",
            worker_id, dead_minutes_ago)
    return worker_id


async def _running(queue: Queue, n: int, holder: UUID | None, *, minutes_ago: int,
                   max_attempts: int = 3, cancel: bool = False) -> UUID:
    """A job claimed by `holder` (None: no worker) `minutes_ago`."""
    job_id = await queue.enqueue(Chore(n=n), options=JobOptions(max_attempts=max_attempts))
    [claimed] = await PlainJobStore(queue.db, queue.config, "default", lambda: holder).claim(1)
    assert claimed.id == job_id
    if cancel:
        assert await queue.cancel(job_id) == "cancelling"
    await queue.db.execute(
        "UPDATE nasiko_queue_jobs SET attempted_at = now() - make_interval(mins => $2) "
        "WHERE id = $1", job_id, minutes_ago)
    return job_id


async def _state(queue: Queue, job_id: UUID) -> tuple[Any, ...]:
    row = await queue.db.fetchrow(
        "SELECT state, attempt, error_msg, claimed_by, claim_token IS NULL AS unclaimed "
        "FROM nasiko_queue_jobs WHERE id = $1", job_id)
    return (row["state"], row["attempt"])


async def test_a_running_plain_job_no_live_worker_holds_is_swept_after_the_limit(
    queue: Queue,
) -> None:
    live = await _worker(queue, dead_minutes_ago=None)
    dead = await _worker(queue, dead_minutes_ago=120)
    nobody = await _running(queue, 1, None, minutes_ago=61)
    unknown = await _running(queue, 2, uuid.uuid4(), minutes_ago=61)
    # Claimed after its worker was declared dead (a worker resumed from a pause):
    # the rescue leaves it, so only this rule frees it.
    after_death = await _running(queue, 3, dead, minutes_ago=61)
    last = await _running(queue, 4, None, minutes_ago=61, max_attempts=1)
    asked = await _running(queue, 5, unknown_holder := uuid.uuid4(), minutes_ago=61,
                           cancel=True)
    long_live = await _running(queue, 6, live, minutes_ago=600)
    fresh = await _running(queue, 7, None, minutes_ago=59)
    assert unknown_holder != live

    rescued = await _store(queue).rescue()
    assert (rescued.rescued, rescued.failed) == (0, 0)
    assert await _state(queue, after_death) == ("running", 1)

    sweeper = StuckJobSweeper(SweeperConfig.of(queue.config), _store(queue), WorkerStats(),
                              on_swept=lambda: None)
    assert await sweeper.run_once() == RecoveryResult(failed=0, reset=0, plain_reset=3,
                                                      plain_ended=2)
    for job_id in (nobody, unknown, after_death):
        assert await _state(queue, job_id) == ("available", 1)
    assert await _state(queue, last) == ("discarded", 1)
    assert await _state(queue, asked) == ("cancelled", 1)
    assert await _state(queue, long_live) == ("running", 1)
    assert await _state(queue, fresh) == ("running", 1)
    row = await queue.db.fetchrow(
        "SELECT error_msg, claimed_by, claim_token, run_at <= now() AS due "
        "FROM nasiko_queue_jobs WHERE id = $1", nobody)
    assert row["error_msg"].startswith("stuck:")
    assert (row["claimed_by"], row["claim_token"], row["due"]) == (None, None, True)
    assert (await queue.db.fetchval(
        "SELECT error_msg FROM nasiko_queue_jobs WHERE id = $1", asked)) == "cancelled"
    # A second sweep finds nothing more.
    assert await sweeper.run_once() == RecoveryResult(failed=0, reset=0)


async def test_the_sweep_respects_the_configured_limit(queue: Queue) -> None:
    job_id = await _running(queue, 1, None, minutes_ago=6)
    assert await _store(queue).recover() == RecoveryResult(failed=0, reset=0)
    short = Queue(queue.db, config=attrs.evolve(queue.config, stuck_job_mins=5))
    assert await _store(short).recover() == RecoveryResult(failed=0, reset=0, plain_reset=1)
    assert await _state(queue, job_id) == ("available", 1)


async def test_a_swept_plain_job_runs_again_on_a_live_worker(queue: Queue) -> None:
    job_id = await _running(queue, 1, None, minutes_ago=90)
    runs: list[int] = []
    executors = Executors()

    @executors.register(Chore)
    async def chore(ctx: PlainJobContext[Chore]) -> None:
        runs.append(ctx.attempt)

    async with running(queue, executors) as worker:  # its recovery sweep frees the job
        with trio.fail_after(TEST_DEADLINE):
            await worker.wait_for(lambda s: s.done >= 1)
    assert runs == [2]
    assert await _state(queue, job_id) == ("completed", 2)


async def test_a_live_workers_long_running_plain_job_is_not_swept(queue: Queue) -> None:
    started = trio.Event()
    release = trio.Event()
    executors = Executors()

    @executors.register(Chore)
    async def chore(ctx: PlainJobContext[Chore]) -> None:
        started.set()
        await release.wait()

    job_id = await queue.enqueue(Chore(n=1))
    async with running(queue, executors) as worker:
        with trio.fail_after(TEST_DEADLINE):
            await started.wait()
            # It has run for two hours, as far as the database can tell.
            await queue.db.execute(
                "UPDATE nasiko_queue_jobs SET attempted_at = now() - interval '2 hours' "
                "WHERE id = $1", job_id)
            assert await worker.sweeper.run_once() == RecoveryResult(failed=0, reset=0)
            assert await _state(queue, job_id) == ("running", 1)
            release.set()
            await worker.wait_for(lambda s: s.done >= 1)
    assert await _state(queue, job_id) == ("completed", 1)
