"""
The dead-letter queue and job listings: list jobs of every table, retry, cancel
and discard them (`nasiko-queue jobs ...`).

Jobs live in three tables: `build_jobs` (the original's, with its own status
words), `nasiko_queue_jobs` (plain jobs) and `nasiko_queue_deleted_build_jobs`
(copies of failed build jobs deleted with their never-built target by
terminalization, docs/rules.md §6, kept so that a job that failed for good stays
inspectable). An operator wants one list in one vocabulary, so a listing maps
build jobs onto the plain jobs' states: queue "builds", kind from the payload,
pending → available, in_progress → running, done → completed, failed →
discarded, and the kept copies as discarded with `target_deleted` set. The
dead letters are the discarded jobs, the default listing.

Every change is one short transaction per job, so that a bulk retry of
thousands never holds thousands of row locks, and a job that is refused (a
unique key held, an agent deleted) does not hold the others back.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from datetime import datetime, timedelta
from typing import Any
from uuid import UUID

import asyncpg
import attrs

from ..builds.payloads import raw_build_id
from ..config import QueueConfig
from ..db.database import Database, Transaction
from ..db.statements import Q
from ..errors import NasikoQueueError
from ..job_errors import plain_json
from ..queue import CancelResult, cancel_plain_job

#: The states of a listing (the plain jobs' words; build jobs are mapped on them).
STATES = ("available", "running", "completed", "discarded", "cancelled")
#: States a job has for good: only these can be discarded.
FINISHED_STATES = ("completed", "discarded", "cancelled")
#: The state a `JobFilter` (and `nasiko-queue jobs ...`) is about unless told:
#: the dead letters.
DEFAULT_STATE = "discarded"
#: Default page size of a listing.
DEFAULT_LIMIT = 50
#: Page size used to collect every job a bulk retry or discard matches.
_BULK_PAGE = 1000


class JobNotFound(NasikoQueueError):
    """No job has this id in any table."""


class JobRefused(NasikoQueueError):
    """The job cannot be retried, cancelled or discarded as asked; the message says why."""


def _state(_inst: object, _attr: attrs.Attribute[Any], value: str | None) -> None:
    if value is not None and value not in STATES:
        raise ValueError(f"state must be one of {', '.join(STATES)}, not {value!r}")


def _positive(_inst: object, _attr: attrs.Attribute[Any], value: timedelta | None) -> None:
    if value is not None and value <= timedelta(0):
        raise ValueError("older_than must be positive")


def _limit(_inst: object, _attr: attrs.Attribute[Any], value: int) -> None:
    if value < 1:
        raise ValueError("limit must be >= 1")


@attrs.frozen(kw_only=True)
class JobFilter:
    """
    Which jobs a listing, bulk retry or bulk discard is about; None means any.

    `state` defaults to "discarded": the dead-letter queue, as the CLI's
    ``--state`` does (`DEFAULT_STATE`); ``state=None`` (the CLI's ``--state any``)
    is every state. `older_than` is the age of the job's `at` (when it ended, or
    was created while it has not).
    `limit` is a listing's page size; bulk operations act on every match.
    """

    queue: str | None = None
    kind: str | None = None
    state: str | None = attrs.field(default=DEFAULT_STATE, validator=_state)
    older_than: timedelta | None = attrs.field(default=None, validator=_positive)
    limit: int = attrs.field(default=DEFAULT_LIMIT, validator=_limit)


@attrs.frozen(kw_only=True)
class JobSummary:
    """One line of a listing."""

    id: UUID
    #: "plain", "build", or "deleted_build" (a kept copy: its target was deleted).
    source: str
    queue: str
    kind: str | None
    state: str
    attempt: int
    #: Plain jobs only (a build job's cap is its workers' `max_attempts`).
    max_attempts: int | None
    error_msg: str | None
    created_at: datetime
    finished_at: datetime | None
    #: What the listing is ordered by: when it ended, or was created while it has not.
    at: datetime
    #: A failed build job whose agent or connector was deleted with it: cannot be retried.
    target_deleted: bool
    agent_id: UUID | None
    connector_id: UUID | None
    #: Plain jobs only: not claimable before this time (when a retry is due, for
    #: a job waiting after a failed attempt).
    run_at: datetime | None = None
    #: Plain jobs only: lower runs first within a queue.
    priority: int | None = None
    #: When its last attempt was claimed (a build job's `picked_at`); None until
    #: it first runs.
    attempted_at: datetime | None = None
    #: The worker running it (its last claim's, for a plain job that ended).
    claimed_by: UUID | None = None

    @property
    def cursor(self) -> str:
        """Pass as `after=` for the page that follows this job."""
        return f"{self.at.isoformat()}|{self.id}"

    def to_json(self) -> dict[str, Any]:
        return {f.name: plain_json(getattr(self, f.name)) for f in attrs.fields(JobSummary)}


@attrs.frozen
class BulkResult:
    """What a bulk retry or discard did: the jobs changed, and each refusal's reason."""

    done: tuple[UUID, ...]
    refused: tuple[tuple[UUID, str], ...]


