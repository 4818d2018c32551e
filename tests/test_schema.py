"""
The queue in a schema of its own (issue #46, `nasiko_queue.db.schema`): nothing
of it in `public`; an application with tables of the build port's names of its
own installs beside them and keeps them; a database migrated before upgrades in
place with its live jobs; the functions answer a session that does not know the
schema; another schema may be named.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import uuid
from typing import Any, ClassVar

import attrs
import pytest

import nasiko_queue as nq
from nasiko_queue import Database, Queue, open_database
from nasiko_queue.cli.worker import _check_schema
from nasiko_queue.db.migrate import load_migrations, migrate
from nasiko_queue.db.schema import SCHEMA, schema_name
from nasiko_queue.errors import ConfigurationError, MigrationError, NasikoQueueError

from .conftest import FAST
from .helpers import running

#: What `public` holds of anything: relations, functions, types (array types and
#: a relation's row type aside).
PUBLIC_OBJECTS = """
SELECT 'relation ' || c.relname FROM pg_class AS c
WHERE c.relnamespace = 'public'::regnamespace
UNION ALL
SELECT 'function ' || p.proname FROM pg_proc AS p WHERE p.pronamespace = 'public'::regnamespace
UNION ALL
SELECT 'type ' || t.typname FROM pg_type AS t
WHERE t.typnamespace = 'public'::regnamespace AND t.typelem = 0 AND t.typrelid = 0
ORDER BY 1
"""

#: What of the queue is in schema $1.
QUEUE_OBJECTS = """
SELECT count(*) FROM pg_class AS c JOIN pg_namespace AS n ON n.oid = c.relnamespace
WHERE n.nspname = $1 AND c.relname LIKE 'nasiko\\_queue\\_%'
"""

#: The bookkeeping table's creation as the migrator of 0.1 (up to 0037) made it:
#: in the session's schema, public.
LEGACY_BOOKKEEPING = """
CREATE TABLE public.nasiko_queue_migrations (
    version    text PRIMARY KEY,
    name       text NOT NULL,
    checksum   text NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now()
)
"""


@attrs.frozen(kw_only=True)
class Greet(nq.JobArgs):
    kind: ClassVar[str] = "schema_greet"
    name: str


async def _objects(db: Database, sql: str, *args: Any) -> list[str]:
    return [r[0] for r in await db.fetch(sql, *args)]


async def test_a_new_database_holds_nothing_in_public(empty_dsn: str) -> None:
    async with open_database(empty_dsn) as db:
        await migrate(db)
        assert await _objects(db, PUBLIC_OBJECTS) == []
        assert await db.fetchval(QUEUE_OBJECTS, SCHEMA) > 20
        # The build port's tables too: created in the queue's schema.
        assert await db.fetchval(
            "SELECT n.nspname::text FROM pg_class AS c JOIN pg_namespace AS n "
            "ON n.oid = c.relnamespace WHERE c.relname = 'build_jobs'") == SCHEMA


async def test_an_application_with_its_own_agents_table_installs_beside_it(
    empty_dsn: str,
) -> None:
    """Issue #46: `relation "agents" already exists`; then, `has ['agents']`."""
    async with open_database(empty_dsn) as db:
        await db.execute("CREATE TABLE agents (id serial PRIMARY KEY, model text NOT NULL)")
        await db.execute("INSERT INTO agents (model) VALUES ('gpt'), ('claude')")
        await migrate(db)
        # Theirs is as it was: its columns, its rows.
        assert await _objects(db, "SELECT column_name::text FROM information_schema.columns "
                                  "WHERE table_schema = 'public' AND table_name = 'agents' "
                                  "ORDER BY ordinal_position") == ["id", "model"]
        assert await _objects(db, "SELECT model FROM public.agents ORDER BY id") == [
            "gpt", "claude"]
        assert await _objects(db, PUBLIC_OBJECTS) == [
            "relation agents", "relation agents_id_seq", "relation agents_pkey"]

        # A job runs, and its executor's own statements see the application's table.
        queue = Queue(db, config=FAST)
        executors = nq.Executors()

        @executors.register(Greet)
        async def greet(ctx: nq.PlainJobContext[Greet]) -> list[str]:
            models: list[str] = [r["model"] for r in await ctx.db.fetch(
                "SELECT model FROM agents ORDER BY id")]
            return [ctx.payload.name, *models]

        job = await queue.enqueue(Greet(name="ada"))
        async with running(queue, executors):
            assert await queue.result(job, timeout=30) == ["ada", "gpt", "claude"]


