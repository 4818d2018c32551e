"""
The dead-letter queue and job listings (issue #11): jobs that failed for good
stay listable and inspectable (also a build job deleted with its never-built
agent), and can be retried, cancelled or discarded, through the API and the CLI.
"""

from __future__ import annotations

import json
import uuid
from datetime import timedelta
from typing import Any, ClassVar

import attrs
import pytest
import trio
from click.testing import CliRunner, Result

from nasiko_queue import Database, Executors, JobArgs, JobOptions, Queue, Unique
from nasiko_queue.admin.jobs import (
    JobFilter,
    JobNotFound,
    JobRefused,
    cancel,
    discard,
    discard_matching,
    list_jobs,
    retry,
    retry_matching,
)
from nasiko_queue.admin.retention import prune
from nasiko_queue.admin.view import job_view
from nasiko_queue.cli import main
from nasiko_queue.testing import enqueue_with_target, set_build_status

from .conftest import FAST, MASTER_KEY
from .helpers import TEST_DEADLINE, agent_state, build_state, executors_for_all, job_row, running

TOKEN = "tok-9d1c-dead-letter-secret"


@attrs.frozen(kw_only=True)
class Mail(JobArgs):
    kind: ClassVar[str] = "mail"
    options: ClassVar[JobOptions] = JobOptions(queue="email", max_attempts=2)
    to: str


@attrs.frozen(kw_only=True)
class Report(JobArgs):
    kind: ClassVar[str] = "report"
    options: ClassVar[JobOptions] = JobOptions(queue="reports", max_attempts=1)
    n: int = 0


def no_backoff(_attempt: int) -> float:
    return 0.0


class Flaky:
    """An executor that raises (quoting the token) until told to succeed."""

    def __init__(self, quote: str = TOKEN) -> None:
        self.ok = False
        self.runs = 0
        self.quote = quote

    async def __call__(self, ctx: Any) -> None:
        self.runs += 1
        if not self.ok:
            raise RuntimeError(f"refused {self.quote}")
        if hasattr(ctx.payload, "build_id"):
            await set_build_status(ctx.db, ctx.payload, "success")


async def _state(db: Database, job_id: uuid.UUID) -> Any:
    return await db.fetchrow("SELECT state, attempt, error_msg, finished_at "
                             "FROM nasiko_queue_jobs WHERE id = $1", job_id)


# -- plain jobs -------------------------------------------------------------------


async def test_a_discarded_plain_job_is_listed_with_its_errors_retried_and_runs_again(
    queue: Queue,
) -> None:
    flaky = Flaky()
    executors = Executors()
    executors.register(Mail, backoff=no_backoff)(flaky)
    job_id = await queue.enqueue(Mail(to="a@example.com"))
    async with running(queue, executors) as worker:
        with trio.fail_after(TEST_DEADLINE):
            await worker.wait_for(lambda s: s.failed >= 1)
        [dead] = await list_jobs(queue.db)  # the default listing: the dead letters
        assert (dead.id, dead.source, dead.queue, dead.kind, dead.state, dead.attempt,
                dead.max_attempts) == (job_id, "plain", "email", "mail", "discarded", 2, 2)
        view = await job_view(queue.db, job_id)
        assert view is not None
        assert (view.source, view.status, view.queue) == ("plain", "discarded", "email")
        assert [e.attempt for e in view.errors] == [1, 2]

        flaky.ok = True
        assert await retry(queue.db, job_id, FAST) == "plain"
        with trio.fail_after(TEST_DEADLINE):
            await worker.wait_for(lambda s: s.done >= 1)
    row = await _state(queue.db, job_id)
    assert (row["state"], row["attempt"], row["error_msg"]) == ("completed", 1, None)
    assert flaky.runs == 3
    assert await list_jobs(queue.db) == []


async def test_a_retried_plain_job_is_available_as_if_enqueued(queue: Queue) -> None:
    """What the retry writes, before any worker sees it: the job as an enqueue
    writes it, `attempted_at` included (NULL at attempt 0, as for a build job's
    `picked_at`); it kept the dead run's claim time, an attempt time at attempt 0."""
    executors = Executors()
    executors.register(Mail, backoff=no_backoff)(Flaky())
    job_id = await queue.enqueue(Mail(to="a@example.com"))
    async with running(queue, executors) as worker:
        with trio.fail_after(TEST_DEADLINE):
            await worker.wait_for(lambda s: s.failed >= 1)
    assert await retry(queue.db, job_id) == "plain"
    row = await queue.db.fetchrow(
        "SELECT state, attempt, error_msg, attempted_at, finished_at, claimed_by, "
        "claim_token, run_at <= now() AS due FROM nasiko_queue_jobs WHERE id = $1", job_id)
    assert tuple(row) == ("available", 0, None, None, None, None, None, True)


