"""
The engine workloads: drain, enqueue, latency, history, replicas.

Each is a plain function taking a DSN (of a migrated database it may empty) and
returning JSON-ready figures. Setup (bulk rows) goes through bare asyncpg on
`asyncio.run`; the engine runs inside its own `trio.run`.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any, ClassVar, TypeVar
from urllib.parse import urlsplit

import attrs
import trio

from nasiko_queue import (
    Database,
    Executors,
    JobContext,
    PlainJobContext,
    Queue,
    QueueConfig,
    Upload,
    open_database,
)
from nasiko_queue.admin.status import explain_claim
from nasiko_queue.builds.payloads import BUILTIN_PAYLOAD_TYPES, PayloadCodec
from nasiko_queue.builds.store import PgJobStore
from nasiko_queue.db.embedded import with_database
from nasiko_queue.db.migrate import migrate
from nasiko_queue.db.statements import Q
from nasiko_queue.engine.worker import Worker
from nasiko_queue.plain.args import JobArgs
from nasiko_queue.plain.store import PlainJobStore
from nasiko_queue.secrets import SecretBox  # -- enqueue (issue #13)
from nasiko_queue.testing import make_payload

from . import ceilings  # -- enqueue (issue #13)
from .connect import connect
from .plain import BENCH_QUEUE, BenchPing

T = TypeVar("T")
ROOT = Path(__file__).resolve().parent.parent
_CODEC = PayloadCodec()


def _sql(dsn: str, *statements: str) -> None:
    async def main() -> None:
        conn = await connect(dsn)
        try:
            for s in statements:
                await conn.execute(s)
        finally:
            await conn.close()

    plain_asyncio(main())


def plain_asyncio(coro: Coroutine[Any, Any, T]) -> T:
    """
    Run `coro` on a plain asyncio selector loop.

    Not `asyncio.run`: once trio_asyncio is imported, its event-loop policy
    makes `asyncio.run` drive a trio-asyncio loop, which is exactly the overhead
    the ceilings must not include.
    """
    with asyncio.Runner(loop_factory=asyncio.SelectorEventLoop) as runner:
        return runner.run(coro)


def reset(dsn: str) -> None:
    """Empty the queue's tables (the bench owns this database)."""
    _sql(dsn, "TRUNCATE build_jobs, agent_builds, agents, mcp_connector_builds, mcp_connectors",
         "VACUUM ANALYZE build_jobs")


def _upload_payload_text(agent_id: uuid.UUID, build_id: uuid.UUID, owner: uuid.UUID) -> str:
    p = make_payload("Upload", target_id=agent_id, build_id=build_id, owner_id=owner,
                     name=f"b{build_id.hex[:8]}")
    return json.dumps(_CODEC.encode(p), separators=(",", ":"))


def drain_payload_bytes() -> int:
    """The length of a build job's JSON payload as `prepare_jobs` writes it (all
    alike: fixed-width ids and name), for a plain job padded to match."""
    return len(_upload_payload_text(uuid.uuid4(), uuid.uuid4(), uuid.uuid4()))


def prepare_agents(dsn: str, n: int) -> list[tuple[uuid.UUID, uuid.UUID, uuid.UUID]]:
    """`n` deploying agents, each with a build row already 'success': (agent, build, owner)."""
    rows = [(uuid.uuid4(), uuid.uuid4(), uuid.uuid4()) for _ in range(n)]

    async def main() -> None:
        conn = await connect(dsn)
        try:
            await conn.copy_records_to_table(
                "agents", columns=["id", "owner_id", "name", "status"],
                records=[(a, o, f"bench-{a.hex}", "deploying") for a, _, o in rows])
            await conn.copy_records_to_table(
                "agent_builds", columns=["id", "agent_id", "version_tag", "image_reference",
                                         "status"],
                records=[(b, a, "v1", "img", "success") for a, b, _ in rows])
        finally:
            await conn.close()

    plain_asyncio(main())
    return rows


def prepare_jobs(dsn: str, n: int) -> None:
    """`n` pending Upload jobs whose build rows already say 'success'."""
    rows = prepare_agents(dsn, n)

    async def main() -> None:
        conn = await connect(dsn)
        try:
            await conn.copy_records_to_table(
                "build_jobs", columns=["agent_id", "owner_id", "payload"],
                records=[(a, o, _upload_payload_text(a, b, o)) for a, b, o in rows])
            await conn.execute("ANALYZE build_jobs")
        finally:
            await conn.close()

    plain_asyncio(main())


def _noop_executors() -> Executors:
    ex = Executors()

    @ex.register(Upload)
    async def noop(ctx: JobContext[Upload]) -> None:
        return None

    return ex


def _bench_config(**kw: Any) -> QueueConfig:
    return QueueConfig(recovery_interval=3600.0, **kw)


# -- 1. drain -----------------------------------------------------------------


def drain(dsn: str, n_jobs: int, concurrency: int, prefetch: int = 0) -> dict[str, Any]:
    """One in-process worker drains `n_jobs` prepared jobs; jobs/s."""
    reset(dsn)
    prepare_jobs(dsn, n_jobs)

    async def main() -> tuple[float, int, float]:
        async with open_database(dsn) as db:
            queue = Queue(db, config=_bench_config(concurrency=concurrency,
                                                    prefetch=prefetch))
            worker = Worker(queue, _noop_executors())
            async with trio.open_nursery() as nursery:
                t0, cpu0 = time.perf_counter(), time.process_time()
                await nursery.start(worker.run)
                await worker.wait_for(lambda s: s.done + s.failed >= n_jobs)
                elapsed, cpu = time.perf_counter() - t0, time.process_time() - cpu0
                worker.stop()
            if worker.stats.failed:
                raise RuntimeError(f"drain: {worker.stats.failed} jobs failed")
            return n_jobs / elapsed, worker.stats.statements, cpu

    jobs_per_s, statements, cpu = trio.run(main)
    # The worker's own CPU per job (this process, every thread: user + system),
    # the figure issue #13 sets a target for; the server's is not in it.
    return {"concurrency": concurrency, "prefetch": prefetch, "jobs": n_jobs,
            "jobs_per_s": jobs_per_s, "statements": statements,
            "cpu_us_per_job": 1e6 * cpu / n_jobs}


