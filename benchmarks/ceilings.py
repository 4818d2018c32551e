"""
Ceilings: bare asyncpg on plain asyncio (``asyncio.run``, no trio), no engine.

(a) one job per transaction: claim one job (its own commit), mark it done (its
    own commit), with 1 and with 8 connections;
(b) the engine's own statements with the engine's batching: `Q.job_claim` with
    a limit K, then rounds of `Q.jobs_finish_many_and_claim` that finish K jobs
    and claim K more, with as many statements in flight as the worker keeps, on
    connections with the engine's session settings. The runner measures it for
    each drain setting with the K and the statements in flight that setting
    reached.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Coroutine
from typing import Any, TypeVar

import asyncpg

from nasiko_queue.builds.payloads import BUILTIN_PAYLOAD_TYPES
from nasiko_queue.builds.store import BUILD_FAILED
from nasiko_queue.config import MAX_PAYLOAD_BYTES
from nasiko_queue.db.database import ENGINE_SERVER_SETTINGS
from nasiko_queue.db.statements import Q

from .connect import connect

T = TypeVar("T")

CLAIM_ONE = """
UPDATE build_jobs SET status = 'in_progress', picked_at = now(), attempt = attempt + 1
WHERE id = (SELECT id FROM build_jobs WHERE status = 'pending'
            ORDER BY created_at LIMIT 1 FOR UPDATE SKIP LOCKED)
RETURNING id
"""
MARK_DONE = "UPDATE build_jobs SET status = 'done', completed_at = now() WHERE id = $1"


def one_per_transaction(dsn: str, n_jobs: int, connections: int) -> float:
    """Ceiling (a): jobs/s for draining `n_jobs` pending jobs."""

    async def main() -> float:
        conns = [await connect(dsn) for _ in range(connections)]
        try:
            async def loop(conn: asyncpg.Connection) -> int:
                n = 0
                while True:
                    job_id = await conn.fetchval(CLAIM_ONE)
                    if job_id is None:
                        return n
                    await conn.execute(MARK_DONE, job_id)
                    n += 1

            t0 = time.perf_counter()
            done = sum(await asyncio.gather(*(loop(c) for c in conns)))
            elapsed = time.perf_counter() - t0
        finally:
            for c in conns:
                await c.close()
        if done != n_jobs:
            raise RuntimeError(f"ceiling (a) drained {done} jobs, expected {n_jobs}")
        return done / elapsed

    return _run(main())


def same_sql(dsn: str, n_jobs: int, batch: int, streams: int = 1) -> float:
    """
    Ceiling (b): jobs/s with the engine's own statements and batching, no engine.

    As the worker's fetcher does: `streams` statements in flight at once (one
    connection each; the worker keeps two with several slots), each stream
    claiming up to `batch` jobs, then sending rounds that finish every job of its
    last claim and claim the next `batch` (`jobs_finish_many_and_claim`).
    """
    kinds = ["Upload"]
    known = sorted(t.kind for t in BUILTIN_PAYLOAD_TYPES)

    async def stream(conn: asyncpg.Connection) -> int:
        done = 0
        token = uuid.uuid4()
        rows = list(await conn.fetch(Q.job_claim, batch, kinds, known, MAX_PAYLOAD_BYTES,
                                     token, None))
        while rows:
            done += len(rows)
            claimed_with, token = token, uuid.uuid4()
            got = await conn.fetch(
                Q.jobs_finish_many_and_claim, [r["id"] for r in rows],
                [r["old_attempt"] + 1 for r in rows], [False] * len(rows),
                [_build_id(r["payload"]) for r in rows], BUILD_FAILED, batch,
                kinds, known, MAX_PAYLOAD_BYTES, token, None, [claimed_with] * len(rows))
            rows = [r for r in got if r["id"] is not None]
        return done

    async def main() -> float:
        # The engine runs these statements with generic plans kept; so does this.
        conns = [await connect(dsn, server_settings=ENGINE_SERVER_SETTINGS)
                 for _ in range(streams)]
        try:
            t0 = time.perf_counter()
            done = sum(await asyncio.gather(*(stream(c) for c in conns)))
            elapsed = time.perf_counter() - t0
        finally:
            for c in conns:
                await c.close()
        if done != n_jobs:
            raise RuntimeError(f"ceiling (b) drained {done} jobs, expected {n_jobs}")
        return done / elapsed

    return _run(main())


def _run(coro: Coroutine[Any, Any, T]) -> T:
    """On a plain asyncio selector loop, never trio-asyncio's (see workloads.plain_asyncio)."""
    with asyncio.Runner(loop_factory=asyncio.SelectorEventLoop) as runner:
        return runner.run(_checked(coro))


async def _checked(coro: Coroutine[Any, Any, T]) -> T:
    loop = asyncio.get_running_loop()
    if "trio" in type(loop).__module__:
        raise RuntimeError(f"ceiling running on {type(loop).__name__}, not plain asyncio")
    return await coro


