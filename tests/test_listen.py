"""LISTEN/NOTIFY (issue 5): an enqueue in any process wakes every worker at once."""

from __future__ import annotations

import uuid

import attrs
import trio

from nasiko_queue import Database, Queue, QueueConfig, open_database
from nasiko_queue.testing import enqueue_with_target, insert_agent, insert_agent_build, make_payload

from .conftest import FAST, MASTER_KEY
from .helpers import executors_for_all, running, succeed

#: The poll would take an hour: any prompt start below is the notification's doing.
NO_POLL = attrs.evolve(FAST, poll_interval=3600.0)


async def _listen_backends(db: Database) -> list[int]:
    rows = await db.fetch(
        "SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
        "AND query ILIKE 'LISTEN %' AND pid <> pg_backend_pid()")
    return [r["pid"] for r in rows]


async def test_job_from_another_process_starts_at_once(dsn: str) -> None:
    """The enqueuer has its own Database and Queue: no in-process wake can reach the worker."""
    async with open_database(dsn) as worker_db, open_database(dsn) as other_db:
        queue = Queue(worker_db, config=NO_POLL, secrets=MASTER_KEY)
        async with running(queue, executors_for_all(succeed)) as worker:
            assert worker.stats.listen_connects == 1
            assert len(await _listen_backends(worker_db)) == 1
            await worker.drain_once()  # the startup drain is over; now idle for an hour
            other = Queue(other_db, config=NO_POLL, secrets=MASTER_KEY)
            with trio.fail_after(10):
                await enqueue_with_target(other, "Upload")        # inside a transaction
                await worker.wait_for(lambda s: s.done >= 1)
                owner = uuid.uuid4()
                agent = await insert_agent(other_db, owner_id=owner)
                build = await insert_agent_build(other_db, agent)
                await other.enqueue(                               # and without one
                    make_payload("Upload", target_id=agent, build_id=build, owner_id=owner))
                await worker.wait_for(lambda s: s.done >= 2)
            assert worker.stats.notifications >= 2


async def test_one_notification_per_transaction(queue: Queue, db: Database) -> None:
    seen: list[str] = []
    sentinel = trio.Event()

    def on_notify(payload: str) -> None:
        seen.append(payload)
        if payload == "end":
            sentinel.set()

    channel = queue.config.notify_channel
    assert channel is not None
    async with db.listen(channel, on_notify):
        owner = uuid.uuid4()
        async with db.transaction() as tx:
            agent = await insert_agent(tx, owner_id=owner)
            build = await insert_agent_build(tx, agent)
            for _ in range(500):
                await queue.enqueue(
                    make_payload("Upload", target_id=agent, build_id=build, owner_id=owner),
                    tx=tx)
            assert tx._notified == {channel}
        # A later transaction's notification arrives after every earlier one.
        await db.execute("SELECT pg_notify($1, 'end')", channel)
        with trio.fail_after(10):
            await sentinel.wait()
    assert seen == ["", "end"]
    assert await db.fetchval("SELECT count(*) FROM build_jobs") == 500


async def test_rolled_back_enqueue_notifies_nobody(queue: Queue, db: Database) -> None:
    seen: list[str] = []
    sentinel = trio.Event()

    def on_notify(payload: str) -> None:
        seen.append(payload)
        if payload == "end":
            sentinel.set()

    channel = queue.config.notify_channel
    assert channel is not None
    async with db.listen(channel, on_notify):
        owner = uuid.uuid4()
        try:
            async with db.transaction() as tx:
                agent = await insert_agent(tx, owner_id=owner)
                build = await insert_agent_build(tx, agent)
                await queue.enqueue(
                    make_payload("Upload", target_id=agent, build_id=build, owner_id=owner),
                    tx=tx)
                raise LookupError("handler failed")
        except LookupError:
            pass
        await db.execute("SELECT pg_notify($1, 'end')", channel)
        with trio.fail_after(10):
            await sentinel.wait()
    assert seen == ["end"]


