"""
The worker against a real PostgreSQL: every transition of SPEC.md §5–§8.

Each test states the rule it guards. Timers are kept short through `FAST`
(conftest); nothing sleeps to wait for an outcome: `Worker.drain_once()` returns
when a drain that began after the call has finished.
"""

from __future__ import annotations

import json
import uuid
from typing import Any, ClassVar

import attrs
import pytest
import trio

from nasiko_queue import (
    Executors,
    JobContext,
    Payload,
    Queue,
    QueueConfig,
    Target,
    Update,
    Upload,
    Worker,
)
from nasiko_queue.builds.store import BUILD_FAILED, JOB_PANICKED, TARGET_DELETED
from nasiko_queue.engine.contracts import INVALID_PAYLOAD, MAX_ATTEMPTS_EXCEEDED
from nasiko_queue.testing import (
    KINDS,
    enqueue_with_target,
    insert_agent,
    insert_agent_build,
    set_build_status,
)

from .helpers import (
    TEST_DEADLINE,
    agent_state,
    build_state,
    connector_state,
    executors_for_all,
    fail_build,
    job_row,
    running,
    succeed,
)


class Boom(Exception):
    """An executor's crash."""


# -- outcomes read back from the build tables --------------------------------------


@pytest.mark.parametrize("kind", KINDS)
async def test_success_of_each_kind_is_done(queue: Queue, kind: str) -> None:
    """The executor wrote 'success' to its build row (either table): the job is done."""
    job = await enqueue_with_target(queue, kind)
    async with running(queue, executors_for_all(succeed)) as worker:
        await worker.drain_once()
    row = await job_row(queue.db, job.job_id)
    assert row is not None
    assert (row["status"], row["attempt"], row["error_msg"]) == ("done", 1, None)
    assert row["completed_at"] is not None
    assert row["picked_at"] is not None  # done rows keep the claim time


@pytest.mark.parametrize("kind", ["Upload", "McpServerUpload"])
async def test_failed_build_fails_job_without_retry(queue: Queue, kind: str) -> None:
    """A build row left 'failed' fails the job with the fixed message; no second run."""
    runs: list[int] = []

    async def run(ctx: JobContext[Any]) -> None:
        runs.append(ctx.attempt)
        await fail_build(ctx)

    job = await enqueue_with_target(queue, kind)
    async with running(queue, executors_for_all(run)) as worker:
        await worker.drain_once()
    row = await job_row(queue.db, job.job_id)
    assert row is not None
    assert (row["status"], row["error_msg"]) == ("failed", BUILD_FAILED)
    assert runs == [1]


@pytest.mark.parametrize("kind", ["Update", "McpServerUpload"])
async def test_untouched_or_missing_build_row_fails_job(queue: Queue, kind: str) -> None:
    """An executor that returns without writing 'success' (or whose row is gone) fails."""

    async def run(ctx: JobContext[Any]) -> None:
        table = "mcp_connector_builds" if kind == "McpServerUpload" else "agent_builds"
        await ctx.db.execute(f"DELETE FROM {table} WHERE id = $1", ctx.payload.build_id)

    job = await enqueue_with_target(queue, kind)
    async with running(queue, executors_for_all(run)) as worker:
        await worker.drain_once()
    row = await job_row(queue.db, job.job_id)
    assert row is not None
    assert (row["status"], row["error_msg"]) == ("failed", BUILD_FAILED)


async def test_building_build_row_is_not_success(queue: Queue) -> None:
    job = await enqueue_with_target(queue, "Rollback")

    async def run(ctx: JobContext[Any]) -> None:
        await set_build_status(ctx.db, ctx.payload, "building")

    async with running(queue, executors_for_all(run)) as worker:
        await worker.drain_once()
    row = await job_row(queue.db, job.job_id)
    assert row is not None
    assert row["status"] == "failed"


# -- the attempt cap -------------------------------------------------------------------


