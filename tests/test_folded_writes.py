"""
An executor's build-row writes folded into the worker's own statements (issue #13).

`ctx.report_success()` / `ctx.report_failure()` have the completer's statement
(`jobs_finish_reported_and_claim` and its `_kinds` twin, sent for a batch in which
something was reported) write the build row together with the job's done or
failed; `ctx.mark_building()` rides on the worker's next statement. "Together" is
checked on the rows themselves: two rows written by one transaction carry the same
`xmin`, and the worker's finish is one autocommitted
statement, so equal `xmin`s mean one statement wrote both.
"""

from __future__ import annotations

import uuid
from typing import Any

import attrs
import pytest
import trio

from nasiko_queue import Executors, JobContext, Queue, Worker
from nasiko_queue.builds.payloads import Target
from nasiko_queue.builds.store import BUILD_FAILED, JOB_PANICKED, PgJobStore
from nasiko_queue.engine.contracts import BuildReport, JobStatus
from nasiko_queue.executors import RunReport
from nasiko_queue.testing import KINDS, Enqueued, enqueue_with_target, set_build_status

from .helpers import TYPES, agent_state, build_state, connector_state, job_row, running


def _executors(fn: Any, kinds: tuple[str, ...] = KINDS) -> Executors:
    executors = Executors()
    for kind in kinds:
        executors.register(TYPES[kind], fn)
    return executors


def _store(queue: Queue) -> PgJobStore:
    kinds = frozenset(KINDS)
    return PgJobStore(queue.db, queue.config, runnable_kinds=kinds, known_kinds=kinds)


async def _xmins(queue: Queue, job: Enqueued) -> tuple[str, str]:
    """The writing transaction of the job row and of its build row."""
    table = "mcp_connector_builds" if job.is_connector else "agent_builds"
    job_xmin = await queue.db.fetchval("SELECT xmin::text FROM build_jobs WHERE id = $1",
                                       job.job_id)
    build_xmin = await queue.db.fetchval(f"SELECT xmin::text FROM {table} WHERE id = $1",
                                         job.build_id)
    return job_xmin, build_xmin


async def _completed_at_set(queue: Queue, job: Enqueued) -> bool:
    return bool(await queue.db.fetchval(
        "SELECT completed_at IS NOT NULL FROM mcp_connector_builds WHERE id = $1", job.build_id))


# -- the end of a build: report_success / report_failure ------------------------------


@pytest.mark.parametrize("kind", ["Upload", "McpServerUpload"])
@pytest.mark.parametrize("runs", ["every kind", "its kind only"])
async def test_a_reported_success_is_written_with_the_jobs_done_in_one_statement(
    queue: Queue, kind: str, runs: str
) -> None:
    """The executor writes nothing itself; the finish writes the build row 'success'
    (a connector's with completed_at) in the statement that marks the job done. A
    worker running only its kind sends the `_kinds` twin of the statement."""
    job = await enqueue_with_target(queue, kind)
    seen: list[str | None] = []

    async def build(ctx: JobContext[Any]) -> None:
        ctx.report_success()
        seen.append(await build_state(ctx.db, ctx.payload.build_id,
                                      connector=job.is_connector))

    kinds = KINDS if runs == "every kind" else (kind,)
    async with running(queue, _executors(build, kinds)) as worker:
        await worker.drain_once()
    assert seen == ["pending" if job.is_connector else "queued"]  # not written by the call
    row = await job_row(queue.db, job.job_id)
    assert row is not None
    assert (row["status"], row["error_msg"]) == ("done", None)
    assert await build_state(queue.db, job.build_id, connector=job.is_connector) == "success"
    job_xmin, build_xmin = await _xmins(queue, job)
    assert job_xmin == build_xmin
    if job.is_connector:
        assert await _completed_at_set(queue, job)


@pytest.mark.parametrize("kind", ["Upload", "McpServerUpload"])
async def test_a_reported_failure_fails_the_job_and_leaves_the_target_to_the_executor(
    queue: Queue, kind: str
) -> None:
    """An ordinary failure (docs/rules.md §5 step 4): the build row 'failed' and the job
    failed with the fixed message, in one statement, not retried; the worker does not
    terminalize the target (an ordinary failure never did: undoing the agent or the
    connector is the executor's part), so it stays as the executor left it."""
    job = await enqueue_with_target(queue, kind)
    runs = 0

    async def build(ctx: JobContext[Any]) -> None:
        nonlocal runs
        runs += 1
        ctx.report_failure()

    async with running(queue, _executors(build)) as worker:
        await worker.drain_once()
    row = await job_row(queue.db, job.job_id)
    assert row is not None
    assert (row["status"], row["error_msg"], row["attempt"]) == ("failed", BUILD_FAILED, 1)
    assert runs == 1
    assert await build_state(queue.db, job.build_id, connector=job.is_connector) == "failed"
    job_xmin, build_xmin = await _xmins(queue, job)
    assert job_xmin == build_xmin
    if job.is_connector:
        assert await _completed_at_set(queue, job)
        assert await connector_state(queue.db, job.target_id) == "pending"
    else:
        assert await agent_state(queue.db, job.target_id) == "deploying"  # not deleted