async def test_lost_listen_connection_reconnects_and_wakes(dsn: str) -> None:
    async with open_database(dsn) as worker_db, open_database(dsn) as other_db:
        queue = Queue(worker_db, config=NO_POLL, secrets=MASTER_KEY)
        async with running(queue, executors_for_all(succeed)) as worker:
            await worker.drain_once()
            (pid,) = await _listen_backends(worker_db)
            with trio.fail_after(10):
                # A job enqueued while the connection is down sends its NOTIFY into
                # the void; the wake after reconnecting drains it (with the poll at
                # an hour, nothing else would).
                assert await other_db.fetchval("SELECT pg_terminate_backend($1)", pid)
                await enqueue_with_target(Queue(other_db, config=NO_POLL), "Upload")
                await worker.wait_for(lambda s: s.listen_connects >= 2)
                await worker.wait_for(lambda s: s.done >= 1)
                (new_pid,) = await _listen_backends(worker_db)
                assert new_pid != pid
                # And the new connection listens: a job enqueued now starts at once.
                await enqueue_with_target(Queue(other_db, config=NO_POLL), "Upload")
                await worker.wait_for(lambda s: s.done >= 2)


async def test_listen_off_opens_no_connection(dsn: str) -> None:
    async with open_database(dsn) as db:
        queue = Queue(db, config=attrs.evolve(FAST, listen=False), secrets=MASTER_KEY)
        async with running(queue, executors_for_all(succeed)) as worker:
            await worker.drain_once()
            assert worker.stats.listen_connects == 0
            assert await _listen_backends(db) == []


async def test_no_channel_sends_no_notification(db: Database) -> None:
    seen: list[str] = []
    sentinel = trio.Event()

    def on_notify(payload: str) -> None:
        seen.append(payload)
        sentinel.set()

    quiet = Queue(db, config=attrs.evolve(FAST, notify_channel=None), secrets=MASTER_KEY)
    async with db.listen(QueueConfig().notify_channel or "", on_notify):
        await enqueue_with_target(quiet, "Upload")
        await db.execute("SELECT pg_notify($1, 'end')", QueueConfig().notify_channel)
        with trio.fail_after(10):
            await sentinel.wait()
    assert seen == ["end"]


async def test_a_listen_connection_that_hangs_without_a_reset_is_replaced(
    dsn: str, db: Database
) -> None:
    """The LISTEN connection goes silent: no RST, no FIN, nothing delivered (a
    frozen network, a NAT that forgot it). The periodic check notices within its
    interval plus `cleanup_timeout`, and the worker listens on a new connection:
    a job enqueued elsewhere then starts at once (the poll is an hour away)."""
    from .netproxy import Proxy

    config = attrs.evolve(NO_POLL, listen_check_interval=0.2, cleanup_timeout=0.3)
    async with trio.open_nursery() as nursery:
        proxy = Proxy(dsn)
        await nursery.start(proxy.run)
        async with open_database(proxy.dsn()) as worker_db:
            queue = Queue(worker_db, config=config, secrets=MASTER_KEY)
            async with running(queue, executors_for_all(succeed)) as worker:
                await worker.drain_once()
                assert worker.stats.listen_connects == 1
                proxy.freeze()  # every connection open now, LISTEN's included
                with trio.fail_after(10):
                    await worker.wait_for(lambda s: s.listen_connects >= 2)
                proxy.restore()
                assert worker.stats.listen_hangs >= 1
                with trio.fail_after(10):
                    await enqueue_with_target(Queue(db, config=NO_POLL), "Upload")
                    await worker.wait_for(lambda s: s.done >= 1)
        nursery.cancel_scope.cancel()


async def test_a_job_put_back_after_a_crash_or_a_hard_stop_notifies_other_replicas(
    queue: Queue, db: Database
) -> None:
    """A reset (a crash with attempts left, a hard stop's release, the sweep's reset
    of a stuck job) sends a NOTIFY, as the prefetch give-back does, so that another
    replica takes the job at once instead of at its next poll."""
    from nasiko_queue.builds.store import PgJobStore
    from nasiko_queue.testing import KINDS

    seen: list[str] = []
    heard = trio.Event()

    def on_notify(payload: str) -> None:
        seen.append(payload)
        heard.set()

    kinds = frozenset(KINDS)
    store = PgJobStore(db, queue.config, runnable_kinds=kinds, known_kinds=kinds)
    quiet = Queue(db, config=attrs.evolve(FAST, notify_channel=None), secrets=MASTER_KEY)
    for _ in range(2):
        await enqueue_with_target(quiet, "Upload")
    channel = queue.config.notify_channel
    assert channel is not None
    async with db.listen(channel, on_notify):
        (job,) = await store.claim(1)
        assert await store.reset(job)
        with trio.fail_after(10):
            await heard.wait()
        heard = trio.Event()
        await store.claim(1)
        await db.execute("UPDATE build_jobs SET picked_at = now() - interval '2 hours' "
                         "WHERE status = 'in_progress'")
        assert (await store.recover()).reset == 1
        with trio.fail_after(10):
            await heard.wait()
    assert len(seen) == 2
