"""Enqueue (SPEC §4): inside the caller's transaction, wake after commit, never block."""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import Any, ClassVar, TypeVar

import attrs
import pytest
import trio

from nasiko_queue import (
    Job,
    JobArgs,
    JobOptions,
    PayloadTooLarge,
    Queue,
    QueueConfig,
    StandaloneBuild,
    Unique,
    Worker,
)
from nasiko_queue.errors import SecretsNotConfigured
from nasiko_queue.testing import (
    enqueue_with_target,
    insert_agent,
    insert_agent_build,
    insert_connector,
    insert_connector_build,
    make_payload,
)

from .conftest import FAST, MASTER_KEY
from .helpers import TEST_DEADLINE, executors_for_all, job_row, running, succeed

T = TypeVar("T")


def _buffered(worker: Worker) -> int:
    return worker.wakes_pending


async def test_job_commits_with_the_callers_rows_and_wakes_after_commit(queue: Queue) -> None:
    worker = Worker(queue, executors_for_all(succeed))
    queue._add_waker(worker.wake)
    owner = uuid.uuid4()
    async with queue.db.transaction() as tx:
        agent = await insert_agent(tx, owner_id=owner)
        build = await insert_agent_build(tx, agent)
        job_id = await queue.enqueue(
            make_payload("Upload", target_id=agent, build_id=build, owner_id=owner), tx=tx)
        assert _buffered(worker) == 0  # not before commit
        # Invisible to everyone else until commit.
        assert await queue.db.fetchval("SELECT count(*) FROM build_jobs") == 0
    assert _buffered(worker) == 1
    row = await job_row(queue.db, job_id)
    assert row is not None
    assert (row["status"], row["attempt"], row["picked_at"]) == ("pending", 0, None)


async def test_rolled_back_transaction_leaves_no_job_and_no_wake(queue: Queue) -> None:
    worker = Worker(queue, executors_for_all(succeed))
    queue._add_waker(worker.wake)
    owner = uuid.uuid4()

    async def handler() -> None:
        async with queue.db.transaction() as tx:
            agent = await insert_agent(tx, owner_id=owner)
            build = await insert_agent_build(tx, agent)
            await queue.enqueue(
                make_payload("Upload", target_id=agent, build_id=build, owner_id=owner), tx=tx)
            raise RuntimeError("handler failed")

    with pytest.raises(RuntimeError, match="handler failed"):
        await handler()
    assert _buffered(worker) == 0
    assert await queue.db.fetchval("SELECT count(*) FROM build_jobs") == 0
    assert await queue.db.fetchval("SELECT count(*) FROM agents") == 0


async def test_wake_never_blocks_when_the_channel_is_full(queue: Queue) -> None:
    """[decision] 64 wakes fill the channel; the 65th and later are dropped at once."""
    worker = Worker(queue, executors_for_all(succeed))
    queue._add_waker(worker.wake)
    with trio.fail_after(5):  # generous: this must not wait at all
        for _ in range(queue.config.wake_capacity):
            await enqueue_with_target(queue, "Upload")
        assert _buffered(worker) == queue.config.wake_capacity
        await enqueue_with_target(queue, "Upload")
        for _ in range(1000):
            worker.wake()
    assert _buffered(worker) == queue.config.wake_capacity
    # Nothing was lost: one drain runs all 65.
    async with trio.open_nursery() as nursery:
        await nursery.start(worker.run)
        await worker.drain_once()
        worker.stop()
    assert await queue.db.fetchval("SELECT count(*) FROM build_jobs WHERE status='done'") == 65


async def test_wake_after_stop_is_harmless(queue: Queue) -> None:
    worker = Worker(queue, executors_for_all(succeed))
    worker.stop()
    worker.wake()  # closed channel: dropped, no exception


