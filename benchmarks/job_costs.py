"""
Issue #25: what the adaptive look-ahead buys, and what one job costs the server.

- `plain_drain`: one worker drains N plain jobs queued up front, at a
  concurrency, with `prefetch=0` (the former default) or the default ("auto");
  the runner takes both in turn, so that their ratio meets the same noise. Its
  jobs are `BenchPing`s, or `BenchPadded`s as large as the drain's build jobs.
- `job_cost`: a worker at the defaults (but its concurrency) runs jobs while
  they are being enqueued (`enqueue_many` in chunks, from the same process):
  plain, plain with a payload padded to a build job's size ("plain_padded": what
  a build job costs beyond its larger payload is the difference), or build. Per
  job: the WAL written (`pg_current_wal_lsn()` around the run), the CPU of the
  server backends serving the run (user + system from
  `/proc/<pid>/stat` of every backend connected to the bench's database: not
  pg_stat_statements, which needs a preload this server may not have, and which
  leaves out commits and parsing), and where the bytes go: the table's heap and
  each of its indexes (`pg_relation_size` before and after), with its inserts,
  updates and HOT updates (`pg_stat_all_tables`) and its fillfactor.

The WAL figure is the whole server's: run it on the bench's own server (no
`--dsn`), or another workload's writes count too. The backends' CPU needs the
server on this machine (else None).
"""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path
from typing import Any

import asyncpg
import trio

from nasiko_queue import Executors, JobContext, PlainJobContext, Queue, Upload, open_database
from nasiko_queue.builds.payloads import PayloadCodec
from nasiko_queue.engine.worker import Worker

from .plain import BenchPadded, BenchPing
from .workloads import (
    BENCH_SECRETS,
    _bench_config,
    _sql,
    bench_upload,
    drain_payload_bytes,
    enqueue_payloads,
    reset_jobs,
)

#: The job table of each kind.
TABLES = {"plain": "nasiko_queue_jobs", "plain_padded": "nasiko_queue_jobs",
          "build": "build_jobs"}
#: Jobs per `enqueue_many` call of `job_cost`.
CHUNK = 100
#: `prefetch` as the bench names it: 0, or the default (None: "auto" for plain lanes).
SETTINGS = {"p0": 0, "auto": None}

_TICKS = os.sysconf("SC_CLK_TCK")


def _executors(kind: str) -> Executors:
    """A worker of one lane: plain `BenchPing` (or `BenchPadded`) jobs, or build
    `Upload` jobs; each does nothing."""
    ex = Executors()
    if kind == "plain":
        @ex.register(BenchPing)
        async def ping(ctx: PlainJobContext[BenchPing]) -> None:
            return None
    elif kind == "plain_padded":
        @ex.register(BenchPadded)
        async def padded(ctx: PlainJobContext[BenchPadded]) -> None:
            return None
    else:
        @ex.register(Upload)
        async def build(ctx: JobContext[Upload]) -> None:
            return None
    return ex


# -- the drain, before and after ------------------------------------------------


