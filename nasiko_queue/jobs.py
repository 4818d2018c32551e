"""
The job row and every transition of it: claim, finish, fail, reset, recover.

`PgJobStore` is the worker's whole view of the database. Each method is one
crossing of the trio/asyncio bridge and, where it writes more than one row,
one transaction. The worker loop talks only to the `JobStore` protocol, so its
timer logic can be tested against an in-memory fake on trio's mock clock.

Every write to a claimed job is guarded by the claim itself (`id`, `attempt`,
`status = 'in_progress'`): a job that the sweep has meanwhile handed to another
worker, or whose target was deleted, is left alone and the write reports False.
"""

from __future__ import annotations

import enum
import json
import logging
from datetime import datetime
from typing import Protocol
from uuid import UUID

import asyncpg
import attrs

from ._sql import Q
from .config import QueueConfig
from .database import Database
from .errors import is_transient
from .payloads import raw_build_id
from .terminalize import terminalize_target

log = logging.getLogger("nasiko_queue.jobs")

# The fixed strings a job's error_msg may hold (SPEC §5). Raw exception text goes
# to the log only, never into the row.
MAX_ATTEMPTS_EXCEEDED = "max attempts exceeded"
INVALID_PAYLOAD = "invalid job payload"
TARGET_DELETED = "target deleted"
JOB_PANICKED = "job panicked during execution"
BUILD_FAILED = "build or deploy step failed — see the relevant *_builds row for details"


class JobStatus(enum.StrEnum):
    """`build_jobs.status`; TEXT + CHECK in the schema."""

    PENDING = "pending"
    IN_PROGRESS = "in_progress"
    DONE = "done"
    FAILED = "failed"


@attrs.frozen(kw_only=True)
class ClaimedJob:
    """A job this worker has just claimed, as the claim returned it."""

    id: UUID
    agent_id: UUID | None
    connector_id: UUID | None
    owner_id: UUID
    #: The payload column as JSON text; parsed by the worker, not by the claim.
    payload: str = attrs.field(repr=False)
    #: `attempt` before this claim's increment (the original's `old_attempt`).
    old_attempt: int
    created_at: datetime
    #: The target agent has `deleted_at` set (the job must not run).
    target_soft_deleted: bool = False

    @property
    def attempt(self) -> int:
        """The row's attempt now: which run this is (1-based) and our claim token."""
        return self.old_attempt + 1

    @property
    def is_connector_job(self) -> bool:
        return self.connector_id is not None


@attrs.frozen
class RecoveryResult:
    """What one recovery sweep did."""

    #: Stuck jobs with no attempts left, now failed (their targets terminalized).
    failed: int
    #: Stuck jobs with attempts left, now pending again.
    reset: int


class JobStore(Protocol):
    """The worker's operations on the queue; see `PgJobStore` for the meaning of each."""

    async def claim(self, limit: int) -> list[ClaimedJob]: ...

    async def finish_many_and_claim(
        self, finishing: list[tuple[ClaimedJob, UUID]], limit: int
    ) -> tuple[dict[UUID, JobStatus | None], list[ClaimedJob]]: ...

    async def unclaim(self, jobs: list[ClaimedJob]) -> int: ...

    async def fail(
        self,
        job: ClaimedJob,
        message: str,
        *,
        own_build_id: UUID | None,
        terminalize: bool,
    ) -> bool: ...

    async def reset(self, job: ClaimedJob) -> bool: ...

    async def recover(self) -> RecoveryResult: ...


