"""
Real `nasiko-queue worker` processes on one real PostgreSQL database (SPEC §5, §7, §8).

Replicas draining one table, a worker killed with SIGKILL in the middle of a job
and rescued from its missed heartbeats, SIGTERM once and twice, rescues and sweeps
racing completions, and one leader sweeping while replicas' startup sweeps run
at once. Every run of every job is recorded by the executor itself
(`tests/proc_executors.py`), so "ran exactly once" is counted, not assumed. Leases
are a second long here (the defaults' 30 s figure is in test_process_leases.py);
stuck jobs are made stuck by ageing `picked_at` in SQL, never by waiting an hour.
"""

from __future__ import annotations

import json
import re
import signal
from collections import Counter
from pathlib import Path
from typing import Any
from uuid import UUID

import pytest
import trio

from nasiko_queue import Database, Queue
from nasiko_queue.builds.store import PgJobStore
from nasiko_queue.engine.contracts import MAX_ATTEMPTS_EXCEEDED

from .procs import (
    AGE_PAST_THRESHOLD,
    KINDS,
    TRANSITIONS_DDL,
    Run,
    WorkerProcess,
    audit_runs,
    create_executions_table,
    create_targets,
    enqueue_jobs,
    gate_closed,
    insert_serde_jobs,
    one_run_per_attempt,
    runs_by_job,
    status_counts,
    wait_for_log,
    wait_until,
    worker_processes,
)

pytestmark = pytest.mark.slow

#: Heartbeats every 0.2 s, a worker dead after 1 s without one, a rescue round
#: every 0.1 s: a killed worker's jobs are back within about 1.3 s.
SHORT_LEASES = ("--heartbeat-interval", "0.2", "--lease", "1", "--rescue-interval", "0.1")


#: The leader's rescue round, with the number of jobs it failed for good.
_RESCUE_LINE = r"rescue: \d+ job\(s\) of dead workers back to pending, (\d+) failed for good"


def _logged_counts(worker: WorkerProcess, pattern: str) -> int:
    """The sum of the first number of every log line of `worker` that matches `pattern`."""
    return sum(int(m.group(1)) for m in re.finditer(pattern, worker.log_text()))


async def _job(db: Database, job_id: UUID) -> dict[str, Any] | None:
    row = await db.fetchrow(
        "SELECT status, attempt, error_msg, picked_at, completed_at FROM build_jobs "
        "WHERE id = $1", job_id)
    return None if row is None else dict(row)


async def _status_is(db: Database, job_id: UUID, status: str) -> bool:
    row = await _job(db, job_id)
    return row is not None and row["status"] == status


async def _runs_of(db: Database, job_id: UUID) -> list[Run]:
    return (await runs_by_job(db)).get(job_id, [])


# -- replicas ------------------------------------------------------------------------------


async def _original_replica(db: Database, inserted: trio.Event) -> None:
    """
    A replica speaking the original Rust worker's own statements (reference §5.1, §6):
    claim one row with SELECT … FOR UPDATE SKIP LOCKED LIMIT 1 and UPDATE in one
    transaction, run, then `mark_job` done. It shares the table with our workers.
    """

    async def claim(conn: Any) -> Any:
        async with conn.transaction():
            row = await conn.fetchrow(
                "SELECT id, agent_id, connector_id, payload::text AS payload, attempt "
                "FROM build_jobs WHERE status = 'pending' ORDER BY created_at "
                "FOR UPDATE SKIP LOCKED LIMIT 1")
            if row is not None:
                await conn.execute(
                    "UPDATE build_jobs SET status = 'in_progress', picked_at = now(), "
                    "attempt = attempt + 1 WHERE id = $1", row["id"])
            return row

    while True:
        row = await db.run(claim)
        if row is None:
            if inserted.is_set():
                return
            with trio.move_on_after(0.05):  # the replica's own poll timer
                await inserted.wait()
            continue
        payload = json.loads(row["payload"])
        build_id = UUID(payload.get("build_id") or payload["rollback_build_id"])
        connector = row["connector_id"] is not None
        builds = "mcp_connector_builds" if connector else "agent_builds"
        await db.execute(
            f"WITH b AS (UPDATE {builds} SET status = 'success' WHERE id = $2) "
            "INSERT INTO executions (job_id, build_id, attempt, replica, finished_at) "
            "VALUES ($1, $2, $3, 'original-sql', clock_timestamp())",
            row["id"], build_id, row["attempt"] + 1)
        await db.execute(
            "UPDATE build_jobs SET status = 'done', error_msg = NULL, completed_at = now() "
            "WHERE id = $1", row["id"])


