"""
Prefetch (`QueueConfig.prefetch`): jobs claimed ahead of the free slots wait in
a local buffer. What must hold: every job still runs once, the buffer lets
finishes share statements, and a buffered job that never started goes back to
pending with its attempt restored — at a graceful stop, at a hard stop, and
when it has waited past `prefetch_ttl` (so an idle replica can take it).
"""

from __future__ import annotations

import logging
import uuid
from collections import Counter
from typing import Any, ClassVar

import attrs
import pytest
import trio
import trio.testing

from nasiko_queue import Executors, JobArgs, JobOptions, PlainJobContext, Queue, Worker
from nasiko_queue.builds.store import PgJobStore
from nasiko_queue.db.statements import Q
from nasiko_queue.engine.contracts import WorkerIdentity
from nasiko_queue.errors import ConfigurationError
from nasiko_queue.plain.store import PlainJobStore
from nasiko_queue.testing import KINDS, Enqueued, enqueue_with_target

from .helpers import TEST_DEADLINE, LogEvent, executors_for_all, job_row, running, succeed


class CountingBatches(PgJobStore):
    """The real store, recording the size of every finish batch and every claim."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.batches: list[int] = []
        self.claims = 0

    async def finish_many_and_claim(self, finishing: Any, limit: int, **kw: Any) -> Any:
        self.batches.append(len(finishing))
        return await super().finish_many_and_claim(finishing, limit, **kw)

    async def claim(self, limit: int) -> Any:
        self.claims += 1
        return await super().claim(limit)


def _with(queue: Queue, **changes: Any) -> Queue:
    return Queue(queue.db, config=attrs.evolve(queue.config, **changes))


async def _rows(queue: Queue, jobs: list[Enqueued]) -> list[tuple[str, int, bool]]:
    rows = [await job_row(queue.db, job.job_id) for job in jobs]
    return [(r["status"], r["attempt"], r["picked_at"] is not None) for r in rows if r]


class HoldsTheFirstFinish(CountingBatches):
    """`CountingBatches` whose first finish statement is held until three more
    jobs have run: what a slow round trip does, made certain."""

    def __init__(self, *args: Any, ran: Counter[Any], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.ran = ran
        self.more_ran = trio.Event()

    async def finish_many_and_claim(self, finishing: Any, limit: int, **kw: Any) -> Any:
        if not self.batches:
            await self.more_ran.wait()
        return await super().finish_many_and_claim(finishing, limit, **kw)


async def test_prefetch_lets_finishes_share_statements_at_concurrency_one(queue: Queue) -> None:
    """
    One slot, eight prefetched: while the fetcher records one finish the slot
    runs the next buffered jobs, so 80 jobs take fewer than 80 statements — and
    each still runs exactly once and ends done. The first finish statement is
    held until the slot has run three more jobs from its buffer (a round trip
    slower than those jobs, for certain: on a fast server every finish may
    otherwise go alone, which proves nothing either way).
    """
    runs: Counter[Any] = Counter()
    store: HoldsTheFirstFinish | None = None

    async def run(ctx: Any) -> None:
        runs[ctx.job_id] += 1
        await succeed(ctx)
        if store is not None and len(runs) >= 4:
            store.more_ran.set()

    for _ in range(80):
        await enqueue_with_target(queue, "Upload")
    prefetching = _with(queue, prefetch=8)
    kinds = frozenset(KINDS)
    store = HoldsTheFirstFinish(queue.db, prefetching.config, runnable_kinds=kinds,
                                known_kinds=kinds, ran=runs)
    worker = Worker(prefetching, executors_for_all(run), store=store)
    with trio.fail_after(TEST_DEADLINE):
        async with trio.open_nursery() as nursery:
            await nursery.start(worker.run)
            await worker.drain_once()
            worker.stop()
    assert sum(store.batches) == 80
    assert set(runs.values()) == {1}
    assert len(runs) == 80
    assert len(store.batches) + store.claims < 80, (store.batches, store.claims)
    assert max(store.batches) >= 3, store.batches
    assert await queue.db.fetchval("SELECT count(*) FROM build_jobs WHERE status='done'") == 80


async def _block_first_job(
    queue: Queue, n_jobs: int, *, store: type[PgJobStore] | None = None, **config: Any
) -> tuple[Worker, list[Enqueued], trio.Event, trio.Event]:
    """A worker whose first job waits on `release`; `started` is set when it runs.
    With `store`, the worker's build store is one of that class."""
    started, release = trio.Event(), trio.Event()

    async def run(ctx: Any) -> None:
        if not started.is_set():
            started.set()
            await release.wait()
        await succeed(ctx)

    jobs = [await enqueue_with_target(queue, "Upload") for _ in range(n_jobs)]
    configured = _with(queue, **config)
    kinds = frozenset(KINDS)
    own = None if store is None else store(queue.db, configured.config, runnable_kinds=kinds,
                                           known_kinds=kinds)
    worker = Worker(configured, executors_for_all(run), store=own)
    return worker, jobs, started, release


