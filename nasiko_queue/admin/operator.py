"""
The operator's views and actions of the dashboard (issue #21): running and
scheduled jobs, "run now", search by kind and by argument, the actions kept in
a job's timeline, pausing cron schedules, and the planner's row estimates.

Every read is one named statement of ``db/queries.sql`` with a bounded page;
every action is one short transaction that records itself in the job's
timeline (`nasiko_queue_job_events`, migration 0015) and wakes the workers.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from uuid import UUID

import asyncpg
import attrs

from ..config import QueueConfig
from ..db.database import Database
from ..db.statements import Q
from ..plain.schedules import Schedule
from ..queue import Queue
from .jobs import STATES, JobNotFound, JobRefused, _notify, _parse_cursor, record

#: The largest page any of these views returns (a `limit` above it is cut to it).
MAX_PAGE = 500
#: Longest search filters: a kind (kinds have at most 100 characters), and the
#: arguments' JSON text.
MAX_KIND_FILTER = 100
MAX_ARGS_FILTER = 4096
#: Seconds a search may run (`search_statement_timeout`).
SEARCH_TIMEOUT = 5.0


def _page(limit: int) -> int:
    if limit < 1:
        raise ValueError("limit must be >= 1")
    return min(limit, MAX_PAGE)


@attrs.frozen(kw_only=True)
class RunningJob:
    """A job being run now, and the worker that holds it."""

    source: str
    id: UUID
    queue: str
    kind: str | None
    attempt: int
    max_attempts: int | None
    #: When this attempt started (claimed).
    started_at: datetime | None
    cancel_requested: bool
    claimed_by: UUID | None
    #: The holding worker's host and pid (None: no registered worker holds it).
    host: str | None
    pid: int | None
    worker_alive: bool | None

    def run_seconds(self, now: datetime) -> float | None:
        return None if self.started_at is None else (now - self.started_at).total_seconds()


@attrs.frozen(kw_only=True)
class ScheduledJob:
    """A plain job waiting for its `run_at`."""

    id: UUID
    queue: str
    kind: str
    priority: int
    attempt: int
    max_attempts: int
    run_at: datetime
    created_at: datetime


@attrs.frozen(kw_only=True)
class FoundJob:
    """One job a search found."""

    source: str
    id: UUID
    queue: str
    kind: str | None
    state: str
    attempt: int
    max_attempts: int | None
    error_msg: str | None
    created_at: datetime
    finished_at: datetime | None
    run_at: datetime
    at: datetime

    @property
    def cursor(self) -> str:
        return f"{self.at.isoformat()}|{self.id}"


@attrs.frozen(kw_only=True)
class JobEvent:
    """An operator's action on a job: what, who ("dashboard", "cli", "api"), when."""

    at: datetime
    action: str
    actor: str
    detail: str | None


async def running_jobs(db: Database, limit: int = MAX_PAGE) -> list[RunningJob]:
    """The running jobs (plain and build), longest-running first."""
    return [RunningJob(**dict(r)) for r in await db.fetch(Q.jobs_running, _page(limit))]


async def scheduled_jobs(db: Database, queue: str | None = None,
                         limit: int = MAX_PAGE) -> list[ScheduledJob]:
    """Plain jobs waiting for a `run_at` in the future, soonest first.

    Raises:
        ValueError: a queue name over 128 characters (no queue has one).
    """
    if queue is not None and len(queue) > 128:
        raise ValueError(f"queue: at most 128 characters, got {len(queue)}")
    return [ScheduledJob(**dict(r))
            for r in await db.fetch(Q.jobs_scheduled, queue, _page(limit))]


def parse_args_filter(text: str | None) -> str | None:
    """
    The JSON document a search's arguments must contain, checked: None for an
    empty one; a ValueError saying what is wrong for text that is not a JSON
    object.
    """
    if text is None or not text.strip():
        return None
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"arguments: not valid JSON ({exc.args[0] if exc.args else exc}); "
                         'give an object such as {"user_id": 42}') from None
    except RecursionError:
        raise ValueError("arguments: nested too deeply") from None
    if not isinstance(value, dict):
        raise ValueError('arguments: give a JSON object such as {"user_id": 42}, '
                         f"not {type(value).__name__}")
    return json.dumps(value)


