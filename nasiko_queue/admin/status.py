"""
A snapshot of the queue's health, for `nasiko-queue status` and for monitoring.

Kept apart from the CLI so that it can be tested, and called from an
application's own health endpoint, without parsing any output. Every figure
comes from one of the named `status` statements of ``db/queries.sql``; the
claim-plan check runs ``EXPLAIN`` (never ``EXPLAIN ANALYZE``: nothing is
claimed) on the worker's own claim statement.

Why check the plan at all: the claim must stay cheap however much finished
history the table holds, and that rests on one partial index. A migration that
drops or changes it, or a table whose statistics mislead the planner, turns
every claim into a scan of the whole history, silently. `status` makes it loud.

.. versionadded:: 0.1.0
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from datetime import datetime
from typing import Any

import attrs

from ..builds.payloads import BUILTIN_PAYLOAD_TYPES
from ..config import MAX_PAYLOAD_BYTES, STUCK_JOB_MINS
from ..db.database import Database
from ..db.statements import Q
from ..engine.contracts import JobStatus

#: The partial index that keeps claims cheap (migrations/0001_schema.sql).
WORK_QUEUE_INDEX = "build_jobs_work_queue"
#: The other partial index of pending rows (0011, by kind): the planner may take it
#: instead on a small table, and it serves the claim as well there.
PENDING_KIND_INDEX = "build_jobs_pending_kind"
_PENDING_INDEXES = frozenset({WORK_QUEUE_INDEX, PENDING_KIND_INDEX})

#: Below this many rows, reading all of `build_jobs` is what the planner rightly
#: prefers once the table is analyzed (measured: 5 rows give a Seq Scan, 50 the
#: index), so a claim without the index is reported, not warned about.
SMALL_TABLE_ROWS = 1000

#: `EXPLAIN` node types that read an index by name.
_INDEX_NODES = frozenset({"Index Scan", "Index Only Scan", "Bitmap Index Scan"})


@attrs.frozen(kw_only=True)
class ClaimPlan:
    """How PostgreSQL would find the next job to claim."""

    #: The claim reads a partial index of pending rows (`build_jobs_work_queue`, or
    #: on a small table `build_jobs_pending_kind`), by an index or bitmap index scan.
    uses_work_queue_index: bool
    #: The node that finds candidate jobs, e.g. "Bitmap Index Scan using
    #: build_jobs_work_queue" or, when the index is not used, "Seq Scan on build_jobs".
    node: str
    #: Rows in `build_jobs` when the plan was made (None: not counted).
    table_rows: int | None = None

    @property
    def is_warning(self) -> bool:
        """The claim scans without the index, and the table is big enough for that to hurt."""
        return not self.uses_work_queue_index and (
            self.table_rows is None or self.table_rows >= SMALL_TABLE_ROWS
        )

    def describe(self) -> str:
        """One line for people: what the claim uses, and whether that is a problem."""
        if self.uses_work_queue_index:
            return f"claim uses the partial index ({self.node})"
        if not self.is_warning:
            return (f"claim does not use {WORK_QUEUE_INDEX} ({self.node}); fine while the "
                    f"table holds only {self.table_rows} jobs")
        return f"WARNING: claim does not use {WORK_QUEUE_INDEX}: {self.node}"


@attrs.frozen(kw_only=True)
class QueueCounts:
    """One queue of plain jobs (`nasiko_queue_jobs`) at one moment."""

    queue: str
    #: Waiting and due now; waiting for their `run_at`; being run.
    available: int
    scheduled: int
    running: int
    #: Ended: done; discarded (the dead letters); cancelled.
    completed: int
    discarded: int
    cancelled: int
    #: Seconds the oldest due job has waited (None when none is due).
    oldest_available_age: float | None
    #: Throughput: jobs completed in the last minute, and in the last 5 minutes.
    completed_1m: int = 0
    completed_5m: int = 0

    def to_json(self) -> dict[str, Any]:
        return attrs.asdict(self)


@attrs.frozen(kw_only=True)
class UnservedQueue:
    """Waiting jobs that no live worker will run: a queue no live worker serves
    (`kind` None), or a kind of plain job that no live worker serving its queue
    runs. They wait until a worker that runs them starts (a typo in a queue name
    or a kind looks like this)."""

    queue: str
    #: Jobs waiting in it (due now or scheduled).
    waiting: int
    #: Seconds its oldest due job has waited (None: none is due yet).
    oldest_age: float | None
    #: The kind no live worker of the queue runs; None: the whole queue is unserved.
    kind: str | None = None

    def describe(self) -> str:
        jobs = f"{self.waiting} waiting job{'' if self.waiting == 1 else 's'}"
        if self.kind is None:
            return f"WARNING: queue {self.queue!r} has {jobs} and no live worker serves it"
        return (f"WARNING: queue {self.queue!r} has {jobs} of kind {self.kind!r}, which no "
                "live worker runs (a typo in the kind, or a worker not deployed yet)")

    def to_json(self) -> dict[str, Any]:
        return attrs.asdict(self)


@attrs.frozen(kw_only=True)
class WorkerRow:
    """One registered worker, live or dead."""

    id: str
    host: str
    pid: int
    kinds: tuple[str, ...]
    #: The queues it serves ("builds" for build jobs) and its concurrency in each;
    #: None for a worker of a version that did not record them.
    queues: Mapping[str, int] | None
    started_at: datetime
    heartbeat_at: datetime
    #: Seconds since its last heartbeat.
    heartbeat_age: float
    lease_secs: float
    #: Its heartbeat is within its lease and nobody declared it dead.
    alive: bool
    #: When a rescuer (or the worker itself, on a stop) declared it dead.
    dead_at: datetime | None
    #: Roles it holds now ("maintenance": it leads rescue, sweeps and retention).
    roles: tuple[str, ...]
    #: Jobs it holds (in progress, claimed by it).
    holding: int

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id, "host": self.host, "pid": self.pid, "kinds": list(self.kinds),
            "queues": None if self.queues is None else dict(self.queues),
            "started_at": self.started_at.isoformat(),
            "heartbeat_at": self.heartbeat_at.isoformat(),
            "heartbeat_age_seconds": self.heartbeat_age, "lease_seconds": self.lease_secs,
            "alive": self.alive,
            "dead_at": self.dead_at.isoformat() if self.dead_at else None,
            "roles": list(self.roles), "holding": self.holding,
        }


@attrs.frozen(kw_only=True)
class QueueStatus:
    """The queue at one moment: the counts of `build_jobs` (the whole table),
    its workers, and the queues of plain jobs."""

    #: Jobs per status, all four statuses present (zero when none).
    counts: Mapping[str, int]
    #: Jobs claimed and not finished right now.
    in_progress: int
    #: When the longest-held of those was claimed (None when none is held).
    oldest_picked_at: datetime | None
    #: How many held jobs are older than `stuck_job_mins`: the next recovery
    #: sweep will reset or fail them.
    stuck: int
    #: The threshold `stuck` was counted with.
    stuck_job_mins: int
    #: Seconds the oldest pending job has waited (None when none waits).
    oldest_pending_age: float | None
    #: What the claim statement's plan reads.
    claim_plan: ClaimPlan
    #: Every registered worker (live, then dead ones not yet forgotten).
    workers: tuple[WorkerRow, ...] = ()
    #: Every queue of plain jobs that holds a job, by name.
    queues: tuple[QueueCounts, ...] = ()
    #: Queues with waiting jobs that no live worker serves (build jobs as "builds").
    unserved: tuple[UnservedQueue, ...] = ()

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (timestamps in ISO 8601) for `status --json`."""
        return {
            "counts": dict(self.counts),
            "in_progress": {
                "held": self.in_progress,
                "oldest_picked_at": (
                    self.oldest_picked_at.isoformat() if self.oldest_picked_at else None
                ),
                "stuck": self.stuck,
                "stuck_job_mins": self.stuck_job_mins,
            },
            "oldest_pending_age_seconds": self.oldest_pending_age,
            "claim_plan": {
                "uses_work_queue_index": self.claim_plan.uses_work_queue_index,
                "node": self.claim_plan.node,
                "warning": self.claim_plan.is_warning,
                "description": self.claim_plan.describe(),
            },
            "workers": [w.to_json() for w in self.workers],
            "queues": [q.to_json() for q in self.queues],
            "unserved": [q.to_json() for q in self.unserved],
        }