@pytest.mark.parametrize(("stored_attempt", "runs"), [(2, 1), (3, 0), (7, 0)])
async def test_cap_is_checked_before_running(queue: Queue, stored_attempt: int, runs: int) -> None:
    """old_attempt >= MAX_ATTEMPTS: failed 'max attempts exceeded' without running."""
    ran: list[int] = []

    async def run(ctx: JobContext[Any]) -> None:
        ran.append(ctx.attempt)
        await succeed(ctx)

    job = await enqueue_with_target(queue, "Upload", prior_success=True)
    await queue.db.execute("UPDATE build_jobs SET attempt = $2 WHERE id = $1",
                           job.job_id, stored_attempt)
    async with running(queue, executors_for_all(run)) as worker:
        await worker.drain_once()
    row = await job_row(queue.db, job.job_id)
    assert row is not None
    assert len(ran) == runs
    if runs:
        assert (row["status"], row["attempt"]) == ("done", stored_attempt + 1)
    else:
        assert (row["status"], row["error_msg"]) == ("failed", MAX_ATTEMPTS_EXCEEDED)
        assert row["attempt"] == stored_attempt + 1
        # Terminalized: the agent has a successful build, so it stays and fails.
        assert await agent_state(queue.db, job.target_id) == "failed"
        assert await build_state(queue.db, job.build_id) == "failed"


async def test_cap_follows_configured_max_attempts(db: Any) -> None:
    from .conftest import FAST, MASTER_KEY

    queue = Queue(db, config=QueueConfig(**{**_fields(FAST), "build_max_attempts": 5}),
                  secrets=MASTER_KEY)
    runs: list[int] = []

    async def always(ctx: JobContext[Any]) -> None:
        runs.append(ctx.attempt)
        raise Boom

    job = await enqueue_with_target(queue, "Upload")
    async with running(queue, executors_for_all(always)) as worker:
        await worker.drain_once()
    assert runs == [1, 2, 3, 4, 5]
    assert await job_row(queue.db, job.job_id) is None  # agent never built: deleted


def _fields(config: QueueConfig) -> dict[str, Any]:
    import attrs

    return attrs.asdict(config)


# -- panics -------------------------------------------------------------------------------


@pytest.mark.parametrize("failures", [1, 2])
async def test_panics_are_retried_at_once(queue: Queue, failures: int) -> None:
    """A raise with attempts left: back to pending, retried in the same drain."""
    runs: list[int] = []

    async def flaky(ctx: JobContext[Any]) -> None:
        runs.append(ctx.attempt)
        if len(runs) <= failures:
            raise Boom(f"crash {len(runs)}")
        await succeed(ctx)

    job = await enqueue_with_target(queue, "Update")
    async with running(queue, executors_for_all(flaky)) as worker:
        await worker.drain_once()
    row = await job_row(queue.db, job.job_id)
    assert row is not None
    assert runs == list(range(1, failures + 2))
    assert (row["status"], row["attempt"], row["error_msg"]) == ("done", failures + 1, None)


async def test_a_task_the_executor_starts_that_raises_is_a_panic_of_its_job(
        queue: Queue) -> None:
    """
    The executor runs in its slot's task, not in a nursery of ours: a task it
    starts in a nursery of its own that raises is still its job's crash (kept
    with the task's message, retried at once), and the worker goes on.
    """
    runs: list[int] = []

    async def with_helper_task(ctx: JobContext[Any]) -> None:
        runs.append(ctx.attempt)

        async def upload_logs() -> None:
            if ctx.attempt == 1:
                raise Boom("log upload failed")

        async with trio.open_nursery() as nursery:
            nursery.start_soon(upload_logs)
        await succeed(ctx)

    job = await enqueue_with_target(queue, "Upload")
    async with running(queue, executors_for_all(with_helper_task)) as worker:
        await worker.drain_once()
        assert (worker.stats.panicked, worker.stats.done) == (1, 1)
    assert runs == [1, 2]
    row = await job_row(queue.db, job.job_id)
    assert row is not None
    assert (row["status"], row["attempt"]) == ("done", 2)
    errors = await queue.db.fetch(
        "SELECT message FROM nasiko_queue_job_errors WHERE job_id = $1", job.job_id)
    assert [e["message"] for e in errors] == ["log upload failed"]


