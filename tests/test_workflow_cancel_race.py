"""
A run's cancel racing a step's claim (issue #45, bug 3): the stop is never lost;
and a cancel the server aborts for a parent/child lock cycle is run again by the
asyncio client too (a suspicion of the same issue, found real).

A run's end (its cancel, or a step's failure) stops its unfinished steps, but
skips a step job whose row another transaction holds: waiting there, under the
run's lock, would deadlock with the finishes that wait for it. The skipped job
was left to its executor's check of the run, made once, before the cancel had
committed (an application cancels inside its own transaction): the step ran in
full and ended `completed`, never asked to stop, and `retry_run` answered
"still stopping" all the while. The executor now waits for an end of its run
in flight before it reads the run (migration 0034), and a step that will not
run ends `cancelled`.

The claim in flight is a real worker's, gated: a test trigger makes the claim
of a step job wait for an advisory lock the test holds, after the claim has
locked the job's row (as a slow claim would).
"""

from __future__ import annotations

import contextlib
from uuid import UUID

import asyncpg
import attrs
import pytest
import trio

from nasiko_queue import CancelResult, Executors, Queue, StepContext, Workflow, aio
from nasiko_queue.db.database import Database
from nasiko_queue.db.statements import Q

from .conftest import FAST
from .helpers import TEST_DEADLINE, running
from .plain_asyncio import run_asyncio
from .test_cancel_race import BLOCKED_BY, _blocked_by

#: A heartbeat short enough that a step asked to stop ends at once (its worker
#: sees the request at its next heartbeat).
CONFIG = attrs.evolve(FAST, heartbeat_interval=0.2, lease=1.0)

#: The gate's advisory lock key.
GATE = 4545

#: The claim of a step job (available -> running) waits for the gate, holding
#: the job's row: the claim's own FOR UPDATE took it before this trigger runs.
GATE_CLAIMS = f"""
CREATE FUNCTION test_gate_claim() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_advisory_xact_lock_shared({GATE});
    RETURN NEW;
END $$;
CREATE TRIGGER test_gate_claim BEFORE UPDATE OF state ON nasiko_queue_jobs
    FOR EACH ROW
    WHEN (OLD.state = 'available' AND NEW.state = 'running' AND NEW.workflow_run IS NOT NULL)
    EXECUTE FUNCTION test_gate_claim();
"""

STEP_JOB = """
SELECT state, cancel_requested, attempt FROM nasiko_queue_jobs
WHERE workflow_run = $1 AND payload ->> 'step' = $2
"""

#: An operator's discard of step job $1: its step fails, and its run.
DISCARD = """
UPDATE nasiko_queue_jobs SET state = 'discarded', finished_at = now(), error_msg = 'boom'
WHERE id = $1
"""


def one_step(ran: list[str]) -> Workflow:
    wf = Workflow("race")

    @wf.step()
    async def b(ctx: StepContext) -> str:
        ran.append(ctx.step)
        return "ran"

    return wf


def executors_for(wf: Workflow) -> Executors:
    executors = Executors()
    executors.register_workflow(wf)
    return executors


async def _pid(tx: object) -> int:
    pid: int = await tx.fetchval("SELECT pg_backend_pid()")  # type: ignore[attr-defined]
    return pid


async def _until_waiting_or_ran(db: Database, pid: int, ran: list[str]) -> None:
    """Return once a session waits for a lock backend `pid` holds (the executor,
    waiting for the cancel) or the step's function has run (the bug)."""
    while not ran and not await db.fetchval(BLOCKED_BY, pid):  # noqa: ASYNC110
        await trio.sleep(0.005)


async def _step_job_ended(db: Database, run_id: UUID, step: str = "b") -> str:
    """Step `step`'s job's state once it has ended (read again until then)."""
    while True:
        row = await db.fetchrow(STEP_JOB, run_id, step)
        if row["state"] not in ("available", "running"):
            return str(row["state"])
        await trio.sleep(0.01)


@pytest.mark.parametrize("in_app_transaction", [True, False],
                         ids=["in-an-app-transaction", "on-its-own"])
