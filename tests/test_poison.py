"""
Poison rows: a payload PostgreSQL stores but Python cannot parse fails its own
job, never the sweep, never the worker's start-up (issue #9).

The rows are written by plain SQL, as another writer of the table could.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import attrs

from nasiko_queue import Database, Queue
from nasiko_queue.builds.store import PgJobStore
from nasiko_queue.engine.contracts import INVALID_PAYLOAD, MAX_ATTEMPTS_EXCEEDED, RecoveryResult
from nasiko_queue.testing import (
    KINDS,
    enqueue_with_target,
    insert_agent,
    insert_agent_build,
    make_payload,
)

from .helpers import (
    LogEvent,
    agent_state,
    build_state,
    executors_for_all,
    job_row,
    running,
    succeed,
)

#: Deeper than Python's recursion limit (1000): `json.loads` raises RecursionError.
DEPTH = 1200


async def _insert(db: Database, payload_text: str, *, prior_success: bool = True,
                  status: str = "pending", attempt: int = 0, stuck: bool = False
                  ) -> tuple[uuid.UUID, uuid.UUID, uuid.UUID]:
    """A job for a new agent with a queued build, its payload given as JSON text."""
    owner = uuid.uuid4()
    agent = await insert_agent(db, owner_id=owner)
    if prior_success:
        await insert_agent_build(db, agent, status="success", version_tag="v0")
    build = await insert_agent_build(db, agent)
    text = payload_text.replace("$BUILD", str(build))
    job = await db.fetchval(
        "INSERT INTO build_jobs (agent_id, owner_id, payload, status, attempt, picked_at) "
        "VALUES ($1, $2, $3::jsonb, $4, $5, "
        "        CASE WHEN $6 THEN now() - interval '2 hours' END) RETURNING id",
        agent, owner, text, status, attempt, stuck)
    return job, agent, build


def _deep(build: str = "$BUILD") -> str:
    """A payload that names its kind and build, with a value nested DEPTH levels deep."""
    return (f'{{"kind": "Upload", "build_id": "{build}", "deep": '
            + "[" * DEPTH + "]" * DEPTH + "}")


def _store(queue: Queue) -> PgJobStore:
    kinds = frozenset(KINDS)
    return PgJobStore(queue.db, queue.config, runnable_kinds=kinds, known_kinds=kinds)


def test_the_poison_payload_really_defeats_json_loads() -> None:
    """The premise: this JSON is valid, and Python's parser gives up on it."""
    import pytest

    with pytest.raises(RecursionError):
        json.loads(_deep("x"))


async def test_a_payload_too_deep_for_python_fails_as_invalid_and_terminalizes(
    queue: Queue,
) -> None:
    job, agent, build = await _insert(queue.db, _deep())
    good = await enqueue_with_target(queue, "Upload")
    async with running(queue, executors_for_all(succeed)) as worker:
        await worker.drain_once()
    row = await job_row(queue.db, job)
    assert row is not None
    assert (row["status"], row["attempt"], row["error_msg"]) == ("failed", 1, INVALID_PAYLOAD)
    assert await build_state(queue.db, build) == "failed"   # its own build, read by SQL
    assert await agent_state(queue.db, agent) == "failed"   # terminalized (it had built)
    assert (await job_row(queue.db, good.job_id) or {})["status"] == "done"


async def test_a_poison_row_out_of_attempts_does_not_stop_the_sweep_for_the_others(
    queue: Queue,
) -> None:
    """Each stuck job's recovery is independent: the poison one fails and its target
    is terminalized, and so does an ordinary one, and the one with attempts left
    goes back to pending."""
    poison, poison_agent, poison_build = await _insert(
        queue.db, _deep(), status="in_progress", attempt=3, stuck=True)
    valid = json.dumps(queue._codec.encode(make_payload(
        "Upload", target_id=uuid.uuid4(), build_id=uuid.uuid4(), owner_id=uuid.uuid4())))
    plain, plain_agent, _ = await _insert(queue.db, valid, prior_success=False,
                                          status="in_progress", attempt=3, stuck=True)
    again, _, _ = await _insert(queue.db, valid, status="in_progress", attempt=1, stuck=True)
    assert await _store(queue).recover() == RecoveryResult(failed=2, reset=1)
    row = await job_row(queue.db, poison)
    assert row is not None
    assert (row["status"], row["error_msg"]) == ("failed", MAX_ATTEMPTS_EXCEEDED)
    assert await build_state(queue.db, poison_build) == "failed"
    assert await agent_state(queue.db, poison_agent) == "failed"
    assert await agent_state(queue.db, plain_agent) is None     # never built: deleted
    assert await job_row(queue.db, plain) is None
    assert (await job_row(queue.db, again) or {})["status"] == "pending"


