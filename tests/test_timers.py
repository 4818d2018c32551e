"""
The worker's timers on trio's mock clock, with an in-memory fake of the job store.

A fake is right here and only here: these tests are about *when* the worker
looks (5 s poll re-armed after each drain, recovery ticks at 600 s intervals,
missed ticks skipped), which a real database cannot drive on virtual time
(trio-asyncpg-notes §5: autojump with real sockets fires timeouts early).
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from typing import Any, cast

import trio
import trio.testing

from nasiko_queue import Database, Executors, JobContext, Queue, QueueConfig, Upload, Worker
from nasiko_queue.builds.payloads import PayloadCodec
from nasiko_queue.engine.contracts import (
    ClaimedJob,
    Heartbeat,
    JobStatus,
    RecoveryResult,
    RescueResult,
)
from nasiko_queue.testing import make_payload


class FakeStore:
    """Pending payloads in a list; records when each operation happened (trio time)."""

    def __init__(self, *, recover_takes: float = 0.0, recover_fails: int = 0) -> None:
        self.pending: list[str] = []
        self.claims: list[float] = []
        self.recoveries: list[float] = []
        self.finished: list[float] = []
        self.unclaims: list[float] = []
        self.recover_takes = recover_takes
        self.recover_fails = recover_fails
        #: Seconds claim statements take, in turn (none: they answer at once).
        self.statement_takes: list[float] = []
        self.limits: list[int] = []
        self.in_flight = 0
        self.most_in_flight = 0
        #: Jobs claimed and not yet finished, and the most there ever were.
        self.outstanding = 0
        self.most_outstanding = 0

    def add(self) -> None:
        owner = uuid.uuid4()
        payload = make_payload("Upload", target_id=uuid.uuid4(), build_id=uuid.uuid4(),
                               owner_id=owner)
        import json

        self.pending.append(json.dumps(PayloadCodec().encode(payload)))

    async def claim(self, limit: int) -> list[ClaimedJob]:
        self.claims.append(trio.current_time())
        self.limits.append(limit)
        if self.statement_takes:
            self.in_flight += 1
            self.most_in_flight = max(self.most_in_flight, self.in_flight)
            takes = self.statement_takes[len(self.limits) % len(self.statement_takes)]
            await trio.sleep(takes)
            self.in_flight -= 1
        taken, self.pending = self.pending[:limit], self.pending[limit:]
        self.outstanding += len(taken)
        self.most_outstanding = max(self.most_outstanding, self.outstanding)
        return [
            ClaimedJob(id=uuid.uuid4(), agent_id=uuid.uuid4(), connector_id=None,
                       owner_id=uuid.uuid4(), payload=p, old_attempt=0,
                       created_at=datetime.now(UTC))
            for p in taken
        ]

    async def finish_from_build(self, job: ClaimedJob, build_id: uuid.UUID) -> JobStatus:
        self.finished.append(trio.current_time())
        self.outstanding -= 1
        return JobStatus.DONE

    async def finish_many_and_claim(
        self, finishing: list[tuple[ClaimedJob, uuid.UUID, Any]], limit: int, **_: Any
    ) -> tuple[dict[uuid.UUID, JobStatus | None], list[ClaimedJob]]:
        statuses: dict[uuid.UUID, JobStatus | None] = {
            job.id: await self.finish_from_build(job, build) for job, build, _ in finishing}
        return statuses, await self.claim(limit)

    async def unclaim(self, jobs: list[ClaimedJob]) -> int:
        self.unclaims.append(trio.current_time())
        self.pending[:0] = [job.payload for job in jobs]
        self.outstanding -= len(jobs)
        return len(jobs)

    async def fail(self, job: ClaimedJob, message: str, *, own_build_id: Any,
                   terminalize: bool) -> bool:
        return True

    async def reset(self, job: ClaimedJob) -> bool:
        return True

    async def resolve_lost_claim(self, claim: Any) -> int:
        return 0

    async def register_worker(self, identity: Any) -> None:
        self.worker_id = identity.id

    async def heartbeat(self, role: str | None) -> Heartbeat:
        return Heartbeat(alive=True, leader=role is not None)

    async def retire_worker(self) -> None:
        pass

    async def deregister_worker(self) -> None:
        pass

    async def rescue(self) -> RescueResult:
        return RescueResult(0, 0, 0)

    async def record_error(self, job: Any, error: Any) -> None:
        pass

    async def recover(self) -> RecoveryResult:
        self.recoveries.append(trio.current_time())
        if self.recover_fails:
            self.recover_fails -= 1
            raise OSError("database is down")
        await trio.sleep(self.recover_takes)
        return RecoveryResult(0, 0)


def _worker(store: FakeStore, **config: Any) -> Worker:
    executors = Executors()

    @executors.register(Upload)
    async def run(ctx: JobContext[Upload]) -> None:
        await trio.sleep(1)  # a one-second "build"

    # No database behind this queue: no LISTEN connection either.
    queue = Queue(cast(Database, None), config=QueueConfig(**{"listen": False, **config}))
    return Worker(queue, executors, store=store)


async def test_startup_recovery_runs_before_started(autojump_clock: trio.testing.MockClock) -> None:
    store = FakeStore()
    worker = _worker(store)
    async with trio.open_nursery() as nursery:
        await nursery.start(worker.run)
        assert store.recoveries == [0.0]
        nursery.cancel_scope.cancel()


async def test_startup_recovery_retries_until_the_database_answers(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store = FakeStore(recover_fails=3)
    worker = _worker(store, retry_initial_delay=1.0, retry_max_delay=10.0)
    async with trio.open_nursery() as nursery:
        await nursery.start(worker.run)
        assert store.recoveries == [0.0, 1.0, 3.0, 7.0]  # backoff 1, 2, 4
        assert trio.current_time() == 7.0
        nursery.cancel_scope.cancel()


async def test_poll_finds_a_job_nobody_woke_for(autojump_clock: trio.testing.MockClock) -> None:
    """A job appearing without a wake (another process enqueued it) starts at +5 s."""
    store = FakeStore()
    worker = _worker(store)
    async with trio.open_nursery() as nursery:
        await nursery.start(worker.run)
        await trio.sleep(2)
        assert store.claims == [0.0]  # the first drain, at start
        store.add()  # no wake
        await trio.sleep(10)
        # Claimed at the 5 s poll, ran for 1 s; the drain's next claim (one slot:
        # it waits for the running job) found nothing at 6 s.
        assert store.claims[:3] == [0.0, 5.0, 6.0]
        assert store.finished == [6.0]
        nursery.cancel_scope.cancel()


async def test_poll_is_rearmed_after_each_drain(autojump_clock: trio.testing.MockClock) -> None:
    store = FakeStore()
    store.add()
    store.add()
    worker = _worker(store)
    async with trio.open_nursery() as nursery:
        await nursery.start(worker.run)
        await trio.sleep(8.5)
        # Drain at 0 runs two 1-second jobs and ends at 2; next look 5 s later.
        assert store.finished == [1.0, 2.0]
        assert [t for t in store.claims if t > 2] == [7.0]
        nursery.cancel_scope.cancel()


async def test_wake_starts_a_drain_at_once(autojump_clock: trio.testing.MockClock) -> None:
    store = FakeStore()
    worker = _worker(store)
    async with trio.open_nursery() as nursery:
        await nursery.start(worker.run)
        await trio.sleep(1.5)
        store.add()
        worker.wake()
        await trio.sleep(0.1)
        assert store.claims == [0.0, 1.5]
        nursery.cancel_scope.cancel()


async def test_recovery_ticks_every_ten_minutes(autojump_clock: trio.testing.MockClock) -> None:
    store = FakeStore()
    worker = _worker(store)
    async with trio.open_nursery() as nursery:
        await nursery.start(worker.run)
        await trio.sleep(1900)
        assert store.recoveries == [0.0, 600.0, 1200.0, 1800.0]
        nursery.cancel_scope.cancel()


async def test_missed_recovery_ticks_are_skipped(autojump_clock: trio.testing.MockClock) -> None:
    """A sweep that overruns (1500 s) skips the ticks it missed instead of replaying them."""
    store = FakeStore()
    worker = _worker(store)
    async with trio.open_nursery() as nursery:
        await nursery.start(worker.run)
        store.recover_takes = 1500
        await trio.sleep(3100)
        # Startup (instant); the tick at 600 runs until 2100, so 1200 and 1800 are
        # skipped, not replayed; the next tick is 2400 (and runs past 3100).
        assert store.recoveries == [0.0, 600.0, 2400.0]
        nursery.cancel_scope.cancel()


async def test_failed_recovery_tick_does_not_stop_the_worker(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store = FakeStore()
    worker = _worker(store)
    async with trio.open_nursery() as nursery:
        await nursery.start(worker.run)
        store.recover_fails = 1
        await trio.sleep(1250)
        assert store.recoveries == [0.0, 600.0, 1200.0]
        store.add()
        worker.wake()
        await trio.sleep(2)
        assert len(store.finished) == 1
        nursery.cancel_scope.cancel()


async def test_configured_intervals(autojump_clock: trio.testing.MockClock) -> None:
    store = FakeStore()
    worker = _worker(store, poll_interval=1.0, recovery_interval=30.0)
    async with trio.open_nursery() as nursery:
        await nursery.start(worker.run)
        await trio.sleep(65)
        assert store.recoveries == [0.0, 30.0, 60.0]
        assert store.claims[:4] == [0.0, 1.0, 2.0, 3.0]
        nursery.cancel_scope.cancel()


async def test_graceful_stop_waits_for_the_running_job(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store = FakeStore()
    store.add()
    store.add()
    worker = _worker(store)
    async with trio.open_nursery() as nursery:
        await nursery.start(worker.run)
        await trio.sleep(0.5)
        worker.stop()
    assert trio.current_time() == 1.0       # the running job's 1 s build finished
    assert store.finished == [1.0]
    assert len(store.pending) == 1           # the second was never claimed


async def test_recovery_tick_starts_a_drain(autojump_clock: trio.testing.MockClock) -> None:
    """The sweep is one of the three signals: jobs it frees run without waiting for a poll."""
    store = FakeStore()
    worker = _worker(store, poll_interval=10_000.0)
    async with trio.open_nursery() as nursery:
        await nursery.start(worker.run)
        await trio.sleep(100)
        store.add()  # e.g. a stuck job the sweep is about to reset
        await trio.sleep(600)
        assert store.finished == [601.0]
        nursery.cancel_scope.cancel()


async def test_stop_during_startup_recovery_returns(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A first signal while the database is still down stops the worker (no second
    signal needed)."""
    store = FakeStore(recover_fails=10**6)
    worker = _worker(store, retry_initial_delay=1.0, retry_max_delay=10.0)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(worker.run)
        await trio.sleep(30)
        worker.stop()
    assert trio.current_time() == 30.0
    assert store.claims == []


