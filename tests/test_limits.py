"""
Limits that hold across replicas (issue #23), at the claim: global concurrency
under concurrent claims, rate windows (aged in SQL, never waited for), partition
fairness, and slots freed by every way a run ends (rescue, retry, cancel, dead
letter). The process tests with 4 replicas are in test_limit_processes.py.
"""

from __future__ import annotations

import math
import uuid
from typing import Any, ClassVar
from uuid import UUID

import attrs
import pytest
import trio

from nasiko_queue import Executors, JobArgs, JobOptions, PartitionMode, Queue, Rate, Worker
from nasiko_queue.builds.store import PgJobStore
from nasiko_queue.db.statements import Q
from nasiko_queue.engine.contracts import ClaimedJob, WorkerIdentity
from nasiko_queue.plain.store import PlainJobStore

from .helpers import TEST_DEADLINE


@attrs.frozen(kw_only=True)
class Call(JobArgs):
    kind: ClassVar[str] = "limited_call"
    options: ClassVar[JobOptions] = JobOptions(queue="api", max_attempts=3)
    customer: str = "c"
    n: int = 0


def _store(queue: Queue, worker: UUID | None = None) -> PlainJobStore:
    return PlainJobStore(queue.db, queue.config, "api", lambda: worker)


async def _running(queue: Queue) -> int:
    n: int = await queue.db.fetchval(
        "SELECT count(*) FROM nasiko_queue_jobs WHERE queue = 'api' AND state = 'running'")
    return n


async def _fill(queue: Queue, n: int, customer: str = "c", priority: int = 0) -> list[UUID]:
    opts = JobOptions(queue="api", max_attempts=3, priority=priority)
    return [await queue.enqueue(Call(customer=customer, n=i), options=opts) for i in range(n)]


async def test_the_global_concurrency_holds_under_concurrent_claims(queue: Queue) -> None:
    """Eight replicas' claims at once, each asking for 5: three run, across all of them."""
    await queue.set_limit("api", concurrency=3)
    await _fill(queue, 40)
    taken: list[ClaimedJob] = []

    async def claim() -> None:
        taken.extend(await _store(queue).claim(5))

    for _round in range(3):
        async with trio.open_nursery() as nursery:
            for _ in range(8):
                nursery.start_soon(claim)
        assert await _running(queue) == 3
    assert len(taken) == 3

    # A finish frees its slot in the same statement that claims the next job.
    store = _store(queue)
    done, claimed = await store.finish_many_and_claim([(taken[0], None, None)], 5)
    assert len(done) == 1
    assert len(claimed) == 1
    assert await _running(queue) == 3
    # The limit raised: the next claim takes the new room.
    await queue.set_limit("api", concurrency=5)
    assert len(await store.claim(10)) == 2
    assert await queue.clear_limit("api")
    assert len(await store.claim(10)) == 10  # unlimited again: the plain claim
    assert not await queue.clear_limit("api")


async def test_the_per_worker_slots_still_bound_the_claim(queue: Queue) -> None:
    """The claim never takes more than it asks (its worker's room), under a higher limit."""
    await queue.set_limit("api", concurrency=10)
    await _fill(queue, 20)
    assert len(await _store(queue).claim(2)) == 2


async def _worker(queue: Queue) -> UUID:
    store = PgJobStore(queue.db, queue.config, runnable_kinds=frozenset(),
                       known_kinds=frozenset())
    worker_id = uuid.uuid4()
    await store.register_worker(WorkerIdentity(id=worker_id, host="h", pid=1, kinds=()))
    return worker_id


async def test_a_dead_workers_jobs_release_their_slots_when_rescued(queue: Queue) -> None:
    await queue.set_limit("api", concurrency=2)
    await _fill(queue, 5)
    dead = await _worker(queue)
    assert len(await _store(queue, dead).claim(5)) == 2
    assert await _store(queue).claim(5) == []  # full: the dead worker's jobs hold it
    await queue.db.execute(
        "UPDATE nasiko_queue_workers SET dead_at = now(), "
        "heartbeat_at = now() WHERE id = $1", dead)
    rescued = await queue.db.fetchrow(Q.plain_rescue, None)
    assert rescued["rescued"] == 2
    assert len(await _store(queue).claim(5)) == 2
    assert await _running(queue) == 2