async def test_the_last_report_of_a_run_wins(queue: Queue) -> None:
    job = await enqueue_with_target(queue, "Upload")

    async def build(ctx: JobContext[Any]) -> None:
        ctx.report_failure()
        ctx.report_success()
        assert ctx.reported is BuildReport.SUCCESS

    async with running(queue, _executors(build)) as worker:
        await worker.drain_once()
    assert (await job_row(queue.db, job.job_id) or {})["status"] == "done"
    assert await build_state(queue.db, job.build_id) == "success"


@pytest.mark.parametrize("crash", ["raises", "times out"])
async def test_a_report_followed_by_a_crash_is_not_written(queue: Queue, crash: str) -> None:
    """The run reports success, then crashes: the crash rules apply (retried at
    once) and the report is dropped. The second run sees the build row untouched and
    reports nothing, so the job ends failed with the row still 'queued'."""
    job = await enqueue_with_target(queue, "Upload")
    seen: list[str | None] = []
    queue = Queue(queue.db, config=attrs.evolve(queue.config, job_timeout=0.2))

    async def build(ctx: JobContext[Any]) -> None:
        seen.append(await build_state(ctx.db, ctx.payload.build_id))
        if ctx.attempt == 1:
            ctx.report_success()
            if crash == "raises":
                raise RuntimeError("crashed after reporting")
            await trio.sleep_forever()  # cancelled at job_timeout

    async with running(queue, _executors(build)) as worker:
        await worker.drain_once()
    assert seen == ["queued", "queued"]
    row = await job_row(queue.db, job.job_id)
    assert row is not None
    assert (row["status"], row["error_msg"], row["attempt"]) == ("failed", BUILD_FAILED, 2)
    assert await build_state(queue.db, job.build_id) == "queued"


async def test_a_report_on_the_last_crashing_run_is_not_written_and_the_target_terminalized(
    queue: Queue,
) -> None:
    """Every run reports success and raises: after max_attempts runs the job fails
    `job panicked during execution` and terminalization ends its build row
    'failed'; the reports never landed."""
    job = await enqueue_with_target(queue, "Upload", prior_success=True)

    async def build(ctx: JobContext[Any]) -> None:
        ctx.report_success()
        raise RuntimeError("always")

    async with running(queue, _executors(build)) as worker:
        await worker.drain_once()
    row = await job_row(queue.db, job.job_id)
    assert row is not None
    assert (row["status"], row["error_msg"], row["attempt"]) == ("failed", JOB_PANICKED, 3)
    assert await build_state(queue.db, job.build_id) == "failed"
    assert await agent_state(queue.db, job.target_id) == "failed"  # kept: it built before


# -- the original way, and the two ways mixed -----------------------------------------


@pytest.mark.parametrize("status", ["success", "failed"])
async def test_an_executor_writing_its_build_row_itself_works_as_before(
    queue: Queue, status: str
) -> None:
    job = await enqueue_with_target(queue, "Upload")

    async def build(ctx: JobContext[Any]) -> None:
        await set_build_status(ctx.db, ctx.payload, "building")
        await set_build_status(ctx.db, ctx.payload, status)

    async with running(queue, _executors(build)) as worker:
        await worker.drain_once()
    row = await job_row(queue.db, job.job_id)
    assert row is not None
    assert row["status"] == ("done" if status == "success" else "failed")
    assert await build_state(queue.db, job.build_id) == status
    job_xmin, build_xmin = await _xmins(queue, job)
    assert job_xmin != build_xmin  # the executor's own transaction wrote the row


@pytest.mark.parametrize(("written", "reported"), [("success", "failure"),
                                                   ("failed", "success")])