async def test_four_worker_processes_and_an_original_replica_run_every_job_once(
    dsn: str, queue: Queue, tmp_path: Path
) -> None:
    """
    4 worker processes, plus a replica using the original's own SQL, drain 2,000 jobs
    of all seven kinds: half enqueued through `Queue.enqueue`, half inserted by SQL in
    the original's serde JSON, both while the replicas run. Every job runs exactly once
    (counted by the executor) and ends done with attempt 1.
    """
    db = queue.db
    await create_executions_table(db)
    n_api, n_sql = 1000, 1000
    api_targets = await create_targets(db, [f"ok:api{i}" for i in range(n_api)], KINDS)
    sql_targets = await create_targets(db, [f"ok:sql{i}" for i in range(n_sql)], KINDS)

    async with worker_processes(dsn, tmp_path) as procs:
        workers = await procs.start_all(4)
        inserted = trio.Event()
        api_ids: list[UUID] = []
        sql_ids: list[UUID] = []

        async def insert_all() -> None:
            # Interleaved: serde rows land in chunks while API jobs are being enqueued.
            for chunk in range(0, n_sql, 200):
                sql_ids.extend(await insert_serde_jobs(db, sql_targets[chunk:chunk + 200]))
                api_ids.extend(await enqueue_jobs(queue, api_targets[chunk:chunk + 200]))
            inserted.set()

        with trio.fail_after(120):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(insert_all)
                nursery.start_soon(_original_replica, db, inserted)
        all_ids = api_ids + sql_ids

        async def drained() -> bool:
            return (await status_counts(db, all_ids))["done"] == len(all_ids)

        await wait_until("every job to be done", drained, alive=workers)
        for w in workers:
            w.signal(signal.SIGTERM)
        assert [await w.wait_exit() for w in workers] == [0, 0, 0, 0]

    assert await status_counts(db) == Counter({"done": n_api + n_sql})
    assert await db.fetchval("SELECT count(*) FROM build_jobs WHERE attempt <> 1") == 0
    runs = await runs_by_job(db)
    audit = audit_runs(runs, all_ids)
    assert audit.runs == audit.jobs == n_api + n_sql  # one run per job, no more, no less
    assert audit.never_finished == []
    assert audit.rerun_after_finish == []
    assert set(runs) == set(all_ids)

    by_replica = Counter(r.replica for rs in runs.values() for r in rs)
    assert set(by_replica) == {w.replica for w in workers} | {"original-sql"}, by_replica
    # One table, two writers, two readers: our workers ran serde rows of all seven
    # kinds, and the original's statements ran rows that `Queue.enqueue` wrote.
    kind_of = dict(zip(sql_ids, (t.kind for t in sql_targets), strict=True))
    assert {kind_of[j] for j in sql_ids if runs[j][0].replica != "original-sql"} == set(KINDS)
    assert any(runs[j][0].replica == "original-sql" for j in api_ids)
    # Every build row of every job ended 'success'.
    assert await db.fetchval(
        "SELECT count(*) FROM agent_builds WHERE status <> 'success'") == 0
    assert await db.fetchval(
        "SELECT count(*) FROM mcp_connector_builds WHERE status <> 'success'") == 0
    print(f"\nreplicas: {dict(by_replica)}")


# -- crash: SIGKILL in the middle of a job --------------------------------------------------


async def _has_run(db: Database, job_id: UUID, attempt: int) -> bool:
    return any(r.attempt == attempt for r in await _runs_of(db, job_id))