async def test_a_runs_cancel_reaches_a_step_whose_claim_is_in_flight(
    db: Database, in_app_transaction: bool
) -> None:
    """
    A worker's claim holds the step job's row (gated); the run is cancelled
    then: inside an application's transaction (as `aio.cancel` runs), which
    commits only once the claim has committed and the executor has started, or
    on its own. The step's function never runs, the job ends `cancelled`, and
    `retry_run` runs the step again once it has.
    Before the fix: in a transaction, the step ran and ended `completed`, never
    asked to stop; on its own, the step ran not, but its job ended `completed`.
    """
    queue = Queue(db, config=CONFIG)
    ran: list[str] = []
    wf = one_step(ran)
    run_id = await queue.start(wf)
    await db.execute(GATE_CLAIMS)
    with trio.fail_after(TEST_DEADLINE):
        async with contextlib.AsyncExitStack() as workers, \
                contextlib.AsyncExitStack() as gated, contextlib.AsyncExitStack() as app_stack:
            # The gate before the worker starts: it claims as it starts.
            gate = await gated.enter_async_context(db.transaction())
            await gate.execute("SELECT pg_advisory_xact_lock($1)", GATE)
            worker = await workers.enter_async_context(running(queue, executors_for(wf)))
            # The worker's claim has locked the job's row and waits at the gate.
            await _blocked_by(db, await _pid(gate))
            if in_app_transaction:
                app = await app_stack.enter_async_context(db.transaction())
                assert await app.fetchval(Q.workflow_cancel, run_id) == "cancelled"
                app_pid = await _pid(app)
            else:
                assert await queue.cancel_run(run_id) == "cancelled"
            await gated.aclose()  # the gate opens: the claim commits, the executor starts
            if in_app_transaction:
                await _until_waiting_or_ran(db, app_pid, ran)
                await app_stack.aclose()  # the cancel commits
            assert await _step_job_ended(db, run_id) == "cancelled"
            await worker.wait_for(lambda s: s.running == 0)
    assert ran == []
    row = await db.fetchrow(STEP_JOB, run_id, "b")
    assert (row["state"], row["cancel_requested"], row["attempt"]) == ("cancelled", True, 1)
    view = await queue.run(run_id)
    assert view is not None
    assert (view.state, view.step("b").state) == ("cancelled", "cancelled")
    # Stopped: the retry is not refused, and the step runs.
    await db.execute("DROP TRIGGER test_gate_claim ON nasiko_queue_jobs")
    assert await queue.retry_run(run_id) == "retried"
    with trio.fail_after(TEST_DEADLINE):
        async with running(queue, executors_for(wf)):
            assert await queue.run_result(run_id, timeout=TEST_DEADLINE) == "ran"
    assert ran == ["b"]


async def test_a_runs_failure_reaches_a_step_whose_claim_is_in_flight(db: Database) -> None:
    """
    The other end of a run, by the same rule: a step fails (its job discarded,
    by an operator's statement in an application's transaction) while a
    worker's claim of a sibling step holds that one's row. The run fails; the
    sibling's function never runs and its job ends `cancelled`. Before the
    fix: the sibling ran and ended `completed`.
    """
    queue = Queue(db, config=CONFIG)
    ran: list[str] = []
    wf = Workflow("fails")

    @wf.step(delay=3600)  # due later: never claimed here
    async def a(ctx: StepContext) -> None:
        ran.append(ctx.step)

    @wf.step()
    async def b(ctx: StepContext) -> str:
        ran.append(ctx.step)
        return "ran"

    run_id = await queue.start(wf)
    a_job = await db.fetchval("SELECT id FROM nasiko_queue_jobs WHERE workflow_run = $1 "
                              "AND payload ->> 'step' = 'a'", run_id)
    await db.execute(GATE_CLAIMS)
    with trio.fail_after(TEST_DEADLINE):
        async with contextlib.AsyncExitStack() as workers, \
                contextlib.AsyncExitStack() as gated, contextlib.AsyncExitStack() as app_stack:
            gate = await gated.enter_async_context(db.transaction())
            await gate.execute("SELECT pg_advisory_xact_lock($1)", GATE)
            worker = await workers.enter_async_context(running(queue, executors_for(wf)))
            # The worker's claim has locked b's job's row and waits at the gate.
            await _blocked_by(db, await _pid(gate))
            app = await app_stack.enter_async_context(db.transaction())
            await app.execute(DISCARD, a_job)
            app_pid = await _pid(app)
            await gated.aclose()  # the gate opens: the claim commits, the executor starts
            await _until_waiting_or_ran(db, app_pid, ran)
            await app_stack.aclose()  # the failure commits
            assert await _step_job_ended(db, run_id, "b") == "cancelled"
            await worker.wait_for(lambda s: s.running == 0)
    assert ran == []
    view = await queue.run(run_id)
    assert view is not None
    assert (view.state, view.failed_step, view.step("a").state, view.step("b").state) == (
        "failed", "a", "failed", "cancelled")

