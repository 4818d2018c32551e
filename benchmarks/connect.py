"""
Bare asyncpg connections for the benchmarks, set up as the queue's own are: the
queue's schema last on the search path (`nasiko_queue.db.schema`), so the
benchmarks' SQL names the queue's tables as the queue's statements do.
"""

from __future__ import annotations

from typing import Any

import asyncpg

from nasiko_queue.db.database import join_schema


async def connect(dsn: str, **kwargs: Any) -> asyncpg.Connection:
    conn = await asyncpg.connect(dsn, **kwargs)
    await join_schema(conn)
    return conn


def create_pool(dsn: str, **kwargs: Any) -> Any:
    """An asyncpg pool (await it, or use it as an async context manager)."""
    return asyncpg.create_pool(dsn, init=join_schema, **kwargs)
