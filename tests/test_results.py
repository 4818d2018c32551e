"""
Results a caller can await (issue #22): what a plain job's executor returned is
stored with its completion, and `Queue.result` waits for it, woken by NOTIFY.

The waiting side runs with a poll interval of an hour (`SLOW_POLL`): a wait
that were not woken by its notification would hang until the test's deadline
and fail, so each passing wait here was woken by NOTIFY.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar
from uuid import UUID, uuid4

import attrs
import pytest
import trio

from nasiko_queue import (
    Executors,
    JobArgs,
    JobFailed,
    JobOptions,
    NoSuchJob,
    PlainJobContext,
    Queue,
    QueueConfig,
    Results,
    ResultTimeout,
    StepContext,
    Workflow,
)
from nasiko_queue.db.database import Database
from nasiko_queue.plain.results import ResultRefused, decode_result, encode_result

from .conftest import FAST, MASTER_KEY
from .helpers import TEST_DEADLINE, running
from .test_cancel_race import _blocked_by


@attrs.frozen(kw_only=True)
class Resize(JobArgs):
    kind: ClassVar[str] = "resize"
    options: ClassVar[JobOptions] = JobOptions(queue="images", max_attempts=2)
    n: int = 0
    returns: str = "dict"


@attrs.frozen
class Thumbnail:
    url: str
    width: int


SLOW_POLL = attrs.evolve(FAST, poll_interval=3600.0)


def executors_returning() -> Executors:
    executors = Executors()

    @executors.register(Resize, backoff=lambda _attempt: 0.0)
    async def resize(ctx: PlainJobContext[Resize]) -> Any:
        what = ctx.payload.returns
        n = ctx.payload.n
        if what == "dict":
            return {"n": n, "urls": [f"https://cdn/{n}.png"]}
        if what == "attrs":
            return Thumbnail(url=f"https://cdn/{n}.png", width=64 * n)
        if what == "none":
            return None
        if what == "crash":
            raise RuntimeError(f"cannot resize {n}")
        if what == "huge":
            return "x" * 2_000
        if what == "set":
            return {1, 2}
        if what == "nan":
            return {"ratio": math.nan}
        if what == "nul":
            return "a\x00b"
        raise AssertionError(what)

    return executors


def waiter(queue: Queue) -> Queue:
    return Queue(queue.db, config=SLOW_POLL, secrets=MASTER_KEY)


async def waiting(results: Results, count: int = 1) -> trio.Event:
    """An event set once `count` waits have read their rows and block."""
    blocked = trio.Event()
    seen: set[UUID] = set()

    def on_waiting(job_id: UUID) -> None:
        seen.add(job_id)
        if len(seen) >= count:
            blocked.set()

    results.on_waiting = on_waiting
    return blocked


async def test_a_waiting_caller_gets_what_the_executor_returned(queue: Queue) -> None:
    job_id = await queue.enqueue(Resize(n=7))
    got: list[Any] = []

    with trio.fail_after(TEST_DEADLINE):
        async with waiter(queue).results() as results, trio.open_nursery() as nursery:
            blocked = await waiting(results)

            async def wait() -> None:
                got.append(await results.wait(job_id))

            nursery.start_soon(wait)
            # The wait blocks before the worker starts: only the job's end wakes it.
            await blocked.wait()
            assert got == []
            async with running(queue, executors_returning()) as worker:
                await worker.wait_for(lambda s: s.done >= 1)
    assert got == [{"n": 7, "urls": ["https://cdn/7.png"]}]
    row = await queue.db.fetchrow("SELECT state, result FROM nasiko_queue_jobs WHERE id = $1",
                                  job_id)
    assert row["state"] == "completed"
    assert decode_result(row["result"]) == {"n": 7, "urls": ["https://cdn/7.png"]}
    # The wait ended with the job: nothing is left behind.
    assert await queue.db.fetchval("SELECT count(*) FROM nasiko_queue_result_waits") == 0


async def test_a_result_structured_as_a_declared_type_and_an_ended_job_answers_at_once(
    queue: Queue,
) -> None:
    attrs_id = await queue.enqueue(Resize(n=2, returns="attrs"))
    none_id = await queue.enqueue(Resize(n=3, returns="none"))
    async with running(queue, executors_returning()) as worker:
        with trio.fail_after(TEST_DEADLINE):
            await worker.wait_for(lambda s: s.done >= 2)
    with trio.fail_after(TEST_DEADLINE):
        assert await waiter(queue).result(attrs_id, Thumbnail) == Thumbnail(
            url="https://cdn/2.png", width=128)
        assert await waiter(queue).result(attrs_id) == {"url": "https://cdn/2.png",
                                                        "width": 128}
        assert await waiter(queue).result(none_id) is None
    assert await queue.db.fetchval(
        "SELECT result IS NULL FROM nasiko_queue_jobs WHERE id = $1", none_id)


async def test_a_discarded_job_raises_with_its_last_error_and_so_does_a_cancelled_one(
    queue: Queue,
) -> None:
    crash_id = await queue.enqueue(Resize(n=1, returns="crash"))
    later_id = await queue.enqueue(Resize(n=2), delay=3600)
    caught: dict[str, JobFailed] = {}

    with trio.fail_after(TEST_DEADLINE):
        async with waiter(queue).results() as results, trio.open_nursery() as nursery:
            blocked = await waiting(results, 2)

            async def wait(name: str, job_id: Any) -> None:
                with pytest.raises(JobFailed) as info:
                    await results.wait(job_id)
                caught[name] = info.value

            nursery.start_soon(wait, "crash", crash_id)
            nursery.start_soon(wait, "later", later_id)
            await blocked.wait()
            assert await queue.cancel(later_id) == "cancelled"  # not the completer's path
            async with running(queue, executors_returning()) as worker:
                await worker.wait_for(lambda s: s.failed >= 1)
    crash = caught["crash"]
    assert (crash.job_id, crash.state) == (crash_id, "discarded")
    assert crash.error == "RuntimeError: cannot resize 1"
    assert "cannot resize 1" in str(crash)
    assert (caught["later"].state, caught["later"].error) == ("cancelled", "cancelled")
    assert str(caught["later"]) == f"job {later_id} was cancelled"


@pytest.mark.parametrize(("returns", "why"), [
    ("huge", "result refused: the result is 2002 bytes encoded, over max_result_bytes (1000)"),
    ("set", "result refused: the result is not JSON: TypeError: Object of type set is not "
            "JSON serializable"),
    ("nan", "result refused: the result is not JSON: ValueError: Out of range float values "
            "are not JSON compliant"),
    ("nul", "result refused: the result holds a NUL character (\\u0000), which PostgreSQL's "
            "jsonb cannot store"),
])
async def test_a_result_that_cannot_be_stored_discards_the_job_and_the_queue_goes_on(
    db: Database, returns: str, why: str,
) -> None:
    queue = Queue(db, config=attrs.evolve(FAST, max_result_bytes=1000), secrets=MASTER_KEY)
    bad_id = await queue.enqueue(Resize(n=1, returns=returns))
    good_id = await queue.enqueue(Resize(n=2))
    async with running(queue, executors_returning()) as worker:
        with trio.fail_after(TEST_DEADLINE):
            await worker.wait_for(lambda s: s.done >= 1 and s.failed >= 1)
    row = await db.fetchrow(
        "SELECT state, attempt, error_msg, result FROM nasiko_queue_jobs WHERE id = $1", bad_id)
    # Refused, not truncated, and not retried (it had a second attempt left).
    assert (row["state"], row["attempt"], row["result"]) == ("discarded", 1, None)
    assert row["error_msg"] == why
    with pytest.raises(JobFailed, match="result refused"):
        await waiter(queue).result(bad_id)
    assert await waiter(queue).result(good_id) == {"n": 2, "urls": ["https://cdn/2.png"]}


async def test_results_of_a_batched_drain_land_on_their_own_jobs(db: Database) -> None:
    config = attrs.evolve(FAST, queues={"images": 10}, prefetch=20)
    queue = Queue(db, config=config, secrets=MASTER_KEY)
    ids = await queue.enqueue_many([Resize(n=n) for n in range(200)])
    got: dict[int, Any] = {}

    with trio.fail_after(TEST_DEADLINE):
        async with waiter(queue).results() as results:

            async def wait(n: int) -> None:
                got[n] = await results.wait(ids[n])

            async with trio.open_nursery() as nursery:
                for n in range(200):
                    nursery.start_soon(wait, n)
                async with running(queue, executors_returning()) as worker:
                    await worker.wait_for(lambda s: s.done >= 200)
    assert got == {n: {"n": n, "urls": [f"https://cdn/{n}.png"]} for n in range(200)}
    assert await db.fetchval("SELECT count(*) FROM nasiko_queue_result_waits") == 0


async def test_no_such_job_a_deleted_one_and_a_timeout(queue: Queue) -> None:
    with trio.fail_after(TEST_DEADLINE):
        with pytest.raises(NoSuchJob):
            await waiter(queue).result(uuid4())
        # A job that never runs here (no worker): the timeout ends the wait, and
        # the wait is removed.
        job_id = await queue.enqueue(Resize(n=1))
        with pytest.raises(ResultTimeout, match=f"job {job_id} had not ended after 0.2s"):
            await waiter(queue).result(job_id, timeout=0.2)
        assert await queue.db.fetchval("SELECT count(*) FROM nasiko_queue_result_waits") == 0
        assert isinstance(ResultTimeout("x"), TimeoutError)

        async with waiter(queue).results() as results, trio.open_nursery() as nursery:
            blocked = await waiting(results)

            async def delete_once_waited() -> None:
                await blocked.wait()
                await queue.db.execute("DELETE FROM nasiko_queue_jobs WHERE id = $1", job_id)

            nursery.start_soon(delete_once_waited)
            with pytest.raises(NoSuchJob):
                await results.wait(job_id)


async def test_a_wait_survives_a_lost_listen_connection(queue: Queue) -> None:
    # Polls while LISTEN is down; reads the row again as soon as it is back.
    config = attrs.evolve(FAST, poll_interval=3600.0, retry_initial_delay=0.01,
                          retry_max_delay=0.02)
    job_id = await queue.enqueue(Resize(n=5))
    got: list[Any] = []
    with trio.fail_after(TEST_DEADLINE):
        async with Queue(queue.db, config=config).results() as results, \
                trio.open_nursery() as nursery:
            blocked = await waiting(results)

            async def wait() -> None:
                got.append(await results.wait(job_id))

            nursery.start_soon(wait)
            await blocked.wait()
            # Cut the LISTEN connection, and complete the job while it may be down.
            assert await queue.db.fetchval(
                "SELECT count(*) FROM (SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE query = 'LISTEN \"nasiko_queue_results\"' "
                "AND datname = current_database()) AS t") == 1
            async with running(queue, executors_returning()) as worker:
                await worker.wait_for(lambda s: s.done >= 1)
    assert got == [{"n": 5, "urls": ["https://cdn/5.png"]}]


def test_encode_result_refuses_what_jsonb_cannot_hold_and_keeps_the_rest() -> None:
    assert encode_result(None, 10) is None
    assert encode_result({"a": [1, "é"]}, 100).json == '{"a":[1,"é"]}'  # type: ignore[union-attr]
    assert encode_result(Thumbnail("u", 1), 100).json == '{"url":"u","width":1}'  # type: ignore[union-attr]
    # The bound counts bytes of the JSON text: "é" is two, and the quotes count.
    assert encode_result("éé", 6) is not None
    with pytest.raises(ResultRefused, match="8 bytes encoded, over max_result_bytes \\(6\\)"):
        encode_result("ééé", 6)
    with pytest.raises(ResultRefused, match="not JSON"):
        encode_result(object(), 100)
    assert QueueConfig().max_result_bytes == 1024 * 1024


async def test_a_wait_that_starts_while_the_jobs_end_commits_sees_the_end(queue: Queue) -> None:
    """Regression (review of 18ab46b): the end's trigger ran before the wait existed,
    so it notified nobody; the wait read the row before the end committed and
    blocked for good. The wait's read is FOR SHARE: it waits for that commit."""
    job_id = await queue.enqueue(Resize(n=1), delay=3600)
    caught: list[BaseException] = []
    with trio.fail_after(TEST_DEADLINE):
        async with waiter(queue).results() as results, trio.open_nursery() as nursery:

            async def wait() -> None:
                try:
                    await results.wait(job_id)
                except JobFailed as exc:
                    caught.append(exc)

            async with queue.db.transaction() as tx:
                assert await tx.fetchval("SELECT nasiko_queue_cancel($1)", job_id) == "cancelled"
                nursery.start_soon(wait)
                # Committed once the wait's read is blocked on the ending transaction.
                await _blocked_by(queue.db, await tx.fetchval("SELECT pg_backend_pid()"))
    [failed] = caught
    assert isinstance(failed, JobFailed)
    assert failed.state == "cancelled"


