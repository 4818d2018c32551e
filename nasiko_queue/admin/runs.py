"""
Workflow runs as an operator sees them (issue #22, "see and steer runs"): list
runs, show one run's steps with every attempt of their jobs, cancel and retry
runs (`nasiko-queue runs ...`, `nasiko-queue run ID`, the dashboard's Runs pages).

A run's view is read, not computed: its row, its steps' head rows, and its
step jobs (every job each step ever had: a run's retry gives a failed step a
new job and keeps the old one, whose attempts and errors are the story of the
failure). The jobs come a page at a time (`JOBS_PER_PAGE`, each with its last
`ERRORS_PER_JOB` errors): a fan-out of 20,000 items is 20,000 jobs. What the
view says of the run as a whole (each step's jobs and items by state, its
attempts, its first claim and last end) is counted over all of them, whatever
the page.
Inputs, results and step results are JSON an application wrote; they may hold
sealed tokens, so they are shown masked exactly as job payloads and results are
(`admin.view.masked_json`): an operator's terminal is not the place for them.

A cancel or retry is the run's own rule (migration 0018's functions, one
statement that locks the run's row), recorded in the same transaction in the
timeline of operator actions (`nasiko_queue_job_events`, keyed by the run's id:
ids never collide, and the timeline table has no foreign key on purpose).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from typing import Any
from uuid import UUID

import attrs

from ..db.database import Database, retry_conflicts
from ..db.statements import Q
from ..errors import NasikoQueueError, NoSuchRun
from ..job_errors import JobError, plain_json
from .jobs import record
from .operator import JobEvent, job_events
from .view import masked_json

__all__ = ["DEFAULT_LIMIT", "ERRORS_PER_JOB", "JOBS_PER_PAGE", "STATES", "RunDetail",
           "RunFilter", "RunNotFound", "RunRefused", "RunSummary", "StepDetail", "StepItem",
           "StepJob", "cancel_run", "list_runs", "retry_run", "run_detail"]

#: A run's states (migration 0018).
STATES = ("running", "completed", "failed", "cancelled")
#: Default page size of a listing.
DEFAULT_LIMIT = 50
#: Default number of step jobs on a page of a run's view.
JOBS_PER_PAGE = 50
#: A job on a page of a run's view shows its last this many errors (its own
#: page, all of them).
ERRORS_PER_JOB = 3


class RunNotFound(NoSuchRun):
    """No workflow run has this id."""


class RunRefused(NasikoQueueError):
    """The run cannot be cancelled or retried as asked; the message says why."""


def _state(_inst: object, _attr: attrs.Attribute[Any], value: str | None) -> None:
    if value is not None and value not in STATES:
        raise ValueError(f"state must be one of {', '.join(STATES)}, not {value!r}")


def _limit(_inst: object, _attr: attrs.Attribute[Any], value: int) -> None:
    if value < 1:
        raise ValueError("limit must be >= 1")


@attrs.frozen(kw_only=True)
class RunFilter:
    """Which runs a listing is about (None: any) and its page size."""

    workflow: str | None = None
    state: str | None = attrs.field(default=None, validator=_state)
    limit: int = attrs.field(default=DEFAULT_LIMIT, validator=_limit)


@attrs.frozen(kw_only=True)
class RunSummary:
    """One line of a runs listing."""

    id: UUID
    workflow: str
    state: str
    failed_step: str | None
    error: str | None
    #: A child run's parent run and the parent's step that started it.
    parent_run: UUID | None
    parent_step: str | None
    created_at: datetime
    finished_at: datetime | None
    #: How many steps it has, and how many completed (a mapped step counts once).
    steps: int
    completed: int

    @property
    def cursor(self) -> str:
        """Pass as `after=` for the page that follows this run."""
        return f"{self.created_at.isoformat()}|{self.id}"

    def to_json(self) -> dict[str, Any]:
        return {f.name: plain_json(getattr(self, f.name)) for f in attrs.fields(RunSummary)}


def _parse_cursor(cursor: str) -> tuple[datetime, UUID]:
    at, sep, run_id = cursor.partition("|")
    try:
        if not sep:
            raise ValueError
        return datetime.fromisoformat(at), UUID(run_id)
    except ValueError:
        raise ValueError(f"{cursor!r} is not a listing cursor") from None


async def list_runs(db: Database, where: RunFilter | None = None, *,
                    after: str | None = None) -> list[RunSummary]:
    """
    One page of the runs `where` matches, newest started first (then by id).

    Pass the last run's `cursor` as `after` for the next page; an empty page is
    the end. Ordered by start, not by end as the job listings are: a run that
    ends meanwhile keeps its place, so paging through running runs skips none.
    """
    where = where or RunFilter()
    at, last = _parse_cursor(after) if after is not None else (None, None)
    rows = await db.fetch(Q.workflow_runs_list, where.workflow, where.state, at, last,
                          where.limit)
    return [RunSummary(**dict(r)) for r in rows]


# -- one run ----------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class StepJob:
    """One job of a step (of one item, for a mapped step): its attempts and errors."""

    id: UUID
    #: The item it ran (0 for a step that is not mapped).
    index: int
    queue: str
    state: str
    attempt: int
    max_attempts: int
    #: Its last error, one line.
    error_msg: str | None
    created_at: datetime
    run_at: datetime
    #: When its last attempt was claimed, and when it ended.
    attempted_at: datetime | None
    finished_at: datetime | None
    claimed_by: UUID | None
    #: What its function returned, masked; None: nothing (yet).
    result: Any
    #: Its last crashed or timed-out attempts' errors (`ERRORS_PER_JOB` at
    #: most), oldest first.
    errors: tuple[JobError, ...]
    #: Whether it has earlier errors than these (its own page shows them all).
    more_errors: bool = False
    #: Whether it is its step's job now (False: a run's retry replaced it).
    live: bool

    @property
    def seconds(self) -> float | None:
        """How long its last attempt ran (None until it ended)."""
        if self.attempted_at is None or self.finished_at is None:
            return None
        return (self.finished_at - self.attempted_at).total_seconds()

    def to_json(self) -> dict[str, Any]:
        view = {f.name: plain_json(getattr(self, f.name)) for f in attrs.fields(StepJob)
                if f.name != "errors"}
        view["errors"] = [e.to_json() for e in self.errors]
        view["seconds"] = self.seconds
        return view


@attrs.frozen(kw_only=True)
class StepItem:
    """One item of a mapped step: its row."""

    index: int
    state: str
    result: Any
    error: str | None
    job_id: UUID | None

    def to_json(self) -> dict[str, Any]:
        return {f.name: plain_json(getattr(self, f.name)) for f in attrs.fields(StepItem)}


@attrs.frozen(kw_only=True)
class StepDetail:
    """One step of a run: its definition's shape, its state, its counts (of all
    its jobs and items) and its jobs and items on the view's page."""

    name: str
    #: "job", "signal" (waits for a signal) or "child" (waits for a child run).
    kind: str
    #: The steps it runs after.
    after: tuple[str, ...]
    #: The step whose list it runs once per item of; None: not mapped.
    map_over: str | None
    #: Its longest chain of dependencies (0: none): its indent in a graph.
    depth: int
    state: str
    #: Its result (a mapped step's: its items' results in order), masked.
    result: Any
    error: str | None
    #: A child step's run.
    child_run: UUID | None
    #: A mapped step's items whose live jobs are on this page (empty for any
    #: other step).
    items: tuple[StepItem, ...]
    #: Its jobs on this page, oldest first.
    jobs: tuple[StepJob, ...]
    #: All its jobs by state, and a mapped step's items by state (exact, for
    #: the whole run: not the page's).
    job_states: dict[str, int] = attrs.field(factory=dict)
    item_states: dict[str, int] = attrs.field(factory=dict)
    #: Attempts of all its jobs.
    attempts: int = 0
    #: When its first job's last attempt was claimed (of all its jobs).
    started_at: datetime | None = None
    #: When its last job ended (of all its jobs), once it is over (completed,
    #: failed, cancelled).
    finished_at: datetime | None = None

    @property
    def job_count(self) -> int:
        """How many jobs it had, all pages."""
        return sum(self.job_states.values())

    @property
    def item_count(self) -> int:
        """How many items a mapped step has (0 for any other step)."""
        return sum(self.item_states.values())

    @property
    def seconds(self) -> float | None:
        """From its first attempt's claim to its end (None while it is not over)."""
        start, end = self.started_at, self.finished_at
        return None if start is None or end is None else (end - start).total_seconds()

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "kind": self.kind, "after": list(self.after),
                "map_over": self.map_over, "depth": self.depth, "state": self.state,
                "result": self.result, "error": self.error,
                "child_run": plain_json(self.child_run),
                "started_at": plain_json(self.started_at),
                "finished_at": plain_json(self.finished_at), "seconds": self.seconds,
                "attempts": self.attempts, "job_states": dict(self.job_states),
                "item_states": dict(self.item_states),
                "items": [i.to_json() for i in self.items],
                "jobs": [j.to_json() for j in self.jobs]}


