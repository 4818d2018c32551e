"""
Errors are kept (issue #11): every crashed or timed-out attempt stores what the
executor raised, with the payload's secrets masked, in a table that outlives the
job row; `build_jobs.error_msg` keeps the fixed messages of docs/rules.md.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from datetime import timedelta
from typing import Any
from urllib.parse import quote, urlencode

import attrs
import pytest
import trio

from nasiko_queue import Database, JobContext, Queue, job_errors
from nasiko_queue.admin.retention import prune
from nasiko_queue.builds.store import JOB_PANICKED
from nasiko_queue.job_errors import MAX_MESSAGE, MAX_TRACEBACK, describe, secret_values
from nasiko_queue.testing import enqueue_with_target

from .conftest import FAST, MASTER_KEY
from .helpers import executors_for_all, job_row, running

TOKEN = "tok-5f3a9c1e-secret"


class DeployRefused(RuntimeError):
    pass


async def _refuse(ctx: JobContext[Any]) -> None:
    """An executor that quotes its secret in the error it raises (a careless one)."""
    token = ctx.payload.env["API_TOKEN"].reveal()
    raise DeployRefused(f"registry refused token {token} on attempt {ctx.attempt}")


async def test_each_crashed_attempt_keeps_its_error_with_secrets_masked(
    queue: Queue, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    job = await enqueue_with_target(queue, "Upload", prior_success=True,
                                    env={"API_TOKEN": TOKEN, "LOG_LEVEL": "info"})
    async with running(queue, executors_for_all(_refuse)) as worker:
        with trio.fail_after(20):
            await worker.wait_for(lambda s: s.failed >= 1)
        me = worker.heartbeat.identity
    assert me is not None
    row = await job_row(queue.db, job.job_id)
    assert row is not None
    assert (row["status"], row["attempt"], row["error_msg"]) == ("failed", 3, JOB_PANICKED)

    errors = await job_errors(queue.db, job.job_id)
    assert [(e.attempt, e.reason, e.error_type, e.worker_id) for e in errors] == [
        (n, "crash", "tests.test_job_errors.DeployRefused", me.id) for n in (1, 2, 3)]
    assert [e.message for e in errors] == [
        f"registry refused token ******** on attempt {n}" for n in (1, 2, 3)]
    for e in errors:
        assert "in _refuse" in e.traceback
        assert e.traceback.rstrip().endswith(e.message)
        assert e.at is not None
    stored = await queue.db.fetchval(
        "SELECT string_agg(message || traceback, '') FROM nasiko_queue_job_errors")
    assert TOKEN not in stored
    # The worker's log shows the masked error too, never the token.
    assert "registry refused token ********" in caplog.text
    assert TOKEN not in caplog.text


async def test_errors_outlive_a_job_deleted_with_its_target(queue: Queue) -> None:
    """A never-built agent is deleted with its job when the job fails for good
    (docs/rules.md §6); the errors are what is left to inspect."""
    job = await enqueue_with_target(queue, "Upload", env={"API_TOKEN": TOKEN})
    async with running(queue, executors_for_all(_refuse)) as worker:
        with trio.fail_after(20):
            await worker.wait_for(lambda s: s.failed >= 1)
    assert await job_row(queue.db, job.job_id) is None
    assert [e.attempt for e in await job_errors(queue.db, job.job_id)] == [1, 2, 3]


async def test_a_run_past_its_limit_keeps_a_timeout(db: Database) -> None:
    async def hang(ctx: JobContext[Any]) -> None:
        await trio.sleep_forever()

    queue = Queue(db, config=attrs.evolve(FAST, job_timeout=0.1), secrets=MASTER_KEY)
    job = await enqueue_with_target(queue, "Rollback", prior_success=True)
    await db.execute("UPDATE build_jobs SET attempt = 2 WHERE id = $1", job.job_id)
    async with running(queue, executors_for_all(hang)) as worker:
        with trio.fail_after(20):
            await worker.wait_for(lambda s: s.failed >= 1)
    (error,) = await job_errors(db, job.job_id)
    assert (error.attempt, error.reason, error.error_type, error.message) == (
        3, "timeout", "nasiko_queue.JobTimeout", "ran past its limit of 0.1s")


async def test_kept_errors_go_with_their_job_not_before(queue: Queue) -> None:
    """Retention deletes a job's kept errors once the job itself is gone, never
    while the job is kept. It used to delete each error by its own age: a job
    that failed today after a long life lost its first attempts' errors."""
    job = await enqueue_with_target(queue, "Upload", prior_success=True,
                                    env={"API_TOKEN": TOKEN})
    async with running(queue, executors_for_all(_refuse)) as worker:
        with trio.fail_after(20):
            await worker.wait_for(lambda s: s.failed >= 1)
    await queue.db.execute("UPDATE nasiko_queue_job_errors SET at = at - interval '2 days' "
                           "WHERE attempt < 3")
    assert await prune(queue.db, timedelta(days=1)) == 0
    assert [e.attempt for e in await job_errors(queue.db, job.job_id)] == [1, 2, 3]
    await queue.db.execute("UPDATE build_jobs SET completed_at = now() - interval '2 days' "
                           "WHERE id = $1", job.job_id)
    await queue.db.execute("UPDATE nasiko_queue_job_errors SET at = now() - interval '2 days'")
    assert await prune(queue.db, timedelta(days=1)) == 1
    assert await job_errors(queue.db, job.job_id) == []


