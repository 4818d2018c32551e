"""
Durable workflows (issue #22): DAGs of steps run as plain jobs, their
transitions taken by the SQL rule of migration 0018 in the transaction that
ends each step's job. Real PostgreSQL and real workers; no sleeps: a test waits
on the worker's counters or on events its steps set, and time passes by aging
rows in SQL.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime
from typing import Any
from uuid import UUID

import attrs
import pytest
import trio

from nasiko_queue import (
    Executors,
    InvalidPayload,
    NoSuchRun,
    Queue,
    RunFailed,
    Schedule,
    Scheduler,
    SignalResult,
    StartWorkflow,
    StepContext,
    Workflow,
    open_database,
)
from nasiko_queue.admin.runs import RunRefused, retry_run
from nasiko_queue.db.database import Database
from nasiko_queue.db.statements import Q
from nasiko_queue.workflows.transitions import TransitionConfig, TransitionService

from .conftest import FAST, MASTER_KEY
from .helpers import TEST_DEADLINE, running

#: Steps of one run run side by side (fan-out items, a failing step beside a
#: running one); a cancel reaches a running step at the next heartbeat.
WORKFLOW_CONFIG = attrs.evolve(FAST, concurrency=4, heartbeat_interval=0.2)


@pytest.fixture
async def queue(db: Database) -> AsyncIterator[Queue]:
    yield Queue(db, config=WORKFLOW_CONFIG, secrets=MASTER_KEY)
    # Whatever a test did, no run is left running with nothing left to run.
    assert await db.fetch(Q.workflow_stuck_runs) == []


@attrs.frozen
class Release:
    version: str
    files: int


def fanout_workflow(log: list[str]) -> Workflow:
    wf = Workflow("release", input_type=Release)

    @wf.step()
    async def build(ctx: StepContext) -> list[str]:
        log.append("build")
        assert isinstance(ctx.input, Release)
        assert ctx.input.version == "1.2"
        return [f"f{i}" for i in range(ctx.input.files)]

    @wf.step(map_over=build)
    async def test(ctx: StepContext) -> dict[str, Any]:
        assert "build" in log  # never before its dependency completed
        log.append(f"test {ctx.index}")
        assert ctx.results["build"][ctx.index] == ctx.item
        return {"file": ctx.item, "ok": True}

    @wf.step(after=[test])
    async def report(ctx: StepContext) -> str:
        log.append("report")
        return ",".join(r["file"] for r in ctx.results["test"])

    return wf


def executors_for(*wfs: Workflow) -> Executors:
    executors = Executors()
    for wf in wfs:
        executors.register_workflow(wf)
    return executors


async def test_steps_run_in_dag_order_and_a_fan_in_gets_the_results_in_item_order(
    queue: Queue,
) -> None:
    log: list[str] = []
    wf = fanout_workflow(log)
    run_id = await queue.start(wf, Release("1.2", 3))
    async with running(queue, executors_for(wf)) as worker:
        await worker.wait_for(lambda s: s.done >= 5)
    view = await queue.run(run_id)
    assert view is not None
    assert (view.state, view.result, view.failed_step) == ("completed", "f0,f1,f2", None)
    assert view.input == {"version": "1.2", "files": 3}
    assert log[0] == "build"
    assert log[-1] == "report"
    assert sorted(log[1:4]) == ["test 0", "test 1", "test 2"]
    assert view.step("test").result == [{"file": f"f{i}", "ok": True} for i in range(3)]
    assert [(s.step, s.index, s.state) for s in view.steps] == [
        ("build", 0, "completed"), ("test", -1, "completed"), ("test", 0, "completed"),
        ("test", 1, "completed"), ("test", 2, "completed"), ("report", 0, "completed")]
    # Each step's job carries its run; each ran once.
    assert await queue.db.fetchval(
        "SELECT count(*) FROM nasiko_queue_jobs WHERE workflow_run = $1 AND attempt = 1",
        run_id) == 5


@pytest.mark.parametrize("name", ["nightly-report", "x²", "ﬁle report"])
async def test_a_workflow_whose_name_is_no_identifier_runs(queue: Queue, name: str) -> None:
    """Regression: `Workflow("nightly-report")` was accepted, and every one of its
    step jobs was then discarded as an invalid payload (its jobs' type was named
    after the workflow, and cattrs cannot generate code for such a class name).
    Review: a Unicode letter or digit that Python normalizes broke it the same way."""
    wf = Workflow(name)

    @wf.step()
    async def gather(ctx: StepContext) -> int:
        return 2

    @wf.step(after=[gather])
    async def double(ctx: StepContext) -> int:
        return 2 * int(ctx.results["gather"])

    run_id = await queue.start(wf, None)
    async with running(queue, executors_for(wf)):
        assert await queue.run_result(run_id, timeout=TEST_DEADLINE) == 4


async def test_an_empty_fan_out_completes_the_mapped_step_with_an_empty_list(
    queue: Queue,
) -> None:
    log: list[str] = []
    wf = fanout_workflow(log)
    run_id = await queue.start(wf, Release("1.2", 0))
    async with running(queue, executors_for(wf)) as worker:
        await worker.wait_for(lambda s: s.done >= 2)
    view = await queue.run(run_id)
    assert view is not None
    assert (view.state, view.result) == ("completed", "")
    assert view.step("test").result == []
    assert log == ["build", "report"]


async def test_a_discarded_step_fails_the_run_cancels_the_others_and_starts_nothing(
    queue: Queue,
) -> None:
    wf = Workflow("fragile", max_attempts=1)
    slow_started = trio.Event()
    ran: list[str] = []

    @wf.step()
    async def slow(ctx: StepContext) -> None:
        slow_started.set()
        await trio.sleep_forever()  # stopped only by the run's failure's cancel

    @wf.step()
    async def broken(ctx: StepContext) -> None:
        await slow_started.wait()
        raise RuntimeError("the model refused")

    @wf.step(after=[broken])
    async def after_broken(ctx: StepContext) -> None:
        ran.append("after_broken")

    run_id = await queue.start(wf)
    async with running(queue, executors_for(wf)) as worker:
        await worker.wait_for(lambda s: s.failed >= 1)
        # The running step's job was asked to stop; its worker cancels it.
        await worker.wait_for(lambda s: s.running == 0)
    view = await queue.run(run_id)
    assert view is not None
    assert (view.state, view.failed_step) == ("failed", "broken")
    assert view.error == "RuntimeError: the model refused"
    assert {s.step: s.state for s in view.steps} == {
        "slow": "cancelled", "broken": "failed", "after_broken": "cancelled"}
    assert ran == []
    states = await queue.db.fetch("SELECT payload->>'step' AS step, state FROM "
                                  "nasiko_queue_jobs WHERE workflow_run = $1", run_id)
    assert {r["step"]: r["state"] for r in states} == {"slow": "cancelled",
                                                       "broken": "discarded"}


async def test_cancel_a_run_stops_its_running_step_and_nothing_else_starts(
    queue: Queue,
) -> None:
    wf = Workflow("cancellable")
    started = trio.Event()
    ran: list[str] = []

    @wf.step()
    async def first(ctx: StepContext) -> None:
        started.set()
        await trio.sleep_forever()

    @wf.step(after=[first])
    async def second(ctx: StepContext) -> None:
        ran.append("second")

    run_id = await queue.start(wf)
    async with running(queue, executors_for(wf)) as worker:
        await started.wait()
        assert await queue.cancel_run(run_id) == "cancelled"
        await worker.wait_for(lambda s: s.running == 0)
        assert await queue.cancel_run(run_id) == "already cancelled"
    view = await queue.run(run_id)
    assert view is not None
    assert view.state == "cancelled"
    assert {s.step: s.state for s in view.steps} == {"first": "cancelled",
                                                     "second": "cancelled"}
    assert ran == []
    assert await queue.db.fetchval(
        "SELECT state FROM nasiko_queue_jobs WHERE workflow_run = $1", run_id) == "cancelled"
    assert await queue.cancel_run(uuid.uuid4()) is None


async def test_retry_runs_the_failed_and_unstarted_steps_and_keeps_completed_results(
    queue: Queue,
) -> None:
    wf = Workflow("flaky", max_attempts=1)
    calls: dict[str, int] = {"fetch": 0, "summarise": 0, "publish": 0}

    @wf.step()
    async def fetch(ctx: StepContext) -> str:
        calls["fetch"] += 1
        return "page"

    @wf.step(after=[fetch])
    async def summarise(ctx: StepContext) -> str:
        calls["summarise"] += 1
        if calls["summarise"] == 1:
            raise RuntimeError("rate limited")
        return ctx.results["fetch"].upper()

    @wf.step(after=[summarise])
    async def publish(ctx: StepContext) -> str:
        calls["publish"] += 1
        return f"published {ctx.results['summarise']}"

    run_id = await queue.start(wf)
    async with running(queue, executors_for(wf)) as worker:
        await worker.wait_for(lambda s: s.failed >= 1)
        view = await queue.run(run_id)
        assert view is not None
        assert view.state == "failed"
        assert view.step("publish").state == "cancelled"
        assert await queue.retry_run(run_id) == "retried"
        assert await queue.retry_run(run_id) == "not failed: running"
        await worker.wait_for(lambda s: s.done >= 3)
    view = await queue.run(run_id)
    assert view is not None
    assert (view.state, view.result, view.error) == ("completed", "published PAGE", None)
    assert calls == {"fetch": 1, "summarise": 2, "publish": 1}


def approval_workflow(timeout: float | None = None) -> Workflow:
    # Its steps in a queue of their own: the signal's timer goes to the timer
    # type's queue ("workflows"), which the worker serves all the same.
    wf = Workflow("approve", queue="drafts")

    @wf.step()
    async def draft(ctx: StepContext) -> str:
        return "draft 1"

    approval = wf.signal("approval", after=[draft], timeout=timeout)

    @wf.step(after=[draft, approval])
    async def send(ctx: StepContext) -> str:
        return f"{ctx.results['draft']} approved by {ctx.results['approval']['by']}"

    return wf


async def test_a_signal_after_its_step_waits_is_delivered_once_and_holds_no_slot(
    queue: Queue,
) -> None:
    wf = approval_workflow()
    run_id = await queue.start(wf)
    async with running(queue, executors_for(wf)) as worker:
        await worker.wait_for(lambda s: s.done >= 1)
        view = await queue.run(run_id)
        assert view is not None
        assert view.step("approval").state == "waiting"
        # Waiting holds no slot and no job: nothing of the run is running.
        assert worker.stats.running == 0
        assert await queue.db.fetchval(
            "SELECT count(*) FROM nasiko_queue_jobs WHERE state IN ('available', 'running')"
        ) == 0
        assert await queue.signal(run_id, "approvel", {"by": "bob"}) == "no such signal"
        assert await queue.signal(run_id, "approval", {"by": "ana"}) == SignalResult.DELIVERED
        # Once: a second send is refused, whether or not the run has ended since.
        assert await queue.signal(run_id, "approval", {"by": "bob"}) == "already sent"
        await worker.wait_for(lambda s: s.done >= 2)
    view = await queue.run(run_id)
    assert view is not None
    assert (view.state, view.result) == ("completed", "draft 1 approved by ana")
    assert await queue.signal(run_id, "approval", {}) == "already sent"
    assert await queue.signal(uuid.uuid4(), "approval", {}) is None


async def test_a_signal_sent_before_its_step_waits_is_kept_and_consumed_then(
    queue: Queue,
) -> None:
    wf = approval_workflow()
    run_id = await queue.start(wf)
    assert await queue.signal(run_id, "approval", {"by": "early"}) == SignalResult.KEPT
    assert await queue.signal(run_id, "approval", {"by": "late"}) == "already sent"
    async with running(queue, executors_for(wf)) as worker:
        await worker.wait_for(lambda s: s.done >= 2)
    view = await queue.run(run_id)
    assert view is not None
    assert (view.state, view.result) == ("completed", "draft 1 approved by early")


@pytest.mark.parametrize("queues", [None, {"drafts": 2}])
async def test_a_signal_timeout_fails_the_step_and_the_run(
    queue: Queue, queues: dict[str, int] | None
) -> None:
    """The timer fires on a worker that serves the queues its types name, and on
    one given its queues (`{"drafts": 2}`, the steps' queue only): a worker that
    registered a workflow serves the queue of the timer's type, "workflows",
    unless configured otherwise. The second used to leave the timer unclaimed,
    and the run waiting for ever."""
    worker_queue = Queue(queue.db, config=attrs.evolve(queue.config, queues=queues),
                         secrets=MASTER_KEY)
    wf = approval_workflow(timeout=3600)
    run_id = await queue.start(wf)
    async with running(worker_queue, executors_for(wf)) as worker:
        assert sorted(lane.name for lane in worker.lanes) == ["drafts", "workflows"]
        await worker.wait_for(lambda s: s.done >= 1)
        timer = await queue.db.fetchrow(
            "SELECT id, queue, run_at - now() AS left FROM nasiko_queue_jobs "
            "WHERE kind = 'nasiko_queue.signal_timeout'")
        assert timer is not None
        assert timer["queue"] == "workflows"
        assert 3590 < timer["left"].total_seconds() <= 3600
        # An hour passes: the timer is due.
        await queue.db.execute("UPDATE nasiko_queue_jobs SET run_at = now() WHERE id = $1",
                               timer["id"])
        queue.wake()
        await worker.wait_for(lambda s: s.done >= 2)
    view = await queue.run(run_id)
    assert view is not None
    assert (view.state, view.failed_step) == ("failed", "approval")
    assert view.error == "signal approval timed out after 3600 s"
    assert view.step("send").state == "cancelled"
    assert await queue.db.fetchval("SELECT result FROM nasiko_queue_jobs WHERE id = $1",
                                   timer["id"]) == '"timed out"'
    assert await queue.signal(run_id, "approval", {"by": "ana"}) == "run failed"


async def test_a_delayed_step_is_a_scheduled_job_a_durable_sleep(queue: Queue) -> None:
    wf = Workflow("sleepy")
    ran: list[str] = []

    @wf.step()
    async def first(ctx: StepContext) -> int:
        return 1

    @wf.step(after=[first], delay=86_400)
    async def tomorrow(ctx: StepContext) -> int:
        ran.append("tomorrow")
        return ctx.results["first"] + 1

    run_id = await queue.start(wf)
    async with running(queue, executors_for(wf)) as worker:
        await worker.wait_for(lambda s: s.done >= 1)
        job = await queue.db.fetchrow(
            "SELECT id, state, run_at - now() AS left FROM nasiko_queue_jobs "
            "WHERE workflow_run = $1 AND payload->>'step' = 'tomorrow'", run_id)
        assert job is not None
        assert job["state"] == "available"
        assert 86_390 < job["left"].total_seconds() <= 86_400
        assert ran == []
        await queue.db.execute("UPDATE nasiko_queue_jobs SET run_at = now() WHERE id = $1",
                               job["id"])
        queue.wake()
        await worker.wait_for(lambda s: s.done >= 2)
    view = await queue.run(run_id)
    assert view is not None
    assert (view.state, view.result, ran) == ("completed", 2, ["tomorrow"])


async def test_a_child_run_gives_its_result_to_the_parent_step(queue: Queue) -> None:
    child = Workflow("research")

    @child.step()
    async def search(ctx: StepContext) -> list[str]:
        return [f"{ctx.input['topic']} a", f"{ctx.input['topic']} b"]

    @child.step(after=[search])
    async def rank(ctx: StepContext) -> str:
        return ctx.results["search"][-1]

    parent = Workflow("agent")

    @parent.step()
    async def plan(ctx: StepContext) -> dict[str, str]:
        return {"topic": ctx.input["q"]}

    sub = parent.child("sub", child, after=["plan"])

    @parent.step(after=[sub])
    async def answer(ctx: StepContext) -> str:
        return f"answer: {ctx.results['sub']}"

    run_id = await queue.start(parent, {"q": "queues"})
    async with running(queue, executors_for(parent)) as worker:
        await worker.wait_for(lambda s: s.done >= 4)
    view = await queue.run(run_id)
    assert view is not None
    assert (view.state, view.result) == ("completed", "answer: queues b")
    child_id = view.step("sub").child_run
    assert child_id is not None
    child_view = await queue.run(child_id)
    assert child_view is not None
    assert (child_view.state, child_view.result, child_view.parent_run,
            child_view.parent_step) == ("completed", "queues b", run_id, "sub")


async def test_a_failed_child_fails_its_parent(queue: Queue) -> None:
    child = Workflow("doomed", max_attempts=1)

    @child.step()
    async def boom(ctx: StepContext) -> None:
        raise ValueError("no")

    parent = Workflow("host")
    parent.child("sub", child)
    run_id = await queue.start(parent)
    async with running(queue, executors_for(parent)) as worker:
        await worker.wait_for(lambda s: s.failed >= 1)
    view = await queue.run(run_id)
    assert view is not None
    assert (view.state, view.failed_step) == ("failed", "sub")
    assert view.error is not None
    assert view.error.endswith("failed at step boom: ValueError: no")


#: A step job's end as its worker writes it (the trigger of migration 0018 takes
#: the run's transition): completed, or discarded on its last attempt.
END_STEP_JOB = """
UPDATE nasiko_queue_jobs SET state = $2, finished_at = now(), error_msg = $3
WHERE workflow_run = $1 AND state = 'available'
"""


@pytest.mark.parametrize("stale_end", ["fails", "is cancelled"])
async def test_a_replaced_child_run_no_longer_ends_its_parent(
    queue: Queue, stale_end: str
) -> None:
    """
    The parent P is cancelled (its child C1 with it) and retried, as before
    migration 0030 (whose retry resumes C1 instead): its step starts a new
    child C2, which completes, and P goes on to its next step.
    Then C1, retried on its own, fails or is cancelled: P's step no longer
    waits for C1, so P goes on. It used to fail (or cancel) P and rewrite its
    completed step: only a child's completion checked that the step still
    waited for that child.
    """
    child = Workflow("leaf", max_attempts=1)

    @child.step()
    async def work(ctx: StepContext) -> int:
        return 1

    parent = Workflow("trunk")
    sub = parent.child("sub", child)

    @parent.step(after=[sub])
    async def then(ctx: StepContext) -> int:
        return 2

    run_id = await queue.start(parent)
    view = await queue.run(run_id)
    assert view is not None
    first = view.step("sub").child_run
    assert first is not None
    assert await queue.cancel_run(run_id) == "cancelled"
    # What a retry before 0030 left: the step no longer names C1 (runs replaced
    # then still exist), so the retry starts a new child.
    await queue.db.execute("UPDATE nasiko_queue_workflow_steps SET child_run = NULL "
                           "WHERE run_id = $1 AND step = 'sub'", run_id)
    assert await queue.retry_run(run_id) == "retried"
    view = await queue.run(run_id)
    assert view is not None
    second = view.step("sub").child_run
    assert second not in (None, first)
    await queue.db.execute(END_STEP_JOB, second, "completed", None)
    view = await queue.run(run_id)
    assert view is not None
    assert (view.state, view.step("sub").state, view.step("then").state) == (
        "running", "completed", "enqueued")

    assert await queue.retry_run(first) == "retried"
    if stale_end == "fails":
        await queue.db.execute(END_STEP_JOB, first, "discarded", "ValueError: late")
        ended = "failed"
    else:
        assert await queue.cancel_run(first) == "cancelled"
        ended = "cancelled"
    stale = await queue.run(first)
    assert stale is not None
    assert stale.state == ended
    view = await queue.run(run_id)
    assert view is not None
    assert (view.state, view.step("sub").state, view.step("sub").child_run,
            view.step("then").state) == ("running", "completed", second, "enqueued")


async def _step_jobs(queue: Queue, run_id: UUID) -> list[tuple[str, str]]:
    rows = await queue.db.fetch("SELECT payload->>'step' AS step, state FROM nasiko_queue_jobs "
                                "WHERE workflow_run = $1 ORDER BY created_at, id", run_id)
    return [(r["step"], r["state"]) for r in rows]


async def test_a_retry_waits_until_the_stopped_step_has_stopped(queue: Queue) -> None:
    """
    Cancel a run whose step is running, retry it at once: the step's function
    was still running (it stops at its worker's next heartbeat, or later if it
    ignores cancellation) when the retry enqueued the step again, so it ran
    twice at once (found by a bug hunt). The retry is refused until the old
    job has ended, and changes nothing meanwhile.
    """
    wf = Workflow("slow")

    @wf.step()
    async def crunch(ctx: StepContext) -> int:
        return 1

    run_id = await queue.start(wf)
    # A worker has claimed the step's job and runs it.
    await queue.db.execute("UPDATE nasiko_queue_jobs SET state = 'running', attempt = 1 "
                           "WHERE workflow_run = $1", run_id)
    assert await queue.cancel_run(run_id) == "cancelled"
    assert await queue.retry_run(run_id) == "still stopping: crunch"
    with pytest.raises(RunRefused, match=r"still running \(crunch\)"):
        await retry_run(queue.db, run_id)
    view = await queue.run(run_id)
    assert view is not None
    assert (view.state, await _step_jobs(queue, run_id)) == ("cancelled",
                                                             [("crunch", "running")])
    # Its worker heard the cancel and ended the job.
    await queue.db.execute("UPDATE nasiko_queue_jobs SET state = 'cancelled', "
                           "finished_at = now() WHERE workflow_run = $1", run_id)
    assert await queue.retry_run(run_id) == "retried"
    assert await _step_jobs(queue, run_id) == [("crunch", "cancelled"), ("crunch", "available")]


def _two_step_child(calls: list[str]) -> Workflow:
    child = Workflow("pipeline", max_attempts=1)

    @child.step()
    async def expensive(ctx: StepContext) -> int:
        calls.append("expensive")
        return 41

    @child.step(after=[expensive])
    async def flaky(ctx: StepContext) -> int:
        calls.append("flaky")
        return ctx.results["expensive"] + 1

    return child


async def test_a_parents_retry_retries_its_failed_child_keeping_its_completed_steps(
    queue: Queue,
) -> None:
    """
    The child's second step failed, so the child and its parent failed. The
    parent's retry started a whole new child run: the child's completed step ran
    again (found by a bug hunt). It retries the same child run now, whose
    completed step keeps its result.
    """
    calls: list[str] = []
    parent = Workflow("owner")
    parent.child("sub", _two_step_child(calls))
    run_id = await queue.start(parent)
    view = await queue.run(run_id)
    assert view is not None
    child_id = view.step("sub").child_run
    assert child_id is not None
    await queue.db.execute("UPDATE nasiko_queue_jobs SET state = 'completed', "
                           "finished_at = now(), result = '41' WHERE workflow_run = $1 "
                           "AND state = 'available'", child_id)  # expensive
    await queue.db.execute(END_STEP_JOB, child_id, "discarded", "ValueError: flaky")
    view = await queue.run(run_id)
    assert view is not None
    assert view.state == "failed"
    assert await queue.retry_run(run_id) == "retried"
    view = await queue.run(run_id)
    assert view is not None
    assert (view.state, view.step("sub").state, view.step("sub").child_run) == (
        "running", "waiting", child_id)
    assert await _step_jobs(queue, child_id) == [
        ("expensive", "completed"), ("flaky", "discarded"), ("flaky", "available")]
    async with running(queue, executors_for(parent)):
        with trio.fail_after(TEST_DEADLINE):
            assert await queue.run_result(run_id, timeout=TEST_DEADLINE) == 42
    assert calls == ["flaky"]


async def _a_child_retried_on_its_own(queue: Queue) -> tuple[UUID, UUID]:
    """A parent whose child failed (so did the parent) and was retried on its
    own: the parent's and the child's run ids."""
    parent = Workflow("keeper")
    parent.child("sub", _two_step_child([]))
    run_id = await queue.start(parent)
    view = await queue.run(run_id)
    assert view is not None
    child_id = view.step("sub").child_run
    assert child_id is not None
    await queue.db.execute(END_STEP_JOB, child_id, "discarded", "ValueError: early")
    assert await queue.retry_run(child_id) == "retried"
    return run_id, child_id


async def test_a_child_retried_on_its_own_is_waited_for_and_cancelled_with_its_parent(
    queue: Queue,
) -> None:
    """
    The failed child was retried on its own, then its parent: the parent's
    retry started a second child and left the first running with no parent
    waiting for it, and cancelling the parent did not reach it (found by a bug
    hunt). The parent now waits for the child that runs, and a cancel reaches it.
    """
    run_id, child_id = await _a_child_retried_on_its_own(queue)
    assert await queue.retry_run(run_id) == "retried"
    view = await queue.run(run_id)
    assert view is not None
    assert (view.step("sub").state, view.step("sub").child_run) == ("waiting", child_id)
    assert await queue.db.fetchval("SELECT count(*) FROM nasiko_queue_workflow_runs "
                                   "WHERE parent_run = $1", run_id) == 1
    assert await queue.cancel_run(run_id) == "cancelled"
    child = await queue.run(child_id)
    assert child is not None
    assert child.state == "cancelled"


def _nested_top() -> Workflow:
    """A parent with two child steps, each child running a grandchild, and a job
    step that can fail the parent."""
    def grand(n: int) -> Workflow:
        g = Workflow(f"grand{n}", max_attempts=1)

        @g.step()
        async def work(ctx: StepContext) -> int:
            return n

        return g

    def mid(n: int) -> Workflow:
        m = Workflow(f"mid{n}", max_attempts=1)
        m.child("g", grand(n))
        return m

    top = Workflow("top", max_attempts=1)
    top.child("c1", mid(1))
    top.child("c2", mid(2))

    @top.step()
    async def f(ctx: StepContext) -> int:
        return 0

    return top


async def test_a_retry_resumes_every_child_once_even_when_one_completes_at_once(
    queue: Queue,
) -> None:
    """
    Both grandchildren were retried on their own and completed while their
    parents stayed cancelled; the top run's retry then completed child c1 at
    once, whose completion advanced the top run in the middle of the retry,
    while c2's step was still blocked: a second child run of c2 started, and
    the old one was retried too (a review's finding). Each child is resumed
    once now, and no run is started anew.
    """
    top = await queue.start(_nested_top())
    view = await queue.run(top)
    assert view is not None
    children = [view.step(s).child_run for s in ("c1", "c2")]
    grandchildren = []
    for child in children:
        assert child is not None
        mid = await queue.run(child)
        assert mid is not None
        grandchildren.append(mid.step("g").child_run)
    await queue.db.execute(END_STEP_JOB, top, "discarded", "ValueError: f")
    for grandchild in grandchildren:
        assert grandchild is not None
        assert await queue.retry_run(grandchild) == "retried"
        await queue.db.execute(END_STEP_JOB, grandchild, "completed", None)
    runs_before = await queue.db.fetchval("SELECT count(*) FROM nasiko_queue_workflow_runs")
    assert await queue.retry_run(top) == "retried"
    view = await queue.run(top)
    assert view is not None
    assert [view.step(s).child_run for s in ("c1", "c2")] == children
    assert [view.step(s).state for s in ("c1", "c2", "f")] == [
        "completed", "completed", "enqueued"]
    assert await queue.db.fetchval(
        "SELECT count(*) FROM nasiko_queue_workflow_runs") == runs_before


async def test_a_retry_refused_deep_in_its_tree_changes_nothing(queue: Queue) -> None:
    """
    The parent's check of running step jobs passed, then a job of its failed
    child was claimed (the child's failure had skipped it: its row was locked)
    before the child's own retry ran: that retry refused, but its answer was
    dropped and the parent answered 'retried', its step waiting for ever on a
    child that stayed failed (a review's finding). The whole retry is refused
    now and nothing changes.
    """
    from .test_cancel_race import _blocked_by

    child = Workflow("kid", max_attempts=1)

    @child.step()
    async def a(ctx: StepContext) -> int:
        return 1

    @child.step()
    async def b(ctx: StepContext) -> int:
        return 2

    parent = Workflow("dad", max_attempts=1)
    parent.child("sub", child)
    run_id = await queue.start(parent)
    view = await queue.run(run_id)
    assert view is not None
    child_id = view.step("sub").child_run
    b_job = await queue.db.fetchval("SELECT id FROM nasiko_queue_jobs WHERE workflow_run = $1 "
                                    "AND payload->>'step' = 'b'", child_id)
    locked, go, claimed = trio.Event(), trio.Event(), trio.Event()
    answers: list[str | None] = []

    async def claimer() -> None:
        async with queue.db.transaction() as x:
            await x.execute("SELECT 1 FROM nasiko_queue_jobs WHERE id = $1 FOR UPDATE", b_job)
            locked.set()
            await go.wait()
            await x.execute("UPDATE nasiko_queue_jobs SET state = 'running', attempt = 1 "
                            "WHERE id = $1", b_job)
        claimed.set()

    async def retry() -> None:
        answers.append(await queue.retry_run(run_id))

    with trio.fail_after(TEST_DEADLINE):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(claimer)
            await locked.wait()
            await queue.db.execute("UPDATE nasiko_queue_jobs SET state = 'discarded', "
                                   "finished_at = now(), error_msg = 'boom' "
                                   "WHERE workflow_run = $1 AND payload->>'step' = 'a'",
                                   child_id)
            async with queue.db.transaction() as y:
                await y.execute("SELECT 1 FROM nasiko_queue_workflow_runs WHERE id = $1 "
                                "FOR UPDATE", child_id)
                nursery.start_soon(retry)
                await _blocked_by(queue.db, await y.fetchval("SELECT pg_backend_pid()"))
                go.set()
                await claimed.wait()
    assert answers == ["still stopping: b"]
    view = await queue.run(run_id)
    assert view is not None
    assert (view.state, view.step("sub").state) == ("failed", "failed")


async def test_a_child_whose_step_runs_does_not_hold_back_its_parents_retry(
    queue: Queue,
) -> None:
    """
    A child retried on its own runs its step: that step is not one asked to
    stop, so the parent's retry waits for the child instead of being refused
    for as long as the step runs (a review's finding).
    """
    run_id, child_id = await _a_child_retried_on_its_own(queue)
    await queue.db.execute("UPDATE nasiko_queue_jobs SET state = 'running', attempt = 1 "
                           "WHERE workflow_run = $1 AND state = 'available'", child_id)
    assert await queue.retry_run(run_id) == "retried"
    view = await queue.run(run_id)
    assert view is not None
    assert (view.state, view.step("sub").state, view.step("sub").child_run) == (
        "running", "waiting", child_id)


async def test_a_unique_start_returns_the_first_runs_id(queue: Queue) -> None:
    wf = approval_workflow()
    first = await queue.start(wf, unique="release-42")
    assert await queue.start(wf, unique="release-42") == first
    assert await queue.db.fetchval("SELECT count(*) FROM nasiko_queue_workflow_runs") == 1
    assert await queue.db.fetchval("SELECT count(*) FROM nasiko_queue_jobs") == 1
    # Once ever, not only while running: a finished run keeps its key.
    assert await queue.cancel_run(first) == "cancelled"
    assert await queue.start(wf, unique="release-42") == first


async def test_a_start_job_starts_one_run_per_tick_however_often_it_runs(
    queue: Queue,
) -> None:
    wf = approval_workflow()
    tick = await queue.enqueue(StartWorkflow(workflow="approve", input={"n": 1}))
    async with running(queue, executors_for(wf)) as worker:
        await worker.wait_for(lambda s: s.done >= 2)  # the start, then the draft
        # The tick's job runs again (as a retry after a crash would run it).
        await queue.db.execute("UPDATE nasiko_queue_jobs SET state = 'available', "
                               "finished_at = NULL WHERE id = $1", tick)
        queue.wake()
        await worker.wait_for(lambda s: s.done >= 3)
    runs = await queue.db.fetch("SELECT id, unique_key, input::text FROM "
                                "nasiko_queue_workflow_runs")
    assert len(runs) == 1
    assert runs[0]["unique_key"] == f"nasiko_queue.start:{tick}"
    results = await queue.db.fetch("SELECT result FROM nasiko_queue_jobs WHERE id = $1", tick)
    assert results[0]["result"] == f'"{runs[0]["id"]}"'


async def test_a_step_of_a_dead_worker_is_rescued_and_runs_again(queue: Queue) -> None:
    wf = Workflow("rescued")
    ran: list[int] = []

    @wf.step()
    async def only(ctx: StepContext) -> int:
        ran.append(ctx.job.attempt)
        return ctx.job.attempt

    run_id = await queue.start(wf)
    # A worker claimed the step, then died (its heartbeat an hour old).
    dead = uuid.uuid4()
    await queue.db.execute(
        "INSERT INTO nasiko_queue_workers (id, host, pid, kinds, heartbeat_at, lease_secs, "
        "dead_at) VALUES ($1, 'gone', 1, '{}', now() - interval '1 hour', 30, now())", dead)
    await queue.db.execute(
        "UPDATE nasiko_queue_jobs SET state = 'running', attempt = 1, claimed_by = $1, "
        "attempted_at = now() - interval '1 hour' WHERE workflow_run = $2", dead, run_id)
    rescued = await queue.db.fetchrow(Q.plain_rescue, None)
    assert rescued is not None
    assert rescued["rescued"] == 1
    view = await queue.run(run_id)
    assert view is not None
    assert view.state == "running"
    async with running(queue, executors_for(wf)) as worker:
        await worker.wait_for(lambda s: s.done >= 1)
    view = await queue.run(run_id)
    assert view is not None
    assert (view.state, view.result, ran) == ("completed", 2, [2])


async def test_a_dead_workers_step_on_its_last_attempt_fails_the_run_in_the_rescue(
    queue: Queue,
) -> None:
    """The rescue's statement discards the job, and its transition fails the run in
    that same statement: no run waits for a step nobody runs."""
    wf = Workflow("last_try", max_attempts=1)

    @wf.step()
    async def only(ctx: StepContext) -> None: ...

    @wf.step(after=[only])
    async def then(ctx: StepContext) -> None: ...

    run_id = await queue.start(wf)
    dead = uuid.uuid4()
    await queue.db.execute(
        "INSERT INTO nasiko_queue_workers (id, host, pid, kinds, heartbeat_at, lease_secs, "
        "dead_at) VALUES ($1, 'gone', 1, '{}', now() - interval '1 hour', 30, now())", dead)
    await queue.db.execute(
        "UPDATE nasiko_queue_jobs SET state = 'running', attempt = 1, claimed_by = $1, "
        "attempted_at = now() - interval '1 hour' WHERE workflow_run = $2", dead, run_id)
    rescued = await queue.db.fetchrow(Q.plain_rescue, None)
    assert rescued is not None
    assert (rescued["rescued"], rescued["ended"]) == (0, 1)
    view = await queue.run(run_id)
    assert view is not None
    assert (view.state, view.failed_step, view.error) == (
        "failed", "only", "the worker running it died")
    assert view.step("then").state == "cancelled"


async def test_an_operators_cancel_of_a_step_job_cancels_its_run(queue: Queue) -> None:
    from nasiko_queue.admin import jobs as admin_jobs

    run_id = await queue.start(approval_workflow())
    job_id = await queue.db.fetchval(
        "SELECT id FROM nasiko_queue_jobs WHERE workflow_run = $1", run_id)
    assert await admin_jobs.cancel(queue.db, job_id) == "cancelled"
    view = await queue.run(run_id)
    assert view is not None
    assert (view.state, view.step("draft").state, view.step("send").state) == (
        "cancelled", "cancelled", "cancelled")


async def test_mapped_items_ending_in_concurrent_transactions_lose_no_fan_in(
    db: Database, queue: Queue,
) -> None:
    """SQL level: two items of a fan-out complete in two transactions at once. The
    second finds the run's row held by the first's transition and does not wait
    for it (migration 0033): its end is recorded as due, its statement returns,
    and the transition service applies it after the first committed, seeing the
    first's rows. The fan-in starts once."""
    log: list[str] = []
    wf = fanout_workflow(log)
    run_id = await queue.start(wf, Release("1.2", 2))
    build = await db.fetchval("SELECT id FROM nasiko_queue_jobs WHERE workflow_run = $1",
                              run_id)
    await db.execute("UPDATE nasiko_queue_jobs SET state = 'running' WHERE id = $1", build)
    await db.execute("UPDATE nasiko_queue_jobs SET state = 'completed', result = '[\"a\",\"b\"]'"
                     " WHERE id = $1", build)
    items = [r["id"] for r in await db.fetch(
        "SELECT id FROM nasiko_queue_jobs WHERE workflow_run = $1 AND kind = 'release.test' "
        "ORDER BY payload->>'idx'", run_id)]
    await db.execute("UPDATE nasiko_queue_jobs SET state = 'running' WHERE id = ANY($1)",
                     items)
    done = "UPDATE nasiko_queue_jobs SET state = 'completed', result = '{\"ok\": true}' " \
           "WHERE id = $1"

    with trio.fail_after(TEST_DEADLINE):
        async with db.transaction() as tx:
            await tx.execute(done, items[0])
            # The first item's transition holds the run's row: the second's
            # statement returns at once, its transition due.
            await db.execute(done, items[1])
            assert await db.fetchval(
                "SELECT count(*) FROM nasiko_queue_workflow_due WHERE job_id = $1",
                items[1]) == 1
        assert await db.fetchval(
            "SELECT count(*) FROM nasiko_queue_jobs WHERE workflow_run = $1 "
            "AND kind = 'release.report'", run_id) == 0
        assert await TransitionService(db, TransitionConfig()).drain() == 1
    assert await db.fetchval(
        "SELECT count(*) FROM nasiko_queue_jobs WHERE workflow_run = $1 "
        "AND kind = 'release.report'", run_id) == 1
    view = await queue.run(run_id)
    assert view is not None
    assert view.step("test").result == [{"ok": True}, {"ok": True}]


#: Whether a session waits for a lock backend $1 holds (the server's record of
#: who waits for whom, read again until it says so: no sleep stands in for it).
BLOCKED_BY = """
SELECT count(*) > 0 FROM pg_stat_activity
WHERE datname = current_database() AND $1::int = ANY (pg_blocking_pids(pid))
"""


def test_definitions_refuse_what_the_rules_cannot_run() -> None:
    wf = Workflow("shapes")

    @wf.step()
    async def a(ctx: StepContext) -> None: ...

    with pytest.raises(ValueError, match="exists already"):
        wf.signal("a")
    with pytest.raises(ValueError, match="no step 'nope'"):
        wf.signal("s", after=["nope"])
    with pytest.raises(TypeError, match="a list of steps"):
        wf.signal("s", after=a)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"without '\.'"):
        Workflow("a.b")
    with pytest.raises(ValueError, match="own child"):
        wf.child("me", wf)
    with pytest.raises(ValueError, match="no steps"):
        Workflow("empty").definition(None)
    # Its steps' kinds would be the queue's own: a step named signal_timeout took
    # over the signal timers, and signals never timed out (found by a bug hunt).
    with pytest.raises(ValueError, match="the queue's own"):
        Workflow("nasiko_queue")


def _translator(language: str) -> Workflow:
    wf = Workflow("translate")

    @wf.step()
    async def word(ctx: StepContext) -> str:
        return language

    return wf


def test_two_child_workflows_of_one_name_are_refused() -> None:
    """
    A run keeps one definition per child workflow name, and a worker registers
    one executor set per name: two different child workflows named alike made
    one child step silently run the other's steps (the English child ran the
    French workflow), and a child named as its parent lost its definition.
    Both are refused when the parent is registered or started.
    """
    parent = Workflow("multilingual")
    parent.child("english", _translator("english"))
    parent.child("french", _translator("french"))
    with pytest.raises(ValueError, match="two different workflows named 'translate'"):
        Executors().register_workflow(parent)
    with pytest.raises(ValueError, match="two different workflows named 'translate'"):
        parent.definition(None)

    outer = Workflow("translate")
    outer.child("inner", _translator("any"))
    with pytest.raises(ValueError, match="two different workflows named 'translate'"):
        outer.children()
    # The same workflow object twice, at any depth, is one child workflow.
    shared = _translator("shared")
    twice = Workflow("twice")
    twice.child("one", shared)
    middle = Workflow("middle")
    middle.child("deep", shared)
    twice.child("two", middle)
    assert twice.children() == {"translate": shared, "middle": middle}


def _mapped_then_not(version: int, seen: list[tuple[Any, Any]]) -> Workflow:
    """Deploy 1 maps step b over a's list; deploy 2 makes b a plain step."""
    wf = Workflow("reshaped")

    @wf.step()
    async def a(ctx: StepContext) -> list[str]:
        return ["x", "y", "z"]

    async def b(ctx: StepContext) -> str:
        seen.append((ctx.item, ctx.index))
        return f"v{version} {ctx.item} {ctx.index}"

    b_step = (wf.step(map_over=a, queue="later")(b) if version == 1
              else wf.step(after=[a], queue="later")(b))

    @wf.step(after=[b_step])
    async def c(ctx: StepContext) -> Any:
        return ctx.results["b"]

    return wf


async def test_a_deploy_that_changes_a_step_never_reshapes_a_run_in_flight(
    queue: Queue,
) -> None:
    """
    A run of deploy 1 has enqueued step b's three items (b maps over a's list)
    when deploy 2, in which b is a plain step, takes over. Each item still runs
    as an item of the run's own definition. The executor used to ask the new
    code whether b is mapped: each item ran with no item and no index.
    """
    seen: list[tuple[Any, Any]] = []
    first = Executors()
    v1 = _mapped_then_not(1, seen)
    first.register_workflow(v1)
    run_id = await queue.start(v1, None)
    only_workflows = Queue(queue.db, config=attrs.evolve(queue.config,
                                                         queues={"workflows": 1}))
    async with running(only_workflows, first) as worker:
        with trio.fail_after(TEST_DEADLINE):
            await worker.drain_once()  # a ran; b's items wait in queue "later"
    assert await queue.db.fetchval(
        "SELECT count(*) FROM nasiko_queue_workflow_steps WHERE run_id = $1 AND step = 'b' "
        "AND idx >= 0 AND state = 'enqueued'", run_id) == 3
    second = Executors()
    second.register_workflow(_mapped_then_not(2, seen))
    async with running(queue, second):
        with trio.fail_after(TEST_DEADLINE):
            result = await queue.run_result(run_id, timeout=TEST_DEADLINE)
    assert sorted(seen) == [("x", 0), ("y", 1), ("z", 2)]
    assert result == ["v2 x 0", "v2 y 1", "v2 z 2"]


@pytest.mark.parametrize(("make", "what"), [
    (lambda wf: wf.step(delay=1e13)(_noop_step), "delay"),
    (lambda wf: wf.step(delay=-1.0)(_noop_step), "delay"),
    (lambda wf: wf.step(delay=float("nan"))(_noop_step), "delay"),
    (lambda wf: wf.signal("ok", timeout=1e13), "timeout"),
])
def test_a_wait_past_what_a_timestamp_holds_is_refused_at_definition(
    make: Callable[[Workflow], Any], what: str
) -> None:
    """A delay or a signal timeout is written as a timestamp by the transition
    that ends the step before it: 1e13 s past now is out of PostgreSQL's range,
    so that step's completion failed ("timestamp out of range"), its run stuck.
    Refused when the workflow is defined instead (100 years at most)."""
    wf = Workflow("waits")
    with pytest.raises(ValueError, match=rf"waits\.\w+: a {what} is 0 to 3155760000 seconds"):
        make(wf)
    wf.step(delay=3600.0)(_noop_step)  # an hour is fine


async def _noop_step(ctx: StepContext) -> None:
    return None


async def test_run_result_is_woken_by_the_runs_end_and_a_failed_run_raises(
    queue: Queue,
) -> None:
    """The waiting side polls once an hour: each wait here was woken by NOTIFY."""
    waiting = Queue(queue.db, config=attrs.evolve(WORKFLOW_CONFIG, poll_interval=3600.0))
    log: list[str] = []
    good = fanout_workflow(log)
    bad = approval_workflow(timeout=60)
    good_id = await queue.start(good, Release("1.2", 2))
    bad_id = await queue.start(bad)
    got: dict[str, Any] = {}

    with trio.fail_after(TEST_DEADLINE):
        async with waiting.results() as results, trio.open_nursery() as nursery:
            blocked = trio.Event()
            seen: set[uuid.UUID] = set()

            def on_waiting(run_id: uuid.UUID) -> None:
                seen.add(run_id)
                if len(seen) == 2:
                    blocked.set()

            results.on_waiting = on_waiting

            async def wait_both(which: str, run_id: uuid.UUID) -> None:
                try:
                    got[which] = await results.wait_run(run_id)
                except RunFailed as exc:
                    got[which] = exc

            nursery.start_soon(wait_both, "good", good_id)
            nursery.start_soon(wait_both, "bad", bad_id)
            await blocked.wait()  # both read their run's row, found it running
            async with running(queue, executors_for(good, bad)) as worker:
                await worker.wait_for(lambda s: s.done >= 5)
                assert await queue.cancel_run(bad_id) == "cancelled"
    assert got["good"] == "f0,f1"
    failed = got["bad"]
    assert isinstance(failed, RunFailed)
    assert (failed.run_id, failed.state, failed.step) == (bad_id, "cancelled", None)
    assert str(failed) == f"run {bad_id} cancelled"
    # An ended run answers at once; no waits are left behind.
    with trio.fail_after(TEST_DEADLINE):
        assert await waiting.run_result(good_id) == "f0,f1"
        with pytest.raises(NoSuchRun):
            await waiting.run_result(uuid.uuid4())
    assert await queue.db.fetchval("SELECT count(*) FROM nasiko_queue_result_waits") == 0


async def test_a_cancel_skips_a_step_job_another_transaction_holds_and_it_never_runs(
    queue: Queue,
) -> None:
    """The completer holds a step job's row while its trigger waits for the run's
    row; a cancel holding the run's row must not wait for the job's (a deadlock).
    It skips it; the job, claimed later, finds its run ended and does not run:
    it asks to stop, and ends `cancelled` at its worker's heartbeat (migration
    0034; it ended `completed` before, having completed nothing)."""
    queue = Queue(queue.db, config=WORKFLOW_CONFIG)
    wf = Workflow("held")
    ran: list[str] = []

    @wf.step()
    async def only(ctx: StepContext) -> None:
        ran.append("only")

    run_id = await queue.start(wf)
    with trio.fail_after(TEST_DEADLINE):
        async with queue.db.transaction() as tx:
            await tx.execute("SELECT 1 FROM nasiko_queue_jobs WHERE workflow_run = $1 "
                             "FOR UPDATE", run_id)
            assert await queue.cancel_run(run_id) == "cancelled"
    assert await queue.db.fetchval(
        "SELECT state FROM nasiko_queue_jobs WHERE workflow_run = $1", run_id) == "available"
    async with running(queue, executors_for(wf)) as worker:
        await worker.wait_for(lambda s: s.cancelled >= 1)
    assert ran == []
    view = await queue.run(run_id)
    assert view is not None
    assert (view.state, view.step("only").state) == ("cancelled", "cancelled")
    assert await queue.db.fetchval(
        "SELECT state FROM nasiko_queue_jobs WHERE workflow_run = $1", run_id) == "cancelled"


async def test_a_cron_schedule_starts_one_run_per_tick_across_replicas(queue: Queue) -> None:
    """Two replicas' schedulers run the same rounds; each tick enqueues one start
    job (the scheduler's rule), and each start job one run (its unique key)."""
    wf = approval_workflow()
    schedule = Schedule("morning", "0 6 * * *",
                        StartWorkflow(workflow="approve", input={"day": "x"}))
    replicas = [Scheduler(queue, [schedule]), Scheduler(queue, [schedule])]
    for now in (datetime(2024, 5, 1, 5, 0, tzinfo=UTC), datetime(2024, 5, 1, 6, 0, 1, tzinfo=UTC),
                datetime(2024, 5, 2, 6, 0, 1, tzinfo=UTC)):
        for scheduler in replicas:
            await scheduler.run_once(now)
    async with running(queue, executors_for(wf)) as worker:
        await worker.wait_for(lambda s: s.done >= 4)  # two starts, two drafts
    runs = await queue.db.fetch(
        "SELECT r.input::text AS input, j.run_at FROM nasiko_queue_workflow_runs AS r "
        "JOIN nasiko_queue_jobs AS j ON r.unique_key = 'nasiko_queue.start:' || j.id "
        "ORDER BY j.run_at")
    assert [(r["input"], r["run_at"]) for r in runs] == [
        ('{"day": "x"}', datetime(2024, 5, 1, 6, 0, tzinfo=UTC)),
        ('{"day": "x"}', datetime(2024, 5, 2, 6, 0, tzinfo=UTC))]
    assert await queue.db.fetchval("SELECT count(*) FROM nasiko_queue_workflow_runs") == 2


async def test_bad_input_is_refused_with_a_clear_error_and_nothing_starts(
    queue: Queue,
) -> None:
    log: list[str] = []
    wf = fanout_workflow(log)
    with pytest.raises(InvalidPayload, match="release's input is a Release, not dict"):
        await queue.start(wf, {"version": "1"})
    with pytest.raises(InvalidPayload, match="must be JSON"):
        await queue.start(approval_workflow(), {"when": {1, 2}})
    with pytest.raises(ValueError, match="non-empty string"):
        await queue.start(approval_workflow(), unique="")
    run_id = await queue.start(approval_workflow())
    with pytest.raises(InvalidPayload, match="NUL"):
        await queue.signal(run_id, "approval", {"by": "a\x00b"})
    assert await queue.db.fetchval("SELECT count(*) FROM nasiko_queue_workflow_runs") == 1
    assert await queue.db.fetchval("SELECT count(*) FROM nasiko_queue_workflow_signals") == 0


async def test_a_start_in_the_callers_transaction_vanishes_with_it(queue: Queue) -> None:
    wf = approval_workflow()

    class Undo(Exception):
        pass

    started: list[uuid.UUID] = []

    async def start_then_fail() -> None:
        async with queue.db.transaction() as tx:
            started.append(await queue.start(wf, tx=tx))
            assert await tx.fetchval("SELECT count(*) FROM nasiko_queue_jobs "
                                     "WHERE workflow_run = $1", started[0]) == 1
            raise Undo

    with pytest.raises(Undo):
        await start_then_fail()
    [run_id] = started
    assert await queue.run(run_id) is None
    assert await queue.db.fetchval("SELECT count(*) FROM nasiko_queue_jobs") == 0
    async with queue.db.transaction() as tx:
        kept = await queue.start(wf, tx=tx)
    view = await queue.run(kept)
    assert view is not None
    assert view.step("draft").state == "enqueued"


async def test_the_stuck_run_check_finds_a_run_whose_transition_was_lost(
    queue: Queue,
) -> None:
    """What every test here checks at its end can fail: a step job that ended
    without its transition (here: its run's id removed first) leaves its run stuck."""
    run_id = await queue.start(approval_workflow())
    await queue.db.execute("UPDATE nasiko_queue_jobs SET workflow_run = NULL, "
                           "state = 'completed' WHERE workflow_run = $1", run_id)
    assert [r["id"] for r in await queue.db.fetch(Q.workflow_stuck_runs)] == [run_id]
    assert await queue.cancel_run(run_id) == "cancelled"


async def test_a_cancel_that_the_server_aborts_for_a_deadlock_is_run_again(dsn: str) -> None:
    """
    Cancelling a parent locks it and then its child; a child's step ending
    locks the child and then, as the child completes, its parent. Met head on,
    PostgreSQL aborts one of the two: the worker's finish is retried, but a
    user's `cancel_run` raised DeadlockDetectedError (found by a bug hunt). It is
    run again now. Here the cancel's session detects the deadlock first
    (deadlock_timeout 20 ms against the other's 1 s), so it is the one aborted.
    """
    from .test_cancel_race import _blocked_by

    child = Workflow("quick")

    @child.step()
    async def only(ctx: StepContext) -> int:
        return 1

    parent = Workflow("waiter")
    parent.child("sub", child)
    sep = "&" if "?" in dsn else "?"
    async with open_database(dsn) as db, \
            open_database(f"{dsn}{sep}deadlock_timeout=20ms") as cancelling:
        run_id = await Queue(db, config=FAST).start(parent)
        view = await Queue(db, config=FAST).run(run_id)
        assert view is not None
        child_id = view.step("sub").child_run
        answers: list[str | None] = []

        async def cancel() -> None:
            answers.append(await Queue(cancelling, config=FAST).cancel_run(run_id))

        with trio.fail_after(TEST_DEADLINE):
            async with trio.open_nursery() as nursery, db.transaction() as ending:
                # The child's step ends: its trigger has locked the child run...
                await ending.execute("SELECT 1 FROM nasiko_queue_workflow_runs WHERE id = $1 "
                                     "FOR UPDATE", child_id)
                nursery.start_soon(cancel)
                await _blocked_by(db, await ending.fetchval("SELECT pg_backend_pid()"))
                # ...and, completing the child, wants its parent, which the cancel holds.
                await ending.execute(END_STEP_JOB, child_id, "completed", None)
    assert answers in (["cancelled"], ["already completed"])


async def test_a_step_is_given_only_its_own_dependencies_results(queue: Queue) -> None:
    """The worker parses a large dependency result once per run and shares it
    (`ResultCache`); a step that does not depend on it must not see it (review of
    issue #45: every held result was merged into every step's `ctx.results`)."""
    wf = Workflow("held_results")
    seen: dict[str, list[str]] = {}

    @wf.step()
    async def big(ctx: StepContext) -> list[str]:
        return ["x" * 100] * 400  # about 40 kB of JSON: held parsed by the worker

    @wf.step(after=[big])
    async def uses_big(ctx: StepContext) -> int:
        seen["uses_big"] = sorted(ctx.results)
        return len(ctx.results["big"])

    @wf.step(after=[uses_big])
    async def after_that(ctx: StepContext) -> int:
        seen["after_that"] = sorted(ctx.results)
        return 1

    run_id = await queue.start(wf)
    async with running(queue, executors_for(wf)):
        with trio.fail_after(TEST_DEADLINE):
            assert await queue.run_result(run_id) == 1
    assert seen == {"uses_big": ["big"], "after_that": ["uses_big"]}


@pytest.mark.parametrize("end", ["discarded", "cancel"])
async def test_a_childs_end_never_waits_for_its_parents_row(queue: Queue, end: str) -> None:
    """
    A child run's failure (its step discarded, in a worker's finish) or cancel
    ended the parent's waiting step with the parent's row taken FOR UPDATE: it
    waited for whoever held the parent (the transition service on a piece of
    the parent's fan-out; an application cancelling the parent, which then locks
    the child: a deadlock). Review of issue #45; migration 0037: with the
    parent's row held, the child's end commits at once and leaves the parent
    due; the transition service then fails (or cancels) the parent.
    """
    calls: list[str] = []
    parent = Workflow("holder")
    parent.child("sub", _two_step_child(calls))
    run_id = await queue.start(parent)
    view = await queue.run(run_id)
    assert view is not None
    child_id = view.step("sub").child_run
    assert child_id is not None
    async with queue.db.transaction() as holding:
        await holding.execute("SELECT 1 FROM nasiko_queue_workflow_runs WHERE id = $1 "
                              "FOR UPDATE", run_id)
        # On another connection, bounded: before 0037 it waited for `holding`.
        async with queue.db.transaction() as child_end:
            await child_end.execute("SET LOCAL lock_timeout = '2s'")
            if end == "discarded":
                await child_end.execute(END_STEP_JOB, child_id, "discarded", "ValueError: x")
            else:
                assert await child_end.fetchval("SELECT nasiko_queue_workflow_cancel($1)",
                                                child_id) == "cancelled"
    assert await queue.db.fetchval("SELECT state FROM nasiko_queue_workflow_runs "
                                   "WHERE id = $1", run_id) == "running"
    service = TransitionService(queue.db, TransitionConfig(piece=1000))
    assert await service.drain() >= 1
    view = await queue.run(run_id)
    assert view is not None
    assert view.state == ("failed" if end == "discarded" else "cancelled")