@attrs.frozen(kw_only=True)
class RunDetail:
    """A run as an operator sees it: its row (input and result masked) and its steps."""

    id: UUID
    workflow: str
    state: str
    input: Any
    result: Any
    failed_step: str | None
    error: str | None
    unique_key: str | None
    parent_run: UUID | None
    parent_step: str | None
    created_at: datetime
    finished_at: datetime | None
    #: In the definition's order, which is a DAG order (a step names only
    #: steps declared before it).
    steps: tuple[StepDetail, ...]
    #: Operators' cancels and retries, oldest first.
    events: tuple[JobEvent, ...]
    #: Pass as `after=` for the next page of its jobs; None: this page is the last.
    next_cursor: str | None = None

    def step(self, name: str) -> StepDetail:
        for s in self.steps:
            if s.name == name:
                return s
        raise KeyError(name)

    @property
    def failed(self) -> StepDetail | None:
        """The step that failed the run, if it failed."""
        if self.failed_step is None:
            return None
        return next((s for s in self.steps if s.name == self.failed_step), None)

    def to_json(self) -> dict[str, Any]:
        view = {f.name: plain_json(getattr(self, f.name)) for f in attrs.fields(RunDetail)
                if f.name not in ("steps", "events", "next_cursor")}
        view["steps"] = [s.to_json() for s in self.steps]
        view["events"] = [{"at": plain_json(e.at), "action": e.action, "actor": e.actor,
                           "detail": e.detail} for e in self.events]
        view["next"] = self.next_cursor
        return view

    @property
    def running_jobs(self) -> int:
        """Its step jobs running now (all pages)."""
        return sum(s.job_states.get("running", 0) for s in self.steps)


