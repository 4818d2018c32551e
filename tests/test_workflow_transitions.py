"""
Bounded workflow transitions (issue #45, bugs 2 and 4; migration 0033).

A step's end takes its transition inside the finish only when the run's row is
free and the transition is small; what is left (a held row, a fan-out's further
pieces, a large join) is recorded as due and applied by a `TransitionService`,
a piece per transaction, resumable from the cursor on the mapped step's head.

No sleeps: a test waits on the worker's counters or on events its steps set,
gates a transition by holding the run's row from a test connection, and drives
the service's pieces itself where their order matters.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, ClassVar
from uuid import UUID

import attrs
import pytest
import trio

from nasiko_queue import (
    Database,
    DatabaseConfig,
    Executors,
    JobArgs,
    JobOptions,
    PlainJobContext,
    Queue,
    StepContext,
    Workflow,
    open_database,
)
from nasiko_queue.db.statements import Q
from nasiko_queue.engine.worker import Worker
from nasiko_queue.workflows.transitions import TransitionConfig, TransitionService

from .conftest import FAST, MASTER_KEY
from .helpers import TEST_DEADLINE


class _Rollback(Exception):
    """Raised to roll a test's transaction back."""


def _plan_workflow(name: str, items: int, *, item_queue: str = "items") -> Workflow:
    """`plan` returns `items` numbers; `work` maps over them (on `item_queue`,
    which the tests' workers do not serve unless they say so); `join` after."""
    wf = Workflow(name)

    @wf.step()
    async def plan(ctx: StepContext) -> list[int]:
        return list(range(items))

    @wf.step(map_over=plan, queue=item_queue)
    async def work(ctx: StepContext) -> int:
        assert ctx.item == ctx.index
        return int(ctx.item) * 2

    @wf.step(after=[work])
    async def join(ctx: StepContext) -> int:
        return len(ctx.results["work"])

    return wf


@asynccontextmanager
async def _worker(queue: Queue, executors: Executors, *,
                  service: bool = True) -> AsyncIterator[Worker]:
    """A started worker (without its transition service unless `service`)."""
    worker = Worker(queue, executors)
    if not service:
        worker.transitions = None
    with trio.fail_after(TEST_DEADLINE):
        async with trio.open_nursery() as nursery:
            await nursery.start(worker.run)
            yield worker
            worker.stop()


async def _count(db: Database, sql: str, *args: Any) -> int:
    return int(await db.fetchval(sql, *args))


async def _item_jobs(db: Database, run_id: UUID) -> int:
    return await _count(db, "SELECT count(*) FROM nasiko_queue_jobs WHERE workflow_run = $1 "
                            "AND payload ->> 'step' = 'work'", run_id)


async def _head(db: Database, run_id: UUID) -> dict[str, Any]:
    row = await db.fetchrow(
        "SELECT state, items, enqueued_to, done_items FROM nasiko_queue_workflow_steps "
        "WHERE run_id = $1 AND step = 'work' AND idx = -1", run_id)
    assert row is not None
    return dict(row)


async def test_a_fan_out_longer_than_the_statement_bound_lands_in_pieces(dsn: str) -> None:
    """
    Bug 2: the plan step's finish used to enqueue every item in its statement,
    which `cleanup_timeout` cut on every try; with the server's
    client_connection_check_interval set each cut try rolled back, and the
    fan-out never landed (the plan step stayed `running`). 20,000 items take
    seconds to enqueue in one statement; the bound here is 0.3 s. Now the finish
    enqueues the first piece (at once claimable), and the service the rest, a
    committed piece at a time.
    """
    items = 20_000
    name = dsn.rsplit("/", 1)[1]
    async with open_database(dsn) as admin:
        await admin.execute(f'ALTER DATABASE "{name}" SET client_connection_check_interval '
                            "= '100ms'")
    config = attrs.evolve(FAST, cleanup_timeout=0.3, queues={"workflows": 1})
    async with open_database(dsn) as db:
        queue = Queue(db, config=config, secrets=MASTER_KEY)
        wf = _plan_workflow("wide", items)
        executors = Executors()
        executors.register_workflow(wf)
        run_id = await queue.start(wf, None)
        # The worker runs `plan` (its items' queue is not served); the test
        # drives the service's pieces.
        async with _worker(queue, executors, service=False) as worker:
            await worker.wait_for(lambda s: s.done >= 1)
        # The plan step's end landed, with the first piece: claimable now.
        head = await _head(db, run_id)
        assert (head["state"], head["items"], head["enqueued_to"]) == ("enqueued", items, 100)
        assert await _item_jobs(db, run_id) == 100
        service = TransitionService(db, TransitionConfig(piece=1000))
        with trio.fail_after(TEST_DEADLINE):
            await service.drain()
        assert service.pieces >= (items - 100) // 1000
        assert await _item_jobs(db, run_id) == items
        assert (await _head(db, run_id))["enqueued_to"] == items
        # Each item once, with its own element.
        assert await _count(
            db, "SELECT count(DISTINCT idx) FROM nasiko_queue_workflow_steps "
                "WHERE run_id = $1 AND step = 'work' AND idx >= 0 AND item = to_jsonb(idx) "
                "AND state = 'enqueued' AND job_id IS NOT NULL", run_id) == items