def _build_id(payload_text: str) -> str:
    import json

    value: str = json.loads(payload_text)["build_id"]
    return value


# -- enqueue (issue #13) ---------------------------------------------------------------
#
# (e1) a bare loop of the engine's own single-row INSERT + NOTIFY (`Q.job_insert_notify`,
#      `Q.plain_insert_notify`), one statement per job and so one commit per job, on one
#      connection: what `Queue.enqueue(payload)` without `tx` does, minus the engine.
# (e2) the same rows in one multi-row INSERT … unnest (`Q.jobs_insert_many_notify`,
#      `Q.plain_insert_many_notify`, one statement, one commit), and by COPY; the ratio
#      takes the faster of the two.
#
# Both insert the very rows the engine would: the payload text is encoded (and the env
# sealed) by the engine's own codec *before* the clock starts, so the engine's figure
# pays for its encoding and the ceiling does not. That is the strict comparison: the
# same bytes reach the server, and everything the engine adds, encoding included,
# shows in the ratio.


def enqueue_loop(dsn: str, statement: str, rows: list[tuple[Any, ...]]) -> float:
    """Ceiling e1: jobs/s for `statement` run once per row (its own transaction)."""

    async def main() -> float:
        conn = await connect(dsn)
        try:
            t0 = time.perf_counter()
            for row in rows:
                await conn.fetchval(statement, *row)
            return len(rows) / (time.perf_counter() - t0)
        finally:
            await conn.close()

    return _run(main())


def enqueue_bulk(dsn: str, statement: str, columns: tuple[list[Any], ...],
                 table: str, copy_columns: list[str],
                 copy_records: list[tuple[Any, ...]]) -> dict[str, float]:
    """
    Ceiling e2: jobs/s for the rows in one multi-row statement (`columns` as its
    arrays), and for the same rows by COPY into `table` (in another run, after a
    TRUNCATE, so that both find the table as empty).
    """
    n = len(copy_records)

    async def main() -> dict[str, float]:
        conn = await connect(dsn)
        try:
            t0 = time.perf_counter()
            await conn.execute(statement, *columns)
            insert = n / (time.perf_counter() - t0)
            await conn.execute(f"TRUNCATE {table}")
            t0 = time.perf_counter()
            await conn.copy_records_to_table(table, columns=copy_columns,
                                             records=copy_records)
            copy = n / (time.perf_counter() - t0)
            return {"insert_jobs_per_s": insert, "copy_jobs_per_s": copy,
                    "jobs_per_s": max(insert, copy)}
        finally:
            await conn.close()

    return _run(main())


# -- ceiling L (issue #25) ---------------------------------------------------------------
#
# (L) a bare LISTEN/NOTIFY ping-pong between two connections of one process: connection A
#     sends `NOTIFY` on one channel, B listens to it and answers at once on another,
#     which A listens to; the round trip, at the pace the wake workloads enqueue. The
#     least any wake from another process can take on this server and machine: one
#     notification out and one back, with no job written and no claim. The engine's
#     wake latency is reported as a ratio to it (issue #25: no millisecond targets).

PING, PONG = "nasiko_bench_ping", "nasiko_bench_pong"


def listen_ping_pong(dsn: str, n: int, rate: float) -> dict[str, Any]:
    """Ceiling L: p50/p95/p99/max of `n` NOTIFY round trips, one every 1/rate s (ms)."""

    async def main() -> dict[str, Any]:
        a, b = await connect(dsn), await connect(dsn)
        try:
            loop = asyncio.get_running_loop()
            answers: asyncio.Queue[float] = asyncio.Queue()
            pending: set[asyncio.Task[Any]] = set()

            def echo(conn: Any, pid: int, channel: str, payload: str) -> None:
                task = loop.create_task(b.execute("SELECT pg_notify($1, $2)", PONG, payload))
                pending.add(task)
                task.add_done_callback(pending.discard)

            def heard(conn: Any, pid: int, channel: str, payload: str) -> None:
                answers.put_nowait(time.perf_counter())

            await b.add_listener(PING, echo)
            await a.add_listener(PONG, heard)
            samples: list[float] = []
            t_next = time.perf_counter()
            for i in range(n):
                await asyncio.sleep(max(0.0, t_next - time.perf_counter()))
                t_next += 1 / rate
                t0 = time.perf_counter()
                await a.execute("SELECT pg_notify($1, $2)", PING, str(i))
                samples.append(await asyncio.wait_for(answers.get(), 10) - t0)
            return _ms_percentiles(samples)
        finally:
            await a.close()
            await b.close()

    return _run(main())


def _ms_percentiles(samples: list[float]) -> dict[str, Any]:
    """As the latency workload reports (nearest rank), in ms."""
    s = sorted(samples)

    def pct(p: float) -> float:
        return s[min(len(s) - 1, round(p / 100 * (len(s) - 1)))] * 1e3

    return {"p50_ms": pct(50), "p95_ms": pct(95), "p99_ms": pct(99), "max_ms": s[-1] * 1e3,
            "n": len(s)}
