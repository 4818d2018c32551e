"""
The rules of workflow runs (migration 0018) as code: what every run, step row,
step job and signal must be.

`WorkflowModel` has no I/O. Given the same events as the real engine (a run
started, a step job's run that returned or raised, a worker that died holding a
step job and the leader's rescue, a signal, a run's cancel or retry) it says
what each run's and step row's state must be, which step jobs exist (and in
which state, at which attempt), and what `Queue.signal`, `Queue.cancel_run`
and `Queue.retry_run` must answer. `workflow_machine.py` drives the real engine
and this model side by side.

Which step job a one-slot worker claims among jobs due at the same instant is
the database's choice (ties of run_at), not a rule: the machine reports the
runs in the order they happened and the model checks that each was allowed
(its step enqueued, its run running, its job available) before applying it.

Keep it plain: it is the documentation of migration 0018's functions.

.. versionadded:: 0.2.0
"""

from __future__ import annotations

import enum
from collections import Counter
from typing import Any
from uuid import UUID

import attrs

BLOCKED = "blocked"
ENQUEUED = "enqueued"
WAITING = "waiting"
COMPLETED = "completed"
FAILED = "failed"
CANCELLED = "cancelled"
RUNNING = "running"
AVAILABLE = "available"
DISCARDED = "discarded"

#: Every step's attempts (the workflows' `max_attempts`).
MAX_ATTEMPTS = 2


class Outcome(enum.Enum):
    """What one run of a step's function does."""

    RETURN = "return"
    RAISE = "raise"


@attrs.frozen
class StepDef:
    name: str
    kind: str = "job"
    after: tuple[str, ...] = ()
    map_over: str | None = None


#: The machine's workflows: a chain, a diamond, a fan-out over a list, a signal wait.
WORKFLOWS: dict[str, tuple[StepDef, ...]] = {
    "chain": (StepDef("a"), StepDef("b", after=("a",)), StepDef("c", after=("b",))),
    "diamond": (StepDef("a"), StepDef("b", after=("a",)), StepDef("c", after=("a",)),
                StepDef("d", after=("b", "c"))),
    "fanout": (StepDef("src"), StepDef("item", after=("src",), map_over="src"),
               StepDef("sink", after=("item",))),
    "gate": (StepDef("a"), StepDef("go", kind="signal", after=("a",)),
             StepDef("b", after=("go",))),
}


@attrs.define
class StepJob:
    """One plain job of a step row (a retried run's step gets a new one)."""

    state: str = AVAILABLE
    attempt: int = 0
    cancel_requested: bool = False
    #: Held by a worker that died (until the rescue).
    held: bool = False


@attrs.define
class StepRow:
    state: str = BLOCKED
    #: Its jobs, oldest first; the live one is the last while `live`.
    jobs: list[StepJob] = attrs.Factory(list)
    live: bool = False
    #: Its result once completed (what its function returned, its items' results
    #: for a mapped step's head, the payload for a signal step).
    result: Any = None
    #: How many times its function ran (its result names the run that returned).
    runs: int = 0


@attrs.define
class WorkflowRun:
    id: UUID
    workflow: str
    #: A fan-out's list length (what its `src` step returns).
    size: int
    state: str = RUNNING
    rows: dict[tuple[str, int], StepRow] = attrs.Factory(dict)
    #: Signals sent: name -> [payload, consumed].
    signals: dict[str, list[Any]] = attrs.Factory(dict)

    @property
    def steps(self) -> tuple[StepDef, ...]:
        return WORKFLOWS[self.workflow]

    def head(self, step: StepDef) -> StepRow:
        return self.rows[(step.name, -1 if step.map_over else 0)]

    def rows_of(self, name: str) -> list[StepRow]:
        return [row for (step, _), row in self.rows.items() if step == name]

    def live_job(self, step: str, idx: int) -> StepJob | None:
        row = self.rows.get((step, idx))
        return row.jobs[-1] if row is not None and row.live and row.jobs else None


