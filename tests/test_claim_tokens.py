"""
A claim is unique for the life of a job (issue #45, bug 1).

The dead-letter retry starts a job's attempts from 0 again, so a frozen
worker's run (id, attempt 1) and the run after an operator's retry (id, attempt
1) used to look the same to every write guarded by (id, attempt, state): on
resuming, the frozen worker's fence reset the row under the live run, its new
identity claimed the job as attempt 2 and discarded it, and the live run's
success was dropped. Every write a worker makes to its claim now names the
claim's token, which every claim sets anew (and the rescue, the sweep, a
give-back and the retry clear); for build jobs, the token and the attempt
together (the original's SQL claims without writing the token).

The frozen worker is in-process and gated: its heartbeat runs only when the
test says (`beat_once`), which is what a SIGSTOPped process's does; the
rescue and the retry are the leader's and the operator's own calls.
"""

from __future__ import annotations

import json
from typing import Any, ClassVar
from uuid import UUID

import attrs
import trio

from nasiko_queue import (
    Database,
    Executors,
    JobArgs,
    JobContext,
    JobOptions,
    PlainJobContext,
    Queue,
    Worker,
    job_admin,
)
from nasiko_queue.builds.store import PgJobStore
from nasiko_queue.engine.contracts import MAX_ATTEMPTS_EXCEEDED, ClaimedJob, JobResult
from nasiko_queue.plain.store import CANCELLED, DISCARDED, PlainJobStore
from nasiko_queue.testing import KINDS, enqueue_with_target

from .conftest import FAST, MASTER_KEY
from .helpers import TEST_DEADLINE, executors_for_all, succeed

#: No heartbeat of its own (the test beats for it), no maintenance, no poll.
FROZEN = attrs.evolve(FAST, poll_interval=3600.0, heartbeat_interval=3600.0,
                      lease=3 * 3600.0, queues={"tokens": 1}, maintenance=False)


@attrs.frozen
class Once(JobArgs):
    kind: ClassVar[str] = "tokens_once"
    options: ClassVar[JobOptions] = JobOptions(queue="tokens", max_attempts=1)
    n: int = 0


async def _row(db: Database, job_id: UUID) -> dict[str, Any]:
    row = await db.fetchrow(
        "SELECT state, attempt, claimed_by, claim_token, error_msg, result::text AS result "
        "FROM nasiko_queue_jobs WHERE id = $1", job_id)
    assert row is not None
    return dict(row)


async def _declare_dead(db: Database, worker: Worker) -> None:
    """What the leader does to a worker paused past its lease (its row is aged
    out: declared dead)."""
    await worker.wait_for(lambda s: s.heartbeats >= 1)  # its first beat has landed
    me = worker.heartbeat.identity
    assert me is not None
    await db.execute("UPDATE nasiko_queue_workers SET dead_at = now(), heartbeat_at = "
                     "heartbeat_at - interval '1 hour' WHERE id = $1", me.id)