def test_results_that_break_the_encoder_are_refused_not_crashed() -> None:
    """Regression (review of 18ab46b): a lone surrogate or deep nesting escaped as an
    internal error (retried, the run's effects done again); an escaped backslash
    before "u0000" was taken for a NUL."""
    with pytest.raises(ResultRefused, match="not JSON"):
        encode_result("name-\udcff.png", 100)
    deep: Any = []
    for _ in range(100_000):
        deep = [deep]
    with pytest.raises(ResultRefused, match="not JSON"):
        encode_result(deep, 10_000_000)
    assert encode_result("a\\u0000b", 100) is not None


async def test_a_wait_reads_again_through_an_outage(dsn: str, queue: Queue) -> None:
    """The server goes away (every connection closed, new ones refused) while a
    caller waits: LISTEN is lost, and the wait's read fails. The wait goes on,
    reads again at its next poll, and hears the job's end once the server is
    back. It used to raise the read's connection error at once, ending a wait
    the caller gave 60 s to."""
    from nasiko_queue import DatabaseConfig, open_database

    from .helpers import LogEvent
    from .netproxy import Proxy

    job_id = await queue.enqueue(Resize(n=1), delay=3600)  # no worker: it waits
    proxy = Proxy(dsn)
    config = attrs.evolve(FAST, poll_interval=0.05, retry_initial_delay=0.01,
                          retry_max_delay=0.05)
    with trio.fail_after(TEST_DEADLINE):
        async with trio.open_nursery() as outer:
            await outer.start(proxy.run)
            async with open_database(DatabaseConfig(dsn=proxy.dsn(), connect_timeout=5)) as db, \
                    Queue(db, config=config).results() as results, \
                    trio.open_nursery() as nursery:
                blocked = await waiting(results)
                failed: list[JobFailed] = []

                async def wait() -> None:
                    with pytest.raises(JobFailed) as ended:
                        await results.wait(job_id, timeout=TEST_DEADLINE)
                    failed.append(ended.value)

                with LogEvent(f"could not read {job_id}") as unread:
                    nursery.start_soon(wait)
                    await blocked.wait()
                    proxy.refuse()
                    await unread.event.wait()  # a read failed in the outage; still waiting
                proxy.restore()
                assert await queue.cancel(job_id) == "cancelled"
            outer.cancel_scope.cancel()
    assert [(e.state, e.error) for e in failed] == [("cancelled", "cancelled")]


