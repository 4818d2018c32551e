"""
The asyncio client, `nasiko_queue.aio` (issue #26): enqueue, enqueue_many,
cancel and result from asyncio over asyncpg, joining the caller's transaction,
with the trio API's codec; and the worker in a thread of the asyncio process
(`nq.start_worker_thread`) running what it enqueued.

Each test is a plain function that runs its asyncio part on a plain asyncio loop
(`plain_asyncio.run_asyncio`, which checks it is one), as an application's server
does (pytest-trio runs only the `async def` tests).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import json
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any, ClassVar, TypeVar
from uuid import UUID, uuid4

import asyncpg
import attrs
import pytest
import trio

import nasiko_queue as nq
from nasiko_queue import (
    CancelResult,
    Executors,
    InvalidPayload,
    Job,
    JobArgs,
    JobFailed,
    JobOptions,
    NoSuchJob,
    PayloadCodec,
    PlainJobContext,
    ResultTimeout,
    Secret,
    SecretsNotConfigured,
    Unique,
    aio,
)
from nasiko_queue.db.statements import Q

from .conftest import FAST, MASTER_KEY
from .helpers import TEST_DEADLINE
from .plain_asyncio import PLAIN_ASYNCIO, run_asyncio

T = TypeVar("T")


@attrs.frozen(kw_only=True)
class Resize(JobArgs):
    kind: ClassVar[str] = "resize"
    options: ClassVar[JobOptions] = JobOptions(queue="images", priority=2, max_attempts=4)
    url: str
    width: int = 64
    #: Sealed at rest, as any secret field of a plain job.
    token: Mapping[str, Secret] = attrs.field(factory=dict, metadata={"sealed": True})


@attrs.frozen
class Thumbnail:
    url: str
    width: int


def on_pool(dsn: str, fn: Callable[[asyncpg.Pool], Awaitable[T]]) -> T:
    async def main() -> T:
        async with asyncpg.create_pool(dsn, min_size=1, max_size=4) as pool:
            return await fn(pool)

    return run_asyncio(main())


async def payloads(pool: asyncpg.Pool) -> dict[UUID, dict[str, Any]]:
    rows = await pool.fetch("SELECT id, payload::text AS p FROM nasiko_queue.nasiko_queue_jobs")
    return {r["id"]: json.loads(r["p"]) for r in rows}


def test_enqueue_joins_the_callers_transaction(dsn: str) -> None:
    async def main(pool: asyncpg.Pool) -> None:
        async with pool.acquire() as conn:
            await conn.execute("CREATE TABLE images (url text PRIMARY KEY)")
            async with conn.transaction():
                await conn.execute("INSERT INTO images VALUES ('a.png')")
                kept = await aio.enqueue(conn, Resize(url="a.png"))

            async def failing_handler() -> None:
                async with conn.transaction():
                    await conn.execute("INSERT INTO images VALUES ('b.png')")
                    await aio.enqueue(conn, Resize(url="b.png"))
                    raise ZeroDivisionError

            with pytest.raises(ZeroDivisionError):
                await failing_handler()
        assert await pool.fetchval("SELECT array_agg(url) FROM images") == ["a.png"]
        assert list(await payloads(pool)) == [kept]
        row = await pool.fetchrow("SELECT queue, priority, max_attempts, state FROM "
                                  "nasiko_queue.nasiko_queue_jobs WHERE id = $1", kept)
        assert tuple(row) == ("images", 2, 4, "available")

    on_pool(dsn, main)


def test_the_codec_is_the_trio_apis(dsn: str) -> None:
    """The row holds what Queue.enqueue writes (PayloadCodec.dumps), secret fields
    sealed; without the key a secret is refused before anything is sent."""
    job = Resize(url="é.png", width=3, token={"api": Secret("s3cr3t")})

    async def main(pool: asyncpg.Pool) -> None:
        job_id = await aio.enqueue(pool, job, secrets=MASTER_KEY)
        with pytest.raises(SecretsNotConfigured):
            await aio.enqueue(pool, job)
        [stored] = (await payloads(pool)).values()
        assert "s3cr3t" not in json.dumps(stored)
        decoded = PayloadCodec(types=[Resize], secrets=MASTER_KEY).decode_args(stored)
        assert decoded == job
        plain = Resize(url="é.png", width=3)
        await pool.execute("DELETE FROM nasiko_queue.nasiko_queue_jobs WHERE id = $1", job_id)
        await aio.enqueue(pool, plain)
        [stored] = (await payloads(pool)).values()
        assert stored == json.loads(PayloadCodec().dumps(plain))

    on_pool(dsn, main)


def test_options_unique_and_bad_input(dsn: str) -> None:
    async def main(pool: asyncpg.Pool) -> None:
        first = await aio.enqueue(pool, Resize(url="u"), unique=Unique("u"),
                                  options=JobOptions(queue="other"), delay=60)
        assert await aio.enqueue(pool, Resize(url="u2"), unique=Unique("u")) == first
        row = await pool.fetchrow("SELECT queue, run_at > now() AS later FROM "
                                  "nasiko_queue.nasiko_queue_jobs WHERE id = $1", first)
        assert tuple(row) == ("other", True)
        with pytest.raises(TypeError, match="only plain jobs"):
            await aio.enqueue(pool, nq.StandaloneBuild(  # type: ignore[arg-type]
                build_id=uuid4(), agent_id=uuid4(), agent_name="a", version_tag="v1"))
        naive = datetime.datetime(2030, 1, 1)  # naive: the mistake refused
        with pytest.raises(ValueError, match="aware datetime"):
            await aio.enqueue(pool, Resize(url="x"), run_at=naive)
        with pytest.raises(nq.PayloadTooLarge):
            await aio.enqueue(pool, Resize(url="x" * 200), max_payload_bytes=100)
        assert await pool.fetchval("SELECT count(*) FROM nasiko_queue.nasiko_queue_jobs") == 1

    on_pool(dsn, main)


def test_enqueue_many(dsn: str) -> None:
    """All or none, ids in the order given; a bad job is named by its index."""
    async def main(pool: asyncpg.Pool) -> None:
        ids = await aio.enqueue_many(pool, [
            Resize(url="0"),
            Job(Resize(url="1"), options=JobOptions(queue="q1"), unique=Unique("k")),
            Job(Resize(url="2"), delay=30),
            Job(Resize(url="3"), unique=Unique("k")),
        ])
        assert len(ids) == 4
        assert ids[3] == ids[1]
        stored = await payloads(pool)
        assert [stored[i]["url"] for i in ids[:3]] == ["0", "1", "2"]
        with pytest.raises(InvalidPayload, match=r"jobs\[1\]: .*NUL"):
            await aio.enqueue_many(pool, [Resize(url="ok"), Resize(url="a\x00b")])
        with pytest.raises(ValueError, match=r"jobs\[0\]: delay is 0 to"):
            await aio.enqueue_many(pool, [Job(Resize(url="ok"), delay=-1)])
        # Found by a bug hunt: a lone surrogate raised TypeError ("function takes
        # exactly 5 arguments") in place of the index, a NaN delay went out as the
        # bare token NaN (the server refused the batch's JSON, no index).
        with pytest.raises(InvalidPayload, match=r"jobs\[1\]: .*field 'url': a lone "
                                                 r"surrogate"):
            await aio.enqueue_many(pool, [Resize(url="ok"), Resize(url="a\ud800b")])
        for bad in (float("nan"), float("inf"), 1e300):
            with pytest.raises(ValueError, match=r"jobs\[1\]: delay is 0 to"):
                await aio.enqueue_many(pool, [Resize(url="ok"), Job(Resize(url="x"), delay=bad)])
        assert await aio.enqueue_many(pool, []) == []
        assert await pool.fetchval("SELECT count(*) FROM nasiko_queue.nasiko_queue_jobs") == 3

    on_pool(dsn, main)


def test_cancel(dsn: str) -> None:
    async def main(pool: asyncpg.Pool) -> None:
        job_id = await aio.enqueue(pool, Resize(url="c"))
        assert await aio.cancel(pool, job_id) is CancelResult.CANCELLED
        assert await aio.cancel(pool, job_id) == "already cancelled"
        assert await aio.cancel(pool, uuid4()) is None
        with pytest.raises(JobFailed, match="cancelled"):
            await aio.result(pool, job_id)
        with pytest.raises(NoSuchJob):
            await aio.result(pool, uuid4())
        with pytest.raises(ResultTimeout):
            await aio.result(pool, await aio.enqueue(pool, Resize(url="t")), timeout=0.05)
        # The timed-out wait took its record with it.
        assert await pool.fetchval("SELECT count(*) FROM "
                                   "nasiko_queue.nasiko_queue_result_waits") == 0

    on_pool(dsn, main)


def resize_executors(started: threading.Event | None = None,
                     release: threading.Event | None = None) -> Executors:
    executors = Executors()

    @executors.register(Resize)
    async def resize(ctx: PlainJobContext[Resize]) -> Thumbnail:
        if started is not None and release is not None:
            started.set()
            # A thread's event: the test holds the job running from its own thread.
            await trio.to_thread.run_sync(release.wait)
        return Thumbnail(url=f"thumb-{ctx.payload.url}", width=ctx.payload.width)

    return executors


def test_worker_thread_runs_what_asyncio_enqueues(dsn: str) -> None:
    """An asyncio app with the worker in a thread of its process: the result comes
    back through aio.result, woken by NOTIFY (the worker's poll is an hour)."""
    config = attrs.evolve(FAST, poll_interval=3600.0)
    with nq.start_worker_thread(dsn, resize_executors(), config=config) as worker_thread:
        async def main(pool: asyncpg.Pool) -> list[Any]:
            ids = [await aio.enqueue(pool, Resize(url=f"{n}.png", width=n)) for n in range(3)]
            async with asyncio.timeout(TEST_DEADLINE):
                return [await aio.result(pool, i, Thumbnail) for i in ids] + [
                    await aio.result(pool, ids[0])]

        answers = on_pool(dsn, main)
        assert answers == [Thumbnail("thumb-0.png", 0), Thumbnail("thumb-1.png", 1),
                           Thumbnail("thumb-2.png", 2), {"url": "thumb-0.png", "width": 0}]
        assert worker_thread.worker is not None
        assert worker_thread.worker.stats.done == 3
    assert not worker_thread.running


def test_worker_thread_graceful_stop_finishes_the_job_in_flight(dsn: str) -> None:
    """Stop asked while a job runs: it finishes and completes; nothing is claimed
    after the stop (a job enqueued then waits for the next worker)."""
    started, release = threading.Event(), threading.Event()
    thread = nq.start_worker_thread(dsn, resize_executors(started, release), config=FAST)
    try:
        async def enqueue(pool: asyncpg.Pool) -> UUID:
            return await aio.enqueue(pool, Resize(url="inflight"))

        inflight = on_pool(dsn, enqueue)
        assert started.wait(TEST_DEADLINE)
        thread.request_stop()
        later = on_pool(dsn, enqueue)
        release.set()
        assert thread.join(TEST_DEADLINE)
    finally:
        release.set()
        thread.stop()

    async def states(pool: asyncpg.Pool) -> dict[UUID, tuple[str, str | None]]:
        rows = await pool.fetch("SELECT id, state, result::text AS r FROM "
                                "nasiko_queue.nasiko_queue_jobs")
        return {r["id"]: (r["state"], r["r"]) for r in rows}

    found = on_pool(dsn, states)
    assert found == {inflight: ("completed", '{"url": "thumb-inflight", "width": 64}'),
                     later: ("available", None)}


def test_worker_thread_that_cannot_start_says_why(empty_dsn: str) -> None:
    """An unmigrated database: start raises the database's own error (it was a
    RuntimeError whose cause was an exception group, which `except
    asyncpg.UndefinedTableError` could not catch; found by a bug hunt)."""
    before = threading.active_count()
    with pytest.raises(asyncpg.UndefinedTableError):
        nq.start_worker_thread(empty_dsn, resize_executors(), config=FAST)
    assert threading.active_count() == before


def test_worker_thread_hard_stop_past_its_timeout_puts_the_job_back(dsn: str) -> None:
    """A job that never ends: the graceful stop's timeout passes (0 s here), the
    stop turns hard, and the job is available again at once, its attempt counted."""
    started = threading.Event()
    executors = Executors()

    @executors.register(Resize)
    async def hang(_ctx: PlainJobContext[Resize]) -> None:
        started.set()
        await trio.sleep_forever()

    thread = nq.start_worker_thread(dsn, executors, config=FAST)
    try:
        job_id = on_pool(dsn, lambda pool: aio.enqueue(pool, Resize(url="hang")))
        assert started.wait(TEST_DEADLINE)
    finally:
        thread.stop(timeout=0)
    assert not thread.running

    async def row(pool: asyncpg.Pool) -> tuple[str, int]:
        found = await pool.fetchrow("SELECT state, attempt FROM nasiko_queue.nasiko_queue_jobs "
                                    "WHERE id = $1", job_id)
        return found["state"], found["attempt"]

    assert on_pool(dsn, row) == ("available", 1)


def test_fastapi_app_serves_while_jobs_run_and_stops_gracefully(dsn: str) -> None:
    """The worker thread in a FastAPI app's lifespan: requests are answered while a
    job runs; the app's shutdown with the job in flight lets it finish (completed,
    its result stored), and nothing is lost."""
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    started, release, stopping = threading.Event(), threading.Event(), threading.Event()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        worker = await asyncio.to_thread(nq.start_worker_thread, dsn,
                                         resize_executors(started, release), config=FAST)
        try:
            async with asyncpg.create_pool(dsn, min_size=1, max_size=2) as app.state.pool:
                yield
        finally:
            await asyncio.to_thread(worker.request_stop)
            stopping.set()  # asked while the job still runs: it cannot end before release
            await asyncio.to_thread(worker.stop, timeout=TEST_DEADLINE)

    app = FastAPI(lifespan=lifespan)

    @app.post("/resize")
    async def create(url: str) -> dict[str, str]:
        assert type(asyncio.get_running_loop()).__module__.startswith("asyncio")
        return {"job": str(await aio.enqueue(app.state.pool, Resize(url=url)))}

    @app.get("/count")
    async def count() -> dict[str, int]:
        jobs: int = await app.state.pool.fetchval(
            "SELECT count(*) FROM nasiko_queue.nasiko_queue_jobs")
        return {"jobs": jobs}

    with TestClient(app, backend_options=PLAIN_ASYNCIO) as client:
        job_id = UUID(client.post("/resize", params={"url": "slow"}).json()["job"])
        assert started.wait(TEST_DEADLINE)  # the job runs ...
        assert client.get("/count").json() == {"jobs": 1}  # ... and requests are served
        # The job may end once the shutdown has asked the worker to stop.
        releaser = threading.Thread(target=lambda: stopping.wait(TEST_DEADLINE)
                                    and release.set())
        releaser.start()
    releaser.join()
    assert stopping.is_set()
    # Out of the block: the lifespan ended, so the worker thread has stopped.

    async def row(pool: asyncpg.Pool) -> tuple[str, str]:
        found = await pool.fetchrow("SELECT state, result::text AS r FROM "
                                    "nasiko_queue.nasiko_queue_jobs "
                                    "WHERE id = $1", job_id)
        return found["state"], found["r"]

    assert on_pool(dsn, row) == ("completed", '{"url": "thumb-slow", "width": 64}')


#: Every other client session of the test's database, ended by the server (as
#: a restart, a fail-over or an idle-connection reaper would end them).
TERMINATE_OTHERS = """
SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity
WHERE datname = current_database() AND pid <> pg_backend_pid()
  AND backend_type = 'client backend'
"""


@pytest.mark.parametrize("given", ["pool", "connection"])
def test_a_result_wait_whose_connection_drops_does_not_hang(dsn: str, given: str) -> None:
    """
    The session LISTENing for a job's end is terminated by the server while the
    job runs. Given a pool, the wait goes on with another connection and returns
    the result once the job completes; given a connection, it raises
    `ConnectionError` at once. Before, it waited for a NOTIFY that could never
    come: for ever without a timeout.
    """

    async def main(pool: asyncpg.Pool) -> None:
        job_id = await aio.enqueue(pool, Resize(url="r"))
        async with contextlib.AsyncExitStack() as stack:
            if given == "pool":
                waiting = asyncio.create_task(
                    aio.result(pool, job_id, Thumbnail, timeout=TEST_DEADLINE))
            else:
                own = await stack.enter_async_context(pool.acquire())
                waiting = asyncio.create_task(
                    aio.result(own, job_id, Thumbnail, timeout=TEST_DEADLINE))
            async with asyncio.timeout(TEST_DEADLINE):
                # Until the wait is recorded: its LISTEN is up.
                while not await pool.fetchval(  # noqa: ASYNC110
                        "SELECT count(*) FROM nasiko_queue.nasiko_queue_result_waits"):
                    await asyncio.sleep(0.005)
                async with pool.acquire() as killer:
                    assert await killer.fetchval(TERMINATE_OTHERS) >= 1
                    if given == "connection":
                        with pytest.raises(ConnectionError, match="closed while waiting"):
                            await waiting
                        return
                    await killer.execute(
                        "UPDATE nasiko_queue.nasiko_queue_jobs SET state = 'completed', "
                        "finished_at = now(), "
                        "result = '{\"url\": \"r\", \"width\": 7}' WHERE id = $1", job_id)
                assert await waiting == Thumbnail(url="r", width=7)

    on_pool(dsn, main)


def test_a_result_wait_on_a_pool_closed_under_it_says_so(dsn: str) -> None:
    """The application closes its pool while a wait runs on it: the wait raises
    `ConnectionError` at once instead of trying the closed pool again for ever
    (found by review: with `timeout=None` it never returned)."""

    async def main() -> None:
        pool = await asyncpg.create_pool(dsn, min_size=1, max_size=2)
        job_id = await aio.enqueue(pool, Resize(url="r"))
        waiting = asyncio.create_task(aio.result(pool, job_id))
        async with asyncio.timeout(TEST_DEADLINE):
            while not await pool.fetchval(  # noqa: ASYNC110
                    "SELECT count(*) FROM nasiko_queue.nasiko_queue_result_waits"):
                await asyncio.sleep(0.005)
            pool.terminate()
            with pytest.raises(ConnectionError, match="closed while waiting"):
                await waiting

    run_asyncio(main())


def test_a_result_wait_on_a_connection_outlasts_a_long_held_row_lock(
    dsn: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """
    Another transaction holds the job's row (it cancels the job, then does slow
    work before it commits) for longer than the wait's read may take
    (`RESULT_POLL`). The read's timeout used to be taken for a peer gone without
    a word: on a connection, `ConnectionError`, the caller's timeout not over
    and the connection healthy. A trivial query now tells the two apart: the
    connection answers, so the wait reads again, and ends with the cancel.
    """
    monkeypatch.setattr(aio, "RESULT_POLL", 0.2)

    async def main(pool: asyncpg.Pool) -> None:
        job_id = await aio.enqueue(pool, Resize(url="r"), delay=3600)
        pinged = asyncio.Event()

        def logged(record: Any) -> None:
            if record.query == Q.health_ping:
                pinged.set()

        async with pool.acquire() as holder, pool.acquire() as own:
            own.add_query_logger(logged)
            async with holder.transaction():
                assert await aio.cancel(holder, job_id) == "cancelled"
                waiting = asyncio.create_task(aio.result(own, job_id, timeout=TEST_DEADLINE))
                ping = asyncio.create_task(pinged.wait())
                # A read timed out on the lock, and the connection answered: the
                # wait goes on (before the fix, it ended with ConnectionError).
                await asyncio.wait([ping, waiting], timeout=TEST_DEADLINE,
                                   return_when=asyncio.FIRST_COMPLETED)
                assert ping.done()
                assert not waiting.done(), waiting.exception()
            with pytest.raises(nq.JobFailed) as failed:
                async with asyncio.timeout(TEST_DEADLINE):
                    await waiting
            assert failed.value.state == "cancelled"

    on_pool(dsn, main)