@pytest.mark.parametrize("serial", [False, True])
async def test_a_late_finish_of_a_rescued_job_frees_no_slot(queue: Queue, serial: bool) -> None:
    """
    A worker declared dead finishes its job late, after the rescue made it
    available and another worker claimed it again: the finish is refused (the
    attempt is no longer its), and its claim in the same statement must count
    that job as running. It did not: every finishing id was taken as freeing a
    slot, and a second job ran under `concurrency=1` (or a second of the same
    key in a serial partition).
    """
    if serial:
        await queue.set_limit("api", partition_by="customer",
                              partition_mode=PartitionMode.SERIAL)
    else:
        await queue.set_limit("api", concurrency=1)
    await _fill(queue, 3)
    dead, alive = await _worker(queue), await _worker(queue)
    [late] = await _store(queue, dead).claim(1)
    await queue.db.execute(
        "UPDATE nasiko_queue_workers SET dead_at = now(), heartbeat_at = now() WHERE id = $1",
        dead)
    assert (await queue.db.fetchrow(Q.plain_rescue, None))["rescued"] == 1
    [again] = await _store(queue, alive).claim(1)
    assert (again.id, again.attempt) == (late.id, late.attempt + 1)
    done, claimed = await _store(queue, dead).finish_many_and_claim([(late, None, None)], 1)
    assert done == {late.id: None}  # not its run any more
    assert claimed == []
    assert await _running(queue) == 1


@attrs.frozen(kw_only=True)
class Free(JobArgs):
    kind: ClassVar[str] = "unlimited_call"
    options: ClassVar[JobOptions] = JobOptions(queue="free")


#: The lock a limited queue's claims take (migration 0020), as a replica's
#: claim that stalled holds it.
LIMITS_LOCK = "SELECT pg_advisory_xact_lock(hashtext('nasiko_queue.limits'), hashtext($1))"

#: Sessions of this database waiting for a lock that backend $1 holds.
BLOCKED_BY = """
SELECT count(*) FROM pg_stat_activity
WHERE datname = current_database() AND $1::int = ANY (pg_blocking_pids(pid))
"""


async def test_a_limited_queue_whose_lock_is_held_never_starves_another_queue(
    queue: Queue,
) -> None:
    """
    Another replica's claim stalls holding the lock of limited queue "api": this
    worker's "api" claims wait for it. They used to wait on both of the engine's
    connections, which all lanes share, until the statements' bound abandoned
    them (lost claims, connections closed), and queue "free"'s job waited that
    long. A claim now waits 250 ms at most (migration 0028) and claims nothing:
    the "free" job runs while the lock is still held, and no claim is lost.
    """
    await queue.set_limit("api", concurrency=2)
    await _fill(queue, 3)
    ran_free = trio.Event()
    executors = Executors()

    @executors.register(Call)
    async def call(ctx: Any) -> None:
        pass

    @executors.register(Free)
    async def free(ctx: Any) -> None:
        ran_free.set()

    config = attrs.evolve(queue.config, queues={"api": 2, "free": 1})
    worker = Worker(Queue(queue.db, config=config), executors)
    with trio.fail_after(TEST_DEADLINE):
        async with queue.db.transaction() as stalled:
            await stalled.execute(LIMITS_LOCK, "api")
            pid = await stalled.fetchval("SELECT pg_backend_pid()")
            async with trio.open_nursery() as nursery:
                await nursery.start(worker.run)
                while not await queue.db.fetchval(BLOCKED_BY, pid):  # noqa: ASYNC110
                    await trio.sleep(0.005)  # until an "api" claim waits for the lock
                await queue.enqueue(Free())
                await ran_free.wait()
                assert worker.stats.lost_claims == 0
                assert await _running(queue) == 0  # nothing of "api" claimed meanwhile
                worker.stop()
    assert worker.stats.lost_claims == 0


PICK = "SELECT nasiko_queue_limited_pick('api', 2, '{}'::uuid[], '{}'::int[])"
HOLDS_LIMITS_LOCK = """
SELECT count(*) FROM pg_locks
WHERE locktype = 'advisory' AND pid = pg_backend_pid() AND granted
  AND classid::int = hashtext('nasiko_queue.limits') AND objid::int = hashtext('api')
"""