async def test_oversized_payload_is_refused(db: object) -> None:
    from .conftest import MASTER_KEY

    queue = Queue(db, config=QueueConfig(max_payload_bytes=2048), secrets=MASTER_KEY)  # type: ignore[arg-type]
    owner = uuid.uuid4()
    agent = await insert_agent(queue.db, owner_id=owner)
    payload = make_payload("Upload", target_id=agent, build_id=uuid.uuid4(), owner_id=owner,
                           env={"BIG": "x" * 5000})
    with pytest.raises(PayloadTooLarge, match="max_payload_bytes"):
        await queue.enqueue(payload)
    assert await queue.db.fetchval("SELECT count(*) FROM build_jobs") == 0


async def test_payload_without_owner_needs_one(queue: Queue) -> None:
    agent = await insert_agent(queue.db, owner_id=uuid.uuid4())
    payload = StandaloneBuild(build_id=uuid.uuid4(), agent_id=agent, agent_name="a",
                              version_tag="v1")
    with pytest.raises(ValueError, match="owner_id"):
        await queue.enqueue(payload)
    owner = uuid.uuid4()
    job_id = await queue.enqueue(payload, owner_id=owner)
    assert await queue.db.fetchval("SELECT owner_id FROM build_jobs WHERE id=$1", job_id) == owner


async def test_owner_is_the_caller_for_rollback(queue: Queue) -> None:
    job = await enqueue_with_target(queue, "Rollback")
    stored = await queue.db.fetchrow(
        "SELECT owner_id, payload->>'caller_id' AS caller, payload->>'kind' AS kind "
        "FROM build_jobs WHERE id = $1", job.job_id)
    assert stored is not None
    assert (stored["kind"], str(stored["owner_id"])) == ("Rollback", stored["caller"])


async def test_secrets_need_a_key(db: object) -> None:
    queue = Queue(db)  # type: ignore[arg-type]
    with pytest.raises(SecretsNotConfigured):
        await enqueue_with_target(queue, "McpServerUpload", env={"TOKEN": "x"})
    assert await queue.db.fetchval("SELECT count(*) FROM mcp_connectors") == 0


# -- enqueue_many: a batch in one statement ------------------------------------------------


async def _payloads(sql: Any, n: int, kinds: tuple[str, ...] = ("Upload",)) -> list[Any]:
    """`n` payloads, kinds in turn, each with its target and build row (in `sql`)."""
    payloads = []
    for i in range(n):
        kind = kinds[i % len(kinds)]
        owner = uuid.uuid4()
        if kind == "McpServerUpload":
            target = await insert_connector(sql, owner_id=owner)
            build = await insert_connector_build(sql, target, owner_id=owner)
        else:
            target = await insert_agent(sql, owner_id=owner)
            build = await insert_agent_build(sql, target)
        payloads.append(make_payload(kind, target_id=target, build_id=build, owner_id=owner,
                                     name=f"{kind.lower()}-{i}",
                                     env={"API_TOKEN": f"s3cret-{i}"}))
    return payloads


async def test_enqueue_many_inserts_the_batch_and_it_runs_in_the_order_given(
    queue: Queue,
) -> None:
    payloads = await _payloads(queue.db, 60, ("Upload", "McpServerUpload", "Rollback"))
    ids = await queue.enqueue_many(payloads)
    assert len(set(ids)) == 60
    rows = await queue.db.fetch(
        "SELECT id, status, attempt, payload ->> 'kind' AS kind, owner_id FROM build_jobs "
        "ORDER BY created_at")
    assert [r["id"] for r in rows] == ids
    # The order is the claim's own (ORDER BY created_at), not a tie that the
    # index happens to break in insertion order.
    assert await queue.db.fetchval("SELECT count(DISTINCT created_at) FROM build_jobs") == 60
    assert {(r["status"], r["attempt"]) for r in rows} == {("pending", 0)}
    assert [r["kind"] for r in rows] == [p.kind for p in payloads]
    assert [r["owner_id"] for r in rows] == [p.job_owner() for p in payloads]

    ran: list[Any] = []

    async def record(ctx: Any) -> None:
        ran.append(ctx.job_id)
        await succeed(ctx)

    assert queue.config.concurrency == 1  # one job at a time: the claim order is the run order
    async with running(queue, executors_for_all(record)) as worker:
        with trio.fail_after(20):
            await worker.wait_for(lambda s: s.done >= 60)
    assert ran == ids  # claimed oldest first: the batch's own order