async def test_graceful_stop_gives_back_prefetched_jobs_with_attempts_restored(
    queue: Queue,
) -> None:
    worker, jobs, started, release = await _block_first_job(queue, 5, prefetch=3)
    with trio.fail_after(TEST_DEADLINE):
        async with trio.open_nursery() as nursery:
            await nursery.start(worker.run)
            await started.wait()
            await worker.wait_for(lambda s: s.buffered == 3)
            assert await _rows(queue, jobs[1:4]) == [("in_progress", 1, True)] * 3
            worker.stop()
            # The buffer goes back at once, while the running job still runs.
            await worker.wait_for(lambda s: s.returned == 3)
            assert await _rows(queue, jobs[1:4]) == [("pending", 0, False)] * 3
            release.set()
    assert await _rows(queue, jobs) == [("done", 1, True)] + [("pending", 0, False)] * 4
    assert (worker.stats.done, worker.stats.returned) == (1, 3)


async def test_a_stop_asked_during_a_run_that_returns_at_once_gives_back_the_buffer(
    queue: Queue,
) -> None:
    """
    The stop comes while a run is in its slot, and the run returns without
    another await (its report folded into the finish, issue #13): the slot must
    not take the buffered jobs, which go back unstarted (docs/rules.md §8).
    Found while steering issue #24's machine at stops with a full buffer: the
    slot looked only at `closing`, which the lane sets a step later, and ran
    the whole buffer after the stop.
    """
    stopped: list[bool] = []
    worker: Worker

    async def run(ctx: Any) -> None:
        if not stopped:
            stopped.append(True)
            await worker.wait_for(lambda s: s.buffered == 3)
            worker.stop()  # no await from here to the run's end
        ctx.report_success()

    jobs = [await enqueue_with_target(queue, "Upload") for _ in range(5)]
    worker = Worker(_with(queue, prefetch=3), executors_for_all(run))
    with trio.fail_after(TEST_DEADLINE):
        async with trio.open_nursery() as nursery:
            await nursery.start(worker.run)
    assert (worker.stats.done, worker.stats.returned) == (1, 3)
    assert await _rows(queue, jobs) == [("done", 1, True)] + [("pending", 0, False)] * 4


async def test_a_stop_between_a_claim_and_its_start_runs_the_job_without_look_ahead(
    queue: Queue,
) -> None:
    """
    The build lane's default has no look-ahead (prefetch 0): it claims only for
    its free slot, so what its buffer holds is the current drain step's claim.
    A graceful stop asked after that claim and before the executor starts must
    run the job, its attempt kept, and end it done (docs/rules.md §8: the
    worker ends after the current drain step); only a lane with look-ahead gives back what
    it claimed ahead. 4e84668 had made the slot give it back (attempt restored,
    never run); 7f89e9b fixed it. The stop lands through the lane's test signal
    `before_take`, called once the slot has found the job in its buffer and
    just before it looks at the stop: no sleep, no race.
    """
    ran: list[tuple[int, bool]] = []
    worker: Worker

    async def run(ctx: Any) -> None:
        ran.append((ctx.attempt, worker.state.stopping.is_set()))
        await succeed(ctx)

    def stop_now() -> None:
        lane.before_take = None
        worker.stop()

    jobs = [await enqueue_with_target(queue, "Upload")]
    worker = Worker(queue, executors_for_all(run))
    lane = worker.lanes[0].state
    assert (worker.lanes[0].name, lane.prefetch()) == ("builds", 0)
    lane.before_take = stop_now
    with trio.fail_after(TEST_DEADLINE):
        async with trio.open_nursery() as nursery:
            await nursery.start(worker.run)
    assert ran == [(1, True)], "the job must start after the stop, and only once"
    assert await _rows(queue, jobs) == [("done", 1, True)]
    assert (worker.stats.done, worker.stats.returned) == (1, 0)