# -- 2. enqueue ---------------------------------------------------------------


def enqueue(dsn: str, n_jobs: int) -> dict[str, Any]:
    """`Queue.enqueue` one job per call (own transaction), and n jobs in one transaction."""
    reset(dsn)
    [(agent, build, owner)] = prepare_agents(dsn, 1)
    payload = make_payload("Upload", target_id=agent, build_id=build, owner_id=owner)

    async def main() -> dict[str, Any]:
        async with open_database(dsn) as db:
            queue = Queue(db, config=_bench_config())
            t0 = time.perf_counter()
            for _ in range(n_jobs):
                await queue.enqueue(payload)
            single = n_jobs / (time.perf_counter() - t0)
            t0 = time.perf_counter()
            async with db.transaction() as tx:
                for _ in range(n_jobs):
                    await queue.enqueue(payload, tx=tx)
            batch = n_jobs / (time.perf_counter() - t0)
        return {"jobs": n_jobs, "single_jobs_per_s": single, "batch_jobs_per_s": batch}

    return trio.run(main)


# -- 3. latency ---------------------------------------------------------------


def _percentiles(samples: list[float]) -> dict[str, float]:
    s = sorted(samples)

    def pct(p: float) -> float:
        return s[min(len(s) - 1, round(p / 100 * (len(s) - 1)))]

    return {"p50_ms": pct(50) * 1e3, "p95_ms": pct(95) * 1e3, "p99_ms": pct(99) * 1e3,
            "max_ms": s[-1] * 1e3, "n": len(s)}


def has_listen() -> bool:
    return "listen" in attrs.fields_dict(QueueConfig)


def latency(dsn: str, n_jobs: int, rate: float) -> dict[str, Any]:
    """
    An idle worker (concurrency 1, default 5 s poll); jobs enqueued every 1/rate s.
    Measures executor start - just before the enqueue call, for an enqueuer in
    the worker's process (same Queue: in-process wake) and, when the engine has
    LISTEN/NOTIFY, for an enqueuer in another process (`benchmarks.enqueuer`).
    Each also has `after_commit`: start - the instant the enqueue call returned
    (issue #13's figure); and `plain_other_process` is the cross-process run
    for plain jobs.
    """
    reset(dsn)
    targets = prepare_agents(dsn, 2 * n_jobs)
    local = [make_payload("Upload", target_id=a, build_id=b, owner_id=o)
             for a, b, o in targets[:n_jobs]]
    remote = json.dumps([[str(a), str(b), str(o)] for a, b, o in targets[n_jobs:]])
    listen = has_listen()

    async def main() -> dict[str, Any]:
        started: dict[uuid.UUID, float] = {}
        ex = Executors()

        @ex.register(Upload)
        async def record(ctx: JobContext[Upload]) -> None:
            started[ctx.job_id] = time.perf_counter()

        async def collect(before: dict[uuid.UUID, float],
                          returned: dict[uuid.UUID, float] | None = None) -> dict[str, Any]:
            # Start times are taken in the executor, so looking every 10 ms
            # here does not change the figures.
            with trio.move_on_after(10):
                while not all(j in started for j in before):  # noqa: ASYNC110
                    await trio.sleep(0.01)
            samples = [started[j] - t for j, t in before.items() if j in started]
            out = _percentiles(samples)
            out["samples_ms"] = [round(x * 1e3, 3) for x in samples]
            if returned is not None:
                out["after_commit"] = _after_commit(started, returned)
            return out

        async with open_database(dsn) as db:
            queue = Queue(db, config=_bench_config())
            worker = Worker(queue, ex)
            result: dict[str, Any] = {"jobs": n_jobs, "rate_per_s": rate}
            async with trio.open_nursery() as nursery:
                await nursery.start(worker.run)
                await trio.sleep(0.2)
                before: dict[uuid.UUID, float] = {}
                returned: dict[uuid.UUID, float] = {}
                calls: list[float] = []
                t_next = trio.current_time()
                for p in local:
                    await trio.sleep_until(t_next)
                    t_next += 1 / rate
                    t = time.perf_counter()
                    job = await queue.enqueue(p)
                    before[job], returned[job] = t, time.perf_counter()
                    calls.append(returned[job] - t)
                result["in_process"] = await collect(before, returned)
                # How much of it is the enqueue call itself (its commit).
                result["in_process"]["enqueue_call_p50_ms"] = statistics.median(calls) * 1e3
                if listen:
                    proc = await trio.run_process(
                        [sys.executable, "-m", "benchmarks.enqueuer", dsn, str(rate)],
                        stdin=remote.encode(), capture_stdout=True, cwd=ROOT, env=_child_env())
                    result["other_process"] = await collect(*_enqueue_times(proc.stdout))
                worker.stop()
            if listen:
                result["plain_other_process"] = await _plain_latency(
                    dsn, n_jobs, rate, started, collect)
            if not listen:
                result["other_process"] = "n/a: needs LISTEN/NOTIFY (QueueConfig has no 'listen')"
            return result

    return trio.run(main)


# -- latency / claim flat / replicas (issue #13) --------------------------------


