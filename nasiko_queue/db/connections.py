"""
The queue's own connections: small sets for its hot statements, on the asyncio side.

The worker's claims and finishes, and enqueues, used to run on asyncpg pools.
Under trio-asyncio every asyncio callback costs a pass of trio's scheduler
(trio-asyncio runs one handle per pass, each under a `move_on_after`), and a
pool's acquire and release alone queue eight of them per statement: a
`SELECT 1` took 13 handles and 300 µs of CPU through the pool, 5 handles and
150 µs on a connection held directly (benchmarks/README.md, "Where the engine's
time goes"). That was half the worker's CPU per statement, and half an
enqueue's time.

`ConnectionSet` keeps what the queue needs of a pool and nothing that costs
callbacks: an idle connection is handed out and taken back without awaiting
anything; only opening one, or waiting for one when all are busy, goes through
the loop. What it gives up is what these statements never need: they leave no
transaction open (each is one autocommitted statement, or a transaction the
caller begins and ends in one go) and set no session state beyond the
connect-time settings, so nothing needs resetting. A connection that failed
in any way but a statement error, or was left in a transaction, is closed and
never handed out again; one idle for longer than `idle_lifetime` (a firewall
may have forgotten it) is closed instead of used; new ones are opened on
demand, as asyncpg's pool does.
"""

from __future__ import annotations

import asyncio
import collections
import math
from collections.abc import Awaitable, Callable
from typing import Any

import asyncpg


class ConnectionSet:
    """
    Up to `size` connections opened lazily with `connect_kwargs`; asyncio side only.

    `acquire` returns an idle connection at once when there is one, and waits
    (served in order) when all are busy; `try_acquire` returns None instead of
    waiting. `release` takes a connection back, or closes it when `broken`.
    """

    def __init__(self, dsn: str, size: int, *, idle_lifetime: float = math.inf,
                 init: Callable[[asyncpg.Connection], Awaitable[None]] | None = None,
                 **connect_kwargs: Any) -> None:
        if size < 0:
            raise ValueError(f"a connection set cannot have {size} connections")
        self._dsn = dsn
        self._size = size
        self._idle_lifetime = idle_lifetime
        self._connect_kwargs = connect_kwargs
        #: Run on each new connection before it is handed out (as asyncpg's pools do).
        self._init = init
        #: Idle connections, with the loop time each was given back at.
        self._idle: list[tuple[asyncpg.Connection, float]] = []
        #: Connections open or being opened (idle ones included).
        self._count = 0
        self._waiters: collections.deque[asyncio.Future[asyncpg.Connection]] = (
            collections.deque())
        self._closed = False

    @property
    def open(self) -> int:
        """Connections open or being opened, idle or in use."""
        return self._count

    @property
    def idle_connections(self) -> list[asyncpg.Connection]:
        """The idle ones, the next to be handed out last."""
        return [conn for conn, _since in self._idle]

    async def acquire(self, patience: float) -> asyncpg.Connection:
        """A connection of the set (opening one if there is room), within `patience` seconds."""
        if self._size == 0:
            raise ValueError("acquire on a connection set of size 0 would wait forever")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + patience
        while True:
            conn = await self.try_acquire(max(0.0, deadline - loop.time()))
            if conn is not None:
                return conn
            waiter: asyncio.Future[asyncpg.Connection] = loop.create_future()
            self._waiters.append(waiter)
            try:
                return await asyncio.wait_for(waiter, max(0.0, deadline - loop.time()))
            except _Retry:
                continue  # a connection closed: there is room to open one
            except BaseException:
                if waiter.done() and not waiter.cancelled() and waiter.exception() is None:
                    self.release(waiter.result())  # handed over as we gave up: pass it on
                elif waiter in self._waiters:
                    self._waiters.remove(waiter)
                raise

    async def try_acquire(self, patience: float) -> asyncpg.Connection | None:
        """An idle connection, else a new one if there is room (opened within
        `patience` seconds), else None at once."""
        if self._closed:
            raise asyncpg.InterfaceError("the connection set is closed")
        now = asyncio.get_running_loop().time()
        while self._idle:
            conn, since = self._idle.pop()  # the most recent: the others may age out
            if not conn.is_closed() and now - since < self._idle_lifetime:
                return conn
            # Closed by the server, or idle so long that a firewall may have
            # forgotten it (asyncpg's pool closes its idle ones after 300 s too).
            self._discard(conn, graceful=True)
        if self._count >= self._size:
            return None
        self._count += 1
        try:
            conn = await asyncpg.connect(self._dsn, timeout=patience, **self._connect_kwargs)
        except BaseException:
            self._count -= 1
            self._wake_one_for_room()
            raise
        try:
            if self._init is not None:
                await self._init(conn)
        except BaseException:
            conn.terminate()
            self._count -= 1
            self._wake_one_for_room()
            raise
        return conn

    def release(self, conn: asyncpg.Connection, *, broken: bool = False) -> None:
        """
        Give `conn` back: to the oldest waiter, else to the idle list. A broken
        connection (one that failed other than by a statement's error, or is
        closed, or was left inside a transaction) is terminated instead.
        """
        if broken or self._closed or conn.is_closed() or conn.is_in_transaction():
            self._discard(conn)
            return
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(conn)
                return
        self._idle.append((conn, asyncio.get_running_loop().time()))

    def _discard(self, conn: asyncpg.Connection, *, graceful: bool = False) -> None:
        """Close `conn` (with a goodbye to the server when `graceful`) and make room."""
        self._count -= 1
        if not conn.is_closed():
            if graceful:
                task = asyncio.get_running_loop().create_task(conn.close(timeout=5.0))
                task.add_done_callback(_retrieve)
            else:
                conn.terminate()
        self._wake_one_for_room()

    def _wake_one_for_room(self) -> None:
        """A connection closed: the oldest waiter may open one in its place."""
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_exception(_Retry())
                return

    async def close(self) -> None:
        """Close the idle connections; those in use are terminated when released."""
        self._closed = True
        idle, self._idle = self._idle, []
        for conn, _since in idle:
            self._count -= 1
            await conn.close()
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_exception(asyncpg.InterfaceError("the connection set is closed"))
        self._waiters.clear()

    def terminate(self) -> None:
        """Close every idle connection at once, without a goodbye to the server."""
        self._closed = True
        idle, self._idle = self._idle, []
        for conn, _since in idle:
            self._count -= 1
            conn.terminate()


class _Retry(Exception):
    """Internal: a waiter woken because a connection closed; `acquire` opens one."""


def _retrieve(task: asyncio.Task[None]) -> None:
    """A graceful close's outcome, retrieved so asyncio does not report it."""
    if not task.cancelled():
        task.exception()
