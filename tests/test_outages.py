"""
Database outages under real worker processes (SPEC §5: the worker waits and reconnects).

PostgreSQL restarted while workers drain (fast and immediate shutdowns), the
workers' connections killed from the server side with `pg_terminate_backend`,
and the server down when the workers start. The restarts use a server this test
starts for itself (`EmbeddedPostgres`): a shared server is never stopped.

What must hold afterwards: every worker is still alive, every job is done, no job
finished twice (a run cut off by the outage may be retried: that is the
at-least-once case of a crashed executor, and it is counted, not hidden).
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any
from uuid import UUID

import asyncpg
import pytest
import trio

from nasiko_queue import Database, migrate, open_database
from nasiko_queue.db.embedded import EmbeddedPostgres, with_database
from nasiko_queue.errors import is_transient

from .procs import (
    KINDS,
    RunAudit,
    WorkerProcess,
    audit_runs,
    create_executions_table,
    create_targets,
    insert_serde_jobs,
    one_run_per_attempt,
    runs_by_job,
    status_counts,
    unfinished_jobs,
    wait_for_log,
    wait_until,
    worker_processes,
)

#: Appended to the workers' DSN so that the test kills their connections, not its own.
WORKER_APP = "application_name=nq-outage-worker"
#: What a worker logs when the database fails under it.
NOTICED = ("claim failed", "panicked on attempt", "update failed", "cannot connect to",
           "database error at")


@pytest.fixture
def own_server() -> Iterator[EmbeddedPostgres]:
    """A PostgreSQL server of this test's own, which it may stop and start at will."""
    with EmbeddedPostgres() as server:
        yield server


@pytest.fixture
def own_dsn(own_server: EmbeddedPostgres) -> str:
    dsn = with_database(own_server.dsn, "outage")

    async def create() -> None:
        async with open_database(own_server.dsn) as admin:
            await admin.execute("CREATE DATABASE outage")
        async with open_database(dsn) as db:
            await migrate(db)

    trio.run(create)
    return dsn


@asynccontextmanager
async def fresh(dsn: str) -> AsyncIterator[Database]:
    """A new pool: after a restart, the old one may hold connections the server dropped."""
    async with open_database(dsn) as db:
        yield db


async def _load(dsn: str, n: int) -> list[UUID]:
    async with fresh(dsn) as db:
        await create_executions_table(db)
        targets = await create_targets(db, [f"work:{i}" for i in range(n)], KINDS)
        return await insert_serde_jobs(db, targets)


async def _wait_done(db: Database, ids: list[UUID], at_least: int,
                     workers: list[WorkerProcess]) -> None:
    async def progressed() -> bool:
        return (await status_counts(db, ids))["done"] >= at_least

    await wait_until(f"{at_least} jobs to be done", progressed, alive=workers,
                     during_outage=True, explain=lambda: unfinished_jobs(db, ids))


async def _wait_noticed(workers: list[WorkerProcess], offsets: list[int]) -> None:
    """Wait until every worker has logged a database failure after `offsets`."""
    for w, offset in zip(workers, offsets, strict=True):
        async def noticed(w: WorkerProcess = w, offset: int = offset) -> bool:
            return any(marker in w.log_text()[offset:] for marker in NOTICED)

        await wait_until(f"{w.name} to notice the outage", noticed, alive=[w])


async def _check_all_done_once(dsn: str, ids: list[UUID]) -> RunAudit:
    async with fresh(dsn) as db:
        assert await status_counts(db, ids) == {"done": len(ids)}
        runs = await runs_by_job(db)
        audit = audit_runs(runs, ids)
    assert one_run_per_attempt(runs)
    assert audit.never_finished == []
    assert audit.rerun_after_finish == [], "a finished job ran again"
    return audit


async def _stop_workers(workers: list[WorkerProcess]) -> None:
    for w in workers:
        w.signal(signal.SIGTERM)
    assert [await w.wait_exit() for w in workers] == [0] * len(workers)


