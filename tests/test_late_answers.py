"""
Answers that come late (issue #9): a slow network or a loaded server must not
strand jobs, and `cleanup_timeout` is a real bound on each shielded step.

The worker talks to the real server through `netproxy.Proxy`, which holds the
server's replies for a while (the server does the work and commits; the answer
is what is late) or freezes connections outright. Nothing here ages rows or
runs a sweep: a job stranded `in_progress` would stay there, and the test fails.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import attrs
import pytest
import trio

from nasiko_queue import Database, JobContext, Queue, Worker, open_database
from nasiko_queue.testing import enqueue_with_target

from .conftest import FAST, MASTER_KEY
from .helpers import LogEvent, executors_for_all, job_row, succeed
from .netproxy import Proxy

#: The bound under test, and a reply delay well past it.
BOUND = 0.5
LATE = 1.5

#: No LISTEN (its connection would go through the proxy too) and no poll: the
#: worker is woken by hand, so that it does what the test says and nothing else.
CONFIG = attrs.evolve(FAST, cleanup_timeout=BOUND, listen=False, poll_interval=3600.0)


@asynccontextmanager
async def _proxied(dsn: str) -> AsyncIterator[tuple[Proxy, Database]]:
    async with trio.open_nursery() as nursery:
        proxy = Proxy(dsn)
        await nursery.start(proxy.run)
        async with open_database(proxy.dsn()) as db:
            yield proxy, db
        nursery.cancel_scope.cancel()


async def _wait(worker: Worker, done: int) -> None:
    with trio.fail_after(20):
        await worker.wait_for(lambda stats: stats.done >= done)


@pytest.mark.parametrize("prefetch", [0, 3])
async def test_a_claim_whose_answer_comes_late_is_given_back_and_each_job_runs_once(
    dsn: str, queue: Queue, prefetch: int
) -> None:
    """The claim commits on the server; its answer arrives after `cleanup_timeout`.
    What it took (up to concurrency + prefetch jobs) goes back to pending with the
    attempts restored, and every job then runs once, at attempt 1, without a sweep."""
    direct = Queue(queue.db, config=attrs.evolve(CONFIG, notify_channel=None),
                   secrets=MASTER_KEY)
    runs: list[tuple[Any, int]] = []

    async def run(ctx: JobContext[Any]) -> None:
        runs.append((ctx.job_id, ctx.attempt))
        await succeed(ctx)

    async with _proxied(dsn) as (proxy, db):
        config = attrs.evolve(CONFIG, prefetch=prefetch)
        worker = Worker(Queue(db, config=config, secrets=MASTER_KEY), executors_for_all(run))
        async with trio.open_nursery() as nursery:
            await nursery.start(worker.run)
            await worker.drain_once()  # an empty drain: the claim's connection is open
            jobs = [await enqueue_with_target(direct, "Upload") for _ in range(4)]
            proxy.delay_replies(LATE)
            worker.wake()
            with trio.fail_after(20):
                await worker.wait_for(lambda stats: stats.claim_errors >= 1)
            proxy.restore()
            await _wait(worker, len(jobs))
            worker.stop()
    rows = [await job_row(queue.db, j.job_id) for j in jobs]
    assert [(r or {}).get("status") for r in rows] == ["done"] * 4
    assert [(r or {}).get("attempt") for r in rows] == [1] * 4
    assert sorted(runs, key=str) == sorted(((j.job_id, 1) for j in jobs), key=str)
    assert worker.stats.lost_claims >= 1


async def test_a_finish_whose_answer_comes_late_gives_back_what_it_claimed(
    dsn: str, queue: Queue
) -> None:
    """The statement that records a finish also claims the next job. Its answer
    comes late: the finish is sent again (it is guarded, so it lands once), and the
    job the first try claimed goes back and runs once, at attempt 1."""
    direct = Queue(queue.db, config=attrs.evolve(CONFIG, notify_channel=None),
                   secrets=MASTER_KEY)
    warm_up = await enqueue_with_target(direct, "Upload")
    release = trio.Event()
    first_built = trio.Event()
    runs: list[tuple[Any, int]] = []

    async def run(ctx: JobContext[Any]) -> None:
        runs.append((ctx.job_id, ctx.attempt))
        await succeed(ctx)
        if ctx.job_id != warm_up.job_id and not first_built.is_set():
            first_built.set()
            await release.wait()

    async with _proxied(dsn) as (proxy, db):
        worker = Worker(Queue(db, config=CONFIG, secrets=MASTER_KEY), executors_for_all(run))
        with LogEvent("finish update failed") as late:
            async with trio.open_nursery() as nursery:
                await nursery.start(worker.run)
                # One job first, so that the finish statement is prepared on the
                # connection: the late answer below is the statement's own, not
                # that of its preparation.
                worker.wake()
                await _wait(worker, 1)
                first = await enqueue_with_target(direct, "Upload")
                second = await enqueue_with_target(direct, "Upload")
                worker.wake()
                with trio.fail_after(20):
                    await first_built.wait()
                proxy.delay_replies(LATE)
                release.set()
                with trio.fail_after(20):
                    await late.event.wait()
                proxy.restore()
                await _wait(worker, 3)
                worker.stop()
    rows = [await job_row(queue.db, j.job_id) for j in (first, second)]
    assert [((r or {}).get("status"), (r or {}).get("attempt")) for r in rows] == [
        ("done", 1), ("done", 1)]
    assert runs[1:] == [(first.job_id, 1), (second.job_id, 1)]
    assert worker.stats.lost_claims == 1


async def test_a_hard_stop_is_bounded_when_the_server_stops_answering(
    dsn: str, queue: Queue
) -> None:
    """A hard stop while the server answers nothing at all: putting the running job
    back is one shielded step, bounded by `cleanup_timeout`, and the stop (with the
    pool's close, also bounded) takes no longer than the documented worst case.
    Cancelling a trio-asyncio call used to wait for asyncpg's own timeouts (9 s
    with a 1 s bound)."""
    started = trio.Event()

    async def hang(ctx: JobContext[Any]) -> None:
        started.set()
        await trio.sleep_forever()

    direct = Queue(queue.db, config=attrs.evolve(CONFIG, notify_channel=None),
                   secrets=MASTER_KEY)
    job = await enqueue_with_target(direct, "Upload")
    async with trio.open_nursery() as outer:
        proxy = Proxy(dsn)
        await outer.start(proxy.run)
        # The worst case of a hard stop (README, "Stopping"): the running jobs'
        # releases beside the last try of a statement under way (four bounds),
        # the last finishes (two), the give-back of the buffer (three, with its
        # wake), one lost claim's resolution (two), the worker row's removal
        # (one); then the four pools' close, one each.
        worst = 16 * BOUND
        with trio.fail_after(worst + 1.0):  # + slack for a loaded machine
            async with open_database(attrs.evolve(
                    _config_of(proxy), cleanup_timeout=BOUND)) as db:
                worker = Worker(Queue(db, config=CONFIG, secrets=MASTER_KEY),
                                executors_for_all(hang))
                async with trio.open_nursery() as nursery:
                    await nursery.start(worker.run)
                    worker.wake()
                    with trio.fail_after(20):
                        await started.wait()
                    # Nothing answers, new connections included: a release that
                    # opened a fresh connection must not reach the server either.
                    proxy.partition()
                    stop_at = trio.current_time()
                    nursery.cancel_scope.cancel()
            took = trio.current_time() - stop_at
        outer.cancel_scope.cancel()
    print(f"hard stop with no answers took {took:.2f}s (bound {BOUND}s)")
    assert took <= worst + 1.0
    row = await job_row(queue.db, job.job_id)
    assert row is not None
    assert row["status"] == "in_progress"  # the server never heard: left for the rescue


def _config_of(proxy: Proxy) -> Any:
    from nasiko_queue import DatabaseConfig

    return DatabaseConfig(dsn=proxy.dsn())