async def search_jobs(db: Database, *, kind: str | None = None, args: str | None = None,
                      state: str | None = None, queue: str | None = None,
                      after: str | None = None, limit: int = 50) -> list[FoundJob]:
    """
    Jobs of `kind` whose arguments contain the JSON object `args` (jsonb
    containment: ``payload @> args``), newest first; a page of at most
    `MAX_PAGE`. Sealed fields are stored encrypted, so they never match.

    Raises:
        ValueError: `args` is not a JSON object, `state` is not a state, or
            `after` is not a cursor.
    """
    for name, value, most in (("kind", kind, MAX_KIND_FILTER), ("queue", queue, 128),
                              ("arguments", args, MAX_ARGS_FILTER)):
        if value is not None and len(value) > most:
            raise ValueError(f"{name}: at most {most} characters, got {len(value)}")
    document = parse_args_filter(args)
    if state is not None and state not in STATES:
        raise ValueError(f"state must be one of {', '.join(STATES)}, not {state!r}")
    at, last = _parse_cursor(after) if after else (None, None)
    try:
        async with db.transaction() as tx:
            await tx.fetchval(Q.search_statement_timeout, f"{SEARCH_TIMEOUT:g}s")
            rows = await tx.fetch(Q.jobs_search, kind or None, document, state,
                                  queue or None, at, last, _page(limit))
    except asyncpg.QueryCanceledError:
        raise ValueError(f"the search ran past {SEARCH_TIMEOUT:g} s and was stopped; name a "
                         "kind or a queue to narrow it") from None
    return [FoundJob(**dict(r)) for r in rows]


async def run_now(db: Database, job_id: UUID, config: QueueConfig | None = None, *,
                  actor: str = "api") -> str:
    """
    Make a waiting plain job due now (its `run_at` moved to now) and wake the
    workers; returns its queue. Recorded in the job's timeline.

    Raises:
        JobNotFound: no plain job has this id (build jobs have no `run_at`).
        JobRefused: the job is not waiting (running or ended).
    """
    config = config or QueueConfig()
    async with db.transaction() as tx:
        row = await tx.fetchrow(Q.plain_run_now, job_id)
        if row is not None:
            await record(tx, job_id, "run now", actor)
            await _notify(tx, config)
            return str(row["queue"])
    plain = await db.fetchrow(Q.plain_get, job_id)
    if plain is not None:
        raise JobRefused(f"job {job_id} is {plain['state']}: only a waiting job can be "
                         "run now")
    if await db.fetchrow(Q.build_job_peek, job_id) is not None:
        raise JobRefused(f"job {job_id} is a build job: build jobs have no run_at")
    raise JobNotFound(f"no job {job_id}")


async def job_events(db: Database, job_id: UUID) -> list[JobEvent]:
    """The operator actions recorded on `job_id`, oldest first."""
    return [JobEvent(**dict(r)) for r in await db.fetch(Q.job_events_of, job_id)]


async def pause_schedule(db: Database, name: str) -> datetime:
    """
    Pause the cron schedule `name`: its ticks enqueue nothing until
    `resume_schedule` (they are moved over, not replayed on resume). Idempotent;
    returns since when it is paused.

    Raises:
        JobRefused: no scheduler has recorded the schedule yet.
    """
    paused: datetime | None = await db.fetchval(Q.schedule_pause, name)
    if paused is None:
        raise JobRefused(f"schedule {name!r} is not known yet: a worker's scheduler "
                         "records it when it first sees it")
    return paused


async def resume_schedule(db: Database, name: str) -> bool:
    """Resume the cron schedule `name`; returns whether it was paused."""
    return await db.fetchval(Q.schedule_resume, name) is not None