def _parse_cursor(cursor: str) -> tuple[datetime, UUID]:
    at, sep, job_id = cursor.partition("|")
    try:
        if not sep:
            raise ValueError
        return datetime.fromisoformat(at), UUID(job_id)
    except ValueError:
        raise ValueError(f"{cursor!r} is not a listing cursor") from None


async def list_jobs(db: Database, where: JobFilter | None = None, *,
                    after: str | None = None) -> list[JobSummary]:
    """
    One page of the jobs `where` matches, newest first (by `at`, then id).

    Pass the last job's `cursor` as `after` for the next page; an empty page is
    the end. Pages by position, not offset, so a page costs the same however
    deep it is and jobs retried or discarded meanwhile do not shift the rest.
    """
    where = where or JobFilter()
    at, last = _parse_cursor(after) if after is not None else (None, None)
    rows = await db.fetch(Q.jobs_list, where.queue, where.kind, where.state,
                          where.older_than, at, last, where.limit)
    return [JobSummary(**dict(r)) for r in rows]


async def _all_matching(db: Database, where: JobFilter) -> list[JobSummary]:
    page = attrs.evolve(where, limit=_BULK_PAGE)
    found: list[JobSummary] = []
    after: str | None = None
    while True:
        batch = await list_jobs(db, page, after=after)
        found.extend(batch)
        if len(batch) < _BULK_PAGE:
            return found
        after = batch[-1].cursor


async def count_jobs(db: Database, where: JobFilter | None = None) -> int:
    """
    How many jobs `where` matches over every page of `list_jobs` (its `limit`
    aside): what a bulk retry or discard with it would be about. One statement,
    no paging.
    """
    where = where or JobFilter()
    count: int = await db.fetchval(Q.jobs_count, where.queue, where.kind, where.state,
                                   where.older_than)
    return count


#: The name it had first.
count_matching = count_jobs


# -- retry ------------------------------------------------------------------------


async def retry(db: Database, job_id: UUID, config: QueueConfig | None = None, *,
                actor: str = "api") -> str:
    """
    Run a dead job again; returns "plain" or "build" (which table it was in).

    - A plain job that was discarded or cancelled becomes available now, with
      attempts from 0 and no error (its kept errors stay). If its unique key is
      held by another job meanwhile, it is refused naming that job.
    - A failed build job whose agent or connector exists (and is not
      soft-deleted) becomes pending with attempt 0, as the original's enqueue
      writes it. Its own build row, if failed, goes back to queued (pending for a
      connector), and its target, if failed, back to deploying (pending): what
      the enqueue point had written, so that the run reports as a fresh one and
      a second failure for good terminalizes it again as docs/rules.md §6 says.
    - A failed build job whose target was deleted with it (a kept copy) is
      refused: there is nothing to build for.

    Workers are woken through `config.notify_channel` once it commits. The
    retry is recorded in the job's timeline as done by `actor` ("dashboard",
    "cli", "api").

    Raises:
        JobNotFound: no job has this id.
        JobRefused: any other job (running, completed, a copy...), saying why.
    """
    config = config or QueueConfig()
    peek = await db.fetchrow(Q.build_job_peek, job_id)
    if peek is not None:
        await _retry_build(db, job_id, peek, config, actor)
        return "build"
    unique_key: str | None = None
    try:
        async with db.transaction() as tx:
            row = await tx.fetchrow(Q.plain_lock, job_id)
            if row is not None:
                if row["state"] not in ("discarded", "cancelled"):
                    raise JobRefused(f"job {job_id} is {row['state']}: only discarded or "
                                     "cancelled jobs can be retried")
                unique_key = row["unique_key"]
                await tx.execute(Q.plain_requeue, job_id)
                await record(tx, job_id, "retried", actor)
                await _notify(tx, config)
                return "plain"
    except asyncpg.UniqueViolationError:
        # Rolled back; asked outside the failed transaction.
        holder = await db.fetchval(Q.plain_unique_holder, unique_key)
        raise JobRefused(
            f"job {job_id} cannot be retried: job {holder} holds its unique key "
            f"{unique_key!r} now; cancel or discard that one first, or leave this one "
            "dead") from None
    copy = await db.fetchrow(Q.deleted_build_job_get, job_id)
    if copy is not None:
        target = "agent" if copy["agent_id"] is not None else "connector"
        target_id = copy["agent_id"] or copy["connector_id"]
        raise JobRefused(
            f"job {job_id} cannot be retried: its {target} {target_id} was deleted when the "
            f"job failed for good (it had never built successfully, docs/rules.md §6), so "
            f"there is nothing left to build for. Create the {target} again and enqueue a "
            f"new job for it (`nasiko-queue job {job_id}` shows the old payload, secrets "
            f"masked), then `nasiko-queue jobs discard {job_id}`.")
    raise JobNotFound(f"no job {job_id}")


