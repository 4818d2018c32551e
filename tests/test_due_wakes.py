"""
Issue #45, bugs 6 and 7: every due time a lane learns of wakes it then, and no
wake is lost between a drain's last claim and its sleep.

Every worker here polls once a minute (`MINUTE`), and each test waits for the
job's start with a bound far below that (`SOON`): a job that waited for the poll
fails the test instead of passing late. Nothing sleeps: the tests wait on the
executors' events, and hold the engine at the instant they need by gating the
real store's statements (the database is the real one throughout).

* Bug 6: a retry written with a backoff starts when the backoff ends: the
  worker that wrote it re-arms its lane's timer (no drain follows that write to
  read the next due time), and the NOTIFY naming its queue makes the other
  workers read when it falls due. A job scheduled by another connection's SQL,
  and a workflow's delayed step, likewise.
* Bug 7: a wake that comes after a claim started causes another claim: one that
  lands while the drain's empty claim is in flight, while the lane reads its next
  due time after the drain, or before a finish statement whose claim never ran
  (its first try failed: the tries after it claim nothing) ended the drain.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, ClassVar
from uuid import UUID, uuid4

import asyncpg
import attrs
import trio

from nasiko_queue import Executors, JobArgs, JobOptions, PlainJobContext, Queue, Worker
from nasiko_queue.db.database import Database
from nasiko_queue.engine.lane import Lane

from .conftest import FAST

#: A minute's poll: a job that waited for it fails the test. Two slots: a
#: drain ends (a claim comes back short) while a job runs.
MINUTE = attrs.evolve(FAST, poll_interval=60.0, queues={"due": 2}, prefetch=0)

#: How long a test waits for a start: far below the poll, far above a wake.
SOON = 15.0


@attrs.frozen(kw_only=True)
class Flaky(JobArgs):
    """Fails its first attempt (after `Runs.crash` is set), then succeeds."""

    kind: ClassVar[str] = "due_flaky"
    options: ClassVar[JobOptions] = JobOptions(queue="due")
    n: int = 0


@attrs.frozen(kw_only=True)
class Probe(JobArgs):
    kind: ClassVar[str] = "due_probe"
    options: ClassVar[JobOptions] = JobOptions(queue="due")
    n: int = 0


class Runs:
    """What the executors did: an event per (kind, attempt) started."""

    def __init__(self) -> None:
        self.started: dict[tuple[str, int], trio.Event] = {}
        #: Attempt 1 of `Flaky` holds its slot until this is set, then raises.
        self.crash = trio.Event()
        #: `Probe` holds its slot until this is set.
        self.release = trio.Event()
        self.release.set()
        #: Called once attempt 1 of `Flaky` has started (None: nothing).
        self.on_first: Callable[[], None] | None = None

    def event(self, kind: str, attempt: int) -> trio.Event:
        return self.started.setdefault((kind, attempt), trio.Event())

    async def flaky(self, ctx: PlainJobContext[Flaky]) -> None:
        self.event(Flaky.kind, ctx.attempt).set()
        if ctx.attempt == 1:
            if self.on_first is not None:
                self.on_first()
            await self.crash.wait()
            raise RuntimeError("the first attempt fails")

    async def probe(self, ctx: PlainJobContext[Probe]) -> None:
        self.event(Probe.kind, ctx.attempt).set()
        await self.release.wait()

    def executors(self, backoff: float = 0.2) -> Executors:
        executors = Executors()
        executors.register(Flaky, self.flaky, backoff=lambda _attempt: backoff)
        executors.register(Probe, self.probe)
        return executors


async def started(event: trio.Event) -> None:
    """Wait for a start, bounded far below the poll."""
    with trio.fail_after(SOON):
        await event.wait()


async def asleep(worker: Worker, lane: Lane) -> None:
    """Until `lane`'s drain loop waits for a wake, the poll or its next due job
    (it sets `waiting` with no checkpoint after the drain count moves)."""
    with trio.fail_after(SOON):
        while not lane.state.waiting:
            await worker.state.changed.park()


async def run_worker(worker: Worker, body: Callable[[], Awaitable[None]]) -> None:
    with trio.fail_after(4 * SOON):
        async with trio.open_nursery() as nursery:
            await nursery.start(worker.run)
            try:
                await body()
            finally:
                worker.stop()


# -- bug 6: due times ---------------------------------------------------------------


async def test_a_retry_starts_when_its_backoff_ends_not_at_the_poll(db: Database) -> None:
    """The first attempt fails once the lane sleeps (its drain over, the next due
    time read: none); the retry, 0.2 s later, must wake it. No LISTEN: the
    worker that wrote the retry re-arms its lane itself."""
    runs = Runs()
    worker = Worker(Queue(db, config=attrs.evolve(MINUTE, listen=False)),
                    runs.executors(backoff=0.2))
    [lane] = worker.lanes

    async def body() -> None:
        await worker.queue.enqueue(Flaky())
        await runs.event(Flaky.kind, 1).wait()
        await asleep(worker, lane)
        runs.crash.set()
        await started(runs.event(Flaky.kind, 2))

    await run_worker(worker, body)


async def test_another_workers_retry_wakes_this_one_when_it_falls_due(db: Database) -> None:
    """Worker `a` runs the first attempt and stops (gracefully: the failure is
    written as a retry, then it claims nothing more); worker `b`, asleep until
    its poll, must run the second attempt when the backoff ends: the retry's
    NOTIFY names the queue, and `b` reads when the job falls due."""
    runs = Runs()
    a = Worker(Queue(db, config=MINUTE), runs.executors(backoff=0.5))
    b = Worker(Queue(db, config=MINUTE), runs.executors(backoff=0.5))
    [lane_b] = b.lanes
    runs.on_first = a.stop  # `a` takes nothing after this attempt

    async def body() -> None:
        await asleep(b, lane_b)
        # Enqueued by a Queue no worker here hears in-process: `a` takes it, by
        # the NOTIFY; `b` is kept from it by the test (not woken).
        async with trio.open_nursery() as nursery:
            await nursery.start(a.run)
            await a.drain_once()
            b_before = lane_b.state.drains_started
            await Queue(db, config=attrs.evolve(MINUTE, notify_channel=None)).enqueue(
                Flaky())
            a.wake()
            await runs.event(Flaky.kind, 1).wait()
            assert lane_b.state.drains_started == b_before  # `b` never heard of it
            runs.crash.set()
        # `a` has stopped, its retry written.
        await started(runs.event(Flaky.kind, 2))

    await run_worker(b, body)


async def test_a_job_scheduled_by_sql_on_another_connection_starts_when_due(
    db: Database,
) -> None:
    """`nasiko_queue_enqueue(..., delay => 0.5)` from a connection of the
    application's: its NOTIFY makes the lane read when the job falls due."""
    runs = Runs()
    worker = Worker(Queue(db, config=MINUTE), runs.executors())
    [lane] = worker.lanes

    async def body() -> None:
        await asleep(worker, lane)
        # Plain SQL on a pooled connection: no in-process wake, only its NOTIFY.
        await db.fetchval("SELECT nasiko_queue_enqueue('due_probe', '{}', 'due', "
                          "delay => 0.5)")
        await started(runs.event(Probe.kind, 1))

    await run_worker(worker, body)


