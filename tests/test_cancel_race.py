"""
One cancel rule (issue #20, item 3): a cancel racing a claim, or a crashed run
going back to available, is never lost.

The cancel locks the job's row and then decides on the state it holds: an
available job ends `cancelled` at once, a running one is asked to stop
(`cancelling`), an ended one is left as it is (`already <state>`). It used to be
one statement of three parts sharing one snapshot: when a claim held the row,
every part missed it and the cancel answered "no such job" while the job ran.
"""

from __future__ import annotations

import uuid
from collections import Counter
from functools import partial
from typing import Any
from uuid import UUID

import attrs
import pytest
import trio

from nasiko_queue import (
    CancelResult,
    Executors,
    PlainJobContext,
    Queue,
    QueueConfig,
    Worker,
)
from nasiko_queue.db.database import Database
from nasiko_queue.db.statements import Q
from nasiko_queue.engine.state import WorkerStats
from nasiko_queue.plain.store import PlainJobStore

from .conftest import FAST
from .helpers import TEST_DEADLINE, running
from .test_plain_jobs import Step

#: What a claim does to the row it takes (`plain_claim`, for one row).
CLAIM_ONE = """
UPDATE nasiko_queue_jobs
SET state = 'running', attempt = attempt + 1, attempted_at = now(),
    previous_attempted_at = attempted_at, claimed_by = $2, claim_token = gen_random_uuid()
WHERE id = $1 AND state = 'available'
"""

#: Sessions of this database waiting for a lock that backend $1 holds.
BLOCKED_BY = """
SELECT count(*) FROM pg_stat_activity
WHERE datname = current_database() AND $1::int = ANY (pg_blocking_pids(pid))
"""

ROW = """
SELECT state, cancel_requested, finished_at, error_msg FROM nasiko_queue_jobs WHERE id = $1
"""


async def _blocked_by(db: Database, pid: int) -> None:
    """Return once another session waits for a lock that backend `pid` holds
    (the server's own record of who waits for whom, read again until it says so:
    no sleep stands in for the wait)."""
    while not await db.fetchval(BLOCKED_BY, pid):  # noqa: ASYNC110
        await trio.sleep(0.005)


async def _cancel_while_held(queue: Queue, job_id: UUID, hold: str, *args: Any) -> Any:
    """
    Another transaction locks job `job_id`'s row (``SELECT ... FOR UPDATE``) and
    runs `hold` on it; a cancel starts, and once it waits for that transaction's
    lock, the transaction commits. Returns the cancel's answer.
    """
    answers: list[Any] = []

    async def cancel() -> None:
        answers.append(await queue.cancel(job_id))

    with trio.fail_after(TEST_DEADLINE):
        # The transaction commits on leaving; then the nursery waits for the cancel.
        async with trio.open_nursery() as nursery, queue.db.transaction() as tx:
            pid = await tx.fetchval("SELECT pg_backend_pid()")
            await tx.fetchval("SELECT state FROM nasiko_queue_jobs WHERE id = $1 FOR UPDATE",
                              job_id)
            await tx.execute(hold, job_id, *args)
            nursery.start_soon(cancel)
            await _blocked_by(queue.db, pid)
    [answer] = answers
    return answer


async def test_a_cancel_waiting_on_a_claim_asks_the_run_to_stop(queue: Queue) -> None:
    """(b) A claim holds the row and makes it running; the cancel waits for it and
    then finds it running: "cancelling", the flag set, never "no such job"."""
    job_id = await queue.enqueue(Step(n=1))
    answer = await _cancel_while_held(queue, job_id, CLAIM_ONE, uuid.uuid4())
    assert answer == "cancelling"
    assert answer is CancelResult.CANCELLING
    row = await queue.db.fetchrow(ROW, job_id)
    assert (row["state"], row["cancel_requested"]) == ("running", True)