async def test_enqueue_many_seals_secrets_as_enqueue_does(queue: Queue) -> None:
    payloads = await _payloads(queue.db, 4, ("Upload", "McpServerUpload"))
    await queue.enqueue_many(payloads)
    stored = [r["env"] for r in await queue.db.fetch(
        "SELECT payload -> 'env' ->> 'API_TOKEN' AS env FROM build_jobs")]
    assert len(stored) == 4
    assert all(v.startswith("nq1:") and "s3cret" not in v for v in stored), stored


async def test_enqueue_many_commits_with_the_callers_transaction_and_sends_one_notify(
    queue: Queue,
) -> None:
    channel = queue.config.notify_channel
    assert channel is not None
    heard: list[str] = []
    marker = trio.Event()

    def on_notify(payload: str) -> None:
        heard.append(payload)
        if payload == "marker":
            marker.set()

    async def handler_that_fails() -> None:
        async with queue.db.transaction() as tx:
            await queue.enqueue_many(await _payloads(tx, 5), tx=tx)
            raise RuntimeError("handler failed")

    worker = Worker(queue, executors_for_all(succeed))
    queue._add_waker(worker.wake)
    async with queue.db.listen(channel, on_notify):
        with pytest.raises(RuntimeError, match="handler failed"):
            await handler_that_fails()
        assert await queue.db.fetchval("SELECT count(*) FROM build_jobs") == 0
        assert _buffered(worker) == 0

        async with queue.db.transaction() as tx:
            await queue.enqueue_many(await _payloads(tx, 30), tx=tx)
            await queue.enqueue_many(await _payloads(tx, 30), tx=tx)
            assert _buffered(worker) == 0  # not before commit
        assert _buffered(worker) == 2
        # A notification of our own after the batch's: once it arrives, every
        # notification sent before it has arrived too.
        await queue.db.execute("SELECT pg_notify($1, 'marker')", channel)
        with trio.fail_after(10):
            await marker.wait()
    assert heard == ["", "marker"]  # one NOTIFY for the transaction, not one per job
    assert await queue.db.fetchval("SELECT count(*) FROM build_jobs") == 60


async def test_a_bad_payload_refuses_the_whole_batch_and_says_which(db: object) -> None:
    from .conftest import MASTER_KEY

    queue = Queue(db, config=QueueConfig(max_payload_bytes=2048), secrets=MASTER_KEY)  # type: ignore[arg-type]
    payloads = await _payloads(queue.db, 5)
    owner = uuid.uuid4()
    payloads[3] = make_payload("Upload", target_id=await insert_agent(queue.db, owner_id=owner),
                               build_id=uuid.uuid4(), owner_id=owner, env={"BIG": "x" * 5000})
    with pytest.raises(PayloadTooLarge, match="max_payload_bytes") as caught:
        await queue.enqueue_many(payloads)
    assert "payload 3 of the 5 given to enqueue_many; nothing was enqueued" in (
        caught.value.__notes__)
    assert await queue.db.fetchval("SELECT count(*) FROM build_jobs") == 0
    assert await queue.enqueue_many([]) == []


# -- enqueue (issue #13): batches in chunks, and the kept connections --------------------


@attrs.frozen(kw_only=True)
class Note(JobArgs):
    kind: ClassVar[str] = "note"
    n: int
    text: str = ""


