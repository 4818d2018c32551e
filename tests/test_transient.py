"""
One list of what is transient (issue #9): what can pass by waiting is retried,
by the worker, the sweep and the CLI alike; what never will falls back.

The first tests read the classifier itself (the SQLSTATEs are PostgreSQL's, the
exception classes asyncpg's). The others meet a real `lock_timeout` on a real
server: a lock held by another session is an error that waiting fixes.
"""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import asyncpg
import attrs
import pytest
import trio
from asyncpg import exceptions as pg

from nasiko_queue import Database, DatabaseConfig, Queue, open_database
from nasiko_queue.builds.store import PgJobStore
from nasiko_queue.cli.worker import _unreachable
from nasiko_queue.db.database import join_schema
from nasiko_queue.engine.contracts import MAX_ATTEMPTS_EXCEEDED, RecoveryResult
from nasiko_queue.errors import OutcomeUnknown, is_connection_error, is_transient
from nasiko_queue.testing import KINDS, enqueue_with_target

from .helpers import LogEvent, agent_state, executors_for_all, job_row, running, succeed

TRANSIENT = [
    pg.LockNotAvailableError,                   # 55P03: lock_timeout, NOWAIT
    pg.ObjectInUseError,                        # 55006
    pg.ReadOnlySQLTransactionError,             # 25006: a standby after a fail-over
    pg.IdleInTransactionSessionTimeoutError,    # 25P03
    pg.DeadlockDetectedError,                   # 40P01
    pg.SerializationError,                      # 40001
    pg.TooManyConnectionsError,                 # 53300
    pg.OutOfMemoryError,                        # 53200
    pg.DiskFullError,                           # 53100
    pg.QueryCanceledError,                      # 57014: statement_timeout
    pg.AdminShutdownError,                      # 57P01
    pg.CannotConnectNowError,                   # 57P03
    pg.ConnectionDoesNotExistError,             # 08003
    pg.SnapshotTooOldError,                     # 72000
]
NEVER = [
    pg.RaiseError,                              # P0001: a trigger's RAISE
    pg.UniqueViolationError,                    # 23505
    pg.ForeignKeyViolationError,                # 23503
    pg.CheckViolationError,                     # 23514
    pg.InsufficientPrivilegeError,              # 42501
    pg.UndefinedTableError,                     # 42P01
    pg.TransactionIntegrityConstraintViolationError,  # 40002: a deferred constraint
    pg.DatabaseDroppedError,                    # 57P04
    pg.InvalidPasswordError,                    # 28P01
    pg.InvalidCatalogNameError,                 # 3D000: no such database
]


@pytest.mark.parametrize("error", TRANSIENT, ids=lambda e: f"{e.sqlstate}-{e.__name__}")
def test_errors_that_pass_by_waiting_are_transient(error: type[Exception]) -> None:
    assert is_transient(error("x"))


@pytest.mark.parametrize("error", NEVER, ids=lambda e: f"{e.sqlstate}-{e.__name__}")
def test_errors_on_the_merits_are_not(error: type[Exception]) -> None:
    assert not is_transient(error("x"))


def test_client_side_failures_and_unknown_outcomes_are_transient() -> None:
    for exc in (ConnectionResetError(), TimeoutError(), asyncpg.InterfaceError("closed"),
                OutcomeUnknown("no answer"), ExceptionGroup("g", [TimeoutError(), OSError()])):
        assert is_transient(exc), exc
    assert not is_transient(ValueError("a bug"))
    assert not is_transient(ExceptionGroup("g", [TimeoutError(), pg.RaiseError("x")]))


def test_the_cli_waits_out_the_same_errors_and_reports_a_host_that_does_not_resolve() -> None:
    """The CLI's start-up wait uses the one classifier: a server that has too many
    connections or is read-only is waited for, as the worker would; a wrong password
    or a database that does not exist is reported; so is a host name that does not
    resolve (a typo in the DSN, at start-up)."""
    assert _unreachable(pg.TooManyConnectionsError("x"))
    assert _unreachable(pg.ReadOnlySQLTransactionError("x"))
    assert _unreachable(ConnectionRefusedError())
    assert not _unreachable(pg.InvalidPasswordError("x"))
    assert not _unreachable(pg.InvalidCatalogNameError("x"))
    assert not _unreachable(socket.gaierror(-2, "Name or service not known"))


@asynccontextmanager
async def _locked(dsn: str, table: str, row_id: Any) -> AsyncIterator[None]:
    """Another session holds a row lock (an application's long transaction), on a
    connection that finds the queue's tables as the queue's own do."""
    conn = await asyncpg.connect(dsn)
    await join_schema(conn)
    try:
        tx = conn.transaction()
        await tx.start()
        await conn.execute(f"SELECT 1 FROM {table} WHERE id = $1 FOR UPDATE", row_id)
        try:
            yield
        finally:
            await tx.rollback()
    finally:
        await conn.close()


@asynccontextmanager
async def _with_lock_timeout(dsn: str) -> AsyncIterator[Database]:
    """The application's setting: statements wait 100 ms for a lock, then fail 55P03."""
    sep = "&" if "?" in dsn else "?"
    async with open_database(DatabaseConfig(dsn=f"{dsn}{sep}lock_timeout=100")) as db:
        yield db