async def test_the_picks_lock_wait_leaves_the_callers_lock_timeout(
    queue: Queue,
) -> None:
    """
    The pick's bounded wait for its queue's lock (migration 0028) sets
    lock_timeout for itself only: the caller's own is as it was after the pick,
    whether the lock was free or held by another claim (then the pick claims
    nothing after 250 ms, not after the caller's hour). A lock taken is held to
    the end of the caller's transaction: the count of running jobs must see
    every committed claim.
    """
    await queue.set_limit("api", concurrency=2)
    await _fill(queue, 3)
    async with queue.db.transaction() as tx:
        await tx.execute("SET LOCAL lock_timeout = '7s'")
        assert len(await tx.fetchval(PICK)) == 2
        assert await tx.fetchval("SHOW lock_timeout") == "7s"
        assert await tx.fetchval(HOLDS_LIMITS_LOCK) == 1
    async with queue.db.transaction() as stalled:
        await stalled.execute(LIMITS_LOCK, "api")
        async with queue.db.transaction() as tx:
            await tx.execute("SET LOCAL lock_timeout = '1h'")
            with trio.fail_after(TEST_DEADLINE):  # after 250 ms, not the caller's hour
                assert await tx.fetchval(PICK) == []
            assert await tx.fetchval("SHOW lock_timeout") == "1h"
            assert await tx.fetchval(HOLDS_LIMITS_LOCK) == 0


async def test_every_end_of_a_run_frees_its_slot(queue: Queue) -> None:
    """A retry, a dead letter, a cancelled run and a give-back each free one slot."""
    await queue.set_limit("api", concurrency=4)
    await _fill(queue, 10)
    store = _store(queue)
    a, b, c, d = await store.claim(4)
    assert await store.claim(1) == []
    assert await store.retry(a, 60.0, "boom") == "available"
    assert await store.end(b, "discarded", "poison")
    assert await queue.cancel(c.id) == "cancelling"
    assert await store.end(c, "cancelled", None)
    assert await store.unclaim([d]) == 1
    assert len(await store.claim(10)) == 4
    assert await _running(queue) == 4


async def test_a_spent_rate_claims_nothing_and_says_when_it_allows(queue: Queue) -> None:
    """Rate 3 per 60 s: three start, the rest wait; the lane is told to wake at the
    window's end, not at its poll. Windows are aged in SQL."""
    await queue.set_limit("api", rate=Rate(3, per=60.0))
    await _fill(queue, 10)
    store = _store(queue)
    assert len(await store.claim(2)) == 2
    assert len(await store.claim(5)) == 1
    assert await store.claim(5) == []
    wait = await store.next_due()
    assert wait is not None
    assert 50.0 < wait <= 60.0
    # A run given back still counted as a start (never exceeded)...
    [job] = await queue.db.fetch(
        "SELECT id, claim_token FROM nasiko_queue_jobs WHERE state = 'running' LIMIT 1")
    await queue.db.execute(Q.plain_unclaim, [job["id"]], [job["claim_token"]])
    assert await store.claim(5) == []
    # ...until its window passes.
    await queue.db.execute("UPDATE nasiko_queue_limit_starts "
                           "SET started_at = started_at - interval '61 seconds'")
    assert len(await store.claim(5)) == 3
    [limit] = await queue.limits()
    assert limit.rate == Rate(3, per=60.0)
    assert limit.window_starts == 3
    assert limit.running == 5


async def test_a_rate_partitioned_by_a_job_arg_is_per_key(queue: Queue) -> None:
    await queue.set_limit("api", rate=Rate(2, per=60.0), partition_by="customer")
    await _fill(queue, 6, "a")
    await _fill(queue, 6, "b")
    claimed = await _store(queue).claim(10)
    keys = sorted(j.payload_customer for j in map(_Claimed.of, claimed))
    assert keys == ["a", "a", "b", "b"]
    assert await _store(queue).claim(10) == []
    await _fill(queue, 1, "c")
    assert [_Claimed.of(j).payload_customer for j in await _store(queue).claim(10)] == ["c"]


@attrs.frozen
class _Claimed:
    payload_customer: str

    @classmethod
    def of(cls, job: ClaimedJob) -> _Claimed:
        import json
        assert job.payload is not None
        return cls(json.loads(job.payload)["customer"])


async def test_round_robin_lets_a_new_key_start_in_the_next_claim(queue: Queue) -> None:
    """Key a's backlog of 200 does not delay key b's first job past one claim round;
    priority orders within a key."""
    await queue.set_limit("api", partition_by="customer",
                          partition_mode=PartitionMode.ROUND_ROBIN)
    await _fill(queue, 200, "a")
    first_b = await _fill(queue, 3, "b", priority=1)
    urgent_b = await _fill(queue, 1, "b", priority=0)
    claimed = await _store(queue).claim(2)
    assert sorted(_Claimed.of(j).payload_customer for j in claimed) == ["a", "b"]
    assert urgent_b[0] in {j.id for j in claimed}
    assert first_b[0] not in {j.id for j in claimed}


