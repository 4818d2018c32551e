"""
Plain jobs (issue #11): no target, named queues with their own concurrency,
priority, schedules, retries with backoff, unique keys and cancellation; in a
table of their own, which the original worker's claim never sees.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime, timedelta
from typing import Any, ClassVar

import attrs
import pytest
import trio

from nasiko_queue import (
    Backoff,
    Executors,
    JobArgs,
    JobOptions,
    PlainJobContext,
    Queue,
    QueueConfig,
    Secret,
    SecretBox,
    Unique,
    Update,
    Worker,
    job_errors,
)
from nasiko_queue.db.database import Database
from nasiko_queue.plain.store import PlainJobStore

from .conftest import FAST
from .helpers import TEST_DEADLINE, running


@attrs.frozen(kw_only=True)
class SendEmail(JobArgs):
    kind: ClassVar[str] = "send_email"
    options: ClassVar[JobOptions] = JobOptions(queue="email", max_attempts=3)
    to: str
    subject: str = "hello"


@attrs.frozen(kw_only=True)
class Step(JobArgs):
    kind: ClassVar[str] = "workflow_step"
    n: int


async def plain_row(db: Database, job_id: Any) -> Any:
    return await db.fetchrow(
        "SELECT state, attempt, queue, priority, error_msg, run_at, finished_at, claimed_by "
        "FROM nasiko_queue_jobs WHERE id = $1", job_id)


def no_backoff(_attempt: int) -> float:
    return 0.0


async def test_a_plain_job_runs_and_its_return_means_done(queue: Queue) -> None:
    seen: list[PlainJobContext[SendEmail]] = []
    executors = Executors()

    @executors.register(SendEmail)
    async def send(ctx: PlainJobContext[SendEmail]) -> None:
        seen.append(ctx)

    job_id = await queue.enqueue(SendEmail(to="a@example.com"))
    async with running(queue, executors) as worker:
        with trio.fail_after(TEST_DEADLINE):
            await worker.wait_for(lambda s: s.done >= 1)
    [ctx] = seen
    assert (ctx.job_id, ctx.attempt, ctx.max_attempts, ctx.queue) == (job_id, 1, 3, "email")
    assert ctx.payload == SendEmail(to="a@example.com")
    row = await plain_row(queue.db, job_id)
    assert (row["state"], row["attempt"], row["error_msg"]) == ("completed", 1, None)
    assert row["finished_at"] is not None
    # No build row, no build_jobs row.
    assert await queue.db.fetchval("SELECT count(*) FROM build_jobs") == 0


async def test_an_exception_retries_after_the_backoff_and_the_last_one_discards(
    queue: Queue,
) -> None:
    executors = Executors()
    delays: list[int] = []

    def backoff(attempt: int) -> float:
        delays.append(attempt)
        return 0.0

    @executors.register(SendEmail, backoff=backoff)
    async def send(ctx: PlainJobContext[SendEmail]) -> None:
        raise ConnectionError(f"smtp refused on attempt {ctx.attempt}")

    job_id = await queue.enqueue(SendEmail(to="b@example.com"))
    async with running(queue, executors) as worker:
        with trio.fail_after(TEST_DEADLINE):
            await worker.wait_for(lambda s: s.failed >= 1)
        assert worker.stats.retried == 2
    row = await plain_row(queue.db, job_id)
    assert (row["state"], row["attempt"]) == ("discarded", 3)
    assert row["error_msg"] == "ConnectionError: smtp refused on attempt 3"
    # The backoff is asked after each crash that leaves attempts (1, 2); the
    # last one discards.
    assert delays[:2] == [1, 2]
    errors = await job_errors(queue.db, job_id)
    assert [(e.attempt, e.error_type) for e in errors] == [
        (n, "builtins.ConnectionError") for n in (1, 2, 3)]


async def test_a_crashed_job_waits_for_its_backoff(queue: Queue) -> None:
    executors = Executors()
    runs = 0

    @executors.register(SendEmail, backoff=lambda attempt: 3600.0)
    async def send(ctx: PlainJobContext[SendEmail]) -> None:
        nonlocal runs
        runs += 1
        raise RuntimeError("down")

    job_id = await queue.enqueue(SendEmail(to="c@example.com"))
    async with running(queue, executors) as worker:
        with trio.fail_after(TEST_DEADLINE):
            await worker.wait_for(lambda s: s.retried >= 1)
            await worker.drain_once()
    assert runs == 1
    row = await plain_row(queue.db, job_id)
    assert row["state"] == "available"
    wait = await queue.db.fetchval(
        "SELECT extract(epoch FROM run_at - now()) FROM nasiko_queue_jobs WHERE id = $1", job_id)
    assert 3000 < wait <= 3600 * 1.1


def test_the_default_backoff_grows_and_is_capped() -> None:
    backoff = Backoff(jitter=0)
    assert [backoff(n) for n in (1, 2, 3, 4, 5)] == [16, 31, 96, 271, 640]
    assert backoff(100) == 86_400
    jittered = Backoff()
    assert all(16 * 0.9 <= jittered(1) <= 16 * 1.1 for _ in range(100))


async def test_priority_then_due_time_orders_the_claim(queue: Queue) -> None:
    order: list[int] = []
    executors = Executors()

    @executors.register(Step)
    async def step(ctx: PlainJobContext[Step]) -> None:
        order.append(ctx.payload.n)

    for n, priority in [(1, 5), (2, 0), (3, 5), (4, -1), (5, 0)]:
        await queue.enqueue(Step(n=n), options=JobOptions(priority=priority))
    async with running(queue, executors) as worker:
        with trio.fail_after(TEST_DEADLINE):
            await worker.wait_for(lambda s: s.done >= 5)
    assert order == [4, 2, 5, 1, 3]


async def test_each_queue_runs_at_most_its_concurrency_and_only_its_own_jobs(
    db: Database,
) -> None:
    config = attrs.evolve(FAST, queues={"email": 2, "default": 1})
    queue = Queue(db, config=config)
    running_now = {"email": 0, "default": 0}
    peak = {"email": 0, "default": 0}
    release, full = trio.Event(), trio.Event()
    executors = Executors()

    async def hold(ctx: Any) -> None:
        running_now[ctx.queue] += 1
        peak[ctx.queue] = max(peak[ctx.queue], running_now[ctx.queue])
        if sum(running_now.values()) == 3:
            full.set()
        await release.wait()
        running_now[ctx.queue] -= 1

    executors.register(SendEmail, hold)
    executors.register(Step, hold)
    for n in range(5):
        await queue.enqueue(SendEmail(to=f"{n}@example.com"))
        await queue.enqueue(Step(n=n))
    # A queue this worker does not run: never claimed.
    other = await queue.enqueue(Step(n=99), options=JobOptions(queue="reports"))
    async with running(queue, executors) as worker:
        with trio.fail_after(TEST_DEADLINE):
            # Every slot's executor has started (stats.running counts a slot from
            # the moment it takes a job, before its executor runs).
            await full.wait()
            release.set()
            await worker.wait_for(lambda s: s.done >= 10)
    assert peak == {"email": 2, "default": 1}
    assert (await plain_row(db, other))["state"] == "available"


async def test_a_scheduled_job_is_not_claimed_early_and_wakes_the_worker_when_due(
    db: Database,
) -> None:
    # The poll is an hour: only the wake for the due job can run it in time.
    queue = Queue(db, config=attrs.evolve(FAST, poll_interval=3600.0))
    ran_at: list[float] = []
    executors = Executors()

    @executors.register(Step)
    async def step(ctx: PlainJobContext[Step]) -> None:
        ran_at.append(trio.current_time())

    async with running(queue, executors) as worker:
        later = await queue.enqueue(Step(n=1), run_at=datetime.now(UTC) + timedelta(hours=1))
        await queue.enqueue(Step(n=2), delay=0.5)
        enqueued = trio.current_time()
        with trio.fail_after(TEST_DEADLINE):
            await worker.wait_for(lambda s: s.done >= 1)
    assert ran_at[0] - enqueued >= 0.45
    assert len(ran_at) == 1
    assert (await plain_row(db, later))["state"] == "available"


async def test_run_at_must_be_aware_and_build_jobs_take_no_schedule(queue: Queue) -> None:
    with pytest.raises(ValueError, match="aware"):
        await queue.enqueue(Step(n=1), run_at=datetime(2030, 1, 1))
    with pytest.raises(ValueError, match="run_at or delay"):
        await queue.enqueue(Step(n=1), run_at=datetime.now(UTC), delay=1)
    from uuid import uuid4

    from nasiko_queue.testing import make_payload
    build = make_payload("Update", target_id=uuid4(), build_id=uuid4(), owner_id=uuid4())
    with pytest.raises(ValueError, match="build job"):
        await queue.enqueue(build, delay=5)


async def test_a_unique_enqueue_returns_the_existing_job(queue: Queue) -> None:
    first = await queue.enqueue(Step(n=1), unique=Unique("report:2026-12-01"))
    again = await queue.enqueue(Step(n=2), unique=Unique("report:2026-12-01"))
    other = await queue.enqueue(Step(n=3), unique=Unique("report:2026-12-02"))
    assert again == first
    assert other != first
    assert await queue.db.fetchval("SELECT count(*) FROM nasiko_queue_jobs") == 2


async def test_concurrent_unique_enqueues_insert_one_job(queue: Queue) -> None:
    ids: list[Any] = []

    async def enqueue() -> None:
        ids.append(await queue.enqueue(Step(n=0), unique=Unique("once")))

    async with trio.open_nursery() as nursery:
        for _ in range(20):
            nursery.start_soon(enqueue)
    assert len(set(ids)) == 1
    assert await queue.db.fetchval("SELECT count(*) FROM nasiko_queue_jobs") == 1


async def test_a_unique_key_frees_once_its_job_leaves_the_unique_states(queue: Queue) -> None:
    executors = Executors()
    executors.register(Step, _noop)
    first = await queue.enqueue(Step(n=1), unique=Unique("k"))
    async with running(queue, executors) as worker:
        with trio.fail_after(TEST_DEADLINE):
            await worker.wait_for(lambda s: s.done >= 1)
    second = await queue.enqueue(Step(n=2), unique=Unique("k"))
    assert second != first
    # Unique among completed ones too: a third is the completed first... or the second.
    ever = await queue.enqueue(Step(n=3), unique=Unique(
        "k", states={"available", "running", "completed"}))
    assert ever in (first, second)


async def test_a_key_is_held_by_its_jobs_own_states_not_the_next_enqueues(
    queue: Queue,
) -> None:
    """The rule the README states: the states kept with the job decide. A key
    whose job had the default states is free once that job completed, even for
    an enqueue that names "completed"; a key whose job named "completed" stays
    held once it completed, even against an enqueue with the default states."""
    executors = Executors()
    executors.register(Step, _noop)
    ever = Unique("ever", states={"available", "running", "completed"})
    plain = await queue.enqueue(Step(n=1), unique=Unique("plain"))
    once = await queue.enqueue(Step(n=2), unique=ever)
    async with running(queue, executors) as worker:
        with trio.fail_after(TEST_DEADLINE):
            await worker.wait_for(lambda s: s.done >= 2)
    assert await queue.enqueue(Step(n=3), unique=Unique(
        "plain", states={"available", "running", "completed"})) != plain
    assert await queue.enqueue(Step(n=4), unique=Unique("ever")) == once
    assert await queue.db.fetchval("SELECT count(*) FROM nasiko_queue_jobs") == 3


async def _noop(_ctx: Any) -> None:
    return None


async def test_cancel_a_waiting_job_and_a_running_one(queue: Queue) -> None:
    started = trio.Event()
    executors = Executors()
    stopped: list[bool] = []

    @executors.register(Step)
    async def step(ctx: PlainJobContext[Step]) -> None:
        started.set()
        try:
            await trio.sleep_forever()
        finally:
            stopped.append(True)

    waiting = await queue.enqueue(Step(n=1), delay=3600)
    assert await queue.cancel(waiting) == "cancelled"
    assert (await plain_row(queue.db, waiting))["state"] == "cancelled"
    assert await queue.cancel(waiting) == "already cancelled"  # no change
    assert await queue.cancel(waiting.__class__(int=1)) is None

    job = await queue.enqueue(Step(n=2))
    # Heartbeats bring the cancel; the lease is not under test (a short one lapses
    # under load, and the live worker stops its own job).
    config = attrs.evolve(FAST, heartbeat_interval=0.2, lease=30.0)
    fast_queue = Queue(queue.db, config=config)
    async with running(fast_queue, executors) as worker:
        with trio.fail_after(TEST_DEADLINE):
            await started.wait()
            assert await queue.cancel(job) == "cancelling"
            await worker.wait_for(lambda s: s.cancelled >= 1)
    assert stopped == [True]
    row = await plain_row(queue.db, job)
    assert (row["state"], row["error_msg"]) == ("cancelled", "cancelled")


async def test_an_invalid_payload_is_discarded_and_the_worker_goes_on(queue: Queue) -> None:
    executors = Executors()
    executors.register(Step, _noop)
    await queue.db.execute(
        "INSERT INTO nasiko_queue_jobs (id, queue, kind, payload, max_attempts) "
        "VALUES (gen_random_uuid(), 'default', 'workflow_step', "
        "'{\"kind\": \"workflow_step\", \"n\": \"not a number\"}', 5)")
    good = await queue.enqueue(Step(n=1))
    async with running(queue, executors) as worker:
        with trio.fail_after(TEST_DEADLINE):
            await worker.wait_for(lambda s: s.done >= 1 and s.failed >= 1)
    states = sorted(r["state"] for r in await queue.db.fetch(
        "SELECT state FROM nasiko_queue_jobs"))
    assert states == ["completed", "discarded"]
    assert (await plain_row(queue.db, good))["state"] == "completed"
    assert await queue.db.fetchval(
        "SELECT error_msg FROM nasiko_queue_jobs WHERE state = 'discarded'") == \
        "invalid job payload"


@pytest.mark.parametrize("max_attempts", [1, 3])
async def test_a_kind_without_an_executor_here_is_retried_not_lost(
    queue: Queue, max_attempts: int
) -> None:
    """A worker of a rolling deploy that has no executor for the job's kind gives
    it back unrun, for a worker that has one, after its backoff: its attempt not
    counted, so that even a job of one attempt is never discarded for that
    alone. It used to count the attempt: on its last (`max_attempts=1`: the
    first) the job was discarded without ever running."""
    executors = Executors()
    executors.register(SendEmail, _noop)  # runs queue "email" only
    config = attrs.evolve(FAST, queues={"default": 1})
    q = Queue(queue.db, config=config)
    job = await q.enqueue(Step(n=1), options=JobOptions(max_attempts=max_attempts))
    async with running(q, executors) as worker:
        with trio.fail_after(TEST_DEADLINE):
            await worker.wait_for(lambda s: s.retried >= 1 or s.failed >= 1)
    row = await plain_row(queue.db, job)
    assert (row["state"], row["attempt"], row["finished_at"]) == ("available", 0, None)
    assert row["run_at"] > datetime.now(UTC) + timedelta(seconds=10)  # after its backoff
    assert "no executor for kind 'workflow_step'" in row["error_msg"]
    assert await queue.db.fetchval("SELECT count(*) FROM nasiko_queue_job_errors") == 0

    # Its next claim is the same attempt again: a worker that has the executor runs it.
    await queue.db.execute("UPDATE nasiko_queue_jobs SET run_at = now() WHERE id = $1", job)
    ran: list[int] = []

    @executors.register(Step)
    async def step(ctx: PlainJobContext[Step]) -> None:
        ran.append(ctx.attempt)

    async with running(q, executors) as worker:
        with trio.fail_after(TEST_DEADLINE):
            await worker.wait_for(lambda s: s.done >= 1)
    assert ran == [1]
    assert (await plain_row(queue.db, job))["state"] == "completed"


async def test_a_job_without_an_executor_here_asked_to_stop_ends_cancelled(
    queue: Queue,
) -> None:
    """The give-back of a job this worker has no executor for follows the cancel
    rule: asked to stop meanwhile, it ends `cancelled`."""
    job = await queue.enqueue(Step(n=1))
    store = PlainJobStore(queue.db, queue.config, "default", lambda: None)
    [claimed] = await store.claim(1)
    assert await queue.cancel(job) == "cancelling"
    assert await store.defer(claimed, 30.0, "nasiko_queue.NoExecutor: none") == "cancelled"
    row = await plain_row(queue.db, job)
    assert (row["state"], row["attempt"], row["error_msg"]) == ("cancelled", 0, "cancelled")


async def test_enqueue_many_plain_and_build_jobs_in_one_call(queue: Queue) -> None:
    from nasiko_queue.testing import enqueue_with_target
    build = await enqueue_with_target(queue, "Update")
    ids = await queue.enqueue_many([Step(n=n) for n in range(100)] + [build.payload])
    assert len(ids) == 101
    assert await queue.db.fetchval("SELECT count(*) FROM nasiko_queue_jobs") == 100
    assert await queue.db.fetchval("SELECT count(*) FROM build_jobs") == 2
    order = [r["id"] for r in await queue.db.fetch(
        "SELECT id FROM nasiko_queue_jobs ORDER BY priority, run_at, id")]
    assert order == ids[:100]


async def test_a_worker_with_only_plain_queues_claims_no_build_job(queue: Queue) -> None:
    from nasiko_queue.testing import enqueue_with_target
    build = await enqueue_with_target(queue, "Update")
    executors = Executors()
    executors.register(Step, _noop)
    await queue.enqueue(Step(n=1))
    async with running(queue, executors) as worker:
        with trio.fail_after(TEST_DEADLINE):
            await worker.wait_for(lambda s: s.done >= 1)
            await worker.drain_once()
    assert await queue.db.fetchval("SELECT status FROM build_jobs WHERE id = $1",
                                   build.job_id) == "pending"


def test_a_worker_needs_a_lane() -> None:
    executors = Executors()
    executors.register(Update, _noop)
    with pytest.raises(ValueError, match="nothing to run"):
        Worker(Queue(None, config=QueueConfig(builds=False)), executors)  # type: ignore[arg-type]


async def test_the_originals_claim_never_takes_a_plain_or_scheduled_job(queue: Queue) -> None:
    """The original Rust worker's claim (reference §5.1), verbatim, beside jobs of
    every new feature: it takes the one build job and nothing else, ever."""
    from nasiko_queue.testing import enqueue_with_target
    await queue.enqueue(Step(n=1), delay=3600)                      # scheduled
    await queue.enqueue(Step(n=2), options=JobOptions(priority=-5))  # priority
    await queue.enqueue(Step(n=3), unique=Unique("u"))              # unique
    await queue.enqueue_many([SendEmail(to="x@example.com")] * 3)   # a batch, another queue
    build = await enqueue_with_target(queue, "Update")

    async def original_claim(conn: Any) -> Any:
        async with conn.transaction():
            row = await conn.fetchrow(
                "SELECT id, agent_id, connector_id, payload, attempt FROM build_jobs "
                "WHERE status='pending' ORDER BY created_at FOR UPDATE SKIP LOCKED LIMIT 1")
            if row is not None:
                await conn.execute(
                    "UPDATE build_jobs SET status = 'in_progress', picked_at = now(), "
                    "attempt = attempt + 1 WHERE id = $1", row["id"])
            return row

    first = await queue.db.run(original_claim)
    assert first is not None
    assert first["id"] == build.job_id
    assert await queue.db.run(original_claim) is None
    assert await queue.db.fetchval(
        "SELECT count(*) FROM nasiko_queue_jobs WHERE state = 'available'") == 6


async def test_a_dead_workers_plain_jobs_are_rescued_or_discarded(db: Database) -> None:
    """The leader's rescue covers plain jobs: a dead worker's running job with
    runs left is available again (attempt counted) and runs on a live worker;
    one on its last attempt is discarded; a cancelled one ends cancelled."""
    import uuid

    from nasiko_queue.builds.store import PgJobStore
    from nasiko_queue.engine.contracts import WorkerIdentity
    from nasiko_queue.plain.store import PlainJobStore

    # The default heartbeat and lease: the dead worker's heartbeat is an hour old
    # (aged in SQL below), and the live worker's election kicks a rescue round at
    # once. A short lease would bind the live worker too: under load its own
    # heartbeat missed one and it fenced itself, dropping its jobs.
    config = FAST
    queue = Queue(db, config=config)
    again = await queue.enqueue(Step(n=1), options=JobOptions(priority=0))
    last = await queue.enqueue(Step(n=2), options=JobOptions(priority=1, max_attempts=1))
    asked = await queue.enqueue(Step(n=3), options=JobOptions(priority=2))
    dead = PgJobStore(db, config, runnable_kinds=frozenset(), known_kinds=frozenset())
    await dead.register_worker(WorkerIdentity(id=uuid.uuid4(), host="gone", pid=1, kinds=()))
    claimed = await PlainJobStore(db, config, "default", lambda: dead.worker_id).claim(3)
    assert [j.id for j in claimed] == [again, last, asked]
    assert await queue.cancel(asked) == "cancelling"
    await db.execute(
        "UPDATE nasiko_queue_workers SET heartbeat_at = heartbeat_at - interval '1 hour'")
    await db.execute(
        "UPDATE nasiko_queue_jobs SET attempted_at = attempted_at - interval '1 hour'")
    runs: list[int] = []
    executors = Executors()

    @executors.register(Step)
    async def step(ctx: PlainJobContext[Step]) -> None:
        runs.append(ctx.attempt)

    async with running(queue, executors) as worker:
        # The rescued job can run and finish before its rescue round returns and
        # counts it (the round's statement NOTIFYs as it commits): wait for both.
        with trio.fail_after(TEST_DEADLINE):
            await worker.wait_for(lambda s: s.done >= 1 and s.rescued >= 3)
        assert worker.stats.rescued == 3  # given back or ended
    assert runs == [2]
    assert [(await plain_row(db, j))["state"] for j in (again, last, asked)] == [
        "completed", "discarded", "cancelled"]
    assert (await plain_row(db, last))["error_msg"] == "the worker running it died"


async def test_plain_jobs_enqueued_in_a_transaction_commit_or_vanish_with_it(
    queue: Queue,
) -> None:
    class Rollback(Exception):
        pass

    async def enqueue_then_roll_back() -> None:
        async with queue.db.transaction() as tx:
            await queue.enqueue_many([Step(n=n) for n in range(3)], tx=tx)
            await queue.enqueue(Step(n=9), tx=tx, unique=Unique("in-tx"))
            raise Rollback

    with pytest.raises(Rollback):
        await enqueue_then_roll_back()
    assert await queue.db.fetchval("SELECT count(*) FROM nasiko_queue_jobs") == 0
    async with queue.db.transaction() as tx:
        ids = await queue.enqueue_many([Step(n=n) for n in range(3)], tx=tx)
        first = await queue.enqueue(Step(n=9), tx=tx, unique=Unique("in-tx"))
        # The same transaction sees its own unique job.
        assert await queue.enqueue(Step(n=10), tx=tx, unique=Unique("in-tx")) == first
    assert await queue.db.fetchval("SELECT count(*) FROM nasiko_queue_jobs") == 4
    assert len(set(ids)) == 3


@attrs.frozen(kw_only=True)
class CallTool(JobArgs):
    """A plain job with a sealed field, as an application would write one."""

    kind: ClassVar[str] = "call_tool"
    tool: str
    credentials: Mapping[str, Secret] = attrs.field(
        factory=dict, hash=False, metadata={"sealed": True})


async def test_a_plain_jobs_secrets_are_sealed_at_rest_and_masked_in_its_errors(
    queue: Queue, caplog: pytest.LogCaptureFixture
) -> None:
    token = "sk-live-8c1f0e2a77"
    executors = Executors()
    seen: list[str] = []

    @executors.register(CallTool, backoff=no_backoff)
    async def call(ctx: PlainJobContext[CallTool]) -> None:
        seen.append(ctx.payload.credentials["API_KEY"].reveal())
        raise PermissionError(f"tool refused key {ctx.payload.credentials['API_KEY'].reveal()}")

    job_id = await queue.enqueue(CallTool(tool="search", credentials={"API_KEY": Secret(token)}),
                                 options=JobOptions(max_attempts=1))
    stored = await queue.db.fetchval("SELECT payload::text FROM nasiko_queue_jobs WHERE id = $1",
                                     job_id)
    assert token not in stored
    assert '"API_KEY": "nq1:' in stored
    async with running(queue, executors) as worker:
        with trio.fail_after(TEST_DEADLINE):
            await worker.wait_for(lambda s: s.failed >= 1)
    assert seen == [token]  # opened for the executor
    [error] = await job_errors(queue.db, job_id)
    assert error.message == "tool refused key ********"
    assert token not in error.traceback
    row = await plain_row(queue.db, job_id)
    assert token not in row["error_msg"]
    assert token not in caplog.text


async def test_a_plain_jobs_secret_that_does_not_open_fails_the_job_saying_why(
    queue: Queue, caplog: pytest.LogCaptureFixture
) -> None:
    """
    A worker with another master key than the enqueuer's (or none) used to drop
    the value and run the job without it: the executor saw no credential and
    the job ended completed, the one trace a warning naming "build None". The
    job is discarded as an invalid payload instead, the reason logged with its
    id, and nothing runs; it can be retried once the worker has the key.
    """
    executors = Executors()
    ran: list[dict[str, Secret]] = []

    @executors.register(CallTool)
    async def call(ctx: PlainJobContext[CallTool]) -> None:
        ran.append(dict(ctx.payload.credentials))

    token = "sk-live-5d2e9b0c41"
    job_id = await queue.enqueue(CallTool(tool="search", credentials={"API_KEY": Secret(token)}))
    other_key = Queue(queue.db, config=queue.config, secrets=SecretBox(b"o" * 32))
    async with running(other_key, executors) as worker:
        with trio.fail_after(TEST_DEADLINE):
            await worker.wait_for(lambda s: s.failed + s.done >= 1)
    assert ran == []
    row = await plain_row(queue.db, job_id)
    assert (row["state"], row["error_msg"]) == ("discarded", "invalid job payload")
    assert f"job {job_id}: invalid payload" in caplog.text
    assert "secret credentials['API_KEY'] does not open: it does not decrypt" in caplog.text
    assert token not in caplog.text
    # Written in plaintext (enqueue_json seals nothing): refused, saying so.
    plain_id = await queue.enqueue_json("call_tool", {"tool": "search",
                                                      "credentials": {"API_KEY": token}})
    async with running(queue, executors) as worker:
        with trio.fail_after(TEST_DEADLINE):
            await worker.wait_for(lambda s: s.failed + s.done >= 1)
    assert ran == []
    assert (await plain_row(queue.db, plain_id))["state"] == "discarded"
    assert "does not open: it was stored in plaintext" in caplog.text
    assert token not in caplog.text


# -- enqueue_many with per-job options (issue #21) ----------------------------------


@attrs.frozen(kw_only=True)
class OncePerUser(JobArgs):
    """A type whose jobs are unique by a key of their fields."""

    kind: ClassVar[str] = "once_per_user"
    user: str

    def unique_key(self) -> str | None:
        return f"user:{self.user}"


async def _rows(db: Database, ids: list[Any]) -> list[Any]:
    return [await db.fetchrow(
        "SELECT queue, priority, max_attempts, run_at, created_at, unique_key "
        "FROM nasiko_queue_jobs WHERE id = $1", i) for i in ids]


async def test_enqueue_many_takes_each_jobs_options_run_at_and_delay(queue: Queue) -> None:
    """Jobs meant for queue "qa" go to "qa" (they silently went to "default")."""
    from nasiko_queue import Job
    at = datetime.now(UTC) + timedelta(days=1)
    ids = await queue.enqueue_many([
        Job(Step(n=0), options=JobOptions(queue="qa", priority=3, max_attempts=7)),
        Job(Step(n=1), run_at=at),
        Job(Step(n=2), delay=3600),
        Job(Step(n=3), delay=timedelta(minutes=5), options=JobOptions(queue="qa")),
        Step(n=4),
        SendEmail(to="x@example.com"),
    ])
    rows = await _rows(queue.db, ids)
    assert [(r["queue"], r["priority"], r["max_attempts"]) for r in rows] == [
        ("qa", 3, 7), ("default", 0, 20), ("default", 0, 20), ("qa", 0, 20),
        ("default", 0, 20), ("email", 0, 3)]
    assert rows[1]["run_at"] == at
    # The batch's clock (per row, for the order), not the transaction's.
    assert timedelta(minutes=59) < rows[2]["run_at"] - rows[2]["created_at"] < timedelta(
        minutes=61)
    assert timedelta(minutes=4) < rows[3]["run_at"] - rows[3]["created_at"] < timedelta(
        minutes=6)
    assert rows[4]["run_at"] <= rows[0]["created_at"] + timedelta(seconds=5)


async def test_enqueue_many_refuses_a_bad_job_with_its_index_and_enqueues_nothing(
    queue: Queue,
) -> None:
    from nasiko_queue import Job
    with pytest.raises(ValueError, match="aware datetime") as err:
        await queue.enqueue_many([Step(n=0), Job(Step(n=1), delay=5),
                                  Job(Step(n=2), run_at=datetime(2030, 1, 1))])
    assert "payload 2 of the 3 given to enqueue_many; nothing was enqueued" in (
        err.value.__notes__)
    with pytest.raises(ValueError, match="run_at or delay, not both"):
        await queue.enqueue_many([Job(Step(n=1), delay=5, run_at=datetime.now(UTC))])
    with pytest.raises(TypeError, match="build payloads take no options"):
        Job(Update.__new__(Update))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="not str"):
        await queue.enqueue_many(["step"])  # type: ignore[list-item]
    assert await queue.db.fetchval("SELECT count(*) FROM nasiko_queue_jobs") == 0


async def test_enqueue_many_takes_unique_jobs_in_order_and_answers_each_holder(
    queue: Queue,
) -> None:
    """Unique jobs (by `unique=`, by the type's key) go in the batch: a held key
    inserts nothing and answers its holder, held before the batch or earlier in
    it; the others are inserted in the order given."""
    from nasiko_queue import Job
    held = await queue.enqueue(Step(n=-1), unique=Unique("k"))
    ids = await queue.enqueue_many([
        Step(n=0),
        Job(Step(n=1), unique=Unique("k")),                 # held before the batch
        Job(Step(n=2), unique=Unique("j")),
        Job(Step(n=3), unique=Unique("j")),                 # held by the one before
        OncePerUser(user="ann"),                            # the type's key
        OncePerUser(user="ann"),
        Step(n=4),
    ])
    assert ids[1] == held
    assert ids[3] == ids[2]
    assert ids[5] == ids[4]
    assert len(set(ids)) == 5
    order = [r["id"] for r in await queue.db.fetch(
        "SELECT id FROM nasiko_queue_jobs WHERE queue = 'default' ORDER BY priority, run_at")]
    assert order == [held, ids[0], ids[2], ids[4], ids[6]]
    rows = await _rows(queue.db, [ids[2], ids[4]])
    assert [r["unique_key"] for r in rows] == ["j", "user:ann"]
    # Once the holder has ended, the key is free again (the default states).
    await queue.cancel(held)
    [again] = await queue.enqueue_many([Job(Step(n=5), unique=Unique("k"))])
    assert again != held


async def test_enqueue_many_with_unique_jobs_in_a_transaction_and_in_chunks(
    queue: Queue,
) -> None:
    from nasiko_queue import Job
    from nasiko_queue.queue import ENQUEUE_MANY_CHUNK
    async with queue.db.transaction() as tx:
        first = await queue.enqueue_many([Job(Step(n=0), unique=Unique("t"))], tx=tx)
        again = await queue.enqueue_many(
            [Step(n=1), Job(Step(n=2), unique=Unique("t"))], tx=tx)
    assert again[1] == first[0]
    n = ENQUEUE_MANY_CHUNK + 500                    # two statements, pipelined
    batch: list[Any] = [Step(n=i) for i in range(n)]
    batch[10] = Job(Step(n=10), unique=Unique("t"))
    batch[-1] = Job(Step(n=n), unique=Unique("t"))
    batch[-2] = Job(Step(n=n), unique=Unique("late"))
    ids = await queue.enqueue_many(batch)
    assert ids[10] == ids[-1] == first[0]
    assert await queue.db.fetchval("SELECT count(*) FROM nasiko_queue_jobs") == 2 + n - 2
    order = [r["id"] for r in await queue.db.fetch(
        "SELECT id FROM nasiko_queue_jobs ORDER BY run_at")]
    assert order[2:] == [i for k, i in enumerate(ids) if k not in (10, n - 1)]


async def test_enqueue_json_writes_what_enqueue_writes_without_the_type(queue: Queue) -> None:
    """`Queue.enqueue_json(kind, args)`, behind `nasiko-queue enqueue` (issue #21)."""
    from nasiko_queue import InvalidPayload
    typed = await queue.enqueue(SendEmail(to="a@example.com"))
    untyped = await queue.enqueue_json("send_email", {"to": "a@example.com",
                                                      "subject": "hello"},
                                       options=JobOptions(queue="email", max_attempts=3))
    rows = [await queue.db.fetchrow("SELECT queue, kind, payload::jsonb AS p, max_attempts "
                                    "FROM nasiko_queue_jobs WHERE id = $1", i)
            for i in (typed, untyped)]
    assert dict(rows[0]) == dict(rows[1])
    held = await queue.enqueue_json("step", {}, unique=Unique("one"))
    assert await queue.enqueue_json("step", {"n": 1}, unique=Unique("one")) == held
    for kind, args, message in [("step", {"text": "a\x00b"}, "NUL character"),
                                ("step", {"x": float("nan")}, "not JSON"),
                                ("Update", {}, "build job's kind"),
                                ("step", ["n"], "must be a JSON object")]:
        with pytest.raises(InvalidPayload, match=message):
            await queue.enqueue_json(kind, args)  # type: ignore[arg-type]