# -- bug 7: no wake lost at a drain's end ------------------------------------------------


def gate(worker: Worker, name: str, *, fail_first_finish: bool = False) -> Any:
    """
    Wrap a method of the lane's real store (shared by its producer, completer
    and slots): while armed, a call runs on the server as usual, then its
    answer waits for `release` (`in_flight` is set meanwhile); with
    `fail_first_finish`, the armed call raises a deadlock before it is sent
    (what PostgreSQL answers two statements that locked rows in opposite
    orders), and the statement's retry runs as the engine sends it.
    """
    [lane] = worker.lanes
    store = lane.store
    original = getattr(store, name)

    @attrs.define
    class Gate:
        armed: bool = False
        in_flight: trio.Event = attrs.Factory(trio.Event)
        release: trio.Event = attrs.Factory(trio.Event)

    the_gate = Gate()

    async def gated(*args: Any, **kwargs: Any) -> Any:
        if not the_gate.armed or (name == "finish_many_and_claim" and not args[1]):
            return await original(*args, **kwargs)
        the_gate.armed = False
        if fail_first_finish:
            the_gate.in_flight.set()
            raise asyncpg.exceptions.DeadlockDetectedError("deadlock detected (injected)")
        answer = await original(*args, **kwargs)
        the_gate.in_flight.set()
        await the_gate.release.wait()
        return answer

    setattr(store, name, gated)
    return the_gate


