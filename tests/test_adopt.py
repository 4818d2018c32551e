"""
`migrate` on a database the original Rust control plane created adopts the
application's tables (docs/rules.md §1; `nasiko_queue.db.adopt`): it checks the
columns the queue needs, records 0001 and 0003 as applied without running them,
adds only the queue's own columns, indexes and tables, and a build job the
original's SQL inserted runs on our worker while the original's claim still
takes the jobs our side enqueues (issue #46). The original's schema is
tests/sql/original_schema.sql, written from the reference's description.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest
import trio

from nasiko_queue import (
    Database,
    Executors,
    JobContext,
    PayloadCodec,
    Queue,
    StandaloneBuild,
    open_database,
)
from nasiko_queue.db.migrate import load_migrations, migrate
from nasiko_queue.errors import MigrationError
from nasiko_queue.testing import enqueue_with_target

from .conftest import FAST
from .helpers import running
from .test_leases import ORIGINAL_CLAIM

ORIGINAL_SCHEMA = (Path(__file__).parent / "sql" / "original_schema.sql").read_text()

#: The original's enqueue point (reference §9): the row with its defaults.
ORIGINAL_ENQUEUE = ("INSERT INTO build_jobs (agent_id, owner_id, payload) "
                    "VALUES ($1, $2, $3::jsonb) RETURNING id")


async def _columns(db: Database, table: str) -> set[str]:
    rows = await db.fetch("SELECT column_name FROM information_schema.columns "
                          "WHERE table_schema = 'public' AND table_name = $1", table)
    return {r["column_name"] for r in rows}


async def _original(db: Database) -> uuid.UUID:
    """The original's database, with one user; returns the user's id."""
    await db.execute(ORIGINAL_SCHEMA)
    user: uuid.UUID = await db.fetchval(
        "INSERT INTO users (email) VALUES ('ada@example.com') RETURNING id")
    return user


async def test_migrate_adopts_the_originals_tables_and_shares_build_jobs(
    empty_dsn: str,
) -> None:
    async with open_database(empty_dsn) as db:
        owner = await _original(db)
        theirs = {t: await _columns(db, t) for t in ("agents", "agent_builds", "build_jobs")}
        applied = await migrate(db)
        assert applied == [m.version for m in load_migrations()]
        # Nothing of the application's was dropped or replaced (its own trigger
        # still calls its own function; 0001 was adopted, not run); the queue's
        # tables and columns were added.
        for table, columns in theirs.items():
            assert columns <= await _columns(db, table), table
        assert "display_name" in await _columns(db, "agents")
        assert await db.fetchval(
            "SELECT tgfoid::regproc::text FROM pg_trigger WHERE tgname = "
            "'trg_agents_updated_at'") == "update_updated_at_column"
        assert await db.fetchval("SELECT to_regclass('nasiko_queue_jobs')") is not None
        assert len(await _columns(db, "build_jobs")) > len(theirs["build_jobs"])
        assert await migrate(db) == []  # adopted once, recorded

        queue = Queue(db, config=FAST)
        # The original's enqueue point writes a job; our worker runs it.
        agent = await db.fetchval("INSERT INTO agents (owner_id, name, status) "
                                  "VALUES ($1, 'mine', 'deploying') RETURNING id", owner)
        build = await db.fetchval(
            "INSERT INTO agent_builds (agent_id, version_tag, image_reference) "
            "VALUES ($1, 'v1', 'img:v1') RETURNING id", agent)
        payload = StandaloneBuild(build_id=build, agent_id=agent, agent_name="mine",
                                  version_tag="v1")
        theirs_id = await db.fetchval(ORIGINAL_ENQUEUE, agent, owner,
                                      PayloadCodec().dumps(payload))
        ran: list[Any] = []
        executors = Executors()

        @executors.register(StandaloneBuild)
        async def standalone(ctx: JobContext[StandaloneBuild]) -> None:
            ran.append(ctx.job_id)
            ctx.report_success()

        async with running(queue, executors) as worker:
            await worker.wait_for(lambda s: s.done >= 1)
        assert ran == [theirs_id]
        row = await db.fetchrow("SELECT status, attempt FROM build_jobs WHERE id = $1",
                                theirs_id)
        assert (row["status"], row["attempt"]) == ("done", 1)
        assert await db.fetchval("SELECT status::text FROM agent_builds WHERE id = $1",
                                 build) == "success"

        # Our side enqueues a job; the original's claim (a Rust replica) takes it,
        # on a session of its own that knows nothing of the queue's schema
        # (issue #46): the queue's triggers on its tables still find their tables.
        ours = await enqueue_with_target(queue, "StandaloneBuild", owner_id=owner)
        async def as_rust(conn: Any) -> Any:
            async with conn.transaction():
                await conn.execute("SET LOCAL search_path = public")
                claimed = await conn.fetchval(ORIGINAL_CLAIM)
                await conn.execute("UPDATE build_jobs SET status = 'failed' WHERE id = $1",
                                   claimed)
                await conn.execute("DELETE FROM build_jobs WHERE id = $1", claimed)
                return claimed

        assert await db.run(as_rust) == ours.job_id
        assert await db.fetchval("SELECT count(*) FROM nasiko_queue_deleted_build_jobs "
                                 "WHERE id = $1", ours.job_id) == 1


async def test_adopting_refuses_an_application_table_without_a_needed_column(
    empty_dsn: str,
) -> None:
    async with open_database(empty_dsn) as db:
        await _original(db)
        await db.execute("ALTER TABLE agents DROP COLUMN writable_path")
        with pytest.raises(MigrationError, match=r"without what the queue reads and writes: "
                                                 r"agents\.writable_path"):
            await migrate(db)
        # Nothing was recorded, nothing of the queue's created.
        assert await db.fetchval("SELECT to_regclass('nasiko_queue_jobs')") is None


async def test_a_new_database_gets_the_tables_created(empty_dsn: str) -> None:
    """No application tables: 0001 and 0003 run as ever (the demo, the tests)."""
    async with open_database(empty_dsn) as db:
        await migrate(db)
        assert await db.fetchval("SELECT to_regproc('nasiko_set_updated_at')") is not None
        with trio.fail_after(10):
            assert await db.fetchval("SELECT count(*) FROM build_jobs") == 0


async def test_an_original_from_before_its_mcp_tables_is_adopted_then_migrated(
    empty_dsn: str,
) -> None:
    """Found by review: adopting 0001 skipped its trigger function, which 0003 (run
    where the application has no MCP tables yet) gives its new tables: migrate
    failed with "function nasiko_set_updated_at() does not exist"."""
    async with open_database(empty_dsn) as db:
        await _original(db)
        await db.execute("ALTER TABLE build_jobs DROP COLUMN connector_id")
        await db.execute("DROP TABLE mcp_connector_builds, mcp_connectors")
        assert await migrate(db) == [m.version for m in load_migrations()]
        assert await db.fetchval("SELECT to_regclass('mcp_connectors')") is not None