@attrs.frozen(kw_only=True)
class Email(JobArgs):
    """A plain job of an unrelated queue."""

    kind: ClassVar[str] = "email"
    options: ClassVar[JobOptions] = JobOptions(queue="email")


async def test_another_queues_job_starts_while_a_transition_waits_for_its_run(
    dsn: str,
) -> None:
    """
    Bug 4: a step's finish waited, in the trigger, for the run's row, holding
    an engine connection every lane of the worker needs; here there is one, so
    an `email` job enqueued then could not even be claimed until the row was
    free. The test holds the run's row while the step returns: its finish no
    longer waits (the transition is recorded as due), and the email job starts
    while the row is still held. Once it is free, the service applies the
    transition and the run completes.
    """
    config = attrs.evolve(FAST, cleanup_timeout=TEST_DEADLINE * 2,
                          queues={"workflows": 1, "email": 1})
    async with open_database(DatabaseConfig(dsn=dsn, engine_connections=1)) as db:
        queue = Queue(db, config=config, secrets=MASTER_KEY)
        wf = Workflow("gated")
        started, release, emailed = trio.Event(), trio.Event(), trio.Event()

        @wf.step()
        async def first(ctx: StepContext) -> str:
            started.set()
            await release.wait()
            return "one"

        @wf.step(after=[first])
        async def second(ctx: StepContext) -> str:
            return ctx.results["first"] + " two"

        executors = Executors()
        executors.register_workflow(wf)

        @executors.register(Email)
        async def send(ctx: PlainJobContext[Email]) -> None:
            emailed.set()

        run_id = await queue.start(wf, None)
        async with _worker(queue, executors) as worker:
            await started.wait()
            async with db.transaction() as holder:
                await holder.execute("SELECT 1 FROM nasiko_queue_workflow_runs WHERE id = $1 "
                                     "FOR UPDATE", run_id)
                release.set()
                await worker.wait_for(lambda s: s.done >= 1)  # first's finish recorded
                await queue.enqueue(Email())
                await emailed.wait()
                # The email ran while the run's row is held: first's end is
                # committed, its transition due, nothing of it applied.
                assert await _count(
                    db, "SELECT count(*) FROM nasiko_queue_workflow_due WHERE run_id = $1",
                    run_id) == 1
                assert await _count(
                    db, "SELECT count(*) FROM nasiko_queue_jobs WHERE workflow_run = $1 "
                        "AND state = 'completed'", run_id) == 1
                assert await _count(
                    db, "SELECT count(*) FROM nasiko_queue_jobs WHERE workflow_run = $1",
                    run_id) == 1
            assert await queue.run_result(run_id, timeout=TEST_DEADLINE) == "one two"
        assert await db.fetch(Q.workflow_stuck_runs) == []


