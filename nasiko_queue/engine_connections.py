"""
The queue's own connections: a small set for its hot statements, on the asyncio side.

The worker's claims and finishes used to run on an `asyncpg.Pool` of their own.
Under trio-asyncio every asyncio callback costs a pass of trio's scheduler
(trio-asyncio runs one handle per pass, each under a `move_on_after`), and the
pool's acquire and release alone queue eight of them per statement: a
`SELECT 1` took 13 handles and 300 µs of CPU through the pool, 5 handles and
150 µs on a connection held directly (benchmarks/README.md, "Where the engine's
time goes"). That was half the worker's CPU per statement.

`ConnectionSet` keeps what the engine needs of a pool and nothing that costs
callbacks: an idle connection is handed out and taken back without awaiting
anything; only opening one, or waiting for one when all are busy, goes through
the loop. What it gives up is what these statements never use: no transaction
is left open by them (each is one autocommitted statement), no session state
is set beyond the connect-time settings, so nothing needs resetting. A
connection that failed in any way but a statement error is closed, never
handed out again, and a new one is opened on demand, as asyncpg's pool does.
"""

from __future__ import annotations

import asyncio
import collections
from typing import Any

import asyncpg


class ConnectionSet:
    """
    Up to `size` connections opened lazily with `connect_kwargs`; asyncio side only.

    `acquire` returns an idle connection at once when there is one; `release`
    takes it back (or closes it, when `broken`). Waiters are served in order.
    """

    def __init__(self, dsn: str, size: int, **connect_kwargs: Any) -> None:
        if size < 1:
            raise ValueError(f"a connection set needs at least one connection, got {size}")
        self._dsn = dsn
        self._size = size
        self._connect_kwargs = connect_kwargs
        self._idle: list[asyncpg.Connection] = []
        #: Connections open or being opened (idle ones included).
        self._count = 0
        self._waiters: collections.deque[asyncio.Future[asyncpg.Connection]] = (
            collections.deque())
        self._closed = False

    async def acquire(self, patience: float) -> asyncpg.Connection:
        """A connection of the set (opening one if there is room), within `patience` seconds."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + patience
        while True:
            if self._closed:
                raise asyncpg.InterfaceError("the connection set is closed")
            while self._idle:
                conn = self._idle.pop()
                if not conn.is_closed():
                    return conn
                self._count -= 1  # the server dropped it while idle
            if self._count < self._size:
                return await self._open(max(0.0, deadline - loop.time()))
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

    async def _open(self, patience: float) -> asyncpg.Connection:
        self._count += 1
        try:
            conn: asyncpg.Connection = await asyncpg.connect(
                self._dsn, timeout=patience, **self._connect_kwargs)
        except BaseException:
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
            if not conn.is_closed():
                conn.terminate()
            self._count -= 1
            self._wake_one_for_room()
            return
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(conn)
                return
        self._idle.append(conn)

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
        for conn in idle:
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
        for conn in idle:
            self._count -= 1
            conn.terminate()


class _Retry(Exception):
    """Internal: a waiter woken because a connection closed; `acquire` opens one."""