async def test_a_timeout_holds_while_the_listen_connection_cannot_open(
    dsn: str, queue: Queue,
) -> None:
    """A network cut: nothing gets through and nothing is refused, so opening the
    call's LISTEN connection waits for `connect_timeout` (two minutes here). The
    caller's timeout of a tenth of a second covers that too. It used to start
    only once LISTEN had opened or failed."""
    from nasiko_queue import DatabaseConfig, open_database

    from .netproxy import Proxy

    job_id = await queue.enqueue(Resize(n=1), delay=3600)
    proxy = Proxy(dsn)
    with trio.fail_after(TEST_DEADLINE):
        async with trio.open_nursery() as outer:
            await outer.start(proxy.run)
            async with open_database(DatabaseConfig(dsn=proxy.dsn(),
                                                    connect_timeout=120)) as db:
                proxy.partition()
                with pytest.raises(ResultTimeout):
                    await Queue(db, config=FAST).result(job_id, timeout=0.1)
                proxy.restore()
            outer.cancel_scope.cancel()


async def test_no_wait_is_recorded_for_a_job_that_is_not_there_or_has_ended(
    queue: Queue,
) -> None:
    """A wait's row is removed by the job's end (its trigger), or by the waiter
    when it stops waiting; a removal that fails (an outage, a cancel) leaves it
    to the job's end. For an id no job has, or a job already ended, no end will
    come: the row stayed for good (found by a bug hunt). The read records none
    then; for a waiting job it records one, as before."""
    from nasiko_queue.db.statements import Q

    waits = "SELECT count(*) FROM nasiko_queue_result_waits"
    assert await queue.db.fetchrow(Q.result_wait_and_read, uuid4(), uuid4(), None) is None
    assert await queue.db.fetchrow(Q.workflow_result_wait_and_read, uuid4(), uuid4()) is None
    ended = await queue.enqueue(Resize(n=1))
    assert await queue.cancel(ended) == "cancelled"
    row = await queue.db.fetchrow(Q.result_wait_and_read, ended, uuid4(), None)
    assert row["state"] == "cancelled"
    assert await queue.db.fetchval(waits) == 0
    waiting = await queue.enqueue(Resize(n=2), delay=3600)
    assert (await queue.db.fetchrow(Q.result_wait_and_read, waiting, uuid4(), None))["state"] \
        == "available"
    assert await queue.db.fetchval(waits) == 1