async def test_a_waiting_job_keeps_its_old_errors_through_retention(queue: Queue) -> None:
    """A plain job waiting out a long backoff after a crash, its error older than
    the retention: the job is alive, so its error (and an operator's action on
    it) stays."""
    from nasiko_queue.admin import jobs as job_admin

    from .test_plain_jobs import Step

    job_id = await queue.enqueue(Step(n=1))
    await queue.db.execute(
        "UPDATE nasiko_queue_jobs SET attempt = 1, run_at = now() + interval '1 hour' "
        "WHERE id = $1", job_id)
    await queue.db.execute(
        "INSERT INTO nasiko_queue_job_errors (job_id, attempt, at, reason, error_type, "
        "message, traceback) VALUES ($1, 1, now() - interval '31 days', 'crash', "
        "'RuntimeError', 'boom', '')", job_id)
    async with queue.db.transaction() as tx:
        await job_admin.record(tx, job_id, "run now", "cli")
    await queue.db.execute("UPDATE nasiko_queue_job_events SET at = now() - interval '31 days'")
    await prune(queue.db, timedelta(days=30))
    assert [e.attempt for e in await job_errors(queue.db, job_id)] == [1]
    assert await queue.db.fetchval("SELECT count(*) FROM nasiko_queue_job_events") == 1


def test_a_long_error_is_bounded_and_short_values_are_not_masked() -> None:
    try:
        raise ValueError("x" * (2 * MAX_TRACEBACK) + " level=info")
    except ValueError as exc:
        error = describe(exc, attempt=1, reason="crash", secrets=["info", "1"])
    assert error.message.startswith("x" * MAX_MESSAGE + "… (")
    assert len(error.message) < MAX_MESSAGE + 40
    assert error.traceback.startswith("… (")
    assert len(error.traceback) < MAX_TRACEBACK + 40
    assert error.traceback.rstrip().endswith("level=********")  # 4 characters: masked
    short = describe(ValueError("code a1b"), attempt=1, reason="crash", secrets=["1"])
    assert short.message == "code a1b"  # one character: left alone


ESCAPED = "s3cr'et\\tok/é+=\"x"  # a quote, a backslash, a slash, an accent, + and =


@pytest.mark.parametrize("render", [
    pytest.param(lambda s: f"bad token {s!r}", id="repr"),
    pytest.param(lambda s: f"bad token {s!a}", id="ascii"),
    pytest.param(lambda s: f"in {[s]}", id="a list's repr"),
    pytest.param(lambda s: f"body {json.dumps({'token': s})}", id="json"),
    pytest.param(lambda s: f"body {json.dumps({'token': s}, ensure_ascii=False)}",
                 id="json, not ascii"),
    pytest.param(lambda s: f"GET /v1?token={quote(s, safe='')}", id="url"),
    pytest.param(lambda s: f"GET /v1?{urlencode({'token': s})}", id="form"),
    pytest.param(lambda s: f"bytes {s.encode()!r}", id="bytes"),
])
def test_a_secret_is_masked_in_its_escaped_forms(render: Callable[[str], str]) -> None:
    """
    An executor that wrote ``{token!r}`` of a value holding a quote or a
    backslash left the escaped form unmasked in the kept message, the
    traceback, the row's error_msg and the worker's log (found by a bug hunt).
    """
    try:
        raise RuntimeError(render(ESCAPED))
    except RuntimeError as exc:
        error = describe(exc, attempt=1, reason="crash", secrets=[ESCAPED])
    assert "********" in error.message
    for text in (error.message, error.traceback):
        assert "s3cr" not in text, text


def test_secret_values_are_found_in_every_secret_field() -> None:
    from nasiko_queue.testing import make_payload

    payload = make_payload("McpServerUpload", target_id=_uuid(), build_id=_uuid(),
                           owner_id=_uuid(), name="n", env={"A": "alpha-secret"})
    assert secret_values(payload) == ["alpha-secret"]
    assert secret_values("not a payload") == []


def _uuid() -> Any:
    import uuid

    return uuid.uuid4()


def test_a_shown_payload_masks_secret_fields_plaintext_or_sealed() -> None:
    """`nasiko-queue job` shows payloads: a table shared with the original holds the
    agent kinds' env in plaintext (seal_agent_env=False); it is masked all the same,
    as is a sealed token in any field; nothing else changes."""
    from nasiko_queue.admin.view import mask_payload

    stored = {"kind": "Upload", "name": "crawler", "ports": [8000],
              "env": {"API_TOKEN": "plain-token", "LOG_LEVEL": "info"},
              "note": "nq1:AAAA"}
    assert mask_payload(stored) == {
        "kind": "Upload", "name": "crawler", "ports": [8000],
        "env": {"API_TOKEN": "********", "LOG_LEVEL": "********"}, "note": "********"}
    assert mask_payload({"kind": "Unknown", "env": {"A": "kept"}}) == {
        "kind": "Unknown", "env": {"A": "kept"}}