async def test_a_frozen_workers_run_never_touches_the_run_after_an_operators_retry(
    db: Database,
) -> None:
    """
    The reported scenario. A `max_attempts=1` job runs on W1, which freezes; the
    rescue discards the job (its last attempt); an operator retries it; W2 runs
    it (attempt 1 again). W1 resumes: its heartbeat learns it was declared dead,
    its fence stops the old run and writes the reset, which must change nothing,
    and its new identity finds nothing to claim. W2's success lands.
    """
    leader = PgJobStore(db, FROZEN, runnable_kinds=frozenset(), known_kinds=frozenset())
    w1_started, w1_stopped = trio.Event(), trio.Event()
    w2_started, w2_may_return = trio.Event(), trio.Event()

    async def frozen_run(ctx: PlainJobContext[Once]) -> None:
        w1_started.set()
        try:
            await trio.sleep_forever()
        finally:
            w1_stopped.set()

    async def live_run(ctx: PlainJobContext[Once]) -> dict[str, str]:
        w2_started.set()
        await w2_may_return.wait()
        return {"by": "w2"}

    first, second = Executors(), Executors()
    first.register(Once, frozen_run)
    second.register(Once, live_run)
    w1 = Worker(Queue(db, config=FROZEN), first)
    w2 = Worker(Queue(db, config=FROZEN), second)
    with trio.fail_after(TEST_DEADLINE):
        async with trio.open_nursery() as nursery:
            await nursery.start(w1.run)
            job_id = await w1.queue.enqueue(Once())
            await w1_started.wait()
            await _declare_dead(db, w1)
            rescued = await leader.rescue()
            assert rescued.failed == 1
            assert (await _row(db, job_id))["state"] == "discarded"
            assert await job_admin.retry(db, job_id, FROZEN) == "plain"
            await nursery.start(w2.run)
            await w2_started.wait()
            live = await _row(db, job_id)
            assert (live["state"], live["attempt"]) == ("running", 1)
            # W1 thaws: declared dead, it fences, stops its run (whose reset names
            # the old claim) and registers anew.
            await w1.heartbeat.beat_once()
            await w1_stopped.wait()
            await w1.wait_for(lambda s: s.fenced >= 1 and s.registrations >= 2
                              and s.running == 0)
            await w1.drain_once()  # its new identity claims whatever it may
            assert await _row(db, job_id) == live, "the frozen worker's fence wrote"
            assert w1.stats.released == 0
            w2_may_return.set()
            await w2.wait_for(lambda s: s.done >= 1)
            w1.stop()
            w2.stop()
    row = await _row(db, job_id)
    assert (row["state"], row["attempt"], row["error_msg"]) == ("completed", 1, None)
    assert json.loads(row["result"]) == {"by": "w2"}


async def _stale_and_live(queue: Queue) -> tuple[PlainJobStore, ClaimedJob, ClaimedJob]:
    """A `max_attempts=1` job claimed (the stale claim), discarded by the rescue
    of its dead worker, retried by an operator and claimed again: the live claim,
    of the same attempt."""
    job_id = await queue.enqueue(Once())
    holder = UUID(int=1)
    store = PlainJobStore(queue.db, queue.config, "tokens", lambda: holder)
    [stale] = await store.claim(1)
    await queue.db.execute(
        "INSERT INTO nasiko_queue_workers (id, host, pid, kinds, lease_secs, heartbeat_at, "
        "dead_at) VALUES ($1, 'frozen', 1, '{}', 1, now(), now())", holder)
    await queue.db.execute("UPDATE nasiko_queue_jobs SET attempted_at = attempted_at - "
                           "interval '1 hour' WHERE id = $1", job_id)
    rescue = PgJobStore(queue.db, queue.config, runnable_kinds=frozenset(),
                        known_kinds=frozenset())
    assert (await rescue.rescue()).failed == 1
    assert await job_admin.retry(queue.db, job_id, queue.config) == "plain"
    [live] = await store.claim(1)
    assert (live.id, live.attempt) == (stale.id, stale.attempt) == (job_id, 1)
    assert live.claim_token != stale.claim_token
    return store, stale, live


async def test_every_write_of_a_stale_plain_claim_touches_nothing(queue: Queue) -> None:
    """Each statement a worker writes its claim with, sent for the stale claim
    of the same job and attempt, changes no row; the live claim's finish lands."""
    store, stale, live = await _stale_and_live(queue)
    before = await _row(queue.db, live.id)
    statuses, _ = await store.finish_many_and_claim([(stale, None, JobResult('"stale"'))], 0)
    assert statuses == {stale.id: None}
    assert await store.retry(stale, 0.0, "boom") is None
    assert await store.defer(stale, 0.0, "no executor") is None
    assert await store.end(stale, DISCARDED, MAX_ATTEMPTS_EXCEEDED) is None
    assert await store.end(stale, CANCELLED, "cancelled") is None
    assert not await store.discard_unrecorded(stale, "refused")
    assert not await store.reset(stale)
    assert await store.unclaim([stale]) == 0
    assert await _row(queue.db, live.id) == before
    statuses, _ = await store.finish_many_and_claim([(live, None, JobResult('"live"'))], 0)
    assert statuses == {live.id: "done"}
    # A retried batch of the stale claim still reports nothing of the live one's.
    statuses, _ = await store.finish_many_and_claim([(stale, None, None)], 0)
    assert statuses == {stale.id: None}
    row = await _row(queue.db, live.id)
    assert (row["state"], json.loads(row["result"])) == ("completed", "live")


