"""
What the engine and its stores agree on: the claimed job, the outcomes a
store reports, the worker's identity and heartbeat, and the two store
protocols (`LaneStore`, one lane's operations; `JobStore`, the worker's).
Moved here from `jobs.py` (issue #20); `builds.store.PgJobStore` implements
both for build jobs, `plain.store.PlainJobStore` the lane part for plain jobs.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from datetime import datetime
from typing import Protocol
from uuid import UUID

import attrs

from ..errors import OutcomeUnknown
from ..job_errors import JobError

MAX_ATTEMPTS_EXCEEDED = "max attempts exceeded"
INVALID_PAYLOAD = "invalid job payload"

#: Stuck jobs the sweep chooses per statement; it loops until none is left.
#: The role the maintenance leader holds (`nasiko_queue_leaders.role`).
MAINTENANCE_ROLE = "maintenance"


class JobStatus(enum.StrEnum):
    """`build_jobs.status`; TEXT + CHECK in the schema."""

    PENDING = "pending"
    IN_PROGRESS = "in_progress"
    DONE = "done"
    FAILED = "failed"


class BuildReport(enum.StrEnum):
    """
    An outcome an executor reported through its context (`JobContext.report_success`,
    `report_failure`): the status the completer's statement writes to the job's build
    row, in the same statement as the job's own done or failed (issue #13).
    """

    SUCCESS = "success"
    FAILED = "failed"


#: A claim as the worker's books key it (`ClaimedJob.claim`): id, attempt, token.
ClaimKey = tuple[UUID, int, UUID | None]


@attrs.frozen(kw_only=True)
class ClaimedJob:
    """A job this worker has just claimed, as the claim returned it: a build job
    (`build_jobs`), or a plain job (`nasiko_queue_jobs`, with `queue` set)."""

    id: UUID
    agent_id: UUID | None
    connector_id: UUID | None
    #: The user who caused a build job; None for a plain job.
    owner_id: UUID | None
    #: The payload column as JSON text; parsed by the worker, not by the claim.
    #: None when it is larger than `QueueConfig.max_payload_bytes` (written by
    #: another writer; enqueue refuses such payloads): the claim did not send it.
    payload: str | None = attrs.field(repr=False)
    #: `attempt` before this claim's increment (the original's `old_attempt`).
    old_attempt: int
    created_at: datetime
    #: The target agent has `deleted_at` set (the job must not run).
    target_soft_deleted: bool = False
    #: A plain job's queue, kind (its own column), runs allowed and priority.
    queue: str | None = None
    kind: str | None = None
    max_attempts: int | None = None
    priority: int = 0
    #: The worker the claim named (`claimed_by`; None for a tool with no worker
    #: row).
    claimed_by: UUID | None = None
    #: The token the claim wrote on the row (`claim_token`), new for every claim
    #: statement. Every write the worker makes to this claim names it: the
    #: attempt alone cannot tell this run from a later one after a dead-letter
    #: retry (attempts start from 0 again) or a give-back (the attempt is
    #: restored, so the next claim has the same attempt number). A worker that
    #: registered anew after the fence still names its old claims by their
    #: tokens. None only for a job made by hand (a test of timer logic).
    claim_token: UUID | None = None

    @property
    def order(self) -> tuple[int, datetime]:
        """Where it goes in the local buffer: as the claim ordered it."""
        return (self.priority, self.created_at)

    @property
    def attempt(self) -> int:
        """The row's attempt now: which run this is (1-based)."""
        return self.old_attempt + 1

    @property
    def claim(self) -> ClaimKey:
        """This claim, in the worker's own books (`WorkerState.job_scopes`,
        `cancels`): one worker may hold two claims of one job at once, of the
        same attempt even (a fenced run still unwinding, and the claim its new
        identity made after an operator's retry)."""
        return (self.id, self.attempt, self.claim_token)

    @property
    def is_connector_job(self) -> bool:
        return self.connector_id is not None


@attrs.frozen
class JobResult:
    """What a plain job's executor returned, as the completing statement writes it
    (`nasiko_queue_jobs.result`, issue #22): JSON text, checked and within
    `QueueConfig.max_result_bytes`."""

    json: str