async def test_sigkill_mid_job_is_rescued_by_another_worker_and_nothing_else_moves(
    dsn: str, queue: Queue, tmp_path: Path
) -> None:
    """
    Worker A is SIGKILLed while it runs a job. Its heartbeat stops; once it is older
    than A's lease (1 s here), the maintenance leader (B, taking over the role if A
    held it) declares A dead and puts the job back to pending, and B runs it again:
    attempt 2, done. No 60-minute wait, no ageing in SQL. A job B is running
    meanwhile, a job done earlier and the counters of both are untouched: a rescue
    that took a live worker's job, or any job but the dead worker's, fails this.
    """
    db = queue.db
    await create_executions_table(db)
    earlier, victim, bystander = await create_targets(
        db, ["ok:earlier", "hang@1:victim", "gate:bystander"], ["Upload", "Update"])
    async with worker_processes(dsn, tmp_path) as procs:
        (a,) = await procs.start_all(1, *SHORT_LEASES, prefix="a")
        (earlier_id,) = await enqueue_jobs(queue, [earlier])
        await wait_until("the earlier job to be done",
                         lambda: _status_is(db, earlier_id, "done"), alive=[a])
        (victim_id,) = await enqueue_jobs(queue, [victim])
        await wait_until("A to start the victim job", lambda: _has_run(db, victim_id, 1),
                         alive=[a])

        (b,) = await procs.start_all(1, *SHORT_LEASES, "--concurrency", "2", prefix="b")
        async with gate_closed(db):
            (bystander_id,) = await enqueue_jobs(queue, [bystander])
            await wait_until("B to start the bystander job",
                             lambda: _has_run(db, bystander_id, 1), alive=[b])
            before = {j: await _job(db, j) for j in (earlier_id, bystander_id)}

            assert await a.kill() == -signal.SIGKILL
            row = await _job(db, victim_id)
            assert row is not None
            assert (row["status"], row["attempt"]) == ("in_progress", 1)  # nobody knows yet

            await wait_until("B to rescue and rerun the victim",
                             lambda: _status_is(db, victim_id, "done"), alive=[b])
            # The bystander is still running, untouched by B's rescues; the earlier job too.
            assert {j: await _job(db, j) for j in (earlier_id, bystander_id)} == before
        await wait_until("the bystander job to be done",
                         lambda: _status_is(db, bystander_id, "done"), alive=[b])
        b.signal(signal.SIGTERM)
        assert await b.wait_exit() == 0

    row = await _job(db, victim_id)
    assert row is not None
    assert (row["status"], row["attempt"], row["error_msg"]) == ("done", 2, None)
    runs = await runs_by_job(db)
    assert [(r.attempt, r.replica, r.finished) for r in runs[victim_id]] == [
        (1, a.replica, False), (2, b.replica, True)]
    assert [(r.attempt, r.finished) for r in runs[earlier_id]] == [(1, True)]
    assert [(r.attempt, r.replica, r.finished) for r in runs[bystander_id]] == [
        (1, b.replica, True)]
    assert "rescue: 1 job(s) of dead workers back to pending, 0 failed for good" in b.log_text()
    assert "stuck job(s)" not in b.log_text()  # the 60-minute sweep played no part