async def _retry_build(db: Database, job_id: UUID, peek: asyncpg.Record,
                       config: QueueConfig, actor: str) -> None:
    if peek["status"] != "failed":
        raise JobRefused(f"job {job_id} is {peek['status']}: only failed build jobs can "
                         "be retried")
    agent_id, connector_id = peek["agent_id"], peek["connector_id"]
    try:
        build_id = raw_build_id(json.loads(peek["payload"]))
    except (ValueError, RecursionError):
        build_id = None
    async with db.transaction() as tx:
        # docs/rules.md §6's lock order: the target, then the job. An agent
        # deleted meanwhile took the job with it (and a copy was kept).
        lock = Q.agent_lock if agent_id is not None else Q.connector_lock
        if await tx.fetchval(lock, agent_id or connector_id) is None:
            raise JobRefused(f"job {job_id} cannot be retried: its target was deleted "
                             "meanwhile (`nasiko-queue job` shows the kept copy)")
        row = await tx.fetchrow(Q.build_job_lock, job_id)
        if row is None or row["status"] != "failed":
            raise JobRefused(f"job {job_id} changed meanwhile; look again")
        if agent_id is not None and await tx.fetchval(Q.agent_soft_deleted, agent_id):
            raise JobRefused(f"job {job_id} cannot be retried: its agent {agent_id} is "
                             "soft-deleted (it would fail `target deleted` without running)")
        await tx.execute(Q.build_job_requeue, job_id)
        if agent_id is not None:
            if build_id is not None:
                await tx.execute(Q.agent_build_requeue, build_id, agent_id)
            await tx.execute(Q.agent_redeploy, agent_id)
        else:
            if build_id is not None:
                await tx.execute(Q.connector_build_requeue, build_id, connector_id)
            await tx.execute(Q.connector_redeploy, connector_id)
        await record(tx, job_id, "retried", actor)
        await _notify(tx, config)


async def record(tx: Transaction | Database, job_id: UUID, action: str, actor: str,
                 detail: str | None = None) -> None:
    """Keep an operator's action in the job's timeline (nasiko_queue_job_events)."""
    await tx.execute(Q.job_event_insert, job_id, action, actor, detail)


async def _notify(tx: Transaction, config: QueueConfig) -> None:
    """Wake listening workers once the transaction commits (NOTIFY is transactional)."""
    if config.notify_channel is not None:
        await tx.execute(Q.queue_notify, config.notify_channel)


# -- discard ----------------------------------------------------------------------


async def discard(db: Database, job_id: UUID, *, actor: str = "api") -> str:
    """
    Delete a finished job for good, with its kept errors; returns its source
    ("plain", "build" or "deleted_build").

    A failed build job's row is deleted without a copy being kept aside (the
    copy is for jobs deleted with their target, not by an operator). Only
    finished jobs: a waiting or running one is refused (cancel it first).

    Raises:
        JobNotFound: no job has this id.
        JobRefused: the job has not finished.
    """
    async with db.transaction() as tx:
        plain = await tx.fetchrow(Q.plain_lock, job_id)
        if plain is not None:
            _must_be_finished(job_id, plain["state"])
            await tx.execute(Q.plain_delete_finished, job_id)
            source = "plain"
        elif (build := await tx.fetchrow(Q.build_job_lock, job_id)) is not None:
            _must_be_finished(job_id, build["status"])
            await tx.execute(Q.build_job_delete_finished, job_id)
            source = "build"
        elif (await tx.execute(Q.deleted_build_job_delete, job_id)).endswith(" 1"):
            source = "deleted_build"
        else:
            raise JobNotFound(f"no job {job_id}")
        await tx.execute(Q.job_errors_delete, job_id)
        await record(tx, job_id, "discarded", actor)
    return source