@pytest.mark.parametrize("crash", ["retry", "reset"])
async def test_a_cancel_waiting_on_a_crashed_run_going_back_cancels_it(
    queue: Queue, crash: str
) -> None:
    """(c) A crashed run goes back to available (what `plain_retry` or the hard
    stop's `plain_reset` writes) while the cancel waits for its row: the cancel
    then finds it available and ends it `cancelled`."""
    job_id = await queue.enqueue(Step(n=1))
    store = PlainJobStore(queue.db, queue.config, "default", lambda: None)
    [job] = await store.claim(1)
    if crash == "retry":
        answer = await _cancel_while_held(queue, job_id, Q.plain_retry, job.claim_token, 0.0,
                                          "boom")
    else:
        answer = await _cancel_while_held(queue, job_id, Q.plain_reset, job.claim_token)
    assert answer == "cancelled"
    assert answer is CancelResult.CANCELLED
    row = await queue.db.fetchrow(ROW, job_id)
    assert (row["state"], row["error_msg"]) == ("cancelled", "cancelled")
    assert row["finished_at"] is not None


async def test_a_cancel_waiting_on_a_run_that_ends_answers_its_state(queue: Queue) -> None:
    """A run completes while the cancel waits for its row: "already completed"."""
    job_id = await queue.enqueue(Step(n=1))
    store = PlainJobStore(queue.db, queue.config, "default", lambda: None)
    [job] = await store.claim(1)
    answer = await _cancel_while_held(
        queue, job_id, "UPDATE nasiko_queue_jobs SET state = 'completed', finished_at = now() "
                       "WHERE id = $1 AND attempt = $2", job.attempt)
    assert answer is CancelResult.ALREADY_COMPLETED
    assert answer == "already completed"


#: What the cancel writes to a running job's row (inside `nasiko_queue_cancel`).
ASK_TO_STOP = "UPDATE nasiko_queue_jobs SET cancel_requested = true WHERE id = $1"


@pytest.mark.parametrize("end", ["retry", "reset", "rescue"])
async def test_a_run_end_waiting_on_a_cancel_ends_the_job_cancelled(
    queue: Queue, end: str
) -> None:
    """
    The other side of the race: the cancel holds a running job's row (its flag
    set, not yet committed) while the run's end waits for it: a crash's retry, a
    hard stop's reset, the rescue of its dead worker. Each decides by
    `nasiko_queue_run_end` on the row the cancel left: cancelled.
    """
    job_id = await queue.enqueue(Step(n=1))
    holder = uuid.uuid4()
    store = PlainJobStore(queue.db, queue.config, "default", lambda: holder)
    [job] = await store.claim(1)
    if end == "rescue":
        await queue.db.execute(
            "INSERT INTO nasiko_queue_workers (id, host, pid, kinds, lease_secs, heartbeat_at, "
            "dead_at) VALUES ($1, 'gone', 1, '{}', 1, now() - interval '1 hour', now())",
            holder)
        await queue.db.execute("UPDATE nasiko_queue_jobs SET attempted_at = attempted_at "
                               "- interval '2 hours' WHERE id = $1", job_id)
    ends = {
        "retry": lambda: queue.db.fetchval(Q.plain_retry, job_id, job.claim_token, 0.0, "boom"),
        "reset": lambda: queue.db.execute(Q.plain_reset, job_id, job.claim_token),
        "rescue": lambda: queue.db.fetchrow(Q.plain_rescue, None),
    }
    results: list[Any] = []

    async def run_end() -> None:
        results.append(await ends[end]())

    with trio.fail_after(TEST_DEADLINE):
        async with trio.open_nursery() as nursery, queue.db.transaction() as tx:
            pid = await tx.fetchval("SELECT pg_backend_pid()")
            await tx.execute(ASK_TO_STOP, job_id)
            nursery.start_soon(run_end)
            await _blocked_by(queue.db, pid)
    row = await queue.db.fetchrow(ROW, job_id)
    assert row["state"] == "cancelled"
    assert row["finished_at"] is not None
    if end == "retry":
        assert results == ["cancelled"]
    elif end == "rescue":
        assert (results[0]["rescued"], results[0]["ended"]) == (0, 1)
    assert await queue.cancel(job_id) is CancelResult.ALREADY_CANCELLED