async def test_job_killed_at_every_attempt_fails_max_attempts_and_terminalizes(
    dsn: str, queue: Queue, tmp_path: Path
) -> None:
    """
    Three jobs whose runs never end, their worker SIGKILLed at attempts 1, 2 and 3.
    Each next worker leads once the killed one's hold on the role runs out, and
    rescues the jobs from the dead worker's missed heartbeats. After the third
    kill, the rescue fails them 'max attempts exceeded' without a fourth run and
    terminalizes each target: an agent with an earlier good build is marked failed
    (its building build failed); an agent and a connector that never built are
    deleted, with their jobs.
    """
    db = queue.db
    await create_executions_table(db)
    (kept,) = await create_targets(db, ["hang:kept"], ["Upload"], prior_success=True)
    gone_agent, gone_connector = await create_targets(
        db, ["hang:agent", "hang:connector"], ["GithubClone", "McpServerUpload"])
    ids = await insert_serde_jobs(db, [kept, gone_agent, gone_connector])
    kept_id = ids[0]
    killed: list[str] = []
    async with worker_processes(dsn, tmp_path) as procs:
        for attempt in (1, 2, 3):
            # Each new worker rescues the jobs the killed one held, and runs them.
            (w,) = await procs.start_all(1, *SHORT_LEASES, "--concurrency", "3",
                                         prefix=f"attempt{attempt}-")

            async def all_running(attempt: int = attempt) -> bool:
                runs = await runs_by_job(db)
                return all(any(r.attempt == attempt for r in runs.get(j, [])) for j in ids)

            await wait_until(f"all three jobs to run attempt {attempt}", all_running,
                             alive=[w])
            assert await w.kill() == -signal.SIGKILL
            killed.append(w.replica)

        (last,) = await procs.start_all(1, *SHORT_LEASES, prefix="last")

        async def terminal() -> bool:
            # The rescue round's log line, not only the rows: the round fails the
            # jobs first and logs after its last statements, so a stop sent as
            # soon as the rows are failed could cancel the round before its line.
            return await db.fetchval(
                "SELECT count(*) FROM build_jobs WHERE status = 'in_progress'") == 0 \
                and _logged_counts(last, _RESCUE_LINE) == 3

        await wait_until("the rescue to fail the exhausted jobs", terminal, alive=[last])
        last.signal(signal.SIGTERM)
        assert await last.wait_exit() == 0

    row = await _job(db, kept_id)
    assert row is not None
    assert (row["status"], row["attempt"], row["error_msg"]) == (
        "failed", 3, MAX_ATTEMPTS_EXCEEDED)
    assert await db.fetchval("SELECT status FROM agents WHERE id = $1",
                             kept.target_id) == "failed"
    assert await db.fetchval("SELECT status::text FROM agent_builds WHERE id = $1",
                             kept.build_id) == "failed"  # it was 'building' when killed
    assert await db.fetchval(
        "SELECT count(*) FROM agent_builds WHERE agent_id = $1 AND status = 'success'",
        kept.target_id) == 1
    assert await db.fetchval("SELECT count(*) FROM agents WHERE id = $1",
                             gone_agent.target_id) == 0
    assert await db.fetchval("SELECT count(*) FROM mcp_connectors WHERE id = $1",
                             gone_connector.target_id) == 0
    assert await db.fetchval("SELECT count(*) FROM build_jobs") == 1  # the others cascaded
    runs = await runs_by_job(db)
    for job in ids:  # exactly three runs each, one per killed worker, none after
        assert [(r.attempt, r.replica, r.finished) for r in runs[job]] == [
            (1, killed[0], False), (2, killed[1], False), (3, killed[2], False)]
    assert _logged_counts(last, _RESCUE_LINE) == 3


# -- shutdown --------------------------------------------------------------------------------


async def test_sigterm_once_lets_the_running_job_finish_and_exits_0(
    dsn: str, queue: Queue, tmp_path: Path
) -> None:
    """After the first SIGTERM the running job still finishes (done, one run); nothing
    more is claimed; the process exits 0."""
    db = queue.db
    await create_executions_table(db)
    running, waiting = await create_targets(db, ["gate:running", "ok:waiting"])
    async with worker_processes(dsn, tmp_path) as procs:
        (a,) = await procs.start_all(1)
        async with gate_closed(db):
            (running_id,) = await enqueue_jobs(queue, [running])
            await wait_until("the job to start", lambda: _has_run(db, running_id, 1),
                             alive=[a])
            a.signal(signal.SIGTERM)
            await wait_for_log(a, "stopping once the running jobs finish")
            (waiting_id,) = await enqueue_jobs(queue, [waiting])
            assert a.proc.returncode is None  # held by the running job
            assert await _status_is(db, running_id, "in_progress")
        assert await a.wait_exit() == 0

    row = await _job(db, running_id)
    assert row is not None
    assert (row["status"], row["attempt"]) == ("done", 1)
    assert [(r.attempt, r.finished) for r in (await runs_by_job(db))[running_id]] == [(1, True)]
    row = await _job(db, waiting_id)
    assert row is not None
    assert (row["status"], row["attempt"]) == ("pending", 0)  # claimed by nobody


