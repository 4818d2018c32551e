"""
Durable workflows (issue #22) with real `nasiko-queue worker` replicas that die
by SIGKILL: during a step, during a transition (the transaction that ends a
step's job and, by the trigger of migration 0018, enqueues what it unblocks),
and during a fan-in (a mapped step's items partly done).

Three replicas run the workflows of `tests/wf_proc_executors.py` (a chain with
a fan-out of N items and a fan-in). Every run of every step is recorded by the
step itself in a ledger table, so each claim below is counted: every run ends
in its right state, no step starts after its run ended (one clock: the
database's), each step and item is enqueued exactly once (one job row each,
retried in place), and the fan-in gets every item's result, in item order.

Each kill lands at a point the test chose, not by timing luck: a step blocks on
an advisory lock the test holds (`procs.gate_closed`), or the step's transition
is due while the test holds the run's row FOR UPDATE. Leases are
a second long, so a dead replica's jobs are rescued by a live one in about one
and a half.
"""

from __future__ import annotations

import json
import signal
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import datetime
from pathlib import Path
from typing import Any
from uuid import UUID

import attrs
import pytest

from nasiko_queue import Database, Queue
from nasiko_queue.db.statements import Q

from .procs import WorkerProcess, Workers, gate_closed, wait_until, worker_processes
from .wf_proc_executors import FRAGILE, LEDGER_DDL, WORKFLOW, item_result

pytestmark = pytest.mark.slow

REPLICAS = 3
#: Heartbeats every 0.3 s, a replica dead after 3 s without one (room for a loaded
#: machine: a live replica whose lease lapses has its step run again), a rescue round
#: every 0.1 s; three step jobs at once per replica.
OPTIONS = ("--heartbeat-interval", "0.3", "--lease", "3", "--rescue-interval", "0.1",
           "--concurrency", "3", "--executors", "tests.wf_proc_executors:executors")
#: The server looks for a lost client this often, even while a statement of
#: that client waits for a lock (PostgreSQL 14+; Linux).
CONNECTION_CHECK = "100ms"


# -- the ledger, the runs and their jobs, read with the test's own SQL --------------------


@attrs.frozen
class Execution:
    """One run of a step, as the step recorded it."""

    step: str
    idx: int
    attempt: int
    replica: str
    received: Any
    started_at: datetime
    finished: bool


async def _ledger(db: Database, run_id: UUID) -> list[Execution]:
    rows = await db.fetch(
        "SELECT step, idx, attempt, replica, received::text AS received, started_at, "
        "finished_at IS NOT NULL AS finished FROM wf_ledger WHERE run_id = $1 ORDER BY seq",
        run_id)
    return [Execution(step=r["step"], idx=r["idx"], attempt=r["attempt"], replica=r["replica"],
                      received=json.loads(r["received"]), started_at=r["started_at"],
                      finished=r["finished"]) for r in rows]


async def _started(db: Database, run_id: UUID, step: str, idx: int = 0,
                   attempt: int = 1) -> Execution | None:
    for e in await _ledger(db, run_id):
        if (e.step, e.idx, e.attempt) == (step, idx, attempt):
            return e
    return None


async def _run_row(db: Database, run_id: UUID) -> dict[str, Any]:
    row = await db.fetchrow(
        "SELECT state, result::text AS result, failed_step, error, finished_at "
        "FROM nasiko_queue_workflow_runs WHERE id = $1", run_id)
    assert row is not None, f"run {run_id} is gone"
    return dict(row)


async def _ended(db: Database, run_id: UUID) -> bool:
    return (await _run_row(db, run_id))["state"] != "running"


async def _step_jobs(db: Database, run_id: UUID) -> Counter[tuple[str, int]]:
    """How many job rows each step (and item) of the run has: its enqueues."""
    rows = await db.fetch(
        "SELECT payload->>'step' AS step, (payload->>'idx')::int AS idx FROM nasiko_queue_jobs "
        "WHERE workflow_run = $1", run_id)
    return Counter((r["step"], r["idx"]) for r in rows)