async def test_an_answered_statement_is_not_failed_by_its_connection_dying_after(
    db: Database, dsn: str
) -> None:
    """
    Engine fix (db/database.py, `Database.run`): the server may drop a connection right
    after answering on it (`pg_terminate_backend`, a shutdown). asyncpg then fails to
    reset it on release (InternalClientError), and `run` used to raise that error in
    place of the answer, so a committed claim was reported as failed and its job sat
    in_progress, run by nobody, until the sweep an hour later. Seen as a job that never
    finished in `test_workers_survive_their_connections_being_killed`; here it is
    provoked directly, 20 times (before the fix, the first few already raised).
    """

    killer: Any = None

    async def answered_then_dropped(conn: Any) -> int:
        nonlocal killer
        killer = killer or await asyncpg.connect(dsn)
        pid: int = await conn.fetchval("SELECT pg_backend_pid()")
        await killer.fetchval("SELECT pg_terminate_backend($1)", pid)
        for _ in range(5000):  # the backend exits within milliseconds
            if not await killer.fetchval(
                    "SELECT count(*) FROM pg_stat_activity WHERE pid = $1", pid):
                return pid  # gone, its FATAL message sent to `conn`, which is idle
            await asyncio.sleep(0.001)
        raise AssertionError(f"backend {pid} outlived pg_terminate_backend")

    async def probe() -> int:
        """The pool does not test a connection on release (no reset round trip, see
        database._keep_session), so the dead one is found by the next use: that use
        fails once with a transient error, and the pool then connects afresh."""
        try:
            return int(await db.fetchval("SELECT 1"))
        except Exception as exc:
            if not is_transient(exc):
                raise
            return int(await db.fetchval("SELECT 1"))

    pids = set()
    try:
        for _ in range(20):
            assert await probe() == 1
            pids.add(await db.run(answered_then_dropped))  # answered, not failed
    finally:
        if killer is not None:
            await db.run(lambda _: killer.close())
    assert len(pids) == 20  # every call answered, each on a fresh connection
    assert await probe() == 1  # and the pool goes on


@pytest.mark.slow
async def test_workers_survive_postgres_restarts_under_load(
    own_server: EmbeddedPostgres, own_dsn: str, tmp_path: Path
) -> None:
    """Three restarts while 3 workers drain 450 jobs: fast shutdowns (clients told
    to go) and an immediate one (a crash: clients cut off, recovery at startup)."""
    n = 450
    ids = await _load(own_dsn, n)
    async with worker_processes(own_dsn, tmp_path) as procs, fresh(own_dsn) as db:
        workers = await procs.start_all(3)
        for mode, progress in (("fast", n // 4), ("immediate", n // 2), ("fast", 3 * n // 4)):
            await _wait_done(db, ids, progress, workers)
            offsets = [len(w.log_text()) for w in workers]
            await trio.to_thread.run_sync(own_server.stop, mode)
            await _wait_noticed(workers, offsets)
            await trio.to_thread.run_sync(own_server.start)
        await _wait_done(db, ids, n, workers)
        await _stop_workers(workers)
    audit = await _check_all_done_once(own_dsn, ids)
    print(f"\nrestarts: {audit.runs} runs for {n} jobs, {audit.interrupted_runs} cut off "
          "by the outages and retried")


@pytest.mark.slow
async def test_workers_survive_their_connections_being_killed(
    dsn: str, tmp_path: Path
) -> None:
    """Three times while 3 workers drain 450 jobs, every connection of theirs is
    killed by the server (`pg_terminate_backend`), on whatever server the run uses."""
    n = 450
    ids = await _load(dsn, n)
    worker_dsn = f"{dsn}?{WORKER_APP}"
    killed = 0
    async with worker_processes(worker_dsn, tmp_path) as procs, fresh(dsn) as db:
        workers = await procs.start_all(3)
        for progress in (n // 4, n // 2, 3 * n // 4):
            # Killed while idle in a pool, a connection is replaced without a word;
            # killed mid-statement, the statement fails (a claim, a final update or
            # the executor's own write) and is retried. Either way the drain goes on.
            await _wait_done(db, ids, progress, workers)
            now = await db.fetchval(
                "SELECT count(*) FROM (SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE datname = current_database() AND application_name = $1) AS t",
                WORKER_APP.split("=")[1])
            assert now >= 1
            killed += now
        await _wait_done(db, ids, n, workers)
        await _stop_workers(workers)
    audit = await _check_all_done_once(dsn, ids)
    print(f"\nterminated: {killed} worker connections; {audit.runs} runs for {n} jobs, "
          f"{audit.interrupted_runs} cut off and retried")


@pytest.mark.slow
async def test_workers_started_while_the_database_is_down_wait_for_it(
    own_server: EmbeddedPostgres, own_dsn: str, tmp_path: Path
) -> None:
    """Two workers started while the server is down keep retrying (one line each time,
    no exit); once it is up they run every job exactly once. A third, stopped with
    SIGTERM while it waits, exits 0 at once."""
    n = 200
    ids = await _load(own_dsn, n)
    await trio.to_thread.run_sync(own_server.stop, "fast")
    async with worker_processes(own_dsn, tmp_path) as procs:
        workers = [await procs.start(f"early{i}") for i in range(2)]
        quitter = await procs.start("quitter")
        for w in [*workers, quitter]:
            await wait_for_log(w, "cannot connect to", count=2)  # waited, tried again
        assert all(w.proc.returncode is None for w in workers)
        quitter.signal(signal.SIGTERM)
        assert await quitter.wait_exit() == 0
        await trio.to_thread.run_sync(own_server.start)
        for w in workers:
            await wait_for_log(w, "worker started")
        async with fresh(own_dsn) as db:
            await _wait_done(db, ids, n, workers)
        await _stop_workers(workers)
    audit = await _check_all_done_once(own_dsn, ids)
    assert audit.runs == n  # nothing was running during the outage: one run each
    for w in workers:
        assert "Traceback" not in w.log_text()
