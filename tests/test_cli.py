"""
The `nasiko-queue` command, against a real PostgreSQL.

Commands run in-process through click's `CliRunner` where that is enough, from
sync test functions (the command calls `trio.run` itself, which cannot nest in
a pytest-trio test). The worker runs as a real subprocess, because what is
tested is how a process answers SIGTERM.
"""

from __future__ import annotations

import base64
import io
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import types
import uuid
import warnings
from collections.abc import Awaitable, Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit
from uuid import UUID

import attrs
import pytest
import trio
from click.testing import CliRunner, Result
from rich.console import Console

from nasiko_queue import (
    ConfigurationError,
    Database,
    Executors,
    JobOptions,
    Queue,
    QueueConfig,
    SecretBox,
    open_database,
)
from nasiko_queue.admin.status import SMALL_TABLE_ROWS, ClaimPlan, plan_claim, queue_status
from nasiko_queue.cli import load_executors, main
from nasiko_queue.cli.demo import DemoLog, SimulatedCrash, run_demo
from nasiko_queue.testing import KINDS, enqueue_with_target

from .conftest import FAST

REPO = Path(__file__).resolve().parent.parent
#: How long a subprocess may take for anything; generous, a test never waits it out
#: unless something is broken.
DEADLINE = 20.0


@pytest.fixture
def runner(monkeypatch: pytest.MonkeyPatch) -> CliRunner:
    """A runner whose environment names no database unless the test passes one."""
    monkeypatch.delenv("DATABASE_URL", raising=False)
    monkeypatch.delenv("NASIKO_QUEUE_MASTER_KEY", raising=False)
    return CliRunner()


def invoke(runner: CliRunner, *args: str, env: dict[str, str] | None = None) -> Result:
    result = runner.invoke(main, list(args), env=env, catch_exceptions=True)
    # An exception other than the command's own exit would be a bug with a traceback.
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result


def with_db(dsn: str, fn: Callable[[Database], Awaitable[Any]]) -> Any:
    """Run `fn(db)` in a trio loop of its own (sync tests set up rows with this)."""

    async def go() -> Any:
        async with open_database(dsn) as db:
            return await fn(db)

    return trio.run(go)


# -- migrate ---------------------------------------------------------------------


def test_migrate_applies_then_says_up_to_date(runner: CliRunner, empty_dsn: str) -> None:
    first = invoke(runner, "migrate", "--dsn", empty_dsn)
    assert first.exit_code == 0, first.output
    assert "applied migrations: 0001, 0003" in first.output

    second = invoke(runner, "migrate", "--dsn", empty_dsn)
    assert second.exit_code == 0, second.output
    assert second.output.strip() == "schema is up to date"


def test_dsn_comes_from_database_url(runner: CliRunner, dsn: str) -> None:
    result = invoke(runner, "migrate", env={"DATABASE_URL": dsn})
    assert result.exit_code == 0, result.output
    assert "up to date" in result.output


# -- errors ----------------------------------------------------------------------


def _one_line_error(result: Result) -> str:
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.output
    assert lines[0].startswith("Error: ")
    return lines[0]


@pytest.mark.parametrize("command", ["migrate", "status"])
def test_no_dsn_is_a_one_line_usage_error(runner: CliRunner, command: str) -> None:
    result = invoke(runner, command)
    assert result.exit_code == 2
    assert "pass --dsn or set DATABASE_URL" in _one_line_error(result)


@pytest.mark.parametrize(
    ("dsn", "exit_code", "says"),
    [
        ("postgresql://root@127.0.0.1:1/postgres", 1, "cannot connect to 127.0.0.1:1/postgres"),
        ("postgresql://root@nosuchhost.invalid/postgres", 1, "cannot connect to nosuchhost"),
        ("mysql://root@127.0.0.1/postgres", 2, "--dsn must be a URL like postgresql://"),
        ("postgresql://root@127.0.0.1:port/postgres", 2, "--dsn is not a valid database URL"),
    ],
)
def test_bad_dsn_is_a_one_line_error(
    runner: CliRunner, dsn: str, exit_code: int, says: str
) -> None:
    result = invoke(runner, "status", "--dsn", dsn)
    assert result.exit_code == exit_code
    assert says in _one_line_error(result)


def test_missing_database_names_it_without_the_password(
    runner: CliRunner, admin_dsn: str
) -> None:
    parts = urlsplit(admin_dsn)
    netloc = f"{parts.username}:hunter2@{parts.hostname}:{parts.port or 5432}"
    bad = urlunsplit(parts._replace(netloc=netloc, path="/nasiko_no_such_db"))
    result = invoke(runner, "status", "--dsn", bad)
    assert result.exit_code == 1
    line = _one_line_error(result)
    assert 'database "nasiko_no_such_db" does not exist' in line
    assert "hunter2" not in result.output


def test_unmigrated_database_says_run_migrate(runner: CliRunner, empty_dsn: str) -> None:
    result = invoke(runner, "status", "--dsn", empty_dsn)
    assert result.exit_code == 1
    assert "run `nasiko-queue migrate` first" in _one_line_error(result)


def test_bad_dsn_in_a_real_process_prints_no_traceback() -> None:
    """The console entry point itself, not only the click command, ends in one line."""
    proc = subprocess.run(
        [sys.executable, "-m", "nasiko_queue", "migrate", "--dsn",
         "postgresql://root@127.0.0.1:1/postgres"],
        cwd=REPO, capture_output=True, text=True, timeout=DEADLINE, check=False,
        env={k: v for k, v in os.environ.items() if k != "DATABASE_URL"},
    )
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "Error: cannot connect to 127.0.0.1:1/postgres: connection refused"
    ]


@pytest.mark.parametrize("which", ["unmigrated", "down"])
def test_the_dashboard_checks_its_database_before_it_serves(empty_dsn: str, which: str) -> None:
    """
    `dashboard` opened its pool lazily and served: a wrong DSN, an unmigrated
    database or a server that is down gave a dashboard whose every page failed,
    where the README promises a one-line error (found by a bug hunt).
    """
    dsn = empty_dsn if which == "unmigrated" else "postgresql://root@127.0.0.1:1/postgres"
    proc = subprocess.run(
        [sys.executable, "-m", "nasiko_queue", "dashboard", "--read-only", "--bind",
         "127.0.0.1:0", "--dsn", dsn],
        cwd=REPO, capture_output=True, text=True, timeout=DEADLINE, check=False,
        env={k: v for k, v in os.environ.items() if k != "DATABASE_URL"},
    )
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    said = "run `nasiko-queue migrate` first" if which == "unmigrated" else "cannot connect to"
    assert said in proc.stderr
    assert "dashboard on" not in proc.stderr


# -- status ----------------------------------------------------------------------