async def test_retry_refuses_a_job_that_is_not_dead(queue: Queue) -> None:
    job_id = await queue.enqueue(Mail(to="b@example.com"))
    with pytest.raises(JobRefused, match="is available: only discarded or cancelled"):
        await retry(queue.db, job_id)
    with pytest.raises(JobNotFound):
        await retry(queue.db, uuid.uuid4())


async def test_a_cancelled_job_is_retried_and_a_held_unique_key_names_its_holder(
    queue: Queue,
) -> None:
    first = await queue.enqueue(Report(n=1), unique=Unique("daily"))
    assert await cancel(queue.db, first) == "cancelled"
    second = await queue.enqueue(Report(n=2), unique=Unique("daily"))
    assert second != first
    with pytest.raises(JobRefused, match=f"job {second} holds its unique key 'daily'"):
        await retry(queue.db, first)
    assert (await _state(queue.db, first))["state"] == "cancelled"  # nothing changed
    assert await cancel(queue.db, second) == "cancelled"
    await retry(queue.db, first)
    row = await _state(queue.db, first)
    assert (row["state"], row["attempt"], row["error_msg"], row["finished_at"]) == (
        "available", 0, None, None)


async def test_a_job_cancelled_while_running_is_retried_without_its_old_cancel_request(
    queue: Queue,
) -> None:
    """
    A run that is cancelled while it runs ends `cancelled` with its
    `cancel_requested` flag set. The retry runs it afresh: the old request must
    go with the old run, or the retried job's first crash would end it
    `cancelled` (nasiko_queue_run_end's rule) instead of retrying it (issue #24:
    no test reached this path).
    """
    runs: list[int] = []
    executors = Executors()

    @executors.register(Mail, backoff=no_backoff)
    async def crash(ctx: Any) -> None:
        runs.append(ctx.attempt)
        if len(runs) == 1:  # the first run is cancelled while it runs, then raises
            assert await ctx.db.fetchval("SELECT nasiko_queue_cancel($1)",
                                         ctx.job_id) == "cancelling"
        raise RuntimeError(f"crash {len(runs)}")

    job_id = await queue.enqueue(Mail(to="c@example.com"))
    flag = "SELECT cancel_requested FROM nasiko_queue_jobs WHERE id = $1"
    async with running(queue, executors) as worker:
        with trio.fail_after(TEST_DEADLINE):
            await worker.wait_for(lambda s: s.cancelled >= 1)
        row = await _state(queue.db, job_id)
        assert (row["state"], row["attempt"]) == ("cancelled", 1)
        assert await queue.db.fetchval(flag, job_id) is True

        assert await retry(queue.db, job_id, FAST) == "plain"
        assert await queue.db.fetchval(flag, job_id) is False
        # Attempt 1 crashes and is retried (not cancelled); attempt 2, its last,
        # is discarded.
        with trio.fail_after(TEST_DEADLINE):
            await worker.wait_for(lambda s: s.failed >= 1)
    row = await _state(queue.db, job_id)
    assert (row["state"], row["attempt"], row["error_msg"]) == (
        "discarded", 2, "RuntimeError: crash 3")
    assert runs == [1, 1, 2]


