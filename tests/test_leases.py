"""
Workers are rows, heartbeats are leases, one worker leads maintenance (issue #10).

In-process workers on a real PostgreSQL, with seconds-scale leases; a worker that
"died" is a registered row whose heartbeat is aged in SQL (its process would have
been SIGKILLed: nobody renews it), never a wait for a real lease to run out where
the test can set the clock instead. The process-level proofs (SIGKILL, SIGSTOP,
the leader killed, four replicas electing one) are in test_processes.py.
"""

from __future__ import annotations

import os
import uuid
from contextlib import AsyncExitStack
from typing import Any

import attrs
import pytest
import trio

from nasiko_queue import ConfigurationError, Database, JobContext, Queue, QueueConfig, Worker
from nasiko_queue.builds.store import JOB_PANICKED, PgJobStore
from nasiko_queue.engine.contracts import (
    MAX_ATTEMPTS_EXCEEDED,
    RecoveryResult,
    RescueResult,
    WorkerIdentity,
)
from nasiko_queue.testing import KINDS, enqueue_with_target

from .conftest import FAST, MASTER_KEY
from .helpers import (
    TEST_DEADLINE,
    agent_state,
    executors_for_all,
    job_row,
    running,
    succeed,
)
from .netproxy import Proxy

#: Leases in tenths of seconds, a rescue round every 50 ms.
LEASED = attrs.evolve(FAST, heartbeat_interval=0.1, lease=0.6, rescue_interval=0.05)
KINDS_SET = frozenset(KINDS)


def _queue(db: Database, config: QueueConfig = LEASED) -> Queue:
    return Queue(db, config=config, secrets=MASTER_KEY)


async def _dead_worker(db: Database, config: QueueConfig = LEASED) -> PgJobStore:
    """A worker that registered and then died: its row never heartbeats again."""
    store = PgJobStore(db, config, runnable_kinds=KINDS_SET, known_kinds=KINDS_SET)
    await store.register_worker(WorkerIdentity(id=uuid.uuid4(), host="gone", pid=1,
                                               kinds=tuple(KINDS)))
    return store


async def _age_heartbeat(db: Database, worker_id: Any) -> None:
    """An hour passes for a worker that died: its last heartbeat, and the claims it
    made before, all move an hour back."""
    await db.execute("UPDATE nasiko_queue_workers SET heartbeat_at = heartbeat_at - "
                     "interval '1 hour' WHERE id = $1", worker_id)
    await db.execute("UPDATE build_jobs SET picked_at = picked_at - interval '1 hour' "
                     "WHERE claimed_by = $1", worker_id)


def test_the_lease_must_outlast_three_heartbeats() -> None:
    with pytest.raises(ConfigurationError, match="three heartbeat intervals"):
        QueueConfig(heartbeat_interval=1.0, lease=2.0)


async def test_a_worker_is_a_row_while_it_runs_and_its_claims_name_it(db: Database) -> None:
    seen: list[Any] = []

    async def run(ctx: JobContext[Any]) -> None:
        seen.append(await ctx.db.fetchval("SELECT claimed_by FROM build_jobs WHERE id = $1",
                                          ctx.job_id))
        await succeed(ctx)

    queue = _queue(db)
    async with running(queue, executors_for_all(run)) as worker:
        await worker.wait_for(lambda s: s.heartbeats >= 2)
        me = worker.heartbeat.identity
        assert me is not None
        row = await db.fetchrow("SELECT * FROM nasiko_queue_workers")
        assert row is not None
        assert (row["id"], row["host"], row["pid"], sorted(row["kinds"]), row["lease_secs"],
                row["dead_at"]) == (me.id, me.host, os.getpid(), sorted(KINDS), 0.6, None)
        assert row["heartbeat_at"] > row["started_at"]
        assert worker.is_leader
        assert await db.fetchval("SELECT worker_id FROM nasiko_queue_leaders "
                                 "WHERE role = 'maintenance'") == me.id
        await enqueue_with_target(queue, "Upload")
        await worker.drain_once()
        assert seen == [me.id]
    # A graceful stop removes the row and gives up the leadership at once.
    assert await db.fetchval("SELECT count(*) FROM nasiko_queue_workers") == 0
    assert await db.fetchval("SELECT count(*) FROM nasiko_queue_leaders") == 0