async def _job_of(db: Database, run_id: UUID, step: str, idx: int = 0) -> dict[str, Any]:
    row = await db.fetchrow(
        "SELECT id, state, attempt, error_msg FROM nasiko_queue_jobs "
        "WHERE workflow_run = $1 AND payload->>'step' = $2 AND (payload->>'idx')::int = $3",
        run_id, step, idx)
    assert row is not None, f"no job for {step}[{idx}] of run {run_id}"
    return dict(row)


async def _explain(db: Database, *run_ids: UUID) -> str:
    parts = []
    for run_id in run_ids:
        run = await _run_row(db, run_id)
        jobs = await db.fetch(
            "SELECT payload->>'step' AS step, payload->>'idx' AS idx, state, attempt "
            "FROM nasiko_queue_jobs WHERE workflow_run = $1 ORDER BY created_at", run_id)
        parts.append(f"run {run_id} {run['state']}: " + ", ".join(
            f"{j['step']}[{j['idx']}] {j['state']}#{j['attempt']}" for j in jobs))
    return "; ".join(parts)


def _expected_results(items: int) -> list[str]:
    return [item_result(f"i{k}", k) for k in range(items)]


async def _audit_completed(db: Database, run_id: UUID, items: int, *,
                           returned_twice: tuple[str, ...] = (),
                           killed_on: frozenset[str] = frozenset()) -> list[Execution]:
    """
    The checks every completed run passes; returns the runs of its steps that
    never finished (the killed ones) for the test's own assertions.
    `returned_twice`: steps whose first return's completion was rolled back
    (so they ran to their end twice: at least once, as a job is).
    `killed_on`: the replicas the test killed while this run's steps may have
    been running on them, at any point of a step (not one the test chose):
    each run of a step but its last must then have been on one of those, and a
    claim killed before the step recorded itself leaves a gap in the attempts.
    """
    run = await _run_row(db, run_id)
    assert (run["state"], json.loads(run["result"])) == ("completed", f"published {items}")
    steps = [("prepare", 0), *(("work", k) for k in range(items)), ("gather", 0),
             ("publish", 0)]
    # Each step and item enqueued exactly once (a retry reuses its job row).
    assert await _step_jobs(db, run_id) == Counter(steps)
    states = await db.fetch("SELECT DISTINCT state FROM nasiko_queue_jobs "
                            "WHERE workflow_run = $1", run_id)
    assert [r["state"] for r in states] == ["completed"]
    ledger = await _ledger(db, run_id)
    if not killed_on:
        # Each ran to its end exactly once, and nothing ran again after that.
        finished = Counter((e.step, e.idx) for e in ledger if e.finished)
        assert finished == Counter(steps) + Counter((s, 0) for s in returned_twice)
    for step, idx in steps:
        mine = [e for e in ledger if (e.step, e.idx) == (step, idx)]
        assert mine[-1].finished, f"{step}[{idx}] ran again after it finished: {mine}"
        attempts = [e.attempt for e in mine]
        if killed_on:
            # Run again only where a kill explains it; the job's attempt is its last run's.
            assert all(e.replica in killed_on for e in mine[:-1]), (step, idx, mine)
            assert attempts == sorted(set(attempts)), (step, idx, mine)
            assert (await _job_of(db, run_id, step, idx))["attempt"] == attempts[-1]
        else:
            assert attempts == list(range(1, len(mine) + 1))
    # The fan-in got every item's result, in item order, each time it ran; so did
    # the step after it.
    expected = _expected_results(items)
    assert [e.received for e in ledger if e.step in ("gather", "publish")] == [expected] * (
        sum(1 for e in ledger if e.step in ("gather", "publish")))
    # No step started after its run ended (the run's end is the last step's finish).
    assert all(e.started_at <= run["finished_at"] for e in ledger)
    return [e for e in ledger if not e.finished]