async def test_a_limited_queue_frees_no_slot_for_a_stale_finish(queue: Queue) -> None:
    """The limited claim is told which finishing jobs end: a stale claim's
    finish, of the same job and attempt as the live run, frees no slot."""
    await queue.set_limit("tokens", concurrency=1)
    store, stale, live = await _stale_and_live(queue)
    await queue.enqueue(Once(n=2))
    statuses, claimed = await store.finish_many_and_claim([(stale, None, None)], 1)
    assert statuses == {stale.id: None}
    assert claimed == []  # the live run still holds the only slot
    statuses, claimed = await store.finish_many_and_claim([(live, None, None)], 1)
    assert statuses == {live.id: "done"}
    assert len(claimed) == 1


async def test_the_limited_pick_rechecks_a_finishing_claim_by_its_token(queue: Queue) -> None:
    """Under the queue's lock the pick re-checks which finishing jobs still run
    the claim that finishes (migration 0036). By attempt (0035's form) a stale
    finish of the same job and attempt as the live run, seen as live when its
    statement began (the rescue, the retry and the new claim committing while
    it waited for the lock), freed the live run's slot; by token it frees none."""
    await queue.set_limit("tokens", concurrency=1)
    _store, stale, live = await _stale_and_live(queue)
    await queue.enqueue(Once(n=2))
    pick = ("SELECT nasiko_queue_limited_pick('tokens', 1, ARRAY[$1::uuid], ARRAY[$2::uuid], "
            "pg_current_snapshot())")
    # A concurrency limit alone: the pick only answers (it writes no start).
    assert await queue.db.fetchval(pick, stale.id, stale.claim_token) == []
    assert len(await queue.db.fetchval(pick, live.id, live.claim_token)) == 1
    by_attempt = pick.replace("ARRAY[$2::uuid]", "ARRAY[$2::integer]")
    # 0035's form: the stale finish freed the slot.
    assert len(await queue.db.fetchval(by_attempt, stale.id, stale.attempt)) == 1


async def test_a_new_claim_of_a_job_always_has_a_token_of_its_own(queue: Queue) -> None:
    """Every claim statement writes a token of its own: a give-back restores the
    attempt, and the next claim of the row (the same attempt again) is told
    apart by its token."""
    job_id = await queue.enqueue(Once())
    store = PlainJobStore(queue.db, queue.config, "tokens", lambda: None)
    tokens = []
    for _ in range(3):
        [job] = await store.claim(1)
        assert job.attempt == 1
        assert (await _row(queue.db, job_id))["claim_token"] == job.claim_token
        tokens.append(job.claim_token)
        assert await store.unclaim([job]) == 1
        assert (await _row(queue.db, job_id))["claim_token"] is None
    assert None not in tokens
    assert len(set(tokens)) == 3