async def test_a_cancel_delivered_as_a_run_crashes_does_not_stop_the_jobs_retry(
    queue: Queue,
) -> None:
    """
    Found by chance under load (issue #25's session): the heartbeat delivers a
    run's cancel after its executor raised but before the crash was written. The
    worker marked the claim (job, attempt 1) cancelled, and nothing removed the
    mark once the run ended `cancelled`. The dead-letter retry starts the job
    from attempt 0, so its next claim was (job, attempt 1) again: that run was
    taken for the cancelled one and ended `cancelled` without starting, again
    and again. The heartbeat's beat is made certain here: the executor runs it
    itself, between its cancel and its crash. Failed before the fix (the retried
    job never ran; a run's end now clears its claim's mark).
    """
    runs: list[int] = []
    executors = Executors()
    workers: list[Any] = []

    @executors.register(Mail, backoff=no_backoff)
    async def crash(ctx: Any) -> None:
        runs.append(ctx.attempt)
        if len(runs) == 1:
            assert await ctx.db.fetchval("SELECT nasiko_queue_cancel($1)",
                                         ctx.job_id) == "cancelling"
            await workers[0].heartbeat.beat_once()  # delivers the cancel to this run
            raise RuntimeError("crash 1")  # before a checkpoint: it ends as a crash

    job_id = await queue.enqueue(Mail(to="d@example.com"))
    async with running(queue, executors) as worker:
        workers.append(worker)
        with trio.fail_after(TEST_DEADLINE):
            await worker.wait_for(lambda s: s.cancelled >= 1)
            assert (await _state(queue.db, job_id))["state"] == "cancelled"
            assert await retry(queue.db, job_id, FAST) == "plain"
            await worker.wait_for(lambda s: s.done >= 1 or s.cancelled >= 2)
    row = await _state(queue.db, job_id)
    assert (row["state"], row["attempt"]) == ("completed", 1)
    assert runs == [1, 1]


async def test_cancel_refuses_build_jobs_and_ended_jobs(queue: Queue) -> None:
    build = await enqueue_with_target(queue, "Upload")
    with pytest.raises(JobRefused, match="build jobs cannot be cancelled"):
        await cancel(queue.db, build.job_id)
    job_id = await queue.enqueue(Mail(to="c@example.com"))
    await queue.db.execute("UPDATE nasiko_queue_jobs SET state = 'completed', "
                           "finished_at = now() WHERE id = $1", job_id)
    with pytest.raises(JobRefused, match=r"already ended \(completed\)"):
        await cancel(queue.db, job_id)
    with pytest.raises(JobNotFound):
        await cancel(queue.db, uuid.uuid4())


# -- build jobs -------------------------------------------------------------------


async def test_a_build_job_deleted_with_its_never_built_agent_stays_listed_and_is_not_retried(
    queue: Queue,
) -> None:
    job = await enqueue_with_target(queue, "Upload", env={"API_TOKEN": TOKEN})
    async with running(queue, executors_for_all(Flaky())) as worker:
        with trio.fail_after(TEST_DEADLINE):
            await worker.wait_for(lambda s: s.failed >= 1)
    assert await job_row(queue.db, job.job_id) is None  # terminalization deleted it
    assert await agent_state(queue.db, job.target_id) is None

    [dead] = await list_jobs(queue.db, JobFilter(queue="builds"))
    assert (dead.id, dead.source, dead.kind, dead.state, dead.attempt, dead.target_deleted,
            dead.agent_id, dead.error_msg) == (
        job.job_id, "deleted_build", "Upload", "discarded", 3, True, job.target_id,
        "job panicked during execution")
    view = await job_view(queue.db, job.job_id)
    assert view is not None
    assert (view.source, view.status, view.target_deleted) == ("deleted_build", "failed", True)
    assert view.payload["env"] == {"API_TOKEN": "********"}
    assert [e.message for e in view.errors] == ["refused ********"] * 3

    with pytest.raises(JobRefused) as refused:
        await retry(queue.db, job.job_id)
    assert f"its agent {job.target_id} was deleted when the job failed for good" in str(
        refused.value)
    assert "enqueue a new job" in str(refused.value)


async def test_a_failed_build_job_whose_agent_exists_is_retried_and_runs(queue: Queue) -> None:
    flaky = Flaky()
    job = await enqueue_with_target(queue, "Upload", prior_success=True)
    async with running(queue, executors_for_all(flaky)) as worker:
        with trio.fail_after(TEST_DEADLINE):
            await worker.wait_for(lambda s: s.failed >= 1)
        # Terminalized: the agent kept (it built before), failed; its build failed.
        assert await agent_state(queue.db, job.target_id) == "failed"
        assert await build_state(queue.db, job.build_id) == "failed"
        [dead] = await list_jobs(queue.db, JobFilter(queue="builds", state="discarded"))
        assert (dead.id, dead.source, dead.target_deleted) == (job.job_id, "build", False)

        flaky.ok = True
        assert await retry(queue.db, job.job_id, FAST) == "build"
        with trio.fail_after(TEST_DEADLINE):
            await worker.wait_for(lambda s: s.done >= 1)
    row = await job_row(queue.db, job.job_id)
    assert row is not None
    assert (row["status"], row["attempt"], row["error_msg"]) == ("done", 1, None)
    assert await build_state(queue.db, job.build_id) == "success"
    assert flaky.runs == 4


