"""
Prefetch (`QueueConfig.prefetch`): jobs claimed ahead of the free slots wait in
a local buffer. What must hold: every job still runs once, the buffer lets
finishes share statements, and a buffered job that never started goes back to
pending with its attempt restored — at a graceful stop, at a hard stop, and
when it has waited past `prefetch_ttl` (so an idle replica can take it).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import attrs
import pytest
import trio

from nasiko_queue import Queue, Worker
from nasiko_queue.builds.store import PgJobStore
from nasiko_queue.errors import ConfigurationError
from nasiko_queue.testing import KINDS, Enqueued, enqueue_with_target

from .helpers import TEST_DEADLINE, executors_for_all, job_row, succeed


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
    queue: Queue, n_jobs: int, **config: Any
) -> tuple[Worker, list[Enqueued], trio.Event, trio.Event]:
    """A worker whose first job waits on `release`; `started` is set when it runs."""
    started, release = trio.Event(), trio.Event()

    async def run(ctx: Any) -> None:
        if not started.is_set():
            started.set()
            await release.wait()
        await succeed(ctx)

    jobs = [await enqueue_with_target(queue, "Upload") for _ in range(n_jobs)]
    worker = Worker(_with(queue, **config), executors_for_all(run))
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


async def test_hard_stop_gives_back_prefetched_jobs_and_releases_the_running_one(
    queue: Queue,
) -> None:
    worker, jobs, started, _release = await _block_first_job(queue, 4, prefetch=2)
    with trio.fail_after(TEST_DEADLINE):
        async with trio.open_nursery() as nursery:
            await nursery.start(worker.run)
            await started.wait()
            await worker.wait_for(lambda s: s.buffered == 2)
            nursery.cancel_scope.cancel()
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