async def test_serial_mode_runs_one_job_per_key(queue: Queue) -> None:
    await queue.set_limit("api", partition_by="customer", partition_mode="serial")
    await _fill(queue, 5, "a")
    await _fill(queue, 5, "b")
    store = _store(queue)
    first = await store.claim(10)
    assert sorted(_Claimed.of(j).payload_customer for j in first) == ["a", "b"]
    assert await store.claim(10) == []
    _done, claimed = await store.finish_many_and_claim([(first[0], None, None)], 10)
    assert [_Claimed.of(j).payload_customer for j in claimed] == \
        [_Claimed.of(first[0]).payload_customer]


async def test_a_paused_limited_queue_claims_nothing(queue: Queue) -> None:
    from nasiko_queue.job_admin import pause_queue
    await queue.set_limit("api", concurrency=3)
    await _fill(queue, 3)
    await pause_queue(queue.db, "api")
    assert await _store(queue).claim(3) == []


async def test_limits_are_checked(queue: Queue) -> None:
    with pytest.raises(ValueError, match="concurrency must be a whole number from 1"):
        await queue.set_limit("api", concurrency=0)
    # What the table cannot hold is refused here, not by the database (a bug
    # hunt found the dashboard's form sending them on: an int32 overflow, an
    # interval out of range, a period rounded to nothing).
    with pytest.raises(ValueError, match="concurrency must be a whole number from 1"):
        await queue.set_limit("api", concurrency=2**31)
    for per in (math.inf, 1e-300, math.nan, 0.0):
        with pytest.raises(ValueError, match=r"per must be from 0\.001 s to 100 years"):
            Rate(1, per=per)
    with pytest.raises(ValueError, match="limit must be a whole number from 1"):
        Rate(2**31, per=1.0)
    with pytest.raises(ValueError, match="a partition mode needs partition_by"):
        await queue.set_limit("api", partition_mode="serial")
    with pytest.raises(ValueError, match="not 'builds'"):
        await queue.set_limit("builds", concurrency=1)
    with pytest.raises(ValueError, match="limit must be a whole number from 1"):
        Rate(0, per=1.0)
    assert await queue.limits() == []


async def test_each_claim_counts_its_starts_once(queue: Queue) -> None:
    """Whichever statement claims (alone, or with finishes), one start per job taken."""
    await queue.set_limit("api", rate=Rate(100, per=60.0))
    await _fill(queue, 30)
    store = _store(queue)
    first = await store.claim(3)
    claimed = len(first)
    for job in first:
        _done, more = await store.finish_many_and_claim([(job, None, None)], 4)
        claimed += len(more)
    starts = await queue.db.fetchval("SELECT count(*) FROM nasiko_queue_limit_starts")
    assert (claimed, starts) == (15, 15)


def test_the_cli_sets_lists_and_clears_limits(dsn: str) -> None:
    """``nasiko-queue limit set|clear`` and ``limits``: an operator's change, no deploy."""
    import json

    from click.testing import CliRunner

    from nasiko_queue.cli import main

    runner = CliRunner()

    def run(*args: str) -> str:
        result = runner.invoke(main, [*args, "--dsn", dsn], catch_exceptions=False)
        assert result.exit_code == 0, result.output
        return result.output

    assert run("limits") == "no queue has limits\n"
    assert run("limit", "set", "api", "--concurrency", "3", "--rate", "10", "--per", "60",
               "--partition-by", "customer", "--partition-mode", "round_robin") == (
        "set api: concurrency 3 (0 running), rate 10 per key per 60s (0 in the window), "
        "partition by customer (round_robin)\n")
    [row] = json.loads(run("limits", "--json"))
    assert row == {"queue": "api", "concurrency": 3, "rate": {"limit": 10, "per": 60.0},
                   "partition_by": "customer", "partition_mode": "round_robin",
                   "running": 0, "window_starts": 0}
    bad = runner.invoke(main, ["limit", "set", "api", "--rate", "3", "--dsn", dsn])
    assert bad.exit_code == 2
    assert "--rate and --per go together" in bad.output
    assert run("limit", "clear", "api") == "cleared the limits of api\n"
    assert run("limit", "clear", "api") == "api had no limits\n"