async def _known_rows(db: Database) -> None:
    """5 Upload jobs: 2 pending (one 10 min old), 2 held (one for 2 hours), 1 done."""
    queue = Queue(db, config=FAST)
    jobs = [(await enqueue_with_target(queue, "Upload")).job_id for _ in range(5)]
    held_now, held_long, done, old_pending, _pending = jobs
    await db.execute(
        "UPDATE build_jobs SET status='in_progress', attempt=1, picked_at=now() WHERE id=$1",
        held_now)
    await db.execute(
        "UPDATE build_jobs SET status='in_progress', attempt=1, "
        "picked_at = now() - interval '2 hours' WHERE id=$1", held_long)
    await db.execute(
        "UPDATE build_jobs SET status='done', attempt=1, picked_at=now(), completed_at=now() "
        "WHERE id=$1", done)
    await db.execute(
        "UPDATE build_jobs SET created_at = now() - interval '10 minutes' WHERE id=$1",
        old_pending)


def test_status_counts_each_queue_of_plain_jobs(runner: CliRunner, dsn: str) -> None:
    from tests.cli_executors import Ping

    async def rows(db: Database) -> None:
        queue = Queue(db, config=FAST)
        await queue.enqueue(Ping(n=1))
        await queue.enqueue(Ping(n=2), delay=3600)
        waiting = await queue.enqueue(Ping(n=3), options=JobOptions(queue="other"))
        await db.execute("UPDATE nasiko_queue_jobs SET run_at = now() - interval '90 seconds' "
                         "WHERE id = $1", waiting)
        gone = await queue.enqueue(Ping(n=4), options=JobOptions(queue="other"))
        assert await queue.cancel(gone) == "cancelled"

    with_db(dsn, rows)
    result = invoke(runner, "status", "--dsn", dsn, "--json")
    assert result.exit_code == 0, result.output
    queues = {q["queue"]: q for q in json.loads(result.stdout)["queues"]}
    assert {name: (q["available"], q["scheduled"], q["cancelled"])
            for name, q in queues.items()} == {"pings": (1, 1, 0), "other": (1, 0, 1)}
    assert 90 <= queues["other"]["oldest_available_age"] < 150
    table = invoke(runner, "status", "--dsn", dsn)
    # The general queue first; no table of build jobs where there is none (issue #46).
    assert table.stdout.lstrip().startswith("queues")
    assert "pings" in table.stdout
    assert "build jobs" not in table.stdout