async def test_a_database_migrated_before_upgrades_with_its_live_jobs(
    empty_dsn: str,
) -> None:
    """A database migrated by 0.1 (everything in public, up to 0037) moves into
    the schema at 0038, its jobs waiting, running and ended kept."""
    before = [m for m in load_migrations() if m.version < "0038"]
    async with open_database(empty_dsn) as db:
        await db.execute(LEGACY_BOOKKEEPING)
        await migrate(db, before)
        assert await db.fetchval(QUEUE_OBJECTS, "public") > 20
        assert await db.fetchval(QUEUE_OBJECTS, SCHEMA) == 0

        queue = Queue(db, config=FAST)
        waiting = [await queue.enqueue(Greet(name=f"w{i}")) for i in range(3)]
        later = await queue.enqueue(Greet(name="later"), delay=3600)
        ended = await queue.enqueue(Greet(name="ended"))
        running_id = await queue.enqueue(Greet(name="running"))
        await db.execute("UPDATE nasiko_queue_jobs SET state = 'completed', "
                         "result = '\"done before\"', finished_at = now() WHERE id = $1", ended)
        # Claimed by a worker of the old version that is gone (its lease lapsed).
        await db.execute("UPDATE nasiko_queue_jobs SET state = 'running', attempt = 1, "
                         "attempted_at = now() - interval '2 hours' WHERE id = $1", running_id)
        counts_before = await _objects(
            db, "SELECT state || ' ' || count(*) FROM nasiko_queue_jobs GROUP BY state "
                "ORDER BY state")

        assert await migrate(db) == ["0038"]
        assert await db.fetchval(QUEUE_OBJECTS, "public") == 0
        assert await db.fetchval(QUEUE_OBJECTS, SCHEMA) > 20
        assert await _objects(
            db, f"SELECT state || ' ' || count(*) FROM {SCHEMA}.nasiko_queue_jobs "
                "GROUP BY state ORDER BY state") == counts_before
        assert await migrate(db) == []

        executors = nq.Executors()

        @executors.register(Greet)
        def greet(ctx: nq.PlainJobContext[Greet]) -> str:
            return f"hello {ctx.payload.name}"

        async with running(queue, executors):
            for i, job in enumerate(waiting):
                assert await queue.result(job, timeout=30) == f"hello w{i}"
        assert await queue.result(ended, timeout=5) == "done before"
        assert await db.fetchval("SELECT state FROM nasiko_queue_jobs WHERE id = $1",
                                 later) == "available"
        # The run the old worker held is still there, for the lease or the sweep.
        assert await db.fetchval("SELECT attempt FROM nasiko_queue_jobs WHERE id = $1",
                                 running_id) >= 1


async def test_the_functions_answer_a_session_that_does_not_know_the_schema(
    dsn: str,
) -> None:
    """An application's own connection, its search path `public` only: the SQL
    API (named with its schema) and the triggers it fires find the queue's tables."""
    async def as_application(conn: Any) -> None:
        async with conn.transaction():
            await conn.execute("SET LOCAL search_path = public")
            job = await conn.fetchval(
                f"SELECT {SCHEMA}.nasiko_queue_enqueue('schema_greet', "
                "'{\"kind\": \"schema_greet\", \"name\": \"sql\"}'::jsonb)")
            assert isinstance(job, uuid.UUID)
            assert await conn.fetchval(f"SELECT {SCHEMA}.nasiko_queue_cancel($1)",
                                       job) == "cancelled"

    async with open_database(dsn) as db:
        await db.run(as_application)
        unpathed = await db.fetch(
            "SELECT p.oid::regprocedure::text FROM pg_proc AS p "
            "JOIN pg_language AS l ON l.oid = p.prolang "
            "WHERE p.pronamespace = $1::regnamespace "
            "AND NOT (l.lanname = 'sql' AND p.provolatile IN ('i', 's')) "
            "AND p.proconfig IS NULL", SCHEMA)
        assert unpathed == []


