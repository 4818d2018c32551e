"""
The wake path (issue #13): from a wake to the claim with no detour, and the
opt-in claims whose commit does not wait for the disk.

* A wake while the worker is idle begins the drain in the wake itself, so that
  the producer claims on its next pass instead of after the drain loop's.
* A wake during a drain re-arms it: a claim that was already in flight (and may
  have been sent before the job that caused the wake was committed) coming
  back short does not end the drain; the producer claims again in the same
  drain, without a round of the drain loop.
* `QueueConfig.claim_synchronous_commit` off: the claims a worker sends on their
  own commit with `synchronous_commit = off`, and no other statement does.
  Seen from inside the server: a trigger writes down the setting in force when
  each of the queue's updates ran.
"""

from __future__ import annotations

from typing import Any, ClassVar

import attrs
import pytest
import trio

from nasiko_queue import JobArgs, JobContext, JobOptions, PlainJobContext, Queue
from nasiko_queue.builds.payloads import BUILTIN_PAYLOAD_TYPES
from nasiko_queue.builds.store import PgJobStore
from nasiko_queue.db.database import Database
from nasiko_queue.engine.contracts import ClaimedJob
from nasiko_queue.engine.worker import Worker
from nasiko_queue.testing import enqueue_with_target

from .conftest import FAST, MASTER_KEY
from .helpers import TEST_DEADLINE, executors_for_all, running, succeed

#: Nothing wakes the worker but the test: no LISTEN, no poll within the test.
QUIET = attrs.evolve(FAST, listen=False, poll_interval=3600.0)


class GatedStore(PgJobStore):
    """
    The real store, whose claims can be made to answer late: while `armed`,
    a claim runs (and commits) on the server as usual, then its answer waits
    for `release`, as a slow network would hold it. Only the timing is the
    test's; every statement is the engine's own, on the real database.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.armed = False
        self.in_flight = trio.Event()
        self.release = trio.Event()

    async def claim(self, limit: int) -> list[ClaimedJob]:
        jobs = await super().claim(limit)
        if self.armed:
            self.armed = False
            self.in_flight.set()
            await self.release.wait()
        return jobs


async def test_a_wake_while_idle_begins_the_drain_at_once(queue: Queue) -> None:
    quiet = Queue(queue.db, config=QUIET, secrets=MASTER_KEY)
    async with running(quiet, executors_for_all(succeed)) as worker:
        await worker.drain_once()
        before = worker.stats.drains_started
        worker.wake()
        # No checkpoint since the wake: the drain is under way already.
        assert worker.stats.drains_started == before + 1
        assert all(lane.state.draining for lane in worker.lanes)
        with trio.fail_after(TEST_DEADLINE):
            await worker.drain_once()


async def test_a_wake_during_a_drain_is_answered_by_that_drain(queue: Queue) -> None:
    """
    The drain's claim commits having found nothing; before its answer arrives a
    job is enqueued and the worker woken. The short answer must not end the
    drain: the job is claimed in that same drain, not in the next one.
    """
    config = QUIET
    kinds = frozenset(t.kind for t in BUILTIN_PAYLOAD_TYPES)
    store = GatedStore(queue.db, config, runnable_kinds=kinds, known_kinds=kinds)
    worker_queue = Queue(queue.db, config=config, secrets=MASTER_KEY)
    # Another Queue object: its enqueue wakes no worker in this process.
    other = Queue(queue.db, config=attrs.evolve(config, notify_channel=None),
                  secrets=MASTER_KEY)
    started_in_drain: list[int] = []

    async def run(ctx: JobContext[Any]) -> None:
        started_in_drain.append(worker.stats.drains_started)
        await succeed(ctx)

    worker = Worker(worker_queue, executors_for_all(run), store=store)
    with trio.fail_after(TEST_DEADLINE):
        async with trio.open_nursery() as nursery:
            await nursery.start(worker.run)
            await worker.drain_once()
            store.armed = True
            worker.wake()
            drain = worker.stats.drains_started
            await store.in_flight.wait()  # committed, found nothing; answer held
            await enqueue_with_target(other, "Upload")
            worker.wake()
            store.release.set()
            await worker.wait_for(lambda s: s.done >= 1)
            worker.stop()
    assert started_in_drain == [drain]


# -- claims that do not wait for the flush -----------------------------------------

SETTING_LOG = """
CREATE TABLE test_commit_setting (n bigserial, tbl text, status text, setting text);
CREATE FUNCTION test_log_commit_setting() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO test_commit_setting (tbl, status, setting)
    VALUES (TG_TABLE_NAME, coalesce(to_jsonb(NEW) ->> 'status', to_jsonb(NEW) ->> 'state'),
            current_setting('synchronous_commit'));
    RETURN NEW;
END $$;
-- AFTER triggers run at the end of the statement, when every part of it
-- (the claim's set_config included) has run.
CREATE TRIGGER test_log_build AFTER UPDATE ON build_jobs
    FOR EACH ROW EXECUTE FUNCTION test_log_commit_setting();
CREATE TRIGGER test_log_plain AFTER UPDATE ON nasiko_queue_jobs
    FOR EACH ROW EXECUTE FUNCTION test_log_commit_setting();
"""


@attrs.frozen(kw_only=True)
class Ping(JobArgs):
    kind: ClassVar[str] = "test_ping"
    options: ClassVar[JobOptions] = JobOptions(queue="pings")


async def _settings(db: Database, table: str) -> list[tuple[str, str]]:
    rows = await db.fetch("SELECT status, setting FROM test_commit_setting WHERE tbl = $1 "
                          "ORDER BY n", table)
    return [(r["status"], r["setting"]) for r in rows]


@pytest.mark.parametrize("synchronous", [True, False])
async def test_only_claims_skip_the_flush_and_only_when_asked(
    db: Database, synchronous: bool
) -> None:
    await db.execute(SETTING_LOG)
    config = attrs.evolve(QUIET, claim_synchronous_commit=synchronous)
    queue = Queue(db, config=config, secrets=MASTER_KEY)
    build = await enqueue_with_target(queue, "Upload")
    await queue.enqueue(Ping())
    executors = executors_for_all(succeed)

    @executors.register(Ping)
    async def ping(ctx: PlainJobContext[Ping]) -> None:
        return None

    async with running(queue, executors) as worker:
        with trio.fail_after(TEST_DEADLINE):
            await worker.wait_for(lambda s: s.done >= 2)
    claim = "on" if synchronous else "off"
    # The claim (sent on its own after the wake), then the finish, which rides on
    # a statement that claims too but keeps the server's setting.
    assert await _settings(db, "build_jobs") == [("in_progress", claim), ("done", "on")]
    assert await _settings(db, "nasiko_queue_jobs") == [("running", claim), ("completed", "on")]
    assert await db.fetchval("SELECT status FROM build_jobs WHERE id = $1",
                             build.job_id) == "done"