async def test_the_answers_are_strings() -> None:
    """A `str` enum: today's comparisons and f-strings keep working."""
    assert CancelResult.CANCELLED == "cancelled"
    assert f"{CancelResult.ALREADY_DISCARDED} job" == "already discarded job"
    assert CancelResult("cancelling") is CancelResult.CANCELLING
    assert {r.value for r in CancelResult} == {
        "cancelled", "cancelling", "already completed", "already discarded",
        "already cancelled"}


#: Enqueue-then-cancel rounds against a live worker (issue #20 measured 71 and 46
#: of 300 lost on 6ed3707).
ROUNDS = 300


async def test_enqueue_then_cancel_against_a_live_worker_never_loses(db: Database) -> None:
    """
    (a) Each round enqueues a job, which wakes the in-process worker's claim at
    once, and cancels it while that claim may hold its row. Every cancel must
    answer "cancelled" (the job never starts) or "cancelling" (the run is
    stopped); none answers None, and no job ends any other way than cancelled.
    """
    config: QueueConfig = attrs.evolve(FAST, queues={"default": 2}, builds=False,
                                       maintenance=False)
    queue = Queue(db, config=config)
    started: dict[UUID, trio.Event] = {}
    answered: dict[UUID, trio.Event] = {}
    answers: dict[UUID, Any] = {}
    runs: list[UUID] = []
    completed: list[UUID] = []
    executors = Executors()

    def event(events: dict[UUID, trio.Event], job_id: UUID) -> trio.Event:
        return events.setdefault(job_id, trio.Event())

    @executors.register(Step)
    async def step(ctx: PlainJobContext[Step]) -> None:
        runs.append(ctx.job_id)
        event(started, ctx.job_id).set()
        await event(answered, ctx.job_id).wait()
        if answers[ctx.job_id] == "cancelling":
            await trio.sleep_forever()  # until the cancel reaches it
        # A lost cancel: the run returns (its slot is free for the next rounds).
        completed.append(ctx.job_id)

    worker = Worker(queue, executors)
    async with trio.open_nursery() as nursery:
        await nursery.start(worker.run)
        with trio.fail_after(TEST_DEADLINE):
            for n in range(ROUNDS):
                job_id = await queue.enqueue(Step(n=n))
                answer = answers[job_id] = await queue.cancel(job_id)
                event(answered, job_id).set()
                if answer == "cancelling":
                    # The claim took it: its run starts, the heartbeat delivers
                    # the cancel, the run ends cancelled.
                    before = worker.stats.cancelled
                    await event(started, job_id).wait()
                    await worker.heartbeat.beat_once()
                    await worker.wait_for(partial(_cancelled_more, before))
            await worker.wait_for(lambda s: s.running == 0 and s.finishing == 0)
        # Checked before the worker stops: a lost cancel's run still hangs, and a
        # hard stop would put its job back.
        states = await db.fetch("SELECT state, count(*) AS n FROM nasiko_queue_jobs "
                                "GROUP BY state")
        nursery.cancel_scope.cancel()
    counts = Counter(str(a) for a in answers.values())
    print(f"\n{ROUNDS} enqueue-then-cancel rounds: {dict(counts)}")
    lost = [j for j, a in answers.items() if a not in ("cancelled", "cancelling")]
    assert not lost, f"{len(lost)} of {ROUNDS} cancels lost: {dict(counts)}"
    assert not completed
    for job_id, answer in answers.items():
        if answer == "cancelled":
            assert job_id not in runs, f"job {job_id} ran after its cancel answered cancelled"
    assert {r["state"]: r["n"] for r in states} == {"cancelled": ROUNDS}