async def test_one_rescue_round_gives_back_a_dead_workers_jobs(db: Database) -> None:
    """River-style: `rescue()` once. The dead worker's job with attempts left goes
    back to pending (attempt counted), the one out of attempts fails `max attempts
    exceeded` and terminalizes its target; a live worker's job is not touched."""
    queue = _queue(db)
    again = await enqueue_with_target(queue, "Upload")
    exhausted = await enqueue_with_target(queue, "Update", prior_success=True)
    await db.execute("UPDATE build_jobs SET attempt = 2 WHERE id = $1", exhausted.job_id)
    live_job = await enqueue_with_target(queue, "Rollback")
    dead = await _dead_worker(db)
    assert {j.id for j in await dead.claim(2)} == {again.job_id, exhausted.job_id}
    live = await _dead_worker(db)  # registered, and it keeps heartbeating (below)
    assert [j.id for j in await live.claim(1)] == [live_job.job_id]
    await _age_heartbeat(db, dead.worker_id)
    assert (await live.heartbeat(None)).alive

    rescuer = PgJobStore(db, LEASED, runnable_kinds=KINDS_SET, known_kinds=KINDS_SET)
    assert await rescuer.rescue() == RescueResult(declared_dead=1, failed=1, rescued=1)
    row = await job_row(db, again.job_id)
    assert row is not None
    assert (row["status"], row["attempt"], row["picked_at"]) == ("pending", 1, None)
    row = await job_row(db, exhausted.job_id)
    assert row is not None
    assert (row["status"], row["attempt"], row["error_msg"]) == (
        "failed", 3, MAX_ATTEMPTS_EXCEEDED)
    assert await agent_state(db, exhausted.target_id) == "failed"  # it had built before
    assert (await job_row(db, live_job.job_id) or {})["status"] == "in_progress"
    assert await db.fetchval("SELECT dead_at IS NOT NULL FROM nasiko_queue_workers "
                             "WHERE id = $1", dead.worker_id)
    # The dead worker learns it at its next heartbeat (were it only paused).
    assert not (await dead.heartbeat(None)).alive
    assert await rescuer.rescue() == RescueResult(declared_dead=0, failed=0, rescued=0)


async def test_the_leader_rescues_a_dead_workers_job_and_it_runs_again(db: Database) -> None:
    job = await enqueue_with_target(_queue(db), "Upload")
    dead = await _dead_worker(db)
    await dead.claim(1)
    await _age_heartbeat(db, dead.worker_id)
    runs: list[int] = []

    async def run(ctx: JobContext[Any]) -> None:
        runs.append(ctx.attempt)
        await succeed(ctx)

    async with running(_queue(db), executors_for_all(run)) as worker:
        with trio.fail_after(10):
            # The rescue round counts its rows after its statement returns, and by
            # then the job may be claimed and done (seen under two CPU hogs): wait
            # for both, as the test below does.
            await worker.wait_for(lambda s: s.done >= 1 and s.rescued >= 1)
        assert worker.stats.rescued == 1
    row = await job_row(db, job.job_id)
    assert row is not None
    assert (row["status"], row["attempt"]) == ("done", 2)
    assert runs == [2]


async def test_a_newly_elected_leader_rescues_at_once_not_a_period_later(
    db: Database,
) -> None:
    """Found measuring fail-over: the rescue's timer ran in step with the heartbeat,
    so the round after an election came a whole `rescue_interval` late (18 s instead
    of 15 s from a SIGKILL with the defaults). Here the interval is an hour: only a
    round run on election rescues the dead worker's job within the test's deadline."""
    job = await enqueue_with_target(_queue(db), "Upload")
    dead = await _dead_worker(db)
    await dead.claim(1)
    await _age_heartbeat(db, dead.worker_id)
    hourly = attrs.evolve(LEASED, rescue_interval=3600.0)
    async with running(_queue(db, hourly), executors_for_all(succeed)) as worker:
        with trio.fail_after(10):
            # The rescued job may be claimed, run and done before the rescue round
            # has counted it (under load): wait for both.
            await worker.wait_for(lambda s: s.done >= 1 and s.rescued >= 1)
        assert (worker.stats.elected, worker.stats.rescued) == (1, 1)
    row = await job_row(db, job.job_id)
    assert row is not None
    assert (row["status"], row["attempt"]) == ("done", 2)


