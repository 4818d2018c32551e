"""
The queue's own connections (`db.connections.ConnectionSet`), on a plain
asyncio loop against the real server: reuse without a round trip, the bound on
their number, waiters served in order, broken connections replaced.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

import asyncpg
import pytest

from nasiko_queue.db.connections import ConnectionSet

T = TypeVar("T")


def _run(main: Callable[[], Awaitable[T]]) -> T:
    # A plain asyncio loop, named (see tests/plain_asyncio.py).
    with asyncio.Runner(loop_factory=asyncio.SelectorEventLoop) as runner:
        return runner.run(main())  # type: ignore[arg-type]


def test_an_idle_connection_is_handed_out_again_and_the_settings_hold(dsn: str) -> None:
    async def main() -> None:
        conns = ConnectionSet(dsn, 2, server_settings={"plan_cache_mode": "force_generic_plan"})
        pids = []
        for _ in range(5):
            conn = await conns.acquire(5)
            pids.append(conn.get_server_pid())
            assert await conn.fetchval("SHOW plan_cache_mode") == "force_generic_plan"
            conns.release(conn)
        assert len(set(pids)) == 1, "sequential use should reuse the one idle connection"
        await conns.close()

    _run(main)


def test_no_more_than_size_and_a_waiter_gets_the_next_released(dsn: str) -> None:
    async def main() -> None:
        conns = ConnectionSet(dsn, 2)
        a, b = await conns.acquire(5), await conns.acquire(5)
        assert a.get_server_pid() != b.get_server_pid()
        waiter = asyncio.ensure_future(conns.acquire(5))
        await asyncio.sleep(0)  # it parks: both are in use
        assert not waiter.done()
        conns.release(b)
        c = await waiter
        assert c is b
        with pytest.raises(TimeoutError):
            await conns.acquire(0.05)  # a and c are both still out
        conns.release(a)
        conns.release(c)
        await conns.close()

    _run(main)


def test_a_broken_connection_is_terminated_and_room_is_made_for_a_new_one(dsn: str) -> None:
    async def main() -> None:
        conns = ConnectionSet(dsn, 1)
        first = await conns.acquire(5)
        waiter = asyncio.ensure_future(conns.acquire(5))
        await asyncio.sleep(0)
        conns.release(first, broken=True)
        assert first.is_closed()
        second = await waiter  # woken to open one in the broken one's place
        assert second is not first
        assert await second.fetchval("SELECT 1") == 1
        conns.release(second)
        await conns.close()

    _run(main)


def test_a_connection_the_server_dropped_while_idle_is_replaced(dsn: str) -> None:
    async def main() -> None:
        conns = ConnectionSet(dsn, 1)
        conn = await conns.acquire(5)
        pid = conn.get_server_pid()
        conns.release(conn)
        gone: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        conn.add_termination_listener(lambda _conn: gone.set_result(None))
        admin = await asyncpg.connect(dsn)
        try:
            await admin.execute("SELECT pg_terminate_backend($1)", pid)
            await asyncio.wait_for(gone, 10)  # asyncpg saw the socket close
        finally:
            await admin.close()
        assert conn.is_closed()
        again = await conns.acquire(5)
        assert again.get_server_pid() != pid
        assert await again.fetchval("SELECT 1") == 1
        conns.release(again)
        await conns.close()

    _run(main)


def test_a_connection_left_in_a_transaction_is_not_handed_out(dsn: str) -> None:
    async def main() -> None:
        conns = ConnectionSet(dsn, 1)
        conn = await conns.acquire(5)
        await conn.execute("BEGIN")
        conns.release(conn)
        assert conn.is_closed()
        fresh = await conns.acquire(5)
        assert not fresh.is_in_transaction()
        conns.release(fresh)
        await conns.close()

    _run(main)


def test_try_acquire_returns_none_when_every_connection_is_out(dsn: str) -> None:
    async def main() -> None:
        conns = ConnectionSet(dsn, 1)
        conn = await conns.try_acquire(5)
        assert conn is not None
        assert await conns.try_acquire(5) is None
        conns.release(conn)
        assert await conns.try_acquire(5) is conn
        conns.release(conn)
        none = ConnectionSet(dsn, 0)  # enqueue_connections=0: always the pool
        assert await none.try_acquire(5) is None
        await conns.close()

    _run(main)


def test_a_connection_idle_past_its_lifetime_is_closed_not_used(dsn: str) -> None:
    async def main() -> None:
        conns = ConnectionSet(dsn, 1, idle_lifetime=0.0)  # every idle one is too old
        first = await conns.acquire(5)
        conns.release(first)
        second = await conns.acquire(5)
        assert second is not first
        assert conns.open == 1
        conns.release(second)
        await conns.close()
        assert conns.open == 0

    _run(main)