def _depths(defs: Sequence[dict[str, Any]]) -> dict[str, int]:
    depth: dict[str, int] = {}
    for d in defs:  # a DAG order: every step after those it names
        depth[d["name"]] = 1 + max((depth.get(a, 0) for a in d.get("after") or ()),
                                   default=-1)
    return depth


def _job_cursor(row: Any) -> str:
    return f"{row['created_at'].isoformat()}|{row['idx']}|{row['id']}"


def _parse_job_cursor(cursor: str) -> tuple[datetime, int, UUID]:
    try:
        at, idx, job_id = cursor.split("|")
        return datetime.fromisoformat(at), int(idx), UUID(job_id)
    except ValueError:
        raise ValueError(f"{cursor!r} is not a cursor of a run's jobs") from None


@attrs.frozen
class _Counts:
    """A step's exact counts, from `workflow_run_counts`."""

    jobs: dict[str, int] = attrs.Factory(dict)
    items: dict[str, int] = attrs.Factory(dict)
    attempts: int = 0
    started: datetime | None = None
    finished: datetime | None = None


async def _counts(db: Database, run_id: UUID) -> dict[str, _Counts]:
    counts: dict[str, _Counts] = {}
    for c in await db.fetch(Q.workflow_run_counts, run_id):
        old = counts.get(c["step"], _Counts())
        if c["kind"] == "item":
            counts[c["step"]] = attrs.evolve(old, items={**old.items, c["state"]: c["n"]})
            continue
        started = [t for t in (old.started, c["first_attempted_at"]) if t is not None]
        finished = [t for t in (old.finished, c["last_finished_at"]) if t is not None]
        counts[c["step"]] = attrs.evolve(
            old, jobs={**old.jobs, c["state"]: c["n"]}, attempts=old.attempts + c["attempts"],
            started=min(started, default=None), finished=max(finished, default=None))
    return counts