async def test_a_retried_build_job_is_pending_as_if_enqueued(queue: Queue) -> None:
    """What the retry writes, before any worker sees it: the job as the enqueue
    point wrote it, its build queued, its failed agent deploying."""
    job = await enqueue_with_target(queue, "Rollback", prior_success=True)
    async with running(queue, executors_for_all(Flaky())) as worker:
        with trio.fail_after(TEST_DEADLINE):
            await worker.wait_for(lambda s: s.failed >= 1)
    await retry(queue.db, job.job_id)
    row = await job_row(queue.db, job.job_id)
    assert row is not None
    assert (row["status"], row["attempt"], row["error_msg"], row["picked_at"],
            row["completed_at"]) == ("pending", 0, None, None, None)
    assert await build_state(queue.db, job.build_id) == "queued"
    assert await agent_state(queue.db, job.target_id) == "deploying"
    with pytest.raises(JobRefused, match="is pending: only failed build jobs"):
        await retry(queue.db, job.job_id)


async def test_a_build_job_of_a_soft_deleted_agent_is_not_retried(queue: Queue) -> None:
    job = await enqueue_with_target(queue, "Update", deleted=True)
    async with running(queue, executors_for_all(Flaky())) as worker:
        with trio.fail_after(TEST_DEADLINE):
            await worker.wait_for(lambda s: s.failed >= 1)
    with pytest.raises(JobRefused, match="soft-deleted"):
        await retry(queue.db, job.job_id)
    row = await job_row(queue.db, job.job_id)
    assert row is not None
    assert row["status"] == "failed"


# -- listings ---------------------------------------------------------------------


async def test_listings_filter_by_queue_kind_state_and_age_and_page(queue: Queue) -> None:
    db = queue.db
    mails = [await queue.enqueue(Mail(to=f"{n}@example.com")) for n in range(3)]
    report = await queue.enqueue(Report())
    build = await enqueue_with_target(queue, "Upload")
    for job_id, ago in zip(mails, (timedelta(days=2), timedelta(minutes=1),
                                                 timedelta(minutes=2)), strict=True):
        await db.execute("UPDATE nasiko_queue_jobs SET state = 'discarded', "
                         "finished_at = now() - $2::interval WHERE id = $1", job_id, ago)
    await db.execute("UPDATE nasiko_queue_jobs SET state = 'completed', finished_at = now() "
                     "WHERE id = $1", report)

    def ids(jobs: list[Any]) -> set[uuid.UUID]:
        return {j.id for j in jobs}

    assert ids(await list_jobs(db)) == set(mails)
    assert ids(await list_jobs(db, JobFilter(state=None))) == {*mails, report, build.job_id}
    assert ids(await list_jobs(db, JobFilter(state="completed"))) == {report}
    assert ids(await list_jobs(db, JobFilter(state="available"))) == {build.job_id}
    assert ids(await list_jobs(db, JobFilter(state=None, queue="builds"))) == {build.job_id}
    assert ids(await list_jobs(db, JobFilter(state=None, kind="Upload"))) == {build.job_id}
    assert ids(await list_jobs(db, JobFilter(state=None, queue="reports"))) == {report}
    assert ids(await list_jobs(db, JobFilter(state=None, kind="mail"))) == set(mails)
    assert ids(await list_jobs(db, JobFilter(older_than=timedelta(days=1)))) == {mails[0]}
    # Newest first, one page at a time, each job once.
    first = await list_jobs(db, JobFilter(limit=2))
    rest = await list_jobs(db, JobFilter(limit=2), after=first[-1].cursor)
    assert [j.id for j in first] == [mails[1], mails[2]]
    assert [j.id for j in rest] == [mails[0]]
    assert await list_jobs(db, JobFilter(limit=2), after=rest[-1].cursor) == []
    with pytest.raises(ValueError, match="state must be one of"):
        JobFilter(state="failed")


