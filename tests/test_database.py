"""
The database layer: no connection leaks under cancellation, reconnects after
the server goes away (a private server, so the shared one is never touched).
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import trio

from nasiko_queue import Database, DatabaseConfig, Queue, Worker, migrate, open_database
from nasiko_queue.db.embedded import EmbeddedPostgres
from nasiko_queue.testing import enqueue_with_target

from .conftest import FAST
from .helpers import LogEvent, executors_for_all, job_row, running, succeed


async def generic_plan(db: Database, statement: str, types: str, args: str) -> str:
    """EXPLAIN of `statement`'s generic plan, as the engine's connections run it
    (prepared with `types`, executed with the SQL expressions `args`)."""

    async def explain(conn: Any) -> list[str]:
        async with conn.transaction():
            await conn.execute("SET LOCAL plan_cache_mode = force_generic_plan")
            await conn.execute(f"PREPARE nq_plan_check({types}) AS {statement}")
            try:
                return [r[0] for r in await conn.fetch(f"EXPLAIN EXECUTE nq_plan_check({args})")]
            finally:
                await conn.execute("DEALLOCATE nq_plan_check")

    return "\n".join(await db.run(explain))


def _pool_stats(db: Database) -> tuple[int, int]:
    pool = db._pool
    return pool.get_size(), pool.get_idle_size()


async def test_cancelled_queries_do_not_leak_connections(dsn: str) -> None:
    """With a pool of ONE connection, 50 cancelled operations and transactions later
    the connection is still returned and usable (a leak would hang here)."""
    async with open_database(DatabaseConfig(dsn=dsn, max_connections=1)) as db:
        for i in range(50):
            with trio.move_on_after(0.001 * (i % 5)):
                if i % 2:
                    await db.execute("SELECT pg_sleep(1)")
                else:
                    async with db.transaction() as tx:
                        await tx.execute("CREATE TEMP TABLE IF NOT EXISTS t (x int)")
                        await tx.execute("SELECT pg_sleep(1)")
        with trio.fail_after(10):
            assert await db.fetchval("SELECT 42") == 42
            async with db.transaction() as tx:
                assert await tx.fetchval("SELECT 1") == 1
        assert _pool_stats(db) == (1, 1)


async def test_cancelled_transaction_rolls_back(dsn: str) -> None:
    async with open_database(DatabaseConfig(dsn=dsn, max_connections=1)) as db:
        await db.execute("CREATE TABLE marks (x int)")
        with trio.move_on_after(0.2):
            async with db.transaction() as tx:
                await tx.execute("INSERT INTO marks VALUES (1)")
                await trio.sleep_forever()
        assert await db.fetchval("SELECT count(*) FROM marks") == 0
        # The connection is clean: a new transaction is a transaction, not a savepoint.
        async with db.transaction() as tx:
            await tx.execute("INSERT INTO marks VALUES (2)")
        assert await db.fetchval("SELECT count(*) FROM marks") == 1


async def test_body_exception_is_not_wrapped(dsn: str) -> None:
    with pytest.raises(KeyError):
        async with open_database(dsn):
            raise KeyError("mine")


@pytest.fixture
def private_server() -> Any:
    with EmbeddedPostgres() as server:
        yield server


async def test_worker_survives_a_server_restart(private_server: EmbeddedPostgres) -> None:
    async with open_database(DatabaseConfig(dsn=private_server.dsn, connect_timeout=2)) as db:
        await migrate(db)
        queue = Queue(db, config=FAST)
        first = await enqueue_with_target(queue, "Upload")
        async with running(queue, executors_for_all(succeed)) as worker:
            await worker.drain_once()
            await trio.to_thread.run_sync(private_server.stop)
            with LogEvent("claim failed") as failing:
                await worker.drain_once()  # the claim fails; the worker lives on
                assert failing.count >= 1
            await trio.to_thread.run_sync(private_server.start)
            second = await enqueue_with_target(queue, "Upload")
            await worker.drain_once()
        for job in (first, second):
            assert (await job_row(db, job.job_id) or {})["status"] == "done"


async def test_worker_waits_for_an_unreachable_server(private_server: EmbeddedPostgres) -> None:
    """Started while the server is down, the worker retries its registration (then
    its startup sweep) and reports itself started only once the database answers;
    then it works."""
    async with open_database(DatabaseConfig(dsn=private_server.dsn, connect_timeout=2)) as db:
        await migrate(db)
        queue = Queue(db, config=FAST)
        job = await enqueue_with_target(queue, "Upload")
        await trio.to_thread.run_sync(private_server.stop)
        worker = Worker(queue, executors_for_all(succeed))
        started = trio.Event()
        async with trio.open_nursery() as nursery:

            async def start() -> None:
                await nursery.start(worker.run)
                started.set()

            with LogEvent("could not register the worker") as failing:
                nursery.start_soon(start)
                await failing.event.wait()
                assert not started.is_set()
                await trio.to_thread.run_sync(private_server.start)
                await started.wait()
            await worker.drain_once()
            worker.stop()
        assert (await job_row(db, job.job_id) or {})["status"] == "done"


async def test_connection_terminated_by_the_server(dsn: str, queue: Queue) -> None:
    job = await enqueue_with_target(queue, "Upload")
    async with running(queue, executors_for_all(succeed)) as worker:
        await worker.drain_once()
        await queue.db.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE datname = current_database() AND pid <> pg_backend_pid()")
        second = await enqueue_with_target(queue, "Upload")
        await worker.drain_once()
        await worker.drain_once()
    for j in (job, second):
        assert (await job_row(queue.db, j.job_id) or {})["status"] == "done"


async def test_a_transaction_whose_begin_meets_a_dead_connection_runs_on_a_fresh_one(
    dsn: str,
) -> None:
    """
    A pooled connection the server closed while it sat idle (a restart,
    `pg_terminate_backend`, a proxy's idle timeout) is found dead only by the
    next statement sent on it. When that statement is a transaction's BEGIN,
    nothing has run yet, so `Database.transaction()` takes a fresh connection
    and begins again. Before, asyncpg had already handed the dead connection
    back to its pool as it noticed the loss, and the transaction's cleanup
    then failed on it ("cannot call Connection.terminate(): connection has been
    released back to the pool"), hiding the loss itself. The proxy closes the
    connection on the BEGIN's text, so the loss lands there every run;
    `test_connection_terminated_by_the_server` met it by chance in CI.
    """
    import asyncpg

    from .netproxy import Proxy

    proxy = Proxy(dsn)
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            await nursery.start(proxy.run)
            async with open_database(proxy.dsn()) as db:
                assert await db.fetchval("SELECT 1") == 1
                proxy.cut_on(b"BEGIN")
                async with db.transaction() as tx:
                    assert await tx.fetchval("SELECT 2") == 2
                assert proxy.cut.is_set()
                assert await db.fetchval("SELECT 3") == 3
                # A single statement is not sent again (it may have run), but the
                # caller gets the loss itself, not the cleanup's complaint.
                proxy.cut_on(b"SELECT 4")
                with pytest.raises(asyncpg.ConnectionDoesNotExistError):
                    await db.fetchval("SELECT 4")
                assert await db.fetchval("SELECT 5") == 5
            nursery.cancel_scope.cancel()


async def test_queue_statements_keep_generic_plans_and_application_sql_does_not(
    queue: Queue,
) -> None:
    db = queue.db
    assert [r[0] for r in await db.fetch_generic("SHOW plan_cache_mode")] == [
        "force_generic_plan"]
    assert await db.fetchval("SHOW plan_cache_mode") == "auto"


@pytest.mark.parametrize("name", ["job_claim", "jobs_finish_many_and_claim",
                                  "jobs_finish_reported_and_claim", "jobs_unclaim",
                                  "jobs_unclaim_lost"])
async def test_generic_plans_of_the_queue_statements_never_scan_the_job_table(
    queue: Queue, name: str
) -> None:
    """The statements `fetch_generic` runs, planned as it plans them (generic),
    with a backlog of 3,000 pending jobs and as many finished: rows are found by
    primary key or the partial index, never by a sequential scan of build_jobs
    (the claim's first form, a join, hashed one: its generic plan guesses
    LIMIT $1 at a tenth of the backlog)."""
    from nasiko_queue.db.statements import Q

    agent = (await enqueue_with_target(queue, "Upload")).target_id
    await queue.db.execute(
        "INSERT INTO build_jobs (agent_id, owner_id, status, payload, completed_at) "
        "SELECT $1, gen_random_uuid(), CASE WHEN g % 2 = 0 THEN 'done' ELSE 'pending' END,"
        " '{\"kind\": \"Upload\"}', CASE WHEN g % 2 = 0 THEN now() END "
        "FROM generate_series(1, 6000) AS g", agent)
    await queue.db.execute("ANALYZE build_jobs")
    kinds = "'{Upload}'::text[]"
    ids = "ARRAY[gen_random_uuid()]"
    calls = {
        "job_claim": ("int, text[], text[], int, uuid, uuid",
                      f"10, {kinds}, {kinds}, 1000, gen_random_uuid(), gen_random_uuid()"),
        "jobs_finish_many_and_claim": (
            "uuid[], int[], boolean[], uuid[], text, int, text[], text[], int, uuid, uuid, "
            "uuid[]",
            f"{ids}, ARRAY[1], ARRAY[false], {ids}, 'failed', 10, {kinds}, {kinds}, 1000, "
            f"gen_random_uuid(), gen_random_uuid(), {ids}"),
        "jobs_finish_reported_and_claim": (
            "uuid[], int[], boolean[], uuid[], text, int, text[], text[], int, uuid, uuid, "
            "text[], uuid[]",
            f"{ids}, ARRAY[1], ARRAY[false], {ids}, 'failed', 10, {kinds}, {kinds}, 1000, "
            f"gen_random_uuid(), gen_random_uuid(), ARRAY['success'], {ids}"),
        "jobs_unclaim": ("uuid[], int[], text, uuid[]", f"{ids}, ARRAY[1], 'ch', '{{NULL}}'"),
        "jobs_unclaim_lost": ("uuid, int, text", "gen_random_uuid(), 60, 'ch'"),
    }
    types, args = calls[name]

    plan = await generic_plan(queue.db, getattr(Q, name), types, args)
    assert "build_jobs" in plan
    assert "Seq Scan on build_jobs" not in plan, plan


@pytest.mark.parametrize("name", ["jobs_finish_many_and_claim",
                                  "jobs_finish_many_and_claim_kinds",
                                  "jobs_finish_reported_and_claim",
                                  "jobs_finish_reported_and_claim_kinds"])
async def test_the_finish_probes_its_jobs_by_primary_key_not_every_running_job(
    queue: Queue, name: str
) -> None:
    """
    The finish of K jobs reads those K rows, not every in_progress row of every
    worker: with 2,000 jobs running elsewhere, its generic plan (which, from
    statistics taken while few jobs ran, takes in_progress for rare) must not
    scan the in_progress part of the work-queue index.
    """
    from nasiko_queue.db.statements import Q

    agent = (await enqueue_with_target(queue, "Upload")).target_id
    await queue.db.execute(
        "INSERT INTO build_jobs (agent_id, owner_id, status, payload, completed_at) "
        "SELECT $1, gen_random_uuid(), 'done', '{\"kind\": \"Upload\"}', now() "
        "FROM generate_series(1, 3000)", agent)
    await queue.db.execute("ANALYZE build_jobs")
    await queue.db.execute(
        "INSERT INTO build_jobs (agent_id, owner_id, status, payload, picked_at, attempt) "
        "SELECT $1, gen_random_uuid(), 'in_progress', '{\"kind\": \"Upload\"}', now(), 1 "
        "FROM generate_series(1, 2000)", agent)
    kinds = "'{Upload}'::text[]"
    ids = "ARRAY[gen_random_uuid()]"
    types = "uuid[], int[], boolean[], uuid[], text, int, text[], text[], int, uuid, uuid"
    args = (f"{ids}, ARRAY[1], ARRAY[false], {ids}, 'failed', 10, {kinds}, {kinds}, 1000, "
            "gen_random_uuid(), gen_random_uuid()")
    if "reported" in name:
        types, args = types + ", text[]", args + ", ARRAY['success']"
    types, args = types + ", uuid[]", args + f", {ids}"  # the claim tokens

    plan = await generic_plan(queue.db, getattr(Q, name), types, args)
    assert "status = 'in_progress'" not in plan, plan
    assert "build_jobs_pkey" in plan, plan


async def test_the_plain_finish_probes_its_jobs_by_primary_key(queue: Queue) -> None:
    """`plain_finish_many_and_claim`, as the test above: 2,000 jobs running
    elsewhere are not read to finish one."""
    from nasiko_queue.db.statements import Q

    await queue.db.execute(
        "INSERT INTO nasiko_queue_jobs (id, queue, kind, payload, state, finished_at, "
        "max_attempts) SELECT gen_random_uuid(), 'default', 'k', '{}', 'completed', now(), 20 "
        "FROM generate_series(1, 3000)")
    await queue.db.execute("ANALYZE nasiko_queue_jobs")
    await queue.db.execute(
        "INSERT INTO nasiko_queue_jobs (id, queue, kind, payload, state, attempt, claimed_by, "
        "max_attempts) SELECT gen_random_uuid(), 'default', 'k', '{}', 'running', 1, "
        "gen_random_uuid(), 20 "
        "FROM generate_series(1, 2000)")
    types = "uuid[], uuid[], text, int, uuid, uuid, int, uuid[], uuid[], text[]"
    args = ("ARRAY[gen_random_uuid()], ARRAY[gen_random_uuid()], 'default', 10, "
            "gen_random_uuid(), NULL, 1000, '{}', '{}', ARRAY['{}']")

    plan = await generic_plan(queue.db, Q.plain_finish_many_and_claim, types, args)
    assert "nasiko_queue_jobs_running" not in plan, plan
    assert "nasiko_queue_jobs_pkey" in plan, plan


async def test_every_named_statement_is_valid_sql_for_the_schema(db: Database) -> None:
    """Each statement of queries.sql is parsed and planned by the server (prepared,
    not run), so that one the tests reach only rarely cannot hide a syntax error or
    a wrong column (a reserved word as an alias once did, in worker_deregister)."""
    import attrs as _attrs

    from nasiko_queue.db.statements import Q

    async def prepare_all(conn: Any) -> list[str]:
        bad = []
        for field in _attrs.fields(type(Q)):
            try:
                await conn.prepare(getattr(Q, field.name))
            except Exception as exc:
                bad.append(f"{field.name}: {type(exc).__name__}: {exc}")
        return bad

    assert await db.run(prepare_all) == []


@pytest.mark.parametrize("base", ["jobs_finish_many_and_claim",
                                  "jobs_finish_reported_and_claim"])
def test_the_kinds_finish_statements_are_their_base_with_the_other_claim(base: str) -> None:
    """Each finish-and-claim statement includes `job_claim`; its `_kinds` twin is
    written in queries.sql as a line that derives it, and the loader builds it from
    the base with `job_claim_kinds` included instead, so that the two cannot drift
    (a fix to the finish once had to be made twice)."""
    from nasiko_queue.db.statements import Q, parse

    def code(text: str) -> str:  # its lines, stripped, without comments
        return "\n".join(line.strip() for line in text.splitlines()
                         if line.strip() and not line.lstrip().startswith("--"))

    def shifted(text: str) -> str:  # a claim's $1-$6 as the finish's $6-$11
        return code(re.sub(r"\$(\d+)", lambda m: f"${int(m[1]) + 5}", text))

    full, kinds = getattr(Q, base), getattr(Q, base + "_kinds")
    claim, claim_kinds = shifted(Q.job_claim), shifted(Q.job_claim_kinds)
    assert claim in code(full)
    assert claim_kinds not in code(full)
    assert code(kinds) == code(full).replace(claim, claim_kinds)
    with pytest.raises(ValueError, match="must come before it"):
        parse("-- name: b\n-- derived from a: it includes c for d.\n")
    with pytest.raises(ValueError, match="no single include of 'd'"):
        parse("-- name: a\nSELECT 1;\n-- name: b\n-- derived from a: it includes c for d.\n")


def test_a_finish_with_nothing_reported_leaves_the_build_rows_alone() -> None:
    """`jobs_finish_many_and_claim`, sent when no executor of the batch reported
    through its context, neither locks nor writes a build row: the server
    sets up every part of a plan each time it runs it, used or not, so the
    folded writes live in `jobs_finish_reported_and_claim` alone (issue #25)."""
    from nasiko_queue.db.statements import Q

    for name in ("jobs_finish_many_and_claim", "jobs_finish_many_and_claim_kinds"):
        text = code_of(getattr(Q, name))
        for writes in ("UPDATE agent_builds", "UPDATE mcp_connector_builds", "FOR UPDATE\n",
                       "$12::text[]", "$13"):
            assert writes not in text, (name, writes)
    reported = code_of(Q.jobs_finish_reported_and_claim)
    assert "UPDATE agent_builds" in reported
    assert "$12::text[]" in reported


def test_the_two_finishes_share_their_finish_and_result_lines() -> None:
    """`jobs_finish_many_and_claim` and `jobs_finish_reported_and_claim` are two
    statements (the server sets up every part of a plan it runs, so the unused
    build-row writes cost every batch), and their claim is one include; the job's
    own finish (its status, its guard on the claim) and the rows they return are
    spelled in each, and must stay the same but for what only the reported one has:
    its one-time filter that takes the build rows' locks first, and the start
    writes it leaves out of its result."""
    from nasiko_queue.db.statements import Q

    only_reported = ("AND (SELECT count(*) FROM locked) >= 0",
                     "WHERE i.reported IS DISTINCT FROM 'building'",
                     "RETURNING j.id, j.status, o.build_id, o.folded")

    def shared(text: str) -> list[str]:
        body = code_of(text)
        finish = body[body.index("), finished AS ("):body.index("RETURNING j.id, j.status")]
        result = body[body.index("SELECT i.id AS finished_id"):]
        return [line.strip() for line in (finish + result).splitlines()
                if line.strip() not in only_reported]

    assert shared(Q.jobs_finish_many_and_claim) == shared(Q.jobs_finish_reported_and_claim)
    assert "SET status = CASE WHEN o.build_status = 'success'" in "\n".join(
        shared(Q.jobs_finish_many_and_claim))


def code_of(text: str) -> str:
    """A statement's text without its comment lines."""
    return "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("--"))


def test_the_plain_finish_claims_with_the_text_of_plain_claim() -> None:
    """`plain_finish_many_and_claim` is written in queries.sql with its claim as an
    include of `plain_claim` (parameters renumbered): the claim's scan, order, limit
    and SKIP LOCKED are spelled once, so the two claims cannot drift."""
    import re
    from importlib import resources

    from nasiko_queue.db.statements import Q, parse

    def code(text: str) -> list[str]:
        return [line.strip() for line in text.splitlines()
                if line.strip() and not line.lstrip().startswith("--")]

    claim = code(re.sub(r"\$(\d+)", lambda m: f"${int(m[1]) + 2}", Q.plain_claim))
    finish = code(Q.plain_finish_many_and_claim)
    assert any(finish[i:i + len(claim)] == claim for i in range(len(finish))), finish
    source = resources.files("nasiko_queue").joinpath("db/queries.sql").read_text("utf-8")
    # The claim's own lines (another statement may order by run_at too: the
    # scheduled jobs' listing does).
    for once in ("WITH RECURSIVE priorities", "AND priority = priorities.priority",
                 "FOR UPDATE SKIP LOCKED) AS due"):
        assert source.count(once) == 1, once
    with pytest.raises(ValueError, match="must come before it"):
        parse("-- name: b\n  -- include a, its $1-$1 as $2-$2\n")
    with pytest.raises(ValueError, match=r"takes \$1, \$2"):
        parse("-- name: a\nSELECT $1::int + $2::int;\n"
              "-- name: b\nSELECT $1::int, (\n  -- include a, its $1-$1 as $2-$2\n);\n")
    built = parse("-- name: a\n-- A comment.\nSELECT $1::int\n  + $2::int;\n"
                  "-- name: b\nSELECT $1::int, (\n    -- include a, its $1-$2 as $2-$3\n);\n")
    assert built["b"] == "SELECT $1::int, (\n    SELECT $2::int\n      + $3::int\n)"