@pytest.mark.parametrize("kind", ["Upload", "McpServerUpload"])
async def test_a_build_row_already_finished_is_left_as_it_is_and_decides(
    queue: Queue, written: str, reported: str, kind: str
) -> None:
    """The decision for a report that meets a build row already 'success' or
    'failed' (the executor wrote it itself, or someone else did): the row is not
    overwritten, and the job follows the row, as a job whose executor reported
    nothing does. So the job and its build row always agree."""
    job = await enqueue_with_target(queue, kind)

    async def build(ctx: JobContext[Any]) -> None:
        await set_build_status(ctx.db, ctx.payload, written)
        if reported == "success":
            ctx.report_success()
        else:
            ctx.report_failure()

    async with running(queue, _executors(build)) as worker:
        await worker.drain_once()
    row = await job_row(queue.db, job.job_id)
    assert row is not None
    assert row["status"] == ("done" if written == "success" else "failed")
    assert await build_state(queue.db, job.build_id, connector=job.is_connector) == written
    job_xmin, build_xmin = await _xmins(queue, job)
    assert job_xmin != build_xmin  # the build row kept the executor's write


async def test_a_report_on_a_missing_build_row_fails_the_job(queue: Queue) -> None:
    job = await enqueue_with_target(queue, "Upload")

    async def build(ctx: JobContext[Any]) -> None:
        await ctx.db.execute("DELETE FROM agent_builds WHERE id = $1", ctx.payload.build_id)
        ctx.report_success()

    async with running(queue, _executors(build)) as worker:
        await worker.drain_once()
    row = await job_row(queue.db, job.job_id)
    assert row is not None
    assert (row["status"], row["error_msg"]) == ("failed", BUILD_FAILED)


async def test_a_report_for_a_job_no_longer_ours_writes_nothing(queue: Queue) -> None:
    """The claim was handed on (the sweep reset it, another worker claimed it): the
    stale finish and its folded report both find nothing to write."""
    store = _store(queue)
    job = await enqueue_with_target(queue, "Upload")
    (stale,) = await store.claim(1)
    await queue.db.execute("UPDATE build_jobs SET attempt = attempt + 1 WHERE id = $1",
                           job.job_id)
    statuses, _ = await store.finish_many_and_claim(
        [(stale, job.build_id, BuildReport.SUCCESS)], 0)
    assert statuses == {job.job_id: None}
    assert await build_state(queue.db, job.build_id) == "queued"
    assert (await job_row(queue.db, job.job_id) or {})["status"] == "in_progress"


async def test_a_finish_sent_again_after_a_lost_answer_changes_nothing(queue: Queue) -> None:
    """A retried batch (its first answer lost) reports what the first try wrote and
    writes neither row a second time."""
    store = _store(queue)
    job = await enqueue_with_target(queue, "Upload")
    (claimed,) = await store.claim(1)
    finishing = [(claimed, job.build_id, BuildReport.SUCCESS)]
    first, _ = await store.finish_many_and_claim(finishing, 0)
    written = await _xmins(queue, job)
    again, _ = await store.finish_many_and_claim(finishing, 0)
    assert first == again == {job.job_id: JobStatus.DONE}
    assert await _xmins(queue, job) == written


async def test_two_reports_on_one_build_row_in_one_statement_agree(queue: Queue) -> None:
    """Two jobs of one build row (a double enqueue) report differently in the same
    statement: the row gets one status, the failure, and both jobs follow it."""
    store = _store(queue)
    first = await enqueue_with_target(queue, "Upload")
    second_id = await queue.enqueue(first.payload, owner_id=first.owner_id)
    a, b = await store.claim(2)
    statuses, _ = await store.finish_many_and_claim(
        [(a, first.build_id, BuildReport.SUCCESS), (b, first.build_id, BuildReport.FAILED)], 0)
    assert statuses == {first.job_id: JobStatus.FAILED, second_id: JobStatus.FAILED}
    assert await build_state(queue.db, first.build_id) == "failed"


