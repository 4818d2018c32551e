"""Several workers on one table: SKIP LOCKED keeps every claim exclusive (SPEC §8)."""

from __future__ import annotations

from collections import Counter
from typing import Any

import trio
import trio.lowlevel

from nasiko_queue import JobContext, Queue, Worker, open_database
from nasiko_queue.testing import enqueue_with_target

from .conftest import FAST
from .helpers import executors_for_all, succeed


async def test_two_replicas_never_claim_the_same_job(dsn: str, queue: Queue) -> None:
    runs: Counter[Any] = Counter()
    by_worker: Counter[int] = Counter()

    def executor(index: int) -> Any:
        async def run(ctx: JobContext[Any]) -> None:
            runs[ctx.job_id] += 1
            by_worker[index] += 1
            await trio.lowlevel.checkpoint()  # let the other replica interleave
            await succeed(ctx)
        return run

    jobs = [await enqueue_with_target(queue, "Upload") for _ in range(60)]
    async with open_database(dsn) as db1, open_database(dsn) as db2:
        workers = [
            Worker(Queue(db1, config=FAST), executors_for_all(executor(0))),
            Worker(Queue(db2, config=FAST), executors_for_all(executor(1))),
        ]
        async with trio.open_nursery() as nursery:
            for w in workers:
                await nursery.start(w.run)
            async with trio.open_nursery() as both:
                for w in workers:
                    both.start_soon(w.drain_once)
            for w in workers:
                w.stop()
    assert set(runs) == {j.job_id for j in jobs}
    assert set(runs.values()) == {1}
    done = await queue.db.fetchval("SELECT count(*) FROM build_jobs WHERE status = 'done'")
    assert done == 60
    assert by_worker[0] > 0
    assert by_worker[1] > 0
