"""
The executable form of docs/rules.md §5–§7: what every row must be after each event.

`QueueModel` has no I/O. Given the same events as the real engine (enqueue, a
drain in which each run of each job does what the script says, a crashed
worker's claim, aging, a sweep, deletions), it says what every job row (status,
attempt, error_msg, whether picked_at and completed_at are set) and every
target and build row must be. The state machine in `machine.py` drives the real
engine and this model side by side and compares them after every step; a
reader can also check the model against docs/rules.md line by line, which is the
point of keeping it this plain.

.. versionadded:: 0.1.0
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from uuid import UUID

import attrs

# The fixed error strings of docs/rules.md §5, spelled out here and not imported
# from the engine: the model is an independent statement of the rules, so that
# an engine whose message drifts from the documented one disagrees with it.
MAX_ATTEMPTS_EXCEEDED = "max attempts exceeded"
INVALID_PAYLOAD = "invalid job payload"
TARGET_DELETED = "target deleted"
JOB_PANICKED = "job panicked during execution"
BUILD_FAILED = "build or deploy step failed — see the relevant *_builds row for details"
#: The messages of a job failed for good by the engine, whose target it terminalizes.
TERMINALIZING = frozenset({MAX_ATTEMPTS_EXCEEDED, INVALID_PAYLOAD, JOB_PANICKED})


class Outcome(enum.Enum):
    """What one run of an executor does (the fake outside world's script)."""

    #: The build works: build row 'success', the target 'running'.
    SUCCEED = "succeed"
    #: The build fails in the ordinary way: build row 'failed', target 'failed'.
    FAIL = "fail"
    #: The executor crashes: build row 'building', then an exception.
    RAISE = "raise"
    #: The executor never returns (build row 'building'); the worker is hard-stopped.
    HANG = "hang"
    #: Someone hard-deletes the target during the build; the executor returns.
    DELETE_TARGET = "delete_target"
    #: Someone soft-deletes the agent during the build; the build still succeeds.
    SOFT_DELETE = "soft_delete"
    #: The executor returns without touching its build row (it stays queued).
    NO_REPORT = "no_report"
    #: The executor writes 'building' and returns: not a success.
    REPORT_BUILDING = "report_building"


#: The outcomes every executor under the harness has had to play since 0.1.0;
#: `NO_REPORT` and `REPORT_BUILDING` came later (see `QueueStateMachine.outcomes`).
CLASSIC_OUTCOMES = (Outcome.SUCCEED, Outcome.FAIL, Outcome.RAISE, Outcome.HANG,
                    Outcome.DELETE_TARGET, Outcome.SOFT_DELETE)


class TargetKind(enum.Enum):
    AGENT = "agent"
    CONNECTOR = "connector"


@attrs.define
class TargetState:
    """An agent (status = agents.status) or a connector (status = build_status)."""

    kind: TargetKind
    id: UUID
    status: str
    soft_deleted: bool = False
    #: Build rows of this target: id → status.
    builds: dict[UUID, str] = attrs.Factory(dict)


@attrs.define
class JobState:
    """One build_jobs row as the model expects it."""

    id: UUID
    seq: int
    #: The payload's kind as the claim sees it (None when there is none).
    kind: str | None
    valid: bool
    target: UUID
    #: The build row the job drives, when the payload names one.
    build_id: UUID | None
    plan: tuple[Outcome, ...] = ()
    status: str = "pending"
    attempt: int = 0
    error_msg: str | None = None
    picked: bool = False
    completed: bool = False
    #: Minutes since picked_at, as the machine set it in SQL (0: just claimed).
    age_mins: int = 0
    #: The registered worker whose claim holds it (None: a claim naming no worker,
    #: as the original's SQL makes, or none).
    holder: UUID | None = None
    #: How many times an executor ran this job.
    runs: int = 0

    def next_outcome(self) -> Outcome:
        """The outcome of the next run (SUCCEED once the script is used up)."""
        return self.plan[self.attempt] if self.attempt < len(self.plan) else Outcome.SUCCEED

    def remaining_plan(self) -> tuple[Outcome, ...]:
        return self.plan[self.attempt:]


@attrs.define
class DrainResult:
    """What a drain did, for the machine's bookkeeping."""

    hung: UUID | None = None
    ran: list[UUID] = attrs.Factory(list)


@attrs.define
class QueueModel:
    """
    The queue as docs/rules.md says it must be.

    Args:
        max_attempts: MAX_ATTEMPTS.
        runnable: kinds the worker has executors for; other *known* kinds stay
            pending, unknown kinds are claimed and fail as invalid.
        known: every kind a payload type exists for.
        stuck_job_mins: the sweep's threshold, STUCK_JOB_MINS.
    """

    max_attempts: int
    runnable: frozenset[str]
    known: frozenset[str]
    stuck_job_mins: int = 60
    jobs: dict[UUID, JobState] = attrs.Factory(dict)
    targets: dict[UUID, TargetState] = attrs.Factory(dict)
    #: Jobs whose row went with their deleted target.
    gone: set[UUID] = attrs.Factory(set)
    #: Registered workers the machine plays: id -> "alive", "expired" (its
    #: heartbeat older than its lease) or "dead" (declared so by a rescue).
    workers: dict[UUID, str] = attrs.Factory(dict)
    _seq: int = 0

    # -- events from the application ------------------------------------------------

    def add_target(self, target: TargetState) -> None:
        self.targets[target.id] = target

    def add_job(
        self,
        job_id: UUID,
        *,
        kind: str | None,
        valid: bool,
        target: UUID,
        build_id: UUID | None,
        plan: Iterable[Outcome] = (),
    ) -> JobState:
        self._seq += 1
        job = JobState(id=job_id, seq=self._seq, kind=kind, valid=valid, target=target,
                       build_id=build_id, plan=tuple(plan))
        self.jobs[job_id] = job
        return job

    def hard_delete(self, target_id: UUID) -> None:
        """DELETE the agent or connector: its builds and jobs go by cascade."""
        self.targets.pop(target_id, None)
        for job in [j for j in self.jobs.values() if j.target == target_id]:
            del self.jobs[job.id]
            self.gone.add(job.id)

    def soft_delete(self, target_id: UUID) -> None:
        target = self.targets.get(target_id)
        if target is not None and target.kind is TargetKind.AGENT:
            target.soft_deleted = True

    # -- the claim ----------------------------------------------------------------------

    def claimable(self) -> list[JobState]:
        """Pending jobs a worker would claim, oldest first (docs/rules.md §5, the claim)."""
        return sorted(
            (j for j in self.jobs.values()
             if j.status == "pending"
             and (j.kind in self.runnable or j.kind not in self.known)),
            key=lambda j: j.seq,
        )

    def claim(self, job: JobState, holder: UUID | None = None) -> int:
        """in_progress, picked_at now(), attempt + 1; returns old_attempt."""
        old = job.attempt
        job.status, job.attempt, job.picked, job.age_mins = "in_progress", old + 1, True, 0
        job.holder = holder
        return old

    def crash_claim(self, holder: UUID | None = None) -> JobState | None:
        """A worker claims the oldest job and dies: the row stays in_progress."""
        pending = self.claimable()
        if not pending:
            return None
        self.claim(pending[0], holder)
        return pending[0]

    # -- a drain ------------------------------------------------------------------------

    def drain(self, stop_after_runs: int | None = None) -> DrainResult:
        """
        What one worker does from start to idle: the startup sweep, then claims
        oldest first until none is pending. A hanging executor ends the drain
        with a hard stop, which puts its job back to pending at once; a graceful
        stop requested during the n-th run (`stop_after_runs`) lets that job
        finish and claims nothing more.
        """
        self.recover()
        result = DrainResult()
        while True:
            pending = self.claimable()
            if not pending:
                return result
            job = pending[0]
            hung = self._process(job, result)
            if hung:
                result.hung = job.id
                return result
            if stop_after_runs is not None and len(result.ran) >= stop_after_runs:
                return result

    def _process(self, job: JobState, result: DrainResult) -> bool:
        old = self.claim(job)
        if old >= self.max_attempts:                          # 1. the cap
            self._fail(job, MAX_ATTEMPTS_EXCEEDED, terminalize=True)
            return False
        if not job.valid:                                     # 2. parse
            self._fail(job, INVALID_PAYLOAD, terminalize=True)
            return False
        target = self.targets[job.target]
        if target.soft_deleted:                               # 3. soft-deleted target
            self._fail(job, TARGET_DELETED, terminalize=False)
            return False
        outcome = job.plan[old] if old < len(job.plan) else Outcome.SUCCEED
        job.runs += 1                                         # 4. run
        result.ran.append(job.id)
        if outcome is Outcome.HANG:
            self._set_build(job, "building")
            self._reset(job)                                  # hard stop: back at once
            return True
        if outcome is Outcome.RAISE:
            self._set_build(job, "building")
            if old + 1 >= self.max_attempts:
                self._fail(job, JOB_PANICKED, terminalize=True)
            else:
                self._reset(job)
            return False
        if outcome is Outcome.DELETE_TARGET:
            self.hard_delete(job.target)
            return False
        if outcome is Outcome.SOFT_DELETE:
            self.soft_delete(job.target)
        if outcome is Outcome.NO_REPORT:
            pass                                              # build row untouched
        elif outcome is Outcome.REPORT_BUILDING:
            self._set_build(job, "building")
        elif outcome is Outcome.FAIL:
            self._set_build(job, "failed")
            target.status = "failed"
        else:  # SUCCEED, or SOFT_DELETE followed by a successful build
            self._set_build(job, "success")
            target.status = "running"
        self._finish_from_build(job)
        return False

    def _finish_from_build(self, job: JobState) -> None:
        """Read the build row: 'success' → done; anything else, or none → failed."""
        target = self.targets.get(job.target)
        build = None if target is None or job.build_id is None else target.builds.get(job.build_id)
        if build == "success":
            job.status, job.error_msg, job.completed = "done", None, True
        else:
            job.status, job.error_msg, job.completed = "failed", BUILD_FAILED, True

    def _set_build(self, job: JobState, status: str) -> None:
        target = self.targets[job.target]
        if job.build_id is not None and job.build_id in target.builds:
            target.builds[job.build_id] = status

    def _reset(self, job: JobState) -> None:
        job.status, job.picked, job.holder = "pending", False, None

    def _fail(self, job: JobState, message: str, *, terminalize: bool) -> None:
        job.status, job.error_msg, job.completed = "failed", message, True
        target = self.targets.get(job.target)
        if target is None:
            return
        if terminalize:
            self._terminalize(target, job.build_id)
        elif (job.build_id is not None and target.kind is TargetKind.AGENT
              and target.builds.get(job.build_id) in ("queued", "building")):
            # A job that will never run ends its own build row.
            target.builds[job.build_id] = "failed"

    # -- terminalization (docs/rules.md §6) ---------------------------------------------

    def _terminalize(self, target: TargetState, own_build: UUID | None) -> None:
        if target.kind is TargetKind.AGENT:
            for build_id, status in target.builds.items():
                if status == "building" or (build_id == own_build and status == "queued"):
                    target.builds[build_id] = "failed"
            if "success" in target.builds.values():
                if target.status == "deploying":
                    target.status = "failed"
            else:
                self.hard_delete(target.id)
        else:
            for build_id, status in target.builds.items():
                if status in ("pending", "building"):
                    target.builds[build_id] = "failed"
            if "success" in target.builds.values():
                if target.status in ("pending", "building"):
                    target.status = "failed"
            else:
                self.hard_delete(target.id)

    # -- recovery (docs/rules.md §7) ----------------------------------------------------

    def age(self, minutes: int | None = None) -> None:
        """Every in_progress row's picked_at is set `minutes` back (default: one
        minute past the stuck threshold)."""
        for job in self.jobs.values():
            if job.status == "in_progress":
                job.age_mins = self.stuck_job_mins + 1 if minutes is None else minutes

    def stuck(self, job: JobState) -> bool:
        """
        In progress, claimed longer ago than the threshold, and held by no live
        worker: the 60-minute rule is for claims that name no heartbeating worker.
        """
        return (job.status == "in_progress" and job.age_mins > self.stuck_job_mins
                and self._worker_state(job) not in ("alive", "expired"))

    def _worker_state(self, job: JobState) -> str | None:
        return None if job.holder is None else self.workers.get(job.holder)

    # -- workers, leases, rescue -------------------------------------------------------

    def expire(self, worker: UUID) -> None:
        """
        A minute passes for a worker that stopped heartbeating (it died, or is
        paused): longer than its lease. Its claims age with it.
        """
        if self.workers.get(worker) == "alive":
            self.workers[worker] = "expired"
        for job in self.jobs.values():
            if job.status == "in_progress" and job.holder == worker:
                job.age_mins += 1

    def rescue(self) -> tuple[int, int, int]:
        """
        One rescue round: expired workers are declared dead; the jobs dead workers
        hold go back to pending (attempt counted) or, out of attempts, fail and
        terminalize. Returns (declared dead, failed, rescued).
        """
        declared = 0
        for worker, state in self.workers.items():
            if state == "expired":
                self.workers[worker] = "dead"
                declared += 1
        held = sorted((j for j in self.jobs.values() if j.status == "in_progress"
                       and self._worker_state(j) == "dead"), key=lambda j: j.seq)
        failed = rescued = 0
        for job in held:
            if job.id not in self.jobs:
                continue
            if job.attempt >= self.max_attempts:
                self._fail(job, MAX_ATTEMPTS_EXCEEDED, terminalize=True)
                failed += 1
            else:
                job.status, job.picked, job.age_mins, job.holder = "pending", False, 0, None
                rescued += 1
        return declared, failed, rescued

    def recover(self) -> tuple[int, int]:
        """The two sweep statements: exhausted stuck jobs fail, the others go back."""
        stuck = sorted((j for j in self.jobs.values() if self.stuck(j)), key=lambda j: j.id)
        failed = 0
        for job in [j for j in stuck if j.attempt >= self.max_attempts]:
            if job.id in self.jobs:  # an earlier terminalization may have deleted it
                self._fail(job, MAX_ATTEMPTS_EXCEEDED, terminalize=True)
                failed += 1
        reset = 0
        for job in [j for j in stuck if j.attempt < self.max_attempts]:
            if job.id in self.jobs:
                job.status, job.picked, job.age_mins, job.holder = "pending", False, 0, None
                reset += 1
        return failed, reset

    # -- views ----------------------------------------------------------------------------

    def job_rows(self) -> dict[UUID, tuple[str, int, str | None, bool, bool]]:
        """Every job row: (status, attempt, error_msg, picked_at set, completed_at set)."""
        return {j.id: (j.status, j.attempt, j.error_msg, j.picked, j.completed)
                for j in self.jobs.values()}

    def target_rows(self) -> dict[UUID, tuple[str, str, bool]]:
        """Every target: (kind, status, soft-deleted)."""
        return {t.id: (t.kind.value, t.status, t.soft_deleted) for t in self.targets.values()}

    def build_rows(self) -> dict[UUID, tuple[UUID, str]]:
        """Every build row: (target id, status)."""
        return {b: (t.id, s) for t in self.targets.values() for b, s in t.builds.items()}