async def test_the_sixty_minute_rule_is_for_rows_no_live_worker_holds(db: Database) -> None:
    """A live worker's job that runs past `stuck_job_mins` is its own (no sweep hands it
    on while the worker heartbeats); a row claimed without a worker (the original's
    SQL) is swept as before."""
    queue = _queue(db)
    long_one = await enqueue_with_target(queue, "Upload")
    foreign = await enqueue_with_target(queue, "Update")
    started = trio.Event()
    release = trio.Event()

    async def run(ctx: JobContext[Any]) -> None:
        started.set()
        await release.wait()
        await succeed(ctx)

    anonymous = PgJobStore(db, LEASED, runnable_kinds=frozenset({"Update"}),
                           known_kinds=KINDS_SET)
    executors = executors_for_all(run)
    only_uploads = type(executors)()
    only_uploads.register(type(long_one.payload), run)
    async with running(queue, only_uploads) as worker:
        with trio.fail_after(10):
            await started.wait()
        assert [j.id for j in await anonymous.claim(1)] == [foreign.job_id]
        await db.execute("UPDATE build_jobs SET picked_at = now() - interval '2 hours' "
                         "WHERE status = 'in_progress'")
        assert await anonymous.recover() == RecoveryResult(failed=0, reset=1)
        assert (await job_row(db, long_one.job_id) or {})["status"] == "in_progress"
        assert (await job_row(db, foreign.job_id) or {})["status"] == "pending"
        release.set()
        await worker.wait_for(lambda s: s.done >= 1)
    assert (await job_row(db, long_one.job_id) or {})["status"] == "done"


#: The original Rust worker's own statements (reference §5.1, §6): its sweep hands a
#: stuck row on without touching columns it does not know, and its claim takes the
#: oldest pending row the same way.
ORIGINAL_SWEEP = ("UPDATE build_jobs SET status = 'pending', picked_at = NULL "
                  "WHERE status = 'in_progress' AND picked_at < now() - "
                  "make_interval(mins => 60) AND attempt < 3")
ORIGINAL_CLAIM = ("UPDATE build_jobs SET status = 'in_progress', picked_at = now(), "
                  "attempt = attempt + 1 WHERE id = (SELECT id FROM build_jobs "
                  "WHERE status = 'pending' ORDER BY created_at FOR UPDATE SKIP LOCKED "
                  "LIMIT 1) RETURNING id")


async def test_a_row_the_originals_sweep_handed_on_is_no_longer_our_workers(
    db: Database,
) -> None:
    """
    Found by review: our worker's job ran past 60 minutes; a replica running the
    original's SQL swept it (status and picked_at only) and claimed it again. The
    row must stop naming our worker: else our worker's death has the leader rescue
    the job from under the original's replica (a second concurrent run, and the
    original's late result written over ours), and while our worker lives the
    sweep never frees the row should the original's replica die.
    """
    queue = _queue(db)
    job = await enqueue_with_target(queue, "Upload")
    ours = await _dead_worker(db)  # registered; it heartbeats until it dies, below
    assert [j.id for j in await ours.claim(1)] == [job.job_id]
    await db.execute("UPDATE build_jobs SET picked_at = now() - interval '2 hours'")
    assert (await db.execute(ORIGINAL_SWEEP)) == "UPDATE 1"
    assert await db.fetchval(ORIGINAL_CLAIM) == job.job_id
    assert await db.fetchval("SELECT claimed_by FROM build_jobs") is None

    await _age_heartbeat(db, ours.worker_id)  # now our worker dies
    rescuer = PgJobStore(db, LEASED, runnable_kinds=KINDS_SET, known_kinds=KINDS_SET)
    assert await rescuer.rescue() == RescueResult(declared_dead=1, failed=0, rescued=0)
    row = await job_row(db, job.job_id)
    assert row is not None
    assert (row["status"], row["attempt"]) == ("in_progress", 2)  # the original's run
    # And when the original's replica dies too, the 60-minute rule frees it.
    await db.execute("UPDATE build_jobs SET picked_at = now() - interval '2 hours'")
    assert await rescuer.recover() == RecoveryResult(failed=0, reset=1)