async def test_an_aio_cancel_meeting_a_parents_cancel_makes_no_deadlock(
    db: Database, dsn: str
) -> None:
    """
    Suspicion of issue #45: cancelling a child run's step job locks the job, the
    child run (its trigger) and then the parent (the child's cancel reaches it);
    a parent's cancel locks the parent and then the child. Met head on, the
    server aborted one, and `aio.cancel` raised DeadlockDetectedError. Since
    migration 0037 the child's end takes its parent's row only if it is free
    (held, the parent is left to the transition service), so the cycle never
    forms: both cancels answer. (`aio.cancel` still runs a deadlocked try again,
    in a savepoint, for any cycle an application's own locks might make.)

    Deterministic: the aio cancel is held (the child's end-of-run lock, taken
    by the test) once it has locked the job and the child; the parent's cancel
    then waits for the child; released, the aio cancel waits for the parent and
    closes the cycle, and its session, whose deadlock_timeout is 20 ms against
    the other's 10 s, is the one aborted.
    """
    child = Workflow("quick")

    @child.step()
    async def only(ctx: StepContext) -> int:
        return 1

    parent = Workflow("waiter")
    parent.child("sub", child)
    queue = Queue(db, config=CONFIG)
    run_id = await queue.start(parent)
    view = await queue.run(run_id)
    assert view is not None
    child_id = view.step("sub").child_run
    job_id = await db.fetchval("SELECT id FROM nasiko_queue_jobs WHERE workflow_run = $1",
                               child_id)
    outcomes: list[object] = []

    async def aio_cancel() -> None:
        async def main() -> object:
            conn = await asyncpg.connect(dsn, server_settings={"deadlock_timeout": "20ms"})
            try:
                async with conn.transaction():  # the application's own
                    return await aio.cancel(conn, job_id)
            finally:
                await conn.close()

        try:
            outcomes.append(await trio.to_thread.run_sync(run_asyncio, main()))
        except asyncpg.DeadlockDetectedError as exc:
            outcomes.append(exc)

    answers: list[str] = []
    with trio.fail_after(TEST_DEADLINE):
        async with trio.open_nursery() as outer, db.transaction() as cancelling:
            await cancelling.execute("SET LOCAL deadlock_timeout = '10s'")
            # The parent's cancel has locked the parent run.
            await cancelling.execute("SELECT 1 FROM nasiko_queue_workflow_runs WHERE id = $1 "
                                     "FOR UPDATE", run_id)

            async def cancel_parent() -> None:
                answers.append(await cancelling.fetchval(Q.workflow_cancel, run_id))

            async with trio.open_nursery() as inner, db.transaction() as hold:
                await hold.execute(
                    "SELECT pg_advisory_xact_lock(hashtext('nasiko_queue.run_end'), "
                    "hashtext($1::uuid::text))", child_id)
                outer.start_soon(aio_cancel)
                # The aio cancel holds the job and the child run, and waits here.
                await _blocked_by(db, await _pid(hold))
                aio_pid = await db.fetchval(
                    "SELECT pid FROM pg_stat_activity WHERE $1::int = ANY "
                    "(pg_blocking_pids(pid))", await _pid(hold))
                inner.start_soon(cancel_parent)
                # The parent's cancel reaches the child run, which the aio cancel holds.
                await _blocked_by(db, aio_pid)
                # Released on leaving: the aio cancel finds the parent's row held,
                # leaves the parent due and commits; the parent's cancel then ends.
    assert answers == ["cancelled"]
    assert outcomes == [CancelResult.CANCELLED]
    view = await queue.run(child_id)
    assert view is not None
    assert view.state == "cancelled"