async def test_round_robin_turns_carry_over_claims_of_one_job(queue: Queue) -> None:
    """
    Regression: the turn was the rank within the claim, so claims of one job each
    (a worker with one free slot) took key a's oldest every time and key b, enqueued
    after, waited for a's whole backlog. The key served longest ago goes first.
    """
    await queue.set_limit("api", partition_by="customer", partition_mode="round_robin")
    await _fill(queue, 20, "a")
    store = _store(queue)
    assert [_Claimed.of(j).payload_customer for j in await store.claim(1)] == ["a"]
    await _fill(queue, 2, "b")
    await _fill(queue, 2, "c")
    order = [_Claimed.of(j).payload_customer for _ in range(6) for j in await store.claim(1)]
    assert order == ["b", "c", "a", "b", "c", "a"]


async def test_the_dashboard_shows_sets_and_clears_limits(queue: Queue) -> None:
    from urllib.parse import unquote_plus

    from nasiko_queue.web.dashboard import dashboard_app

    from .test_dashboard import TOKEN, _client, _login

    await queue.set_limit("api", rate=Rate(20, per=2.0), partition_by="customer")
    app = dashboard_app(queue.db, token=TOKEN, config=queue.config)
    async with await _client(app) as client:
        page = (await client.get("/limits")).text
        assert "20 per 2 s per key" in page
        assert "customer (none)" in page
        csrf = await _login(client)
        r = await client.post("/actions/limit-set", data={
            "queue": "email", "concurrency": "3", "rate": "", "per": "",
            "partition_by": "", "partition_mode": "none", "csrf": csrf, "next": "/limits"})
        assert r.status_code == 303
        assert "limits of queue email set" in unquote_plus(r.headers["location"])
        r = await client.post("/actions/limit-set", data={
            "queue": "email", "rate": "5", "csrf": csrf, "next": "/limits"})
        assert "a rate needs its period" in unquote_plus(r.headers["location"])
        r = await client.post("/actions/limit-clear",
                              data={"queue": "api", "csrf": csrf, "next": "/limits"})
        assert "limits of queue api cleared" in unquote_plus(r.headers["location"])
    assert [(x.queue, x.concurrency, x.rate) for x in await queue.limits()] == [
        ("email", 3, None)]


async def test_a_job_committed_while_a_limited_claim_waits_is_claimed_or_left_uncounted(
    queue: Queue,
) -> None:
    """
    The limited claim's outer UPDATE reads the statement's snapshot, taken before
    `nasiko_queue_limited_pick` waits (for the queue's lock, or here a ledger row
    a slow transaction holds); the pick reads fresh snapshots after the wait. A
    job committed in between was picked, locked and its start written to the
    rate ledger, but the outer UPDATE could not see it: the claim returned
    nothing, the job stayed available, and the window's one start was spent on
    a run that never began (found deciding a suspicion of issue #45).
    """
    from .test_cancel_race import _blocked_by

    await queue.set_limit("api", rate=Rate(1, per=3600.0))
    # An old start, out of the window: the claim deletes it first, and waits
    # for it while a slow transaction holds it.
    await queue.db.execute("INSERT INTO nasiko_queue_limit_starts (queue, pkey, started_at) "
                           "VALUES ('api', '', now() - interval '2 hours')")
    claimed: list[ClaimedJob] = []
    with trio.fail_after(TEST_DEADLINE):
        async with trio.open_nursery() as nursery, queue.db.transaction() as slow:
            await slow.execute("SELECT 1 FROM nasiko_queue_limit_starts FOR UPDATE")
            # The enqueue begins first: its job is due (run_at is its transaction's
            # now()) by the time the pick reads, as is any job committed while a
            # claim waits for the queue's lock.
            async with queue.db.transaction() as enqueue:
                job_id = await queue.enqueue(Call(), tx=enqueue)

                async def claim() -> None:
                    claimed.extend(await _store(queue).claim(5))

                nursery.start_soon(claim)
                await _blocked_by(queue.db, await slow.fetchval("SELECT pg_backend_pid()"))
            # The enqueue committed after the claim's statement began, before its pick.
    starts = await queue.db.fetchval(
        "SELECT count(*) FROM nasiko_queue_limit_starts WHERE queue = 'api'")
    state = await queue.db.fetchval("SELECT state FROM nasiko_queue_jobs WHERE id = $1", job_id)
    # Either claimed, its start counted; or left for the next claim, uncounted.
    assert (len(claimed), starts, state) in ((1, 1, "running"), (0, 0, "available"))
    if not claimed:
        assert [j.id for j in await _store(queue).claim(5)] == [job_id]