def test_another_schema_may_be_named(empty_dsn: str) -> None:
    """NASIKO_QUEUE_SCHEMA names the schema for every part of a process."""
    script = textwrap.dedent("""
        import asyncio, sys
        from typing import ClassVar
        import asyncpg, attrs, trio
        import nasiko_queue as nq
        from nasiko_queue import aio
        from nasiko_queue.db.migrate import migrate

        @attrs.frozen
        class Ping(nq.JobArgs):
            kind: ClassVar[str] = "ping"

        async def queue_side(dsn):
            async with nq.open_database(dsn) as db:
                await migrate(db)
                await nq.Queue(db).enqueue(Ping())
                print(await db.fetchval(
                    "SELECT string_agg(DISTINCT n.nspname, ',') FROM pg_class c "
                    "JOIN pg_namespace n ON n.oid = c.relnamespace "
                    "WHERE c.relname = 'nasiko_queue_jobs'"))

        async def app_side(dsn):
            conn = await asyncpg.connect(dsn)
            try:
                await aio.enqueue(conn, Ping())
                print(await conn.fetchval("SELECT count(*) FROM jobs_here.nasiko_queue_jobs"))
            finally:
                await conn.close()

        trio.run(queue_side, sys.argv[1])
        asyncio.run(app_side(sys.argv[1]))
    """)
    env = {**os.environ, "NASIKO_QUEUE_SCHEMA": "jobs_here"}
    out = subprocess.run([sys.executable, "-c", script, empty_dsn], env=env,
                         capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split() == ["jobs_here", "2"]


@pytest.mark.parametrize("bad", ["Jobs", "1jobs", "jobs; DROP TABLE x", ""])
def test_an_invalid_schema_name_is_refused(bad: str) -> None:
    with pytest.raises(ConfigurationError, match="NASIKO_QUEUE_SCHEMA"):
        schema_name(bad)
    assert schema_name("jobs_2") == "jobs_2"


async def test_an_application_build_jobs_table_is_refused_not_shadowed(
    empty_dsn: str,
) -> None:
    """Review of issue #46: every worker reads `build_jobs` (the rescue, `status`)
    by a name the search path resolves, so an application's own table of that
    name would be read in place of the queue's: refused, saying why."""
    async with open_database(empty_dsn) as db:
        await db.execute("CREATE TABLE build_jobs (id serial PRIMARY KEY, sha text)")
        with pytest.raises(MigrationError, match="has a table build_jobs of its own"):
            await migrate(db)
        assert await db.fetchval("SELECT count(*) FROM build_jobs") == 0


async def test_a_worker_of_build_jobs_refuses_build_tables_split_across_schemas(
    empty_dsn: str,
) -> None:
    """Review of issue #46: beside an application's `agents`, the build tables are
    in the queue's schema, and the build statements would take the application's
    `agents`: a worker with build executors refuses to start; one without runs."""
    async with open_database(empty_dsn) as db:
        await db.execute("CREATE TABLE agents (id serial PRIMARY KEY)")
        await migrate(db)
        await _check_schema(db)
        with pytest.raises(NasikoQueueError, match=r"not in one schema \(agent_builds in "
                                                   rf"{SCHEMA}, agents in public"):
            await _check_schema(db, builds=True)


async def test_migrate_works_with_an_empty_search_path(empty_dsn: str) -> None:
    """Review of issue #46: `search_path = ''` (the CVE-2018-1058 hardening) made
    the functions' path `nasiko_queue, ""`, which PostgreSQL refuses."""
    async with open_database(empty_dsn) as db:
        await db.execute(f"ALTER DATABASE {await db.fetchval('SELECT current_database()')} "
                         "SET search_path = ''")
    async with open_database(empty_dsn) as db:
        assert await db.fetchval("SHOW search_path") == SCHEMA
        await migrate(db)
        assert await db.fetchval(
            "SELECT proconfig::text FROM pg_proc WHERE proname = 'nasiko_queue_enqueue'") == (
            f"{{search_path={SCHEMA}}}")


async def test_a_0_1_copy_beside_the_schema_is_refused_not_merged(empty_dsn: str) -> None:
    """Review of issue #46: a replica of 0.1 that migrated public again after the
    schema was made: 0038 says so instead of failing on a duplicate name."""
    before = [m for m in load_migrations() if m.version < "0038"]
    async with open_database(empty_dsn) as db:
        await db.execute(LEGACY_BOOKKEEPING)
        await migrate(db, before)
        await db.execute(f"CREATE SCHEMA IF NOT EXISTS {SCHEMA}")
        await db.execute(f"CREATE TABLE {SCHEMA}.nasiko_queue_jobs (id uuid)")
        with pytest.raises(MigrationError, match=r"in schema public and in schema .*"
                                                 r"nasiko_queue_jobs.*keep one copy"):
            await migrate(db)
        assert await db.fetchval(QUEUE_OBJECTS, "public") > 20


def test_a_process_naming_another_schema_is_refused(empty_dsn: str) -> None:
    """Review of issue #46: with the queue in `nasiko_queue`, a migrator naming
    another schema took it for a database of 0.1 and did nothing."""
    migrate_only = textwrap.dedent("""
        import sys, trio, nasiko_queue as nq
        from nasiko_queue.db.migrate import migrate

        async def main(dsn):
            async with nq.open_database(dsn) as db:
                await migrate(db)

        trio.run(main, sys.argv[1])
    """)
    subprocess.run([sys.executable, "-c", migrate_only, empty_dsn], capture_output=True,
                   text=True, timeout=120, check=True)
    env = {**os.environ, "NASIKO_QUEUE_SCHEMA": "jobs_here"}
    out = subprocess.run([sys.executable, "-c", migrate_only, empty_dsn], env=env,
                         capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode != 0
    assert f"the queue already lives in schema '{SCHEMA}'" in out.stderr
    assert f"set NASIKO_QUEUE_SCHEMA={SCHEMA}" in out.stderr