async def test_a_discard_of_a_job_asked_to_stop_ends_it_cancelled(queue: Queue) -> None:
    """Decided (issue #45's suspicion): `plain_end` followed its caller's state,
    so a run asked to stop whose result was refused (or whose outcome could not
    be recorded) ended `discarded`. It ends by the cancel rule
    (`nasiko_queue_run_end`: a cancel wins), as a crash's retry does."""
    job_id = await queue.enqueue(Once())
    store = PlainJobStore(queue.db, queue.config, "tokens", lambda: None)
    [job] = await store.claim(1)
    assert await queue.cancel(job_id) == "cancelling"
    assert await store.end(job, DISCARDED, "result refused: not JSON") == CANCELLED
    row = await _row(queue.db, job_id)
    assert (row["state"], row["error_msg"], row["claim_token"]) == ("cancelled", "cancelled",
                                                                    None)
    # Not asked to stop: discarded, with its error.
    other = await queue.enqueue(Once(n=1))
    [job] = await store.claim(1)
    assert await store.end(job, DISCARDED, "result refused: not JSON") == DISCARDED
    row = await _row(queue.db, other)
    assert (row["state"], row["error_msg"]) == ("discarded", "result refused: not JSON")


async def test_a_job_cancelled_while_it_returns_a_refused_result_ends_cancelled(
    db: Database,
) -> None:
    """The same through a worker: the job is asked to stop as its executor returns
    a value that cannot be stored (whether or not the worker's heartbeat saw the
    cancel first, the refused result is written by `plain_end`)."""
    config = attrs.evolve(FROZEN, heartbeat_interval=0.1, lease=1.0)
    queue = Queue(db, config=config)

    async def refused(ctx: PlainJobContext[Once]) -> object:
        assert await queue.cancel(ctx.job_id) == "cancelling"
        return {1, 2}  # a set: not JSON

    executors = Executors()
    executors.register(Once, refused)
    worker = Worker(queue, executors)
    with trio.fail_after(TEST_DEADLINE):
        async with trio.open_nursery() as nursery:
            await nursery.start(worker.run)
            job_id = await queue.enqueue(Once())
            await worker.wait_for(lambda s: s.cancelled + s.failed >= 1)
            worker.stop()
    row = await _row(db, job_id)
    assert (row["state"], row["error_msg"]) == ("cancelled", "cancelled")


async def test_every_write_of_a_stale_build_claim_touches_nothing(db: Database) -> None:
    """Build jobs: the dead-letter retry (`build_job_requeue`) starts the attempts
    from 0 too. A claim is named by its token and its attempt, so the stale
    claim's finish, fail, reset and give-back leave the live claim's row alone."""
    queue = Queue(db, config=FAST, secrets=MASTER_KEY)
    kinds = frozenset(KINDS)
    store = PgJobStore(db, FAST, runnable_kinds=kinds, known_kinds=kinds)
    job = await enqueue_with_target(queue, "Upload")
    [stale] = await store.claim(1)
    assert await store.fail(stale, MAX_ATTEMPTS_EXCEEDED, own_build_id=None, terminalize=False)
    assert await job_admin.retry(db, job.job_id, FAST) == "build"
    [live] = await store.claim(1)
    assert (live.id, live.attempt) == (stale.id, stale.attempt) == (job.job_id, 1)
    assert live.claim_token != stale.claim_token
    row_sql = ("SELECT status, attempt, claim_token, error_msg, completed_at "
               "FROM build_jobs WHERE id = $1")
    before = dict(await db.fetchrow(row_sql, live.id))
    assert await store.finish_from_build(stale, job.build_id) is None
    assert not await store.fail(stale, MAX_ATTEMPTS_EXCEEDED, own_build_id=None,
                                terminalize=False)
    assert not await store.reset(stale)
    assert await store.unclaim([stale]) == 0
    assert dict(await db.fetchrow(row_sql, live.id)) == before
    assert await store.reset(live)
    assert (await db.fetchrow(row_sql, live.id))["status"] == "pending"