@pytest.mark.parametrize("prior_success", [False, True])
async def test_always_panicking_job_runs_three_times(queue: Queue, prior_success: bool) -> None:
    """
    SPEC §5 [decision]: the third panic fails the job 'job panicked during
    execution' with attempt = 3 (not the original's attempt 4) and terminalizes.
    """
    runs: list[int] = []

    async def always(ctx: JobContext[Any]) -> None:
        runs.append(ctx.attempt)
        await set_build_status(ctx.db, ctx.payload, "building")
        raise Boom("always")

    job = await enqueue_with_target(queue, "GithubClone", prior_success=prior_success)
    async with running(queue, executors_for_all(always)) as worker:
        await worker.drain_once()
    assert runs == [1, 2, 3]
    row = await job_row(queue.db, job.job_id)
    if prior_success:
        assert row is not None
        assert (row["status"], row["attempt"], row["error_msg"]) == ("failed", 3, JOB_PANICKED)
        assert await agent_state(queue.db, job.target_id) == "failed"
        assert await build_state(queue.db, job.build_id) == "failed"
    else:
        # No successful build ever: the agent is deleted, cascading to build and job.
        assert row is None
        assert await agent_state(queue.db, job.target_id) is None


async def test_panic_reset_clears_picked_at_and_keeps_attempt(queue: Queue) -> None:
    """After a panic with attempts left the row is pending, picked_at NULL, attempt 1."""
    seen: list[dict[str, Any] | None] = []
    job_ids: list[uuid.UUID] = []

    async def crash_then_look(ctx: JobContext[Any]) -> None:
        if ctx.attempt == 1:
            raise Boom
        # Second run: the row as the reset left it, before this claim, is gone;
        # what we can check is the claim's view: attempt 2 means the first counted.
        seen.append(await job_row(ctx.db, ctx.job_id))
        await succeed(ctx)

    job = await enqueue_with_target(queue, "Upload")
    job_ids.append(job.job_id)
    async with running(queue, executors_for_all(crash_then_look)) as worker:
        await worker.drain_once()
    assert seen[0] is not None
    assert (seen[0]["status"], seen[0]["attempt"]) == ("in_progress", 2)


async def test_panic_log_has_traceback_but_row_has_fixed_message(
    queue: Queue, caplog: pytest.LogCaptureFixture
) -> None:
    async def always(ctx: JobContext[Any]) -> None:
        raise Boom("raw detail that must not reach the row")

    job = await enqueue_with_target(queue, "Upload", prior_success=True)
    async with running(queue, executors_for_all(always)) as worker:
        await worker.drain_once()
    row = await job_row(queue.db, job.job_id)
    assert row is not None
    assert row["error_msg"] == JOB_PANICKED
    assert "raw detail that must not reach the row" in caplog.text
    assert "Traceback" in caplog.text


# -- terminalization (SPEC §6) -----------------------------------------------------------------


async def test_terminalize_agent_without_success_deletes_it(queue: Queue) -> None:
    job = await enqueue_with_target(queue, "Upload")
    await queue.db.execute("UPDATE build_jobs SET attempt = 3 WHERE id = $1", job.job_id)
    async with running(queue, executors_for_all(succeed)) as worker:
        await worker.drain_once()
    assert await agent_state(queue.db, job.target_id) is None
    assert await build_state(queue.db, job.build_id) is None
    assert await job_row(queue.db, job.job_id) is None


async def test_terminalize_agent_with_success_fails_only_unfinished(queue: Queue) -> None:
    """Building builds and the job's own queued build fail; the success stays; other
    queued builds are left alone; the deploying agent becomes failed."""
    job = await enqueue_with_target(queue, "Update", prior_success=True)
    other_building = await insert_agent_build(queue.db, job.target_id, status="building",
                                              version_tag="vb")
    other_queued = await insert_agent_build(queue.db, job.target_id, status="queued",
                                            version_tag="vq")
    await queue.db.execute("UPDATE build_jobs SET attempt = 3 WHERE id = $1", job.job_id)
    async with running(queue, executors_for_all(succeed)) as worker:
        await worker.drain_once()
    assert await agent_state(queue.db, job.target_id) == "failed"
    assert await build_state(queue.db, job.build_id) == "failed"
    assert await build_state(queue.db, other_building) == "failed"
    assert await build_state(queue.db, other_queued) == "queued"
    successes = await queue.db.fetchval(
        "SELECT count(*) FROM agent_builds WHERE agent_id = $1 AND status = 'success'",
        job.target_id)
    assert successes == 1