#: A finish as the store sends it: the job, the build row that decides it (None for
#: a plain job), and what its executor reported: for a build job, through its
#: context (None: nothing, the build row decides as it stands); for a plain job,
#: the value it returned (None: it returned None).
Finishing = tuple[ClaimedJob, UUID | None, BuildReport | JobResult | None]

#: A start write (`JobContext.mark_building`): the job and its build row.
Starting = tuple[ClaimedJob, UUID]


@attrs.frozen
class RecoveryResult:
    """What one recovery sweep did."""

    #: Stuck jobs with no attempts left, now failed (their targets terminalized).
    failed: int
    #: Stuck jobs with attempts left, now pending again.
    reset: int
    #: Stuck jobs with no attempts left that met a lock or a conflict (a lock
    #: timeout, a deadlock); they are tried again at the next sweep.
    skipped: int = 0
    #: Stuck plain jobs (running past the limit, no live worker holds them)
    #: now available again, attempt counted.
    plain_reset: int = 0
    #: Stuck plain jobs discarded (it was their last attempt) or cancelled.
    plain_ended: int = 0


@attrs.frozen
class LostClaim:
    """A claim that may have committed although its answer never came."""

    #: The token the claim wrote on every row it took (`build_jobs.claim_token`).
    token: UUID
    #: The server process that received it; it must be gone before the claim is
    #: looked at, or the claim could still be on its way.
    backend_pid: int | None


@attrs.frozen
class WorkerIdentity:
    """Who a worker is, for its row in `nasiko_queue_workers` (and `status`)."""

    id: UUID
    host: str
    pid: int
    #: The payload kinds it claims.
    kinds: tuple[str, ...]
    #: The queues it serves ("builds" for the build jobs), each with its concurrency.
    queues: tuple[tuple[str, int], ...] = ()


@attrs.frozen
class Heartbeat:
    """What one heartbeat learnt."""

    #: The worker's row is there and not declared dead. False: its jobs were (or
    #: are being) rescued; it must stop them and register anew.
    alive: bool
    #: It holds the role it asked for (the maintenance leadership).
    leader: bool
    #: Plain jobs it runs whose cancel was asked for: stop them.
    cancels: tuple[UUID, ...] = ()


@attrs.frozen
class RescueResult:
    """What one rescue round did."""

    #: Workers whose heartbeat had gone stale, now declared dead.
    declared_dead: int
    #: Their jobs with no attempts left, now failed (targets terminalized).
    failed: int
    #: Their other jobs, back to pending (attempt counted).
    rescued: int
    #: Jobs that met a lock or a conflict; tried again at the next round.
    skipped: int = 0


class ClaimOutcomeUnknown(OutcomeUnknown):
    """A claim (or a finish carrying one) got no answer: see `PgJobStore.resolve_lost_claim`."""

    def __init__(self, claim: LostClaim, cause: OutcomeUnknown) -> None:
        super().__init__(str(cause), backend_pid=claim.backend_pid)
        self.claim = claim


class LaneStore(Protocol):
    """
    What one lane of a worker (its producer, completer and slots) does to its
    jobs: `PgJobStore` for build jobs, `plain.store.PlainJobStore` for one queue
    of plain jobs.
    """

    async def claim(self, limit: int) -> list[ClaimedJob]: ...

    async def finish_many_and_claim(
        self, finishing: Sequence[Finishing], limit: int, *, starts: Sequence[Starting] = ()
    ) -> tuple[dict[UUID, JobStatus | None], list[ClaimedJob]]: ...

    async def resolve_lost_claim(self, claim: LostClaim) -> int: ...

    async def unclaim(self, jobs: list[ClaimedJob]) -> int: ...

    async def reset(self, job: ClaimedJob) -> bool: ...

    async def record_error(self, job: ClaimedJob, error: JobError) -> None: ...

    async def discard_unrecorded(self, job: ClaimedJob, why: str) -> bool: ...


class JobStore(LaneStore, Protocol):
    """The worker's operations on the queue; see `PgJobStore` for the meaning of each."""

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

    async def register_worker(self, identity: WorkerIdentity) -> None: ...

    async def heartbeat(self, role: str | None) -> Heartbeat: ...

    async def retire_worker(self) -> None: ...

    async def deregister_worker(self) -> None: ...

    async def rescue(self) -> RescueResult: ...

    async def record_error(self, job: ClaimedJob, error: JobError) -> None: ...


