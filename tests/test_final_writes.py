"""
Final writes cannot wedge a slot (issue 20, item 4).

A plain job's outcome that the database refuses on its merits (a NUL in the
exception's message, a backoff no interval can hold, a trigger of the
application's) is written as a minimal one, else the job is discarded with
"could not record the outcome: ...", else logged and left; in every case the
slot goes on: the next job of the queue runs and a graceful stop returns.
"""

from __future__ import annotations

import math
import uuid
from typing import Any, ClassVar

import asyncpg
import attrs
import pytest
import trio

from nasiko_queue import (
    Executors,
    JobArgs,
    JobOptions,
    PlainJobContext,
    Queue,
    Worker,
    job_errors,
)
from nasiko_queue.builds.store import PgJobStore
from nasiko_queue.config import QueueConfig
from nasiko_queue.engine.contracts import LostClaim
from nasiko_queue.engine.retry import RetryPolicy, one_line
from nasiko_queue.errors import FinalWriteRefused
from nasiko_queue.job_errors import describe, one_line_error, storable
from nasiko_queue.plain.executor import MAX_BACKOFF, clamp_backoff
from nasiko_queue.testing import KINDS

from .helpers import TEST_DEADLINE, LogEvent, executors_for_all, running, succeed


@attrs.frozen(kw_only=True)
class Flaky(JobArgs):
    kind: ClassVar[str] = "final_write_flaky"
    options: ClassVar[JobOptions] = JobOptions(queue="fw", max_attempts=2)
    n: int
    message: str = ""


async def _row(queue: Queue, job_id: Any) -> Any:
    return await queue.db.fetchrow(
        "SELECT state, attempt, error_msg, extract(epoch FROM run_at - now()) AS wait "
        "FROM nasiko_queue_jobs WHERE id = $1", job_id)


async def _first_crashes_then_next_runs(queue: Queue, backoff: Any, message: str,
                                        max_attempts: int = 2) -> tuple[Any, list[int]]:
    """Job 1 raises `message`; job 2 (same queue, one slot, runs after it) returns.
    Returns job 1's row once job 2 completed and the worker stopped gracefully."""
    executors = Executors()
    ran: list[int] = []

    @executors.register(Flaky, backoff=backoff)
    async def run(ctx: PlainJobContext[Flaky]) -> None:
        ran.append(ctx.payload.n)
        if ctx.payload.message:  # a payload cannot hold a NUL, an exception can
            raise ValueError(ctx.payload.message.replace("<NUL>", "\x00")
                             .replace("<SURROGATE>", "\ud800"))

    first = await queue.enqueue(Flaky(n=1, message=message),
                                options=JobOptions(queue="fw", priority=0,
                                                    max_attempts=max_attempts))
    await queue.enqueue(Flaky(n=2), options=JobOptions(queue="fw", priority=1))
    async with running(queue, executors) as worker:
        with trio.fail_after(TEST_DEADLINE):
            await worker.wait_for(lambda s: s.done >= 1)
    # `running` stopped the worker gracefully, within TEST_DEADLINE.
    return await _row(queue, first), ran


async def test_a_nul_in_the_message_is_stored_readable_and_the_next_job_runs(
    queue: Queue,
) -> None:
    row, ran = await _first_crashes_then_next_runs(
        queue, lambda _a: 0.0, "bad <NUL> byte <SURROGATE> here", max_attempts=1)
    assert ran == [1, 2]
    assert row["state"] == "discarded"
    assert row["error_msg"] == "ValueError: bad \\x00 byte \ufffd here"
    [job_id] = [r["id"] for r in await queue.db.fetch(
        "SELECT id FROM nasiko_queue_jobs WHERE payload ->> 'n' = '1'")]
    [kept] = await job_errors(queue.db, job_id)
    assert kept.message == "bad \\x00 byte \ufffd here"
    assert "\x00" not in kept.traceback


@pytest.mark.parametrize(("backoff", "wait"), [
    (math.inf, MAX_BACKOFF),
    (1e300, MAX_BACKOFF),
    (math.nan, 60.0),
])
async def test_a_backoff_no_interval_holds_is_clamped_and_the_next_job_runs(
    queue: Queue, backoff: float, wait: float,
) -> None:
    row, ran = await _first_crashes_then_next_runs(queue, lambda _a: backoff, "boom")
    assert ran == [1, 2]
    assert (row["state"], row["attempt"], row["error_msg"]) == ("available", 1,
                                                                "ValueError: boom")
    assert wait * 0.99 < row["wait"] <= wait


async def test_a_negative_backoff_means_at_once(queue: Queue) -> None:
    row, ran = await _first_crashes_then_next_runs(queue, lambda _a: -5.0, "boom")
    assert ran == [1, 1, 2]  # retried at once, then discarded on its last attempt
    assert (row["state"], row["attempt"]) == ("discarded", 2)