async def _enqueue_heard(worker: Worker, db: Database) -> UUID:
    """Enqueue a probe from a Queue this process does not wake in-process, and
    wait until the worker has heard its NOTIFY."""
    heard = worker.stats.notifications
    job_id = await Queue(db, config=MINUTE).enqueue(Probe())
    # Another Queue object: its in-process wake reaches no worker here.
    with trio.fail_after(SOON):
        await worker.wait_for(lambda s: s.notifications > heard)
    return job_id


async def test_a_wake_while_the_drains_empty_claim_is_answered_starts_the_job(
    db: Database,
) -> None:
    """The drain's claim finds nothing and commits; before its answer arrives, a
    job is enqueued and its NOTIFY heard. The empty answer must not end the
    drain without another claim."""
    runs = Runs()
    worker = Worker(Queue(db, config=MINUTE), runs.executors())
    [lane] = worker.lanes

    async def body() -> None:
        await asleep(worker, lane)
        claim = gate(worker, "claim")
        claim.armed = True
        worker.wake()
        with trio.fail_after(SOON):
            await claim.in_flight.wait()
        await _enqueue_heard(worker, db)
        claim.release.set()
        await started(runs.event(Probe.kind, 1))

    await run_worker(worker, body)


async def test_a_wake_while_the_lane_reads_its_next_due_time_starts_the_job(
    db: Database,
) -> None:
    """The drain is over (its claim came back empty) and the lane reads when its
    next job is due; a job enqueued and heard then must start at once, not
    after the sleep that read was for."""
    runs = Runs()
    worker = Worker(Queue(db, config=MINUTE), runs.executors())
    [lane] = worker.lanes

    async def body() -> None:
        await asleep(worker, lane)
        due = gate(worker, "next_due")
        due.armed = True
        worker.wake()
        with trio.fail_after(SOON):
            await due.in_flight.wait()
        await _enqueue_heard(worker, db)
        due.release.set()
        await started(runs.event(Probe.kind, 1))

    await run_worker(worker, body)


async def test_a_finish_whose_claim_never_ran_does_not_end_the_drain(db: Database) -> None:
    """
    One slot, busy: a probe is enqueued and heard, beginning a drain that
    cannot claim until the slot frees. The slot's finish carries that claim;
    its first try fails (a deadlock), and the retry records the finish alone,
    claiming nothing. That empty answer is no short claim: the drain must claim
    the probe, not end and leave it to the poll.
    """
    runs = Runs()
    runs.release = trio.Event()  # the first probe holds the slot
    worker = Worker(Queue(db, config=attrs.evolve(MINUTE, queues={"due": 1})),
                    runs.executors())
    [lane] = worker.lanes

    async def body() -> None:
        await worker.queue.enqueue(Probe())
        await runs.event(Probe.kind, 1).wait()
        finish = gate(worker, "finish_many_and_claim", fail_first_finish=True)
        finish.armed = True
        second = trio.Event()
        runs.started[(Probe.kind, 1)] = second  # the next probe's start
        await _enqueue_heard(worker, db)
        assert lane.state.draining  # begun by the NOTIFY, waiting for room
        runs.release.set()
        with trio.fail_after(SOON):
            await finish.in_flight.wait()
        await started(second)

    await run_worker(worker, body)


async def test_a_result_wait_that_hid_a_due_job_from_the_claim_wakes_its_queue(
    db: Database,
) -> None:
    """
    The wait for a job's result reads its row FOR SHARE (`result_wait_and_read`,
    as `Queue.result` and `aio.result` send it), and a claim's SKIP LOCKED
    passes such a row by: a caller that waits for the job it just enqueued
    meets the claim its NOTIFY woke, the claim comes back short, and the drain
    ends. Here the read is held open in a transaction of the test's over the
    whole drain; once it commits, the job must start (the read's NOTIFY), not
    at the poll.
    """
    from nasiko_queue.db.statements import Q

    runs = Runs()
    worker = Worker(Queue(db, config=MINUTE), runs.executors())
    [lane] = worker.lanes

    async def body() -> None:
        await asleep(worker, lane)
        # No NOTIFY and no in-process wake: the test wakes the worker itself,
        # once the read holds the row.
        job_id = await Queue(db, config=attrs.evolve(MINUTE, notify_channel=None)).enqueue(
            Probe())
        async with db.transaction() as tx:
            row = await tx.fetchrow(Q.result_wait_and_read, job_id, uuid4(),
                                    MINUTE.notify_channel)
            assert row is not None
            assert row["state"] == "available"
            drains = lane.state.drains_completed
            worker.wake()  # as the enqueue's NOTIFY would
            with trio.fail_after(SOON):
                while lane.state.drains_completed == drains or not lane.state.waiting:
                    await worker.state.changed.park()
            assert not runs.event(Probe.kind, 1).is_set()  # the claim passed it by
        await started(runs.event(Probe.kind, 1))

    await run_worker(worker, body)