class PgJobStore:
    """
    `JobStore` on PostgreSQL.

    Args:
        db: the connection pool.
        config: supplies MAX_ATTEMPTS and the stuck threshold.
        runnable_kinds: payload kinds this worker has executors for.
        known_kinds: every kind a payload type exists for; a job of any other
            kind is claimed too, so that it fails as invalid instead of waiting
            forever.
    """

    def __init__(
        self,
        db: Database,
        config: QueueConfig,
        *,
        runnable_kinds: frozenset[str],
        known_kinds: frozenset[str],
    ) -> None:
        self._db = db
        self._config = config
        self._runnable = sorted(runnable_kinds)
        self._known = sorted(known_kinds | runnable_kinds)

    async def claim(self, limit: int) -> list[ClaimedJob]:
        """Claim up to `limit` pending jobs, oldest first (FOR UPDATE SKIP LOCKED)."""
        rows = await self._db.fetch_generic(Q.job_claim, limit, self._runnable, self._known)
        jobs = [ClaimedJob(**dict(row)) for row in rows]
        jobs.sort(key=lambda j: j.created_at)
        return jobs

    async def finish_from_build(self, job: ClaimedJob, build_id: UUID) -> JobStatus | None:
        """
        The executor returned: done if its build row says 'success', else failed.

        Returns the status written, or None when the job is no longer ours (its
        target was hard-deleted during the build, which cascaded the row away).
        One job's `finish_many_and_claim` with no claim: the worker batches its
        finishes, so this is for tools and tests.
        """
        statuses, _ = await self.finish_many_and_claim([(job, build_id)], 0)
        return statuses.get(job.id)

    async def finish_many_and_claim(
        self, finishing: list[tuple[ClaimedJob, UUID]], limit: int
    ) -> tuple[dict[UUID, JobStatus | None], list[ClaimedJob]]:
        """
        `finish_from_build` for every (job, build id) and `claim(limit)`, in one
        round trip: the worker's fetcher records every finish queued since its
        last statement and claims what its slots and prefetch buffer have room
        for, so the claim's SQL lives in two statements, not three. Returns each
        job's status (None: gone or no longer ours) and the claims.
        """
        rows = await self._db.fetch_generic(
            Q.jobs_finish_many_and_claim,
            [j.id for j, _ in finishing],
            [j.attempt for j, _ in finishing],
            [j.is_connector_job for j, _ in finishing],
            [b for _, b in finishing],
            BUILD_FAILED,
            limit,
            self._runnable,
            self._known,
        )
        statuses: dict[UUID, JobStatus | None] = {}
        claimed: list[ClaimedJob] = []
        for row in rows:
            if row["finished_id"] is not None:
                status = row["finished_status"]
                statuses[row["finished_id"]] = None if status is None else JobStatus(status)
            else:
                claimed.append(ClaimedJob(**{k: v for k, v in dict(row).items()
                                             if k not in ("finished_id", "finished_status")}))
        claimed.sort(key=lambda j: j.created_at)
        return statuses, claimed

    async def unclaim(self, jobs: list[ClaimedJob]) -> int:
        """
        Claimed jobs that never started go back to pending, their attempts
        restored (they never ran), and every listening worker is woken so an
        idle replica takes them at once. Returns how many went back.
        """
        if not jobs:
            return 0
        rows = await self._db.fetch_generic(Q.jobs_unclaim, [j.id for j in jobs],
                                    [j.attempt for j in jobs])
        if rows and self._config.notify_channel is not None:
            try:
                await self._db.execute(Q.queue_notify, self._config.notify_channel)
            except Exception as exc:  # they are back; replicas find them at their poll
                log.warning("gave back %d job(s) but could not NOTIFY (%s: %s)", len(rows),
                            type(exc).__name__, exc)
        return len(rows)

    async def fail(
        self,
        job: ClaimedJob,
        message: str,
        *,
        own_build_id: UUID | None,
        terminalize: bool,
    ) -> bool:
        """
        Mark the job failed with `message`, in one transaction with its target.

        With `terminalize`, the target goes terminal (SPEC §6). Without it (the
        soft-deleted agent), only the job's own build row is ended. Returns
        False when the job is no longer ours.
        """

        async def op(conn: asyncpg.Connection) -> bool:
            row = await conn.fetchrow(Q.job_mark, job.id, job.attempt, JobStatus.FAILED, message)
            if row is None:
                return False
            if terminalize:
                await terminalize_target(conn, row["agent_id"], row["connector_id"], own_build_id)
            elif own_build_id is not None and row["agent_id"] is not None:
                await conn.execute(Q.agent_build_fail_own, own_build_id)
            return True

        ours: bool = await self._db.run_in_transaction(op)
        if not ours:
            log.info("job %s: row gone or no longer ours; not marked %r", job.id, message)
        return ours

    async def reset(self, job: ClaimedJob) -> bool:
        """Back to pending with picked_at NULL; the attempt stays counted."""
        return await self._db.fetchval(Q.job_reset_to_pending, job.id, job.attempt) is not None

    async def recover(self) -> RecoveryResult:
        """
        The two recovery statements of SPEC §7.

        Exhausted stuck jobs are failed and their targets terminalized in one
        transaction; then the others go back to pending. Both skip rows another
        session holds, so any number of replicas may sweep at once.
        """
        mins = self._config.stuck_job_mins
        max_attempts = self._config.max_attempts

        async def fail_exhausted(conn: asyncpg.Connection) -> int:
            rows = await conn.fetch(
                Q.jobs_fail_exhausted_stuck, mins, max_attempts, MAX_ATTEMPTS_EXCEEDED
            )
            for row in rows:
                # Each target in a savepoint of its own: one target the database
                # refuses to terminalize must not hold back every other stuck job
                # sweep after sweep. An outage still aborts (and retries) the lot.
                try:
                    async with conn.transaction():
                        await terminalize_target(conn, row["agent_id"], row["connector_id"],
                                                 _build_id_of(row["payload"]))
                except asyncpg.PostgresError as exc:
                    if is_transient(exc):
                        raise
                    log.error("recovery: job %s failed for good, but its target could not be "
                              "terminalized (%s: %s); left as it is", row["id"],
                              type(exc).__name__, exc)
            return len(rows)

        failed = await self._db.run_in_transaction(fail_exhausted)
        reset = len(await self._db.fetch(Q.jobs_reset_stuck, mins, max_attempts))
        if failed:
            log.warning("recovery: %d stuck job(s) had no attempts left and failed", failed)
        if reset:
            log.warning("recovery: %d stuck job(s) reset to pending", reset)
        return RecoveryResult(failed=failed, reset=reset)


def _build_id_of(payload_text: str) -> UUID | None:
    try:
        return raw_build_id(json.loads(payload_text))
    except ValueError:
        return None
