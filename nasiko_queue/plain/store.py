"""
Every transition of a plain job's row (`nasiko_queue_jobs`), for one queue.

The worker runs one lane per queue (see `engine/lane.py`); a lane's producer,
completer and slots talk to a `PlainJobStore` bound to its queue exactly as the
build lane talks to `builds.store.PgJobStore`: the same claim tokens, the same
bounds on each statement. Every write to a claimed job is guarded by the claim
itself: its token (`id`, `claim_token`, `state = 'running'`), which every claim
sets anew and the rescue, the sweep, a give-back and the dead-letter retry
clear. The attempt is no guard: the dead-letter retry counts attempts from 0
again, so a frozen worker's run and the run after the retry can share one.
What differs is what an outcome means: a return completes the job, a
crash makes it available again after its backoff, or discards it when that was
its last attempt.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from uuid import UUID

import asyncpg

from ..config import QueueConfig
from ..db.claims import end_claims_backend, fetch_claiming, without_flush_wait
from ..db.database import Database
from ..db.statements import Q
from ..engine.contracts import (
    ClaimedJob,
    Finishing,
    JobResult,
    JobStatus,
    LostClaim,
    Starting,
)
from ..engine.listener import due_payload
from ..engine.retry import one_line
from ..job_errors import JobError, storable
from .limits import LIMIT_RECHECK

log = logging.getLogger("nasiko_queue.jobs")

#: States a plain job ends in (`nasiko_queue_jobs.state`).
DISCARDED = "discarded"
CANCELLED = "cancelled"


def _claimed(row: asyncpg.Record, queue: str, worker: UUID | None, token: UUID) -> ClaimedJob:
    due: datetime = row["created_at"]  # its run_at
    if due.tzinfo is None:
        # -infinity, which asyncpg reads as a naive datetime.min (a row written
        # by SQL): aware, so that it orders and compares with the others.
        due = due.replace(tzinfo=UTC)
    return ClaimedJob(id=row["id"], agent_id=None, connector_id=None, owner_id=None,
                      payload=row["payload"], old_attempt=row["old_attempt"],
                      created_at=due, kind=row["kind"],
                      max_attempts=row["max_attempts"], priority=row["priority"], queue=queue,
                      claimed_by=worker, claim_token=token)


class PlainJobStore:
    """
    The lane store of one queue of plain jobs.

    Args:
        db: the connection pool.
        config: the payload bound, the NOTIFY channel and `cleanup_timeout`.
        queue: the queue this store claims from.
        worker_id: whose claims these are (`claimed_by`): the worker's id once
            it registered (None before, or for a tool that runs no worker).
    """

    def __init__(self, db: Database, config: QueueConfig, queue: str,
                 worker_id: Callable[[], UUID | None]) -> None:
        self._db = db
        self._config = config
        self.queue = queue
        self._worker_id = worker_id
        self._bound = config.cleanup_timeout
        self._claim_sql = (Q.plain_claim if config.claim_synchronous_commit
                           else without_flush_wait(Q.plain_claim))

    async def claim(self, limit: int) -> list[ClaimedJob]:
        """Claim up to `limit` due jobs of the queue, by priority then due time."""
        token, worker = uuid.uuid4(), self._worker_id()
        args = (self.queue, limit, token, worker,
                self._config.max_payload_bytes, list[UUID](), list[UUID]())
        rows = await fetch_claiming(self._db, self._claim_sql, args, token=token, claims=True,
                                    bound=self._bound)
        jobs = [_claimed(row, self.queue, worker, token) for row in rows]
        jobs.sort(key=lambda j: j.order)
        return jobs

    async def finish_many_and_claim(
        self, finishing: Sequence[Finishing], limit: int, *, starts: Sequence[Starting] = ()
    ) -> tuple[dict[UUID, JobStatus | None], list[ClaimedJob]]:
        """
        Complete each job of `finishing` (its executor returned) and claim up to
        `limit`, in one round trip. A completed job reports `JobStatus.DONE`.
        Plain jobs have no build row: nothing is started; what an executor
        returned (`JobResult`) is written as the job's result.
        """
        token, worker = uuid.uuid4(), self._worker_id()
        ids, tokens = [j.id for j, _, _ in finishing], [j.claim_token for j, _, _ in finishing]
        args = (ids, tokens, self.queue, limit, token, worker,
                self._config.max_payload_bytes, ids, tokens,
                [r.json if isinstance(r, JobResult) else None for _, _, r in finishing])
        rows = await fetch_claiming(self._db, Q.plain_finish_many_and_claim, args, token=token,
                                    claims=limit > 0, bound=self._bound)
        statuses: dict[UUID, JobStatus | None] = {}
        claimed: list[ClaimedJob] = []
        for row in rows:
            if row["finished_id"] is not None:
                done = row["finished_status"] == "completed"
                statuses[row["finished_id"]] = JobStatus.DONE if done else None
            else:
                claimed.append(_claimed(row, self.queue, worker, token))
        claimed.sort(key=lambda j: j.order)
        return statuses, claimed

    async def resolve_lost_claim(self, claim: LostClaim) -> int:
        """As `PgJobStore.resolve_lost_claim`: end the server process, then give back."""
        async def resolve(conn: asyncpg.Connection) -> int:
            await end_claims_backend(conn, claim, self._bound)
            return int(await conn.fetchval(Q.plain_unclaim_lost, claim.token,
                                           timeout=self._bound))

        given: int = await self._db.run_bounded(resolve, bound=self._bound)
        if given:
            log.warning("gave back %d job(s) of queue %r taken by a claim whose answer was "
                        "lost", given, self.queue)
        return given

    async def unclaim(self, jobs: list[ClaimedJob]) -> int:
        """Claimed jobs that never started: available again, attempts restored."""
        if not jobs:
            return 0
        args = ([j.id for j in jobs], [j.claim_token for j in jobs])
        status = await self._db.run_bounded(
            lambda conn: conn.execute(Q.plain_unclaim, *args, timeout=self._bound),
            bound=self._bound, generic=True)
        given = int(status.split()[-1])
        try:  # the give-back has committed: a lost wake must not make it run again
            await self._notify()
        except Exception as exc:
            log.warning("gave back %d job(s) of queue %r, but could not wake the other "
                        "workers (%s); their poll will", given, self.queue, one_line(exc))
        return given

    async def retry(self, job: ClaimedJob, delay: float, error: str) -> str | None:
        """
        A crashed run: available again in `delay` seconds, or discarded when it
        was the job's last attempt. Returns the state written; None when the
        job is no longer ours.
        """
        args = (job.id, job.claim_token, delay, storable(error))
        state: str | None = await self._db.run_bounded(
            lambda conn: conn.fetchval(Q.plain_retry, *args, timeout=self._bound),
            bound=self._bound)
        return state

    async def defer(self, job: ClaimedJob, delay: float, error: str) -> str | None:
        """
        A job this worker has no executor for: available again in `delay`
        seconds, its attempt not counted (it never ran); cancelled when a cancel
        was asked for. Returns the state written; None when no longer ours.
        """
        args = (job.id, job.claim_token, delay, storable(error))
        state: str | None = await self._db.run_bounded(
            lambda conn: conn.fetchval(Q.plain_defer, *args, timeout=self._bound),
            bound=self._bound)
        return state

    async def end(self, job: ClaimedJob, state: str, error: str | None) -> str | None:
        """
        End the run for good: `DISCARDED` or `CANCELLED`. Returns the state
        written: `CANCELLED` for a discard of a job whose cancel was asked for
        meanwhile (the cancel wins, as for a crash); None if no longer ours.
        """
        args = (job.id, job.claim_token, state, None if error is None else storable(error))
        written: str | None = await self._db.run_bounded(
            lambda conn: conn.fetchval(Q.plain_end, *args, timeout=self._bound),
            bound=self._bound)
        return written

    async def discard_unrecorded(self, job: ClaimedJob, why: str) -> bool:
        """A finish the database refused on its merits, alone too: discarded with
        `why` ("could not record the outcome: ..."), or cancelled if its cancel
        was asked for; False if no longer ours."""
        return await self.end(job, DISCARDED, why) is not None

    async def reset(self, job: ClaimedJob) -> bool:
        """A hard stop or the fence cut the run: available again, attempt counted."""
        status = await self._db.run_bounded(
            lambda conn: conn.execute(Q.plain_reset, job.id, job.claim_token,
                                      timeout=self._bound),
            bound=self._bound)
        if status.endswith(" 0"):
            return False
        await self._notify()
        return True

    async def record_error(self, job: ClaimedJob, error: JobError) -> None:
        """Keep a crashed attempt's error (`nasiko_queue_job_errors`)."""
        worker = self._worker_id()
        await self._db.run_bounded(
            lambda conn: conn.execute(Q.job_error_insert, job.id, error.attempt, worker,
                                      error.reason, storable(error.error_type),
                                      storable(error.message), storable(error.traceback),
                                      timeout=self._bound),
            bound=self._bound)

    async def next_due(self) -> float | None:
        """Seconds until the queue's next scheduled job is due; None: none is. For
        a limited queue, sooner when its limits hold back a due job (until its
        rate window allows a start, or `LIMIT_RECHECK` while its concurrency is
        full): the lane's drain loop wakes then, not at its next poll."""
        value = await self._db.run_bounded(
            lambda conn: conn.fetchval(Q.plain_next_due, self.queue, LIMIT_RECHECK,
                                       timeout=self._bound),
            bound=self._bound, generic=True)
        return None if value is None else max(0.0, float(value))

    async def _notify(self) -> None:
        channel = self._config.notify_channel
        if channel is not None:
            await self._db.run_bounded(
                lambda conn: conn.execute(Q.queue_notify, channel, timeout=self._bound),
                bound=self._bound)

    async def notify_due(self) -> None:
        """Tell the workers serving this queue that a job of it falls due later
        (a retry after its backoff): they read when, and wake then."""
        channel = self._config.notify_channel
        if channel is not None:
            payload = due_payload(self.queue)
            await self._db.run_bounded(
                lambda conn: conn.execute(Q.queue_notify_due, channel, payload,
                                          timeout=self._bound),
                bound=self._bound)