async def test_a_build_claim_the_originals_sql_took_over_is_not_ours(db: Database) -> None:
    """What the shared table allows: the original's SQL claims without writing
    the token, so a row our claim marked keeps our token when the original's
    worker claims it after its sweep reset ours; its claim raises the attempt,
    and the pair (token, attempt) no longer names ours."""
    queue = Queue(db, config=FAST, secrets=MASTER_KEY)
    kinds = frozenset(KINDS)
    store = PgJobStore(db, FAST, runnable_kinds=kinds, known_kinds=kinds)
    job = await enqueue_with_target(queue, "Upload")
    [ours] = await store.claim(1)
    # The original's sweep (T10) and claim (T1), as its SQL writes them.
    await db.execute("UPDATE build_jobs SET status = 'pending', picked_at = NULL "
                     "WHERE id = $1", job.job_id)
    await db.execute("UPDATE build_jobs SET status = 'in_progress', picked_at = now(), "
                     "attempt = attempt + 1 WHERE id = $1", job.job_id)
    row = await db.fetchrow("SELECT attempt, claim_token FROM build_jobs WHERE id = $1",
                            job.job_id)
    assert (row["attempt"], row["claim_token"]) == (2, ours.claim_token)
    assert await store.finish_from_build(ours, job.build_id) is None
    assert not await store.reset(ours)
    assert (await db.fetchval("SELECT status FROM build_jobs WHERE id = $1",
                              job.job_id)) == "in_progress"


async def test_a_frozen_build_worker_never_touches_the_run_after_an_operators_retry(
    db: Database,
) -> None:
    """The reported scenario with a build job: W1 runs it and freezes; the job
    fails for good (here: by W1's claim itself, as the rescue of an exhausted job
    would); an operator retries it; W2 runs it (attempt 1 again). W1 thaws and
    fences: its reset must change nothing, and W2's outcome lands."""
    config = attrs.evolve(FROZEN, queues=())
    queue = Queue(db, config=config, secrets=MASTER_KEY)
    job = await enqueue_with_target(queue, "Upload")
    w1_started, w2_started, w2_may_return = trio.Event(), trio.Event(), trio.Event()
    w1_runs: list[int] = []

    async def frozen_run(ctx: JobContext[Any]) -> None:
        w1_runs.append(ctx.attempt)
        if not w1_started.is_set():
            w1_started.set()
            await trio.sleep_forever()  # until its fence
        await succeed(ctx)  # a later run on W1: the job was handed back to it

    async def live_run(ctx: JobContext[Any]) -> None:
        w2_started.set()
        await w2_may_return.wait()
        await succeed(ctx)

    w1 = Worker(queue, executors_for_all(frozen_run))
    w2 = Worker(Queue(db, config=config, secrets=MASTER_KEY), executors_for_all(live_run))
    with trio.fail_after(TEST_DEADLINE):
        async with trio.open_nursery() as nursery:
            await nursery.start(w1.run)
            w1.wake()
            await w1_started.wait()
            await w1.wait_for(lambda s: s.heartbeats >= 1)
            me = w1.heartbeat.identity
            assert me is not None
            # Failed for good while W1 is frozen (what the rescue writes to a dead
            # worker's exhausted job), then retried by an operator.
            await db.execute("UPDATE build_jobs SET status = 'failed', error_msg = $2, "
                             "completed_at = now() WHERE id = $1", job.job_id,
                             MAX_ATTEMPTS_EXCEEDED)
            await db.execute("UPDATE nasiko_queue_workers SET dead_at = now() WHERE id = $1",
                             me.id)
            assert await job_admin.retry(db, job.job_id, config) == "build"
            await nursery.start(w2.run)
            w2.wake()
            await w2_started.wait()
            await w1.heartbeat.beat_once()
            await w1.wait_for(lambda s: s.fenced >= 1 and s.registrations >= 2
                              and s.running == 0)
            await w1.drain_once()
            row = await db.fetchrow("SELECT status, attempt FROM build_jobs WHERE id = $1",
                                    job.job_id)
            assert (row["status"], row["attempt"]) == ("in_progress", 1)
            assert w1.stats.released == 0
            assert w1_runs == [1]
            w2_may_return.set()
            await w2.wait_for(lambda s: s.done >= 1)
            w1.stop()
            w2.stop()
    row = await db.fetchrow("SELECT status, attempt FROM build_jobs WHERE id = $1", job.job_id)
    assert (row["status"], row["attempt"]) == ("done", 1)