async def test_retry_matching_retries_what_it_can_and_says_why_not_the_rest(
    queue: Queue,
) -> None:
    gone = await enqueue_with_target(queue, "Upload")
    async with running(queue, executors_for_all(Flaky())) as worker:
        with trio.fail_after(TEST_DEADLINE):
            await worker.wait_for(lambda s: s.failed >= 1)
    mail = await queue.enqueue(Mail(to="d@example.com"))
    await queue.db.execute("UPDATE nasiko_queue_jobs SET state = 'discarded', "
                           "finished_at = now() WHERE id = $1", mail)
    result = await retry_matching(queue.db, JobFilter())
    assert result.done == (mail,)
    [(refused_id, reason)] = result.refused
    assert refused_id == gone.job_id
    assert "was deleted" in reason
    assert (await _state(queue.db, mail))["state"] == "available"


# -- discard ----------------------------------------------------------------------


async def test_discard_deletes_each_kind_of_dead_job_with_its_errors(queue: Queue) -> None:
    db = queue.db
    gone = await enqueue_with_target(queue, "Upload")  # copy kept when its agent goes
    kept = await enqueue_with_target(queue, "Update", prior_success=True)  # failed row
    async with running(queue, executors_for_all(Flaky())) as worker:
        with trio.fail_after(TEST_DEADLINE):
            await worker.wait_for(lambda s: s.failed >= 2)
    mail = await queue.enqueue(Mail(to="e@example.com"))
    waiting = await queue.enqueue(Mail(to="f@example.com"))
    await db.execute("UPDATE nasiko_queue_jobs SET state = 'discarded', finished_at = now() "
                     "WHERE id = $1", mail)

    assert await discard(db, gone.job_id) == "deleted_build"
    assert await discard(db, kept.job_id) == "build"
    assert await discard(db, mail) == "plain"
    for job_id in (gone.job_id, kept.job_id, mail):
        assert await job_view(db, job_id) is None
        assert await db.fetchval("SELECT count(*) FROM nasiko_queue_job_errors "
                                 "WHERE job_id = $1", job_id) == 0
    # The failed build_jobs row was deleted, not copied aside by the trigger.
    assert await db.fetchval("SELECT count(*) FROM nasiko_queue_deleted_build_jobs") == 0
    assert await agent_state(db, kept.target_id) is not None  # its agent stays
    with pytest.raises(JobRefused, match="only finished jobs can be discarded"):
        await discard(db, waiting)
    with pytest.raises(JobNotFound):
        await discard(db, gone.job_id)
    assert await list_jobs(db, JobFilter(state=None)) != []  # the waiting one is left
    assert (await discard_matching(db, JobFilter(state="available"))).refused[0][0] == waiting


async def test_retention_does_not_copy_pruned_failed_build_jobs_aside(queue: Queue) -> None:
    db = queue.db
    old = await enqueue_with_target(queue, "Upload", prior_success=True)
    other = await enqueue_with_target(queue, "Update", prior_success=True)
    async with running(queue, executors_for_all(Flaky())) as worker:
        with trio.fail_after(TEST_DEADLINE):
            await worker.wait_for(lambda s: s.failed >= 2)
    await db.execute("UPDATE build_jobs SET completed_at = now() - interval '2 days' "
                     "WHERE id = $1", old.job_id)
    assert await prune(db, timedelta(days=1)) == 1
    assert await job_row(db, old.job_id) is None
    assert await db.fetchval("SELECT count(*) FROM nasiko_queue_deleted_build_jobs") == 0
    # A failed row deleted any other way (its agent deleted) is copied: the trigger works.
    await db.execute("DELETE FROM agents WHERE id = $1", other.target_id)
    assert [j.id for j in await list_jobs(db)] == [other.job_id]


# -- CLI --------------------------------------------------------------------------


@pytest.fixture
def runner(monkeypatch: pytest.MonkeyPatch) -> CliRunner:
    monkeypatch.delenv("DATABASE_URL", raising=False)
    return CliRunner()


def invoke(runner: CliRunner, *args: str) -> Result:
    result = runner.invoke(main, list(args), catch_exceptions=True)
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result


def with_db(dsn: str, fn: Any) -> Any:
    from nasiko_queue import open_database

    async def go() -> Any:
        async with open_database(dsn) as db:
            return await fn(Queue(db, config=FAST, secrets=MASTER_KEY))

    return trio.run(go)


