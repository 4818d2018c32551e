"""
The worker's fetcher (the one task that claims and records finishes) at its
edges: hard stops that meet a slow executor or a failing finish, and
`drain_once` while a claim is still in flight. Each case was found by review
and failed before its fix.
"""

from __future__ import annotations

from typing import Any

import attrs
import trio

from nasiko_queue import Queue, Worker
from nasiko_queue.builds.store import PgJobStore
from nasiko_queue.testing import KINDS, enqueue_with_target, set_build_status

from .helpers import TEST_DEADLINE, executors_for_all, job_row, succeed

KINDS_SET = frozenset(KINDS)


def _with(queue: Queue, **changes: Any) -> Queue:
    return Queue(queue.db, config=attrs.evolve(queue.config, **changes))


async def test_a_hard_stop_records_the_outcome_of_an_executor_slow_to_stop(
    queue: Queue,
) -> None:
    """The build succeeded, then the executor spends longer than any cleanup bound
    in work it cannot interrupt (a shielded push, a thread) before it returns. The
    hard stop waits for it, as the nursery must, and its outcome is recorded: the
    sweep would otherwise run a finished build again in an hour."""
    slow = _with(queue, cleanup_timeout=0.2)
    built = trio.Event()

    async def build(ctx: Any) -> None:
        await set_build_status(ctx.db, ctx.payload, "success")
        built.set()
        with trio.CancelScope(shield=True):
            await trio.sleep(1.0)  # the outside world: a push that cannot be cut off

    worker = Worker(slow, executors_for_all(build))
    with trio.fail_after(TEST_DEADLINE):
        async with trio.open_nursery() as nursery:
            await nursery.start(worker.run)
            job = await enqueue_with_target(slow, "Upload")
            await built.wait()
            nursery.cancel_scope.cancel()
    row = await job_row(queue.db, job.job_id)
    assert row is not None
    assert (row["status"], row["attempt"]) == ("done", 1)
    assert worker.stats.done == 1


class SlowClaimReply(PgJobStore):
    """The real store; a claim that took rows answers late (a slow network)."""

    async def claim(self, limit: int) -> Any:
        got = await super().claim(limit)
        if got:
            await trio.sleep(0.3)
        return got


async def test_drain_once_waits_for_a_claim_still_in_flight(queue: Queue) -> None:
    """Two slots: the drain's two claims go out together; the one that finds
    nothing answers first and ends the drain, while the other, holding the job,
    is still on its way. drain_once must wait for it."""
    two = _with(queue, concurrency=2)
    store = SlowClaimReply(queue.db, two.config, runnable_kinds=KINDS_SET,
                           known_kinds=KINDS_SET)
    worker = Worker(two, executors_for_all(succeed), store=store)
    job = await enqueue_with_target(queue, "Upload")
    with trio.fail_after(TEST_DEADLINE):
        async with trio.open_nursery() as nursery:
            await nursery.start(worker.run)
            await worker.drain_once()
            row = await job_row(queue.db, job.job_id)
            worker.stop()
    assert row is not None
    assert row["status"] == "done"


class FailsFirstFinish(PgJobStore):
    """The real store; the first finish statement fails as if the connection dropped."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.failed = trio.Event()
        self.limits: list[int] = []

    async def finish_many_and_claim(self, finishing: Any, limit: int, **kw: Any) -> Any:
        self.limits.append(limit)
        if not self.failed.is_set():
            self.failed.set()
            raise ConnectionResetError("connection reset by peer")
        return await super().finish_many_and_claim(finishing, limit, **kw)


async def test_a_retried_finish_claims_nothing_so_a_hard_stop_orphans_no_job(
    queue: Queue,
) -> None:
    """A finish that failed is retried after a backoff; a hard stop during the
    backoff makes one last try, whose answer nobody reads. Were it to claim, the
    next job would sit in_progress, held by no one, until the sweep."""
    patient = _with(queue, retry_initial_delay=30.0, retry_max_delay=30.0)
    store = FailsFirstFinish(queue.db, patient.config, runnable_kinds=KINDS_SET,
                             known_kinds=KINDS_SET)
    worker = Worker(patient, executors_for_all(succeed), store=store)
    first = await enqueue_with_target(queue, "Upload")
    second = await enqueue_with_target(queue, "Upload")
    with trio.fail_after(TEST_DEADLINE):
        async with trio.open_nursery() as nursery:
            await nursery.start(worker.run)
            await store.failed.wait()  # the finish failed; the 30 s backoff begins
            nursery.cancel_scope.cancel()
    assert store.limits == [1, 0]  # the first try claimed for the slot; the last did not
    rows = [await job_row(queue.db, j.job_id) for j in (first, second)]
    assert [(r["status"], r["attempt"]) for r in rows if r] == [("done", 1), ("pending", 0)]
