"""Recovery of stuck jobs (SPEC §7): rows are aged in SQL, never by waiting."""

from __future__ import annotations

from typing import Any

import trio

from nasiko_queue import Queue
from nasiko_queue.builds.store import PgJobStore
from nasiko_queue.engine.contracts import MAX_ATTEMPTS_EXCEEDED, RecoveryResult
from nasiko_queue.testing import enqueue_with_target

from .helpers import (
    TEST_DEADLINE,
    agent_state,
    build_state,
    connector_state,
    executors_for_all,
    job_row,
    running,
    succeed,
)


async def _stick(queue: Queue, job_id: Any, *, attempt: int, minutes_ago: int) -> None:
    """Make a job look claimed `minutes_ago` by a worker that then vanished."""
    await queue.db.execute(
        "UPDATE build_jobs SET status = 'in_progress', attempt = $2, "
        "picked_at = now() - make_interval(mins => $3) WHERE id = $1",
        job_id, attempt, minutes_ago)


def _store(queue: Queue) -> PgJobStore:
    kinds = frozenset({"Upload", "Update", "McpServerUpload"})
    return PgJobStore(queue.db, queue.config, runnable_kinds=kinds, known_kinds=kinds)


async def test_stuck_job_with_attempts_left_goes_back_to_pending(queue: Queue) -> None:
    job = await enqueue_with_target(queue, "Upload")
    await _stick(queue, job.job_id, attempt=2, minutes_ago=61)
    assert await _store(queue).recover() == RecoveryResult(failed=0, reset=1)
    row = await job_row(queue.db, job.job_id)
    assert row is not None
    assert (row["status"], row["attempt"], row["picked_at"]) == ("pending", 2, None)
    assert await agent_state(queue.db, job.target_id) == "deploying"


async def test_stuck_job_without_attempts_left_fails_and_terminalizes(queue: Queue) -> None:
    kept = await enqueue_with_target(queue, "Update", prior_success=True)
    gone = await enqueue_with_target(queue, "Upload")
    mcp = await enqueue_with_target(queue, "McpServerUpload", prior_success=True)
    for job in (kept, gone, mcp):
        await _stick(queue, job.job_id, attempt=3, minutes_ago=90)
    assert await _store(queue).recover() == RecoveryResult(failed=3, reset=0)
    row = await job_row(queue.db, kept.job_id)
    assert row is not None
    assert (row["status"], row["error_msg"], row["attempt"]) == (
        "failed", MAX_ATTEMPTS_EXCEEDED, 3)
    assert await agent_state(queue.db, kept.target_id) == "failed"
    assert await build_state(queue.db, kept.build_id) == "failed"
    assert await agent_state(queue.db, gone.target_id) is None
    assert await connector_state(queue.db, mcp.target_id) == "failed"


async def test_fresh_and_finished_rows_are_left_alone(queue: Queue) -> None:
    fresh = await enqueue_with_target(queue, "Upload")
    await _stick(queue, fresh.job_id, attempt=3, minutes_ago=59)
    pending = await enqueue_with_target(queue, "Upload")
    done = await enqueue_with_target(queue, "Upload")
    await queue.db.execute(
        "UPDATE build_jobs SET status = 'done', attempt = 1, "
        "picked_at = now() - interval '5 hours' WHERE id = $1", done.job_id)
    assert await _store(queue).recover() == RecoveryResult(failed=0, reset=0)
    assert (await job_row(queue.db, fresh.job_id) or {})["status"] == "in_progress"
    assert (await job_row(queue.db, pending.job_id) or {})["status"] == "pending"
    assert (await job_row(queue.db, done.job_id) or {})["status"] == "done"


async def test_threshold_is_configurable(queue: Queue) -> None:
    import attrs

    job = await enqueue_with_target(queue, "Upload")
    await _stick(queue, job.job_id, attempt=1, minutes_ago=6)
    short = Queue(queue.db, config=attrs.evolve(queue.config, stuck_job_mins=5))
    assert await _store(short).recover() == RecoveryResult(failed=0, reset=1)


async def test_worker_recovers_at_startup_and_reruns(queue: Queue) -> None:
    """A crashed worker's job (claimed 2 h ago) is recovered before the worker says
    it started, then runs again with its attempt counted."""
    job = await enqueue_with_target(queue, "Upload")
    await _stick(queue, job.job_id, attempt=1, minutes_ago=120)
    async with running(queue, executors_for_all(succeed)) as worker:
        assert worker.stats.recoveries == 1
        await worker.drain_once()
    row = await job_row(queue.db, job.job_id)
    assert row is not None
    assert (row["status"], row["attempt"]) == ("done", 2)


async def test_two_sweeps_at_once_terminalize_each_target_once(queue: Queue) -> None:
    jobs = [await enqueue_with_target(queue, "Update", prior_success=True) for _ in range(20)]
    for job in jobs:
        await _stick(queue, job.job_id, attempt=3, minutes_ago=61)
    results: list[RecoveryResult] = []

    async def sweep() -> None:
        results.append(await _store(queue).recover())

    async with trio.open_nursery() as nursery:
        for _ in range(3):
            nursery.start_soon(sweep)
    assert sum(r.failed for r in results) == 20
    failed = await queue.db.fetchval(
        "SELECT count(*) FROM build_jobs WHERE status = 'failed' AND error_msg = $1",
        MAX_ATTEMPTS_EXCEEDED)
    assert failed == 20


async def test_fresh_row_with_attempts_left_is_not_reset(queue: Queue) -> None:
    """Statement 2 honours the threshold too: attempt 1, picked 59 minutes ago, stays."""
    job = await enqueue_with_target(queue, "Upload")
    await _stick(queue, job.job_id, attempt=1, minutes_ago=59)
    assert await _store(queue).recover() == RecoveryResult(failed=0, reset=0)
    row = await job_row(queue.db, job.job_id)
    assert row is not None
    assert (row["status"], row["attempt"]) == ("in_progress", 1)
    assert row["picked_at"] is not None


async def test_a_locked_target_skips_its_job_not_the_whole_sweep(queue: Queue) -> None:
    """
    An application transaction holds one agent's row (an edit in progress) while
    the sweep fails that agent's exhausted job: the sweep waits for the lock a
    moment, skips that job for the next sweep, and goes on with the others and
    with the reset. It used to wait for the lock until the statement timed out
    (60 s), and the time-out, taken for a broken connection, ended the round
    before the other steps.
    """
    locked = await enqueue_with_target(queue, "Update", prior_success=True)
    other = await enqueue_with_target(queue, "Update", prior_success=True)
    left = await enqueue_with_target(queue, "Upload")
    for job in (locked, other):
        await _stick(queue, job.job_id, attempt=3, minutes_ago=90)
    await _stick(queue, left.job_id, attempt=1, minutes_ago=90)
    with trio.fail_after(TEST_DEADLINE):
        async with queue.db.transaction() as edit:
            await edit.execute("SELECT 1 FROM agents WHERE id = $1 FOR UPDATE",
                               locked.target_id)
            result = await _store(queue).recover()
    assert result == RecoveryResult(failed=1, reset=1, skipped=1)
    assert (await job_row(queue.db, locked.job_id) or {})["status"] == "in_progress"
    assert (await job_row(queue.db, other.job_id) or {})["status"] == "failed"
    assert (await job_row(queue.db, left.job_id) or {})["status"] == "pending"
    # The next sweep, the lock gone, fails it.
    assert await _store(queue).recover() == RecoveryResult(failed=1, reset=0)
    assert await agent_state(queue.db, locked.target_id) == "failed"