async def heard_while(queue: Queue, action: Callable[[], Awaitable[T]]) -> tuple[T, list[str]]:
    """`action()`'s answer (its error raised), and the NOTIFY payloads on the queue's
    channel meanwhile: a marker sent after it, once heard, means every notification
    sent before it has arrived too."""
    channel = queue.config.notify_channel
    assert channel is not None
    heard: list[str] = []
    marker = trio.Event()

    def on_notify(payload: str) -> None:
        heard.append(payload)
        if payload == "marker":
            marker.set()

    async with queue.db.listen(channel, on_notify):
        try:
            answer = await action()
        finally:
            await queue.db.execute("SELECT pg_notify($1, 'marker')", channel)
            with trio.fail_after(10):
                await marker.wait()
    heard.remove("marker")
    return answer, heard


async def test_enqueue_many_of_50_000_plain_jobs_goes_in_chunks_in_order(queue: Queue) -> None:
    """More rows than one statement takes: several statements of one transaction,
    still the order given (run_at distinct and ascending), ids in that order, one
    NOTIFY."""
    from nasiko_queue.queue import ENQUEUE_MANY_CHUNK

    n = 50_000
    assert n > 5 * ENQUEUE_MANY_CHUNK
    ids, heard = await heard_while(queue, lambda: queue.enqueue_many(
        [Note(n=i) for i in range(n)]))
    assert heard == [""]
    assert len(ids) == n == len(set(ids))
    rows = await queue.db.fetch(
        "SELECT id, (payload ->> 'n')::int AS n, xmin::text AS tx FROM nasiko_queue_jobs "
        "ORDER BY run_at, id")
    assert [r["id"] for r in rows] == ids
    assert [r["n"] for r in rows] == list(range(n))
    assert len({r["tx"] for r in rows}) == 1  # one transaction
    assert await queue.db.fetchval(
        "SELECT count(DISTINCT run_at) FROM nasiko_queue_jobs") == n


async def test_a_bad_payload_in_a_later_chunk_refuses_the_batch(queue: Queue) -> None:
    """Checked before anything is sent: a payload jsonb would refuse (a NUL), far into
    the batch, names its index, and not one row of the earlier chunks is written."""
    from nasiko_queue.errors import InvalidPayload

    batch = [Note(n=i) for i in range(12_000)]
    batch[11_007] = Note(n=11_007, text="nul \x00 here")
    with pytest.raises(InvalidPayload, match="field 'text': a NUL character") as caught:
        await queue.enqueue_many(batch)
    assert "payload 11007 of the 12000 given to enqueue_many; nothing was enqueued" in (
        caught.value.__notes__)
    assert await queue.db.fetchval("SELECT count(*) FROM nasiko_queue_jobs") == 0


async def test_a_bad_payload_in_the_first_chunk_refuses_the_batch_while_it_warms_up(
    queue: Queue,
) -> None:
    """A batch sent a chunk ahead runs its insert once with no rows while its first
    chunk is encoded (issue #25): a bad payload in that chunk still refuses the
    batch with its index, and the warm-up leaves no row. (That a batch that goes in
    sends one NOTIFY, warm-up and all, is the 50,000-job test's.)"""
    from nasiko_queue.errors import InvalidPayload
    from nasiko_queue.queue import ENQUEUE_MANY_CHUNK, FIRST_CHUNK

    batch = [Note(n=i) for i in range(ENQUEUE_MANY_CHUNK + 5)]
    batch[FIRST_CHUNK - 1] = Note(n=0, text="nul \x00 here")
    with pytest.raises(InvalidPayload, match="a NUL character") as caught:
        await queue.enqueue_many(batch)
    assert f"payload {FIRST_CHUNK - 1} of the {len(batch)} given to enqueue_many; nothing " \
        "was enqueued" in caught.value.__notes__
    assert await queue.db.fetchval("SELECT count(*) FROM nasiko_queue_jobs") == 0