async def test_prefetched_jobs_go_back_at_the_ttl_and_prefetch_resumes_when_a_slot_runs_dry(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """One slot, two prefetched, one-second jobs, a 0.5 s TTL: the two go back
    at 0.5 s (not at 0.4, not at 1.0); nothing is claimed again until the slot
    frees at 1 s, and then the buffer fills again."""
    store = FakeStore()
    for _ in range(3):
        store.add()
    worker = _worker(store, prefetch=2, prefetch_ttl=0.5)
    async with trio.open_nursery() as nursery:
        await nursery.start(worker.run)
        await trio.sleep(0.4)
        assert (store.unclaims, worker.stats.buffered) == ([], 2)
        await trio.sleep(0.2)
        assert (store.unclaims, worker.stats.buffered) == ([0.5], 0)
        assert store.claims == [0.0]
        await trio.sleep(3)
        assert store.claims[:2] == [0.0, 1.0]  # with the first finish, a claim for 3
        assert store.finished == [1.0, 2.0, 3.0]
        assert store.unclaims == [0.5, 1.5]  # the refill waited past the TTL again
        nursery.cancel_scope.cancel()


async def test_several_slots_keep_two_statements_in_flight_each_claiming_half(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Four slots, one-second jobs, statements of 0.1 s and 0.3 s in turn (so the
    two halves drift apart): two statements are in flight at once, each claims
    at most half the slots, and the claims in flight never add up to more than
    the free slots."""
    store = FakeStore()
    store.statement_takes = [0.1, 0.3]
    for _ in range(12):
        store.add()
    worker = _worker(store, concurrency=4)
    async with trio.open_nursery() as nursery:
        await nursery.start(worker.run)
        await worker.wait_for(lambda s: s.done == 12)
        nursery.cancel_scope.cancel()
    assert store.most_in_flight == 2
    assert max(store.limits) == 2
    assert store.limits[:2] == [2, 2]  # the drain's first two claims, at once
    assert store.claims[:2] == [0.0, 0.0]
    assert worker.stats.claimed == 12
    assert store.most_outstanding == 4  # never more jobs in hand than slots


async def test_one_slot_keeps_one_statement_in_flight(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """One slot with prefetch: one statement at a time, so jobs start in the order
    they were claimed."""
    store = FakeStore()
    store.statement_takes = [0.25]
    for _ in range(6):
        store.add()
    worker = _worker(store, prefetch=3)
    async with trio.open_nursery() as nursery:
        await nursery.start(worker.run)
        await worker.wait_for(lambda s: s.done == 6)
        nursery.cancel_scope.cancel()
    assert store.most_in_flight == 1
    assert store.limits[0] == 4