def _after_commit(started: dict[uuid.UUID, float],
                  returned: dict[uuid.UUID, float]) -> dict[str, float]:
    """
    Executor start minus the instant the enqueue call returned (its commit
    done): the wake path alone, without the enqueue's own cost. May be negative
    across processes: the listener can hear the NOTIFY before the enqueuing
    process is scheduled again to see its commit's answer.
    """
    return _percentiles([started[j] - t for j, t in returned.items() if j in started])


def _enqueue_times(stdout: bytes) -> tuple[dict[uuid.UUID, float], dict[uuid.UUID, float]]:
    """`benchmarks.enqueuer`'s output: (before the call, after it returned) by job."""
    times = {uuid.UUID(k): v for k, v in json.loads(stdout).items()}
    return ({j: t[0] for j, t in times.items()}, {j: t[1] for j, t in times.items()})


async def _plain_latency(dsn: str, n_jobs: int, rate: float, started: dict[uuid.UUID, float],
                         collect: Callable[..., Awaitable[dict[str, Any]]]) -> dict[str, Any]:
    """
    The cross-process run for plain jobs: an idle worker that runs only the
    queue of `BenchPing` (one lane, concurrency 1, the 5 s poll), and the
    enqueuer in another process enqueueing `n_jobs` of them at `rate`/s.
    """
    ex = Executors()

    @ex.register(BenchPing)
    async def record(ctx: PlainJobContext[BenchPing]) -> None:
        started[ctx.job_id] = time.perf_counter()

    async with open_database(dsn) as db:
        worker = Worker(Queue(db, config=_bench_config()), ex)
        async with trio.open_nursery() as nursery:
            await nursery.start(worker.run)
            await trio.sleep(0.2)
            proc = await trio.run_process(
                [sys.executable, "-m", "benchmarks.enqueuer", dsn, str(rate), "plain"],
                stdin=json.dumps([[]] * n_jobs).encode(), capture_stdout=True, cwd=ROOT,
                env=_child_env())
            out = await collect(*_enqueue_times(proc.stdout))
            worker.stop()
    return out


# -- claim flat (issue #13) ------------------------------------------------------
#
# The claim's cost must not follow what the table holds besides the jobs it
# takes: finished history, other kinds' or queues' backlogs, jobs scheduled for
# later. Each case is measured on a table holding only the claimable jobs
# ("empty"), then again once the rest is bulk-inserted, in the same run.

#: Claimable jobs in every state of the claim-flat workload.
FLAT_CLAIMABLE = 1000

#: Pending build jobs of a kind the some-kinds replica does not run (Rollback),
#: older than the claimable ones.
OTHER_KIND_SQL = """
INSERT INTO build_jobs (agent_id, owner_id, payload, created_at)
SELECT (SELECT id FROM agents ORDER BY id LIMIT 1), gen_random_uuid(),
       '{"kind":"Rollback"}'::jsonb, now() - interval '1 day' - make_interval(secs => g)
FROM generate_series(1, {n}) AS g
"""

#: Claimable plain jobs in queue 'bench', due.
PLAIN_CLAIMABLE_SQL = """
INSERT INTO nasiko_queue_jobs (id, queue, kind, payload, max_attempts, run_at)
SELECT gen_random_uuid(), 'bench', 'bench_ping', '{"n":0}'::jsonb, 20,
       now() - interval '1 minute' + make_interval(secs => g / 1000.0)
FROM generate_series(1, {n}) AS g
"""

#: Finished plain jobs of queue 'bench' (one in ten discarded).
PLAIN_HISTORY_SQL = """
INSERT INTO nasiko_queue_jobs (id, queue, kind, payload, state, attempt, max_attempts,
                               run_at, created_at, attempted_at, finished_at, error_msg)
SELECT gen_random_uuid(), 'bench', 'bench_ping', '{"n":0}'::jsonb,
       CASE WHEN g % 10 = 0 THEN 'discarded' ELSE 'completed' END, 1, 20,
       now() - make_interval(secs => g), now() - make_interval(secs => g),
       now() - make_interval(secs => g), now() - make_interval(secs => g),
       CASE WHEN g % 10 = 0 THEN 'max attempts exceeded' END
FROM generate_series(1, {n}) AS g
"""

#: Available plain jobs of another queue, due (and older than the claimable ones).
PLAIN_OTHER_QUEUE_SQL = """
INSERT INTO nasiko_queue_jobs (id, queue, kind, payload, max_attempts, run_at)
SELECT gen_random_uuid(), 'other', 'bench_ping', '{"n":0}'::jsonb, 20,
       now() - interval '1 day' - make_interval(secs => g)
FROM generate_series(1, {n}) AS g
"""

#: Plain jobs of queue 'bench' scheduled for later, at priority {priority}.
PLAIN_FUTURE_SQL = """
INSERT INTO nasiko_queue_jobs (id, queue, kind, payload, priority, max_attempts, run_at)
SELECT gen_random_uuid(), 'bench', 'bench_ping', '{"n":0}'::jsonb, {priority}, 20,
       now() + interval '1 day' + make_interval(secs => g)
FROM generate_series(1, {n}) AS g
"""


def _sql_literal(value: object) -> str:
    """A parameter as an SQL literal, for ``EXECUTE name(...)`` (arrays, uuids, ints, NULL)."""
    if value is None:
        return "NULL"
    if isinstance(value, (list, tuple)):
        inner = ",".join('"' + str(v).replace('"', '\\"') + '"' for v in value)
        return "'{" + inner + "}'"
    if isinstance(value, int):
        return str(value)
    return "'" + str(value).replace("'", "''") + "'"


