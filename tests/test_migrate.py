"""The migrator: in order, recorded, idempotent, one transaction each, replica-safe."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
import trio

from nasiko_queue import DatabaseConfig, MigrationError, migrate, open_database
from nasiko_queue.db.migrate import Migration, load_migrations
from nasiko_queue.db.statements import Q

from .helpers import TEST_DEADLINE, LogEvent

ROOT = Path(__file__).resolve().parent.parent


def test_files_are_found_in_order() -> None:
    versions = [m.version for m in load_migrations()]
    assert versions == sorted(versions)
    assert versions[:4] == ["0001", "0003", "0004", "0005"]


async def test_migrate_applies_once_and_records(empty_dsn: str) -> None:
    async with open_database(empty_dsn) as db:
        assert await migrate(db) == [
            "0001", "0003", "0004", "0005", "0006", "0007", "0008", "0009", "0010",
            "0011", "0012", "0013", "0014", "0015", "0016",
            "0017", "0018", "0019", "0020", "0021", "0022", "0023", "0024", "0025", "0026",
            "0027", "0028", "0029", "0030", "0031", "0033", "0034", "0035", "0036", "0037", "0038"]
        assert await migrate(db) == []
        recorded = await db.fetch("SELECT version, name FROM nasiko_queue_migrations "
                                  "ORDER BY version")
        assert [(r["version"], r["name"]) for r in recorded] == [
            ("0001", "schema"), ("0003", "mcp"), ("0004", "jobs_agent_index"),
            ("0005", "queue_autovacuum"), ("0006", "claim_token"),
            ("0007", "finished_jobs_index"), ("0008", "workers"), ("0009", "job_errors"),
            ("0010", "plain_jobs"), ("0011", "pending_kind_index"),
            ("0012", "paused_queues"), ("0013", "cancel_rule"), ("0014", "operator_state"),
            ("0015", "job_events"), ("0016", "listing_order_index"),
            ("0017", "results"), ("0018", "workflows"), ("0019", "enqueue_function"),
            ("0020", "limits"),
            ("0021", "workflow_run_views"), ("0022", "same_page_updates"),
            ("0023", "due_by_priority"), ("0024", "drop_due_index"),
            ("0025", "give_back_attempted_at"), ("0026", "limited_pick_attempts"),
            ("0027", "stale_child_runs"), ("0028", "limited_claim_lock_wait"),
            ("0029", "schedule_expression"), ("0030", "workflow_retry_waits"),
            ("0031", "enqueue_many_named_errors"), ("0033", "bounded_transitions"),
            ("0034", "run_end_meets_claims"),
            ("0035", "limited_pick_snapshot"), ("0036", "limited_pick_tokens"),
            ("0037", "bounded_run_ends"), ("0038", "own_schema")]
        cols = {r["column_name"]: (r["data_type"], r["is_nullable"], r["column_default"])
                for r in await db.fetch(
                    "SELECT column_name, data_type, is_nullable, column_default "
                    "FROM information_schema.columns WHERE table_name = 'build_jobs'")}
        assert cols["status"][0] == "text"
        assert cols["status"][2] == "'pending'::text"
        assert cols["attempt"][1:] == ("NO", "0")
        assert cols["agent_id"][1] == "YES"
        assert cols["connector_id"][1] == "YES"
        assert cols["claim_token"] == ("uuid", "YES", None)  # 0006
        indexes = {r["indexname"]: r["indexdef"] for r in await db.fetch(
            "SELECT indexname, indexdef FROM pg_indexes WHERE tablename = 'build_jobs'")}
        assert "WHERE (status = ANY" in indexes["build_jobs_work_queue"]
        assert "WHERE (connector_id IS NOT NULL)" in indexes["idx_build_jobs_connector"]
        # Deleting an agent must not read the whole job history (0004).
        assert "(agent_id)" in indexes["idx_build_jobs_agent"]
        # Retention finds finished rows by completion time (0007, built concurrently).
        assert "(completed_at) WHERE (status = ANY" in \
            indexes["build_jobs_finished_completed_at"]
        assert await db.fetchval(
            "SELECT indisvalid FROM pg_index WHERE indexrelid = "
            "'build_jobs_finished_completed_at'::regclass")
        # Vacuum by a fixed count of dead rows, not a share of the history (0005).
        options = set(await db.fetchval(
            "SELECT reloptions FROM pg_class WHERE oid = 'build_jobs'::regclass"))
        assert {"autovacuum_vacuum_scale_factor=0.0", "autovacuum_vacuum_threshold=1000",
                "autovacuum_analyze_scale_factor=0.0"} <= options
        # Half of each page left for a job's claim and end (0022, after 0005's 90).
        for table in ("build_jobs", "nasiko_queue_jobs"):
            assert "fillfactor=50" in await db.fetchval(
                "SELECT reloptions FROM pg_class WHERE oid = $1::regclass", table)


async def test_one_target_check(dsn: str) -> None:
    import asyncpg

    async with open_database(dsn) as db:
        with pytest.raises(asyncpg.CheckViolationError, match="chk_build_jobs_one_target"):
            await db.execute("INSERT INTO build_jobs (owner_id, payload) "
                             "VALUES (gen_random_uuid(), '{}')")
        with pytest.raises(asyncpg.CheckViolationError):
            await db.execute("INSERT INTO build_jobs (owner_id, payload, status) "
                             "VALUES (gen_random_uuid(), '{}', 'running')")


async def test_concurrent_migrators_apply_each_file_once(empty_dsn: str) -> None:
    results: list[list[str]] = []

    async def one() -> None:
        async with open_database(empty_dsn) as db:
            results.append(await migrate(db))

    async with trio.open_nursery() as nursery:
        for _ in range(4):
            nursery.start_soon(one)
    everything = tuple(m.version for m in load_migrations())
    assert sorted(map(tuple, results)) == [(), (), (), everything]


async def test_a_failing_migration_rolls_back_whole(empty_dsn: str) -> None:
    bad = [Migration("0001", "bad", "CREATE TABLE half (x int); SELECT no_such_function();")]
    async with open_database(empty_dsn) as db:
        with pytest.raises(MigrationError, match="0001_bad failed"):
            await migrate(db, bad)
        assert await db.fetchval("SELECT to_regclass('half')") is None
        assert await db.fetchval("SELECT count(*) FROM nasiko_queue_migrations") == 0


async def test_a_no_transaction_migration_runs_statement_by_statement(empty_dsn: str) -> None:
    """`--! no-transaction`: CREATE INDEX CONCURRENTLY, which PostgreSQL refuses in a
    transaction (or in a multi-statement string), is applied and recorded."""
    files = [
        Migration("0001", "table", "CREATE TABLE t (x int);"),
        Migration("0002", "index", "--! no-transaction\n-- build it without blocking\n"
                  "DROP INDEX CONCURRENTLY IF EXISTS t_x;\n\n"
                  "CREATE INDEX CONCURRENTLY t_x\n    ON t (x);\n"),
    ]
    async with open_database(empty_dsn) as db:
        assert await migrate(db, files) == ["0001", "0002"]
        assert await db.fetchval("SELECT indisvalid FROM pg_index "
                                 "WHERE indexrelid = 't_x'::regclass")
        assert await migrate(db, files) == []


async def test_a_no_transaction_migration_that_fails_half_way_runs_again(
    empty_dsn: str,
) -> None:
    """Not recorded when a statement fails: the next run starts it from the top, so
    its statements must be safe to repeat (as 0007's DROP ... IF EXISTS is)."""
    half = ("--! no-transaction\nCREATE TABLE IF NOT EXISTS u (x int);\n"
            "SELECT no_such_function();\n")
    async with open_database(empty_dsn) as db:
        with pytest.raises(MigrationError, match="0001_half failed"):
            await migrate(db, [Migration("0001", "half", half)])
        assert await db.fetchval("SELECT to_regclass('u')") is not None  # ran, unrecorded
        assert await db.fetchval("SELECT count(*) FROM nasiko_queue_migrations") == 0
        fixed = half.replace("SELECT no_such_function();", "SELECT 1;")
        assert await migrate(db, [Migration("0001", "half", fixed)]) == ["0001"]


def test_a_no_transaction_migration_may_not_use_dollar_quotes() -> None:
    m = Migration("0001", "f", "--! no-transaction\nCREATE FUNCTION f() RETURNS int "
                  "LANGUAGE sql AS $$ SELECT 1; $$;\n")
    with pytest.raises(MigrationError, match="dollar quoting"):
        m.statements()


async def test_an_edited_migration_is_refused(empty_dsn: str) -> None:
    async with open_database(empty_dsn) as db:
        await migrate(db, [Migration("0001", "a", "CREATE TABLE a (x int)")])
        with pytest.raises(MigrationError, match="changed after it was applied"):
            await migrate(db, [Migration("0001", "a", "CREATE TABLE a (x bigint)")])


def test_the_test_extra_installs_the_build_backend() -> None:
    """
    `pip install '.[test]'` must bring everything `python -m pytest` needs.

    The wheel test below builds without build isolation (no network in a test), so
    the build backend of [build-system] must come with the `test` extra.
    """
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    backends = {_requirement_name(r) for r in project["build-system"]["requires"]}
    test_extra = {_requirement_name(r)
                  for r in project["project"]["optional-dependencies"]["test"]}
    assert backends <= test_extra


def _requirement_name(requirement: str) -> str:
    return re.split(r"[<>=!~;\[ ]", requirement, maxsplit=1)[0].strip().lower()


@pytest.mark.slow
def test_wheel_ships_the_migrations_and_the_type_marker(tmp_path: Path) -> None:
    """
    An installed wheel must be able to migrate (the SQL files travel inside it), and
    its users' type checkers must read its annotations (PEP 561's py.typed).
    """
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(tmp_path), str(ROOT)], check=True)
    (wheel,) = tmp_path.glob("nasiko_queue-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "nasiko_queue/migrations/0001_schema.sql" in names
    assert "nasiko_queue/migrations/0003_mcp.sql" in names
    assert "nasiko_queue/db/queries.sql" in names
    assert "nasiko_queue/py.typed" in names
    # The dashboard's templates and stylesheet (package data, no build step).
    assert "nasiko_queue/web/templates/base.html" in names
    assert "nasiko_queue/web/static/dashboard.css" in names


@pytest.mark.parametrize("transactional", [True, False])
async def test_a_migration_statement_may_outlast_the_pools_command_timeout(
    empty_dsn: str, transactional: bool
) -> None:
    """
    Building an index on a big table (or CONCURRENTLY, behind a long
    transaction) takes minutes; each statement inherited the pool's 60 s
    `command_timeout` and was cut off ("timed out talking to the server"),
    leaving an INVALID index behind (found by a bug hunt). Here the pool's bound
    is 0.2 s and the statement takes 1 s.
    """
    head = "" if transactional else "--! no-transaction\n"
    slow = [Migration("0001", "slow", f"{head}SELECT pg_sleep(1);\n")]
    config = DatabaseConfig(dsn=empty_dsn, command_timeout=0.2)
    async with open_database(config) as db:
        with trio.fail_after(TEST_DEADLINE):
            assert await migrate(db, slow) == ["0001"]


async def test_a_migrator_waiting_for_anothers_lock_says_so(
    empty_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """It waited without a word, for ever if the other one was stuck."""
    monkeypatch.setattr("nasiko_queue.db.migrate.LOCK_WAIT_NOTICE", 0.2)
    tiny = [Migration("0001", "tiny", "SELECT 1;")]
    done: list[list[str]] = []
    async with open_database(empty_dsn) as db, db.transaction() as holder:
        assert await holder.fetchval(Q.migrations_lock)
        with LogEvent("waiting for another migrator") as said, trio.fail_after(TEST_DEADLINE):
            async with trio.open_nursery() as nursery:
                async def other() -> None:
                    done.append(await migrate(db, tiny))

                nursery.start_soon(other)
                await said.event.wait()
                assert done == []
                await holder.execute(Q.migrations_unlock)
    assert done == [["0001"]]


def test_a_misnamed_migration_file_is_refused(tmp_path: Path) -> None:
    """`0030_add-index.sql` did not match the name pattern and was skipped: it never
    ran, and `migrate` said the schema was up to date."""
    (tmp_path / "0001_fine.sql").write_text("SELECT 1;")
    (tmp_path / "0002_add-index.sql").write_text("SELECT 2;")
    (tmp_path / "notes.txt").write_text("not a migration")
    with pytest.raises(MigrationError, match=r"not: \['0002_add-index.sql'\]"):
        load_migrations(tmp_path)