def _cancelled_more(before: int, stats: WorkerStats) -> bool:
    return stats.cancelled > before


@pytest.mark.parametrize("how", ["unclaim", "lost claim"])
async def test_a_give_back_of_a_job_asked_to_stop_ends_it_cancelled(
    queue: Queue, how: str
) -> None:
    """
    A job claimed into a look-ahead buffer and cancelled there ("cancelling":
    its row is running) is given back unstarted: by a stop, its TTL, the fence,
    or as a claim whose answer was lost. It ends `cancelled` without starting,
    its attempt restored, never available again (it used to go back to
    available, flag and all, and the next claim ran it to `completed`).
    """
    job_id = await queue.enqueue(Step(n=1))
    other = await queue.enqueue(Step(n=2))
    store = PlainJobStore(queue.db, queue.config, "default", lambda: None)
    claimed = await store.claim(2)
    assert {job.id for job in claimed} == {job_id, other}
    assert await queue.cancel(job_id) is CancelResult.CANCELLING
    if how == "unclaim":
        assert await store.unclaim(claimed) == 2
    else:
        token = await queue.db.fetchval(
            "SELECT claim_token FROM nasiko_queue_jobs WHERE id = $1", job_id)
        assert await queue.db.fetchval(Q.plain_unclaim_lost, token) == 2
    row = await queue.db.fetchrow(ROW, job_id)
    assert (row["state"], row["error_msg"]) == ("cancelled", "cancelled")
    assert row["finished_at"] is not None
    attempts = await queue.db.fetch(
        "SELECT id, state, attempt, claimed_by, claim_token FROM nasiko_queue_jobs")
    assert {(r["id"], r["state"], r["attempt"], r["claimed_by"], r["claim_token"])
            for r in attempts} == {(job_id, "cancelled", 0, None, None),
                                   (other, "available", 0, None, None)}
    assert [job.id for job in await store.claim(2)] == [other]  # never claimed again
    assert await queue.cancel(job_id) is CancelResult.ALREADY_CANCELLED


async def test_a_job_cancelled_in_the_prefetch_buffer_ends_cancelled_at_a_graceful_stop(
    queue: Queue,
) -> None:
    """
    A worker with one slot runs job 1 and holds job 2 claimed ahead of it; job 2
    is cancelled ("cancelling"), the heartbeat marks it in the buffer, and the
    worker is asked to stop: the buffer is given back, and job 2 ends
    `cancelled`, never run. Failed before the fix: the give-back made it
    available again, flag and all, for the next worker to run to `completed`.
    """
    ran: list[int] = []
    hold, first_started = trio.Event(), trio.Event()
    executors = Executors()

    @executors.register(Step)
    async def step(ctx: PlainJobContext[Step]) -> None:
        ran.append(ctx.payload.n)
        if ctx.payload.n == 1:
            first_started.set()
            await hold.wait()

    first = await queue.enqueue(Step(n=1))
    second = await queue.enqueue(Step(n=2))
    prefetching = Queue(queue.db, config=attrs.evolve(queue.config, prefetch=1))
    async with running(prefetching, executors) as worker:
        with trio.fail_after(TEST_DEADLINE):
            await first_started.wait()
            await worker.wait_for(lambda s: s.buffered == 1)
            assert await queue.cancel(second) is CancelResult.CANCELLING
            await worker.heartbeat.beat_once()  # delivers the cancel to the buffer
            worker.stop()
            await worker.wait_for(lambda s: s.returned == 1)
            hold.set()
    rows = {r["id"]: (r["state"], r["attempt"], r["error_msg"]) for r in await queue.db.fetch(
        "SELECT id, state, attempt, error_msg FROM nasiko_queue_jobs")}
    assert rows == {first: ("completed", 1, None), second: ("cancelled", 0, "cancelled")}
    assert ran == [1]
    assert not worker.state.cancels  # the give-back spent the buffered job's mark