def _must_be_finished(job_id: UUID, status: str) -> None:
    if status not in (*FINISHED_STATES, "done", "failed"):
        raise JobRefused(f"job {job_id} is {status}: only finished jobs can be discarded "
                         "(cancel it first)")


# -- cancel -----------------------------------------------------------------------


async def cancel(db: Database, job_id: UUID, *, actor: str = "api") -> CancelResult:
    """
    Cancel a plain job (as `Queue.cancel`): `CancelResult.CANCELLED` for a waiting
    one, `CANCELLING` for a running one (its worker stops it at its next heartbeat).

    Raises:
        JobNotFound: no job has this id.
        JobRefused: a build job (their rules have no cancel), or one that ended.
    """
    result = await cancel_plain_job(db, job_id)
    if result in (CancelResult.CANCELLED, CancelResult.CANCELLING):
        await record(db, job_id, "cancelled" if result == CancelResult.CANCELLED
                     else "cancel asked (running)", actor)
        return result
    if result is not None:
        raise JobRefused(f"job {job_id} has already ended "
                         f"({result.removeprefix('already ')})")
    if await db.fetchrow(Q.build_job_peek, job_id) is not None or \
            await db.fetchrow(Q.deleted_build_job_get, job_id) is not None:
        raise JobRefused(f"job {job_id} is a build job: build jobs cannot be cancelled "
                         "(docs/rules.md has no such state; their targets' rules decide "
                         "how they end)")
    raise JobNotFound(f"no job {job_id}")


# -- in bulk ----------------------------------------------------------------------


async def _each(db: Database, where: JobFilter,
                act: Callable[[UUID], Awaitable[object]]) -> BulkResult:
    done: list[UUID] = []
    refused: list[tuple[UUID, str]] = []
    for job in await _all_matching(db, where):
        try:
            await act(job.id)
        except (JobRefused, JobNotFound) as exc:
            refused.append((job.id, str(exc)))
        else:
            done.append(job.id)
    return BulkResult(tuple(done), tuple(refused))


async def retry_matching(db: Database, where: JobFilter,
                         config: QueueConfig | None = None, *,
                         actor: str = "api") -> BulkResult:
    """`retry` every job `where` matches (all pages), each in its own transaction."""
    return await _each(db, where, lambda job_id: retry(db, job_id, config, actor=actor))


async def discard_matching(db: Database, where: JobFilter, *,
                           actor: str = "api") -> BulkResult:
    """`discard` every job `where` matches (all pages), each in its own transaction."""
    return await _each(db, where, lambda job_id: discard(db, job_id, actor=actor))


# -- pause and resume -------------------------------------------------------------

#: The build jobs' queue in a listing: not pausable (the original's worker claims
#: build jobs with its own SQL, which a pause could not reach).
BUILDS_QUEUE = "builds"


def _pausable(name: str) -> None:
    if name == BUILDS_QUEUE:
        raise JobRefused("the queue \"builds\" cannot be paused: the original's workers "
                         "claim build jobs with their own SQL, which would not see a pause")
    if not name or len(name) > 128:
        raise JobRefused("a queue name has 1 to 128 characters")


async def pause_queue(db: Database, name: str) -> None:
    """
    Pause the plain-job queue `name`: no worker claims from it until
    `resume_queue`. Jobs already running finish as usual; enqueues still land.
    Idempotent. Pausing a queue that holds no job yet is allowed.

    Raises:
        JobRefused: `name` is "builds" (build jobs cannot be paused) or not a queue name.
    """
    _pausable(name)
    await db.execute(Q.queue_pause, name)


async def resume_queue(db: Database, name: str, config: QueueConfig | None = None) -> bool:
    """
    Resume the queue `name`; returns whether it was paused. Workers are woken
    through `config.notify_channel` once it commits, so they claim at once.
    """
    config = config or QueueConfig()
    async with db.transaction() as tx:
        resumed = await tx.fetchval(Q.queue_resume, name) is not None
        if resumed:
            await _notify(tx, config)
    return resumed


async def paused_queues(db: Database) -> dict[str, datetime]:
    """Every paused queue, and since when."""
    return {r["queue"]: r["paused_at"] for r in await db.fetch(Q.queues_paused)}
