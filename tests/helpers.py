"""Small helpers shared by the engine tests (real PostgreSQL; no mocks)."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any
from uuid import UUID

import trio

from nasiko_queue import Database, Executors, Queue, Worker

#: The payload type of each built-in kind.
from nasiko_queue.builds.payloads import BUILTIN_PAYLOAD_TYPES
from nasiko_queue.testing import KINDS, set_build_status

TYPES = {t.kind: t for t in BUILTIN_PAYLOAD_TYPES}


async def job_row(db: Database, job_id: UUID) -> dict[str, Any] | None:
    row = await db.fetchrow(
        "SELECT status, attempt, error_msg, picked_at, completed_at, agent_id, connector_id "
        "FROM build_jobs WHERE id = $1",
        job_id,
    )
    return None if row is None else dict(row)


async def generic_plan_pages(db: Database, sql: str, types: str, args: str) -> int:
    """Pages (shared buffers hit or read) one run of `sql` reads on its generic
    plan, as the engine runs it: `types` its parameters' types, `args` their
    values as SQL. Rolled back: a claim measured so is not kept."""

    async def explain(conn: Any) -> int:
        tx = conn.transaction()
        await tx.start()
        try:
            await conn.execute("SET LOCAL plan_cache_mode = force_generic_plan")
            await conn.execute(f"PREPARE nq_pages({types}) AS\n{sql}")
            text = await conn.fetchval("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) "
                                       f"EXECUTE nq_pages({args})")
        finally:
            await tx.rollback()
            await conn.execute("DEALLOCATE nq_pages")
        plan = json.loads(text)[0]["Plan"]
        return int(plan["Shared Hit Blocks"] + plan.get("Shared Read Blocks", 0))

    pages: int = await db.run(explain)
    return pages


async def agent_state(db: Database, agent_id: UUID) -> str | None:
    """The agent's status, or None when the row is gone."""
    status: str | None = await db.fetchval("SELECT status FROM agents WHERE id = $1", agent_id)
    return status


async def connector_state(db: Database, connector_id: UUID) -> str | None:
    return await db.fetchval(  # type: ignore[no-any-return]
        "SELECT coalesce(build_status, 'null') FROM mcp_connectors WHERE id = $1", connector_id
    )


async def build_state(db: Database, build_id: UUID, *, connector: bool = False) -> str | None:
    if connector:
        return await db.fetchval(  # type: ignore[no-any-return]
            "SELECT status FROM mcp_connector_builds WHERE id = $1", build_id
        )
    return await db.fetchval(  # type: ignore[no-any-return]
        "SELECT status::text FROM agent_builds WHERE id = $1", build_id
    )


def executors_for_all(behaviour: Callable[..., Any]) -> Executors:
    """An `Executors` registering the same async function for all seven kinds."""
    executors = Executors()
    for kind in KINDS:
        executors.register(TYPES[kind], behaviour)
    return executors


async def succeed(ctx: Any) -> None:
    await set_build_status(ctx.db, ctx.payload, "success")


async def fail_build(ctx: Any) -> None:
    await set_build_status(ctx.db, ctx.payload, "failed")


#: No engine test needs anywhere near this long; a rule broken into a hang fails here.
TEST_DEADLINE = 60.0


@asynccontextmanager
async def running(queue: Queue, executors: Executors) -> AsyncIterator[Worker]:
    """A started worker; stopped gracefully (and waited for) on exit, within a deadline."""
    worker = Worker(queue, executors)
    with trio.fail_after(TEST_DEADLINE):
        async with trio.open_nursery() as nursery:
            await nursery.start(worker.run)
            yield worker
            worker.stop()


class LogEvent(logging.Handler):
    """Sets a trio.Event when a log record containing `text` is emitted (no polling)."""

    def __init__(self, text: str) -> None:
        super().__init__(level=logging.DEBUG)
        self.text = text
        self.event = trio.Event()
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        if self.text in record.getMessage():
            self.count += 1
            self.event.set()

    def __enter__(self) -> LogEvent:
        logging.getLogger("nasiko_queue").addHandler(self)
        logging.getLogger("nasiko_queue").setLevel(logging.DEBUG)
        return self

    def __exit__(self, *exc: object) -> None:
        logging.getLogger("nasiko_queue").removeHandler(self)
