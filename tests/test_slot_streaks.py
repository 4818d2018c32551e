"""
A slot runs its jobs back to back in one cancel scope (`Slots._run_streak`),
not one scope per job. What must hold: the scope stops only the job that runs
when the fence, a cancel request or the job's limit cancels it; that job is
settled as before (given back, cancelled, or retried with its error kept); and
the slot's next jobs run in a fresh scope, not stopped by the spent one.

Each test runs one slot with its jobs claimed ahead, so that the jobs after the
stopped one wait in the same slot's buffer.
"""

from __future__ import annotations

from typing import ClassVar

import attrs
import trio

from nasiko_queue import Executors, JobArgs, JobOptions, PlainJobContext, Queue, Worker

from .conftest import FAST
from .helpers import TEST_DEADLINE, running


@attrs.frozen(kw_only=True)
class Item(JobArgs):
    kind: ClassVar[str] = "streak_item"
    options: ClassVar[JobOptions] = JobOptions(queue="streak")
    n: int


def _one_slot(queue: Queue) -> Queue:
    """One slot, four jobs claimed ahead; heartbeats often (they bring cancel
    requests), on a lease long enough not to lapse under load."""
    config = attrs.evolve(FAST, queues={"streak": 1}, builds=False, prefetch=4,
                          heartbeat_interval=0.2, lease=30.0)
    return Queue(queue.db, config=config)


async def _states(queue: Queue) -> dict[int, tuple[str, int, str | None]]:
    rows = await queue.db.fetch("SELECT (payload->>'n')::int AS n, state, attempt, error_msg "
                                "FROM nasiko_queue_jobs")
    return {r["n"]: (r["state"], r["attempt"], r["error_msg"]) for r in rows}


async def test_a_cancelled_run_stops_alone_and_the_slot_runs_the_next_jobs(
    queue: Queue,
) -> None:
    first_started = trio.Event()
    ran: list[int] = []
    executors = Executors()

    @executors.register(Item)
    async def item(ctx: PlainJobContext[Item]) -> None:
        if ctx.payload.n == 0:
            first_started.set()
            await trio.sleep_forever()  # only its cancel ends it
        ran.append(ctx.payload.n)

    q = _one_slot(queue)
    first = await q.enqueue(Item(n=0))
    await q.enqueue_many([Item(n=n) for n in (1, 2, 3)])
    async with running(q, executors) as worker:
        with trio.fail_after(TEST_DEADLINE):
            await first_started.wait()
            assert await q.cancel(first) == "cancelling"
            await worker.wait_for(lambda s: s.cancelled >= 1 and s.done >= 3)
    assert ran == [1, 2, 3]
    assert await _states(q) == {0: ("cancelled", 1, "cancelled"),
                                1: ("completed", 1, None), 2: ("completed", 1, None),
                                3: ("completed", 1, None)}


async def test_a_run_past_its_limit_is_retried_and_the_slot_runs_the_next_jobs(
    queue: Queue,
) -> None:
    ran: list[int] = []
    executors = Executors()

    @executors.register(Item, timeout=0.05, backoff=lambda _attempt: 0.0)
    async def item(ctx: PlainJobContext[Item]) -> None:
        if ctx.payload.n == 0 and ctx.attempt == 1:
            await trio.sleep_forever()  # its limit ends it
        ran.append(ctx.payload.n)

    q = _one_slot(queue)
    await q.enqueue_many([Item(n=n) for n in range(4)])
    async with running(q, executors) as worker:
        with trio.fail_after(TEST_DEADLINE):
            await worker.wait_for(lambda s: s.done >= 4)
    assert worker.stats.timed_out == 1
    assert sorted(ran) == [0, 1, 2, 3]
    states = await _states(q)
    assert states[0][:2] == ("completed", 2)  # its second run, at once (no backoff)
    assert {n: states[n] for n in (1, 2, 3)} == dict.fromkeys((1, 2, 3), ("completed", 1, None))
    errors = await q.db.fetch("SELECT attempt, reason FROM nasiko_queue_job_errors")
    assert [(r["attempt"], r["reason"]) for r in errors] == [(1, "timeout")]


async def test_a_run_that_swallows_its_cancel_and_returns_keeps_its_outcome(
    queue: Queue,
) -> None:
    """The cancel came, but the executor caught it and returned: as with a scope
    of its own, the run returned, so its outcome stands; and the spent scope
    does not stop the slot's next jobs."""
    first_started = trio.Event()
    ran: list[int] = []
    executors = Executors()

    @executors.register(Item)
    async def item(ctx: PlainJobContext[Item]) -> dict[str, bool] | None:
        if ctx.payload.n == 0:
            first_started.set()
            try:
                await trio.sleep_forever()
            except trio.Cancelled:
                return {"swallowed": True}
        ran.append(ctx.payload.n)
        return None

    q = _one_slot(queue)
    first = await q.enqueue(Item(n=0))
    await q.enqueue_many([Item(n=n) for n in (1, 2)])
    async with running(q, executors) as worker:
        with trio.fail_after(TEST_DEADLINE):
            await first_started.wait()
            assert await q.cancel(first) == "cancelling"
            await worker.wait_for(lambda s: s.done >= 3)
    assert ran == [1, 2]
    assert (await _states(q))[0] == ("completed", 1, None)
    assert await q.db.fetchval("SELECT result FROM nasiko_queue_jobs WHERE id = $1",
                               first) == '{"swallowed": true}'


async def test_a_hard_stop_as_a_run_passes_its_limit_gives_the_job_back(queue: Queue) -> None:
    """
    A hard stop, and the run's limit passing during the executor's shielded
    clean-up: both cancel its scope. The stop wins, as it did when each run had
    a scope of its own: the job goes back at once. (Found in review: the spent
    scope was settled as a timeout, whose writes the stop then cut short, and
    the job stayed running until the leader's rescue.)
    """
    started = trio.Event()
    limit = 0.05
    executors = Executors()

    @executors.register(Item, timeout=limit)
    async def item(ctx: PlainJobContext[Item]) -> None:
        started.set()
        try:
            await trio.sleep_forever()
        finally:
            with trio.CancelScope(shield=True):  # a clean-up that outlasts the limit
                await trio.sleep(2 * limit)

    q = _one_slot(queue)
    await q.enqueue(Item(n=0))
    worker = Worker(q, executors)
    with trio.fail_after(TEST_DEADLINE):
        async with trio.open_nursery() as nursery:
            await nursery.start(worker.run)
            await started.wait()
            nursery.cancel_scope.cancel()  # the hard stop
    assert (worker.stats.released, worker.stats.timed_out) == (1, 0)
    assert await _states(q) == {0: ("available", 1, None)}  # its attempt counted