# -- the replicas ------------------------------------------------------------------------------


@asynccontextmanager
async def _replicas(dsn: str, tmp_path: Path) -> AsyncIterator[tuple[Workers,
                                                                     list[WorkerProcess]]]:
    async with worker_processes(dsn, tmp_path) as procs:
        yield procs, await procs.start_all(REPLICAS, *OPTIONS, prefix="r")


def _by_replica(replicas: list[WorkerProcess], execution: Execution) -> WorkerProcess:
    (worker,) = [w for w in replicas if w.replica == execution.replica]
    return worker


async def _kill(worker: WorkerProcess, alive: list[WorkerProcess]) -> None:
    assert await worker.kill() == -signal.SIGKILL
    alive.remove(worker)


async def _nothing_left_to_rescue(db: Database, victims: list[WorkerProcess],
                                  alive: list[WorkerProcess]) -> None:
    """
    Once the killed replicas are declared dead, a rescue round (run here, after
    the runs ended: whatever the leader's rounds did before) finds nothing of
    theirs left: no completed step reopened, no job claimed for a dead replica
    (by a statement that committed after its death) left behind.
    """
    pids = [w.pid for w in victims]

    async def declared_dead() -> bool:
        return bool(await db.fetchval(
            "SELECT count(*) = $2 FROM nasiko_queue_workers "
            "WHERE pid = ANY($1::int[]) AND dead_at IS NOT NULL", pids, len(pids)))

    await wait_until("the killed replicas to be declared dead", declared_dead, alive=alive)
    row = await db.fetchrow(Q.plain_rescue, None)
    assert row is not None
    assert (row["rescued"], row["ended"]) == (0, 0)


async def _check_interval(dsn: str, db: Database, value: str | None) -> None:
    """Set (or reset) the test database's client_connection_check_interval for the
    connections opened after it (the replicas')."""
    name = dsn.rsplit("/", 1)[1]
    await db.execute(f'ALTER DATABASE "{name}" SET client_connection_check_interval = '
                     + ("DEFAULT" if value is None else f"'{value}'"))


# -- (a) during a step --------------------------------------------------------------------------