@pytest.mark.parametrize("of", ["job", "run"])
async def test_a_wait_recorded_while_the_end_commits_is_not_left_behind(
    queue: Queue, of: str
) -> None:
    """A wait recorded while the job's (or run's) end was in flight: the end's
    trigger deleted the waits before this one existed, and the read (FOR SHARE)
    saw the end; only the waiter's own removal deleted the row. A waiter that
    died then (killed, its removal cut by an outage) left it for good: no end
    would come again, retention does not read the table, runs are never
    deleted. Here the waiter "dies" after its read (it never removes its row).
    The wait is now recorded only if the row, once locked, has not ended."""
    from nasiko_queue.db.statements import Q

    if of == "job":
        target = await queue.enqueue(Resize(n=1), delay=3600)
        end, read, extra = "SELECT nasiko_queue_cancel($1)", Q.result_wait_and_read, (None,)
    else:
        wf = Workflow("held")

        @wf.step()
        async def only(ctx: StepContext) -> None:
            return None

        target = await queue.start(wf)
        end = ("UPDATE nasiko_queue_workflow_runs SET state = 'cancelled', "
               "finished_at = now() WHERE id = $1")
        read, extra = Q.workflow_result_wait_and_read, ()
    rows: list[Any] = []
    with trio.fail_after(TEST_DEADLINE):
        async with trio.open_nursery() as nursery, queue.db.transaction() as tx:
            await tx.execute(end, target)

            async def wait_and_die() -> None:
                rows.append(await queue.db.fetchrow(read, target, uuid4(), *extra))

            nursery.start_soon(wait_and_die)
            # Committed once the read is blocked on the ending transaction.
            await _blocked_by(queue.db, await tx.fetchval("SELECT pg_backend_pid()"))
    assert rows[0]["state"] == "cancelled"
    assert await queue.db.fetchval(
        "SELECT count(*) FROM nasiko_queue_result_waits WHERE job_id = $1", target) == 0