async def queue_status(db: Database, *, stuck_job_mins: int = STUCK_JOB_MINS) -> QueueStatus:
    """
    Gather a `QueueStatus` (eight reads and one ``EXPLAIN``; nothing is written).

    Raises whatever the database raises, e.g. `asyncpg.UndefinedTableError`
    when the schema is not migrated.
    """
    counts = {status.value: 0 for status in JobStatus}
    for row in await db.fetch(Q.jobs_count_by_status):
        counts[row["status"]] = row["n"]
    # An aggregate without GROUP BY always returns exactly one row.
    held = await db.fetchrow(Q.jobs_in_progress_summary, stuck_job_mins) or {}
    age = await db.fetchval(Q.jobs_oldest_pending_age)
    throughput = await queue_throughput(db)
    return QueueStatus(
        counts=counts,
        in_progress=held.get("held", 0),
        oldest_picked_at=held.get("oldest_picked_at"),
        stuck=held.get("stuck", 0),
        stuck_job_mins=stuck_job_mins,
        oldest_pending_age=age,
        claim_plan=attrs.evolve(await explain_claim(db), table_rows=sum(counts.values())),
        workers=await list_workers(db),
        queues=tuple(QueueCounts(**dict(r), completed_1m=throughput.get(r["queue"], (0, 0))[0],
                                 completed_5m=throughput.get(r["queue"], (0, 0))[1])
                     for r in await db.fetch(Q.plain_queue_counts)),
        unserved=await unserved_queues(db),
    )