async def test_terminalize_running_agent_stays_running(queue: Queue) -> None:
    """[decision] Only a 'deploying' agent is marked failed; a running one keeps serving."""
    job = await enqueue_with_target(queue, "Rollback", prior_success=True, agent_status="running")
    await queue.db.execute("UPDATE build_jobs SET attempt = 3 WHERE id = $1", job.job_id)
    async with running(queue, executors_for_all(succeed)) as worker:
        await worker.drain_once()
    assert await agent_state(queue.db, job.target_id) == "running"
    assert await build_state(queue.db, job.build_id) == "failed"


@pytest.mark.parametrize("prior_success", [False, True])
async def test_terminalize_connector(queue: Queue, prior_success: bool) -> None:
    job = await enqueue_with_target(queue, "McpServerUpload", prior_success=prior_success,
                                    env={"TOKEN": "t0p-s3cret"})

    async def always(ctx: JobContext[Any]) -> None:
        await set_build_status(ctx.db, ctx.payload, "building")
        raise Boom

    async with running(queue, executors_for_all(always)) as worker:
        await worker.drain_once()
    if prior_success:
        assert await connector_state(queue.db, job.target_id) == "failed"
        assert await build_state(queue.db, job.build_id, connector=True) == "failed"
        completed = await queue.db.fetchval(
            "SELECT completed_at FROM mcp_connector_builds WHERE id = $1", job.build_id)
        assert completed is not None
        row = await job_row(queue.db, job.job_id)
        assert row is not None
        assert (row["status"], row["attempt"]) == ("failed", 3)
    else:
        assert await connector_state(queue.db, job.target_id) is None
        assert await job_row(queue.db, job.job_id) is None


# -- targets deleted -------------------------------------------------------------------------


async def test_target_hard_deleted_mid_build(queue: Queue) -> None:
    """The cascade removed the job row: the final update touches 0 rows; the worker
    goes on with the next job."""
    victim = await enqueue_with_target(queue, "Upload")
    after = await enqueue_with_target(queue, "Upload")

    async def run(ctx: JobContext[Any]) -> None:
        if ctx.job_id == victim.job_id:
            await ctx.db.execute("DELETE FROM agents WHERE id = $1", ctx.target.agent_id)
            return
        await succeed(ctx)

    async with running(queue, executors_for_all(run)) as worker:
        await worker.drain_once()
        assert worker.stats.done == 1
    assert await job_row(queue.db, victim.job_id) is None
    row = await job_row(queue.db, after.job_id)
    assert row is not None
    assert row["status"] == "done"


async def test_connector_hard_deleted_mid_build(queue: Queue) -> None:
    job = await enqueue_with_target(queue, "McpServerUpload")

    async def run(ctx: JobContext[Any]) -> None:
        await ctx.db.execute("DELETE FROM mcp_connectors WHERE id = $1", ctx.target.connector_id)

    async with running(queue, executors_for_all(run)) as worker:
        await worker.drain_once()
    assert await job_row(queue.db, job.job_id) is None


async def test_soft_deleted_target_is_not_run(queue: Queue) -> None:
    """[decision] deleted_at set: failed 'target deleted', the executor never runs,
    the agent row stays (it is the application's history), its build row ends."""
    ran: list[uuid.UUID] = []

    async def run(ctx: JobContext[Any]) -> None:
        ran.append(ctx.job_id)
        await succeed(ctx)

    job = await enqueue_with_target(queue, "Upload", deleted=True)
    async with running(queue, executors_for_all(run)) as worker:
        await worker.drain_once()
    row = await job_row(queue.db, job.job_id)
    assert row is not None
    assert (row["status"], row["error_msg"], row["attempt"]) == ("failed", TARGET_DELETED, 1)
    assert ran == []
    assert await agent_state(queue.db, job.target_id) == "deploying"
    assert await build_state(queue.db, job.build_id) == "failed"


