"""
Database errors during the claim and during the final update (SPEC §5).

The errors are real PostgreSQL errors: a trigger raises while a row in the
`faults` table names the operation, so the engine meets exactly what it would
meet in production, through the real driver.
"""

from __future__ import annotations

from typing import Any

import pytest
import trio

from nasiko_queue import Database, JobContext, Queue, Worker
from nasiko_queue.builds.store import PgJobStore
from nasiko_queue.engine.contracts import MAX_ATTEMPTS_EXCEEDED
from nasiko_queue.testing import enqueue_with_target

from .helpers import (
    LogEvent,
    agent_state,
    build_state,
    executors_for_all,
    job_row,
    running,
    succeed,
)

FAULTS = """
CREATE TABLE faults (op text PRIMARY KEY);
CREATE FUNCTION inject_fault() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF OLD.status = 'pending' AND NEW.status = 'in_progress'
       AND EXISTS (SELECT 1 FROM faults WHERE op = 'claim') THEN
        RAISE EXCEPTION 'injected fault: claim';
    END IF;
    IF OLD.status = 'in_progress' AND NEW.status IN ('done', 'failed', 'pending')
       AND EXISTS (SELECT 1 FROM faults WHERE op = 'final') THEN
        RAISE EXCEPTION 'injected fault: final update';
    END IF;
    RETURN NEW;
END;
$$;
CREATE TRIGGER inject_fault BEFORE UPDATE ON build_jobs
    FOR EACH ROW EXECUTE FUNCTION inject_fault();
"""


@pytest.fixture
async def faults(db: Database) -> Database:
    await db.execute(FAULTS)
    return db


async def test_failed_claim_stops_the_drain_until_the_next_signal(
    queue: Queue, faults: Database
) -> None:
    job = await enqueue_with_target(queue, "Upload")
    await faults.execute("INSERT INTO faults VALUES ('claim')")
    async with running(queue, executors_for_all(succeed)) as worker:
        await worker.drain_once()
        assert worker.stats.claim_errors >= 1
        row = await job_row(queue.db, job.job_id)
        assert row is not None
        assert (row["status"], row["attempt"]) == ("pending", 0)  # rolled back, untouched

        await faults.execute("DELETE FROM faults")
        await worker.drain_once()
    row = await job_row(queue.db, job.job_id)
    assert row is not None
    assert (row["status"], row["attempt"]) == ("done", 1)


@pytest.mark.parametrize("outcome", ["success", "panic-retry", "panic-final"])
async def test_failed_final_update_is_retried_until_it_lands(
    queue: Queue, faults: Database, outcome: str
) -> None:
    """[decision] The finished job's result is never lost and the job never re-runs."""
    runs: list[int] = []

    async def run(ctx: JobContext[Any]) -> None:
        runs.append(ctx.attempt)
        if outcome == "success" or (outcome == "panic-retry" and ctx.attempt == 2):
            await succeed(ctx)
            return
        raise RuntimeError("crash")

    job = await enqueue_with_target(queue, "Upload", prior_success=True)
    if outcome == "panic-final":
        await queue.db.execute("UPDATE build_jobs SET attempt = 2 WHERE id = $1", job.job_id)
    await faults.execute("INSERT INTO faults VALUES ('final')")
    with LogEvent("update failed (") as failing:
        async with running(queue, executors_for_all(run)) as worker, \
                trio.open_nursery() as nursery:
            nursery.start_soon(worker.drain_once)
            await failing.event.wait()
            row = await job_row(queue.db, job.job_id)
            assert row is not None
            assert row["status"] == "in_progress"
            await faults.execute("DELETE FROM faults")
    row = await job_row(queue.db, job.job_id)
    assert row is not None
    expected = {
        "success": ("done", 1, [1]),
        "panic-retry": ("done", 2, [1, 2]),
        "panic-final": ("failed", 3, [3]),
    }[outcome]
    assert (row["status"], row["attempt"], runs) == expected