async def list_workers(db: Database) -> tuple[WorkerRow, ...]:
    """Every registered worker, live or dead (one read; no scan of the jobs)."""
    return tuple(WorkerRow(
        id=str(r["id"]), host=r["host"], pid=r["pid"], kinds=tuple(r["kinds"]),
        queues=None if r["queues"] is None else json.loads(r["queues"]),
        started_at=r["started_at"], heartbeat_at=r["heartbeat_at"],
        heartbeat_age=r["heartbeat_age"], lease_secs=r["lease_secs"], alive=r["alive"],
        dead_at=r["dead_at"], roles=tuple(r["roles"]), holding=r["holding"],
    ) for r in await db.fetch(Q.workers_list))


async def queue_throughput(db: Database) -> dict[str, tuple[int, int]]:
    """Per queue ("builds" too): jobs completed in the last minute and last 5 minutes."""
    return {r["queue"]: (r["completed_1m"], r["completed_5m"])
            for r in await db.fetch(Q.queue_throughput)}


async def unserved_queues(db: Database) -> tuple[UnservedQueue, ...]:
    """
    Queues holding waiting jobs that no live worker serves (by the `queues` each
    worker registered; a worker of an older version counts as serving all), then
    the kinds that no live worker of a served queue runs (`kind` set).
    Build jobs count as the queue "builds": workers of the original's code do not
    register, so a deployment that still runs them sees "builds" reported here.
    """
    return tuple(UnservedQueue(**dict(r)) for r in await db.fetch(Q.queues_unserved))


async def explain_claim(db: Database) -> ClaimPlan:
    """
    Plan the worker's claim as a worker running every built-in kind would send it.

    The parameters are realistic (one free slot; the seven built-in kinds both
    as the runnable and as the known kinds) because the planner's choice can
    depend on them.
    """
    kinds = [t.kind for t in BUILTIN_PAYLOAD_TYPES]
    # A newline, not a space: the named statement starts with a comment line.
    text = await db.fetchval("EXPLAIN (FORMAT JSON)\n" + Q.job_claim, 1, kinds, kinds,
                             MAX_PAYLOAD_BYTES, None, None)
    return plan_claim(json.loads(text) if isinstance(text, str) else text)


def plan_claim(explained: Any) -> ClaimPlan:
    """
    Read an ``EXPLAIN (FORMAT JSON)`` of `job_claim` and say how it finds jobs.

    The candidate search is the subplan of the ``next`` CTE; the rest of the
    plan (the update joined on the primary key, the soft-delete lookup on
    agents) is the same whatever the claim's health. When the CTE cannot be
    found (the statement was rewritten), the whole plan is searched.
    """
    root = explained[0]["Plan"]
    search = next(
        (n for n in _nodes(root) if n.get("Subplan Name") == "CTE next"),
        root,
    )
    nodes = list(_nodes(search))
    for node in nodes:
        if node.get("Node Type") in _INDEX_NODES and node.get("Index Name") in _PENDING_INDEXES:
            return ClaimPlan(
                uses_work_queue_index=True,
                node=f"{node['Node Type']} using {node['Index Name']}",
            )
    for node in nodes:
        if node.get("Relation Name") == "build_jobs" and "Scan" in node.get("Node Type", ""):
            using = f" using {node['Index Name']}" if node.get("Index Name") else ""
            return ClaimPlan(
                uses_work_queue_index=False,
                node=f"{node['Node Type']} on build_jobs{using}",
            )
    return ClaimPlan(uses_work_queue_index=False, node="no scan of build_jobs found in the plan")


def _nodes(node: Mapping[str, Any]) -> Iterator[Mapping[str, Any]]:
    """Every node of a JSON plan, depth first, parents before children."""
    yield node
    for child in node.get("Plans", ()):
        yield from _nodes(child)
