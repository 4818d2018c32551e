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
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import asyncpg
import attrs
import trio

from nasiko_queue import Executors, JobContext, Queue, QueueConfig, Upload, open_database
from nasiko_queue._sql import Q
from nasiko_queue.job_args import JobArgs  # -- enqueue (issue #13)
from nasiko_queue.jobs import PgJobStore
from nasiko_queue.payloads import BUILTIN_PAYLOAD_TYPES, PayloadCodec
from nasiko_queue.secrets import SecretBox  # -- enqueue (issue #13)
from nasiko_queue.status import explain_claim
from nasiko_queue.testing import make_payload
from nasiko_queue.worker import Worker

from . import ceilings  # -- enqueue (issue #13)

T = TypeVar("T")
ROOT = Path(__file__).resolve().parent.parent
_CODEC = PayloadCodec()


def _sql(dsn: str, *statements: str) -> None:
    async def main() -> None:
        conn = await asyncpg.connect(dsn)
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


def prepare_agents(dsn: str, n: int) -> list[tuple[uuid.UUID, uuid.UUID, uuid.UUID]]:
    """`n` deploying agents, each with a build row already 'success': (agent, build, owner)."""
    rows = [(uuid.uuid4(), uuid.uuid4(), uuid.uuid4()) for _ in range(n)]

    async def main() -> None:
        conn = await asyncpg.connect(dsn)
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
        conn = await asyncpg.connect(dsn)
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

    async def main() -> tuple[float, int]:
        async with open_database(dsn) as db:
            queue = Queue(db, config=_bench_config(concurrency=concurrency,
                                                    prefetch=prefetch))
            worker = Worker(queue, _noop_executors())
            async with trio.open_nursery() as nursery:
                t0 = time.perf_counter()
                await nursery.start(worker.run)
                await worker.wait_for(lambda s: s.done + s.failed >= n_jobs)
                elapsed = time.perf_counter() - t0
                worker.stop()
            if worker.stats.failed:
                raise RuntimeError(f"drain: {worker.stats.failed} jobs failed")
            return n_jobs / elapsed, worker.stats.statements

    jobs_per_s, statements = trio.run(main)
    return {"concurrency": concurrency, "prefetch": prefetch, "jobs": n_jobs,
            "jobs_per_s": jobs_per_s, "statements": statements}


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

        async def collect(before: dict[uuid.UUID, float]) -> dict[str, Any]:
            # Start times are taken in the executor, so looking every 10 ms
            # here does not change the figures.
            with trio.move_on_after(10):
                while not all(j in started for j in before):  # noqa: ASYNC110
                    await trio.sleep(0.01)
            samples = [started[j] - t for j, t in before.items() if j in started]
            out = _percentiles(samples)
            out["samples_ms"] = [round(x * 1e3, 3) for x in samples]
            return out

        async with open_database(dsn) as db:
            queue = Queue(db, config=_bench_config())
            worker = Worker(queue, ex)
            result: dict[str, Any] = {"jobs": n_jobs, "rate_per_s": rate}
            async with trio.open_nursery() as nursery:
                await nursery.start(worker.run)
                await trio.sleep(0.2)
                before: dict[uuid.UUID, float] = {}
                calls: list[float] = []
                t_next = trio.current_time()
                for p in local:
                    await trio.sleep_until(t_next)
                    t_next += 1 / rate
                    t = time.perf_counter()
                    before[await queue.enqueue(p)] = t
                    calls.append(time.perf_counter() - t)
                result["in_process"] = await collect(before)
                # How much of it is the enqueue call itself (its commit).
                result["in_process"]["enqueue_call_p50_ms"] = statistics.median(calls) * 1e3
                if listen:
                    proc = await trio.run_process(
                        [sys.executable, "-m", "benchmarks.enqueuer", dsn, str(rate)],
                        stdin=remote.encode(), capture_stdout=True, cwd=ROOT, env=_child_env())
                    remote_before = {uuid.UUID(k): v
                                     for k, v in json.loads(proc.stdout).items()}
                    result["other_process"] = await collect(remote_before)
                worker.stop()
            if not listen:
                result["other_process"] = "n/a: needs LISTEN/NOTIFY (QueueConfig has no 'listen')"
            return result

    return trio.run(main)


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
        conn = await asyncpg.connect(dsn)
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
            conn = await asyncpg.connect(dsn)
            try:
                await conn.copy_records_to_table(
                    "build_jobs", columns=["agent_id", "owner_id", "payload"],
                    records=[(a, o, _upload_payload_text(a, b, o)) for a, b, o in rows])
            finally:
                await conn.close()

        plain_asyncio(insert())
        t0 = time.perf_counter()
        left = ("SELECT count(*) FROM build_jobs WHERE status IN ('pending', 'in_progress')")
        while _count(dsn, left) > 0:
            if time.perf_counter() - t0 > 300:
                raise RuntimeError("replicas: jobs not drained in 300 s")
            time.sleep(0.02)  # the workers are other processes: poll, bounded
        elapsed = time.perf_counter() - t0
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
            "jobs_per_s": n_jobs / elapsed}


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
    return [make_payload("Upload", target_id=a, build_id=b, owner_id=o, name=f"b{b.hex[:8]}",
                         env={"API_TOKEN": f"tok-{b.hex}"})
            for a, b, o in prepare_agents(dsn, n)]


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


__all__ = ["Q", "ceiling_prepare", "drain", "enqueue", "history", "latency", "replicas"]