async def _dead_jobs(queue: Queue) -> tuple[uuid.UUID, uuid.UUID, uuid.UUID]:
    """A build job deleted with its agent, a failed one whose agent is kept, a dead mail."""
    gone = await enqueue_with_target(queue, "Upload", env={"API_TOKEN": TOKEN})
    kept = await enqueue_with_target(queue, "Upload", prior_success=True,
                                     env={"API_TOKEN": TOKEN})
    executors = executors_for_all(Flaky())
    # A mail has no secret field: what its executor raises is kept as it is.
    executors.register(Mail, backoff=no_backoff)(Flaky(quote="smtp down"))
    mail = await queue.enqueue(Mail(to="g@example.com"))
    async with running(queue, executors) as worker:
        with trio.fail_after(TEST_DEADLINE):
            await worker.wait_for(lambda s: s.failed >= 3)
    return gone.job_id, kept.job_id, mail


def test_cli_lists_shows_retries_and_discards_dead_jobs(runner: CliRunner, dsn: str) -> None:
    gone, kept, mail = with_db(dsn, _dead_jobs)

    listed = invoke(runner, "jobs", "list", "--dsn", dsn, "--json")
    assert listed.exit_code == 0, listed.output
    data = json.loads(listed.stdout)
    by_id = {j["id"]: j for j in data["jobs"]}
    assert set(by_id) == {str(gone), str(kept), str(mail)}
    assert by_id[str(gone)]["target_deleted"] is True
    assert (by_id[str(mail)]["queue"], by_id[str(mail)]["state"]) == ("email", "discarded")
    assert data["next"] is None
    page = json.loads(invoke(runner, "jobs", "list", "--dsn", dsn, "--json",
                             "--limit", "2").stdout)
    assert len(page["jobs"]) == 2
    assert page["next"] is not None
    rest = json.loads(invoke(runner, "jobs", "list", "--dsn", dsn, "--json",
                             "--after", page["next"]).stdout)
    assert {j["id"] for j in page["jobs"] + rest["jobs"]} == set(by_id)
    only = json.loads(invoke(runner, "jobs", "list", "--dsn", dsn, "--json",
                             "--queue", "email").stdout)
    assert [j["id"] for j in only["jobs"]] == [str(mail)]
    table = invoke(runner, "jobs", "list", "--dsn", dsn)
    assert table.exit_code == 0
    assert "target deleted" in table.stdout

    shown = invoke(runner, "job", str(gone), "--dsn", dsn, "--json")
    assert shown.exit_code == 0, shown.output
    view = json.loads(shown.stdout)
    assert (view["source"], view["target_deleted"]) == ("deleted_build", True)
    assert view["payload"]["env"] == {"API_TOKEN": "********"}
    assert len(view["errors"]) == 3
    shown_tables = invoke(runner, "job", str(gone), "--dsn", dsn)
    assert "a kept copy: its target was deleted" in shown_tables.stdout
    plain = json.loads(invoke(runner, "job", str(mail), "--dsn", dsn, "--json").stdout)
    assert (plain["source"], plain["queue"], plain["status"]) == ("plain", "email", "discarded")
    for output in (listed.stdout, table.stdout, shown.stdout, shown_tables.stdout):
        assert TOKEN not in output
        assert "nq1:" not in output

    refused = invoke(runner, "jobs", "retry", str(gone), str(kept), "--dsn", dsn)
    assert refused.exit_code == 1
    assert f"retried {kept}" in refused.stdout
    assert "was deleted when the job failed for good" in refused.stderr

    unconfirmed = invoke(runner, "jobs", "discard", "--all", "--dsn", dsn)
    assert unconfirmed.exit_code == 1
    assert "2 jobs match; nothing done: pass --yes" in unconfirmed.stderr
    discarded = invoke(runner, "jobs", "discard", "--all", "--yes", "--dsn", dsn)
    assert discarded.exit_code == 0, discarded.output
    assert {f"discarded {gone}", f"discarded {mail}"} <= set(discarded.stdout.splitlines())
    assert json.loads(invoke(runner, "jobs", "list", "--dsn", dsn, "--json").stdout)[
        "jobs"] == []