#: A trigger that refuses every plain job: the server rejects the plain statement
#: of a mixed batch after its build statement went through.
REFUSE_PLAIN_JOBS = """
CREATE FUNCTION refuse_plain_job() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN RAISE EXCEPTION 'plain jobs refused by the test'; END $$;
CREATE TRIGGER refuse_plain_job BEFORE INSERT ON nasiko_queue_jobs
FOR EACH ROW EXECUTE FUNCTION refuse_plain_job();
"""


async def test_a_mixed_batch_refused_on_its_plain_statement_leaves_no_build_row(
    queue: Queue,
) -> None:
    """
    One small mixed batch (one statement per kind, no chunking): the build
    statement goes first, then the server refuses the plain one. The batch is
    one transaction, so the build job goes with it and the kept connection
    serves the next enqueue (issue #24: the one mid-batch refusal test sent
    several chunks, which takes the pipelined path).
    """
    import asyncpg

    owner = uuid.uuid4()
    agent = await insert_agent(queue.db, owner_id=owner)
    build = await insert_agent_build(queue.db, agent)
    payload = make_payload("Upload", target_id=agent, build_id=build, owner_id=owner)
    await queue.db.execute(REFUSE_PLAIN_JOBS)
    batch: list[Any] = [Note(n=1), payload, Note(n=2)]  # the build statement goes first
    with pytest.raises(asyncpg.RaiseError, match="plain jobs refused by the test"):
        await queue.enqueue_many(batch)
    assert await queue.db.fetchval("SELECT count(*) FROM build_jobs") == 0
    assert await queue.db.fetchval("SELECT count(*) FROM nasiko_queue_jobs") == 0
    await queue.db.execute("DROP TRIGGER refuse_plain_job ON nasiko_queue_jobs")
    ids = await queue.enqueue_many(batch)
    assert await queue.db.fetchval("SELECT count(*) FROM build_jobs") == 1
    assert await queue.db.fetchval("SELECT count(*) FROM nasiko_queue_jobs") == 2
    assert len(set(ids)) == 3


async def test_a_mixed_batch_that_loses_its_connection_before_the_plain_statement_leaves_nothing(
    dsn: str,
) -> None:
    """
    A mixed batch (one statement per kind): the build statement goes through,
    then the connection is lost before the plain statement reaches the server
    (the proxy closes it on that statement's text). The batch was one
    transaction that never committed, so the build job goes with it; the
    caller gets the driver's connection error (not a half-enqueued batch and no
    ids), and the queue's next enqueue, on a fresh connection, goes in whole
    (issue #24).
    """
    import asyncpg

    from nasiko_queue import open_database
    from nasiko_queue.errors import is_connection_error

    from .netproxy import Proxy

    proxy = Proxy(dsn)
    with trio.fail_after(TEST_DEADLINE):
        async with trio.open_nursery() as nursery:
            await nursery.start(proxy.run)
            async with open_database(dsn) as direct, open_database(proxy.dsn()) as db:
                queue = Queue(db, config=FAST, secrets=MASTER_KEY)
                owner = uuid.uuid4()
                agent = await insert_agent(direct, owner_id=owner)
                build = await insert_agent_build(direct, agent)
                payload = make_payload("Upload", target_id=agent, build_id=build,
                                       owner_id=owner)
                batch: list[Any] = [Note(n=1), payload, Note(n=2)]
                proxy.cut_on(b"INSERT INTO nasiko_queue_jobs")
                # The error that says what happened: the connection went, mid-batch
                # (before the fix: "cannot call Transaction.__aexit__()" over it).
                with pytest.raises(asyncpg.ConnectionDoesNotExistError) as lost:
                    await queue.enqueue_many(batch)
                assert is_connection_error(lost.value)
                assert proxy.cut.is_set()
                assert await direct.fetchval("SELECT count(*) FROM build_jobs") == 0
                assert await direct.fetchval("SELECT count(*) FROM nasiko_queue_jobs") == 0
                ids = await queue.enqueue_many(batch)
                assert await direct.fetchval("SELECT count(*) FROM build_jobs") == 1
                assert await direct.fetchval("SELECT count(*) FROM nasiko_queue_jobs") == 2
                assert len(set(ids)) == 3
            nursery.cancel_scope.cancel()