# -- workflows: their steps are plain jobs, in the same lanes ------------------------

#: As `MINUTE`, for the queue of workflow steps ("workflows").
STEPS = attrs.evolve(FAST, poll_interval=60.0, concurrency=2, prefetch=0)


async def test_a_delayed_step_starts_when_its_delay_ends(db: Database) -> None:
    """The transition that enqueues a delayed step NOTIFYs: the lane reads when
    the step falls due and sleeps until then, not until its poll."""
    from nasiko_queue import StepContext, Workflow

    wf = Workflow("due_delayed")
    later = trio.Event()

    @wf.step()
    async def first(ctx: StepContext) -> int:
        return 1

    @wf.step(after=[first], delay=0.5)
    async def second(ctx: StepContext) -> int:
        later.set()
        return 2

    executors = Executors()
    executors.register_workflow(wf)
    queue = Queue(db, config=STEPS)
    worker = Worker(queue, executors)

    async def body() -> None:
        await queue.start(wf)
        await started(later)

    await run_worker(worker, body)


async def test_a_steps_retry_starts_when_its_backoff_ends(db: Database) -> None:
    """A step's first attempt fails once its lane sleeps; its retry, after a
    backoff of 0.2 s, must wake the lane (as a plain job's)."""
    from nasiko_queue import StepContext, Workflow

    wf = Workflow("due_retried")
    first_try, fail, second_try = trio.Event(), trio.Event(), trio.Event()

    @wf.step(backoff=lambda _attempt: 0.2)
    async def flaky(ctx: StepContext) -> int:
        if ctx.job.attempt == 1:
            first_try.set()
            await fail.wait()
            raise RuntimeError("the first attempt fails")
        second_try.set()
        return 1

    executors = Executors()
    executors.register_workflow(wf)
    queue = Queue(db, config=attrs.evolve(STEPS, listen=False))
    worker = Worker(queue, executors)

    async def body() -> None:
        await queue.start(wf)
        await started(first_try)
        [lane] = [lane for lane in worker.lanes if lane.name == wf.queue]
        await asleep(worker, lane)
        fail.set()
        await started(second_try)

    await run_worker(worker, body)


async def test_a_transition_notify_wakes_no_lane_of_a_worker_without_workflows(
    db: Database,
) -> None:
    """A due workflow transition's NOTIFY is for the workers that run workflows
    (their transition service). A worker without any used to wake every lane on
    it: a drain of each queue, for nothing, on every transition of the fleet.
    Sent before a NOTIFY naming queue `due`, in one transaction (delivered in
    order, each wake synchronous), so that once `due` drains, a wake of `other`
    by the first would already show."""
    worker = Worker(Queue(db, config=attrs.evolve(MINUTE, queues={"due": 1, "other": 1})),
                    Runs().executors())
    assert worker.transitions is None
    lanes = {lane.name: lane for lane in worker.lanes}

    async def body() -> None:
        for lane in lanes.values():
            await asleep(worker, lane)
        before = {name: lane.state.drains_started for name, lane in lanes.items()}
        async with db.transaction() as tx:
            for payload in ("nasiko_queue.transition", "queue:due"):
                await tx.execute("SELECT pg_notify($1, $2)", MINUTE.notify_channel, payload)
        with trio.fail_after(SOON):
            while lanes["due"].state.drains_started == before["due"]:
                await worker.state.changed.park()
        assert lanes["other"].state.drains_started == before["other"]

    await run_worker(worker, body)
