"""Retention: `prune` deletes old done/failed jobs in batches and nothing else."""

from __future__ import annotations

from datetime import timedelta

import attrs
import pytest
import trio
from click.testing import CliRunner

from nasiko_queue import Database, Queue, open_database
from nasiko_queue.admin.retention import parse_duration, prune
from nasiko_queue.cli import main
from nasiko_queue.testing import enqueue_with_target

from .helpers import executors_for_all, running, succeed


async def _jobs(queue: Queue, n: int) -> list[object]:
    return [(await enqueue_with_target(queue, "Upload")).job_id for _ in range(n)]


async def _stage(db: Database, ids: list[object], status: str, age: str | None) -> None:
    """Give jobs a status and, for finished ones, a completion `age` ago."""
    await db.execute(
        "UPDATE build_jobs SET status = $2, "
        "picked_at = CASE WHEN $2 <> 'pending' THEN now() - $3::text::interval END, "
        "completed_at = CASE WHEN $2 IN ('done', 'failed') THEN now() - $3::text::interval END "
        "WHERE id = ANY($1::uuid[])", ids, status, age or "0 s")


async def _statuses(db: Database) -> dict[str, int]:
    return {r["status"]: r["n"] for r in await db.fetch(
        "SELECT status, count(*) AS n FROM build_jobs GROUP BY status")}


async def test_prune_deletes_only_old_finished_jobs_in_batches(queue: Queue, db: Database) -> None:
    ids = await _jobs(queue, 12)
    await _stage(db, ids[0:3], "done", "40 days")
    await _stage(db, ids[3:5], "failed", "31 days")
    await _stage(db, ids[5:6], "done", "29 days")        # too young
    await _stage(db, ids[6:8], "pending", None)
    # Claimed long ago (stuck, even): still never pruned.
    await _stage(db, ids[8:10], "in_progress", "90 days")
    await db.execute("UPDATE build_jobs SET created_at = now() - interval '90 days'")
    await _stage(db, ids[10:12], "done", "1 hour")
    assert await prune(db, timedelta(days=30), batch_size=2) == 5
    assert await _statuses(db) == {"done": 3, "pending": 2, "in_progress": 2}
    assert await prune(db, timedelta(days=30), batch_size=2) == 0
    assert await prune(db, timedelta(minutes=30)) == 3
    assert await _statuses(db) == {"pending": 2, "in_progress": 2}


def test_parse_duration() -> None:
    assert parse_duration("30d") == timedelta(days=30)
    assert parse_duration("12h") == timedelta(hours=12)
    assert parse_duration(" 90M ") == timedelta(minutes=90)
    assert parse_duration("2w") == timedelta(weeks=2)
    assert parse_duration("1.5h") == timedelta(minutes=90)
    for bad in ("", "30", "d", "-1d", "0s", "3y", "1d2h"):
        with pytest.raises(ValueError, match="duration"):
            parse_duration(bad)
    # Past what timedelta (OverflowError) or the database's timestamps hold: the
    # CLI printed OverflowError's traceback (found by a bug hunt).
    for too_long in ("99999999999d", "5300w", "9"*400 + "s"):
        with pytest.raises(ValueError, match="at most 100 years"):
            parse_duration(too_long)
    assert parse_duration("5200w") == timedelta(weeks=5200)


def test_cli_prune(dsn: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DATABASE_URL", raising=False)

    async def setup() -> None:
        async with open_database(dsn) as db:
            ids = await _jobs(Queue(db), 3)
            await _stage(db, ids[:2], "failed", "2 days")

    async def statuses() -> dict[str, int]:
        async with open_database(dsn) as db:
            return await _statuses(db)

    trio.run(setup)
    runner = CliRunner()
    result = runner.invoke(main, ["prune", "--dsn", dsn, "--older-than", "1d"])
    assert result.exit_code == 0, result.output
    assert "pruned 2 finished jobs" in result.output
    assert trio.run(statuses) == {"pending": 1}
    bad = runner.invoke(main, ["prune", "--dsn", dsn, "--older-than", "soon"])
    assert bad.exit_code == 2
    assert "not a duration" in bad.output


@pytest.mark.parametrize(("older_than", "shown"),
                         [("30d", "30d"), ("45s", "45s"), ("1.5h", "1.5h"), (" 2W ", "2W")])
def test_cli_prune_says_the_age_as_the_user_wrote_it(
    dsn: str, monkeypatch: pytest.MonkeyPatch, older_than: str, shown: str
) -> None:
    """Not `30 days, 0:00:00` or `0:00:45`: the command line's own words."""
    monkeypatch.delenv("DATABASE_URL", raising=False)

    async def setup() -> None:
        async with open_database(dsn) as db:
            ids = await _jobs(Queue(db), 2)
            await _stage(db, ids[:1], "done", "40 days")

    trio.run(setup)
    runner = CliRunner()
    result = runner.invoke(main, ["prune", "--dsn", dsn, "--older-than", older_than])
    assert result.exit_code == 0, result.output
    assert result.output == f"pruned 1 finished job older than {shown}\n"
    again = runner.invoke(main, ["prune", "--dsn", dsn, "--older-than", older_than])
    assert again.output == f"pruned 0 finished jobs older than {shown}\n"


async def test_worker_prunes_on_its_recovery_tick(queue: Queue, db: Database) -> None:
    ids = await _jobs(queue, 2)
    await _stage(db, ids[:1], "done", "10 days")
    await _stage(db, ids[1:], "done", "1 hour")
    config = attrs.evolve(queue.config, recovery_interval=0.05, retention=timedelta(days=7))
    async with running(Queue(db, config=config), executors_for_all(succeed)) as worker:
        with trio.fail_after(10):
            await worker.wait_for(lambda s: s.pruned >= 1)
    assert await _statuses(db) == {"done": 1}


async def test_prune_finds_old_finished_jobs_by_index_not_by_scanning_history(
    queue: Queue, db: Database
) -> None:
    """With a long history, each batch of `prune` reads the finished rows it
    deletes through the partial index of 0007, not a scan of the whole table."""
    from nasiko_queue.db.statements import Q

    agent = (await enqueue_with_target(queue, "Upload")).target_id
    await db.execute(
        "INSERT INTO build_jobs (agent_id, owner_id, status, payload, completed_at) "
        "SELECT $1, gen_random_uuid(), CASE WHEN g % 10 = 0 THEN 'pending' ELSE 'done' END,"
        " '{\"kind\": \"Upload\"}', CASE WHEN g % 10 <> 0 THEN now() - make_interval("
        "  days => g % 60) END FROM generate_series(1, 20000) AS g", agent)
    await db.execute("ANALYZE build_jobs")
    plan = "\n".join(r[0] for r in await db.fetch(
        "EXPLAIN " + Q.jobs_prune, timedelta(days=59), 1000))
    assert "build_jobs_finished_completed_at" in plan, plan
    assert "Seq Scan on build_jobs" not in plan, plan