async def test_a_statement_the_server_refuses_mid_batch_rolls_the_whole_batch_back(
    queue: Queue,
) -> None:
    """The server refuses the second chunk (an agent that does not exist: the foreign
    key): the first chunk's rows and the plain jobs go too, and the kept connection
    serves the next enqueue."""
    import asyncpg

    from nasiko_queue.queue import ENQUEUE_MANY_CHUNK

    owner = uuid.uuid4()
    agent = await insert_agent(queue.db, owner_id=owner)
    good = make_payload("Upload", target_id=agent, build_id=uuid.uuid4(), owner_id=owner)
    orphan = make_payload("Upload", target_id=uuid.uuid4(), build_id=uuid.uuid4(),
                          owner_id=owner)
    batch: list[Any] = [good] * (ENQUEUE_MANY_CHUNK + 3) + [orphan] + [Note(n=1)]
    with pytest.raises(asyncpg.ForeignKeyViolationError):
        await queue.enqueue_many(batch)
    assert await queue.db.fetchval("SELECT count(*) FROM build_jobs") == 0
    assert await queue.db.fetchval("SELECT count(*) FROM nasiko_queue_jobs") == 0
    assert await queue.enqueue_many([good, Note(n=2)]) != []
    assert await queue.db.fetchval("SELECT count(*) FROM build_jobs") == 1


async def test_enqueue_many_in_chunks_joins_the_callers_transaction(queue: Queue) -> None:
    from nasiko_queue.queue import ENQUEUE_MANY_CHUNK

    worker = Worker(queue, executors_for_all(succeed))
    queue._add_waker(worker.wake)
    batch = [Note(n=i) for i in range(2 * ENQUEUE_MANY_CHUNK + 1)]

    async def handler_that_fails() -> None:
        async with queue.db.transaction() as tx:
            await queue.enqueue_many(batch, tx=tx)
            raise RuntimeError("handler failed")

    with pytest.raises(RuntimeError, match="handler failed"):
        await handler_that_fails()
    assert await queue.db.fetchval("SELECT count(*) FROM nasiko_queue_jobs") == 0
    assert _buffered(worker) == 0
    async with queue.db.transaction() as tx:
        await queue.enqueue_many(batch, tx=tx)
        assert _buffered(worker) == 0  # not before commit
    assert _buffered(worker) == 1
    assert await queue.db.fetchval("SELECT count(*) FROM nasiko_queue_jobs") == len(batch)


async def test_an_enqueue_after_the_server_ended_the_kept_connection_opens_another(
    queue: Queue,
) -> None:
    """Once the client has seen the end (a statement sent before that meets a dead
    connection and fails, as on a pooled one)."""
    first = await queue.enqueue(Note(n=1))  # opens the kept connection
    [kept] = queue.db._kept.idle_connections
    await queue.db.execute(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
        "WHERE datname = current_database() AND pid <> pg_backend_pid()")
    with trio.fail_after(10):
        # The end comes from the server, as bytes on the socket: nothing to wait on.
        while not kept.is_closed():  # noqa: ASYNC110
            await trio.sleep(0.01)
    second = await queue.enqueue(Note(n=2))
    assert queue.db._kept.idle_connections != [kept]
    assert await queue.db.fetchval(
        "SELECT array_agg(id ORDER BY run_at) FROM nasiko_queue_jobs") == [first, second]