_REFUSE = """
CREATE FUNCTION refuse_outcome() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF OLD.payload ->> 'n' = '1' AND NEW.state <> 'running'
       AND coalesce(NEW.error_msg, '') NOT LIKE {allowed} THEN
        RAISE EXCEPTION 'refused by the application';
    END IF;
    RETURN NEW;
END $$;
CREATE TRIGGER refuse_outcome BEFORE UPDATE ON nasiko_queue_jobs
FOR EACH ROW EXECUTE FUNCTION refuse_outcome();
"""


async def test_a_refused_outcome_discards_the_job_with_a_clear_error(queue: Queue) -> None:
    # The application refuses any outcome of job 1 but a discard that says why.
    await queue.db.execute(_REFUSE.format(allowed="'could not record the outcome:%'"))
    with LogEvent("could not record the outcome") as logged:
        row, ran = await _first_crashes_then_next_runs(queue, lambda _a: 1.0, "boom")
    assert ran == [1, 2]
    assert row["state"] == "discarded"
    assert row["error_msg"].startswith("could not record the outcome: ")
    assert "refused by the application" in row["error_msg"]
    assert logged.count >= 1


async def test_an_outcome_refused_every_way_leaves_the_row_and_the_slot_goes_on(
    queue: Queue,
) -> None:
    await queue.db.execute(_REFUSE.format(allowed="'never'"))
    with LogEvent("could not record the outcome") as logged:
        row, ran = await _first_crashes_then_next_runs(queue, lambda _a: 1.0, "boom")
    assert ran == [1, 2]
    assert row["state"] == "running"  # left for the rescue once this worker stops
    assert logged.count >= 1
    # The graceful stop declared the worker dead (it still held a job): the
    # rescue gives it back.
    assert await queue.db.fetchval(
        "SELECT count(*) FROM nasiko_queue_workers WHERE dead_at IS NOT NULL") == 1


# -- the pieces ------------------------------------------------------------------------


def test_storable_cleans_what_postgresql_text_refuses() -> None:
    assert storable("a\x00b") == "a\\x00b"
    assert storable("a\ud83dz") == "a\ufffdz"
    assert storable("plain – text ✓") == "plain – text ✓"
    err = describe(ValueError("x\x00y"), attempt=1, reason="crash")
    assert "\x00" not in err.message + err.traceback + err.error_type
    assert "\x00" not in one_line_error(attrs.evolve(err, message="m\x00"))
    assert "\x00" not in one_line(ValueError("v\x00"))


def test_the_backoff_is_clamped_to_what_an_interval_holds() -> None:
    assert clamp_backoff(5.0) == 5.0
    assert clamp_backoff(-1.0) == 0.0
    assert clamp_backoff(math.inf) == MAX_BACKOFF
    assert clamp_backoff(1e300) == MAX_BACKOFF
    assert clamp_backoff(-math.inf) == 0.0
    assert clamp_backoff(math.nan) is None


async def test_the_retry_policy_gives_up_on_a_refusal_and_falls_back_in_order() -> None:
    policy = RetryPolicy(QueueConfig(retry_initial_delay=0.001, retry_max_delay=0.001,
                                     terminalize_tries=2))
    tries: list[str] = []

    def refused(name: str) -> Any:
        async def op() -> str:
            tries.append(name)
            raise ValueError(f"{name} refused")
        return op

    async def lands() -> str:
        tries.append("last")
        return "written"

    with trio.fail_after(TEST_DEADLINE):
        assert await policy.final("x", refused("a"),
                                  fallbacks=[refused("b"), lands]) == "written"
        assert tries == ["a", "a", "b", "b", "last"]
        with pytest.raises(FinalWriteRefused) as raised:
            await policy.final("x", refused("c"))
    assert isinstance(raised.value.__cause__, ValueError)


class RefusesResolutions(PgJobStore):
    """The real store, whose resolution of a lost claim is refused on its merits
    (as code and SQL out of step would be, or a trigger)."""

    async def resolve_lost_claim(self, claim: Any) -> int:
        raise asyncpg.InterfaceError("the server expects 1 argument for this query, "
                                     "2 were passed (injected)")


async def test_a_lost_claim_whose_resolution_is_refused_is_logged_not_raised(
    queue: Queue,
) -> None:
    """A resolution refused `terminalize_tries` times raised `FinalWriteRefused`
    out of the producer, through the worker's nursery, to the application. It
    is logged instead; the claim's jobs (if any) are the rescue's."""
    config = attrs.evolve(queue.config, terminalize_tries=2, retry_initial_delay=0.01)
    kinds = frozenset(KINDS)
    store = RefusesResolutions(queue.db, config, runnable_kinds=kinds, known_kinds=kinds)
    worker = Worker(Queue(queue.db, config=config), executors_for_all(succeed), store=store)
    [lane] = worker.lanes
    with LogEvent("could not be resolved") as logged, trio.fail_after(TEST_DEADLINE):
        await lane.producer.resolve(LostClaim(uuid.uuid4(), None))
    assert logged.count == 1
    assert lane.state.resolving == 0