def plain_drain(dsn: str, n_jobs: int, concurrency: int, setting: str,
                kind: str = "plain") -> dict[str, Any]:
    """
    One worker drains `n_jobs` plain jobs queued up front; jobs/s and statements.
    `kind` "plain_padded": each payload as long as a build job's of `workloads.drain`
    (`drain_payload_bytes`), so that the two differ in what a build job does beyond
    carrying its payload.
    """
    if kind not in ("plain", "plain_padded"):
        raise ValueError(f"kind {kind!r}: 'plain' or 'plain_padded'")
    reset_jobs(dsn)
    prefetch = SETTINGS[setting]
    payloads: list[Any] = (padded_payloads(n_jobs, drain_payload_bytes())
                           if kind == "plain_padded"
                           else [BenchPing(n=i) for i in range(n_jobs)])

    async def main() -> dict[str, Any]:
        async with open_database(dsn) as db:
            await Queue(db, config=_bench_config()).enqueue_many(payloads)
            await db.execute("VACUUM ANALYZE nasiko_queue_jobs")
            config = _bench_config(queues={"bench": concurrency}, builds=False,
                                   prefetch=prefetch)
            worker = Worker(Queue(db, config=config), _executors(kind))
            async with trio.open_nursery() as nursery:
                t0, cpu0 = time.perf_counter(), time.process_time()
                await nursery.start(worker.run)
                await worker.wait_for(lambda s: s.done + s.failed >= n_jobs)
                elapsed, cpu = time.perf_counter() - t0, time.process_time() - cpu0
                look = worker.lanes[0].state.look_ahead
                worker.stop()
        if worker.stats.failed:
            raise RuntimeError(f"plain drain: {worker.stats.failed} jobs failed")
        return {"concurrency": concurrency, "prefetch": setting, "jobs": n_jobs,
                "jobs_per_s": n_jobs / elapsed, "statements": worker.stats.statements,
                # The worker's own CPU (this process), as `workloads.drain` gives it.
                "cpu_us_per_job": 1e6 * cpu / n_jobs,
                "jobs_per_statement": n_jobs / max(1, worker.stats.statements),
                "look_ahead": None if look is None else look.size,
                "typical_run_ms": None if look is None or look.typical is None
                else look.typical * 1e3,
                "returned": worker.stats.returned}

    return trio.run(main)


# -- the cost of a job -------------------------------------------------------------

TABLE_STATS = """
SELECT n_tup_ins, n_tup_upd, n_tup_hot_upd, n_tup_del
FROM pg_stat_all_tables WHERE relid = $1::regclass
"""
SIZES = """
SELECT c.relname AS name, pg_relation_size(c.oid) AS bytes
FROM pg_class AS c
WHERE c.oid = $1::regclass
   OR c.oid IN (SELECT indexrelid FROM pg_index WHERE indrelid = $1::regclass)
"""
FILLFACTOR = """
SELECT coalesce((SELECT split_part(o, '=', 2)::int FROM unnest(reloptions) AS o
                 WHERE o LIKE 'fillfactor=%'), 100)
FROM pg_class WHERE oid = $1::regclass
"""
BACKENDS = """
SELECT pid FROM pg_stat_activity WHERE datname = current_database() AND backend_type =
'client backend'
"""


def _backend_cpu(pids: list[int]) -> dict[int, float] | None:
    """User + system CPU seconds of each backend (Linux /proc; None when unreadable:
    the server runs elsewhere)."""
    out: dict[int, float] = {}
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            return None
        out[pid] = (int(fields[11]) + int(fields[12])) / _TICKS
    return out


async def _table_stats(dsn: str, table: str) -> dict[str, Any]:
    """The table's counters (read once they have settled: a backend that just
    closed may still be flushing its own) and its relations' sizes."""
    async with open_database(dsn) as db:

        async def counters(conn: Any) -> dict[str, int]:
            async with conn.transaction():  # one snapshot of the statistics
                await conn.execute("SELECT pg_stat_clear_snapshot()")
                return dict(await conn.fetchrow(TABLE_STATS, table))

        last: dict[str, int] | None = None
        for _ in range(50):
            row = await db.run_kept(counters)
            if row == last:
                break
            last = row
            await trio.sleep(0.2)
        sizes = {r["name"]: r["bytes"] for r in await db.fetch(SIZES, table)}
        return {"counters": last, "sizes": sizes,
                "fillfactor": await db.fetchval(FILLFACTOR, table)}


def _checkpoint(dsn: str) -> bool:
    """
    A CHECKPOINT before the run's preparation, when the role may take one
    (superuser, or `pg_checkpoint`); False when it may not. The first change of a
    page after a checkpoint logs the whole page: one falling between the
    preparation and the run (the server takes one every `max_wal_size` / 1.9 of
    WAL, which the bench's earlier workloads write) logged an image of every
    `agents` page whose rows the build jobs' foreign-key checks then lock, 140 B
    or more per build job. Taken first, the next is minutes or hundreds of MB away.
    """
    try:
        _sql(dsn, "CHECKPOINT")
    except asyncpg.InsufficientPrivilegeError:
        return False
    return True


