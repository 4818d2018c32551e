"""The Hypothesis state machine on plain jobs (issue #11): the engine against
`PlainModel`. The mutants it must find are in test_plain_statemachine_mutants.py."""

from __future__ import annotations

import pytest

from nasiko_queue import Queue, Unique
from nasiko_queue.plain.store import PlainJobStore
from nasiko_queue.testing.plain_machine import run_plain_state_machine

from .test_plain_jobs import Step


async def test_plain_jobs_match_the_model(dsn: str) -> None:
    await run_plain_state_machine(dsn)


# -- found while building the machine ------------------------------------------------
#
# A unique key's states could be any non-empty set; the unique index holds a row
# only while it is in its own states. With states that leave out one a job moves
# back into by itself (here "running" -> "available"), a second job could take
# the key while the first ran, and the first one's retry (or rescue) then met the
# index and could never be written: the slot retried it forever, the job stayed
# `running`; the rescue failed for every dead worker. `Unique` now refuses such
# states (River requires its waiting and running states likewise).


def test_unique_states_must_hold_waiting_and_running() -> None:
    for states in ({"available"}, {"running"}, {"available", "completed"}):
        with pytest.raises(ValueError, match="must include 'available' and 'running'"):
            Unique("k", states=states)
    assert Unique("k", states={"available", "running", "completed"}).states == {
        "available", "running", "completed"}


# A cancel that reaches a running job before the worker's heartbeat delivers it
# ("cancelling"), when the run then crashes: the rescue ended such a job
# `cancelled`, but the retry made it available again, cancel_requested still
# set, and it ran again; the hard stop's reset did the same. Both now end it
# `cancelled`, as the rescue does.


async def test_a_crash_after_a_cancel_request_ends_the_job_cancelled(queue: Queue) -> None:
    job_id = await queue.enqueue(Step(n=1))
    store = PlainJobStore(queue.db, queue.config, "default", lambda: None)
    [job] = await store.claim(1)
    assert await queue.cancel(job_id) == "cancelling"
    assert await store.retry(job, 60.0, "boom") == "cancelled"


async def test_a_hard_stop_after_a_cancel_request_ends_the_job_cancelled(queue: Queue) -> None:
    job_id = await queue.enqueue(Step(n=1))
    store = PlainJobStore(queue.db, queue.config, "default", lambda: None)
    [job] = await store.claim(1)
    assert await queue.cancel(job_id) == "cancelling"
    assert await store.reset(job)
    row = await queue.db.fetchrow("SELECT state, error_msg, finished_at FROM nasiko_queue_jobs "
                                  "WHERE id = $1", job_id)
    assert (row["state"], row["error_msg"]) == ("cancelled", "cancelled")
    assert row["finished_at"] is not None