async def test_one_leader_among_replicas_and_the_next_takes_over_when_it_stops(
    dsn: str, db: Database
) -> None:
    async with AsyncExitStack() as stack:
        dbs = [await stack.enter_async_context(_open(dsn)) for _ in range(3)]
        workers = [Worker(_queue(d), executors_for_all(succeed)) for d in dbs]
        with trio.fail_after(TEST_DEADLINE):
            async with trio.open_nursery() as nursery:
                scopes = []
                for worker in workers:
                    scope = trio.CancelScope()
                    scopes.append(scope)
                    await nursery.start(_run_in, scope, worker)
                for worker in workers:
                    await worker.wait_for(lambda s: s.heartbeats >= 3)
                leaders = [w for w in workers if w.is_leader]
                assert len(leaders) == 1
                leader = leaders[0]
                assert leader.heartbeat.identity is not None
                assert await db.fetchval("SELECT worker_id FROM nasiko_queue_leaders") == \
                    leader.heartbeat.identity.id
                leader.stop()  # graceful: its row and its leadership go at once
                others = [w for w in workers if w is not leader]
                async with trio.open_nursery() as waiting:
                    for other in others:
                        waiting.start_soon(_wait_elected_or_not, other, others)
                assert sum(w.is_leader for w in others) == 1
                for worker in others:
                    worker.stop()


async def _wait_elected_or_not(worker: Worker, all_of: list[Worker]) -> None:
    await worker.wait_for(lambda s: any(w.is_leader for w in all_of))


