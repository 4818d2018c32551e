"""
Enqueue from any application (issue #26): one plain job per call, each call its
own transaction, through

* ``queue``: `Queue.enqueue` on trio (trio-asyncio + asyncpg), the reference;
* ``sql``:   ``SELECT nasiko_queue.nasiko_queue_enqueue(...)`` on one bare asyncpg connection
             on a plain asyncio loop (what any driver pays; the payload built by hand);
* ``aio``:   `nasiko_queue.aio.enqueue` on one asyncpg connection (the codec, then
             the SQL function);
* ``sync``:  `nasiko_queue.sync.enqueue` on one psycopg 3 connection, autocommit.

Each is run `rounds` times, interleaved (queue, sql, aio, sync, queue, ...), so
that a change in the machine's load touches all alike; the figure is the median
jobs/s of its rounds and the ratio to ``queue``'s median in the same run.

    python -m benchmarks.any_app DSN [JOBS] [ROUNDS]
"""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import time
from collections.abc import Coroutine
from typing import Any, ClassVar

import attrs
import trio

from nasiko_queue import JobArgs, JobOptions, Queue, aio, open_database
from nasiko_queue import sync as nq_sync

from .connect import connect


@attrs.frozen(kw_only=True)
class Note(JobArgs):
    kind: ClassVar[str] = "bench_note"
    options: ClassVar[JobOptions] = JobOptions(queue="bench_any_app")
    n: int
    text: str = "a short note, as a small job carries"


TEXT = "a short note, as a small job carries"


def _plain_asyncio(coro: Coroutine[Any, Any, float]) -> float:
    """A plain asyncio loop: `asyncio.run` would build trio-asyncio's synchronous
    one, trio_asyncio being imported (README: "Which asyncio loop")."""
    with asyncio.Runner(loop_factory=asyncio.SelectorEventLoop) as runner:
        return runner.run(coro)


def _queue(dsn: str, jobs: int) -> float:
    async def main() -> float:
        async with open_database(dsn) as db:
            queue = Queue(db)
            await queue.enqueue(Note(n=-1))  # connections opened before the clock
            start = time.perf_counter()
            for n in range(jobs):
                await queue.enqueue(Note(n=n))
            return jobs / (time.perf_counter() - start)

    return trio.run(main)


def _sql(dsn: str, jobs: int) -> float:
    async def main() -> float:
        conn = await connect(dsn)
        try:
            sql = "SELECT nasiko_queue.nasiko_queue_enqueue($1, $2::jsonb, queue => $3)"
            start = time.perf_counter()
            for n in range(jobs):
                await conn.fetchval(sql, Note.kind, json.dumps({"n": n, "text": TEXT}),
                                    Note.options.queue)
            return jobs / (time.perf_counter() - start)
        finally:
            await conn.close()

    return _plain_asyncio(main())


def _aio(dsn: str, jobs: int) -> float:
    async def main() -> float:
        conn = await connect(dsn)
        try:
            start = time.perf_counter()
            for n in range(jobs):
                await aio.enqueue(conn, Note(n=n))
            return jobs / (time.perf_counter() - start)
        finally:
            await conn.close()

    return _plain_asyncio(main())


def _sync(dsn: str, jobs: int) -> float:
    import psycopg  # a test extra, as the benchmark is

    with psycopg.connect(dsn, autocommit=True) as conn:
        start = time.perf_counter()
        for n in range(jobs):
            nq_sync.enqueue(conn, Note(n=n))
        return jobs / (time.perf_counter() - start)


WAYS = {"queue": _queue, "sql": _sql, "aio": _aio, "sync": _sync}


def run(dsn: str, jobs: int = 2000, rounds: int = 3) -> dict[str, Any]:
    """Median jobs/s of each way and its ratio to `Queue.enqueue`'s."""
    samples: dict[str, list[float]] = {way: [] for way in WAYS}
    for _ in range(rounds):
        for way, fn in WAYS.items():
            samples[way].append(fn(dsn, jobs))
    medians = {way: statistics.median(s) for way, s in samples.items()}
    return {"jobs_per_round": jobs, "rounds": rounds,
            "jobs_per_s": {way: round(m, 1) for way, m in medians.items()},
            "samples": {way: [round(x, 1) for x in s] for way, s in samples.items()},
            "vs_queue": {way: round(m / medians["queue"], 3) for way, m in medians.items()}}


if __name__ == "__main__":
    print(json.dumps(run(sys.argv[1], *(int(a) for a in sys.argv[2:4])), indent=2))