async def test_error_during_terminalization_deletes_nothing(
    queue: Queue, faults: Database
) -> None:
    """[decision] Terminalization runs in the job's own transaction: a database error
    part-way (here, failing the agent's builds) rolls everything back — no delete, the
    job not marked — and the whole step is retried until it succeeds."""
    await faults.execute("""
        CREATE FUNCTION builds_fault() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            IF EXISTS (SELECT 1 FROM faults WHERE op = 'builds') THEN
                RAISE EXCEPTION 'injected fault: agent_builds';
            END IF;
            RETURN NEW;
        END;
        $$;
        CREATE TRIGGER builds_fault BEFORE UPDATE ON agent_builds
            FOR EACH ROW EXECUTE FUNCTION builds_fault();
        INSERT INTO faults VALUES ('builds');
    """)
    job = await enqueue_with_target(queue, "Upload")  # never built: would be deleted
    await queue.db.execute("UPDATE build_jobs SET attempt = 3 WHERE id = $1", job.job_id)
    with LogEvent("update failed (") as failing:
        async with running(queue, executors_for_all(succeed)) as worker, \
                trio.open_nursery() as nursery:
            nursery.start_soon(worker.drain_once)
            await failing.event.wait()
            assert await queue.db.fetchval(
                "SELECT status FROM agents WHERE id = $1", job.target_id) == "deploying"
            row = await job_row(queue.db, job.job_id)
            assert row is not None
            assert row["status"] == "in_progress"
            await faults.execute("DELETE FROM faults")
    assert await queue.db.fetchval("SELECT count(*) FROM agents WHERE id = $1",
                                   job.target_id) == 0


async def test_hard_stop_during_the_final_update_keeps_the_result(queue: Queue,
                                                                  db: Database) -> None:
    """The final update is shielded: a hard stop that lands while it is in flight
    waits for it, so the finished build is recorded and never re-run by a sweep."""
    await db.execute("""
        CREATE FUNCTION slow_final() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            IF NEW.status = 'done' THEN PERFORM pg_sleep(0.5); END IF;
            RETURN NEW;
        END;
        $$;
        CREATE TRIGGER slow_final BEFORE UPDATE ON build_jobs
            FOR EACH ROW EXECUTE FUNCTION slow_final();
    """)
    returned = trio.Event()

    async def run(ctx: JobContext[Any]) -> None:
        await succeed(ctx)
        returned.set()

    job = await enqueue_with_target(queue, "Upload")
    worker = Worker(queue, executors_for_all(run))
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            await nursery.start(worker.run)
            await returned.wait()
            await trio.lowlevel.checkpoint()  # the final update is now under way
            nursery.cancel_scope.cancel()
    row = await job_row(db, job.job_id)
    assert row is not None
    assert (row["status"], row["attempt"]) == ("done", 1)


async def test_a_target_that_cannot_be_terminalized_does_not_wedge_the_worker(
    queue: Queue, db: Database, caplog: pytest.LogCaptureFixture
) -> None:
    """An application rule that forbids deleting the agent: after `terminalize_tries`
    refusals the job is marked failed alone (and the error logged); the next job runs."""
    await db.execute("""
        CREATE FUNCTION keep_agents() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN RAISE EXCEPTION 'agents are never deleted here'; END;
        $$;
        CREATE TRIGGER keep_agents BEFORE DELETE ON agents
            FOR EACH ROW EXECUTE FUNCTION keep_agents();
    """)
    stuck = await enqueue_with_target(queue, "Upload")  # never built: would be deleted
    await db.execute("UPDATE build_jobs SET attempt = 3 WHERE id = $1", stuck.job_id)
    good = await enqueue_with_target(queue, "Upload")
    async with running(queue, executors_for_all(succeed)) as worker:
        await worker.drain_once()
    row = await job_row(db, stuck.job_id)
    assert row is not None
    assert (row["status"], row["error_msg"]) == ("failed", MAX_ATTEMPTS_EXCEEDED)
    assert await build_state(db, stuck.build_id) == "failed"  # its own build ended
    assert (await job_row(db, good.job_id) or {})["status"] == "done"
    assert "falling back" in caplog.text


async def test_sweep_terminalizes_the_other_targets_when_one_is_refused(
    queue: Queue, db: Database
) -> None:
    refused = await enqueue_with_target(queue, "Upload")
    other = await enqueue_with_target(queue, "Upload")
    await db.execute(f"""
        CREATE FUNCTION keep_one() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            IF OLD.id = '{refused.target_id}' THEN RAISE EXCEPTION 'keep this one'; END IF;
            RETURN OLD;
        END;
        $$;
        CREATE TRIGGER keep_one BEFORE DELETE ON agents
            FOR EACH ROW EXECUTE FUNCTION keep_one();
    """)
    await db.execute("UPDATE build_jobs SET status = 'in_progress', attempt = 3, "
                     "picked_at = now() - interval '2 hours'")
    kinds = frozenset({"Upload"})
    result = await PgJobStore(db, queue.config, runnable_kinds=kinds,
                              known_kinds=kinds).recover()
    assert result.failed == 2
    assert await agent_state(db, other.target_id) is None        # terminalized
    assert await agent_state(db, refused.target_id) == "deploying"  # refused, left
    row = await job_row(db, refused.job_id)
    assert row is not None
    assert (row["status"], row["error_msg"]) == ("failed", MAX_ATTEMPTS_EXCEEDED)