async def _run_in(scope: trio.CancelScope, worker: Worker, *,
                  task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    with scope:
        await worker.run(task_status=task_status)


def _open(dsn: str) -> Any:
    from nasiko_queue import open_database

    return open_database(dsn)


async def test_a_job_past_its_run_time_limit_counts_as_a_crash(db: Database) -> None:
    runs: list[int] = []

    async def hang(ctx: JobContext[Any]) -> None:
        runs.append(ctx.attempt)
        await trio.sleep_forever()  # the outside world: a build that never returns

    executors = executors_for_all(succeed)
    limited = type(executors)()
    job = await enqueue_with_target(_queue(db), "Upload", prior_success=True)
    limited.register(type(job.payload), hang, timeout=0.2)
    async with running(_queue(db), limited) as worker:
        with trio.fail_after(20):
            await worker.wait_for(lambda s: s.failed >= 1)
        assert worker.stats.timed_out == 3
    row = await job_row(db, job.job_id)
    assert row is not None
    assert (row["status"], row["attempt"], row["error_msg"]) == ("failed", 3, JOB_PANICKED)
    assert runs == [1, 2, 3]


async def test_the_default_run_time_limit_applies_to_every_kind(db: Database) -> None:
    async def hang(ctx: JobContext[Any]) -> None:
        await trio.sleep_forever()

    job = await enqueue_with_target(_queue(db), "Rollback", prior_success=True)
    await db.execute("UPDATE build_jobs SET attempt = 2 WHERE id = $1", job.job_id)
    config = attrs.evolve(LEASED, job_timeout=0.2)
    async with running(_queue(db, config), executors_for_all(hang)) as worker:
        with trio.fail_after(20):
            await worker.wait_for(lambda s: s.failed >= 1)
    assert (await job_row(db, job.job_id) or {})["error_msg"] == JOB_PANICKED


async def test_a_worker_cut_off_stops_its_job_before_its_lease_ends_and_resumes(
    dsn: str, db: Database
) -> None:
    """Heartbeats stop landing (a network cut: every connection, old and new, gets
    no reset and no answer). Within
    `lease - heartbeat_interval` of its last heartbeat the worker cancels its running
    job (whose result is never written) and drops nothing it could not give back;
    once the database answers again it retires that identity, registers a new one,
    and, leading, rescues the old identity's job, which then runs again."""
    config = attrs.evolve(LEASED, listen=False, cleanup_timeout=0.2, poll_interval=3600.0)
    direct = Queue(db, config=attrs.evolve(config, notify_channel=None), secrets=MASTER_KEY)
    job = await enqueue_with_target(direct, "Upload")
    started = trio.Event()
    cancelled = trio.Event()
    cancelled_at: list[float] = []
    runs: list[int] = []

    async def run(ctx: JobContext[Any]) -> None:
        runs.append(ctx.attempt)
        if ctx.attempt == 1:
            started.set()
            try:
                await trio.sleep_forever()
            finally:
                cancelled_at.append(trio.current_time())
                cancelled.set()
        await succeed(ctx)

    with trio.fail_after(TEST_DEADLINE):
        async with trio.open_nursery() as outer:
            proxy = Proxy(dsn)
            await outer.start(proxy.run)
            async with _open(proxy.dsn()) as proxied:
                worker = Worker(Queue(proxied, config=config, secrets=MASTER_KEY),
                                executors_for_all(run))
                async with trio.open_nursery() as nursery:
                    await nursery.start(worker.run)
                    worker.wake()
                    await started.wait()
                    await worker.wait_for(lambda s: s.heartbeats >= 1)
                    frozen_at = trio.current_time()
                    proxy.partition()
                    await cancelled.wait()
                    assert worker.stats.fenced == 1
                    # Stopped before the lease could end elsewhere (it counts from the
                    # last heartbeat that landed, before the freeze).
                    assert cancelled_at[0] - frozen_at < config.lease
                    proxy.restore()
                    await worker.wait_for(lambda s: s.registrations >= 2 and s.done >= 1)
                    worker.stop()
            outer.cancel_scope.cancel()
    row = await job_row(db, job.job_id)
    assert row is not None
    assert (row["status"], row["attempt"]) == ("done", 2)
    assert runs == [1, 2]


async def test_a_worker_declared_dead_stops_its_job_and_starts_afresh(db: Database) -> None:
    """A pause longer than the lease (SIGSTOP, a frozen VM): meanwhile the worker was
    declared dead and its job given back. Its next heartbeat says so; it cancels the
    run (the job is someone else's now), registers anew, and claims the job again."""
    config = attrs.evolve(LEASED, poll_interval=3600.0)
    queue = _queue(db, config)
    job = await enqueue_with_target(queue, "Upload")
    started = trio.Event()
    runs: list[int] = []

    async def run(ctx: JobContext[Any]) -> None:
        runs.append(ctx.attempt)
        if ctx.attempt == 1:
            started.set()
            await trio.sleep_forever()
        await succeed(ctx)

    rescuer = PgJobStore(db, config, runnable_kinds=KINDS_SET, known_kinds=KINDS_SET)
    async with running(queue, executors_for_all(run)) as worker:
        with trio.fail_after(10):
            await started.wait()
        me = worker.heartbeat.identity
        assert me is not None
        await _age_heartbeat(db, me.id)  # as if it had been paused past its lease
        await db.execute("UPDATE nasiko_queue_workers SET dead_at = now() WHERE id = $1", me.id)
        await rescuer.rescue()
        with trio.fail_after(10):
            await worker.wait_for(lambda s: s.fenced >= 1 and s.registrations >= 2
                                  and s.done >= 1)
    row = await job_row(db, job.job_id)
    assert row is not None
    assert (row["status"], row["attempt"]) == ("done", 2)
    assert runs == [1, 2]


async def test_two_runs_of_one_job_in_one_worker_are_fenced_each(db: Database) -> None:
    """
    Found by the concurrent state machine (a control run failed under load): a
    crashed job's reset commits, another slot of the same worker claims the job
    again and starts it, and only then does the first run's bookkeeping end. The
    running jobs were kept by job id, so the first run's end removed the second
    run's entry: the fence could no longer stop the second run, and its own end
    raised KeyError (which cost the job an attempt). They are kept per claim now.
    """
    first_may_end = trio.Event()
    second_started = trio.Event()

    async def run(ctx: JobContext[Any]) -> None:
        if ctx.attempt == 1:
            await first_may_end.wait()
            await succeed(ctx)
        else:
            second_started.set()
            await trio.sleep_forever()  # only the fence ends it

    queue = _queue(db)
    await enqueue_with_target(queue, "Upload")
    worker = Worker(queue, executors_for_all(run))
    (first,) = await worker.executor.store.claim(1)
    second = attrs.evolve(first, old_attempt=first.attempt)  # attempt 2, the same job
    results: dict[int, Any] = {}
    first_ended = trio.Event()

    async def run_once(job: Any) -> None:
        results[job.attempt] = await worker.executor.run_once(job)
        if job.attempt == 1:
            first_ended.set()

    with trio.fail_after(TEST_DEADLINE):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(run_once, first)
            nursery.start_soon(run_once, second)
            await second_started.wait()
            first_may_end.set()
            await first_ended.wait()
            worker.fence("the test")  # the worker lost its lease: both runs must stop
    assert results[1] is not None  # the first finished (its outcome is for the completer)
    assert results[2] is None  # the second was stopped by the fence, its outcome unwritten
    assert worker.state.job_scopes == {}