async def test_a_fan_out_cut_between_or_inside_pieces_resumes_where_it_was(
    db: Database,
) -> None:
    """
    A fan-out's progress is its cursor, committed with each piece: a worker
    that crashed or was fenced after a piece leaves the rest due, and another
    worker's service goes on from there; a piece cut mid-way (its transaction
    never commits) is rolled back whole and taken again. Every item is
    enqueued once, and the join, once every item completed, happens once.
    """
    items = 2_500
    queue = Queue(db, config=FAST, secrets=MASTER_KEY)
    wf = _plan_workflow("resumed", items)
    run_id = await queue.start(wf, None)
    plan = await db.fetchval("SELECT id FROM nasiko_queue_jobs WHERE workflow_run = $1", run_id)
    await db.execute("UPDATE nasiko_queue_jobs SET state = 'running' WHERE id = $1", plan)
    await db.execute("UPDATE nasiko_queue_jobs SET state = 'completed', "
                     "result = (SELECT jsonb_agg(g) FROM generate_series(0, $2 - 1) g) "
                     "WHERE id = $1", plan, items)
    assert (await _head(db, run_id))["enqueued_to"] == 100
    # One piece by a first worker's service, which then dies.
    assert await TransitionService(db, TransitionConfig(piece=1000)).run_once() == 1
    assert (await _head(db, run_id))["enqueued_to"] == 1100
    # A second worker's piece, cut before it committed.
    seen: list[int] = []

    async def cut_piece() -> None:
        async with db.transaction() as tx:
            seen.append(await tx.fetchval(Q.workflow_apply_due, 1000))
            seen.append(await tx.fetchval(
                "SELECT enqueued_to FROM nasiko_queue_workflow_steps WHERE run_id = $1 "
                "AND step = 'work' AND idx = -1", run_id))
            raise _Rollback

    with pytest.raises(_Rollback):
        await cut_piece()
    assert seen == [1, 2100]
    assert (await _head(db, run_id))["enqueued_to"] == 1100
    assert await _item_jobs(db, run_id) == 1100
    # A third worker's service (another database connection) goes on.
    async with open_database(db.config) as other:
        assert await TransitionService(other, TransitionConfig(piece=1000)).drain() == 2
    assert await _item_jobs(db, run_id) == items
    assert await _count(db, "SELECT count(DISTINCT payload ->> 'idx') FROM nasiko_queue_jobs "
                            "WHERE workflow_run = $1 AND payload ->> 'step' = 'work'",
                        run_id) == items
    # Every item completes in one statement: the join is larger than a finish
    # takes on, so it is due, and the service makes it once.
    await db.execute("UPDATE nasiko_queue_jobs SET state = 'running' WHERE workflow_run = $1 "
                     "AND payload ->> 'step' = 'work'", run_id)
    await db.execute("UPDATE nasiko_queue_jobs SET state = 'completed', "
                     "result = to_jsonb((payload ->> 'idx')::int * 2) "
                     "WHERE workflow_run = $1 AND payload ->> 'step' = 'work'", run_id)
    head = await _head(db, run_id)
    assert (head["state"], head["done_items"]) == ("enqueued", items)
    assert await TransitionService(db, TransitionConfig(piece=1000)).drain() >= 1
    view = await queue.run(run_id)
    assert view is not None
    assert view.step("work").state == "completed"
    assert view.step("work").result == [2 * k for k in range(items)]
    assert await _count(db, "SELECT count(*) FROM nasiko_queue_jobs WHERE workflow_run = $1 "
                            "AND payload ->> 'step' = 'join'", run_id) == 1


async def test_a_signal_timeout_timer_wakes_the_queue_as_an_enqueue_does(
    db: Database,
) -> None:
    """
    Bug 6, second half: the timer job a signal step's wait inserts sent no
    NOTIFY, so no lane learned of its due time before its next poll (a 2 s
    timeout fired at 3-4 s, at 18-19 s with a 20 s poll). It notifies the
    queue's channel now, as every enqueue does.
    """
    queue = Queue(db, config=FAST, secrets=MASTER_KEY)
    wf = Workflow("waits")
    wf.signal("go", timeout=2.0)
    heard = trio.Event()
    channel = FAST.notify_channel
    assert channel is not None
    async with db.listen(channel, lambda _payload: heard.set()):
        await queue.start(wf, None)
        with trio.fail_after(TEST_DEADLINE):
            await heard.wait()
    assert await _count(db, "SELECT count(*) FROM nasiko_queue_jobs "
                            "WHERE kind = 'nasiko_queue.signal_timeout'") == 1