@pytest.mark.parametrize("runs", ["every kind", "Upload only"])
async def test_only_a_batch_with_a_report_is_sent_with_the_build_row_writes(
    queue: Queue, monkeypatch: pytest.MonkeyPatch, runs: str
) -> None:
    """A batch in which nothing was reported goes as `jobs_finish_many_and_claim`
    (the build row decides as it stands, nothing locked or written), one with a
    report, even beside unreported finishes, as `jobs_finish_reported_and_claim`:
    the server sets up every part of a plan each run, used or not, so the
    unused writes cost every no-op batch (issue #25). Each finishes as it should."""
    import nasiko_queue.builds.store as store_module
    from nasiko_queue.db.statements import Q

    sent: list[str] = []
    real = store_module.fetch_claiming

    async def recording(db: Any, sql: str, args: Any, **kw: Any) -> Any:
        sent.append(sql)
        return await real(db, sql, args, **kw)

    monkeypatch.setattr(store_module, "fetch_claiming", recording)
    kinds = frozenset(KINDS) if runs == "every kind" else frozenset({"Upload"})
    store = PgJobStore(queue.db, queue.config, runnable_kinds=kinds,
                       known_kinds=frozenset(KINDS))
    suffix = "" if runs == "every kind" else "_kinds"
    jobs = [await enqueue_with_target(queue, "Upload") for _ in range(3)]
    await set_build_status(queue.db, jobs[0].payload, "success")
    claimed = await store.claim(3)
    by_id = {j.job_id: j for j in jobs}
    first = [(c, by_id[c.id].build_id, None) for c in claimed if c.id == jobs[0].job_id]
    rest = [(c, by_id[c.id].build_id, BuildReport.SUCCESS if c.id == jobs[1].job_id else None)
            for c in claimed if c.id != jobs[0].job_id]
    sent.clear()

    unreported, _ = await store.finish_many_and_claim(first, 1)
    reported, _ = await store.finish_many_and_claim(rest, 1)

    assert sent == [getattr(Q, "jobs_finish_many_and_claim" + suffix),
                    getattr(Q, "jobs_finish_reported_and_claim" + suffix)]
    assert unreported == {jobs[0].job_id: JobStatus.DONE}
    assert reported == {jobs[1].job_id: JobStatus.DONE, jobs[2].job_id: JobStatus.FAILED}
    assert await build_state(queue.db, jobs[1].build_id) == "success"
    assert await build_state(queue.db, jobs[2].build_id) == "queued"


# -- the start of a build: mark_building ----------------------------------------------


@pytest.mark.parametrize("kind", ["Upload", "McpServerUpload"])
async def test_a_start_write_lands_while_the_executor_runs(queue: Queue, kind: str) -> None:
    """`mark_building` returns at once; the producer's next statement writes it while
    the build goes on (the executor waits on the worker's counter, not a clock)."""
    job = await enqueue_with_target(queue, kind)
    seen: list[str | None] = []
    worker: Worker | None = None

    async def build(ctx: JobContext[Any]) -> None:
        ctx.mark_building()
        ctx.mark_building()  # a second call in one run does nothing
        assert worker is not None
        await worker.wait_for(lambda s: s.marked_building >= 1)
        seen.append(await build_state(ctx.db, ctx.payload.build_id,
                                      connector=job.is_connector))
        ctx.report_success()

    async with running(queue, _executors(build)) as started:
        worker = started
        await worker.drain_once()
        assert worker.stats.marked_building == 1
    assert seen == ["building"]
    assert await build_state(queue.db, job.build_id, connector=job.is_connector) == "success"
    if job.is_connector:
        assert await _completed_at_set(queue, job)


async def test_a_start_write_superseded_by_the_runs_report_is_never_sent(
    queue: Queue,
) -> None:
    """A run that reports before its start write was sent (here in the same step:
    no checkpoint in between) has only its report written: no start write goes
    out, and the row goes from 'queued' to 'success' in the finish's one write."""
    job = await enqueue_with_target(queue, "Upload")

    async def build(ctx: JobContext[Any]) -> None:
        ctx.mark_building()
        ctx.report_success()

    async with running(queue, _executors(build)) as worker:
        await worker.drain_once()
        assert worker.stats.marked_building == 0
    assert await build_state(queue.db, job.build_id) == "success"
    job_xmin, build_xmin = await _xmins(queue, job)
    assert job_xmin == build_xmin


@pytest.mark.parametrize("later", ["success", "failed"])
@pytest.mark.parametrize("kind", ["Upload", "McpServerUpload"])
async def test_a_late_start_write_never_overwrites_an_outcome(
    queue: Queue, later: str, kind: str
) -> None:
    """A start write that arrives after the build row says 'success' or 'failed'
    (sent by a statement that was overtaken) leaves it alone; one on a fresh row
    writes 'building'."""
    store = _store(queue)
    late = await enqueue_with_target(queue, kind)
    fresh = await enqueue_with_target(queue, kind)
    claimed = {j.id: j for j in await store.claim(2)}
    await set_build_status(queue.db, late.payload, later)
    statuses, _ = await store.finish_many_and_claim(
        [], 0, starts=[(claimed[late.job_id], late.build_id),
                       (claimed[fresh.job_id], fresh.build_id)])
    assert statuses == {}  # start writes finish nothing
    connector = late.is_connector
    assert await build_state(queue.db, late.build_id, connector=connector) == later
    assert await build_state(queue.db, fresh.build_id, connector=connector) == "building"
    for job in (late, fresh):
        assert (await job_row(queue.db, job.job_id) or {})["status"] == "in_progress"


