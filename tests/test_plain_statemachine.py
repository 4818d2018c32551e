"""The Hypothesis state machine on plain jobs (issue #11): the engine against
`PlainModel`. The mutants it must find are in test_plain_statemachine_mutants.py."""

from __future__ import annotations

import uuid

import pytest

from nasiko_queue import Queue, Unique
from nasiko_queue._sql import Q
from nasiko_queue.jobs import PgJobStore, WorkerIdentity
from nasiko_queue.plain_jobs import PlainJobStore
from nasiko_queue.testing.plain_machine import AGE_PLAIN_CLAIMS, run_plain_state_machine

from .test_plain_jobs import Step


async def test_plain_jobs_match_the_model(dsn: str) -> None:
    await run_plain_state_machine(dsn)


# -- found while building the machine ------------------------------------------------
#
# A unique key's states may be any non-empty subset (`Unique`'s validator); the
# unique index holds a row only while it is in its own states. With states that
# leave out a state a job moves back into (here "running" -> "available"), a
# second job can take the key while the first runs, and the first one's
# transition back then violates the index: the retry (or the rescue) can never
# be written. In a worker the slot retries that final update forever, the job
# stays `running` and the slot is lost; in the rescue, the whole statement fails
# for every dead worker. The machine draws only states that hold both
# "available" and "running", so that it passes; these two tests fail until
# `Unique` refuses such states (River requires available, pending, running and
# scheduled) or the transitions are written so as to meet the key.


@pytest.mark.xfail(strict=True,
                   reason="unique states without 'running': the retry meets the index")
async def test_a_crash_retry_of_a_job_unique_only_while_waiting(queue: Queue) -> None:
    try:
        only_waiting = Unique("k", states={"available"})
    except ValueError:
        return  # refusing such states is one fix
    first = await queue.enqueue(Step(n=1), unique=only_waiting)
    store = PlainJobStore(queue.db, queue.config, "default", lambda: None)
    [job] = await store.claim(1)
    second = await queue.enqueue(Step(n=2), unique=only_waiting)
    assert second != first  # the key was free while the first ran
    assert await store.retry(job, 0.0, "boom") in ("available", "discarded")


@pytest.mark.xfail(strict=True,
                   reason="unique states without 'running': the rescue meets the index")
async def test_the_rescue_of_a_job_unique_only_while_waiting(queue: Queue) -> None:
    try:
        only_waiting = Unique("k", states={"available"})
    except ValueError:
        return
    dead = PgJobStore(queue.db, queue.config, runnable_kinds=frozenset(),
                      known_kinds=frozenset())
    identity = WorkerIdentity(id=uuid.uuid4(), host="test", pid=0, kinds=(Step.kind,))
    await dead.register_worker(identity)
    await queue.enqueue(Step(n=1), unique=only_waiting)
    store = PlainJobStore(queue.db, queue.config, "default", lambda: identity.id)
    [_job] = await store.claim(1)
    await queue.enqueue(Step(n=2), unique=only_waiting)
    await queue.db.execute(Q.testing_worker_expire, identity.id)
    await queue.db.execute(AGE_PLAIN_CLAIMS, identity.id)
    result = await dead.rescue()
    assert (result.rescued, result.failed) == (1, 0)


# A cancel that reaches a running job before the worker's heartbeat delivers it
# ("cancelling"), when the run then crashes: the rescue ends such a job
# `cancelled` (plain_rescue: WHEN j.cancel_requested THEN 'cancelled'), but the
# retry makes it available again, cancel_requested still set, and it runs again
# (its next run is stopped at that worker's next heartbeat, or completes). The
# hard stop's reset does the same. Fails until plain_retry and plain_reset treat
# a requested cancel as the rescue does (or the docs say a crash wins).


@pytest.mark.xfail(strict=True, reason="a crash after a cancel request retries the job")
async def test_a_crash_after_a_cancel_request_ends_the_job_cancelled(queue: Queue) -> None:
    job_id = await queue.enqueue(Step(n=1))
    store = PlainJobStore(queue.db, queue.config, "default", lambda: None)
    [job] = await store.claim(1)
    assert await queue.cancel(job_id) == "cancelling"
    assert await store.retry(job, 60.0, "boom") == "cancelled"