async def test_sigterm_twice_hands_the_job_to_another_worker_without_a_sweep(
    dsn: str, queue: Queue, tmp_path: Path
) -> None:
    """
    A second SIGTERM cancels the running job and puts it back to pending at once
    (attempt counted), exit code 130. Worker B, whose only sweep ran at its startup
    (next one in 10 minutes), takes it within its 0.1 s poll and finishes it.
    """
    db = queue.db
    await create_executions_table(db)
    (job,) = await create_targets(db, ["hang@1:job"], ["Rollback"])
    async with worker_processes(dsn, tmp_path) as procs:
        (a,) = await procs.start_all(1, prefix="a")
        (job_id,) = await enqueue_jobs(queue, [job])
        await wait_until("A to start the job", lambda: _has_run(db, job_id, 1), alive=[a])
        (b,) = await procs.start_all(1, prefix="b")  # default sweep period: 600 s

        a.signal(signal.SIGTERM)
        await wait_for_log(a, "stopping once the running jobs finish")
        assert a.proc.returncode is None  # the job never ends by itself
        a.signal(signal.SIGTERM)
        assert await a.wait_exit() == 130
        assert "cancelled by a hard stop; back to pending" in a.log_text()

        await wait_until("B to run the job", lambda: _status_is(db, job_id, "done"),
                         alive=[b])
        b.signal(signal.SIGTERM)
        assert await b.wait_exit() == 0

    row = await _job(db, job_id)
    assert row is not None
    assert (row["status"], row["attempt"]) == ("done", 2)
    assert [(r.attempt, r.replica, r.finished) for r in (await runs_by_job(db))[job_id]] == [
        (1, a.replica, False), (2, b.replica, True)]
    assert "stuck job(s)" not in b.log_text()  # no sweep was involved


# -- races -------------------------------------------------------------------------------------




async def test_rescues_and_sweeps_racing_completions_never_reopen_a_finished_job(
    dsn: str, queue: Queue, tmp_path: Path
) -> None:
    """
    Two workers run 300 jobs while the test keeps making them look dead: every
    0.1 s it ages both workers' heartbeats past their lease (the leader, rescuing
    every 0.1 s, declares them dead and gives their running jobs back while their
    executors still run) and every running job's claim past the stuck threshold
    (the leader sweeps 20 times a second). Each worker learns at its next heartbeat
    that it was declared dead, stops its jobs and registers anew. So rescues,
    sweeps, fences and completions race on the same rows. Every status change is
    logged by a trigger: a job that reached done or failed never changes again,
    each job reaches exactly one terminal state, and a done job's result was
    written by the claim that ran it (no fenced or stale worker overwrote it).
    """
    db = queue.db
    await create_executions_table(db)
    await db.execute(TRANSITIONS_DDL)
    n = 300
    targets = await create_targets(db, [f"work:{i}" for i in range(n)], KINDS,
                                   prior_success=True)
    all_done = trio.Event()

    async def make_workers_look_dead() -> None:
        while not all_done.is_set():
            await db.execute(
                "UPDATE nasiko_queue_workers SET heartbeat_at = now() - interval '1 hour' "
                "WHERE dead_at IS NULL")
            await db.execute(
                f"UPDATE build_jobs SET picked_at = now() - interval '{AGE_PAST_THRESHOLD}' "
                "WHERE status = 'in_progress'")
            with trio.move_on_after(0.1):  # the pace of the ageing, not a wait
                await all_done.wait()

    async with worker_processes(dsn, tmp_path) as procs:
        workers = await procs.start_all(2, *SHORT_LEASES, "--recovery-interval", "0.05",
                                        "--concurrency", "2")
        async with trio.open_nursery() as nursery:
            nursery.start_soon(make_workers_look_dead)
            ids = await insert_serde_jobs(db, targets)

            async def finished() -> bool:
                counts = await status_counts(db, ids)
                return counts["done"] + counts["failed"] == n

            await wait_until("every job to end", finished, alive=workers, deadline=120)
            all_done.set()
        for w in workers:
            w.signal(signal.SIGTERM)
        assert [await w.wait_exit() for w in workers] == [0, 0]

    moves = await db.fetch("SELECT job_id, old, new, attempt, error FROM transitions "
                           "ORDER BY seq")
    reopened = [m for m in moves if m["old"] in ("done", "failed")]
    assert reopened == []
    terminal = Counter(m["job_id"] for m in moves if m["new"] in ("done", "failed"))
    assert set(terminal) == set(ids)
    assert set(terminal.values()) == {1}
    resets = [m for m in moves if (m["old"], m["new"]) == ("in_progress", "pending")]
    assert resets, "no rescue or fence ever caught a running job: the race was not exercised"
    failed = [m for m in moves if m["new"] == "failed"]
    assert {m["error"] for m in failed} <= {MAX_ATTEMPTS_EXCEEDED}
    declared = sum(w.log_text().count("declared dead, its jobs are rescued") for w in workers)
    fenced = sum(w.log_text().count("was declared dead (a pause longer") for w in workers)
    assert min(declared, fenced) > 0, (declared, fenced)

    runs = await runs_by_job(db)
    assert one_run_per_attempt(runs)
    for m in moves:
        if m["new"] == "done":  # written by the claim that ran it, and that run finished
            assert any(r.attempt == m["attempt"] and r.finished for r in runs[m["job_id"]])
    audit = audit_runs(runs, ids)
    print(f"\nrace: {declared} workers declared dead, {fenced} fences, {len(resets)} resets, "
          f"{len(failed)} jobs out of attempts, {audit.runs} runs for {n} jobs, "
          f"{len(audit.rerun_after_finish)} reruns of a finished build (at-least-once case b)")