def _plan_summary(plan: dict[str, Any], table: str) -> str:
    """The scans of `table` in a JSON plan, in order, each once: how the claim finds rows."""
    seen: list[str] = []

    def walk(node: dict[str, Any]) -> None:
        if node.get("Relation Name") == table:
            using = f" using {node['Index Name']}" if node.get("Index Name") else ""
            label = f"{node['Node Type']}{using}"
            if label not in seen:
                seen.append(label)
        for child in node.get("Plans", ()):
            walk(child)

    walk(plan)
    return "; ".join(seen) or f"no scan of {table}"


async def _explain_generic(dsn: str, sql: str, args: tuple[object, ...],
                           table: str) -> dict[str, Any]:
    """
    EXPLAIN (ANALYZE, BUFFERS) of the claim as the engine runs it: a prepared
    statement on its generic plan (`ENGINE_SERVER_SETTINGS`), inside a
    transaction that is rolled back. The buffers are the noise-free figure:
    pages the claim touched, whatever the machine is doing.
    """
    conn = await connect(dsn, server_settings={"plan_cache_mode": "force_generic_plan"})
    plans: list[dict[str, Any]] = []
    try:
        await conn.execute("PREPARE flat_claim AS\n" + sql)
        call = "EXECUTE flat_claim(" + ", ".join(_sql_literal(a) for a in args) + ")"
        for _ in range(3):  # warm: the last of three
            tx = conn.transaction()
            await tx.start()
            try:
                text = await conn.fetchval("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + call)
                plans.append(json.loads(text)[0])
            finally:
                await tx.rollback()
    finally:
        await conn.close()
    last = plans[-1]
    root = last["Plan"]
    return {"plan_node": _plan_summary(root, table),
            "buffers": root.get("Shared Hit Blocks", 0) + root.get("Shared Read Blocks", 0),
            "server_ms": last.get("Execution Time", 0.0)}


def _flat_claim(lane: str) -> tuple[str, tuple[object, ...], str, frozenset[str]]:
    """The statement a lane claims with, its arguments, its table, the runnable kinds."""
    kinds = frozenset(t.kind for t in BUILTIN_PAYLOAD_TYPES)
    bound = QueueConfig().max_payload_bytes
    if lane == "plain":
        return (Q.plain_claim, (BENCH_QUEUE, 1, uuid.uuid4(), None, bound, [], []),
                "nasiko_queue_jobs", kinds)
    runnable = kinds if lane == "all kinds" else frozenset({"Upload"})
    sql = Q.job_claim if lane == "all kinds" else Q.job_claim_kinds
    return (sql, (1, sorted(runnable), sorted(kinds), bound, uuid.uuid4(), None),
            "build_jobs", runnable)


def _flat_pair(empty_dsn: str, loaded_dsn: str, lane: str, claims: int) -> dict[str, Any]:
    """
    `claims` claims of one job on each of two databases, interleaved in rounds
    of ten, through the engine's own store (each followed by a reset, not
    timed): one whose tables hold only the claimable jobs, and one that holds
    the rest too. Lanes: "all kinds" (`job_claim`), "some kinds"
    (`job_claim_kinds`: a replica that runs Upload only) or "plain"
    (`plain_claim` of queue 'bench'). p50/p99 of each, their ratio, and each
    one's plan and buffers.
    """
    kinds = frozenset(t.kind for t in BUILTIN_PAYLOAD_TYPES)
    config = _bench_config()
    sql, args, table, runnable = _flat_claim(lane)

    def store_of(db: Database) -> PgJobStore | PlainJobStore:
        if lane == "plain":
            return PlainJobStore(db, config, BENCH_QUEUE, lambda: None)
        return PgJobStore(db, config, runnable_kinds=runnable, known_kinds=kinds)

    async def main() -> tuple[list[float], list[float]]:
        async with open_database(empty_dsn) as empty_db, open_database(loaded_dsn) as loaded_db:
            stores = (store_of(empty_db), store_of(loaded_db))
            samples: tuple[list[float], list[float]] = ([], [])
            for _ in range(-(-claims // 10)):
                for store, into in zip(stores, samples, strict=True):
                    for _ in range(10):
                        t0 = time.perf_counter()
                        jobs = await store.claim(1)
                        into.append(time.perf_counter() - t0)
                        if len(jobs) != 1:
                            raise RuntimeError(f"claim flat ({lane}): the claim found no job")
                        await store.reset(jobs[0])
            return samples

    empty, loaded = trio.run(main)
    out: dict[str, Any] = {"lane": lane, "empty": _percentiles(empty),
                           "loaded": _percentiles(loaded)}
    for which, dsn in (("empty", empty_dsn), ("loaded", loaded_dsn)):
        out[which].update(plain_asyncio(_explain_generic(dsn, sql, args, table)))
    out["p50_vs_empty"] = out["loaded"]["p50_ms"] / out["empty"]["p50_ms"]
    out["p99_vs_empty"] = out["loaded"]["p99_ms"] / out["empty"]["p99_ms"]
    out["buffers_vs_empty"] = out["loaded"]["buffers"] / max(1, out["empty"]["buffers"])
    return out


def _fill_claimable(dsn: str) -> None:
    reset(dsn)
    prepare_jobs(dsn, FLAT_CLAIMABLE)
    _sql(dsn, "TRUNCATE nasiko_queue_jobs", PLAIN_CLAIMABLE_SQL.replace("{n}", str(FLAT_CLAIMABLE)),
         "VACUUM ANALYZE build_jobs", "VACUUM ANALYZE nasiko_queue_jobs")


def _sibling_database(dsn: str, suffix: str) -> str:
    """A migrated database beside `dsn`'s on the same server (needs CREATEDB, as the bench)."""
    name = _count_text(dsn, "SELECT current_database()") + suffix

    async def create() -> None:
        conn = await connect(dsn)
        try:
            await conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
            await conn.execute(f'CREATE DATABASE "{name}"')
        finally:
            await conn.close()

    plain_asyncio(create())
    sibling = with_database(dsn, name)

    async def do_migrate() -> None:
        async with open_database(sibling) as db:
            await migrate(db)

    trio.run(do_migrate)
    return sibling


def _drop_database(dsn: str, other: str) -> None:
    name = urlsplit(other).path.lstrip("/")
    _sql(dsn, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def _count_text(dsn: str, query: str) -> str:
    async def main() -> str:
        conn = await connect(dsn)
        try:
            value: str = await conn.fetchval(query)
            return value
        finally:
            await conn.close()

    return plain_asyncio(main())


def claim_flat(dsn: str, history_rows: int, other_rows: int, claims: int) -> dict[str, Any]:
    """
    The claim on tables holding only claimable jobs (a sibling database, the
    "empty" side) against tables that also hold `history_rows` finished jobs and
    `other_rows` jobs the claim must leave alone (this database), interleaved,
    for each lane of a worker:

    * build jobs, a replica running every kind (`job_claim`): the history;
    * build jobs, a replica running Upload only (`job_claim_kinds`): the
      history and `other_rows` pending Rollback jobs, older than its own;
    * plain jobs of queue 'bench' (`plain_claim`): the history, `other_rows`
      available jobs of queue 'other' (older) and `other_rows` jobs of 'bench'
      scheduled for tomorrow at the same priority; then as many again at a
      more urgent priority.

    Rows go in with ``INSERT … SELECT generate_series``, then VACUUM ANALYZE.
    """
    empty = _sibling_database(dsn, "_flat_empty")
    try:
        _fill_claimable(empty)
        _fill_claimable(dsn)
        n, other = str(int(history_rows)), str(int(other_rows))
        _sql(dsn, HISTORY_SQL.replace("{n}", n), "VACUUM ANALYZE build_jobs")
        cases = [dict(_flat_pair(empty, dsn, "all kinds", claims),
                      table=f"{history_rows:,} history")]
        _sql(dsn, OTHER_KIND_SQL.replace("{n}", other), "VACUUM ANALYZE build_jobs")
        cases.append(dict(_flat_pair(empty, dsn, "some kinds", claims),
                          table=f"{history_rows:,} history + {other_rows:,} pending of "
                                "another kind"))
        _sql(dsn, PLAIN_HISTORY_SQL.replace("{n}", n),
             PLAIN_OTHER_QUEUE_SQL.replace("{n}", other),
             PLAIN_FUTURE_SQL.replace("{n}", other).replace("{priority}", "0"),
             "VACUUM ANALYZE nasiko_queue_jobs")
        cases.append(dict(_flat_pair(empty, dsn, "plain", claims),
                          table=f"{history_rows:,} history + {other_rows:,} in another queue "
                                f"+ {other_rows:,} scheduled later"))
        _sql(dsn, PLAIN_FUTURE_SQL.replace("{n}", other).replace("{priority}", "-1"),
             "VACUUM ANALYZE nasiko_queue_jobs")
        cases.append(dict(_flat_pair(empty, dsn, "plain", claims),
                          table=f"… + {other_rows:,} more scheduled later, at a more urgent "
                                "priority"))
    finally:
        _drop_database(dsn, empty)
        reset(dsn)
        _sql(dsn, "TRUNCATE nasiko_queue_jobs")
    return {"history_rows": history_rows, "other_rows": other_rows, "claims": claims,
            "cases": cases}


# -- replicas (issue #13) ---------------------------------------------------------


async def _wait_drained(dsn: str, t0: float) -> None:
    """
    Until no job is pending or in progress, looking every 20 ms on one
    connection: a new connection per look (a server process forked and
    authenticated 50 times a second) took CPU from the very processes measured.
    """
    conn = await connect(dsn)
    try:
        while await conn.fetchval(
                "SELECT count(*) FROM build_jobs WHERE status IN ('pending', 'in_progress')"):
            if time.perf_counter() - t0 > 300:
                raise RuntimeError("replicas: jobs not drained in 300 s")
            await asyncio.sleep(0.02)  # the workers are other processes: poll, bounded
    finally:
        await conn.close()


_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _cpu_seconds(pids: list[int] | None) -> float | None:
    """User + system CPU seconds of `pids` so far (Linux /proc); None if unreadable."""
    if pids is None:
        return None
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # a process that ended meanwhile
        total += int(fields[11]) + int(fields[12])
    return total / _TICKS


def _server_pids(dsn: str) -> list[int] | None:
    """
    The server's processes (the postmaster and its children: backends, WAL
    writer, autovacuum), when it runs on this machine and we may read its data
    directory's postmaster.pid (the embedded server of `nasiko-queue bench`);
    else None.
    """
    try:
        data = Path(_count_text(dsn, "SHOW data_directory"))
        postmaster = int((data / "postmaster.pid").read_text().split()[0])
        pids = [postmaster]
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == postmaster:
                    pids.append(int(stat.parent.name))
            except (OSError, ValueError, IndexError):
                continue
        return pids
    except Exception:
        return None


def _cpu_report(before: tuple[list[float | None], float | None],
                after: tuple[list[float | None], float | None], server: list[int] | None,
                n_jobs: int, elapsed: float) -> dict[str, Any]:
    """
    CPU of each worker process and of the server during the drain, as µs per
    job and as cores: whether the processes or the server are the limit.
    """
    workers = [None if a is None or b is None else b - a
               for a, b in zip(before[0], after[0], strict=True)]
    out: dict[str, Any] = {"worker_cpu_s": workers}
    if all(w is not None for w in workers):
        total = sum(w for w in workers if w is not None)
        out["worker_us_per_job"] = total / n_jobs * 1e6
        out["worker_cores"] = total / elapsed
    if server is not None and before[1] is not None and after[1] is not None:
        out["server_cpu_s"] = after[1] - before[1]
        out["server_us_per_job"] = out["server_cpu_s"] / n_jobs * 1e6
        out["server_cores"] = out["server_cpu_s"] / elapsed
    return out


def _child_env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))


# -- 4. history ---------------------------------------------------------------

HISTORY_SQL = """
INSERT INTO build_jobs (agent_id, owner_id, payload, status, attempt, created_at, picked_at,
                        completed_at, error_msg)
SELECT (SELECT id FROM agents ORDER BY id LIMIT 1), gen_random_uuid(), '{"kind":"Upload"}'::jsonb,
       CASE WHEN g % 10 = 0 THEN 'failed' ELSE 'done' END, 1,
       now() - make_interval(secs => g), now() - make_interval(secs => g),
       now() - make_interval(secs => g),
       CASE WHEN g % 10 = 0 THEN 'max attempts exceeded' END
FROM generate_series(1, {n}) AS g
"""


def history(dsn: str, history_rows: int, claims: int, pending: int = 1000) -> dict[str, Any]:
    """Claim latency (claim(1), then reset) with `history_rows` done/failed rows; and the plan."""
    reset(dsn)
    prepare_jobs(dsn, pending)
    if history_rows:
        _sql(dsn, HISTORY_SQL.replace("{n}", str(int(history_rows))))
    _sql(dsn, "VACUUM ANALYZE build_jobs")

    async def main() -> dict[str, Any]:
        async with open_database(dsn) as db:
            config = _bench_config()
            kinds = frozenset(t.kind for t in BUILTIN_PAYLOAD_TYPES)
            store = PgJobStore(db, config, runnable_kinds=frozenset({"Upload"}),
                               known_kinds=kinds)
            samples: list[float] = []
            for _ in range(claims):
                t0 = time.perf_counter()
                jobs = await store.claim(1)
                samples.append(time.perf_counter() - t0)
                if len(jobs) != 1:
                    raise RuntimeError("history: the claim found no pending job")
                await store.reset(jobs[0])
            plan = await explain_claim(db)
        out = _percentiles(samples)
        out.update(history_rows=history_rows, plan_node=plan.node,
                   uses_work_queue_index=plan.uses_work_queue_index,
                   claims_per_s=claims / sum(samples))
        return out

    return trio.run(main)


# -- 5. replicas --------------------------------------------------------------


def _count(dsn: str, query: str) -> int:
    async def main() -> int:
        conn = await connect(dsn)
        try:
            value: int = await conn.fetchval(query)
            return value
        finally:
            await conn.close()

    return plain_asyncio(main())


def replicas(dsn: str, n_jobs: int, processes: int, concurrency: int) -> dict[str, Any]:
    """
    `processes` worker processes (``python -m nasiko_queue worker``), started on an
    empty queue; once all are connected, `n_jobs` are inserted in one COPY and the
    clock runs until none is pending or in progress. Workers find them by their
    poll (0.05 s), so no process has an advantage from an in-process wake.
    """
    reset(dsn)
    env = _child_env()
    cmd = [sys.executable, "-m", "nasiko_queue", "worker", "--dsn", dsn,
           "--executors", "benchmarks.executors:executors",
           "--concurrency", str(concurrency), "--poll-interval", "0.05",
           "--log-level", "WARNING"]
    procs = [subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE) for _ in range(processes)]
    try:
        deadline = time.monotonic() + 60
        who = ("SELECT count(DISTINCT client_port) FROM pg_stat_activity "
               "WHERE datname = current_database() AND pid <> pg_backend_pid()")
        while _count(dsn, who) < processes:
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                errs = [p.stderr.read().decode()[-800:] if p.poll() is not None and p.stderr
                        else "" for p in procs]
                raise RuntimeError(f"replicas: workers did not start: {errs}")
            time.sleep(0.1)  # another process: poll the database, bounded by the deadline
        rows = prepare_agents(dsn, n_jobs)

        async def insert() -> None:
            conn = await connect(dsn)
            try:
                await conn.copy_records_to_table(
                    "build_jobs", columns=["agent_id", "owner_id", "payload"],
                    records=[(a, o, _upload_payload_text(a, b, o)) for a, b, o in rows])
            finally:
                await conn.close()

        server = _server_pids(dsn)
        cpu_before = [_cpu_seconds([p.pid]) for p in procs], _cpu_seconds(server)
        plain_asyncio(insert())
        t0 = time.perf_counter()
        plain_asyncio(_wait_drained(dsn, t0))
        elapsed = time.perf_counter() - t0
        # Server processes forked during the drain count too (their CPU is all its).
        later = _server_pids(dsn)
        if server is not None and later is not None:
            server = sorted(set(server) | set(later))
        cpu_after = [_cpu_seconds([p.pid]) for p in procs], _cpu_seconds(server)
        done = _count(dsn, "SELECT count(*) FROM build_jobs WHERE status = 'done'")
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    if done != n_jobs:
        raise RuntimeError(f"replicas: {done} of {n_jobs} jobs done")
    return {"processes": processes, "concurrency": concurrency, "jobs": n_jobs,
            "jobs_per_s": n_jobs / elapsed,
            **_cpu_report(cpu_before, cpu_after, server, n_jobs, elapsed)}


def ceiling_prepare(dsn: str, n_jobs: int) -> None:
    reset(dsn)
    prepare_jobs(dsn, n_jobs)


def median(values: list[float]) -> float:
    return statistics.median(values)


# -- enqueue (issue #13) ----------------------------------------------------------------
#
# Enqueue against bare asyncpg (ceilings e1 and e2): one job per call, and
# `enqueue_many`, for build jobs (an `Upload` with one sealed env value, each with
# its own agent and owner, so every seal derives a key: the worst case for the key
# cache) and plain jobs (a small `JobArgs` without secrets). Each measurement
# starts from empty tables; the ceilings insert rows of the same shape and size,
# encoded by the engine's codec before their clock starts.

#: The bench's own master key (its rows are thrown away).
BENCH_SECRETS = SecretBox(b"\x07" * 32)


@attrs.frozen(kw_only=True)
class BenchMail(JobArgs):
    """The plain job of the enqueue workloads: three short strings."""

    kind: ClassVar[str] = "bench_mail"
    to: str
    subject: str
    body: str


def reset_jobs(dsn: str) -> None:
    """`reset`, and the plain jobs' table too."""
    reset(dsn)
    _sql(dsn, "TRUNCATE nasiko_queue_jobs", "VACUUM ANALYZE nasiko_queue_jobs")


def enqueue_payloads(dsn: str, kind: str, n: int) -> list[Any]:
    """Empty tables, then `n` payloads of `kind` ("build" or "plain"), targets created."""
    reset_jobs(dsn)
    if kind == "plain":
        return [BenchMail(to=f"user{i}@example.org", subject=f"Your build {i} is ready",
                          body="It went well. " * 4) for i in range(n)]
    return [bench_upload(a, b, o) for a, b, o in prepare_agents(dsn, n)]


def bench_upload(agent: uuid.UUID, build: uuid.UUID, owner: uuid.UUID) -> Any:
    """The build payload of the enqueue and job-cost workloads: an `Upload` with one secret."""
    return make_payload("Upload", target_id=agent, build_id=build, owner_id=owner,
                        name=f"b{build.hex[:8]}", env={"API_TOKEN": f"tok-{build.hex}"})


def _bench_queue(db: Any) -> Queue:
    return Queue(db, config=_bench_config(), secrets=BENCH_SECRETS)


def enqueue_rows(kind: str, payloads: list[Any]) -> list[tuple[Any, ...]]:
    """The arguments the engine's single-row INSERT + NOTIFY gets for each payload."""
    codec = PayloadCodec(secrets=BENCH_SECRETS)
    channel = QueueConfig().notify_channel
    if kind == "plain":
        opts = BenchMail.options
        return [(uuid.uuid4(), opts.queue, p.kind, codec.dumps(p), opts.priority,
                  opts.max_attempts, None, 0.0, None, None, channel) for p in payloads]
    return [(p.agent_id, None, p.owner_id, codec.dumps(p), channel) for p in payloads]


def ceiling_e2(dsn: str, kind: str, payloads: list[Any]) -> dict[str, float]:
    """Ceiling e2 for `kind`: the rows in one bare multi-row INSERT, and by COPY."""
    rows = enqueue_rows(kind, payloads)
    channel = rows[0][-1]
    ids = [uuid.uuid4() for _ in rows]
    if kind == "plain":
        columns = (ids, *([r[i] for r in rows] for i in range(1, 8)), channel)
        return ceilings.enqueue_bulk(
            dsn, Q.plain_insert_many_notify, columns, "nasiko_queue_jobs",
            ["id", "queue", "kind", "payload", "priority", "max_attempts"],
            [(i, *r[1:6]) for i, r in zip(ids, rows, strict=True)])
    columns = (ids, *([r[i] for r in rows] for i in range(4)), channel)
    return ceilings.enqueue_bulk(
        dsn, Q.jobs_insert_many_notify, columns, "build_jobs",
        ["id", "agent_id", "owner_id", "payload"],
        [(i, r[0], r[2], r[3]) for i, r in zip(ids, rows, strict=True)])


def enqueue_one_per_call(dsn: str, kind: str, n: int, blocks: int) -> dict[str, float]:
    """
    `Queue.enqueue(payload)` for `n` payloads, each its own transaction, against
    ceiling e1 (a bare loop of the engine's INSERT + NOTIFY on `n` rows of the
    same shape), interleaved: `blocks` blocks of each in turn, so that both meet
    the same noise of a shared machine. jobs/s of each over all its blocks, and
    the median of the blocks' ratios.
    """
    payloads = enqueue_payloads(dsn, kind, 2 * n)
    rows = enqueue_rows(kind, payloads[:n])
    statement = Q.plain_insert_notify if kind == "plain" else Q.job_insert_notify
    size = -(-n // blocks)

    async def engine(block: list[Any]) -> float:
        async with open_database(dsn) as db:
            queue = _bench_queue(db)
            # Connect before the clock starts, as the ceiling does.
            await db.run_kept(lambda conn: conn.fetchval("SELECT 1"))
            t0 = time.perf_counter()
            for p in block:
                await queue.enqueue(p)
            return time.perf_counter() - t0

    bare_s: list[float] = []
    engine_s: list[float] = []
    for start in range(0, n, size):
        block = rows[start:start + size]
        bare_s.append(len(block) / ceilings.enqueue_loop(dsn, statement, block))
        engine_s.append(trio.run(engine, payloads[n + start:n + start + size]))
    # A burst of noise hits one block of one side: the median of the pairs' ratios
    # (each pair run back to back) is the figure it moves least.
    return {"bare_jobs_per_s": n / sum(bare_s), "engine_jobs_per_s": n / sum(engine_s),
            "ratio": statistics.median(b / e for b, e in zip(bare_s, engine_s, strict=True))}


def enqueue_many_pair(dsn: str, kind: str, n: int, engine_first: bool) -> dict[str, Any]:
    """
    One `Queue.enqueue_many` of `n` payloads, and ceiling e2 on the same `n`
    targets, one right after the other (`engine_first` says which goes first),
    each into an empty job table.
    """
    payloads = enqueue_payloads(dsn, kind, n)
    table = "nasiko_queue_jobs" if kind == "plain" else "build_jobs"

    async def main() -> float:
        async with open_database(dsn) as db:
            queue = _bench_queue(db)
            await db.run_kept(lambda conn: conn.fetchval("SELECT 1"))
            await db.fetchval("SELECT 1")
            t0 = time.perf_counter()
            ids = await queue.enqueue_many(payloads)
            elapsed = time.perf_counter() - t0
            if len(ids) != n:
                raise RuntimeError(f"enqueue_many returned {len(ids)} ids for {n} jobs")
            return n / elapsed

    out: dict[str, Any] = {}
    for which in ("engine", "bare") if engine_first else ("bare", "engine"):
        _sql(dsn, f"TRUNCATE {table}")
        if which == "engine":
            out["engine_jobs_per_s"] = trio.run(main)
        else:
            out["bare"] = ceiling_e2(dsn, kind, payloads)
    return out


__all__ = ["Q", "ceiling_prepare", "claim_flat", "drain", "enqueue", "history", "latency",
           "replicas"]


# -- folded build-row writes (issue #13) ----------------------------------------
#
# A real executor writes its build row twice: 'building' at the start, 'success'
# at the end. Here the worker drains jobs whose build rows start 'queued', with an
# executor that makes both writes through its context (`ctx.mark_building()`,
# `ctx.report_success()`: folded into the worker's own statements), or the old way
# (two `ctx.db.execute` writes of its own), or none (the no-op drain, beside them
# in the same run, for the ratio).

#: The executors of `drain_build_row`, by mode; the `_10ms` ones spend 10 ms on
#: the build between the two writes (a trio sleep), so that the start write goes
#: out before the report instead of being superseded by it.
BUILD_ROW_MODES = ("noop", "folded", "direct", "noop_10ms", "folded_10ms")


def _prepare_queued_jobs(dsn: str, n: int) -> None:
    """`n` pending Upload jobs whose agents are deploying and build rows 'queued'."""
    rows = [(uuid.uuid4(), uuid.uuid4(), uuid.uuid4()) for _ in range(n)]

    async def main() -> None:
        conn = await connect(dsn)
        try:
            await conn.copy_records_to_table(
                "agents", columns=["id", "owner_id", "name", "status"],
                records=[(a, o, f"bench-{a.hex}", "deploying") for a, _, o in rows])
            await conn.copy_records_to_table(
                "agent_builds", columns=["id", "agent_id", "version_tag", "image_reference",
                                         "status"],
                records=[(b, a, "v1", "img", "queued") for a, b, _ in rows])
            await conn.copy_records_to_table(
                "build_jobs", columns=["agent_id", "owner_id", "payload"],
                records=[(a, o, _upload_payload_text(a, b, o)) for a, b, o in rows])
            await conn.execute("ANALYZE agent_builds, build_jobs")
        finally:
            await conn.close()

    plain_asyncio(main())


def _build_row_executors(mode: str) -> Executors:
    ex = Executors()

    @ex.register(Upload)
    async def build(ctx: JobContext[Upload]) -> None:
        if mode.endswith("_10ms"):
            if mode == "folded_10ms":
                ctx.mark_building()
            await trio.sleep(0.01)
            if mode == "folded_10ms":
                ctx.report_success()
        elif mode == "folded":
            ctx.mark_building()
            # The build's work, however short: the start write may go out meanwhile.
            await trio.lowlevel.checkpoint()
            ctx.report_success()
        elif mode == "direct":
            await ctx.db.execute(Q.agent_build_set_status, ctx.payload.build_id, "building")
            await ctx.db.execute(Q.agent_build_set_status, ctx.payload.build_id, "success")

    return ex


def drain_build_row(dsn: str, n_jobs: int, concurrency: int, mode: str) -> dict[str, Any]:
    """
    One in-process worker (default settings but `concurrency`) drains `n_jobs` jobs
    whose executor writes its build row as `mode` says (`BUILD_ROW_MODES`); jobs/s.
    The no-op modes prepare the rows 'success' already, as the plain drain does.
    """
    if mode not in BUILD_ROW_MODES:
        raise ValueError(f"mode {mode!r}: one of {BUILD_ROW_MODES}")
    reset(dsn)
    if mode.startswith("noop"):
        prepare_jobs(dsn, n_jobs)
    else:
        _prepare_queued_jobs(dsn, n_jobs)

    async def main() -> dict[str, Any]:
        async with open_database(dsn) as db:
            queue = Queue(db, config=_bench_config(concurrency=concurrency))
            worker = Worker(queue, _build_row_executors(mode))
            async with trio.open_nursery() as nursery:
                t0 = time.perf_counter()
                await nursery.start(worker.run)
                await worker.wait_for(lambda s: s.done + s.failed >= n_jobs)
                elapsed = time.perf_counter() - t0
                worker.stop()
            built = await db.fetchval(
                "SELECT count(*) FROM agent_builds WHERE status = 'success'")
        if worker.stats.failed or built != n_jobs:
            raise RuntimeError(f"drain ({mode}): {worker.stats.failed} jobs failed, "
                               f"{built} of {n_jobs} build rows say success")
        return {"mode": mode, "concurrency": concurrency, "jobs": n_jobs,
                "jobs_per_s": n_jobs / elapsed, "statements": worker.stats.statements,
                "start_writes": worker.stats.marked_building}

    return trio.run(main)


__all__ += ["BUILD_ROW_MODES", "drain_build_row"]