# -- invalid payloads -----------------------------------------------------------------------


async def _insert_raw(queue: Queue, payload: object, *, agent_build: bool = True) -> tuple[
        uuid.UUID, uuid.UUID, uuid.UUID | None]:
    owner = uuid.uuid4()
    agent = await insert_agent(queue.db, owner_id=owner)
    build = await insert_agent_build(queue.db, agent) if agent_build else None
    if isinstance(payload, dict) and build is not None:
        payload = {**payload, "build_id": str(build)}
    job_id = await queue.db.fetchval(
        "INSERT INTO build_jobs (agent_id, owner_id, payload) VALUES ($1, $2, $3::jsonb) "
        "RETURNING id", agent, owner, json.dumps(payload))
    return job_id, agent, build


@pytest.mark.parametrize("payload", [
    {"kind": "Upload"},                                  # missing fields
    {"kind": "Frobnicate", "x": 1},                      # unknown kind
    {"no_kind": True},                                   # missing kind
    {"kind": "Upload", "ports": [70000]},                # wrong type
    ["not", "an", "object"],
    "just a string",
])
async def test_invalid_payload_fails_one_job_and_worker_goes_on(
    queue: Queue, payload: object
) -> None:
    """[decision] failed 'invalid job payload', target terminalized; the next job runs."""
    bad_id, agent, build = await _insert_raw(queue, payload)
    await queue.db.execute(  # a successful earlier build keeps the agent row to look at
        "INSERT INTO agent_builds (agent_id, version_tag, image_reference, status) "
        "VALUES ($1, 'v0', 'img', 'success')", agent)
    good = await enqueue_with_target(queue, "Upload")
    async with running(queue, executors_for_all(succeed)) as worker:
        await worker.drain_once()
    row = await job_row(queue.db, bad_id)
    assert row is not None
    assert (row["status"], row["error_msg"]) == ("failed", INVALID_PAYLOAD)
    assert await agent_state(queue.db, agent) == "failed"
    if isinstance(payload, dict) and build is not None:
        assert await build_state(queue.db, build) == "failed"  # its own queued build ended
    good_row = await job_row(queue.db, good.job_id)
    assert good_row is not None
    assert good_row["status"] == "done"


async def test_invalid_payload_of_never_built_agent_deletes_it(queue: Queue) -> None:
    bad_id, agent, _ = await _insert_raw(queue, {"kind": "Upload"})
    async with running(queue, executors_for_all(succeed)) as worker:
        await worker.drain_once()
    assert await job_row(queue.db, bad_id) is None
    assert await agent_state(queue.db, agent) is None


# -- which jobs a replica claims -----------------------------------------------------------


async def test_replica_claims_only_its_kinds_and_unknown_ones(queue: Queue) -> None:
    """[decision] A worker with only an Upload executor leaves Update jobs pending, and
    still fails jobs of a kind no payload type knows."""
    executors = Executors()
    executors.register(Upload, succeed)
    upload = await enqueue_with_target(queue, "Upload")
    update = await enqueue_with_target(queue, "Update")
    unknown, _, _ = await _insert_raw(queue, {"kind": "NoSuchKind"})
    async with running(queue, executors) as worker:
        await worker.drain_once()
    assert (await job_row(queue.db, upload.job_id) or {})["status"] == "done"
    update_row = await job_row(queue.db, update.job_id)
    assert update_row is not None
    assert (update_row["status"], update_row["attempt"]) == ("pending", 0)
    unknown_row = await job_row(queue.db, unknown)
    assert unknown_row is None or unknown_row["error_msg"] == INVALID_PAYLOAD

    other = Executors()
    other.register(Update, succeed)
    async with running(queue, other) as worker:
        await worker.drain_once()
    assert (await job_row(queue.db, update.job_id) or {})["status"] == "done"