async def test_sigkill_during_a_step_reruns_it_or_fails_a_run_without_attempts_left(
    dsn: str, queue: Queue, tmp_path: Path
) -> None:
    """
    Run A is killed inside ``gather`` (the fan-in, a chain step): the rescue puts
    its job back, another replica runs it again (attempt 2) and the run
    completes, ``publish`` enqueued once. Run F has one attempt per step and is
    killed inside ``prepare``: the rescue discards the job, the run fails at
    that step, and none of its later steps is ever enqueued or started. Run C,
    beside them on the same replicas, completes: whichever of its steps the
    kills hit ran again elsewhere (CI once saw its ``gather`` finish on a victim
    before the kill and run again), each step still enqueued once.
    """
    db = queue.db
    await db.execute(LEDGER_DDL)
    async with _replicas(dsn, tmp_path) as (_procs, alive), gate_closed(db):
        a = await queue.start(WORKFLOW, {"items": 3, "gate": "gather"})
        f = await queue.start(FRAGILE, {"items": 2, "gate": "prepare"})
        c = await queue.start(WORKFLOW, {"items": 4})

        async def gated() -> bool:
            return (await _started(db, a, "gather") is not None
                    and await _started(db, f, "prepare") is not None)

        await wait_until("A's gather and F's prepare to start", gated, alive=alive,
                         explain=lambda: _explain(db, a, f))
        in_a = await _started(db, a, "gather")
        in_f = await _started(db, f, "prepare")
        assert in_a is not None
        assert in_f is not None
        victims = {_by_replica(alive, in_a).name: _by_replica(alive, in_a),
                   _by_replica(alive, in_f).name: _by_replica(alive, in_f)}
        for victim in victims.values():
            await _kill(victim, alive)

        await wait_until("runs A, F and C to end",
                         lambda: _all_ended(db, a, f, c), alive=alive,
                         explain=lambda: _explain(db, a, f, c))
        await _nothing_left_to_rescue(db, list(victims.values()), alive)
        # The gate opens only now: the killed steps' server sessions, still
        # waiting at it, end without a word.

    killed = await _audit_completed(db, a, 3)
    assert [(e.step, e.attempt, e.replica) for e in killed] == [
        ("gather", 1, in_a.replica)]
    assert [(e.attempt, e.finished) for e in await _ledger(db, a)
            if e.step == "gather"] == [(1, False), (2, True)]
    # C ran beside them on all three replicas, so the kills may have hit any of its
    # steps, anywhere in it: each such step ran again elsewhere.
    dead = frozenset(v.replica for v in victims.values())
    assert all(e.replica in dead for e in await _audit_completed(db, c, 4, killed_on=dead))

    run = await _run_row(db, f)
    assert (run["state"], run["failed_step"], run["error"]) == (
        "failed", "prepare", "the worker running it died")
    assert await _step_jobs(db, f) == Counter({("prepare", 0): 1})
    assert (await _job_of(db, f, "prepare"))["state"] == "discarded"
    assert [(e.step, e.attempt, e.finished) for e in await _ledger(db, f)] == [
        ("prepare", 1, False)]
    steps = await db.fetch("SELECT step, state FROM nasiko_queue_workflow_steps "
                           "WHERE run_id = $1 ORDER BY step", f)
    assert {r["step"]: r["state"] for r in steps} == {
        "prepare": "failed", "work": "cancelled", "gather": "cancelled",
        "publish": "cancelled"}


async def _all_ended(db: Database, *run_ids: UUID) -> bool:
    for run_id in run_ids:
        if not await _ended(db, run_id):
            return False
    return True


# -- (b) during a transition ----------------------------------------------------------------


async def _due(db: Database, run_id: UUID) -> int:
    """How many transitions of the run are recorded as due (migration 0033)."""
    return int(await db.fetchval(
        "SELECT count(*) FROM nasiko_queue_workflow_due WHERE run_id = $1", run_id))


@pytest.mark.parametrize("server_checks_client", [True, False],
                         ids=["connection-check", "no-connection-check"])
