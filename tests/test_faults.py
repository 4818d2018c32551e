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

from nasiko_queue import Database, JobContext, Queue
from nasiko_queue.testing import enqueue_with_target

from .helpers import LogEvent, executors_for_all, job_row, running, succeed

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
    with LogEvent("update failed; retrying") as failing:
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
    with LogEvent("update failed; retrying") as failing:
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
