"""
Lanes are independent, and the fence covers every claim (issue #20).

A worker runs one lane for build jobs and one per queue of plain jobs. Each has
its own drain loop: a lane whose slots are all busy never holds up another's
claim, wake or poll. The fence is worker-wide: a claim answered after it, and a
job that waited in a buffer, never start on the fenced worker.

The "busy" executors below wait on an event the test sets only at the end, so a
lane that waited for another would wait for ever: each test fails at its
deadline, never on timing luck.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any, ClassVar
from uuid import UUID

import attrs
import pytest
import trio
import trio.testing

from nasiko_queue import (
    Executors,
    Job,
    JobArgs,
    JobContext,
    JobOptions,
    PlainJobContext,
    Queue,
    QueueConfig,
    Worker,
)
from nasiko_queue.builds.payloads import BUILTIN_PAYLOAD_TYPES
from nasiko_queue.builds.store import PgJobStore
from nasiko_queue.db.database import Database
from nasiko_queue.engine.contracts import ClaimedJob
from nasiko_queue.engine.state import LaneState
from nasiko_queue.testing import KINDS, enqueue_with_target, set_build_status

from .conftest import FAST, MASTER_KEY
from .helpers import TEST_DEADLINE, executors_for_all, job_row


@attrs.frozen(kw_only=True)
class Slow(JobArgs):
    kind: ClassVar[str] = "lanes_slow"
    options: ClassVar[JobOptions] = JobOptions(queue="slow")
    n: int = 0


@attrs.frozen(kw_only=True)
class Fast(JobArgs):
    kind: ClassVar[str] = "lanes_fast"
    options: ClassVar[JobOptions] = JobOptions(queue="fast")
    n: int = 0


#: An hour's poll: only a wake (or, where a test says so, its own poll) claims.
QUIET = attrs.evolve(FAST, poll_interval=3600.0)


async def plain_state(db: Database, job_id: UUID) -> tuple[str, int]:
    row = await db.fetchrow("SELECT state, attempt FROM nasiko_queue_jobs WHERE id = $1",
                            job_id)
    assert row is not None
    return row["state"], row["attempt"]


class Busy:
    """Executors that hold their slot until `release` (set at the end of a test)."""

    def __init__(self) -> None:
        self.started = trio.Event()
        self.release = trio.Event()
        self.ran: list[str] = []

    async def hold(self, ctx: PlainJobContext[Any]) -> None:
        self.ran.append(ctx.payload.kind)
        self.started.set()
        await self.release.wait()

    async def quick(self, ctx: PlainJobContext[Any]) -> None:
        self.ran.append(ctx.payload.kind)


async def _run_until(worker: Worker, busy: Busy, body: Any) -> None:
    with trio.fail_after(TEST_DEADLINE):
        async with trio.open_nursery() as nursery:
            await nursery.start(worker.run)
            try:
                await body()
            finally:
                busy.release.set()
                worker.stop()


@pytest.mark.parametrize("how", ["in-process wake", "notify", "poll"])
async def test_a_busy_queue_never_delays_another_queues_job(db: Database, how: str) -> None:
    """Queues slow=1 and fast=1: while the slow job holds its slot, a fast job
    enqueued afterwards runs, woken in-process, by NOTIFY, or by the fast lane's
    own poll (the slow lane's drain never ends while its slot is busy)."""
    config = attrs.evolve(QUIET, queues={"slow": 1, "fast": 1})
    if how == "poll":
        config = attrs.evolve(config, listen=False, poll_interval=0.2)
    queue = Queue(db, config=config)
    # Another Queue object on the same database wakes no worker in this process:
    # only the NOTIFY (or the poll) can.
    other = Queue(db, config=config if how == "notify"
                  else attrs.evolve(config, notify_channel=None))
    busy = Busy()
    executors = Executors()
    executors.register(Slow, busy.hold)
    executors.register(Fast, busy.quick)
    worker = Worker(queue, executors)

    async def body() -> None:
        await queue.enqueue(Slow())
        await busy.started.wait()
        await (queue if how == "in-process wake" else other).enqueue(Fast())
        await worker.wait_for(lambda s: s.done >= 1)
        assert busy.ran == ["lanes_slow", "lanes_fast"]
        assert not busy.release.is_set()  # the slow job still runs

    await _run_until(worker, busy, body)


async def test_a_busy_build_lane_never_delays_a_plain_job_nor_the_reverse(
    db: Database,
) -> None:
    """A build that runs for "30 minutes" (until released) holds the build lane's
    one slot: a plain job runs meanwhile; and a plain job holding its queue's slot
    does not delay the next build job."""
    config = attrs.evolve(QUIET, queues={"slow": 1, "fast": 1})
    queue = Queue(db, config=config, secrets=MASTER_KEY)
    busy = Busy()
    types = {t.kind: t for t in BUILTIN_PAYLOAD_TYPES}
    first_build = trio.Event()
    build_runs: list[str] = []

    async def build(ctx: JobContext[Any]) -> None:
        build_runs.append(ctx.payload.label())
        if len(build_runs) == 1:
            first_build.set()
            await busy.release.wait()
        await set_build_status(ctx.db, ctx.payload, "success")

    executors = Executors()
    for kind in KINDS:
        executors.register(types[kind], build)
    executors.register(Slow, busy.hold)
    executors.register(Fast, busy.quick)
    worker = Worker(queue, executors)

    async def body() -> None:
        await enqueue_with_target(queue, "Upload")  # holds the build lane
        await first_build.wait()
        await queue.enqueue(Fast())
        await worker.wait_for(lambda s: s.done >= 1)
        await queue.enqueue(Slow())  # now a plain lane is busy too
        await busy.started.wait()
        second = await enqueue_with_target(queue, "Upload")
        # The build lane's slot is still taken by the first build: the second
        # waits for it (concurrency 1), but the plain lanes never did.
        assert len(build_runs) == 1
        assert (await job_row(db, second.job_id) or {})["status"] == "pending"

    await _run_until(worker, busy, body)
    assert busy.ran[:2] == ["lanes_fast", "lanes_slow"]


async def test_a_busy_plain_queue_never_delays_a_build_job(db: Database) -> None:
    config = attrs.evolve(QUIET, queues={"slow": 1})
    queue = Queue(db, config=config, secrets=MASTER_KEY)
    busy = Busy()
    built = trio.Event()

    async def build(ctx: JobContext[Any]) -> None:
        await set_build_status(ctx.db, ctx.payload, "success")
        built.set()

    executors = executors_for_all(build)
    executors.register(Slow, busy.hold)
    worker = Worker(queue, executors)

    async def body() -> None:
        await queue.enqueue(Slow())
        await busy.started.wait()
        await enqueue_with_target(queue, "Upload")
        await built.wait()

    await _run_until(worker, busy, body)


async def test_drain_once_waits_for_every_lane_without_one_holding_another(
    db: Database,
) -> None:
    """`drain_once` is a per-lane promise: each lane's drain after the call ends.
    A lane still busy ends its drain when its claim comes back short; the slow
    executor's slot is full, so the slow lane's drain ends only with the job."""
    config = attrs.evolve(QUIET, queues={"slow": 1, "fast": 2})
    queue = Queue(db, config=config)
    busy = Busy()
    executors = Executors()
    executors.register(Slow, busy.hold)
    executors.register(Fast, busy.quick)
    worker = Worker(queue, executors)

    async def body() -> None:
        for n in range(3):
            await queue.enqueue(Fast(n=n))
        await worker.drain_once()
        assert busy.ran == ["lanes_fast"] * 3
        await queue.enqueue(Slow())
        await busy.started.wait()
        fast_lane = next(lane for lane in worker.lanes if lane.name == "fast")
        slow_lane = next(lane for lane in worker.lanes if lane.name == "slow")
        assert slow_lane.state.draining  # its one slot is busy: no short claim yet
        polls = fast_lane.state.drains_completed
        worker.wake()
        await worker.wait_for(lambda _s: fast_lane.state.drains_completed > polls)
        busy.release.set()
        await worker.drain_once()
        assert worker.idle()

    await _run_until(worker, busy, body)


# -- the fence --------------------------------------------------------------------


class GatedStore(PgJobStore):
    """The real store, whose next claim that takes a job holds its answer (the
    claim committed on the server) until `release`: a slow network's timing."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.held = trio.Event()
        self.release = trio.Event()

    async def claim(self, limit: int) -> list[ClaimedJob]:
        jobs = await super().claim(limit)
        if jobs and not self.held.is_set():
            self.held.set()
            await self.release.wait()
        return jobs


async def _declare_dead(db: Database, worker: Worker) -> None:
    """What a leader does to a worker paused past its lease; the worker's next
    heartbeat learns it and fences (then registers anew)."""
    # The heartbeat's own first beat, sent at start, must have landed: answered
    # after the row below, it would fence the worker a second time.
    await worker.wait_for(lambda s: s.heartbeats >= 1)
    me = worker.heartbeat.identity
    assert me is not None
    await db.execute("UPDATE nasiko_queue_workers SET dead_at = now() WHERE id = $1", me.id)
    await worker.heartbeat.beat_once()


async def test_a_claim_answered_after_the_fence_never_runs(db: Database) -> None:
    """The claim commits, its answer is held; meanwhile the worker is declared dead,
    fences and registers anew. The late answer's job goes back (attempt restored)
    instead of running on the fenced worker beside the rescue's re-run."""
    # No maintenance here: the rescue would hand the job on too, and this test is
    # about the late answer alone.
    config = attrs.evolve(QUIET, heartbeat_interval=3600.0, lease=3 * 3600.0,
                          queues=(), maintenance=False)
    queue = Queue(db, config=config, secrets=MASTER_KEY)
    kinds = frozenset(KINDS)
    store = GatedStore(db, config, runnable_kinds=kinds, known_kinds=kinds)
    ran: list[int] = []

    async def run(ctx: JobContext[Any]) -> None:
        ran.append(ctx.attempt)
        await set_build_status(ctx.db, ctx.payload, "success")

    worker = Worker(queue, executors_for_all(run), store=store)
    with trio.fail_after(TEST_DEADLINE):
        async with trio.open_nursery() as nursery:
            await nursery.start(worker.run)
            job = await enqueue_with_target(queue, "Upload")
            await store.held.wait()
            await _declare_dead(db, worker)
            assert worker.stats.fenced == 1
            assert worker.stats.registrations == 2
            store.release.set()
            await worker.wait_for(lambda s: s.returned >= 1 or s.done >= 1)
            assert ran == []
            # Registered anew, the worker claims it again and runs it, once, as
            # attempt 1: the late claim's attempt was given back.
            await worker.wait_for(lambda s: s.done >= 1)
            worker.stop()
    assert ran == [1]
    row = await job_row(db, job.job_id)
    assert row is not None
    assert (row["status"], row["attempt"]) == ("done", 1)


async def test_the_fence_stops_plain_jobs_and_counts_them(
    db: Database, caplog: pytest.LogCaptureFixture,
) -> None:
    """The fence is worker-wide: a plain job's executor is stopped with the build
    jobs', and the fence's log line counts it."""
    # No maintenance: the rescue would hand the job on before the fenced run's
    # own reset, and this test is about the fence alone.
    config = attrs.evolve(QUIET, heartbeat_interval=3600.0, lease=3 * 3600.0,
                          queues={"slow": 1}, maintenance=False)
    queue = Queue(db, config=config)
    busy = Busy()
    stopped = trio.Event()

    async def hold(ctx: PlainJobContext[Slow]) -> None:
        try:
            await busy.hold(ctx)
        except trio.Cancelled:
            stopped.set()
            raise

    executors = Executors()
    executors.register(Slow, hold)
    worker = Worker(queue, executors)
    with trio.fail_after(TEST_DEADLINE), caplog.at_level(logging.ERROR, "nasiko_queue"):
        async with trio.open_nursery() as nursery:
            await nursery.start(worker.run)
            job_id = await queue.enqueue(Slow())
            await busy.started.wait()
            await _declare_dead(db, worker)
            await stopped.wait()
            await worker.wait_for(lambda s: s.released >= 1)
            assert await plain_state(db, job_id) in {("available", 1), ("running", 2)}
            # Registered anew, the worker may claim the job again at once: let
            # that run end.
            busy.release.set()
            worker.stop()
    assert "stopping its 1 running job(s)" in caplog.text
    assert await plain_state(db, job_id) in {("available", 1), ("completed", 2)}


async def test_the_fence_gives_back_the_buffered_jobs_at_once(db: Database) -> None:
    """A fenced worker's look-ahead goes back at once, attempts restored, not left
    `running` under the dead identity until the leader's rescue (which then
    counts an attempt the jobs never used). Found by the plain state machine: a
    drain whose hung run was fenced while its buffer held a job never ran it."""
    # No maintenance: with it, the rescue would give the buffered jobs back too.
    config = attrs.evolve(QUIET, heartbeat_interval=3600.0, lease=3 * 3600.0,
                          queues={"slow": 1}, prefetch=2, maintenance=False)
    queue = Queue(db, config=config)
    busy = Busy()
    executors = Executors()
    executors.register(Slow, busy.hold)
    worker = Worker(queue, executors)
    with trio.fail_after(TEST_DEADLINE):
        async with trio.open_nursery() as nursery:
            await nursery.start(worker.run)
            first, *rest = await queue.enqueue_many([Job(Slow(n=n)) for n in range(3)])
            await busy.started.wait()
            await worker.wait_for(lambda s: s.buffered >= 2)
            await _declare_dead(db, worker)
            # The hung run's job goes back by its own reset; the two buffered by the
            # fence's give-back (before this, never: nothing rescues them here).
            await worker.wait_for(lambda s: s.released >= 1 and s.returned >= 2)
            busy.release.set()
            await worker.wait_for(lambda s: s.done >= 3)
            worker.stop()
    assert await plain_state(db, first) == ("completed", 2)
    assert [await plain_state(db, job_id) for job_id in rest] == [("completed", 1)] * 2


#: The `n` of a job that holds its slot until its test releases it.
HOLDS = 9


class SlowToUnwind:
    """
    A lane of `slots` slots with a look-ahead of 2, whose `Slow(n=0)` holds its
    slot on its first run until the fence stops it, and then takes its time to
    unwind (a shielded clean-up): until `unwinding` returns. `Slow(n=HOLDS)`
    holds its slot until `release`; every other run returns at once. `order`
    lists the runs by `n`.
    """

    def __init__(self, db: Database, slots: int,
                 unwinding: Callable[[], Awaitable[object]]) -> None:
        config = attrs.evolve(QUIET, heartbeat_interval=3600.0, lease=3 * 3600.0,
                              queues={"slow": slots}, prefetch=2, maintenance=False)
        self.queue = Queue(db, config=config)
        self.unwinding = unwinding
        self.started, self.unwound = trio.Event(), trio.Event()
        #: `Slow(n=HOLDS)` holds its slot from `holding` until `release`.
        self.holding, self.release = trio.Event(), trio.Event()
        self.order: list[int] = []
        executors = Executors()
        executors.register(Slow, self.run)
        self.worker = Worker(self.queue, executors)

    def lane(self) -> LaneState:
        return next(lane.state for lane in self.worker.lanes if lane.name == "slow")

    async def run(self, ctx: PlainJobContext[Slow]) -> None:
        self.order.append(ctx.payload.n)
        if ctx.payload.n == HOLDS:
            self.holding.set()
            await self.release.wait()
        if ctx.payload.n != 0 or ctx.attempt != 1:
            return
        self.started.set()
        try:
            await trio.sleep_forever()
        except trio.Cancelled:
            with trio.CancelScope(shield=True):
                await self.unwinding()
            self.unwound.set()
            raise


async def test_after_the_fence_a_lane_claims_only_once_its_stopped_runs_are_back(
        db: Database) -> None:
    """
    A fenced run's job is available again at once, and first in line; the worker,
    registered anew, must not fill its look-ahead while that run is still being
    put back (its executor still unwinding), or the later jobs it claims run
    before it. Found by the plain state machine under load (`drain_then_fence`:
    "the drain ran [B, C, D, B]; the model says [B, B, C, D]").
    """
    drains = 0  # the lane's drains begun before the fence

    async def unwinding() -> None:
        # The worker registers anew meanwhile and its lane begins a drain. Unwind
        # only once that drain has done what it does now: a claim sent meanwhile
        # (the bug) lands first.
        await worker.wait_for(lambda s: s.returned >= 2 and lab.lane().drains_started > drains)
        await trio.testing.wait_all_tasks_blocked()
        if lab.lane().in_flight:
            await worker.wait_for(lambda s: s.buffered >= 2)

    lab = SlowToUnwind(db, 1, unwinding)
    worker = lab.worker
    with trio.fail_after(TEST_DEADLINE):
        async with trio.open_nursery() as nursery:
            await nursery.start(worker.run)
            await lab.queue.enqueue_many([Job(Slow(n=n)) for n in range(3)])
            await lab.started.wait()
            await worker.wait_for(lambda s: s.buffered >= 2)
            drains = lab.lane().drains_started
            await _declare_dead(db, worker)  # fenced, and registered anew
            await lab.unwound.wait()
            await worker.wait_for(lambda s: s.done >= 3)
            worker.stop()
    assert lab.order == [0, 0, 1, 2], lab.order


async def test_while_a_fenced_run_unwinds_its_lanes_free_slots_still_run_jobs(
        db: Database) -> None:
    """What waits for a fenced run to end is the look-ahead alone, and only until
    that run ends: a lane's other slots claim and run jobs meanwhile (one executor
    slow to unwind does not stall its lane), and the look-ahead is back as soon as
    the stopped run ends, though the lane's other slot is still busy."""
    unwind = trio.Event()
    lab = SlowToUnwind(db, 2, unwind.wait)
    worker = lab.worker
    with trio.fail_after(TEST_DEADLINE):
        async with trio.open_nursery() as nursery:
            await nursery.start(worker.run)
            await lab.queue.enqueue(Slow(n=0))
            await lab.started.wait()
            await _declare_dead(db, worker)  # fenced, and registered anew
            assert lab.lane().fence_settling == 1
            await lab.queue.enqueue_many([Job(Slow(n=n)) for n in (1, 2)])
            worker.wake()
            await worker.wait_for(lambda s: s.done >= 2)  # run by the other slot
            assert lab.lane().fence_settling == 1
            await lab.queue.enqueue(Slow(n=HOLDS))
            await lab.holding.wait()  # the other slot is busy from here on
            unwind.set()
            await worker.wait_for(lambda s: lab.lane().fence_settling == 0)
            assert lab.lane().running == 1
            lab.release.set()
            await worker.wait_for(lambda s: s.done >= 4)
            worker.stop()
    assert sorted(lab.order) == [0, 0, 1, 2, HOLDS]


async def test_a_prefetched_job_cancelled_before_it_starts_never_runs(db: Database) -> None:
    """A job claimed into the buffer (prefetch) is cancelled: the heartbeat finds
    the request, and the job ends `cancelled` without its executor running."""
    config = attrs.evolve(QUIET, heartbeat_interval=3600.0, lease=3 * 3600.0,
                          queues={"slow": 1}, prefetch=1)
    queue = Queue(db, config=config)
    busy = Busy()
    executors = Executors()
    executors.register(Slow, busy.hold)
    worker = Worker(queue, executors)

    async def body() -> None:
        await queue.enqueue(Slow(n=1))
        await busy.started.wait()
        second = await queue.enqueue(Slow(n=2))
        await worker.wait_for(lambda s: s.buffered >= 1)
        assert await queue.cancel(second) == "cancelling"  # claimed: it is 'running'
        await worker.heartbeat.beat_once()  # the request reaches the worker
        busy.release.set()
        await worker.wait_for(lambda s: s.cancelled >= 1 or s.done >= 2)
        assert busy.ran == ["lanes_slow"]
        assert await plain_state(db, second) == ("cancelled", 1)

    await _run_until(worker, busy, body)


async def test_a_hard_stop_keeps_heartbeating_until_its_executors_end(db: Database) -> None:
    """An executor that shields itself outlives a hard stop's cancellation. The
    worker keeps renewing its lease until it returns, or the rescue would run the
    job again elsewhere while it still runs."""
    config = attrs.evolve(QUIET, heartbeat_interval=0.05, lease=0.6, queues={"slow": 1})
    queue = Queue(db, config=config)
    started, release = trio.Event(), trio.Event()

    async def stubborn(ctx: PlainJobContext[Slow]) -> None:
        started.set()
        with trio.CancelScope(shield=True):
            await release.wait()

    executors = Executors()
    executors.register(Slow, stubborn)
    worker = Worker(queue, executors)
    with trio.fail_after(TEST_DEADLINE):
        async with trio.open_nursery() as nursery:
            run_scope = trio.CancelScope()

            async def run(task_status: trio.TaskStatus[None]) -> None:
                with run_scope:
                    await worker.run(task_status=task_status)

            await nursery.start(run)
            try:
                await queue.enqueue(Slow())
                await started.wait()
                run_scope.cancel()  # the hard stop
                beats = worker.stats.heartbeats
                await worker.wait_for(lambda s: s.heartbeats >= beats + 3)
                me = worker.heartbeat.identity
                assert me is not None
                assert await db.fetchval("SELECT dead_at IS NULL FROM nasiko_queue_workers "
                                         "WHERE id = $1", me.id)
            finally:
                release.set()  # else a failure here would wait on the shielded run for ever
    # The executor returned: the heartbeat ended with it and the row went.
    assert await db.fetchval("SELECT count(*) FROM nasiko_queue_workers") == 0


def test_a_lane_config_is_the_workers_with_its_own_concurrency() -> None:
    """Guard for the lanes' shape: one `LaneState` per lane, sharing one
    `WorkerState` (counters, fence, scopes), never another lane's buffer."""
    from nasiko_queue.engine.state import LaneState, WorkerState

    shared = WorkerState(QueueConfig())
    a = LaneState(attrs.evolve(QueueConfig(), concurrency=2), shared)
    b = LaneState(QueueConfig(), shared)
    assert a.stats is b.stats
    assert a.job_scopes is b.job_scopes
    assert a.buffer is not b.buffer
    assert a.drain_ended is not b.drain_ended
    shared.fenced = True
    assert a.room() == 0
    assert b.room() == 0


async def test_a_cancel_of_a_job_still_running_under_a_retired_identity_is_not_lost(
    db: Database,
) -> None:
    """
    Decided (issue #20): a cancel need not reach a run the fence already stopped.
    The fence cancels every run's scope; one that shields itself runs on under the
    retired identity, and its outcome is never written (its claim is no longer
    current). The cancel is kept on the row, and the leader's rescue of the
    retired identity's jobs ends the job `cancelled`.
    """
    config = attrs.evolve(QUIET, heartbeat_interval=3600.0, lease=3 * 3600.0,
                          queues={"slow": 1}, maintenance=False)
    queue = Queue(db, config=config)
    leader = PgJobStore(db, config, runnable_kinds=frozenset(), known_kinds=frozenset())
    started, release = trio.Event(), trio.Event()

    async def stubborn(ctx: PlainJobContext[Slow]) -> None:
        started.set()
        with trio.CancelScope(shield=True):
            await release.wait()

    executors = Executors()
    executors.register(Slow, stubborn)
    worker = Worker(queue, executors)
    with trio.fail_after(TEST_DEADLINE):
        async with trio.open_nursery() as nursery:
            await nursery.start(worker.run)
            try:
                job_id = await queue.enqueue(Slow())
                await started.wait()
                await _declare_dead(db, worker)  # fenced; registered anew
                assert await queue.cancel(job_id) == "cancelling"
                rescued = await leader.rescue()
                assert rescued.failed == 1  # ended for good: cancelled
                assert await plain_state(db, job_id) == ("cancelled", 1)
            finally:
                release.set()  # the stale run returns: its completion changes nothing
            await worker.drain_once()
            worker.stop()
    assert await plain_state(db, job_id) == ("cancelled", 1)