def padded_payloads(n: int, target: int | None = None) -> list[BenchPadded]:
    """`n` plain payloads whose JSON is `target` characters long; by default as
    long as a build job's of `job_cost` (an `Upload`, its env sealed, as the
    queue writes it)."""
    codec = PayloadCodec(secrets=BENCH_SECRETS)
    if target is None:
        target = len(codec.dumps(bench_upload(uuid.uuid4(), uuid.uuid4(), uuid.uuid4())))
    return [BenchPadded(n=i, pad="x" * max(0, target - len(codec.dumps(BenchPadded(n=i)))))
            for i in range(n)]


def job_cost(dsn: str, kind: str, n_jobs: int, concurrency: int) -> dict[str, Any]:
    """
    A worker at the defaults (but `concurrency`) runs `n_jobs` jobs of `kind`
    ("plain", "plain_padded" or "build") while they are enqueued, `CHUNK` at a
    time; what the server spent on each, and where its bytes went.
    """
    checkpointed = _checkpoint(dsn)
    payloads: list[Any]
    if kind == "build":  # empties the tables, creates the targets
        payloads = enqueue_payloads(dsn, kind, n_jobs)
    elif kind == "plain_padded":
        reset_jobs(dsn)
        payloads = padded_payloads(n_jobs)
    else:
        reset_jobs(dsn)
        payloads = [BenchPing(n=i) for i in range(n_jobs)]
    table = TABLES[kind]
    _sql(dsn, f"VACUUM ANALYZE {table}")

    async def main() -> dict[str, Any]:
        before = await _table_stats(dsn, table)
        async with open_database(dsn) as db:
            config = _bench_config(concurrency=concurrency, builds=kind == "build",
                                   queues={} if kind == "build" else {"bench": concurrency})
            queue = Queue(db, config=config, secrets=BENCH_SECRETS)
            worker = Worker(queue, _executors(kind))
            async with trio.open_nursery() as nursery:
                await nursery.start(worker.run)
                await db.fetchval("SELECT 1")
                pids = [r["pid"] for r in await db.fetch(BACKENDS)]
                cpu0 = _backend_cpu(pids)
                lsn0 = await db.fetchval("SELECT pg_current_wal_lsn()")
                t0 = time.perf_counter()
                for start in range(0, n_jobs, CHUNK):
                    await queue.enqueue_many(payloads[start:start + CHUNK])
                await worker.wait_for(lambda s: s.done + s.failed >= n_jobs)
                elapsed = time.perf_counter() - t0
                wal = await db.fetchval("SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), $1)",
                                        lsn0)
                later = [r["pid"] for r in await db.fetch(BACKENDS)]
                cpu1 = _backend_cpu(later)
                worker.stop()
        if worker.stats.failed:
            raise RuntimeError(f"job cost ({kind}): {worker.stats.failed} jobs failed")
        after = await _table_stats(dsn, table)
        out: dict[str, Any] = {"kind": kind, "jobs": n_jobs, "concurrency": concurrency,
                               "chunk": CHUNK, "jobs_per_s": n_jobs / elapsed,
                               "wal_bytes_per_job": float(wal) / n_jobs,
                               "fillfactor": after["fillfactor"], "checkpoint": checkpointed}
        if cpu0 is not None and cpu1 is not None:
            spent = sum(c - cpu0.get(pid, 0.0) for pid, c in cpu1.items())
            out["server_cpu_us_per_job"] = spent / n_jobs * 1e6
            out["backends"] = len(cpu1)
        else:
            out["server_cpu_us_per_job"] = None
        c0, c1 = before["counters"], after["counters"]
        out["per_job"] = {k: (c1[k] - c0[k]) / n_jobs for k in c1}
        updates = c1["n_tup_upd"] - c0["n_tup_upd"]
        out["hot_share"] = (c1["n_tup_hot_upd"] - c0["n_tup_hot_upd"]) / updates \
            if updates else None
        out["bytes_per_job"] = {name: (size - before["sizes"].get(name, 0)) / n_jobs
                                for name, size in after["sizes"].items()}
        return out

    return trio.run(main)