async def test_sigkill_during_a_transition_loses_it_not_and_enqueues_once(
    dsn: str, queue: Queue, tmp_path: Path, server_checks_client: bool
) -> None:
    """
    ``prepare`` has returned while the test holds the run's row FOR UPDATE. Its
    job's completion (the completer's statement) no longer waits for that row
    (migration 0033: a finish never waits for a run's lock, it holds a
    connection every lane needs): it commits at once, the transition recorded
    as due. The replica that ran ``prepare`` is SIGKILLed then; the services of
    the others cannot take the run while its row is held (they may wait for it,
    each on a connection of its own, never a finish). Once the row is free, a live
    replica's transition service applies the transition: the items are enqueued once and ``prepare``
    ran once, whether or not the server looks for lost clients
    (client_connection_check_interval): nothing of the transition was in flight
    on the dead replica's connection.
    """
    db = queue.db
    await db.execute(LEDGER_DDL)
    if server_checks_client:
        await _check_interval(dsn, db, CONNECTION_CHECK)
    items = 4
    async with _replicas(dsn, tmp_path) as (_procs, alive):
        async with db.transaction() as holder:
            async with gate_closed(db):
                run_id = await queue.start(WORKFLOW, {"items": items, "gate": "prepare"})

                async def prepare_started() -> bool:
                    return await _started(db, run_id, "prepare") is not None

                await wait_until("prepare to start", prepare_started, alive=alive)
                await holder.execute("SELECT 1 FROM nasiko_queue_workflow_runs WHERE id = $1 "
                                     "FOR UPDATE", run_id)
            # prepare returns now; its completion commits, its transition due.

            async def completed_and_due() -> bool:
                job = await _job_of(db, run_id, "prepare")
                return job["state"] == "completed" and await _due(db, run_id) == 1

            await wait_until("prepare's completion to commit with its transition due",
                             completed_and_due, alive=alive,
                             explain=lambda: _explain(db, run_id))
            holder_pid = await holder.fetchval("SELECT pg_backend_pid()")
            first = await _started(db, run_id, "prepare")
            assert first is not None
            assert first.finished
            victim = _by_replica(alive, first)
            await _kill(victim, alive)
            # No finish waits for the row (a transition service may: on its own
            # connection), and nothing of the transition is applied.
            assert not await db.fetchval(
                "SELECT count(*) FROM pg_stat_activity WHERE $1 = ANY(pg_blocking_pids(pid)) "
                "AND query NOT LIKE '%nasiko_queue_wf_apply_due%'", holder_pid)
            assert await _step_jobs(db, run_id) == Counter({("prepare", 0): 1})
        # The run's row is free.
        await wait_until("the run to end", lambda: _ended(db, run_id), alive=alive,
                         explain=lambda: _explain(db, run_id))
        await _nothing_left_to_rescue(db, [victim], alive)

    assert await _audit_completed(db, run_id, items) == []
    assert [(e.attempt, e.replica) for e in await _ledger(db, run_id)
            if e.step == "prepare"] == [(1, victim.replica)]
    assert (await _job_of(db, run_id, "prepare"))["attempt"] == 1
    assert await _due(db, run_id) == 0


# -- (c) during a fan-in ------------------------------------------------------------------------


async def test_sigkill_during_a_fan_in_reruns_the_killed_item_only(
    dsn: str, queue: Queue, tmp_path: Path
) -> None:
    """
    Six mapped items; item 4 blocks at the gate on its first attempt. Once the
    other five have completed (the fan-in partly done: their results recorded
    in the run), the replica running item 4 is killed. Item 4 runs again on
    another replica; the five completed items are not run again (their results
    are kept in the run's rows); ``gather`` runs once and gets all six results in
    item order.
    """
    db = queue.db
    await db.execute(LEDGER_DDL)
    items = 6
    async with _replicas(dsn, tmp_path) as (_procs, alive), gate_closed(db):
        run_id = await queue.start(WORKFLOW, {"items": items, "gate": "work:4"})

        async def partly_done() -> bool:
            done = await db.fetchval(
                "SELECT count(*) FROM nasiko_queue_workflow_steps WHERE run_id = $1 "
                "AND step = 'work' AND idx >= 0 AND state = 'completed'", run_id)
            return done == items - 1 and await _started(db, run_id, "work", 4) is not None

        await wait_until("five items done and item 4 started", partly_done, alive=alive,
                         explain=lambda: _explain(db, run_id))
        stuck = await _started(db, run_id, "work", 4)
        assert stuck is not None
        victim = _by_replica(alive, stuck)
        await _kill(victim, alive)
        await wait_until("the run to end", lambda: _ended(db, run_id), alive=alive,
                         explain=lambda: _explain(db, run_id))
        await _nothing_left_to_rescue(db, [victim], alive)

    killed = await _audit_completed(db, run_id, items)
    assert [(e.step, e.idx, e.attempt, e.replica) for e in killed] == [
        ("work", 4, 1, victim.replica)]
    ledger = await _ledger(db, run_id)
    assert Counter(e.idx for e in ledger if e.step == "work") == Counter(
        {0: 1, 1: 1, 2: 1, 3: 1, 4: 2, 5: 1})
    rerun = [e for e in ledger if (e.step, e.idx, e.attempt) == ("work", 4, 2)]
    assert rerun[0].replica != victim.replica
