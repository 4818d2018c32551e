"""
The database layer: asyncpg, on the asyncio side of a trio-asyncio loop.

asyncpg speaks asyncio only; trio-asyncio runs an asyncio loop inside trio. Every
crossing of that bridge costs a new asyncio Task and about 90 µs, and a cleanup
that crosses it inside an already-cancelled trio scope never runs (see
shared/reference/trio-asyncpg-notes.md §1: a cancelled `aio_as_trio(conn.transaction())`
leaves the server in an aborted transaction; a cancelled `aio_as_trio(pool.acquire())`
leaks the connection). So this module follows two rules:

* **One crossing per operation.** `Database.run(op)` hands a whole asyncio
  coroutine (acquire, statements, transaction, release) to the loop at once.
  Cancelling the trio caller cancels that one asyncio task, and asyncio's own
  `async with` blocks roll back and release on the way out.
* **Shielded, bounded cleanup** for the one thing that must live on the trio side,
  `Database.transaction()` (the caller's transaction that `enqueue` joins): its
  commit, rollback and release run under `CancelScope(shield=True)` with a timeout.

A bound set on the trio side alone is not a bound: cancelling a trio-asyncio
call cancels its asyncio task and then *waits for it*, and asyncpg answers a
cancellation by asking the server to cancel the statement and waiting for that.
So the worker's own statements go through `Database.run_bounded`, which runs the
operation as an asyncio task of its own, stops waiting for it after `timeout`
whatever the task is doing, and bounds the task itself with asyncpg's timeouts.
When the statement had gone out, the caller gets `OutcomeUnknown`, naming the
server process that received it.

The pool connects lazily (min_size 0), so a worker can start while the server is
down and simply fail operations until it is back; asyncpg replaces connections
that died. Nothing here retries a statement: the callers decide (the worker
retries final updates with backoff; a claim that fails waits for the next wake).
The one exception is a transaction's BEGIN sent on a pooled connection the
server had closed: nothing has run, so it begins again on another (`_begin`).
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from contextlib import asynccontextmanager, suppress
from typing import Any, TypeVar
from urllib.parse import urlsplit

import asyncpg
import attrs
import trio

from ..errors import CannotConnect, NotMigrated, OutcomeUnknown, is_connection_error, leaves
from .bridge import trio_asyncio
from .connections import ConnectionSet
from .schema import SCHEMA
from .statements import Q

log = logging.getLogger("nasiko_queue.database")

#: An undefined relation that is the queue's (its tables, or the build jobs' it creates).
_QUEUE_TABLE = re.compile(r'relation "(?:\w+\.)?(nasiko_queue_\w+|build_jobs|agents|agent_builds|'
                          r'mcp_connectors|mcp_connector_builds)" does not exist')

T = TypeVar("T")

#: Errors that say the connection, not the statement, failed. Since the pool's
#: release does no round trip (`_keep_session`), a connection that raised one of
#: these is terminated rather than returned.
_BROKEN_CONNECTION = (OSError, asyncpg.InterfaceError, asyncpg.InternalClientError,
                      asyncpg.PostgresConnectionError)

#: Errors that say a connection was found closed when a statement was sent on it
#: (not that a statement timed out, or a connect failed): the server closed it while
#: it sat in the pool. asyncpg raises ConnectionDoesNotExistError for a loss seen
#: mid-statement, AdminShutdownError for the server's FATAL notice, InterfaceError
#: once its proxy was released on the loss, InternalClientError for a notice read
#: while idle; the OS the others.
_FOUND_CLOSED = (asyncpg.ConnectionDoesNotExistError, asyncpg.AdminShutdownError,
                 asyncpg.InterfaceError, asyncpg.InternalClientError, ConnectionResetError,
                 BrokenPipeError)

#: An operation run on the asyncio side with one pooled connection.
Operation = Callable[[asyncpg.Connection], Awaitable[T]]

#: Session settings of the queue's own connections (`Database.fetch_generic`).
#: PostgreSQL plans a prepared statement anew on each run (a "custom plan")
#: unless a generic plan looks as cheap; for the claim it never does, because it
#: guesses `LIMIT $1` at a tenth of the table, so every claim paid about 0.7 ms
#: of planning. The claim statements are written so their generic plans are the
#: custom ones (primary-key probes, the partial index), and the queue's
#: connections keep them.
#:
#: A generic plan is made at a statement's first run on a connection and kept,
#: so one made while the queue was empty (a new table, a quiet night: the
#: planner then believes the table holds no rows) would scan the whole backlog
#: on every claim until an ANALYZE replaced it: 4 ms per claim with 3,000 jobs,
#: growing with the backlog (issue #13). The statements run here are written
#: for their indexes, so sequential scans and sorts are priced out: their
#: plans read the indexes whatever the table held when they were made. (They
#: are discouraged, not forbidden: the few rows a claim gathers still sort.)
#:
#: And no JIT compilation: a generic plan's estimates follow the table (its
#: guess of a tenth of the rows for `LIMIT $1`), so on a big enough backlog the
#: claim's estimated cost passes `jit_above_cost` and the server compiles it,
#: 20 ms per claim for statements that run in 0.1 ms (measured, issue #13).
ENGINE_SERVER_SETTINGS = {"plan_cache_mode": "force_generic_plan", "jit": "off",
                          "enable_seqscan": "off", "enable_sort": "off"}

#: Seconds one of the queue's own connections (`ConnectionSet`: the engine's, the
#: enqueues') may sit idle and still be used (asyncpg's pool closes its idle
#: connections after as long, by default).
KEPT_IDLE_LIFETIME = 300.0

#: Connections of the control pool (heartbeats), opened lazily: one per worker
#: on the database object is plenty for a statement every few seconds.
CONTROL_CONNECTIONS = 2


@attrs.frozen(kw_only=True)
class DatabaseConfig:
    """How to reach PostgreSQL and how patient to be with it."""

    #: libpq-style DSN: ``postgresql://user@host:5432/db`` (asyncpg passes unknown
    #: query parameters, such as ``search_path``, to the server as settings).
    dsn: str = attrs.field(repr=False)
    #: Largest number of pooled connections (the LISTEN connection of a later
    #: release is separate).
    max_connections: int = 10
    #: Seconds a single statement may run; also bounds every shielded cleanup.
    command_timeout: float = 60.0
    #: Seconds to open a connection before the operation fails.
    connect_timeout: float = 10.0
    #: Seconds a shielded cleanup (commit, rollback, release, close) may take.
    cleanup_timeout: float = 5.0
    #: Connections of the queue's own small pool, beside the main one: the
    #: worker's claims and finishes run there with generic plans kept
    #: (`ENGINE_SERVER_SETTINGS`), so that your executors' statements on
    #: `ctx.db` keep PostgreSQL's usual planning. One per worker on the database
    #: object is enough; more workers share them.
    engine_connections: int = 2
    # -- enqueue (issue #13) --
    #: Connections kept open beside the pools for the queue's own one-statement
    #: writes (`Queue.enqueue` and `enqueue_many` of up to 2,000 jobs, without
    #: `tx`; a larger batch holds a pooled transaction). A statement on one
    #: of them is one asyncio task; through the pool it is four more (acquire and
    #: release run under timeouts and a shield of their own), which took about
    #: half of an enqueue's time under trio-asyncio. More enqueues at once than
    #: this take pooled connections; 0 sends every one through the pool.
    enqueue_connections: int = 2


class Transaction:
    """
    A transaction on one connection, driven from trio code.

    Each statement crosses the bridge once. Obtain one from
    `Database.transaction()`; `enqueue(..., tx=tx)` joins it, and wakes the
    worker only after it commits.
    """

    def __init__(self, db: Database, conn: asyncpg.Connection) -> None:
        self._db = db
        self._conn = conn
        self._after_commit: list[Callable[[], None]] = []
        #: NOTIFY channels already signalled in this transaction (one per transaction).
        self._notified: set[str] = set()

    async def execute(self, query: str, *args: Any) -> str:
        result: str = await self._db._cross(self._conn.execute(query, *args))
        return result

    async def fetch(self, query: str, *args: Any) -> list[asyncpg.Record]:
        rows: list[asyncpg.Record] = await self._db._cross(self._conn.fetch(query, *args))
        return rows

    async def fetchrow(self, query: str, *args: Any) -> asyncpg.Record | None:
        return await self._db._cross(self._conn.fetchrow(query, *args))

    async def fetchval(self, query: str, *args: Any) -> Any:
        return await self._db._cross(self._conn.fetchval(query, *args))

    def call_after_commit(self, callback: Callable[[], None]) -> None:
        """Run `callback` (synchronous, must not block) once the commit succeeded."""
        self._after_commit.append(callback)


class Listening:
    """A LISTEN connection in use (`Database.listen`)."""

    def __init__(self, db: Database, conn: asyncpg.Connection, lost: trio.Event) -> None:
        self._db = db
        self._conn = conn
        #: Set when the connection terminates.
        self.lost = lost

    async def check(self, bound: float) -> bool:
        """
        Whether the connection answers a trivial query within `bound` seconds.

        A connection whose peer vanished without a reset (a NAT that forgot it,
        a machine powered off, a frozen network) raises nothing and delivers
        nothing, for as long as the kernel's TCP timeouts allow: hours. Only a
        question shows it; this asks one, bounded on both sides of the bridge.
        """
        conn = self._conn
        task = self._db._loop.create_task(conn.fetchval("SELECT 1", timeout=bound))
        answered = trio.Event()
        task.add_done_callback(lambda _task: answered.set())
        with trio.move_on_after(bound):
            await answered.wait()
        if not task.done():
            task.add_done_callback(_drop_late_result)
            return False
        return not task.cancelled() and task.exception() is None


class Database:
    """
    A pool of asyncpg connections and the trio-asyncio loop they live on.

    Create it with `open_database()`. All methods are trio-side and safe to call
    from any task in the loop's scope.
    """

    def __init__(self, loop: Any, pool: asyncpg.Pool, engine_pool: ConnectionSet,
                 control_pool: asyncpg.Pool, config: DatabaseConfig) -> None:
        self._loop = loop
        self._pool = pool
        self._engine_pool = engine_pool
        self._control_pool = control_pool
        self.config = config
        #: Connections kept for the queue's own writes (`run_kept`).
        self._kept = ConnectionSet(config.dsn, config.enqueue_connections,
                                   idle_lifetime=KEPT_IDLE_LIFETIME, init=join_schema,
                                   command_timeout=config.command_timeout)

    async def _cross(self, coro: Coroutine[Any, Any, T]) -> T:
        """
        Run one asyncio coroutine on our loop; the single bridge crossing, so also
        where the two mistakes everyone makes first get a message that says what to
        do (same exception types, so handling and retries are unchanged): a server
        that refuses the connection (`CannotConnect`, naming the host and port) and
        a database that was never migrated (`NotMigrated`).
        """
        try:
            return await self._loop.run_aio_coroutine(coro)  # type: ignore[no-any-return]
        except ConnectionRefusedError as exc:
            if isinstance(exc, CannotConnect):
                raise
            raise CannotConnect(f"cannot connect to PostgreSQL at {self._where()}: connection "
                                "refused (is the server running there, and is the DSN "
                                "right?)", exc.errno) from exc
        except asyncpg.UndefinedTableError as exc:
            if isinstance(exc, NotMigrated) or not _QUEUE_TABLE.search(str(exc)):
                raise
            raise NotMigrated(f"{exc}: this database has not been migrated for nasiko-queue; "
                              "run `nasiko-queue migrate --dsn ...` (or `await nq.migrate(db)`)"
                              ) from exc

    def _where(self) -> str:
        """HOST:PORT of the DSN (never its password)."""
        parts = urlsplit(self.config.dsn)
        try:
            port = parts.port or 5432
        except ValueError:
            port = 5432
        return f"{parts.hostname or 'localhost'}:{port}"

    async def run(self, op: Operation[T]) -> T:
        """Run `op(conn)` with a pooled connection, in one crossing."""
        return await self._run_on(self._pool, op)

    async def fetch_generic(self, query: str, *args: Any) -> list[asyncpg.Record]:
        """
        `fetch` on the queue's own connections, where a prepared statement keeps
        one generic plan instead of being planned on every run. Only for the
        queue's hot statements, whose generic plans are checked to be good
        (`tests/test_database.py`); never for application SQL.
        """
        engine = self._engine_pool

        async def on_asyncio() -> list[asyncpg.Record]:
            conn = await engine.acquire(self.config.connect_timeout)
            broken = True
            try:
                rows: list[asyncpg.Record] = await conn.fetch(
                    query, *args, timeout=self.config.command_timeout)
                broken = False
                return rows
            except asyncpg.PostgresError as exc:
                broken = isinstance(exc, asyncpg.PostgresConnectionError)
                raise
            finally:
                engine.release(conn, broken=broken)

        return await self._cross(on_asyncio())

    async def _run_on(self, pool: asyncpg.Pool, op: Operation[T]) -> T:
        return await self._cross(self._pooled(pool, op))

    async def _pooled(self, pool: asyncpg.Pool, op: Operation[T], *,
                      patience: float | None = None, flight: _Flight | None = None) -> T:
        """
        `op(conn)` with a connection of `pool`, on the asyncio side, waiting
        `patience` seconds for one (default `connect_timeout`); with `flight`, as
        one of `run_bounded`'s operations (sent only if the trio side still waits).
        """
        conn = await pool.acquire(
            timeout=self.config.connect_timeout if patience is None else patience)
        try:
            if flight is not None:
                if flight.abandoned:  # the trio side gave up while we waited
                    raise _Abandoned()
                flight.backend_pid = conn.get_server_pid()
            return await op(conn)
        except _BROKEN_CONNECTION:
            # The connection itself failed (dropped, or left in a state asyncpg
            # cannot continue from): never hand it out again.
            _discard(conn)
            raise
        finally:
            await self._release_after_use(pool, conn)

    # -- enqueue (issue #13) --------------------------------------------------------

    async def run_kept(self, op: Operation[T]) -> T:
        """
        Run `op(conn)` in one crossing on a connection kept for the queue's own
        writes (`DatabaseConfig.enqueue_connections`), or a pooled one when every
        kept connection is busy.

        For statements that leave nothing open behind them: autocommit
        statements, or a transaction that `op` begins and ends itself (a kept
        connection left in one is closed). As with a pooled connection, one that
        failed as a connection is closed; and a statement cancelled (by the
        caller's cancel scope, or `command_timeout`) is settled before the call
        returns: asyncpg asks the server to cancel it, and the connection serves
        again only once the server answered (bounded by `cleanup_timeout`, else
        it is closed). So the caller's next step sees the cancelled statement
        either done or undone, as the pool's release made it.
        """

        kept = self._kept

        async def on_asyncio() -> T:
            conn = await kept.try_acquire(self.config.connect_timeout)
            if conn is None:
                return await self._pooled(self._pool, op)
            try:
                result = await op(conn)
            except _BROKEN_CONNECTION:
                kept.release(conn, broken=True)
                raise
            except (asyncio.CancelledError, TimeoutError):
                await self._settle_kept(conn)
                raise
            except BaseException:
                kept.release(conn)
                raise
            kept.release(conn)
            return result

        return await self._cross(on_asyncio())

    async def _settle_kept(self, conn: asyncpg.Connection) -> None:
        """Wait until the server answered a cancelled statement (asyncpg's next
        statement waits for that first), then keep the connection; else close it."""
        try:
            await conn.fetchval("SELECT 1", timeout=self.config.cleanup_timeout)
        except BaseException:
            self._kept.release(conn, broken=True)
            raise
        self._kept.release(conn)

    async def run_bounded(self, op: Operation[T], *, bound: float,
                          generic: bool = False, control: bool = False) -> T:
        """
        Run `op(conn)` with a pooled connection, waiting for it `bound` seconds at most.

        For the worker's own statements, which run shielded from cancellation and
        must not hold a stopping worker for longer than they are allowed. The
        operation runs as an asyncio task of its own: at the bound the trio side
        stops waiting, whatever the task is doing (a cancelled trio-asyncio call
        would wait for its task, and asyncpg for the server's answer to the
        cancellation), and the task ends on its own later, bounded by asyncpg's
        timeouts, its result dropped. `op` should pass `timeout=bound` to its
        statements, except on the engine's connections (`generic`): there an
        abandoned operation's connection is closed, which ends it at once, and a
        statement timeout would only add a timer per statement. A task abandoned
        before it sent anything never sends it.

        Args:
            generic: run on the queue's own pool, where statements keep generic
                plans (see `fetch_generic`).
            control: run on the control pool, whose connections serve only the
                workers' heartbeats: however busy the other pools, a heartbeat
                never waits for a connection behind the work.

        Raises:
            OutcomeUnknown: the operation had sent its statement and no answer
                came in time, or its connection broke before the answer; what
                it did is unknown. Carries the server process's pid.
        """
        flight = _Flight()
        if generic:
            engine = self._engine_pool

            async def on_asyncio() -> T:
                conn = await engine.acquire(min(bound, self.config.connect_timeout))
                broken = True  # unless the statement answered, or failed by itself
                try:
                    if flight.abandoned:  # the trio side gave up while we waited
                        broken = False
                        raise _Abandoned()
                    flight.backend_pid = conn.get_server_pid()
                    flight.conn = conn
                    result = await op(conn)
                    broken = False
                    return result
                except asyncpg.PostgresError as exc:
                    broken = isinstance(exc, asyncpg.PostgresConnectionError)
                    raise
                finally:
                    engine.release(conn, broken=broken)
        else:
            pool = self._control_pool if control else self._pool

            async def on_asyncio() -> T:
                return await self._pooled(pool, op, flight=flight,
                                          patience=min(bound, self.config.connect_timeout))

        task = self._loop.create_task(on_asyncio())
        answered = trio.Event()
        task.add_done_callback(lambda _task: answered.set())
        try:
            with trio.move_on_after(bound):
                await answered.wait()
        finally:
            if not task.done():
                flight.abandoned = True
                task.add_done_callback(_drop_late_result)
                if flight.conn is not None:
                    # The engine's connections carry no statement timeout (each is a
                    # timer callback, a scheduler pass under trio-asyncio): closing
                    # the socket is what ends the abandoned task's wait instead.
                    flight.conn.terminate()
        if not task.done():
            if flight.backend_pid is None:
                raise TimeoutError(f"no connection within {bound}s")
            raise OutcomeUnknown(f"no answer within {bound}s",
                                 backend_pid=flight.backend_pid)
        if task.cancelled():  # the loop is closing under us
            raise OutcomeUnknown("the operation was cancelled on the asyncio side",
                                 backend_pid=flight.backend_pid)
        exc = task.exception()
        if exc is None:
            return task.result()  # type: ignore[no-any-return]
        if flight.backend_pid is not None and _maybe_sent(exc):
            raise OutcomeUnknown(f"connection failed before the answer ({type(exc).__name__})",
                                 backend_pid=flight.backend_pid) from exc
        raise exc

    async def _release_after_use(self, pool: asyncpg.Pool, conn: asyncpg.Connection) -> None:
        """
        Return `conn` to the pool (asyncio side); a failure here undoes nothing.

        By now the operation's statements were answered, or its own error is on its
        way up. When the server drops the connection just after answering (a
        `pg_terminate_backend`, a shutdown), asyncpg's reset on release fails and it
        terminates the connection itself; raising that error would report a
        committed claim as failed, and the claimed job would sit in_progress with no
        one running it until the stuck-job sweep.
        """
        try:
            await pool.release(conn, timeout=self.config.cleanup_timeout)
        except Exception as exc:
            log.warning("a connection could not be returned to the pool (%s: %s); dropped",
                        type(exc).__name__, exc)

    async def run_in_transaction(self, op: Operation[T]) -> T:
        """Run `op(conn)` inside one transaction, in one crossing."""

        async def in_tx(conn: asyncpg.Connection) -> T:
            async with conn.transaction():
                return await op(conn)

        return await self.run(in_tx)

    async def execute(self, query: str, *args: Any) -> str:
        return await self.run(lambda conn: conn.execute(query, *args))

    async def fetch(self, query: str, *args: Any) -> list[asyncpg.Record]:
        return await self.run(lambda conn: conn.fetch(query, *args))

    async def fetchrow(self, query: str, *args: Any) -> asyncpg.Record | None:
        return await self.run(lambda conn: conn.fetchrow(query, *args))

    async def fetchval(self, query: str, *args: Any) -> Any:
        return await self.run(lambda conn: conn.fetchval(query, *args))

    @asynccontextmanager
    async def transaction(self) -> AsyncIterator[Transaction]:
        """
        A transaction held open across trio code (for the caller's own writes).

        Committed when the block exits normally, rolled back when it raises or is
        cancelled. Commit, rollback and the connection's return to the pool are
        shielded from cancellation and bounded by `cleanup_timeout`; a connection
        whose rollback did not finish is closed rather than returned. A BEGIN that
        finds its pooled connection closed by the server begins again on another
        (`_begin`).
        """
        conn, aio_tx = await self._begin()
        # Reused only when we know its state: committed, or rolled back cleanly.
        # A COMMIT interrupted half-way leaves asyncpg and the server disagreeing
        # about the transaction; such a connection is closed.
        reusable = False
        try:
            tx = Transaction(self, conn)
            try:
                yield tx
            except BaseException:
                reusable = await self._cleanup(aio_tx.rollback(), "rollback")
                raise
            # A commit must not be torn in half by a cancellation: either it is
            # sent and answered, or the bounded shield gives up and we discard
            # the connection (the server then rolls back on disconnect).
            with trio.CancelScope(shield=True):
                with trio.move_on_after(self.config.command_timeout) as scope:
                    await self._cross(aio_tx.commit())
                if scope.cancelled_caught:
                    raise TimeoutError("COMMIT did not complete in time; outcome unknown")
            reusable = True
            for callback in tx._after_commit:
                callback()
        finally:
            if not reusable:
                _discard(conn)
            await self._cleanup(self._pool.release(conn), "release")

    async def _begin(self) -> tuple[asyncpg.Connection, Any]:
        """
        A pooled connection and its transaction, begun.

        A connection the server closed while it sat in the pool (a restart,
        `pg_terminate_backend`, a proxy's idle timeout) is found dead only by
        the next statement sent on it; when that is the BEGIN, nothing has run
        yet, so the BEGIN goes again on another connection. At most once per
        connection the pool can hold, and only for errors that say the
        connection was found closed (`_FOUND_CLOSED`): not a BEGIN that got no
        answer in time (a hung network), which would wait again on each try, and
        not an outage, whose connects fail at the acquire (not retried here). A
        BEGIN interrupted otherwise (cancelled, timed out, refused) closes its
        connection, whose state asyncpg and the server may disagree on, and raises.
        """
        for tries in range(self._pool.get_max_size(), -1, -1):
            conn = await self._cross(self._pool.acquire(timeout=self.config.connect_timeout))
            try:
                aio_tx = conn.transaction()  # refused too, if asyncpg saw the loss first
                await self._cross(aio_tx.start())
            except BaseException as exc:
                _discard(conn)
                await self._cleanup(self._pool.release(conn), "release")
                if tries and isinstance(exc, _FOUND_CLOSED):
                    log.info("a pooled connection was closed by the server (%s); "
                             "beginning again on another", type(exc).__name__)
                    continue
                raise
            return conn, aio_tx
        raise AssertionError("unreachable: the last try returns or raises")

    async def _cleanup(self, coro: Coroutine[Any, Any, Any], what: str) -> bool:
        """
        Run a cleanup shielded and bounded; report whether it finished in time.

        Bounded for real: the cleanup runs as an asyncio task that is left to end
        on its own if it overruns (see `run_bounded`).
        """
        task = self._loop.create_task(coro)
        finished = trio.Event()
        task.add_done_callback(lambda _task: finished.set())
        with trio.CancelScope(shield=True), trio.move_on_after(self.config.cleanup_timeout):
            await finished.wait()
        if not task.done():
            task.add_done_callback(_drop_late_result)
            log.warning("database %s timed out after %.1fs", what, self.config.cleanup_timeout)
            return False
        exc = task.exception()
        if exc is not None:
            log.warning("database %s failed (%s: %s)", what, type(exc).__name__, exc)
            return False
        return True

    @asynccontextmanager
    async def dedicated_connection(self) -> AsyncIterator[asyncpg.Connection]:
        """
        A connection of its own, outside the pool (for LISTEN: a pool's release
        resets the connection and drops its listeners).

        Opened on this database's loop with the pool's timeouts; drive it with
        one crossing per operation (`Database._cross`). Closed on
        exit shielded from cancellation and bounded by `cleanup_timeout`, then
        terminated if the close did not finish.
        """
        conn: asyncpg.Connection = await self._cross(asyncpg.connect(
            self.config.dsn,
            command_timeout=self.config.command_timeout,
            timeout=self.config.connect_timeout,
        ))
        try:
            await self._cross(join_schema(conn))
            yield conn
        finally:
            if not conn.is_closed() and not await self._cleanup(
                    conn.close(timeout=self.config.cleanup_timeout), "close"):
                conn.terminate()

    @asynccontextmanager
    async def listen(
        self, channel: str, on_notify: Callable[[str], None]
    ) -> AsyncIterator[Listening]:
        """
        LISTEN on `channel` on a dedicated connection, for as long as the block runs.

        `on_notify(payload)` runs on the trio thread for every notification (asyncpg
        calls listeners from the asyncio loop, which trio-asyncio runs as a trio
        task), so it may touch trio objects synchronously; it must not block. The
        yielded `Listening` has an Event set when the connection terminates
        (server restart, `pg_terminate_backend`, network error seen by the
        socket) and a bounded `check()` for a connection that hangs without a
        reset: notifications sent while nobody listens are lost, so the caller
        should reconnect and poll.
        """
        lost = trio.Event()

        def on_lost(_conn: object) -> None:
            lost.set()

        def on_notification(_conn: object, _pid: int, _channel: str, payload: str) -> None:
            on_notify(payload)

        async with self.dedicated_connection() as conn:
            conn.add_termination_listener(on_lost)
            await self._cross(conn.add_listener(channel, on_notification))
            if conn.is_closed():  # lost between connect and LISTEN's answer
                lost.set()
            yield Listening(self, conn, lost)

    async def aclose(self) -> None:
        """Close the pools; shielded and bounded, then forced."""
        with trio.CancelScope(shield=True):
            for pool in (self._kept, self._control_pool, self._engine_pool, self._pool):
                with trio.move_on_after(self.config.cleanup_timeout):
                    await self._cross(pool.close())
                    continue
                pool.terminate()


@asynccontextmanager
async def open_database(config: DatabaseConfig | str) -> AsyncIterator[Database]:
    """
    Open a connection pool; close it on exit.

    Runs inside an existing trio-asyncio loop if the caller opened one
    (`trio_asyncio.open_loop()`), otherwise opens one for its own lifetime.
    Connections are made on first use, so this succeeds even while the server
    is unreachable.
    """
    if isinstance(config, str):
        config = DatabaseConfig(dsn=config)
    bridge = trio_asyncio()
    loop = bridge.current_loop.get()
    if loop is not None:
        async with _pool(loop, config) as db:
            yield db
        return
    # open_loop() wraps whatever escapes its body in two exception groups; give
    # the caller back the exception its own code raised.
    raised: BaseException | None = None
    try:
        async with bridge.open_loop() as loop, _pool(loop, config) as db:
            try:
                yield db
            except BaseException as exc:
                raised = exc
                raise
    except BaseExceptionGroup as group:
        if raised is not None and leaves(group) == [raised]:
            raise raised from None
        raise


#: Tries of a call that PostgreSQL aborted for a deadlock or a serialization
#: failure (`retry_conflicts`).
CONFLICT_TRIES = 5


async def retry_conflicts(op: Callable[[], Awaitable[T]]) -> T:
    """
    `op()`, run again (up to `CONFLICT_TRIES` times, after a short pause) when
    PostgreSQL aborted it for a deadlock or a serialization failure: nothing of
    it was kept, and the server asks the client to retry. For the workflow
    calls whose functions lock a parent run and then its child, where a child's
    step ending locks them the other way round: the server breaks the cycle by
    aborting one, and a user's cancel should not be the one that fails for it.
    """
    for attempt in range(1, CONFLICT_TRIES + 1):
        try:
            return await op()
        except (asyncpg.DeadlockDetectedError, asyncpg.SerializationError):
            if attempt == CONFLICT_TRIES:
                raise
            await trio.sleep(0.01 * 2 ** attempt)
    raise AssertionError("unreachable")


@attrs.define
class _Flight:
    """One bounded operation: whether the trio side gave up, and where it was sent."""

    abandoned: bool = False
    #: The server process of the connection the operation used, once it had one.
    backend_pid: int | None = None
    #: That connection, when it is one of the engine's (`ConnectionSet`).
    conn: asyncpg.Connection | None = None


class _Abandoned(Exception):
    """An abandoned operation that got its connection too late, and so sent nothing."""


def _maybe_sent(exc: BaseException) -> bool:
    """Whether a statement that failed with `exc` may still have committed."""
    return is_connection_error(exc) or isinstance(exc, asyncpg.QueryCanceledError)


def _discard(conn: asyncpg.Connection) -> None:
    """
    Close a pooled connection for good, unless asyncpg already has: a
    connection it saw lost (the server closed it) goes back to its pool on its
    own, and its proxy then refuses every call, `terminate()` included. Raising
    that here would hide the loss that the caller is about to report.
    """
    with suppress(asyncpg.InterfaceError):
        conn.terminate()


def _drop_late_result(task: Any) -> None:
    """Done-callback of an abandoned task: retrieve its outcome so asyncio does not
    report it as never retrieved; the caller has moved on (and resolves it)."""
    if task.cancelled():
        return
    exc = task.exception()
    if exc is not None and not isinstance(exc, _Abandoned):
        log.debug("an abandoned database operation ended late (%s: %s)",
                  type(exc).__name__, exc)




def _log_asyncio_error(loop: Any, context: dict[str, Any]) -> None:
    """
    Log what asyncio reports as unhandled, instead of crashing the loop.

    trio-asyncio's default handler re-raises these errors into the loop's
    nursery, which tears the whole loop (and every worker on it) down. asyncpg
    leaves exactly such an error behind when a connection is lost mid-query
    ("Future exception was never retrieved: unexpected connection_lost()"),
    which is an outage the worker must survive, not die of.
    """
    exc = context.get("exception")
    detail = f"{type(exc).__name__}: {exc}" if exc is not None else ""
    log.warning("asyncio: %s %s", context.get("message", "unhandled error"), detail)


async def join_schema(conn: asyncpg.Connection) -> None:
    """
    A new connection's set-up: the queue's schema goes last on its search path
    (`nasiko_queue.db.schema` says why last), one round trip per connection.
    """
    await conn.execute(Q.session_schema_append, SCHEMA)


async def _keep_session(conn: asyncpg.Connection) -> None:
    """
    The pool's reset on release: nothing beyond asyncpg's own rollback.

    asyncpg's default sends ``SELECT pg_advisory_unlock_all(); CLOSE ALL;
    UNLISTEN *; RESET ALL`` on every release: one more round trip per operation,
    measured at about half of a drain's time. The queue's own operations leave
    no session state behind (LISTEN lives on a dedicated connection, the
    migrator unlocks its advisory lock itself), and asyncpg still rolls back any
    open transaction before calling this. Executors that change session
    settings on `ctx.db` must reset them themselves.
    """
    del conn


@asynccontextmanager
async def _pool(loop: Any, config: DatabaseConfig) -> AsyncIterator[Database]:
    if loop.get_exception_handler() is None:
        loop.set_exception_handler(_log_asyncio_error)
    def create(size: int, **settings: Any) -> Any:
        return loop.run_aio_coroutine(asyncpg.create_pool(
            config.dsn,
            min_size=0,
            max_size=size,
            command_timeout=config.command_timeout,
            timeout=config.connect_timeout,
            reset=_keep_session,
            init=join_schema,
            **settings,
        ))

    pool = await create(config.max_connections)
    # No command_timeout: `run_bounded` bounds these statements itself (see there).
    engine_pool = ConnectionSet(config.dsn, config.engine_connections,
                                idle_lifetime=KEPT_IDLE_LIFETIME, init=join_schema,
                                server_settings=ENGINE_SERVER_SETTINGS)
    control_pool = await create(CONTROL_CONNECTIONS)
    db = Database(loop, pool, engine_pool, control_pool, config)
    try:
        yield db
    finally:
        await db.aclose()