async def run_schedule_now(queue: Queue, schedule: Schedule, *, actor: str = "api") -> UUID:
    """
    Enqueue one job of `schedule` now, outside its ticks (its `last_tick` is left
    as it is); returns the job's id. Recorded in the new job's timeline.
    """
    async with queue.db.transaction() as tx:
        job_id = await queue.enqueue(schedule.make_job(), tx=tx, options=schedule.options)
        await record(tx, job_id, "run now", actor, f"schedule {schedule.name}")
    return job_id


async def estimated_rows(db: Database) -> dict[str, int]:
    """The planner's row estimates of the job tables (no scan; as of the last ANALYZE)."""
    return {r["name"]: r["rows"] for r in await db.fetch(Q.table_estimates)}


#: Below this many rows (the planner's estimate) the overview counts ended jobs
#: exactly; above it, it shows the planner's estimates (no scan of the history).
EXACT_BELOW = 100_000


@attrs.frozen(kw_only=True)
class QueueOverview:
    """One queue on the dashboard's overview ("builds" for the build jobs)."""

    queue: str
    available: int
    scheduled: int
    running: int
    completed: int
    discarded: int
    cancelled: int
    #: Seconds the oldest due job has waited (None: none is due).
    oldest_available_age: float | None
    #: The ended counts are the planner's estimates, not exact counts.
    estimated: bool


async def queue_overview(db: Database, *, exact_below: int = EXACT_BELOW,
                         also: Sequence[str] = ()) -> list[QueueOverview]:
    """
    Every queue's counts for the overview, by name, then "builds" (the build jobs,
    listed only where the database holds any: an application that does not use
    them sees no row of zeros; issue #46): jobs
    due, scheduled and running counted exactly (from the indexes of unfinished
    rows); ended ones counted exactly while the table holds fewer than
    `exact_below` rows, else estimated from the planner's statistics (no scan:
    a queue whose jobs all ended long ago may be missing or approximate). The
    queues in `also` (e.g. paused ones) are listed even when empty.
    """
    sizes = await estimated_rows(db)
    live = {r["queue"]: r for r in await db.fetch(Q.plain_queue_live_counts)}
    ended: dict[str, dict[str, int]] = {}
    estimated = sizes.get("nasiko_queue_jobs", 0) >= exact_below
    rows = []
    if estimated:
        rows = await db.fetch(Q.plain_queue_finished_estimates, sorted({*live, *also}))
        estimated = bool(rows)
    if not estimated:
        rows = await db.fetch(Q.plain_queue_finished_counts)
    for r in rows:
        ended.setdefault(r["queue"], {})[r["state"]] = int(r["n"])
    out: list[QueueOverview] = []
    for name in sorted({*live, *ended, *also}):
        counts = ended.get(name, {})
        if name not in live and name not in also and not any(counts.values()):
            continue
        row = live.get(name)
        out.append(QueueOverview(
            queue=name, available=row["available"] if row else 0,
            scheduled=row["scheduled"] if row else 0, running=row["running"] if row else 0,
            completed=counts.get("completed", 0), discarded=counts.get("discarded", 0),
            cancelled=counts.get("cancelled", 0),
            oldest_available_age=row["oldest_available_age"] if row else None,
            estimated=estimated))
    build = await db.fetchrow(Q.build_queue_live_counts)
    big = sizes.get("build_jobs", 0) >= exact_below
    finished = await db.fetchrow(Q.build_finished_estimates) if big else None
    if finished is None:
        big = False
        finished = await db.fetchrow(Q.build_finished_counts)
    # Aggregates without GROUP BY: always one row.
    assert build is not None
    assert finished is not None
    builds = QueueOverview(
        queue="builds", available=build["available"], scheduled=0, running=build["running"],
        completed=int(finished["done"]), discarded=int(finished["failed"]) + build["deleted"],
        cancelled=0, oldest_available_age=None, estimated=big)
    if builds.available or builds.running or builds.completed or builds.discarded:
        out.append(attrs.evolve(builds, oldest_available_age=await db.fetchval(
            Q.jobs_oldest_pending_age)))
    return out