async def test_a_cancelled_enqueue_inserts_nothing_and_its_connection_serves_again(
    queue: Queue,
) -> None:
    """Cancelled while the server waits on a lock (the agent row, held FOR UPDATE by
    another transaction): the cancel reaches the server before the call returns, so
    the job is not written even when the lock goes at once; the kept connection
    then serves the next enqueue."""
    owner = uuid.uuid4()
    agent = await insert_agent(queue.db, owner_id=owner)
    payload = make_payload("Upload", target_id=agent, build_id=uuid.uuid4(), owner_id=owner)
    await queue.enqueue(payload)
    [kept] = queue.db._kept.idle_connections
    async with queue.db.transaction() as blocker:
        await blocker.execute("SELECT 1 FROM agents WHERE id = $1 FOR UPDATE", agent)
        async with trio.open_nursery() as nursery:
            cancel = trio.CancelScope()

            async def enqueue() -> None:
                with cancel:
                    await queue.enqueue(payload)
                    pytest.fail("the enqueue was not blocked")

            nursery.start_soon(enqueue)
            with trio.fail_after(10):
                # Until the server says it waits for the lock (nothing else can tell).
                while not await queue.db.fetchval(  # noqa: ASYNC110
                        "SELECT count(*) FROM pg_stat_activity WHERE pid = $1 "
                        "AND wait_event_type = 'Lock'", kept.get_server_pid()):
                    await trio.sleep(0.01)
            cancel.cancel()
        assert cancel.cancelled_caught
    # The lock is gone now: had the statement not been cancelled, it would commit.
    assert await queue.db.fetchval("SELECT count(*) FROM build_jobs") == 1
    await queue.enqueue(payload)
    assert await queue.db.fetchval("SELECT count(*) FROM build_jobs") == 2
    assert queue.db._kept.idle_connections == [kept]


async def test_without_kept_connections_enqueue_takes_a_pooled_one(dsn: str) -> None:
    from nasiko_queue import DatabaseConfig, open_database

    config = DatabaseConfig(dsn=dsn, max_connections=1, enqueue_connections=0)
    async with open_database(config) as db:
        queue = Queue(db, config=FAST, secrets=MASTER_KEY)
        ids = [await queue.enqueue(Note(n=i)) for i in range(3)]
        ids += await queue.enqueue_many([Note(n=3), Note(n=4)])
        assert db._kept.open == 0
        assert await db.fetchval(
            "SELECT array_agg(id ORDER BY run_at) FROM nasiko_queue_jobs") == ids


async def test_a_large_mixed_batch_keeps_each_kind_in_order_and_ids_in_the_order_given(
    queue: Queue,
) -> None:
    """Build and plain jobs interleaved, more than a chunk of each (the pipelined
    path): the ids come back in the order given, and each table has its jobs in
    that order, all in one transaction with one NOTIFY for both."""
    from nasiko_queue.queue import ENQUEUE_MANY_CHUNK

    owner = uuid.uuid4()
    agent = await insert_agent(queue.db, owner_id=owner)
    build = make_payload("Upload", target_id=agent, build_id=uuid.uuid4(), owner_id=owner)
    batch: list[Any] = [Note(n=i) if i % 3 else build for i in range(3 * ENQUEUE_MANY_CHUNK + 7)]
    ids = await queue.enqueue_many(batch)
    build_ids = [j for j, p in zip(ids, batch, strict=True) if p is build]
    plain_ids = [j for j, p in zip(ids, batch, strict=True) if p is not build]
    assert len(build_ids) > ENQUEUE_MANY_CHUNK
    assert len(plain_ids) > ENQUEUE_MANY_CHUNK
    assert await queue.db.fetchval(
        "SELECT array_agg(id ORDER BY created_at) FROM build_jobs") == build_ids
    assert await queue.db.fetchval(
        "SELECT array_agg(id ORDER BY run_at) FROM nasiko_queue_jobs") == plain_ids
    assert await queue.db.fetchval(
        "SELECT count(DISTINCT xmin::text) FROM (SELECT xmin FROM build_jobs UNION ALL "
        "SELECT xmin FROM nasiko_queue_jobs) AS rows") == 1