TARGET_EVENTS_DDL = """
CREATE TABLE target_events (
    seq       bigserial PRIMARY KEY,
    target_id uuid NOT NULL,
    event     text NOT NULL
);
CREATE FUNCTION log_agent_event() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'DELETE' THEN
        INSERT INTO target_events (target_id, event) VALUES (OLD.id, 'deleted');
    ELSIF NEW.status IS DISTINCT FROM OLD.status THEN
        INSERT INTO target_events (target_id, event) VALUES (NEW.id, NEW.status);
    END IF;
    RETURN NULL;
END;
$$;
CREATE TRIGGER log_agent_event AFTER UPDATE OR DELETE ON agents
    FOR EACH ROW EXECUTE FUNCTION log_agent_event();
CREATE FUNCTION log_connector_event() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'DELETE' THEN
        INSERT INTO target_events (target_id, event) VALUES (OLD.id, 'deleted');
    ELSIF NEW.build_status IS DISTINCT FROM OLD.build_status THEN
        INSERT INTO target_events (target_id, event) VALUES (NEW.id, NEW.build_status);
    END IF;
    RETURN NULL;
END;
$$;
CREATE TRIGGER log_connector_event AFTER UPDATE OR DELETE ON mcp_connectors
    FOR EACH ROW EXECUTE FUNCTION log_connector_event();
"""