async def test_jobs_run_oldest_first(queue: Queue) -> None:
    order: list[uuid.UUID] = []

    async def run(ctx: JobContext[Any]) -> None:
        order.append(ctx.job_id)
        await succeed(ctx)

    jobs = [await enqueue_with_target(queue, kind) for kind in KINDS]
    async with running(queue, executors_for_all(run)) as worker:
        await worker.drain_once()
    assert order == [j.job_id for j in jobs]


# -- secrets ------------------------------------------------------------------------------------


async def test_mcp_env_is_sealed_at_rest_and_open_for_the_executor(
    queue: Queue, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("DEBUG")
    secret = "sk-live-" + uuid.uuid4().hex
    received: dict[str, str] = {}

    async def run(ctx: JobContext[Any]) -> None:
        received.update({k: v.reveal() for k, v in ctx.payload.env.items()})
        await succeed(ctx)

    job = await enqueue_with_target(queue, "McpServerUpload", env={"API_KEY": secret})
    stored = await queue.db.fetchval("SELECT payload::text FROM build_jobs WHERE id = $1",
                                     job.job_id)
    assert secret not in stored
    assert "API_KEY" in stored
    async with running(queue, executors_for_all(run)) as worker:
        await worker.drain_once()
    assert received == {"API_KEY": secret}
    assert secret not in caplog.text
    assert secret not in repr(job.payload)


async def test_value_that_does_not_decrypt_is_dropped(queue: Queue,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    received: list[dict[str, str]] = []

    async def run(ctx: JobContext[Any]) -> None:
        received.append({k: v.reveal() for k, v in ctx.payload.env.items()})
        await succeed(ctx)

    job = await enqueue_with_target(queue, "McpServerUpload", env={"GOOD": "g", "BAD": "b"})
    await queue.db.execute(
        "UPDATE build_jobs SET payload = jsonb_set(payload, '{env,BAD}', '\"nq1:garbage\"') "
        "WHERE id = $1", job.job_id)
    async with running(queue, executors_for_all(run)) as worker:
        await worker.drain_once()
    assert received == [{"GOOD": "g"}]
    assert "BAD" in caplog.text
    assert (await job_row(queue.db, job.job_id) or {})["status"] == "done"


# -- shutdown (SPEC §8) ---------------------------------------------------------------------------


async def test_graceful_stop_lets_the_running_job_finish(queue: Queue) -> None:
    started = trio.Event()
    release = trio.Event()

    async def slow(ctx: JobContext[Any]) -> None:
        started.set()
        await release.wait()
        await succeed(ctx)

    first = await enqueue_with_target(queue, "Upload")
    second = await enqueue_with_target(queue, "Upload")
    worker = Worker(queue, executors_for_all(slow))
    async with trio.open_nursery() as nursery:
        await nursery.start(worker.run)
        await started.wait()
        worker.stop()
        release.set()
    # run() returned: the running job finished; nothing more was claimed.
    assert (await job_row(queue.db, first.job_id) or {})["status"] == "done"
    second_row = await job_row(queue.db, second.job_id)
    assert second_row is not None
    assert (second_row["status"], second_row["attempt"]) == ("pending", 0)


async def test_hard_stop_puts_running_job_back_at_once(queue: Queue) -> None:
    started = trio.Event()

    async def forever(ctx: JobContext[Any]) -> None:
        started.set()
        await trio.sleep_forever()

    job = await enqueue_with_target(queue, "Upload")
    worker = Worker(queue, executors_for_all(forever))
    async with trio.open_nursery() as nursery:
        await nursery.start(worker.run)
        await started.wait()
        nursery.cancel_scope.cancel()
    row = await job_row(queue.db, job.job_id)
    assert row is not None
    assert (row["status"], row["attempt"], row["picked_at"]) == ("pending", 1, None)
    assert worker.stats.released == 1

    # Another worker takes it straight away, without waiting for a sweep.
    async with running(queue, executors_for_all(succeed)) as again:
        await again.drain_once()
    row = await job_row(queue.db, job.job_id)
    assert row is not None
    assert (row["status"], row["attempt"]) == ("done", 2)


async def test_stop_while_idle_returns(queue: Queue) -> None:
    worker = Worker(queue, executors_for_all(succeed))
    async with trio.open_nursery() as nursery:
        await nursery.start(worker.run)
        worker.stop()
    assert worker.stats.drains_completed >= 1


async def test_a_worker_stopped_before_its_lanes_run_still_drains_each_lane_once(
    queue: Queue,
) -> None:
    """The race behind a flaky `test_stop_while_idle_returns`, made certain: a stop
    that comes before a lane's drain loop first runs. Each lane still runs one
    (empty) drain and ends it, so that `drains_started == drains_completed`."""
    worker = Worker(queue, executors_for_all(succeed))
    worker.stop()
    with trio.fail_after(TEST_DEADLINE):
        async with trio.open_nursery() as nursery:
            await nursery.start(worker.run)
    assert [lane.state.drains_completed for lane in worker.lanes] == [1] * len(worker.lanes)
    assert worker.stats.drains_started == worker.stats.drains_completed


async def test_closing_the_wake_channels_send_side_stops_the_worker(queue: Queue) -> None:
    """docs/rules.md §8: closing the wake channel's send side ends the worker, as
    `stop()` does (the lanes' drain loops, each with its own wake, end with it)."""
    worker = Worker(queue, executors_for_all(succeed))
    with trio.fail_after(TEST_DEADLINE):
        async with trio.open_nursery() as nursery:
            await nursery.start(worker.run)
            await worker.drain_once()
            worker._wake_send.close()
    assert worker.state.stopping.is_set()
    assert all(lane.state.closing for lane in worker.lanes)


async def test_poll_finds_jobs_nobody_woke_for(queue: Queue) -> None:
    """A row written by another process (here: plain SQL, no wake) is found by the
    poll. FAST polls every 0.2 s; we wait on the worker's own signal, not a sleep."""
    async with running(queue, executors_for_all(succeed)) as worker:
        await worker.drain_once()
        owner = uuid.uuid4()
        agent = await insert_agent(queue.db, owner_id=owner)
        build = await insert_agent_build(queue.db, agent)
        payload = {"kind": "Upload", "build_id": str(build), "agent_id": str(agent),
                   "owner_id": str(owner), "upload_id": "u", "name": "n", "zip_path": "/z",
                   "image_tag": "i", "ports": [80], "env": {}, "writable": False}
        await queue.db.execute(
            "INSERT INTO build_jobs (agent_id, owner_id, payload) VALUES ($1, $2, $3::jsonb)",
            agent, owner, json.dumps(payload))
        with trio.fail_after(10):
            await worker.wait_for(lambda stats: stats.done >= 1)
    assert await build_state(queue.db, build) == "success"


async def test_crash_is_retried_at_once_with_several_slots(db: Any) -> None:
    """With concurrency > 1 the drain may have ended when a job crashes; the reset
    wakes the worker so the retry does not wait for the poll (here: an hour)."""
    from .conftest import MASTER_KEY

    queue = Queue(db, config=QueueConfig(concurrency=3, poll_interval=3600.0),
                  secrets=MASTER_KEY)
    runs: list[int] = []

    async def flaky(ctx: JobContext[Any]) -> None:
        runs.append(ctx.attempt)
        if ctx.attempt == 1:
            raise Boom
        await succeed(ctx)

    job = await enqueue_with_target(queue, "Upload")
    async with running(queue, executors_for_all(flaky)) as worker:
        with trio.fail_after(10):
            await worker.wait_for(lambda stats: stats.done >= 1)
    assert runs == [1, 2]
    assert (await job_row(queue.db, job.job_id) or {})["status"] == "done"


@attrs.frozen(kw_only=True)
class BadLabel(Payload):
    """A user's payload type whose label() raises: a bug in a log line's helper."""

    kind: ClassVar[str] = "BadLabel"
    build_id: uuid.UUID
    agent_id: uuid.UUID
    owner_id: uuid.UUID

    def label(self) -> str:
        raise RuntimeError("label bug")

    def target(self) -> Target:
        return Target(agent_id=self.agent_id)

    def job_owner(self) -> uuid.UUID | None:
        return self.owner_id


@attrs.frozen(kw_only=True)
class BadBuildId(Payload):
    """A user's payload type whose build_id raises once the executor has returned."""

    kind: ClassVar[str] = "BadBuildId"
    agent_id: uuid.UUID
    owner_id: uuid.UUID

    @property
    def build_id(self) -> uuid.UUID:
        raise RuntimeError("build_id bug")

    def label(self) -> str:
        return "bad-build-id"

    def target(self) -> Target:
        return Target(agent_id=self.agent_id)

    def job_owner(self) -> uuid.UUID | None:
        return self.owner_id


async def test_a_label_that_raises_does_not_stop_the_job(queue: Queue) -> None:
    """label() is only for log lines: its bug is shown in the log, the job runs."""
    executors = executors_for_all(succeed)
    executors.register(BadLabel, succeed)
    owner = uuid.uuid4()
    agent = await insert_agent(queue.db, owner_id=owner)
    build = await insert_agent_build(queue.db, agent)
    job_id = await queue.enqueue(BadLabel(build_id=build, agent_id=agent, owner_id=owner))
    async with running(queue, executors) as worker:
        await worker.drain_once()
    assert (await job_row(queue.db, job_id) or {})["status"] == "done"


async def test_an_internal_error_counts_as_a_crash_and_the_worker_goes_on(queue: Queue) -> None:
    """A bug around a job (here the payload type's own build_id, read once the executor
    has returned) is logged and counted as a crash of that job: retried, then failed
    for good; never left in_progress for the sweep. The loop and the next job go on."""
    runs: list[int] = []

    async def run(ctx: JobContext[Any]) -> None:
        runs.append(ctx.attempt)

    executors = executors_for_all(succeed)
    executors.register(BadBuildId, run)
    owner = uuid.uuid4()
    agent = await insert_agent(queue.db, owner_id=owner)
    broken = await queue.enqueue(BadBuildId(agent_id=agent, owner_id=owner))
    good = await enqueue_with_target(queue, "Upload")
    async with running(queue, executors) as worker:
        await worker.drain_once()
    assert (await job_row(queue.db, good.job_id) or {})["status"] == "done"
    assert runs == [1, 2, 3]
    assert await job_row(queue.db, broken) is None  # failed for good: its agent, never
    # built, was deleted with it (terminalized)


async def test_other_kinds_are_left_for_the_replicas_that_run_them(db: Any) -> None:
    """QueueConfig.other_kinds: a kind this replica does not know but others run stays
    pending instead of failing as invalid (rolling deploys that add a job type)."""
    from .conftest import FAST, MASTER_KEY

    queue = Queue(db, config=QueueConfig(**{**_fields(FAST), "other_kinds": {"Frobnicate"}}),
                  secrets=MASTER_KEY)
    owner = uuid.uuid4()
    agent = await insert_agent(queue.db, owner_id=owner)
    job_id = await queue.db.fetchval(
        "INSERT INTO build_jobs (agent_id, owner_id, payload) "
        "VALUES ($1, $2, '{\"kind\": \"Frobnicate\"}') RETURNING id", agent, owner)
    async with running(queue, executors_for_all(succeed)) as worker:
        await worker.drain_once()
    row = await job_row(queue.db, job_id)
    assert row is not None
    assert (row["status"], row["attempt"]) == ("pending", 0)


async def test_wait_for_sees_running_and_buffered_change(queue: Queue) -> None:
    """`running` and `buffered` change without any other signal: `wait_for` must
    wake for them too (it timed out in 1 of 3 runs while running == 1)."""
    import attrs as _attrs

    release = trio.Event()

    async def block(ctx: JobContext[Any]) -> None:
        await release.wait()
        await succeed(ctx)

    prefetching = Queue(queue.db, config=_attrs.evolve(queue.config, prefetch=2),
                        secrets=queue.secrets)
    for _ in range(3):
        await enqueue_with_target(prefetching, "Upload")
    async with running(prefetching, executors_for_all(block)) as worker:
        with trio.fail_after(10):
            await worker.wait_for(lambda s: s.running == 1 and s.buffered == 2)
            release.set()
            await worker.wait_for(lambda s: s.done == 3 and s.running == 0)