class HoldsTheSecondClaim(PgJobStore):
    """The real store, logging its claims and give-backs in order; its second
    statement that claims waits at the store's door until `release`: a round
    trip slower than a stop, made certain."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.calls: list[str] = []
        self.claims = 0
        self.held = trio.Event()
        self.release = trio.Event()

    async def _door(self, limit: int) -> None:
        if limit:
            self.claims += 1
            if self.claims == 2:
                self.held.set()
                await self.release.wait()
            self.calls.append("claim")

    async def claim(self, limit: int) -> Any:
        await self._door(limit)
        return await super().claim(limit)

    async def finish_many_and_claim(self, finishing: Any, limit: int, **kw: Any) -> Any:
        await self._door(limit)
        return await super().finish_many_and_claim(finishing, limit, **kw)

    async def unclaim(self, jobs: Any) -> int:
        self.calls.append(f"give back {len(jobs)}")
        return await super().unclaim(jobs)


async def test_a_stop_gives_back_the_buffer_once_the_claim_in_flight_has_landed(
    queue: Queue,
) -> None:
    """
    A stop lands while a claim is in flight (sent for the room the look-ahead
    has left): the buffer goes back once that claim is answered, not beside
    it. Sent beside it, the give-back could commit before the claim read the
    table, and the claim took the same job straight back, to give it back a
    second time. Found by issue #24's steered machine beside two CPU hogs:
    "the stop gave back 2 prefetched job(s), not 1" (claimed 3 of 2 jobs).
    """
    started, release_run = trio.Event(), trio.Event()

    async def run(ctx: Any) -> None:
        started.set()
        await release_run.wait()
        await succeed(ctx)

    jobs = [await enqueue_with_target(queue, "Upload") for _ in range(2)]
    looking_ahead = _with(queue, prefetch=3)
    kinds = frozenset(KINDS)
    store = HoldsTheSecondClaim(queue.db, looking_ahead.config, runnable_kinds=kinds,
                                known_kinds=kinds)
    worker = Worker(looking_ahead, executors_for_all(run), store=store)
    with trio.fail_after(TEST_DEADLINE):
        async with trio.open_nursery() as nursery:
            await nursery.start(worker.run)
            await started.wait()
            await worker.wait_for(lambda s: s.buffered == 1)
            worker.wake()  # as an enqueue would: a claim for the room left
            await store.held.wait()
            worker.stop()
            # Every task has gone as far as it can with the claim held.
            await trio.testing.wait_all_tasks_blocked()
            store.release.set()
            await worker.wait_for(lambda s: s.returned >= 1)
            release_run.set()
    assert store.calls == ["claim", "claim", "give back 1"]
    assert (worker.stats.claimed, worker.stats.returned, worker.stats.done) == (2, 1, 1)
    assert await _rows(queue, jobs) == [("done", 1, True), ("pending", 0, False)]


async def _hard_stop_holding(worker: Worker, started: trio.Event, *, buffered: int) -> None:
    """Run `worker` until its first job has started and `buffered` more wait
    claimed ahead of it, then stop it hard (its nursery cancelled)."""
    with trio.fail_after(TEST_DEADLINE):
        async with trio.open_nursery() as nursery:
            await nursery.start(worker.run)
            await started.wait()
            await worker.wait_for(lambda s: s.buffered == buffered)
            nursery.cancel_scope.cancel()


async def test_hard_stop_gives_back_prefetched_jobs_and_releases_the_running_one(
    queue: Queue,
) -> None:
    worker, jobs, started, _release = await _block_first_job(queue, 4, prefetch=2)
    await _hard_stop_holding(worker, started, buffered=2)
    # The running job ran, so its attempt stays counted; the prefetched two never did.
    assert await _rows(queue, jobs) == [("pending", 1, False)] + [("pending", 0, False)] * 3
    assert (worker.stats.released, worker.stats.returned) == (1, 2)


async def test_prefetched_jobs_past_the_ttl_go_back_for_an_idle_replica(queue: Queue) -> None:
    """Replica A's slot is busy with a long job; its two prefetched jobs go back
    after `prefetch_ttl`, replica B (idle) runs them, and A does not claim them
    straight back while its slot stays busy."""
    a, jobs, started, release = await _block_first_job(queue, 3, prefetch=2, prefetch_ttl=0.2)
    b = Worker(queue, executors_for_all(succeed))
    with trio.fail_after(TEST_DEADLINE):
        async with trio.open_nursery() as nursery:
            await nursery.start(a.run)
            await started.wait()
            await a.wait_for(lambda s: s.returned == 2)
            assert a.stats.buffered == 0
            await nursery.start(b.run)
            await b.drain_once()
            assert b.stats.done == 2
            assert await _rows(queue, jobs[1:]) == [("done", 1, True)] * 2
            assert a.stats.claimed == 3  # the long job and the two it gave back
            release.set()
            await a.wait_for(lambda s: s.done == 1)
            a.stop()
            b.stop()
    assert await _rows(queue, jobs[:1]) == [("done", 1, True)]


def test_prefetch_ttl_must_stay_well_under_the_stuck_threshold() -> None:
    from nasiko_queue import QueueConfig

    with pytest.raises(ConfigurationError, match="prefetch_ttl"):
        QueueConfig(prefetch=4, stuck_job_mins=1)  # 60 s TTL vs a 60 s threshold
    QueueConfig(prefetch=4, stuck_job_mins=1, prefetch_ttl=20)
    QueueConfig(prefetch=0, stuck_job_mins=1)  # no buffer, nothing to check


def test_the_auto_look_ahead_ttl_must_stay_well_under_the_stuck_threshold() -> None:
    from nasiko_queue import QueueConfig

    # Plain lanes are "auto" by default: their TTL is checked as well.
    with pytest.raises(ConfigurationError, match="prefetch_auto_ttl"):
        QueueConfig(stuck_job_mins=1, prefetch_auto_ttl=30)
    with pytest.raises(ConfigurationError, match="prefetch_auto_ttl"):
        QueueConfig(prefetch="auto", stuck_job_mins=1, prefetch_auto_ttl=30)
    QueueConfig(prefetch=0, stuck_job_mins=1, prefetch_auto_ttl=30)  # never used
    QueueConfig(prefetch=2, stuck_job_mins=1, prefetch_ttl=20, prefetch_auto_ttl=30)
    for bad in ("always", -1, True, 2.5):
        with pytest.raises(ConfigurationError, match="prefetch"):
            QueueConfig(prefetch=bad)  # type: ignore[arg-type]


def test_the_default_is_auto_for_plain_lanes_and_none_for_the_build_lane() -> None:
    from nasiko_queue import QueueConfig

    default = QueueConfig()
    assert default.prefetch is None
    assert (default.lane_prefetch(builds=True), default.lane_prefetch(builds=False)) == (
        0, "auto")
    for explicit in ("auto", 0, 3):
        config = QueueConfig(prefetch=explicit)
        assert config.lane_prefetch(builds=True) == config.lane_prefetch(builds=False) == \
            explicit


# -- the adaptive look-ahead (issue #25) ------------------------------------------------


def test_the_look_ahead_follows_the_median_run_time() -> None:
    """floor(wait * slots / t), capped at four per slot; none before a run, none
    once t reaches the wait; one long run among short ones changes nothing."""
    from nasiko_queue.engine.lookahead import WINDOW, LookAhead, sized

    assert sized(0.01, 1, 0.05, 4) == 4  # 5, capped
    assert sized(0.02, 1, 0.05, 4) == 2
    assert sized(0.02, 10, 0.05, 40) == 25
    assert sized(0.049, 1, 0.05, 4) == 1
    assert sized(0.05, 10, 0.05, 40) == 0  # a job as long as the wait: nothing ahead
    assert sized(3.0, 10, 0.05, 40) == 0
    assert sized(0.0, 2, 0.05, 8) == 8
    look = LookAhead(concurrency=1, wait=0.05)
    assert (look.size, look.typical) == (0, None)
    look.observe(0.02)
    assert look.size == 2
    look.observe(30.0)  # one long run: the median of two is 15 s
    assert look.size == 0
    for _ in range(3):
        look.observe(0.02)
    assert look.size == 2  # the short runs' median again
    for _ in range(WINDOW):
        look.observe(2.0)
    assert (look.size, look.typical) == (0, 2.0)  # the lane's jobs turned long


def _timed_worker(store: Any, durations: list[float],
                  **config: Any) -> tuple[Worker, list[float]]:
    """A worker on the fake store (trio's clock) whose n-th run takes durations[n]
    seconds (the last one for every run after); and when each run started."""
    from typing import cast

    from nasiko_queue import Database, Executors, JobContext, QueueConfig, Upload

    executors = Executors()
    started: list[float] = []

    @executors.register(Upload)
    async def run(ctx: JobContext[Upload]) -> None:
        started.append(trio.current_time())
        await trio.sleep(durations[min(len(started), len(durations)) - 1])

    queue = Queue(cast(Database, None), config=QueueConfig(**{"listen": False, **config}))
    return Worker(queue, executors, store=store), started


@pytest.mark.parametrize(("run", "claims_ahead"), [(0.01, 4), (0.02, 2), (2.0, 0)])
async def test_auto_claims_ahead_what_its_run_times_say_on_trios_clock(
    autojump_clock: trio.testing.MockClock, run: float, claims_ahead: int
) -> None:
    """One slot, "auto": the first claim takes one job (no run time yet); each
    later one the free slot plus floor(50 ms / run), at most four. Jobs of two
    seconds: never a job ahead of the slot."""
    from .test_timers import FakeStore

    store = FakeStore()
    for _ in range(12):
        store.add()
    worker, _ = _timed_worker(store, [run], prefetch="auto")
    async with trio.open_nursery() as nursery:
        await nursery.start(worker.run)
        await worker.wait_for(lambda s: s.done == 12)
        nursery.cancel_scope.cancel()
    assert store.limits[0] == 1
    assert store.limits[1] == 1 + claims_ahead
    assert store.most_outstanding == 1 + claims_ahead
    assert store.unclaims == []


async def test_the_build_lane_claims_nothing_ahead_by_default(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The default keeps the original's behaviour for build jobs, however short."""
    from .test_timers import FakeStore

    store = FakeStore()
    for _ in range(6):
        store.add()
    worker, _ = _timed_worker(store, [0.001])
    async with trio.open_nursery() as nursery:
        await nursery.start(worker.run)
        await worker.wait_for(lambda s: s.done == 6)
        nursery.cancel_scope.cancel()
    assert set(store.limits) == {1}
    assert store.most_outstanding == 1


async def test_a_job_claimed_ahead_of_a_run_that_turns_long_goes_back_at_the_auto_ttl(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Short runs, then one of 30 s: the jobs claimed ahead of it go back one
    `prefetch_auto_ttl` (1 s) after their claim, not when it ends; the lane
    claims nothing more until its slot runs dry, and then looks ahead again."""
    from .test_timers import FakeStore

    store = FakeStore()
    for _ in range(10):
        store.add()
    worker, started = _timed_worker(store, [0.01, 0.01, 30.0, 0.01], prefetch="auto")
    async with trio.open_nursery() as nursery:
        await nursery.start(worker.run)
        await worker.wait_for(lambda s: s.done == 10)
        nursery.cancel_scope.cancel()
    # Claimed at 0.01 with the first finish: the second job, the long one and
    # the three behind it, which went back at 1.01, long before the long run's
    # end; at 0.02, with the second finish, one more, which went back at 1.02.
    assert store.claims[:3] == pytest.approx([0.0, 0.01, 0.02])
    assert store.limits[:3] == [1, 5, 1]
    assert store.unclaims == pytest.approx([1.01, 1.02])
    assert started[:3] == pytest.approx([0.0, 0.01, 0.02])
    assert started[3] == pytest.approx(30.02)
    assert worker.stats.returned == 4


@attrs.frozen(kw_only=True)
class Ping(JobArgs):
    kind: ClassVar[str] = "prefetch_ping"
    options: ClassVar[JobOptions] = JobOptions(queue="pings")
    n: int


@pytest.mark.parametrize(("wait", "ahead"), [(3600.0, 4), (1e-6, 0)])
async def test_a_plain_lane_claims_ahead_by_default_as_its_run_times_say(
    queue: Queue, wait: float, ahead: int
) -> None:
    """
    A queue of plain jobs with the default `prefetch`, one slot: once a run has
    been timed, the statement that records its finish claims the slot's next
    job and `ahead` more (in the database: running, attempt counted), as many
    as `prefetch_auto_wait` allows: with an hour, four (the cap of one slot);
    with a microsecond, which any run exceeds, none.
    """
    second = trio.Event()
    release = trio.Event()
    executors = Executors()

    @executors.register(Ping)
    async def run(ctx: PlainJobContext[Ping]) -> None:
        if ctx.payload.n == 1:
            second.set()
            await release.wait()

    ids = [await queue.enqueue(Ping(n=n)) for n in range(8)]
    config = attrs.evolve(queue.config, prefetch_auto_wait=wait)
    async with running(Queue(queue.db, config=config), executors) as worker:
        with trio.fail_after(TEST_DEADLINE):
            await second.wait()
            await worker.wait_for(lambda s: s.done >= 1)  # its statement claimed too
            states = [await queue.db.fetchval(
                "SELECT state FROM nasiko_queue_jobs WHERE id = $1", job_id) for job_id in ids]
            assert states == ["completed"] + ["running"] * (1 + ahead) + ["available"] * (
                6 - ahead)
            assert worker.stats.buffered == ahead
            release.set()
            await worker.wait_for(lambda s: s.done == 8)
    assert worker.stats.returned == 0


# -- a give-back restores `attempted_at` ----------------------------------------------------

#: The test SQL that sets a job up: due long ago (claimed first), or crashed once
#: two minutes ago and due again since a minute ago.
DUE_LONG_AGO = "UPDATE nasiko_queue_jobs SET run_at = now() - interval '1 hour' WHERE id = $1"
CRASHED_ONCE = """
UPDATE nasiko_queue_jobs
SET attempt = 1, attempted_at = now() - interval '2 minutes', run_at = now() - interval '1 minute'
WHERE id = $1
RETURNING attempted_at
"""
PLAIN_ROW = "SELECT state, attempt, attempted_at FROM nasiko_queue_jobs WHERE id = $1"


async def _fresh_and_retried(queue: Queue) -> tuple[Any, Any, Any]:
    """A retried job (crashed on attempt 1) and a fresh one, due in that order;
    returns their ids and the crashed attempt's `attempted_at`."""
    retried = await queue.enqueue(Ping(n=1))
    fresh = await queue.enqueue(Ping(n=2))
    crashed_at = await queue.db.fetchval(CRASHED_ONCE, retried)
    return retried, fresh, crashed_at


async def test_a_hard_stop_gives_back_look_ahead_with_the_attempted_at_it_had(
    queue: Queue,
) -> None:
    """
    Look-ahead that a hard stop gives back never ran: its attempt is restored,
    and so is `attempted_at` ("when its last attempt was claimed"): NULL for a
    job that never ran, the crashed attempt's claim for a retried one. Left at
    the give-back's claim, a fresh job showed an attempt time at attempt 0, and
    a retried one a claim after its retry's due time (run_at - attempted_at
    below its backoff). Found by the plain state machine beside a CPU hog: "its
    retry is -0.20701s after its claim, the backoff window is [60.0, 65.0]".
    """
    started, release = trio.Event(), trio.Event()
    executors = Executors()

    @executors.register(Ping)
    async def run(ctx: PlainJobContext[Ping]) -> None:
        started.set()
        await release.wait()  # the first job holds the lane's one slot

    hold = await queue.enqueue(Ping(n=0))
    await queue.db.execute(DUE_LONG_AGO, hold)
    retried, fresh, crashed_at = await _fresh_and_retried(queue)
    worker = Worker(_with(queue, prefetch=2), executors)
    await _hard_stop_holding(worker, started, buffered=2)
    assert (worker.stats.released, worker.stats.returned) == (1, 2)
    assert tuple(await queue.db.fetchrow(PLAIN_ROW, retried)) == ("available", 1, crashed_at)
    assert tuple(await queue.db.fetchrow(PLAIN_ROW, fresh)) == ("available", 0, None)


@pytest.mark.parametrize("how", ["unclaim", "lost claim"])
async def test_each_give_back_of_a_plain_claim_restores_attempted_at(
    queue: Queue, how: str
) -> None:
    """The two statements that give a plain claim back: `plain_unclaim` (look-ahead
    past its TTL, a stop, a slot gone) and `plain_unclaim_lost` (a claim whose
    answer never came, found by its token) restore `attempted_at` with the attempt."""
    retried, fresh, crashed_at = await _fresh_and_retried(queue)
    store = PlainJobStore(queue.db, queue.config, Ping.options.queue, lambda: None)
    claimed = await store.claim(2)
    assert [job.id for job in claimed] == [retried, fresh]
    for job_id in (retried, fresh):
        assert (await queue.db.fetchrow(PLAIN_ROW, job_id))["attempted_at"] is not None
    if how == "unclaim":
        assert await store.unclaim(claimed) == 2
    else:
        token = await queue.db.fetchval(
            "SELECT claim_token FROM nasiko_queue_jobs WHERE id = $1", retried)
        assert await queue.db.fetchval(Q.plain_unclaim_lost, token) == 2
    assert tuple(await queue.db.fetchrow(PLAIN_ROW, retried)) == ("available", 1, crashed_at)
    assert tuple(await queue.db.fetchrow(PLAIN_ROW, fresh)) == ("available", 0, None)


class FailsTheFirstGiveBack(PgJobStore):
    """The real store, whose first give-back meets a dropped connection (an
    outage's error, raised before the statement is sent)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.give_backs = 0

    async def unclaim(self, jobs: Any) -> int:
        self.give_backs += 1
        if self.give_backs == 1:
            raise ConnectionResetError("connection dropped (injected)")
        return await super().unclaim(jobs)


async def test_a_give_back_past_the_ttl_that_fails_is_tried_again(queue: Queue) -> None:
    """
    The look-ahead's give-back past its TTL fails once (an outage): it is tried
    again until it lands, as every final write is. It used to be dropped with a
    warning, and the two jobs stayed running, unstarted, for as long as the
    worker lived (no rescue or sweep takes a live worker's rows).
    """
    worker, jobs, started, release = await _block_first_job(
        queue, 3, store=FailsTheFirstGiveBack, prefetch=2, prefetch_ttl=0.2,
        retry_initial_delay=0.01)
    [lane] = worker.lanes
    store = lane.store
    assert isinstance(store, FailsTheFirstGiveBack)
    dropped = LogEvent("could not be given back")
    logging.getLogger("nasiko_queue").addHandler(dropped)
    try:
        with trio.fail_after(TEST_DEADLINE):
            async with trio.open_nursery() as nursery:
                await nursery.start(worker.run)
                await started.wait()
                await worker.wait_for(lambda s: s.returned == 2 or dropped.count > 0)
                assert dropped.count == 0, "the give-back was dropped after one failure"
                assert store.give_backs == 2
                assert await _rows(queue, jobs[1:]) == [("pending", 0, False)] * 2
                release.set()
                worker.stop()
    finally:
        logging.getLogger("nasiko_queue").removeHandler(dropped)


@pytest.mark.parametrize("lane", ["plain", "builds"])
async def test_a_give_back_tried_again_after_it_landed_leaves_another_claim_alone(
    queue: Queue, lane: str
) -> None:
    """
    A give-back is retried until it lands; a try whose answer was lost may have
    landed already. The give-back restores the attempt, so another worker's
    claim of the same row has the same attempt number again: the retry must not
    take that claim back (found by review: it did, and the job ran twice).
    """
    a, b = uuid.uuid4(), uuid.uuid4()
    kinds = frozenset(KINDS)
    stores: dict[uuid.UUID, Any] = {}
    for worker in (a, b):
        if lane == "plain":
            stores[worker] = PlainJobStore(queue.db, queue.config, "pings",
                                           lambda w=worker: w)
        else:
            store = PgJobStore(queue.db, queue.config, runnable_kinds=kinds,
                               known_kinds=kinds)
            await store.register_worker(WorkerIdentity(id=worker, host="h", pid=1,
                                                       kinds=tuple(kinds)))
            stores[worker] = store
    if lane == "plain":
        await queue.enqueue(Ping(n=1))
    else:
        await enqueue_with_target(queue, "Upload")
    [first] = await stores[a].claim(1)
    assert await stores[a].unclaim([first]) == 1  # landed; say its answer was lost
    [second] = await stores[b].claim(1)
    assert (second.id, second.attempt) == (first.id, first.attempt)
    assert await stores[a].unclaim([first]) == 0  # the retry
    if lane == "plain":
        row = await queue.db.fetchrow(
            "SELECT state, claimed_by FROM nasiko_queue_jobs WHERE id = $1", first.id)
        assert tuple(row) == ("running", b)
    else:
        row = await queue.db.fetchrow(
            "SELECT status, claimed_by FROM build_jobs WHERE id = $1", first.id)
        assert tuple(row) == ("in_progress", b)


class GiveBacksFailDuringAnOutage(PgJobStore):
    """The real store, whose give-backs meet a dropped connection while `down`
    (an outage's error, raised before the statement is sent); `tried` is set at
    the second failed try (the give-back is retrying)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.down = True
        self.give_backs = 0
        self.tried = trio.Event()

    async def unclaim(self, jobs: Any) -> int:
        self.give_backs += 1
        if self.down:
            if self.give_backs >= 2:
                self.tried.set()
            raise ConnectionResetError("connection dropped (injected)")
        return await super().unclaim(jobs)


async def test_a_stop_during_an_outage_long_give_back_ends_within_its_bound(
    queue: Queue,
) -> None:
    """
    A give-back past the TTL begins during an outage and retries (the worker is
    alive: no rescue would take its rows). A graceful stop then comes, and the
    outage goes on: the give-back has 2 × `cleanup_timeout` more, as the stop's
    own writes have, and the worker returns, its two jobs left running for the
    rescue. It used to go on retrying until the outage ended: the stop waited
    for it (here, for ever).
    """
    worker, jobs, started, release = await _block_first_job(
        queue, 3, store=GiveBacksFailDuringAnOutage, prefetch=2, prefetch_ttl=0.2,
        retry_initial_delay=0.01, retry_max_delay=0.05, cleanup_timeout=0.2)
    [lane] = worker.lanes
    store = lane.store
    assert isinstance(store, GiveBacksFailDuringAnOutage)
    with LogEvent("could not be given back") as dropped, trio.fail_after(TEST_DEADLINE):
        async with trio.open_nursery() as nursery:
            await nursery.start(worker.run)
            await started.wait()
            await store.tried.wait()  # the TTL's give-back retries through the outage
            release.set()
            worker.stop()
        assert dropped.count == 1
    assert store.down
    rows = await _rows(queue, jobs)
    assert rows[0] == ("done", 1, True)
    assert rows[1:] == [("in_progress", 1, True)] * 2  # the rescue's, once the worker is gone