def test_status_json_reports_known_rows(runner: CliRunner, dsn: str) -> None:
    with_db(dsn, _known_rows)
    result = invoke(runner, "status", "--dsn", dsn, "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)

    assert data["counts"] == {"pending": 2, "in_progress": 2, "done": 1, "failed": 0}
    held = data["in_progress"]
    assert (held["held"], held["stuck"], held["stuck_job_mins"]) == (2, 1, 60)
    picked = datetime.fromisoformat(held["oldest_picked_at"])
    assert abs(datetime.now(UTC) - timedelta(hours=2) - picked) < timedelta(minutes=1)
    assert 600 <= data["oldest_pending_age_seconds"] < 660
    plan = data["claim_plan"]
    assert plan["uses_work_queue_index"] is True
    assert plan["warning"] is False
    # Either partial index of pending rows (0001, 0011): on a table this small
    # the planner may take either.
    assert plan["node"].endswith(("using build_jobs_work_queue", "using build_jobs_pending_kind"))


def test_status_threshold_is_an_option(runner: CliRunner, dsn: str) -> None:
    with_db(dsn, _known_rows)
    result = invoke(runner, "status", "--dsn", dsn, "--json", "--stuck-job-mins", "180")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["in_progress"]["stuck"] == 0


def test_status_tables_on_an_empty_queue_and_with_build_jobs(
    runner: CliRunner, dsn: str,
) -> None:
    empty = invoke(runner, "status", "--dsn", dsn)
    assert empty.exit_code == 0, empty.output
    assert empty.stdout.startswith("no jobs yet")
    assert "workers" in empty.stdout
    assert "build jobs" not in empty.stdout
    with_db(dsn, _known_rows)
    builds = invoke(runner, "status", "--dsn", dsn)
    assert builds.exit_code == 0, builds.output
    assert "build jobs by status" in builds.stdout
    for status in ("pending", "in_progress", "done", "failed"):
        assert status in builds.stdout
    assert "claim uses the partial index" in builds.stdout


async def test_queue_status_without_the_cli(db: Database, queue: Queue) -> None:
    await enqueue_with_target(queue, "Upload")
    status = await queue_status(db, stuck_job_mins=5)
    assert status.counts == {"pending": 1, "in_progress": 0, "done": 0, "failed": 0}
    assert (status.in_progress, status.stuck, status.oldest_picked_at) == (0, 0, None)
    assert status.oldest_pending_age is not None
    assert status.claim_plan.uses_work_queue_index


async def test_status_notices_a_claim_without_the_index(db: Database) -> None:
    await db.execute("DROP INDEX build_jobs_work_queue")
    await db.execute("DROP INDEX build_jobs_pending_kind")
    plan = (await queue_status(db)).claim_plan
    assert not plan.uses_work_queue_index
    assert plan.node == "Seq Scan on build_jobs"
    # An empty table is read whole anyway: reported, but not as a problem.
    assert not plan.is_warning
    assert "fine while the table holds only 0 jobs" in plan.describe()


def _plan(*scan: dict[str, Any]) -> list[dict[str, Any]]:
    """An EXPLAIN (FORMAT JSON) of the claim's shape, with the given candidate scan."""
    cte = {"Node Type": "Limit", "Subplan Name": "CTE next",
           "Plans": [{"Node Type": "LockRows", "Plans": list(scan)}]}
    pkey = {"Node Type": "Index Scan", "Relation Name": "build_jobs",
            "Index Name": "build_jobs_pkey"}
    return [{"Plan": {"Node Type": "ModifyTable", "Plans": [cte, {"Node Type": "Nested Loop",
                                                                  "Plans": [pkey]}]}}]


def test_plan_reading_finds_the_candidate_scan() -> None:
    uses = plan_claim(_plan({"Node Type": "Index Scan", "Relation Name": "build_jobs",
                             "Index Name": "build_jobs_work_queue"}))
    assert uses == ClaimPlan(uses_work_queue_index=True,
                             node="Index Scan using build_jobs_work_queue")

    # The primary-key lookup of the UPDATE is not mistaken for the claim's search.
    seq = plan_claim(_plan({"Node Type": "Seq Scan", "Relation Name": "build_jobs"}))
    assert seq.node == "Seq Scan on build_jobs"
    big = ClaimPlan(uses_work_queue_index=False, node=seq.node, table_rows=SMALL_TABLE_ROWS)
    assert big.is_warning
    assert big.describe().startswith("WARNING: claim does not use build_jobs_work_queue")


# -- keygen ----------------------------------------------------------------------


def test_keygen_prints_a_usable_32_byte_key(runner: CliRunner) -> None:
    result = invoke(runner, "keygen")
    assert result.exit_code == 0
    key = result.stdout.strip()
    assert len(base64.urlsafe_b64decode(key)) == 32
    SecretBox.from_base64(key)
    assert invoke(runner, "keygen").stdout.strip() != key


# -- worker ----------------------------------------------------------------------


def test_executors_spec_forms(runner: CliRunner) -> None:
    assert isinstance(load_executors("tests.cli_executors:executors"), Executors)
    assert load_executors("tests.cli_executors:make_executors").kinds == {
        "Upload", "Update", "Rollback"}
    assert load_executors("tests.cli_executors:make_executors").plain_kinds == {"ping", "digest"}


def test_worker_flags_reach_the_queue_config(
    runner: CliRunner, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every tuning flag of `worker` ends up in the QueueConfig its worker runs with."""
    import nasiko_queue.cli

    configs: list[QueueConfig] = []

    async def work(dsn: str, executors: Executors, config: QueueConfig, secrets: object,
                   schedules: object = ()) -> int:
        configs.append(config)
        return 0

    monkeypatch.setattr(nasiko_queue.cli.worker, "_work", work)
    spec = ["worker", "--dsn", "postgresql://nobody@127.0.0.1:1/none", "--executors",
            "tests.cli_executors:executors"]
    assert invoke(runner, *spec).exit_code == 0
    result = invoke(runner, *spec, "--build-max-attempts", "5", "--concurrency", "4",
                    "--prefetch", "8", "--poll-interval", "0.5", "--stuck-job-mins", "90",
                    "--recovery-interval", "30", "--heartbeat-interval", "1", "--lease", "4",
                    "--rescue-interval", "2", "--no-maintenance", "--job-timeout", "600")
    assert result.exit_code == 0, result.output
    assert configs == [
        QueueConfig(),
        QueueConfig(build_max_attempts=5, concurrency=4, prefetch=8, poll_interval=0.5,
                    stuck_job_mins=90, recovery_interval=30.0, heartbeat_interval=1.0,
                    lease=4.0, rescue_interval=2.0, maintenance=False, job_timeout=600.0),
    ]
    short = invoke(runner, *spec, "--lease", "2")  # under three heartbeats of 3 s
    assert short.exit_code == 2
    assert "lease" in short.stderr
    refused = invoke(runner, *spec, "--build-max-attempts", "0")
    assert refused.exit_code == 2
    assert "--build-max-attempts" in refused.stderr
    # The former name still works, and says so (issue #21).
    old = invoke(runner, *spec, "--max-attempts", "4")
    assert old.exit_code == 0, old.output
    assert "deprecated" in old.stderr
    assert "--build-max-attempts" in old.stderr
    assert configs[-1] == QueueConfig(build_max_attempts=4)
    assert "--max-attempts" not in invoke(runner, "worker", "--help").output
    # --prefetch takes "auto" too (issue #25); unset, each lane its default.
    assert invoke(runner, *spec, "--prefetch", "auto").exit_code == 0
    assert configs[-1] == QueueConfig(prefetch="auto")
    assert configs[0].prefetch is None
    for bad in ("-1", "always"):
        refused = invoke(runner, *spec, "--prefetch", bad)
        assert refused.exit_code == 2
        assert "--prefetch" in refused.stderr


def test_the_build_jobs_attempt_cap_is_build_max_attempts_and_the_old_name_is_deprecated(
) -> None:
    """`QueueConfig.max_attempts` (3, build jobs) read like `JobOptions.max_attempts`
    (20, plain jobs): renamed where it is configured, the old name kept (issue #21)."""
    assert (QueueConfig().build_max_attempts, JobOptions().max_attempts) == (3, 20)
    with pytest.warns(DeprecationWarning, match="now build_max_attempts"):
        old = QueueConfig(max_attempts=5)  # type: ignore[call-arg]
    assert old == QueueConfig(build_max_attempts=5)
    with pytest.warns(DeprecationWarning, match="now build_max_attempts"):
        assert old.max_attempts == 5
    with pytest.warns(DeprecationWarning, match="now build_max_attempts"):
        assert attrs.evolve(old, max_attempts=2).build_max_attempts == 2
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert attrs.evolve(old, prefetch=1).build_max_attempts == 5
    with pytest.raises(ConfigurationError, match="build_max_attempts"):
        QueueConfig(build_max_attempts=0)


def test_worker_roles_by_flag_and_by_environment(
    runner: CliRunner, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Which queues a process runs, and whether it runs builds and maintenance, by
    flag or by environment variable, so that an operator can scale them apart."""
    import nasiko_queue.cli

    configs: list[QueueConfig] = []

    async def work(dsn: str, executors: Executors, config: QueueConfig, secrets: object,
                   schedules: object = ()) -> int:
        configs.append(config)
        return 0

    monkeypatch.setattr(nasiko_queue.cli.worker, "_work", work)
    spec = ["worker", "--dsn", "postgresql://nobody@127.0.0.1:1/none", "--executors",
            "tests.cli_executors:executors"]
    assert invoke(runner, *spec, "--queues", "pings=8,email", "--concurrency", "3",
                  "--no-builds", "--no-maintenance").exit_code == 0
    with monkeypatch.context() as env:
        env.setenv("NASIKO_QUEUE_QUEUES", "none")
        env.setenv("NASIKO_QUEUE_MAINTENANCE", "false")
        assert invoke(runner, *spec).exit_code == 0
    assert configs == [
        QueueConfig(queues={"pings": 8, "email": 3}, concurrency=3, builds=False,
                    maintenance=False),
        QueueConfig(queues={}, maintenance=False),
    ]
    got: list[object] = []

    async def work_with_schedules(dsn: str, executors: Executors, config: QueueConfig,
                                  secrets: object, schedules: object = ()) -> int:
        got.append((config.scheduler, schedules))
        return 0

    monkeypatch.setattr(nasiko_queue.cli.worker, "_work", work_with_schedules)
    assert invoke(runner, *spec, "--schedules", "tests.cli_executors:schedules",
                  "--no-scheduler").exit_code == 0
    from tests.cli_executors import schedules
    assert got == [(False, tuple(schedules))]
    wrong = invoke(runner, *spec, "--schedules", "tests.cli_executors:executors")
    assert wrong.exit_code == 2
    assert "not a sequence of Schedule" in wrong.stderr
    nothing = invoke(runner, *spec, "--queues", "none", "--no-builds")
    assert nothing.exit_code == 2
    assert "would run nothing" in nothing.stderr
    bad = invoke(runner, *spec, "--queues", "pings=lots")
    assert bad.exit_code == 2
    assert "--queues" in bad.stderr


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        ("tests.cli_executors:not_executors", "is a tuple, not an Executors"),
        # A class named by mistake (issue #46): one line, not the traceback of
        # calling it with no arguments.
        ("tests.cli_executors:Ping", "is a class (Ping), not an Executors"),
        ("tests.cli_executors:ping", "could not be called with no arguments"),
        ("tests.cli_executors:nothing", "has no attribute 'nothing'"),
        ("tests.no_such_module:executors", "cannot import 'tests.no_such_module'"),
        ("tests.cli_executors", "expected module:attribute"),
    ],
)
def test_worker_explains_a_bad_executors_spec(
    runner: CliRunner, dsn: str, spec: str, says: str
) -> None:
    result = invoke(runner, "worker", "--dsn", dsn, "--executors", spec)
    assert result.exit_code == 2
    assert says in _one_line_error(result)


def test_worker_refuses_a_bad_master_key(runner: CliRunner, dsn: str) -> None:
    result = invoke(runner, "worker", "--dsn", dsn, "--executors",
                    "tests.cli_executors:executors",
                    env={"NASIKO_QUEUE_MASTER_KEY": "not base64!"})
    assert result.exit_code == 2
    assert "NASIKO_QUEUE_MASTER_KEY" in _one_line_error(result)
    assert "not base64!" not in result.output


def test_worker_refuses_an_unmigrated_database(runner: CliRunner, empty_dsn: str) -> None:
    result = invoke(runner, "worker", "--dsn", empty_dsn, "--executors",
                    "tests.cli_executors:executors")
    assert result.exit_code == 1
    assert "run `nasiko-queue migrate` first" in _one_line_error(result)


@pytest.fixture
def worker_log(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "worker.log"
    yield path
    if path.exists():  # shown by pytest when the test failed
        sys.stderr.write(path.read_text())


async def _start_worker(dsn: str, log: Path, *flags: str) -> trio.Process:
    # An async test: the process is opened through trio, and its stderr goes to a
    # file so that a chatty worker can never block on a full pipe.
    with log.open("wb") as out:
        return await trio.lowlevel.open_process(
            [sys.executable, "-m", "nasiko_queue", "worker", "--dsn", dsn,
             "--executors", "tests.cli_executors:executors", "--poll-interval", "0.1",
             *flags],
            cwd=REPO, stdin=subprocess.DEVNULL, stdout=out, stderr=out,
        )


async def _wait_for(what: str, check: Callable[[], Awaitable[bool]], proc: trio.Process) -> None:
    """Poll `check` (a cheap DB read or file read) until true, for at most DEADLINE seconds."""
    with trio.move_on_after(DEADLINE):
        while not await check():
            if proc.returncode is not None:
                pytest.fail(f"the worker exited with {proc.returncode} before {what}")
            await trio.sleep(0.05)
        return
    proc.kill()
    pytest.fail(f"timed out after {DEADLINE}s waiting for {what}")


async def _job(db: Database, job_id: UUID) -> Any:
    return await db.fetchrow(
        "SELECT status, attempt, picked_at, error_msg FROM build_jobs WHERE id=$1", job_id)


async def _job_status(db: Database, job_id: UUID) -> str:
    status: str = (await _job(db, job_id))["status"]
    return status


@pytest.mark.slow
async def test_worker_process_runs_a_job_and_stops_on_sigterm(
    dsn: str, queue: Queue, worker_log: Path
) -> None:
    proc = await _start_worker(dsn, worker_log)
    try:
        job = await enqueue_with_target(queue, "Upload")

        async def done() -> bool:
            return await _job_status(queue.db, job.job_id) == "done"

        await _wait_for("the job to be done", done, proc)
        proc.send_signal(signal.SIGTERM)
        with trio.fail_after(DEADLINE):
            assert await proc.wait() == 0
    finally:
        if proc.returncode is None:
            proc.kill()
    assert "stopping once the running jobs finish" in await trio.Path(worker_log).read_text()


@pytest.mark.slow
async def test_worker_process_second_signal_stops_at_once(
    dsn: str, queue: Queue, worker_log: Path
) -> None:
    """First SIGTERM waits for the endless job; the second cancels it, hands it back, exits 130."""
    proc = await _start_worker(dsn, worker_log)
    try:
        job = await enqueue_with_target(queue, "Update")

        async def running() -> bool:
            # The executor has started (it marks its build row), not only the claim:
            # a graceful stop gives back a claimed job that has not started yet,
            # attempt restored (docs/rules.md §8).
            build = await queue.db.fetchval(
                "SELECT status FROM agent_builds WHERE id = $1", job.build_id)
            return build == "building"

        async def stopping() -> bool:
            text = await trio.Path(worker_log).read_text()
            return "stopping once the running jobs finish" in text

        await _wait_for("the job's executor to start", running, proc)
        proc.send_signal(signal.SIGTERM)
        await _wait_for("the first signal to be handled", stopping, proc)
        assert proc.returncode is None  # still waiting for the running job
        proc.send_signal(signal.SIGTERM)
        with trio.fail_after(DEADLINE):
            assert await proc.wait() == 130
    finally:
        if proc.returncode is None:
            proc.kill()
    row = await _job(queue.db, job.job_id)
    assert (row["status"], row["attempt"], row["picked_at"]) == ("pending", 1, None)


@pytest.mark.slow
async def test_worker_process_max_attempts_caps_the_runs(
    dsn: str, queue: Queue, worker_log: Path
) -> None:
    """With --build-max-attempts 1 an executor that always raises runs once (the
    default: 3)."""
    proc = await _start_worker(dsn, worker_log, "--build-max-attempts", "1")
    try:
        job = await enqueue_with_target(queue, "Rollback", prior_success=True)

        async def finished() -> bool:
            return await _job_status(queue.db, job.job_id) == "failed"

        await _wait_for("the job to fail", finished, proc)
        proc.send_signal(signal.SIGTERM)
        with trio.fail_after(DEADLINE):
            assert await proc.wait() == 0
    finally:
        if proc.returncode is None:
            proc.kill()
    row = await _job(queue.db, job.job_id)
    assert (row["attempt"], row["error_msg"]) == (1, "job panicked during execution")


# -- bench -----------------------------------------------------------------------


def _as_installed(cwd: Path, installed: Path, code: str) -> subprocess.CompletedProcess[str]:
    """
    Run `code` as the `nasiko-queue` script of a non-editable install runs, in `cwd`.

    The package is a copy in `installed` (a stand-in for site-packages, with no
    checkout around it); neither the current directory nor this checkout is on
    sys.path (`-P`), and `-S` skips the .pth files through which an editable
    install of some checkout would make its `benchmarks` importable.
    """
    shutil.copytree(REPO / "nasiko_queue", installed / "nasiko_queue",
                    ignore=shutil.ignore_patterns("__pycache__"), dirs_exist_ok=True)
    code = ("import nasiko_queue.cli as cli\n"
            f"assert cli.__file__.startswith({str(installed)!r}), cli.__file__\n" + code)
    path = os.pathsep.join([str(installed), sysconfig.get_paths()["purelib"]])
    return subprocess.run([sys.executable, "-S", "-P", "-c", code], cwd=cwd,
                          capture_output=True, text=True, timeout=DEADLINE, check=False,
                          env={**os.environ, "PYTHONPATH": path})


def test_bench_finds_the_runner_in_the_current_directory(tmp_path: Path) -> None:
    """After `pip install .`, `nasiko-queue bench` in the repository root uses its benchmarks/."""
    checkout = tmp_path / "checkout"
    (checkout / "benchmarks").mkdir(parents=True)
    (checkout / "benchmarks" / "__init__.py").write_text("")
    (checkout / "benchmarks" / "runner.py").write_text("def run_benchmarks(): ...\n")
    proc = _as_installed(checkout, tmp_path / "site-packages",
                         "print(cli.tools._import_bench_runner().__file__)")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(checkout / "benchmarks" / "runner.py")


def test_bench_outside_a_checkout_says_where_to_run_it(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    proc = _as_installed(elsewhere, tmp_path / "site-packages", "cli.main(['bench'])")
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [
        "Error: the benchmark runner is the benchmarks/ folder of a source checkout, and "
        f"neither {elsewhere} nor this installation has one: clone the repository and run "
        "`nasiko-queue bench` from its root"]


def test_bench_refuses_some_other_benchmarks_folder(tmp_path: Path) -> None:
    project = tmp_path / "project"
    (project / "benchmarks").mkdir(parents=True)
    (project / "benchmarks" / "runner.py").write_text("SIZES = ()\n")
    proc = _as_installed(project, tmp_path / "site-packages", "cli.main(['bench'])")
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [
        f"Error: {project / 'benchmarks' / 'runner.py'} is not nasiko-queue's benchmark "
        "runner: run `nasiko-queue bench` from the root of a nasiko-queue checkout"]


def _runner_that_measures_nothing(seen: dict[str, Any], plots: bool) -> types.SimpleNamespace:
    """A benchmark runner that measures nothing, and plots only when `plots` (matplotlib)."""

    def run_benchmarks(dsn: str, sizes: object, *, console: Console, database: str) -> Any:
        seen["database"] = database
        return {"meta": {}}

    def write_json(result: Any, path: Path) -> None:
        path.write_text(json.dumps(result))

    return types.SimpleNamespace(
        TINY="tiny", FULL="full", DEFAULT="default", run_benchmarks=run_benchmarks,
        table=lambda result: "(the table)", write_json=write_json, plot=lambda *_: plots)


@pytest.mark.parametrize("plots", [False, True], ids=["no-matplotlib", "matplotlib"])
def test_bench_messages_keep_their_square_brackets(
    runner: CliRunner, dsn: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, plots: bool
) -> None:
    """Rich reads [words] as markup; the pip extra and the user's paths must survive it."""
    import nasiko_queue.cli

    seen: dict[str, Any] = {}
    monkeypatch.setattr(nasiko_queue.cli.tools, "_import_bench_runner",
                        lambda: _runner_that_measures_nothing(seen, plots))
    out, png = tmp_path / "results[new].json", tmp_path / "bench[new].png"
    result = invoke(runner, "bench", "--dsn", dsn, "--out", str(out), "--plot", str(png))
    assert result.exit_code == 0, result.output
    assert json.loads(out.read_text()) == {"meta": {}}
    lines = result.stdout.splitlines()
    assert f"Benchmarking on {seen['database']}." in lines
    assert f"Results written to {out}." in lines
    if plots:
        assert f"Plot written to {png}." in lines
    else:
        assert ("No plot: matplotlib is not installed (pip install 'nasiko-queue[bench]')."
                in lines)


# -- demo ------------------------------------------------------------------------


def test_demo_every_scenario_ends_as_the_rules_say(runner: CliRunner, dsn: str) -> None:
    result = invoke(runner, "demo", "--dsn", dsn, "--delay", "0")
    assert result.exit_code == 0, result.output
    assert "✗" not in result.stdout
    # The job queue's 7 rows; the builds' 13, the secret note and the verdict.
    assert result.stdout.count("✓") == 7 + 13 + 1 + 1
    assert "All 13 scenarios ended as docs/rules.md says." in result.stdout
    # The general queue comes first; the build worker after it (issue #46).
    queue_part = result.stdout.index("Part 1: the job queue")
    assert queue_part < result.stdout.index("... retried from the dead letters") < \
        result.stdout.index("Part 2: the Nasiko build worker")
    assert "expected (docs/rules.md)" in result.stdout
    # The contract the project was built from is not in the repository: never cite it.
    assert "SPEC" not in result.output
    assert "(sealed); executor received the plaintext" in result.stdout


def test_demo_says_its_errors_are_simulated_before_they_appear(
    runner: CliRunner, dsn: str
) -> None:
    """A new user must not read the crashes the scenarios provoke as the demo failing."""
    result = invoke(runner, "demo", "--dsn", dsn, "--delay", "0")
    assert result.exit_code == 0, result.output
    text = result.stdout
    log_lines = re.findall(r"^(EXPECTED|ERROR|WARNING|INFO) +nasiko_queue", text, re.MULTILINE)
    # The job queue: 2 crashes of the card charge, 2 of the notification and its
    # discard. The builds: 2 crashes of the flaky job, 3 + 3 of the two that
    # always crash; 3 refusals.
    assert log_lines == ["EXPECTED"] * (5 + 11)
    first = re.search(r"^EXPECTED ", text, re.MULTILINE)
    assert first is not None
    note = text.find("simulated on purpose")
    assert 0 <= note < first.start()


def test_demo_log_marks_only_what_the_scenarios_provoke() -> None:
    """Real errors and warnings keep their level; each refusal is expected once only."""
    out = io.StringIO()
    log = logging.getLogger("nasiko_queue.worker")
    refused = uuid.uuid4()
    crashes = [SimulatedCrash("simulated crash of the Upload executor"),
               ExceptionGroup("in a nursery", [SimulatedCrash("simulated crash, grouped")]),
               RuntimeError("disk full")]
    with DemoLog.shown(Console(file=out, width=200), "WARNING") as handler:
        handler.expect_refusal(refused)
        for exc in crashes:
            log.error("job %s panicked", "j1", exc_info=exc)
        log.warning("job %s: target agent is deleted; not running", refused)
        log.warning("job %s update failed (%s); retrying", refused, "timeout")
        log.warning("LISTEN connection lost")
        log.info("not shown at WARNING")
    assert [line.rstrip() for line in out.getvalue().splitlines()] == [
        "EXPECTED nasiko_queue.worker: job j1 panicked "
        "(SimulatedCrash: simulated crash of the Upload executor)",
        "EXPECTED nasiko_queue.worker: job j1 panicked (SimulatedCrash: simulated crash, grouped)",
        "ERROR    nasiko_queue.worker: job j1 panicked (RuntimeError: disk full)",
        f"EXPECTED nasiko_queue.worker: job {refused}: target agent is deleted; not running",
        f"WARNING  nasiko_queue.worker: job {refused} update failed (timeout); retrying",
        "WARNING  nasiko_queue.worker: LISTEN connection lost",
    ]


def test_a_job_queue_row_that_differs_fails_the_demo() -> None:
    """The tour's rows count in the verdict: the demo checks, it does not only show."""
    from nasiko_queue.cli.demo import DemoReport, DemoRow, _done
    from nasiko_queue.cli.demo_queue import TourRow

    build = DemoRow(kind="Upload", scenario="builds", observed=_done(), expected=_done())
    good = TourRow("a workflow", "total 1000", "total 1000")
    bad = TourRow("a workflow", "total 900", "total 1000")
    assert DemoReport((build,), (good,)).ok
    assert not DemoReport((build,), (good, bad)).ok


def test_demo_refuses_a_database_with_unfinished_jobs(runner: CliRunner, dsn: str) -> None:
    async def one_pending(db: Database) -> None:
        await enqueue_with_target(Queue(db, config=FAST), "Upload")

    with_db(dsn, one_pending)
    result = invoke(runner, "demo", "--dsn", dsn, "--delay", "0")
    assert result.exit_code == 1
    assert "the database has 1 unfinished job(s)" in result.output
    assert "Traceback" not in result.output


def test_demo_refuses_a_database_with_plain_jobs_its_worker_would_take(
    runner: CliRunner, dsn: str,
) -> None:
    """Found by review: the demo's first worker runs queues `email` and `default`;
    an application's own waiting job there was claimed and given back unrun, with
    errors in the log. The demo refuses such a database, as it does for build jobs."""
    from .cli_executors import Ping

    async def one_waiting(db: Database) -> None:
        await Queue(db, config=FAST).enqueue(Ping(), options=JobOptions(queue="email"))

    with_db(dsn, one_waiting)
    result = invoke(runner, "demo", "--dsn", dsn, "--delay", "0")
    assert result.exit_code == 1
    assert "the database has 1 unfinished job(s)" in result.output


async def test_run_demo_covers_all_seven_kinds(dsn: str) -> None:
    out = io.StringIO()
    report = await run_demo(dsn, console=Console(file=out, width=160), delay=0)
    assert report.ok, out.getvalue()
    assert {row.kind for row in report.rows} == set(KINDS)
    assert {row.observed.job for row in report.rows} == {"done", "failed", "gone"}


@pytest.mark.slow
def test_demo_without_dsn_uses_a_private_server(runner: CliRunner) -> None:
    result = invoke(runner, "demo", "--delay", "0")
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith("Started a private PostgreSQL server at 127.0.0.1:")
    assert "All 13 scenarios ended as docs/rules.md says." in result.stdout
    assert result.stdout.rstrip().endswith("Removed the private PostgreSQL server.")


# -- job -------------------------------------------------------------------------

TOKEN = "tok-cli-8d2e4b7a"


async def _crashed_jobs(db: Database) -> tuple[UUID, UUID]:
    """Two jobs whose executor quotes its token and crashes three times: one keeps
    its row (the agent had built before), one is deleted with its connector."""
    from .conftest import MASTER_KEY
    from .helpers import executors_for_all, running

    async def refuse(ctx: Any) -> None:
        raise RuntimeError(f"refused {ctx.payload.env['API_TOKEN'].reveal()}")

    queue = Queue(db, config=FAST, secrets=MASTER_KEY)
    kept = await enqueue_with_target(queue, "Upload", prior_success=True,
                                     env={"API_TOKEN": TOKEN, "LOG_LEVEL": "info"})
    gone = await enqueue_with_target(queue, "McpServerUpload", env={"API_TOKEN": TOKEN})
    async with running(queue, executors_for_all(refuse)) as worker:
        with trio.fail_after(20):
            await worker.wait_for(lambda s: s.failed >= 2)
    return kept.job_id, gone.job_id


def test_job_shows_the_row_the_masked_payload_and_each_error(runner: CliRunner,
                                                            dsn: str) -> None:
    kept, gone = with_db(dsn, _crashed_jobs)
    result = invoke(runner, "job", str(kept), "--dsn", dsn, "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert (data["kind"], data["status"], data["attempt"], data["error_msg"]) == (
        "Upload", "failed", 3, "job panicked during execution")
    assert data["payload"]["env"] == {"API_TOKEN": "********", "LOG_LEVEL": "********"}
    assert data["payload"]["agent_id"] == data["agent_id"]  # the rest as stored
    assert [(e["attempt"], e["reason"], e["error_type"], e["message"])
            for e in data["errors"]] == [
        (n, "crash", "builtins.RuntimeError", "refused ********") for n in (1, 2, 3)]

    tables = invoke(runner, "job", str(kept), "--dsn", dsn)
    assert tables.exit_code == 0, tables.output
    assert "attempt 3" in tables.stdout
    assert "refused ********" in tables.stdout
    for output in (result.stdout, tables.stdout):
        assert TOKEN not in output
        assert "nq1:" not in output  # not even sealed

    gone_out = invoke(runner, "job", str(gone), "--dsn", dsn)
    assert gone_out.exit_code == 0, gone_out.output
    # Deleted with its never-built target, it is shown from its kept copy.
    assert "a kept copy: its target was deleted with it" in gone_out.stdout
    assert all(f"attempt {n} crash" in gone_out.stdout for n in (1, 2, 3))
    with_db(dsn, lambda db: db.execute("DELETE FROM nasiko_queue_deleted_build_jobs"))
    alone = invoke(runner, "job", str(gone), "--dsn", dsn)
    assert "the row is gone (deleted with its target); 3 error(s) kept" in alone.stdout
    assert TOKEN not in gone_out.stdout

    missing = invoke(runner, "job", str(uuid.uuid4()), "--dsn", dsn)
    assert missing.exit_code == 1
    assert "no job" in missing.output


def test_job_speaks_plain_job_words_for_a_plain_job(runner: CliRunner, dsn: str) -> None:
    """`nasiko-queue job` shows a plain job's state, priority, run_at, attempted_at
    and error, not the build words (picked_at, agent_id) it showed (issue #21)."""
    from .cli_executors import Ping
    async def setup(db: Database) -> tuple[UUID, UUID]:
        queue = Queue(db, config=FAST)
        job = await queue.enqueue(Ping(n=7), delay=3600,
                                  options=JobOptions(queue="qa", priority=4))
        await db.execute("UPDATE nasiko_queue_jobs SET attempted_at = now(), "
                         "error_msg = 'smtp down' WHERE id = $1", job)
        build = await enqueue_with_target(queue, "Upload")
        return job, build.job_id

    plain, build = with_db(dsn, setup)
    shown = invoke(runner, "job", str(plain), "--dsn", dsn)
    assert shown.exit_code == 0, shown.output
    labels = {line.strip("│┃ ").split(" ")[0] for line in shown.stdout.splitlines()}
    assert {"state", "priority", "run_at", "attempted_at", "finished_at", "error", "queue",
            "max_attempts"} <= labels
    assert not {"picked_at", "completed_at", "agent_id", "owner_id", "status"} & labels
    assert "smtp down" in shown.stdout
    data = json.loads(invoke(runner, "job", str(plain), "--dsn", dsn, "--json").stdout)
    assert (data["state"], data["queue"], data["priority"], data["status"]) == (
        "available", "qa", 4, "available")
    assert data["attempted_at"] is not None
    assert data["run_at"] is not None
    assert not {"picked_at", "completed_at", "agent_id"} & data.keys()
    assert data["payload"] == {"kind": "ping", "n": 7}
    built = invoke(runner, "job", str(build), "--dsn", dsn)
    assert "picked_at" in built.stdout
    assert "agent_id" in built.stdout


def test_job_shows_a_completed_jobs_result(runner: CliRunner, dsn: str) -> None:
    """What the executor returned is shown, its sealed tokens masked (issue #22)."""
    from .cli_executors import Ping
    from .conftest import MASTER_KEY

    async def setup(db: Database) -> UUID:
        job = await Queue(db, config=FAST).enqueue(Ping(n=7))
        await db.execute("UPDATE nasiko_queue_jobs SET state = 'completed', finished_at = "
                         "now(), result = $2::jsonb WHERE id = $1", job,
                         json.dumps({"pong": 7, "token": MASTER_KEY.seal(uuid.uuid4(), "t",
                                                                          "s3cret")}))
        return job

    job = with_db(dsn, setup)
    shown = invoke(runner, "job", str(job), "--dsn", dsn)
    assert shown.exit_code == 0, shown.output
    assert '"pong": 7' in shown.stdout
    data = json.loads(invoke(runner, "job", str(job), "--dsn", dsn, "--json").stdout)
    assert data["result"] == {"pong": 7, "token": "********"}
    assert "s3cret" not in shown.stdout


def test_enqueue_writes_the_row_enqueue_writes_and_prints_its_id(
    runner: CliRunner, dsn: str
) -> None:
    """`nasiko-queue enqueue KIND JSON` (issue #21): the kind need not be known here."""
    from .cli_executors import Ping

    result = invoke(runner, "enqueue", "ping", '{"n": 3}', "--dsn", dsn, "--queue", "pings",
                    "--priority", "-2", "--max-attempts", "4", "--delay", "60",
                    "--executors", "tests.cli_executors:executors")
    assert result.exit_code == 0, result.output
    job_id = UUID(result.stdout.strip())

    async def rows(db: Database) -> Any:
        twin = await Queue(db, config=FAST).enqueue(Ping(n=3))
        return [await db.fetchrow(
            "SELECT queue, kind, payload, priority, max_attempts, state, run_at - created_at "
            "AS wait FROM nasiko_queue_jobs WHERE id = $1", i) for i in (job_id, twin)]

    ours, twin = with_db(dsn, rows)
    assert (ours["kind"], ours["payload"]) == (twin["kind"], twin["payload"])
    assert json.loads(ours["payload"]) == {"kind": "ping", "n": 3}
    assert (ours["queue"], ours["priority"], ours["max_attempts"], ours["state"]) == (
        "pings", -2, 4, "available")
    assert timedelta(seconds=59) < ours["wait"] < timedelta(seconds=61)

    at = "2031-05-01T09:30:00+00:00"
    later = invoke(runner, "enqueue", "report.daily", "--dsn", dsn, "--run-at", at,
                   "--any-kind")
    assert later.exit_code == 0, later.output
    row = with_db(dsn, lambda db: db.fetchrow(
        "SELECT queue, payload, run_at FROM nasiko_queue_jobs WHERE id = $1",
        UUID(later.stdout.strip())))
    assert (row["queue"], json.loads(row["payload"])) == ("default", {"kind": "report.daily"})
    assert row["run_at"] == datetime.fromisoformat(at)

    first = invoke(runner, "enqueue", "ping", "{}", "--dsn", dsn, "--unique", "once",
                   "--any-kind")
    second = invoke(runner, "enqueue", "ping", '{"n": 1}', "--dsn", dsn, "--unique", "once",
                    "--any-kind")
    assert first.exit_code == second.exit_code == 0
    assert first.stdout == second.stdout
    assert "already holds unique key 'once': nothing enqueued" in second.stderr
    assert first.stderr == ""


def test_enqueue_with_a_registry_takes_the_types_options(runner: CliRunner, dsn: str) -> None:
    """Regression (found by the README's quickstart test): with --executors, a job
    went to queue 'default' although its type says `JobOptions(queue="pings")`, and
    no worker of that type's queue ever ran it. The type's options apply, as in
    `Queue.enqueue`; a flag given overrides them."""
    registry = ("--executors", "tests.cli_executors:executors")
    typed = invoke(runner, "enqueue", "ping", "{}", "--dsn", dsn, *registry)
    given = invoke(runner, "enqueue", "ping", "{}", "--dsn", dsn, *registry,
                   "--queue", "other", "--max-attempts", "2")
    assert typed.exit_code == given.exit_code == 0, typed.output + given.output

    def queue_of(job: str) -> Any:
        return with_db(dsn, lambda db: db.fetchrow(
            "SELECT queue, max_attempts FROM nasiko_queue_jobs WHERE id = $1", UUID(job)))

    assert tuple(queue_of(typed.stdout.strip())) == ("pings", 20)
    assert tuple(queue_of(given.stdout.strip())) == ("other", 2)

    # Review: with --any-kind too, a kind the registry names is its type's job; and
    # the type's unique key holds, as for `Queue.enqueue`.
    anyway = invoke(runner, "enqueue", "ping", "{}", "--dsn", dsn, *registry, "--any-kind")
    assert anyway.exit_code == 0, anyway.output
    assert tuple(queue_of(anyway.stdout.strip())) == ("pings", 20)
    first = invoke(runner, "enqueue", "digest", '{"day": "mon"}', "--dsn", dsn, *registry)
    again = invoke(runner, "enqueue", "digest", '{"day": "mon"}', "--dsn", dsn, *registry)
    assert first.exit_code == again.exit_code == 0, first.output + again.output
    assert first.stdout == again.stdout
    assert "already holds unique key 'digest:mon': nothing enqueued" in again.stderr


def test_enqueue_refuses_a_kind_no_worker_would_run(runner: CliRunner, dsn: str) -> None:
    """A typo was given back every 15 s for ever (issue #46): refused, with the near miss."""
    registry = ("--executors", "tests.cli_executors:executors")
    typo = invoke(runner, "enqueue", "pnig", "{}", "--dsn", dsn, *registry)
    assert typo.exit_code == 2
    assert "registers no plain job of kind 'pnig'; did you mean 'ping'?" in typo.stderr
    wrong = invoke(runner, "enqueue", "ping", '{"n": "3"}', "--dsn", dsn, *registry)
    assert wrong.exit_code == 2
    assert "invalid ping payload: field 'n': expected an integer" in wrong.stderr
    alone = invoke(runner, "enqueue", "ping", "{}", "--dsn", dsn)
    assert alone.exit_code == 2
    assert "no live worker to check kind 'ping' against" in alone.stderr

    async def live_worker(db: Database) -> None:
        await db.execute("INSERT INTO nasiko_queue_workers (id, host, pid, kinds, lease_secs) "
                         "VALUES ($1, 'h', 1, ARRAY['ping', 'report.daily'], 60)", uuid.uuid4())

    with_db(dsn, live_worker)
    served = invoke(runner, "enqueue", "ping", "{}", "--dsn", dsn)
    assert served.exit_code == 0, served.output
    near = invoke(runner, "enqueue", "report.dialy", "{}", "--dsn", dsn)
    assert near.exit_code == 2
    assert "no live worker runs kind 'report.dialy'; did you mean 'report.daily'?" in \
        near.stderr
    assert with_db(dsn, lambda db: db.fetchval(
        "SELECT count(*) FROM nasiko_queue_jobs")) == 1


@pytest.mark.parametrize(("args", "message"), [
    (["ping", "{not json"], "JSON is not valid JSON"),
    (["ping", "[1, 2]"], "JSON must be an object of the job's fields, not list"),
    (["ping", '{"kind": "pong"}'], "the arguments name kind 'pong', not 'ping'"),
    (["", "{}"], "a job kind is a non-empty string"),
    (["x" * 101, "{}"], "a job kind has at most 100 characters"),
    (["Upload", "{}"], "Upload is a build job's kind"),
    (["ping", "{}", "--queue", "builds"], "'builds' is the name build jobs go by"),
    (["ping", "{}", "--run-at", "2031-05-01T09:30"], "has no UTC offset"),
    (["ping", "{}", "--run-at", "tomorrow"], "is not an ISO 8601 time"),
    (["ping", "{}", "--run-at", "2031-05-01T09:30Z", "--delay", "5"], "not both"),
    (["ping", "{}", "--priority", "40000"], "--priority"),
    # A bug hunt's: each reached the database (or the worker) before.
    (["ping", "{}", "--run-at", "0001-01-01T00:00:00+00:00"], "within 100 years of now"),
    (["ping", "{}", "--delay", "nan"], "delay is 0 to"),
    (["ping", "{}", "--delay", "1e300"], "delay is 0 to"),
])
def test_enqueue_refuses_bad_input_in_one_line(runner: CliRunner, args: list[str],
                                               message: str) -> None:
    result = invoke(runner, "enqueue", *args, "--dsn", "postgresql://nobody@127.0.0.1:1/x")
    assert result.exit_code == 2, result.output
    assert message in result.stderr
    assert "Traceback" not in result.stderr
    if not {"--priority", "--run-at", "--delay"} & set(args):  # click prints its usage
        assert len(result.stderr.strip().splitlines()) == 1
    missing = invoke(runner, "enqueue", "ping", "{}", env={"DATABASE_URL": ""})
    assert missing.exit_code == 2
    assert "pass --dsn or set DATABASE_URL" in missing.stderr


@pytest.mark.slow
async def test_worker_processes_with_split_roles_run_only_their_part(
    dsn: str, queue: Queue, tmp_path: Path
) -> None:
    """Two processes of one application: one runs the build jobs and maintenance,
    the other only the queue "pings" (by environment variables). Each job runs in
    the process whose role it is; the workers' rows say which kinds they run."""
    from tests.cli_executors import Ping

    builds_log, pings_log = tmp_path / "builds.log", tmp_path / "pings.log"
    builds = await _start_worker(dsn, builds_log, "--queues", "none")
    env = {**os.environ, "NASIKO_QUEUE_QUEUES": "pings=2", "NASIKO_QUEUE_BUILDS": "false",
           "NASIKO_QUEUE_MAINTENANCE": "false"}
    with pings_log.open("wb") as out:
        pings = await trio.lowlevel.open_process(
            [sys.executable, "-m", "nasiko_queue", "worker", "--dsn", dsn,
             "--executors", "tests.cli_executors:executors", "--poll-interval", "0.1"],
            cwd=REPO, stdin=subprocess.DEVNULL, stdout=out, stderr=out, env=env)
    try:
        job = await enqueue_with_target(queue, "Upload")
        ping = await queue.enqueue(Ping(n=1))

        async def both_done() -> bool:
            state = await queue.db.fetchval(
                "SELECT state FROM nasiko_queue_jobs WHERE id = $1", ping)
            return state == "completed" and await _job_status(queue.db, job.job_id) == "done"

        await _wait_for("both jobs to be done", both_done, builds)
        held = {r["pid"]: r["claimed"] for r in await queue.db.fetch(
            "SELECT w.pid, (SELECT count(*) FROM build_jobs AS j WHERE j.claimed_by = w.id) "
            "+ (SELECT count(*) FROM nasiko_queue_jobs AS p WHERE p.claimed_by = w.id) "
            "AS claimed FROM nasiko_queue_workers AS w")}
        assert held == {builds.pid: 1, pings.pid: 1}
        for proc in (builds, pings):
            proc.send_signal(signal.SIGTERM)
        with trio.fail_after(DEADLINE):
            assert await builds.wait() == 0
            assert await pings.wait() == 0
    finally:
        for proc in (builds, pings):
            if proc.returncode is None:
                proc.kill()
    assert "lanes: pings=2" in pings_log.read_text()
    assert "lanes: builds=1" in builds_log.read_text()