def test_cli_cancel_and_usage_errors(runner: CliRunner, dsn: str) -> None:
    async def setup(queue: Queue) -> tuple[uuid.UUID, uuid.UUID]:
        build = await enqueue_with_target(queue, "Upload")
        return await queue.enqueue(Mail(to="h@example.com")), build.job_id

    mail, build = with_db(dsn, setup)
    done = invoke(runner, "jobs", "cancel", str(mail), str(build), "--dsn", dsn)
    assert done.exit_code == 1
    assert f"cancelled {mail}" in done.stdout
    assert "build jobs cannot be cancelled" in done.stderr
    assert invoke(runner, "jobs", "retry", "--dsn", dsn).exit_code == 2
    assert invoke(runner, "jobs", "retry", str(mail), "--all", "--dsn", dsn).exit_code == 2
    assert invoke(runner, "jobs", "retry", str(mail), "--queue", "email",
                  "--dsn", dsn).exit_code == 2
    bad = invoke(runner, "jobs", "list", "--after", "nonsense", "--dsn", dsn)
    assert bad.exit_code == 2
    assert "not a listing cursor" in bad.output
    retried = invoke(runner, "jobs", "retry", "--all", "--state", "cancelled", "--yes",
                     "--dsn", dsn)
    assert retried.exit_code == 0
    assert f"retried {mail}" in retried.stdout


# -- counts, the summary's fields, the default state (issue #21) --------------------


async def test_count_jobs_counts_every_page_of_a_filter_in_one_statement(queue: Queue) -> None:
    from nasiko_queue.job_admin import count_jobs
    db = queue.db
    mails = [await queue.enqueue(Mail(to=f"{n}@example.com")) for n in range(5)]
    await queue.enqueue(Report())
    await enqueue_with_target(queue, "Upload")
    await db.execute("UPDATE nasiko_queue_jobs SET state = 'discarded', finished_at = now() "
                     "- interval '2 days' WHERE id = ANY ($1)", mails[:3])
    assert await count_jobs(db) == 3                          # the dead letters
    assert await count_jobs(db, JobFilter(limit=1)) == 3      # a page size is no bound
    assert await count_jobs(db, JobFilter(state=None)) == 7
    assert await count_jobs(db, JobFilter(state="available")) == 4
    assert await count_jobs(db, JobFilter(state=None, queue="builds")) == 1
    assert await count_jobs(db, JobFilter(state=None, kind="mail")) == 5
    assert await count_jobs(db, JobFilter(older_than=timedelta(days=1))) == 3
    assert await count_jobs(db, JobFilter(older_than=timedelta(days=3))) == 0
    for where in (JobFilter(), JobFilter(state=None), JobFilter(state=None, queue="email")):
        assert await count_jobs(db, where) == len(
            await list_jobs(db, attrs.evolve(where, limit=1000)))


async def test_a_summary_carries_run_at_priority_and_the_claim(queue: Queue) -> None:
    db = queue.db
    later = await queue.enqueue(Mail(to="a@example.com"), delay=3600,
                                options=JobOptions(queue="email", priority=7))
    now = await queue.enqueue(Report())
    worker_id = uuid.uuid4()
    await db.execute("UPDATE nasiko_queue_jobs SET state = 'running', attempt = 1, "
                     "attempted_at = now(), claimed_by = $2 WHERE id = $1", now, worker_id)
    build = await enqueue_with_target(queue, "Upload")
    await db.execute("UPDATE build_jobs SET status = 'in_progress', picked_at = now(), "
                     "attempt = 1 WHERE id = $1", build.job_id)
    jobs = {j.id: j for j in await list_jobs(db, JobFilter(state=None))}
    assert jobs[later].priority == 7
    assert jobs[later].run_at is not None
    assert jobs[later].attempted_at is None
    assert jobs[later].run_at - jobs[later].created_at > timedelta(minutes=59)
    assert (jobs[now].attempted_at is not None, jobs[now].claimed_by) == (True, worker_id)
    assert jobs[build.job_id].attempted_at is not None
    assert (jobs[build.job_id].run_at, jobs[build.job_id].priority) == (None, None)
    as_json = jobs[later].to_json()
    assert {"run_at", "priority", "attempted_at", "claimed_by"} <= as_json.keys()


def test_the_library_and_the_cli_default_to_the_same_state() -> None:
    """Decided (issue #21): both are about the dead letters unless told; `state=None`
    and `--state any` are every state."""
    from nasiko_queue.cli.jobs import jobs_list_command
    from nasiko_queue.job_admin import DEFAULT_STATE
    [state] = [p for p in jobs_list_command.params if p.name == "state"]
    assert JobFilter().state == DEFAULT_STATE == state.default == "discarded"
    assert "any" in state.type.choices  # type: ignore[attr-defined]