async def test_a_mapped_step_whose_items_all_completed_joins_with_their_results(
    db: Database,
) -> None:
    """
    The suspicion of issue #45: a mapped step (re)started with every item
    completed already called `wf_complete(run, step, 0, <its head's result>)`,
    writing the head's stale result over item 0's and joining that. The state
    is forced in SQL here (a run failed with its mapped step's head not
    completed but every item completed; 0033's deferred join reaches it when a
    run is cancelled between its last item's end and the join). Its retry
    joins the items' own results, and item 0 keeps its own.
    """
    queue = Queue(db, config=FAST, secrets=MASTER_KEY)
    wf = _plan_workflow("rejoined", 2)
    run_id = await queue.start(wf, None)
    await db.execute("UPDATE nasiko_queue_workflow_runs SET state = 'failed', "
                     "failed_step = 'work', error = 'forced' WHERE id = $1", run_id)
    await db.execute("UPDATE nasiko_queue_workflow_steps SET state = 'completed', "
                     "result = '[0, 1]' WHERE run_id = $1 AND step = 'plan'", run_id)
    await db.execute("UPDATE nasiko_queue_workflow_steps SET state = 'failed', "
                     "result = '\"stale\"' WHERE run_id = $1 AND step = 'work'", run_id)
    await db.execute("INSERT INTO nasiko_queue_workflow_steps (run_id, step, idx, state, result) "
                     "VALUES ($1, 'work', 0, 'completed', '10'), "
                     "($1, 'work', 1, 'completed', '11')", run_id)
    await db.execute("UPDATE nasiko_queue_workflow_steps SET state = 'cancelled' "
                     "WHERE run_id = $1 AND step = 'join'", run_id)
    await db.execute("UPDATE nasiko_queue_jobs SET state = 'completed' WHERE workflow_run = $1",
                     run_id)
    assert await db.fetchval(Q.workflow_retry, run_id) == "retried"
    view = await queue.run(run_id)
    assert view is not None
    assert [(s.index, s.state, s.result) for s in view.steps if s.step == "work"] == [
        (-1, "completed", [10, 11]), (0, "completed", 10), (1, "completed", 11)]
    assert view.step("join").state == "enqueued"


async def test_a_runs_failure_stops_a_large_fan_out_a_piece_at_a_time(db: Database) -> None:
    """
    A step out of attempts fails its run, and the run's end stops every step it
    has not finished. That stop ran whole inside the failing step's finish: for
    a 100,000-item fan-out, a statement cut by `cleanup_timeout` on every try,
    as the fan-out itself was before 0033 (review of issue #45). The end marks
    the run failed and stops a piece at once (100 steps, in the finish); the
    transition service stops the rest a piece per transaction (migration 0037).
    Nothing runs meanwhile, and at the end every item's job is cancelled.
    """
    items = 2_500
    queue = Queue(db, config=FAST, secrets=MASTER_KEY)
    wf = _plan_workflow("failing", items)
    run_id = await queue.start(wf, None)
    plan = await db.fetchval("SELECT id FROM nasiko_queue_jobs WHERE workflow_run = $1", run_id)
    await db.execute("UPDATE nasiko_queue_jobs SET state = 'running' WHERE id = $1", plan)
    await db.execute("UPDATE nasiko_queue_jobs SET state = 'completed', "
                     "result = (SELECT jsonb_agg(g) FROM generate_series(0, $2 - 1) g) "
                     "WHERE id = $1", plan, items)
    service = TransitionService(db, TransitionConfig(piece=1000))
    assert await service.drain() == 3  # every item enqueued
    assert await _item_jobs(db, run_id) == items
    live = ("SELECT count(*) FROM nasiko_queue_workflow_steps WHERE run_id = $1 "
            "AND step = 'work' AND idx >= 0 AND state = 'enqueued'")
    # Item 7 runs out of attempts: its discard, one statement, fails the run.
    item7 = await db.fetchval("SELECT id FROM nasiko_queue_jobs WHERE workflow_run = $1 "
                              "AND payload ->> 'step' = 'work' AND payload ->> 'idx' = '7'",
                              run_id)
    await db.execute("UPDATE nasiko_queue_jobs SET state = 'running' WHERE id = $1", item7)
    await db.execute("UPDATE nasiko_queue_jobs SET state = 'discarded', error_msg = 'boom' "
                     "WHERE id = $1", item7)
    assert await db.fetchval("SELECT state FROM nasiko_queue_workflow_runs WHERE id = $1",
                             run_id) == "failed"
    # That statement stopped a piece (the head and 99 items, at most 100 rows).
    assert items - 1 - await _count(db, live, run_id) <= 100
    assert await _count(db, "SELECT count(*) FROM nasiko_queue_workflow_due "
                            "WHERE run_id = $1", run_id) == 1
    # The service stops the rest, a piece per transaction.
    assert await service.drain() == 3
    assert await _count(db, live, run_id) == 0
    assert await _count(db, "SELECT count(*) FROM nasiko_queue_workflow_due "
                            "WHERE run_id = $1", run_id) == 0
    states = {r["state"]: r["n"] for r in await db.fetch(
        "SELECT state, count(*) AS n FROM nasiko_queue_jobs WHERE workflow_run = $1 "
        "AND payload ->> 'step' = 'work' GROUP BY state", run_id)}
    assert states == {"discarded": 1, "cancelled": items - 1}