async def test_the_leaders_sweep_and_startup_sweeps_at_once_terminalize_each_target_once(
    dsn: str, queue: Queue, tmp_path: Path
) -> None:
    """
    Two worker processes run; one leads and sweeps every 50 ms, the other never
    sweeps after its startup. Meanwhile the test sweeps too, in a loop, as every
    replica's startup sweep does whenever one starts (docs/rules.md §5: sweeps
    from many replicas at once are safe). Batches of stuck jobs with no attempts
    left appear, claimed by a replica that does not heartbeat. A trigger makes
    failing each row take 5 ms, so one sweep of a batch holds its rows for 150 ms,
    during which the other sweeper comes round about three times. Each job is
    failed once, and each target is terminalized once (a trigger logs every agent
    and connector status change and delete): marked failed when it has a good
    build, deleted when it never built. Nothing runs, and only one replica swept.
    """
    db = queue.db
    await create_executions_table(db)
    await db.execute(TRANSITIONS_DDL)
    await db.execute(TARGET_EVENTS_DDL)
    await db.execute("""
        CREATE FUNCTION slow_fail() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            PERFORM pg_sleep(0.005);
            RETURN NEW;
        END;
        $$;
        CREATE TRIGGER slow_fail BEFORE UPDATE ON build_jobs FOR EACH ROW
            WHEN (OLD.status = 'in_progress' AND NEW.status = 'failed')
            EXECUTE FUNCTION slow_fail();
    """)
    batches, per_batch = 6, 30
    # The test's own sweeper: a replica's startup sweep, over and over.
    store = PgJobStore(db, queue.config, runnable_kinds=frozenset(KINDS),
                       known_kinds=frozenset(KINDS))
    failed_by_test = 0
    all_swept = trio.Event()

    async def startup_sweeps() -> None:
        nonlocal failed_by_test
        while not all_swept.is_set():
            failed_by_test += (await store.recover()).failed
            with trio.move_on_after(0.05):  # the pace of the sweeps, not a wait
                await all_swept.wait()

    async with worker_processes(dsn, tmp_path) as procs:
        workers = await procs.start_all(2, "--recovery-interval", "0.05")
        kept: list[Any] = []
        gone: list[Any] = []
        ids: list[UUID] = []
        async with trio.open_nursery() as nursery:
            nursery.start_soon(startup_sweeps)
            for batch in range(batches):
                # A batch appears at once: targets, builds and jobs stuck at attempt 3.
                async with db.transaction() as tx:
                    with_success = await create_targets(
                        tx, [f"ok:kept{batch}-{i}" for i in range(per_batch // 2)],
                        ["Upload", "McpServerUpload"], prior_success=True)
                    never_built = await create_targets(
                        tx, [f"ok:gone{batch}-{i}" for i in range(per_batch // 2)],
                        ["Update", "McpServerUpload"])
                    new = await insert_serde_jobs(tx, with_success + never_built)
                    await tx.execute(
                        "UPDATE build_jobs SET status = 'in_progress', attempt = 3, "
                        f"picked_at = now() - interval '{AGE_PAST_THRESHOLD}' "
                        "WHERE id = ANY($1::uuid[])", new)
                kept += with_success
                gone += never_built
                ids += new

                async def swept(new: list[UUID] = new) -> bool:
                    return await db.fetchval(
                        "SELECT count(*) FROM build_jobs WHERE id = ANY($1::uuid[]) "
                        "AND status = 'in_progress'", new) == 0

                await wait_until(f"batch {batch} to be swept", swept, alive=workers)
            all_swept.set()
        for w in workers:
            w.signal(signal.SIGTERM)
        assert [await w.wait_exit() for w in workers] == [0, 0]

    moves = await db.fetch("SELECT job_id, old, new, error FROM transitions "
                           "WHERE old <> 'pending'")  # not the test's own staging
    assert Counter((m["old"], m["new"], m["error"]) for m in moves) == Counter(
        {("in_progress", "failed", MAX_ATTEMPTS_EXCEEDED): len(ids)})
    assert Counter(m["job_id"] for m in moves) == Counter(ids)
    events = await db.fetch("SELECT target_id, event FROM target_events")
    by_target: dict[UUID, list[str]] = {}
    for e in events:
        by_target.setdefault(e["target_id"], []).append(e["event"])
    expected = {t.target_id: ["failed"] for t in kept}
    expected.update({t.target_id: ["deleted"] for t in gone})
    assert by_target == expected
    assert await db.fetchval("SELECT count(*) FROM executions") == 0
    swept_by = [_logged_counts(w, r"recovery: (\d+) stuck job\(s\) had no attempts left")
                for w in workers]
    assert sum(swept_by) + failed_by_test == len(ids)
    assert sorted(swept_by)[0] == 0, f"a replica that does not lead swept: {swept_by}"
    assert min(failed_by_test, max(swept_by)) > 0, (
        f"the sweeps never overlapped: leader {max(swept_by)}, startup sweeps {failed_by_test}")
    print(f"\nsweeps: {len(ids)} exhausted jobs, failed by the leader {max(swept_by)}, "
          f"by startup sweeps {failed_by_test}")