@pytest.mark.parametrize("how", ["enqueue", "enqueue_json"])
async def test_a_delay_counts_from_the_enqueue_not_the_transactions_start(
    queue: Queue, how: str
) -> None:
    """`delay=` inside a transaction counts from the enqueue, on the database's
    clock, as `enqueue_many` and the SQL function count it. It counted from the
    transaction's start (`now()`): a delay after a minute of work in the same
    transaction was a minute shorter. The clock read here comes after the BEGIN,
    so a run_at counted from the BEGIN is earlier than it plus the delay."""
    async with queue.db.transaction() as tx:
        before = await tx.fetchval("SELECT clock_timestamp()")
        started = await tx.fetchval("SELECT now()")
        assert started < before
        if how == "enqueue":
            job_id = await queue.enqueue(Note(n=1, text="later"), delay=60, tx=tx)
        else:
            job_id = await queue.enqueue_json("note", {"n": 1}, delay=60, tx=tx)
        after = await tx.fetchval("SELECT clock_timestamp()")
    run_at = await queue.db.fetchval("SELECT run_at FROM nasiko_queue_jobs WHERE id = $1",
                                     job_id)
    assert before + timedelta(seconds=60) <= run_at <= after + timedelta(seconds=60)


@pytest.mark.parametrize("delay", [float("nan"), float("inf"), -1.0, 1e300,
                                   timedelta(days=365 * 101)])
async def test_a_delay_out_of_range_is_refused_before_anything_is_sent(
    queue: Queue, delay: Any
) -> None:
    """
    A NaN delay passed the `< 0` check and reached the server as an interval
    out of range (no field, no index in a batch); found by a bug hunt.
    """
    with pytest.raises(ValueError, match="delay is 0 to"):
        await queue.enqueue(Note(n=1, text="x"), delay=delay)
    with pytest.raises(ValueError, match="delay is 0 to") as caught:
        await queue.enqueue_many([Note(n=0, text="x"), Job(Note(n=1, text="x"), delay=delay)])
    assert any("payload 1 " in note for note in getattr(caught.value, "__notes__", []))
    assert await queue.db.fetchval("SELECT count(*) FROM nasiko_queue_jobs") == 0


def test_whole_numbers_of_any_int_type_and_delays_of_any_number_type_are_taken() -> None:
    """An IntEnum of priorities and a Decimal delay were taken before the checks
    above were added, and still are (a review's finding)."""
    import enum
    from decimal import Decimal
    from fractions import Fraction

    from nasiko_queue.plain.args import delay_seconds

    class Priority(enum.IntEnum):
        HIGH = -10

    assert JobOptions(priority=Priority.HIGH, max_attempts=Priority.HIGH + 13).priority == -10
    assert delay_seconds(Decimal("1.5")) == 1.5
    assert delay_seconds(Fraction(1, 4)) == 0.25
    with pytest.raises(TypeError, match="a number of seconds"):
        delay_seconds("5")  # type: ignore[arg-type]


@pytest.mark.parametrize(("make", "what"), [
    (lambda: JobOptions(priority=1.5), "priority is a whole number"),  # type: ignore[arg-type]
    (lambda: JobOptions(priority=True), "priority is a whole number"),
    (lambda: JobOptions(max_attempts=2.7), "max_attempts is a whole number"),  # type: ignore[arg-type]
    (lambda: JobOptions(max_attempts=2**40), "max_attempts is a whole number"),
    (lambda: JobOptions(max_attempts=0), "max_attempts is a whole number"),
    (lambda: JobOptions(queue="a\x00b"), "no NUL"),
    (lambda: Unique("k\x00"), "no NUL"),
    (lambda: Unique(""), "non-empty"),
])
def test_options_the_database_would_refuse_or_truncate_are_refused_at_once(
    make: Callable[[], object], what: str
) -> None:
    """
    A float priority was stored truncated by the trio API and refused by the
    sync one; 2**40 attempts and NUL characters reached the server, which
    refused the statement naming no field (found by a bug hunt).
    """
    with pytest.raises(ValueError, match=what):
        make()