async def run_detail(db: Database, run_id: UUID, *, limit: int = JOBS_PER_PAGE,
                     after: str | None = None) -> RunDetail | None:
    """
    Run `run_id` with its steps and one page of their jobs (at most `limit`,
    oldest first, each with its last `ERRORS_PER_JOB` kept errors); None: no such
    run. Pass the view's `next_cursor` as `after` for the next page. Each step's
    counts, attempts and times are of all its jobs, whatever the page.

    Raises:
        ValueError: `limit` < 1, or `after` is not a cursor of a run's jobs.
    """
    if limit < 1:
        raise ValueError("limit must be >= 1")
    at, last_idx, last_id = _parse_job_cursor(after) if after is not None else (None, None, None)
    row = await db.fetchrow(Q.workflow_show, run_id)
    if row is None:
        return None
    heads = {h["step"]: h for h in await db.fetch(Q.workflow_step_heads, run_id)}
    counts = await _counts(db, run_id)
    job_rows = await db.fetch(Q.workflow_run_jobs_page, run_id, at, last_idx, last_id, limit)
    errors: dict[UUID, list[JobError]] = {}
    if job_rows:
        for e in await db.fetch(Q.job_errors_last_of_many, [j["id"] for j in job_rows],
                                ERRORS_PER_JOB + 1):
            errors.setdefault(e["job_id"], []).append(JobError(
                attempt=e["attempt"], reason=e["reason"], error_type=e["error_type"],
                message=e["message"], traceback=e["traceback"], at=e["at"],
                worker_id=e["worker_id"]))
    defs: list[dict[str, Any]] = json.loads(row["steps"])
    mapped_steps = {d["name"] for d in defs if d.get("map_over") is not None}
    live = {h["job_id"] for h in heads.values() if h["job_id"] is not None}
    jobs: dict[str, list[StepJob]] = {}
    items: dict[str, list[StepItem]] = {}
    for j in job_rows:
        latest = errors.get(j["id"], [])  # newest first
        jobs.setdefault(j["step"], []).append(StepJob(
            id=j["id"], index=j["idx"], queue=j["queue"], state=j["state"],
            attempt=j["attempt"], max_attempts=j["max_attempts"], error_msg=j["error_msg"],
            created_at=j["created_at"], run_at=j["run_at"], attempted_at=j["attempted_at"],
            finished_at=j["finished_at"], claimed_by=j["claimed_by"],
            result=masked_json(j["result"]),
            errors=tuple(reversed(latest[:ERRORS_PER_JOB])),
            more_errors=len(latest) > ERRORS_PER_JOB,
            live=j["id"] in live or j["item_state"] is not None))
        if j["item_state"] is not None and j["step"] in mapped_steps:
            items.setdefault(j["step"], []).append(StepItem(
                index=j["idx"], state=j["item_state"], result=masked_json(j["item_result"]),
                error=j["item_error"], job_id=j["id"]))
    depth = _depths(defs)
    steps = []
    for d in defs:
        head = heads.get(d["name"])
        mapped = d.get("map_over") is not None
        count = counts.get(d["name"], _Counts())
        state = head["state"] if head else "blocked"
        steps.append(StepDetail(
            name=d["name"], kind=d.get("kind", "job"), after=tuple(d.get("after") or ()),
            map_over=d.get("map_over"), depth=depth[d["name"]], state=state,
            result=masked_json(head["result"]) if head else None,
            error=head["error"] if head else None,
            child_run=head["child_run"] if head else None,
            items=tuple(sorted(items.get(d["name"], ()), key=lambda i: i.index)),
            jobs=tuple(jobs.get(d["name"], ())),
            job_states=count.jobs, item_states=count.items if mapped else {},
            attempts=count.attempts, started_at=count.started,
            finished_at=None if state in ("blocked", "enqueued", "waiting")
            else count.finished))
    return RunDetail(
        id=row["id"], workflow=row["workflow"], state=row["state"],
        input=masked_json(row["input"]), result=masked_json(row["result"]),
        failed_step=row["failed_step"], error=row["error"], unique_key=row["unique_key"],
        parent_run=row["parent_run"], parent_step=row["parent_step"],
        created_at=row["created_at"], finished_at=row["finished_at"], steps=tuple(steps),
        events=tuple(await job_events(db, run_id)),
        next_cursor=_job_cursor(job_rows[-1]) if len(job_rows) == limit else None)