async def test_a_lock_timeout_while_failing_a_job_is_waited_out_not_taken_as_a_refusal(
    dsn: str, queue: Queue
) -> None:
    """A job out of attempts must terminalize its agent, which another session has
    locked, under the application's lock_timeout. Each try fails with 55P03; that
    is not a refusal on the merits: after more tries than `terminalize_tries`, the
    job is still not failed alone, and once the lock goes the agent is terminalized."""
    job = await enqueue_with_target(queue, "Upload", prior_success=True)
    await queue.db.execute("UPDATE build_jobs SET attempt = 3 WHERE id = $1", job.job_id)
    async with _with_lock_timeout(dsn) as db:
        timed = Queue(db, config=attrs.evolve(queue.config, terminalize_tries=2),
                      secrets=queue.secrets)
        with LogEvent("LockNotAvailableError") as waits:
            # Locked before the worker starts (its first drain may claim the job at
            # once, and would fail it unhindered), released before the nursery
            # waits for the drain (which ends only once the job could be failed).
            locked = _aio_locked(dsn, "agents", job.target_id)
            await locked.__aenter__()
            held = True
            try:
                async with running(timed, executors_for_all(succeed)) as worker, \
                        trio.open_nursery() as nursery:
                    nursery.start_soon(worker.drain_once)
                    try:
                        while waits.count < 4:  # twice terminalize_tries
                            await waits.event.wait()
                            waits.event = trio.Event()
                        row = await job_row(queue.db, job.job_id)
                        assert row is not None
                        assert row["status"] == "in_progress"  # not failed alone
                    finally:
                        held = False
                        await locked.__aexit__(None, None, None)
            finally:
                if held:
                    await locked.__aexit__(None, None, None)
    row = await job_row(queue.db, job.job_id)
    assert row is not None
    assert (row["status"], row["error_msg"]) == ("failed", MAX_ATTEMPTS_EXCEEDED)
    assert await agent_state(queue.db, job.target_id) == "failed"  # terminalized after all


@asynccontextmanager
async def _aio_locked(dsn: str, table: str, row_id: Any) -> AsyncIterator[None]:
    """`_locked`, driven from trio through the test's trio-asyncio loop."""
    import trio_asyncio

    cm = _locked(dsn, table, row_id)
    await trio_asyncio.aio_as_trio(cm.__aenter__)()
    try:
        yield
    finally:
        with trio.CancelScope(shield=True):
            await trio_asyncio.aio_as_trio(cm.__aexit__)(None, None, None)


async def test_the_sweep_leaves_a_locked_target_for_the_next_sweep_and_fails_the_others(
    dsn: str, queue: Queue
) -> None:
    locked = await enqueue_with_target(queue, "Upload", prior_success=True)
    other = await enqueue_with_target(queue, "Upload", prior_success=True)
    await queue.db.execute("UPDATE build_jobs SET status = 'in_progress', attempt = 3, "
                           "picked_at = now() - interval '2 hours'")
    kinds = frozenset(KINDS)
    async with _with_lock_timeout(dsn) as db:
        store = PgJobStore(db, queue.config, runnable_kinds=kinds, known_kinds=kinds)
        async with _aio_locked(dsn, "agents", locked.target_id):
            assert await store.recover() == RecoveryResult(failed=1, reset=0, skipped=1)
        row = await job_row(queue.db, locked.job_id)
        assert row is not None
        assert row["status"] == "in_progress"            # untouched, not failed alone
        assert await agent_state(queue.db, other.target_id) == "failed"
        assert await store.recover() == RecoveryResult(failed=1, reset=0)
    assert await agent_state(queue.db, locked.target_id) == "failed"


async def test_a_statement_sent_with_the_wrong_arguments_is_a_bug_not_an_outage(
    queue: Queue
) -> None:
    """Code and SQL out of step (a statement given one argument too many, as after
    an upgrade half done) fails the same way on every connection. It used to be
    taken for a lost connection: a bounded statement's error became
    `OutcomeUnknown` (a claim "lost" on every poll), and a final update was retried
    for ever instead of falling back. A connection closed under a statement is
    still an outage."""
    async def too_many(conn: Any) -> Any:
        return await conn.fetchval("SELECT $1::int", 1, 2)

    for generic in (False, True):
        with pytest.raises(asyncpg.InterfaceError) as wrong:
            await queue.db.run_bounded(too_many, bound=30, generic=generic)
        assert not isinstance(wrong.value, OutcomeUnknown)
        assert "expects 1 argument" in str(wrong.value)
        assert not is_transient(wrong.value)
        assert not is_connection_error(wrong.value)

    async def closed_under_it(conn: Any) -> Any:
        await conn.close()
        return await conn.fetchval("SELECT 1")

    with pytest.raises(OutcomeUnknown) as lost:
        await queue.db.run_bounded(closed_under_it, bound=30, generic=True)
    assert is_transient(lost.value.__cause__ or lost.value)
    for exc in (asyncpg.InterfaceError("cannot perform operation: connection is closed"),
                asyncpg.InterfaceError("cannot perform operation: another operation is "
                                       "in progress"),
                asyncpg.ConnectionDoesNotExistError("connection was closed in the middle")):
        assert is_connection_error(exc), exc
        assert is_transient(exc), exc
    for exc in (asyncpg.ClientConfigurationError("bad sslmode"),
                asyncpg.UnsupportedServerFeatureError("no such feature"),
                asyncpg.InterfaceError("unsupported authentication method requested by the "
                                       "server: 'kerberos4'"),
                asyncpg.InterfaceError("gssapi module not found; please install "
                                       "asyncpg[gssauth] to use asyncpg with Kerberos")):
        assert not is_transient(exc), exc
        assert not _unreachable(exc), exc  # the CLI reports it instead of waiting