async def test_the_worker_starts_when_its_startup_sweep_fails_on_the_merits(
    queue: Queue, db: Database
) -> None:
    """An error the database gives on its merits (here a trigger that refuses the
    sweep's reset) is logged, and the worker starts and runs jobs anyway; only an
    outage is waited out."""
    await db.execute("""
        CREATE FUNCTION refuse_reset() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            IF OLD.status = 'in_progress' AND NEW.status = 'pending' THEN
                RAISE EXCEPTION 'resets are refused here';
            END IF;
            RETURN NEW;
        END;
        $$;
        CREATE TRIGGER refuse_reset BEFORE UPDATE ON build_jobs
            FOR EACH ROW EXECUTE FUNCTION refuse_reset();
    """)
    await _insert(db, _deep(), status="in_progress", attempt=1, stuck=True)
    with LogEvent("startup recovery failed") as failed:
        async with running(queue, executors_for_all(succeed)) as worker:
            good = await enqueue_with_target(queue, "Upload")
            await worker.drain_once()
    assert failed.count == 1
    assert (await job_row(db, good.job_id) or {})["status"] == "done"


async def test_an_oversized_payload_from_another_writer_fails_as_invalid_unread(
    queue: Queue,
) -> None:
    """Enqueue refuses payloads over `max_payload_bytes`; one that another writer
    stored anyway is not sent by the claim (it comes back empty) and fails as
    invalid, its target terminalized, instead of being parsed and run."""
    small = Queue(queue.db, config=attrs.evolve(queue.config, max_payload_bytes=2000),
                  secrets=queue.secrets)
    body: dict[str, Any] = queue._codec.encode(make_payload(
        "Upload", target_id=uuid.uuid4(), build_id=uuid.uuid4(), owner_id=uuid.uuid4()))
    body["build_id"] = "$BUILD"
    body["padding"] = "x" * 5000  # unknown keys are ignored: valid but for its size
    job, agent, build = await _insert(queue.db, json.dumps(body))
    claimed = await _store(small).claim(1)
    assert [(j.id, j.payload) for j in claimed] == [(job, None)]
    await queue.db.execute("UPDATE build_jobs SET status = 'pending', attempt = 0 "
                           "WHERE id = $1", job)
    runs: list[Any] = []

    async def run(ctx: Any) -> None:
        runs.append(ctx.job_id)
        await succeed(ctx)

    async with running(small, executors_for_all(run)) as worker:
        await worker.drain_once()
    row = await job_row(queue.db, job)
    assert row is not None
    assert (row["status"], row["error_msg"]) == ("failed", INVALID_PAYLOAD)
    assert runs == []
    assert await build_state(queue.db, build) == "failed"
    assert await agent_state(queue.db, agent) == "failed"


async def test_a_payload_at_the_bound_still_runs(queue: Queue) -> None:
    """The bound is inclusive of a payload exactly as large as enqueue allows."""
    job = await enqueue_with_target(queue, "Upload")
    size = await queue.db.fetchval(
        "SELECT octet_length(payload::text) FROM build_jobs WHERE id = $1", job.job_id)
    exact = Queue(queue.db, config=attrs.evolve(queue.config, max_payload_bytes=size),
                  secrets=queue.secrets)
    async with running(exact, executors_for_all(succeed)) as worker:
        await worker.drain_once()
    assert (await job_row(queue.db, job.job_id) or {})["status"] == "done"