async def test_a_start_write_and_its_jobs_report_in_one_statement(queue: Queue) -> None:
    """Both ride on one statement when the executor returns before the start write
    was sent: the report alone is written, the row ends 'success'."""
    store = _store(queue)
    job = await enqueue_with_target(queue, "Upload")
    (claimed,) = await store.claim(1)
    statuses, _ = await store.finish_many_and_claim(
        [(claimed, job.build_id, BuildReport.SUCCESS)], 0, starts=[(claimed, job.build_id)])
    assert statuses == {job.job_id: JobStatus.DONE}
    assert await build_state(queue.db, job.build_id) == "success"


async def test_a_start_write_asked_for_before_a_crash_still_lands(queue: Queue) -> None:
    """As the original's first write: the build had started. The retry (which may
    begin before it is sent) then succeeds through its own report."""
    job = await enqueue_with_target(queue, "Upload")
    seen: list[str | None] = []
    worker: Worker | None = None

    async def build(ctx: JobContext[Any]) -> None:
        if ctx.attempt == 1:
            ctx.mark_building()
            raise RuntimeError("crashed after starting")
        assert worker is not None
        await worker.wait_for(lambda s: s.marked_building >= 1)
        seen.append(await build_state(ctx.db, ctx.payload.build_id))
        ctx.report_success()

    async with running(queue, _executors(build)) as started:
        worker = started
        await worker.drain_once()
    assert seen == ["building"]
    assert await build_state(queue.db, job.build_id) == "success"
    assert (await job_row(queue.db, job.job_id) or {})["status"] == "done"


async def test_a_context_outside_a_worker_only_records_what_is_reported() -> None:
    """For a unit test of an executor: a `JobContext` built by hand records the
    reports and the start write, and sends nothing."""
    run = RunReport()
    ctx = JobContext(job_id=uuid.uuid4(), attempt=1, payload=object(), owner_id=uuid.uuid4(),
                     target=Target(agent_id=uuid.uuid4()), db=None, _run=run)  # type: ignore[arg-type]
    assert ctx.reported is None
    ctx.mark_building()
    ctx.report_failure()
    assert (run.building, ctx.reported) == (True, BuildReport.FAILED)
    assert "RunReport" not in repr(ctx)




# -- lock order -----------------------------------------------------------------------


async def _waiting_on_locks(queue: Queue, n: int) -> None:
    """Until `n` server processes of this database wait for a lock (each look is a
    question to the server, not a pause)."""
    sql = ("SELECT count(*) FROM pg_stat_activity "
           "WHERE datname = current_database() AND wait_event_type = 'Lock'")
    with trio.fail_after(10):
        while await queue.db.fetchval(sql) < n:
            await trio.lowlevel.checkpoint()


async def test_two_statements_in_flight_lock_build_rows_in_one_order(queue: Queue) -> None:
    """The worker's two statements in flight may write the same build rows: one the
    jobs' start writes, the next their reports. Each locks every build row it writes
    in id order before anything else, whichever of its writers runs first, so they
    queue instead of deadlocking. Staged here: the reports wait for the lower row
    (held by another transaction), then the start writes arrive listing the higher
    row first; written in the order listed, they would take it and wait for the
    lower one, and PostgreSQL would cancel one statement as a deadlock."""
    store = _store(queue)
    first = await enqueue_with_target(queue, "Upload")
    second = await enqueue_with_target(queue, "Upload")
    claimed = {j.id: j for j in await store.claim(2)}
    low, high = sorted((first, second), key=lambda j: j.build_id)
    release = trio.Event()

    async def hold_the_lower_row(*, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        async with queue.db.transaction() as tx:
            await tx.execute("SELECT 1 FROM agent_builds WHERE id = $1 FOR UPDATE",
                             low.build_id)
            task_status.started()
            await release.wait()

    async def report() -> None:
        await store.finish_many_and_claim(
            [(claimed[j.job_id], j.build_id, BuildReport.SUCCESS) for j in (low, high)], 0)

    async def start() -> None:
        await store.finish_many_and_claim(
            [], 0, starts=[(claimed[j.job_id], j.build_id) for j in (high, low)])

    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            await nursery.start(hold_the_lower_row)
            nursery.start_soon(report)
            await _waiting_on_locks(queue, 1)
            nursery.start_soon(start)
            await _waiting_on_locks(queue, 2)
            release.set()
    for job in (low, high):
        assert await build_state(queue.db, job.build_id) == "success"
        assert (await job_row(queue.db, job.job_id) or {})["status"] == "done"