# -- steer ------------------------------------------------------------------------


async def cancel_run(db: Database, run_id: UUID, *, actor: str = "api") -> str:
    """
    Cancel a running run (as `Queue.cancel_run`: its waiting steps cancelled, its
    running steps' jobs asked to stop, its child runs cancelled); returns
    "cancelled". Recorded in the run's timeline as done by `actor`.

    Raises:
        RunNotFound: no run has this id.
        RunRefused: the run has ended already.
    """
    async def cancel() -> str | None:
        async with db.transaction() as tx:
            answer: str | None = await tx.fetchval(Q.workflow_cancel, run_id)
            if answer == "cancelled":
                await record(tx, run_id, "cancelled", actor, "run")
            return answer

    answer = await retry_conflicts(cancel)
    if answer == "cancelled":
        return answer
    if answer is None:
        raise RunNotFound(f"no run {run_id}")
    raise RunRefused(f"run {run_id} has already ended ({answer.removeprefix('already ')})")


async def retry_run(db: Database, run_id: UUID, *, actor: str = "api") -> str:
    """
    Run a failed or cancelled run again (as `Queue.retry_run`: its failed,
    cancelled and never-started steps start over once their dependencies have
    completed, completed steps keep their results); returns "retried". The
    steps' jobs wake workers through the channel the run was started with.
    Recorded in the run's timeline as done by `actor`.

    Raises:
        RunNotFound: no run has this id.
        RunRefused: the run is running or completed, or a step of it (or of a
            child run) asked to stop is still running.
    """
    async def retry() -> str | None:
        async with db.transaction() as tx:
            answer: str | None = await tx.fetchval(Q.workflow_retry, run_id)
            if answer == "retried":
                await record(tx, run_id, "retried", actor, "run")
            return answer

    answer = await retry_conflicts(retry)
    if answer == "retried":
        return answer
    if answer is None:
        raise RunNotFound(f"no run {run_id}")
    if answer.startswith("still stopping: "):
        raise RunRefused(f"run {run_id}: a step asked to stop is still running "
                         f"({answer.removeprefix('still stopping: ')}); retry once it has "
                         "ended, within a heartbeat or so")
    state = answer.removeprefix("not failed: ")
    raise RunRefused(f"run {run_id} is {state}: only failed or cancelled runs can be "
                     "retried")