class WorkflowModel:
    """Runs, their step rows and jobs, as migration 0018 says they must be."""

    def __init__(self) -> None:
        self.runs: dict[UUID, WorkflowRun] = {}
        #: While the runs' rows are held (`hold`): each step job's end, its
        #: transition due, not applied (migration 0033).
        self.holding = False
        self.due: list[tuple[UUID, str, int, StepJob, str]] = []

    def hold(self) -> None:
        """Every running run's row is held by another transaction: a step job's
        end commits, its transition recorded as due (`apply_due` takes them)."""
        self.holding = True

    def apply_due(self, order: list[tuple[UUID, str, int]]) -> None:
        """The rows are free; the due transitions are applied in `order` (the
        database's: the order the jobs' ends committed, which is not the order
        their functions ran in, since a completion waits for the next claim)."""
        self.holding = False
        pending = {(run_id, step, idx): (job, state)
                   for run_id, step, idx, job, state in self.due}
        assert sorted(pending) == sorted(order), (
            f"transitions due: the database has {order}, the model {sorted(pending)}")
        self.due = []
        for key in order:
            job, state = pending[key]
            self._transition(*key, job, state)

    # -- the application ---------------------------------------------------------------

    def start(self, run_id: UUID, workflow: str, size: int) -> None:
        run = WorkflowRun(run_id, workflow, size)
        for step in run.steps:
            run.rows[(step.name, -1 if step.map_over else 0)] = StepRow()
        self.runs[run_id] = run
        self._advance(run)

    def signal(self, run_id: UUID, name: str, payload: Any) -> str | None:
        run = self.runs.get(run_id)
        if run is None:
            return None
        if name in run.signals:
            return "already sent"
        if run.state != RUNNING:
            return f"run {run.state}"
        if not any(s.name == name and s.kind == "signal" for s in run.steps):
            return "no such signal"
        run.signals[name] = [payload, False]
        row = run.rows[(name, 0)]
        if row.state == WAITING:
            run.signals[name][1] = True
            row.result = payload
            self._complete(run, name, 0)
            return "delivered"
        return "kept"

    def cancel(self, run_id: UUID) -> str | None:
        run = self.runs.get(run_id)
        if run is None:
            return None
        if run.state != RUNNING:
            return f"already {run.state}"
        run.state = CANCELLED
        self._stop_steps(run)
        return "cancelled"

    def retry(self, run_id: UUID) -> str | None:
        run = self.runs.get(run_id)
        if run is None:
            return None
        if run.state not in (FAILED, CANCELLED):
            return f"not failed: {run.state}"
        stopping = sorted({step for (step, _idx), row in run.rows.items()
                           if any(job.state == RUNNING for job in row.jobs)})
        if stopping:
            return "still stopping: " + ", ".join(stopping)
        run.state = RUNNING
        for row in run.rows.values():
            if row.state != COMPLETED:
                row.state, row.live = BLOCKED, False
        self._advance(run)
        return "retried"

    # -- workers -----------------------------------------------------------------------

    def claim(self, run_id: UUID, step: str, idx: int, *, held: bool) -> StepJob:
        """A worker claims the live job of step row (run, step, idx): it must be one
        the model has available (else AssertionError, the claim broke a rule)."""
        run = self.runs.get(run_id)
        assert run is not None, f"a step job of an unknown run {run_id} was claimed"
        job = run.live_job(step, idx)
        state = None if job is None else job.state
        assert state == AVAILABLE, (
            f"run {run_id} ({run.workflow}, {run.state}): step {step}[{idx}] was claimed, "
            f"but its row is {run.rows.get((step, idx))}")
        assert job is not None
        assert run.state == RUNNING
        assert run.rows[(step, idx)].state == ENQUEUED
        job.state, job.attempt, job.held = RUNNING, job.attempt + 1, held
        return job

    def ran(self, run_id: UUID, step: str, idx: int, attempt: int, outcome: Outcome) -> None:
        """A worker ran step row (run, step, idx)'s function, which did `outcome`."""
        job = self.claim(run_id, step, idx, held=False)
        assert job.attempt == attempt, (
            f"step {step}[{idx}] of run {run_id} ran attempt {attempt}; the model says "
            f"{job.attempt}")
        row = self.runs[run_id].rows[(step, idx)]
        row.runs += 1
        if outcome is Outcome.RETURN:
            row.result = self.returned(self.runs[run_id], step, idx, row.runs)
            self._job_ended(run_id, step, idx, job, COMPLETED)
        elif job.cancel_requested:
            self._job_ended(run_id, step, idx, job, CANCELLED)
        elif job.attempt >= MAX_ATTEMPTS:
            self._job_ended(run_id, step, idx, job, DISCARDED)
        else:
            job.state = AVAILABLE

    def not_run(self, run_id: UUID, step: str, idx: int) -> None:
        """
        A worker's claimed step job whose run has ended (its end was in flight as
        the job was claimed, migration 0034) or whose job a retry replaced: its
        executor does not run the step's function; the job asks to stop and ends
        `cancelled` (its end changes nothing).
        """
        run = self.runs[run_id]
        job = run.rows[(step, idx)].jobs[-1]
        assert job.state == RUNNING, (
            f"step {step}[{idx}] of run {run_id} was not run; its job is {job}")
        assert run.state != RUNNING, (
            f"step {step}[{idx}] of run {run_id} was not run, but its run runs")
        job.cancel_requested = True
        self._job_ended(run_id, step, idx, job, CANCELLED)

    @staticmethod
    def returned(run: WorkflowRun, step: str, idx: int, k: int) -> Any:
        """What the machine's step function returns on its `k`-th run of step row
        (step, idx) of `run` (`workflow_machine.WorkflowWorld.execute`)."""
        if step == "src":
            return [f"{k}:{j}" for j in range(run.size)]
        return {"step": step, "idx": idx, "run": k}

    def rescue(self) -> int:
        """The leader's rescue of the dead workers' step jobs: how many it ended or
        gave back."""
        rescued = 0
        for run in self.runs.values():
            for (step, idx), row in run.rows.items():
                for job in row.jobs:
                    if not job.held:
                        continue
                    job.held = False
                    rescued += 1
                    if job.cancel_requested:
                        self._job_ended(run.id, step, idx, job, CANCELLED)
                    elif job.attempt >= MAX_ATTEMPTS:
                        self._job_ended(run.id, step, idx, job, DISCARDED)
                    else:
                        job.state = AVAILABLE
        return rescued

    def held(self) -> bool:
        return any(job.held for run in self.runs.values() for row in run.rows.values()
                   for job in row.jobs)

    def available(self) -> list[tuple[UUID, str, int]]:
        return [(run.id, step, idx) for run in self.runs.values()
                for (step, idx), row in run.rows.items()
                if row.live and row.jobs and row.jobs[-1].state == AVAILABLE]

    # -- the rules (migration 0018) -------------------------------------------------------

    def _job_ended(self, run_id: UUID, step: str, idx: int, job: StepJob, state: str) -> None:
        """A step job's state became `state`: the trigger's transition (nothing, when
        its run has ended or a retry replaced it)."""
        job.state = state
        if self.holding and self.runs[run_id].state == RUNNING:
            self.due.append((run_id, step, idx, job, state))
            return
        self._transition(run_id, step, idx, job, state)

    def _transition(self, run_id: UUID, step: str, idx: int, job: StepJob, state: str) -> None:
        """The transition of a step job that ended in `state`."""
        run = self.runs[run_id]
        row = run.rows[(step, idx)]
        if run.state != RUNNING or not (row.live and row.jobs[-1] is job
                                        and row.state == ENQUEUED):
            return
        if state == COMPLETED:
            self._complete(run, step, idx)
        elif state == DISCARDED:
            self._fail(run, step, idx)
        else:
            row.state = CANCELLED
            self.cancel(run_id)

    def _complete(self, run: WorkflowRun, step: str, idx: int) -> None:
        run.rows[(step, idx)].state = COMPLETED
        head = run.rows.get((step, -1))
        if idx >= 0 and head is not None and all(
                row.state == COMPLETED for (s, i), row in run.rows.items()
                if s == step and i >= 0):
            head.state = COMPLETED
            head.result = [run.rows[(step, i)].result for i in range(run.size)]
        self._advance(run)

    def _fail(self, run: WorkflowRun, step: str, idx: int) -> None:
        run.rows[(step, idx)].state = FAILED
        if idx >= 0 and (step, -1) in run.rows:
            run.rows[(step, -1)].state = FAILED
        run.state = FAILED
        self._stop_steps(run)

    def _stop_steps(self, run: WorkflowRun) -> None:
        for row in run.rows.values():
            if row.state in (BLOCKED, ENQUEUED, WAITING):
                row.state = CANCELLED
                job = row.jobs[-1] if row.live and row.jobs else None
                if job is not None and job.state == AVAILABLE:
                    job.state = CANCELLED
                elif job is not None and job.state == RUNNING:
                    job.cancel_requested = True

    def _ready(self, run: WorkflowRun, step: StepDef) -> bool:
        return run.head(step).state == BLOCKED and all(
            row.state == COMPLETED for dep in step.after for row in run.rows_of(dep))

    def _enqueue(self, row: StepRow) -> None:
        row.state, row.live = ENQUEUED, True
        row.jobs.append(StepJob())

    def _advance(self, run: WorkflowRun) -> None:
        if run.state != RUNNING:
            return
        progressed = True
        while progressed:
            progressed = False
            for step in run.steps:
                if not self._ready(run, step):
                    continue
                if step.map_over is not None:
                    if run.size == 0:
                        run.head(step).state, run.head(step).result = COMPLETED, []
                        progressed = True
                        continue
                    run.head(step).state = ENQUEUED
                    for i in range(run.size):
                        row = run.rows.setdefault((step.name, i), StepRow())
                        if row.state != COMPLETED:
                            self._enqueue(row)
                elif step.kind == "job":
                    self._enqueue(run.head(step))
                else:  # a signal step
                    row = run.head(step)
                    sent = run.signals.get(step.name)
                    if sent is not None and not sent[1]:
                        sent[1] = True
                        row.state, row.result = COMPLETED, sent[0]
                        progressed = True
                        continue
                    row.state = WAITING
        if all(row.state == COMPLETED for row in run.rows.values()):
            run.state = COMPLETED

    # -- what the database must hold ---------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        """Comparable with `workflow_machine.snapshot` of the database."""
        return {
            "runs": {run.id: run.state for run in self.runs.values()},
            "steps": {(run.id, step, idx): row.state for run in self.runs.values()
                      for (step, idx), row in run.rows.items()},
            "jobs": {(run.id, step, idx): Counter((j.state, j.attempt, j.cancel_requested)
                                                  for j in row.jobs)
                     for run in self.runs.values() for (step, idx), row in run.rows.items()
                     if row.jobs},
            "live": {(run.id, step, idx): (row.jobs[-1].state, row.jobs[-1].attempt)
                     for run in self.runs.values() for (step, idx), row in run.rows.items()
                     if row.live and row.jobs},
            "signals": {(run.id, name): sent[1] for run in self.runs.values()
                        for name, sent in run.signals.items()},
            "results": {(run.id, step, idx): row.result for run in self.runs.values()
                        for (step, idx), row in run.rows.items() if row.state == COMPLETED},
        }
