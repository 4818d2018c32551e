"""
A Hypothesis state machine that drives the real engine's workflows (issue #22,
migration 0018) against `WorkflowModel`.

A sibling of the plain-job machine, not more rules in it: its examples start
runs of four fixed workflows (a chain, a diamond, a fan-out over a list, a
signal wait) and mix no plain jobs of their own, its budget is its own
(`workflow_profile`), and the plain machine keeps its examples. It shares that
machine's runner (`runner.py`) and its worker path: step jobs are plain jobs,
run by a real `Worker` with one slot, claimed and held by a registered worker
that dies, given back by the leader's rescue.

Every step does something to the runs — start one (with a plan: how many of
its steps' first runs raise), let a worker drain the queue, have a worker
claim a step job and die, let a worker drain while the runs' rows are held
and die before its transitions are applied (another worker's transition
service applies them, migration 0033), run the rescue, send a signal (before
its step waits, after, twice), cancel a run, cancel one while a worker's claim
of its next step job is in flight (gated; the cancel in an application's
transaction that commits only once the executor has started, or on its own),
retry one — and then compares every run,
step row, step job and signal with the model and checks the invariants:

* no step job exists, and no step's function starts, before every step it
  depends on has completed (all its rows: a mapped step's every item);
* a completed step row's result is written once: it never changes, nor does
  the row leave `completed` (a retry keeps it);
* a run is completed exactly when all its step rows are, and failed exactly
  when one of its steps' jobs was discarded;
* an ended run (failed, cancelled) has no step job waiting to run, and none
  running that was not asked to stop; a step whose run's cancel raced its
  claim does not run its function, and its job ends `cancelled`;
* a signal is delivered once: one signal row per name, its step's result the
  first payload sent, the step after it enqueued once (the model counts every
  step job).

.. versionadded:: 0.2.0
"""

from __future__ import annotations

import contextlib
import itertools
import json
import uuid
from collections import Counter
from collections.abc import Callable
from typing import Any, ClassVar
from uuid import UUID

import attrs
import trio
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant, precondition, rule

from ..builds.store import PgJobStore
from ..config import QueueConfig
from ..db.database import Database
from ..db.statements import Q
from ..engine.contracts import WorkerIdentity
from ..engine.worker import Worker
from ..executors import Executors
from ..plain.store import PlainJobStore
from ..queue import Queue
from ..workflows.definition import StepContext, Workflow
from ..workflows.transitions import TransitionConfig, TransitionService
from .runner import DatabaseMachine, profile, run_machine
from .workflow_model import (
    CANCELLED,
    FAILED,
    MAX_ATTEMPTS,
    RUNNING,
    WORKFLOWS,
    Outcome,
    WorkflowModel,
    WorkflowRun,
)

#: The queue of every step job (the workflows' default).
QUEUE = "workflows"
#: The one signal step's name (of "gate"), and one no workflow has.
SIGNAL = "go"
NO_SIGNAL = "nope"
#: The mapped items a plan covers (a fan-out's list has at most this many).
MAX_ITEMS = 3

#: One slot on the steps' queue, no maintenance of its own (the machine plays
#: the leader), slow polls: a drain is woken, never polled. No look-ahead: the
#: adaptive default would claim by run times, so which step runs when would
#: follow the clock and the examples would not replay.
WORKFLOW_CONFIG = QueueConfig(
    queues={QUEUE: 1},
    prefetch=0,
    builds=False,
    maintenance=False,
    poll_interval=60.0,
    recovery_interval=3600.0,
    # A step asked to stop ends at its worker's next heartbeat: soon.
    heartbeat_interval=0.5,
)

#: Emptied before every example (the runner's `testing_empty_tables` leaves the
#: workflow tables alone); a run's steps and signals go with it (ON DELETE CASCADE).
EMPTY_RUNS = ("WITH due AS (DELETE FROM nasiko_queue_workflow_due) "
              "DELETE FROM nasiko_queue_workflow_runs")

#: Step jobs due now: a drain is over when there are none.
DUE = """
SELECT count(*) FROM nasiko_queue_jobs
WHERE queue = $1 AND state = 'available' AND run_at <= now()
"""

#: Dependencies of step $2 of run $1 that have a row not completed.
OPEN_DEPS = """
SELECT count(*)
FROM nasiko_queue_workflow_runs AS r,
     jsonb_array_elements_text(nasiko_queue_wf_step_def(r.definition, $2) -> 'after') AS a(dep)
JOIN nasiko_queue_workflow_steps AS x ON x.step = a.dep
WHERE r.id = $1 AND x.run_id = r.id AND x.state <> 'completed'
"""

#: Step jobs whose step depends on one with a row not completed.
EARLY_JOBS = """
SELECT j.id, j.workflow_run, j.payload ->> 'step' AS step, a.dep, x.idx, x.state
FROM nasiko_queue_jobs AS j
JOIN nasiko_queue_workflow_runs AS r ON r.id = j.workflow_run,
     jsonb_array_elements_text(
         nasiko_queue_wf_step_def(r.definition, j.payload ->> 'step') -> 'after') AS a(dep)
JOIN nasiko_queue_workflow_steps AS x ON x.step = a.dep
WHERE x.run_id = r.id AND x.state <> 'completed'
"""

#: Each run's state beside what its step rows and jobs say.
RUN_CHECK = """
SELECT r.id, r.state,
       bool_and(s.state = 'completed') AS all_completed,
       bool_or(s.state = 'failed') AS any_failed,
       bool_or(s.state = 'failed' AND j.state = 'discarded') AS failed_discarded,
       (SELECT count(*) FROM nasiko_queue_jobs AS w
        WHERE w.workflow_run = r.id
          AND (w.state = 'available' OR (w.state = 'running' AND NOT w.cancel_requested)))
           AS live_jobs
FROM nasiko_queue_workflow_runs AS r
JOIN nasiko_queue_workflow_steps AS s ON s.run_id = r.id
LEFT JOIN nasiko_queue_jobs AS j ON j.id = s.job_id
GROUP BY r.id, r.state
"""

#: The step job the next claim of queue $1 takes (the claim's order: priority,
#: then due time, then id).
NEXT_CLAIM = """
SELECT id, workflow_run, payload ->> 'step' AS step, (payload ->> 'idx')::int AS idx
FROM nasiko_queue_jobs
WHERE queue = $1 AND state = 'available' AND run_at <= now()
ORDER BY priority, run_at, id LIMIT 1
"""

#: The advisory lock a gated claim waits for (`GATE_CLAIM`).
GATE = 4545

#: The claim of step job {job} waits for the gate, holding the job's row (the
#: claim's FOR UPDATE took it before this trigger runs): a claim in flight.
GATE_CLAIM = """
CREATE OR REPLACE FUNCTION workflow_machine_gate() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_advisory_xact_lock_shared({gate});
    RETURN NEW;
END $$;
DROP TRIGGER IF EXISTS workflow_machine_gate ON nasiko_queue_jobs;
CREATE TRIGGER workflow_machine_gate BEFORE UPDATE OF state ON nasiko_queue_jobs
    FOR EACH ROW
    WHEN (OLD.state = 'available' AND NEW.state = 'running' AND NEW.id = '{job}')
    EXECUTE FUNCTION workflow_machine_gate();
"""
UNGATE = "DROP TRIGGER IF EXISTS workflow_machine_gate ON nasiko_queue_jobs"

#: Sessions of this database waiting for a lock that backend $1 holds.
BLOCKED_BY = """
SELECT count(*) FROM pg_stat_activity
WHERE datname = current_database() AND $1::int = ANY (pg_blocking_pids(pid))
"""

SNAP_RUNS = "SELECT id, state FROM nasiko_queue_workflow_runs"
SNAP_STEPS = """
SELECT run_id, step, idx, state, job_id, result::text AS result
FROM nasiko_queue_workflow_steps
"""
SNAP_JOBS = """
SELECT id, workflow_run, payload ->> 'step' AS step, (payload ->> 'idx')::int AS idx, state,
       attempt, cancel_requested
FROM nasiko_queue_jobs WHERE workflow_run IS NOT NULL
"""
SNAP_SIGNALS = "SELECT run_id, name, consumed FROM nasiko_queue_workflow_signals"


class SimulatedCrash(Exception):
    """What a step's run planned to raise raises."""


@attrs.frozen(kw_only=True)
class RunSpec:
    """A run the machine starts: its workflow, a fan-out's list length, and how
    many of each job step's first runs raise (2: its first job is discarded)."""

    workflow: str
    size: int
    raises: tuple[int, ...]


def _run_specs(workflow: str | None = None) -> st.SearchStrategy[RunSpec]:
    return st.builds(
        RunSpec,
        workflow=st.sampled_from(tuple(WORKFLOWS)) if workflow is None else st.just(workflow),
        size=st.sampled_from((2, 0, 3, 1)),
        raises=st.lists(st.sampled_from((0, 1, 0, 2, 1)), min_size=6, max_size=6).map(tuple))


def job_rows(workflow: str) -> list[tuple[str, int]]:
    """The (step, idx) of a workflow's job-step rows a plan covers, in order."""
    rows: list[tuple[str, int]] = []
    for step in WORKFLOWS[workflow]:
        if step.map_over is not None:
            rows.extend((step.name, i) for i in range(MAX_ITEMS))
        elif step.kind == "job":
            rows.append((step.name, 0))
    return rows


class WorkflowWorld:
    """What each step's runs do, and a record of every run."""

    def __init__(self) -> None:
        #: Run -> (step, idx) -> how many of its first runs raise.
        self.raises: dict[UUID, dict[tuple[str, int], int]] = {}
        self.runs: Counter[tuple[UUID, str, int]] = Counter()
        #: The runs of this drain, in order: (run, step, idx, attempt, outcome).
        self.log: list[tuple[UUID, str, int, int, Outcome]] = []
        #: Step functions that started before a dependency had completed.
        self.early: list[str] = []

    async def execute(self, ctx: StepContext) -> Any:
        idx = ctx.index or 0
        key = (ctx.run_id, ctx.step, idx)
        self.runs[key] += 1
        k = self.runs[key]
        if await ctx.job.db.fetchval(OPEN_DEPS, ctx.run_id, ctx.step):
            self.early.append(f"step {ctx.step}[{idx}] of run {ctx.run_id} started before "
                              "its dependencies completed")
        fails = self.raises.get(ctx.run_id, {}).get((ctx.step, idx), 0)
        outcome = Outcome.RAISE if k <= fails else Outcome.RETURN
        self.log.append((ctx.run_id, ctx.step, idx, ctx.job.attempt, outcome))
        if outcome is Outcome.RAISE:
            raise SimulatedCrash(f"planned crash of run {k}")
        if ctx.step == "src":  # the list a fan-out maps over
            return [f"{k}:{j}" for j in range(ctx.input["size"])]
        return {"step": ctx.step, "idx": idx, "run": k}


def _no_backoff(_attempt: int) -> float:
    return 0.0


def machine_workflows(world: WorkflowWorld) -> dict[str, Workflow]:
    """The engine's workflows of `WORKFLOWS`, their job steps run by `world`."""

    async def body(ctx: StepContext) -> Any:
        return await world.execute(ctx)

    made: dict[str, Workflow] = {}
    for name, steps in WORKFLOWS.items():
        wf = Workflow(name, queue=QUEUE, max_attempts=MAX_ATTEMPTS)
        for step in steps:
            if step.kind == "signal":
                wf.signal(step.name, after=list(step.after))
            else:
                wf.step(name=step.name, after=list(step.after), map_over=step.map_over,
                        backoff=_no_backoff)(body)
        made[name] = wf
    return made


class WorkflowStateMachine(DatabaseMachine):
    """Workflow runs in the real engine against `WorkflowModel`, one step at a time."""

    runner: ClassVar[str] = "run_workflow_state_machine"
    config: ClassVar[QueueConfig] = WORKFLOW_CONFIG

    def __init__(self) -> None:
        super().__init__()
        self.world = WorkflowWorld()
        self.queue = Queue(self.env.db, config=self.config)
        self.workflows = machine_workflows(self.world)
        self.executors = Executors()
        for wf in self.workflows.values():
            self.executors.register_workflow(wf)
        self.model = WorkflowModel()
        #: Completed step rows' results, as first written.
        self.results: dict[tuple[UUID, str, int], str | None] = {}
        #: Workers that died holding a step job, not yet rescued.
        self.dead: list[UUID] = []
        self.payloads = itertools.count(1)
        self.rescuer = PgJobStore(self.env.db, self.config, runnable_kinds=frozenset(),
                                  known_kinds=frozenset())

    @initialize(specs=st.tuples(*(_run_specs(workflow) for workflow in WORKFLOWS)),
                drained=st.integers(0, 3).map(bool))
    def start_empty(self, specs: tuple[RunSpec, ...], drained: bool) -> None:
        """
        Empty tables (the runner's emptying, which keeps runs, and the runs';
        one initializer, so that no emptying follows a start); then a run of
        each workflow, drained at once (most examples). Steering: every example
        has a join, a fan-out and a signal wait, most begin with runs completed,
        failed (as planned) or waiting for their signal, so the rules that need
        such runs (a retry, a signal, a cancel of a run half done) are never
        starved by the few steps an example has.
        """
        self._call(self.env.db.execute, Q.testing_empty_build_jobs)
        self._call(self.env.db.execute, Q.testing_empty_tables)
        self._call(self.env.db.execute, EMPTY_RUNS)
        for spec in specs:
            self.start(spec)
        if drained:
            self.drain()

    # -- rules: the application ----------------------------------------------------------

    @rule(spec=_run_specs())
    def start(self, spec: RunSpec) -> None:
        """A run of one of the four workflows; its first steps are enqueued."""
        wf = self.workflows[spec.workflow]
        run_id = self._call(self.queue.start, wf, {"size": spec.size})
        self.world.raises[run_id] = dict(zip(job_rows(spec.workflow), spec.raises,
                                             strict=False))
        self.model.start(run_id, spec.workflow, spec.size)

    def _runs(self, data: st.DataObject, wanted: Callable[[WorkflowRun], bool]) -> UUID:
        """A run to act on: one that is `wanted` when there is one (most draws),
        else any (the refusals are rules too)."""
        runs = list(self.model.runs.values())
        preferred = [r.id for r in runs if wanted(r)]
        prefer = bool(preferred) and data.draw(st.integers(0, 3), label="prefer") > 0
        pool = preferred if prefer else [r.id for r in runs]
        run_id: UUID = data.draw(st.sampled_from(pool), label="run")
        return run_id

    @precondition(lambda self: self.model.runs)
    @rule(data=st.data(), twice=st.sampled_from((False, True, False)),
          other=st.sampled_from((False, False, False, False, True)))
    def signal(self, data: st.DataObject, twice: bool, other: bool) -> None:
        """`Queue.signal` to a run (a running "gate" mostly: before its step waits
        or after; `twice`: sent again at once); `other`: a name no step has."""
        run_id = self._runs(data, lambda r: r.workflow == "gate" and r.state == RUNNING)
        name = NO_SIGNAL if other else SIGNAL
        for _ in range(2 if twice else 1):
            payload = {"n": next(self.payloads)}
            answer = self._call(self.queue.signal, run_id, name, payload)
            got = None if answer is None else answer.value
            expected = self.model.signal(run_id, name, payload)
            assert got == expected, (
                f"signal {name} to run {run_id} answered {got!r}; the model says {expected!r}")

    @precondition(lambda self: self.model.runs)
    @rule(data=st.data(), retried=st.booleans())
    def cancel_run(self, data: st.DataObject, retried: bool) -> None:
        """`Queue.cancel_run` (of a running run mostly): its unfinished steps are
        cancelled, none starts. With `retried`, it is retried at once (a run
        half done: its completed steps must keep their results)."""
        run_id = self._runs(data, lambda r: r.state == RUNNING)
        answer = self._call(self.queue.cancel_run, run_id)
        expected = self.model.cancel(run_id)
        assert answer == expected, (
            f"cancel of run {run_id} answered {answer!r}; the model says {expected!r}")
        if retried:
            self._retry(run_id)

    @precondition(lambda self: self.model.available())
    @rule(in_app=st.booleans())
    def cancel_racing_a_claim(self, in_app: bool) -> None:
        """
        A worker's claim of the next step job holds its row (gated) as its run
        is cancelled: with `in_app`, inside an application's transaction that
        commits once the gate is open and the executor waits for it (or the
        step's function ran: the bug); else on its own. The cancel skips the
        held row; the executor, once the claim has committed, finds the run
        ended: the step does not run, its job ends `cancelled`. Then the drain
        goes on; the model replays what ran before the claim, the claim, the
        cancel, the step not run, and what ran after.
        """
        key, answer, expected, after = self._call(self._cancel_racing_a_claim, in_app)
        assert answer == expected, (
            f"cancel of run {key[0]} during a claim answered {answer!r}; the model says "
            f"{expected!r}")
        ran = [entry[:3] for entry in after]
        assert key not in ran[:1], (
            f"step {key[1]}[{key[2]}] of run {key[0]} ran although its run's cancel came "
            "while its claim was in flight")
        self.model.not_run(*key)
        for run_id, step, idx, attempt, outcome in after:
            self.model.ran(run_id, step, idx, attempt, outcome)
        assert not self.model.available(), (
            f"the drain left step jobs due: {self.model.available()}")

    async def _cancel_racing_a_claim(self, in_app: bool) -> tuple[
            tuple[UUID, str, int], str | None, str | None,
            list[tuple[UUID, str, int, int, Outcome]]]:
        db = self.env.db
        first = await db.fetchrow(NEXT_CLAIM, QUEUE)
        assert first is not None, f"no step job due; the model has {self.model.available()}"
        key = (first["workflow_run"], first["step"], first["idx"])
        await db.execute(GATE_CLAIM.format(gate=GATE, job=first["id"]))
        self.world.log = []
        worker = Worker(self.queue, self.executors)
        drained = trio.Event()

        async def drain() -> None:
            while True:
                await worker.drain_once(lanes=[QUEUE])
                if not await db.fetchval(DUE, QUEUE):
                    break
            drained.set()

        try:
            async with contextlib.AsyncExitStack() as gated, trio.open_nursery() as nursery, \
                    contextlib.AsyncExitStack() as app:
                # The gate before the worker starts: it claims as it starts.
                gate = await gated.enter_async_context(db.transaction())
                await gate.execute("SELECT pg_advisory_xact_lock($1)", GATE)
                await nursery.start(worker.run)
                nursery.start_soon(drain)
                # The claim of the job has locked its row and waits at the gate.
                await _blocked_by(db, await gate.fetchval("SELECT pg_backend_pid()"))
                # The drain's first claim, with no finish in its statement:
                # nothing ran before it, no transition is in flight.
                assert self.world.log == [], self.world.log
                self.model.claim(*key, held=False)
                expected = self.model.cancel(key[0])
                if in_app:
                    tx = await app.enter_async_context(db.transaction())
                    answer = await tx.fetchval(Q.workflow_cancel, key[0])
                    app_pid = await tx.fetchval("SELECT pg_backend_pid()")
                else:
                    answer = await self.queue.cancel_run(key[0])
                await gated.aclose()  # the gate opens: the claim commits, its executor starts
                if in_app:
                    while not self.world.log and not await db.fetchval(  # noqa: ASYNC110
                            BLOCKED_BY, app_pid):
                        await trio.sleep(0.005)
                    await app.aclose()  # the cancel commits
                await drained.wait()
                worker.stop()
        finally:
            with trio.CancelScope(shield=True):
                await db.execute(UNGATE)
        return key, answer, expected, list(self.world.log)

    @precondition(lambda self: self.model.runs)
    @rule(data=st.data())
    def retry_run(self, data: st.DataObject) -> None:
        """`Queue.retry_run` (of a failed or cancelled run mostly): its steps not
        completed run again, the completed ones keep their results."""
        self._retry(self._runs(data, lambda r: r.state in (FAILED, CANCELLED)))

    def _retry(self, run_id: UUID) -> None:
        answer = self._call(self.queue.retry_run, run_id)
        expected = self.model.retry(run_id)
        assert answer == expected, (
            f"retry of run {run_id} answered {answer!r}; the model says {expected!r}")

    # -- rules: workers ------------------------------------------------------------------

    @rule()
    def drain(self) -> None:
        """A worker (one slot) starts, runs the step jobs until none is due, and
        stops; the model replays its runs in the order they happened."""
        log = self._call(self._drain)
        for run_id, step, idx, attempt, outcome in log:
            self.model.ran(run_id, step, idx, attempt, outcome)
        assert not self.model.available(), (
            f"the drain left step jobs due: {self.model.available()}")

    async def _drain(self) -> list[tuple[UUID, str, int, int, Outcome]]:
        self.world.log = []
        worker = Worker(self.queue, self.executors)
        async with trio.open_nursery() as nursery:
            await nursery.start(worker.run)
            # A step's end enqueues its dependants in the transaction that
            # records it, after the drain's last claim: drain again until none
            # is due.
            while True:
                await worker.drain_once(lanes=[QUEUE])
                if not await self.env.db.fetchval(DUE, QUEUE):
                    break
            worker.stop()
        return list(self.world.log)

    @precondition(lambda self: self.model.available() and not self.model.held())
    @rule()
    def drain_then_die_before_the_transitions(self) -> None:
        """
        A worker runs the due step jobs while every running run's row is held
        by another transaction (a cancel, a signal, another worker's transition
        in flight): each step's end commits with its transition recorded as
        due, not applied (migration 0033: a finish never waits for a run's
        row). The worker dies (or is fenced) before its transition service
        takes them; once the rows are free another worker's service does. The
        runs are then as the model has them: each transition as if taken at
        its step's end, none lost, none taken twice.
        """
        log, due = self._call(self._drain_held)
        self.model.hold()
        for run_id, step, idx, attempt, outcome in log:
            self.model.ran(run_id, step, idx, attempt, outcome)
        self.model.apply_due(due)

    async def _drain_held(self) -> tuple[list[tuple[UUID, str, int, int, Outcome]],
                                         list[tuple[UUID, str, int]]]:
        db = self.env.db
        self.world.log = []
        async with db.transaction() as holder:
            await holder.execute("SELECT 1 FROM nasiko_queue_workflow_runs "
                                 "WHERE state = 'running' FOR UPDATE")
            worker = Worker(self.queue, self.executors)
            worker.transitions = None  # it dies before its service takes any
            async with trio.open_nursery() as nursery:
                await nursery.start(worker.run)
                await worker.drain_once(lanes=[QUEUE])
                worker.stop()
            # What is due, in the order the service takes it.
            due = [(r["workflow_run"], r["step"], r["idx"]) for r in await db.fetch(
                "SELECT j.workflow_run, j.payload ->> 'step' AS step, "
                "(j.payload ->> 'idx')::int AS idx FROM nasiko_queue_workflow_due AS d "
                "JOIN nasiko_queue_jobs AS j ON j.id = d.job_id ORDER BY d.id")]
        await TransitionService(db, TransitionConfig()).drain()
        assert not await db.fetchval("SELECT count(*) FROM nasiko_queue_workflow_due")
        return list(self.world.log), due

    @precondition(lambda self: self.model.available() and not self.model.held())
    @rule()
    def worker_dies(self) -> None:
        """A registered worker claims a due step job and dies (SIGKILL): the row
        stays running, held by a worker that no longer heartbeats."""
        row = self._call(self._claim_and_die)
        assert row is not None, f"no step job claimed; the model has {self.model.available()}"
        self.model.claim(row["workflow_run"], row["step"], row["idx"], held=True)

    async def _claim_and_die(self) -> Any:
        identity = uuid.uuid4()
        await self.rescuer.register_worker(WorkerIdentity(
            id=identity, host="workflow-machine", pid=0, kinds=()))
        self.dead.append(identity)
        store = PlainJobStore(self.env.db, self.config, QUEUE, lambda: identity)
        jobs = await store.claim(1)
        if not jobs:
            return None
        return await self.env.db.fetchrow(SNAP_JOBS + " AND id = $1", jobs[0].id)

    @precondition(lambda self: self.model.held())
    @rule()
    def rescue(self) -> None:
        """The dead workers' leases run out; one round of the leader's rescue: a
        held step job is available again, or discarded on its last attempt (its
        run fails), or cancelled when its run asked it to stop."""
        self._call(self._rescue)
        self.model.rescue()

    async def _rescue(self) -> None:
        for worker in self.dead:
            await self.env.db.execute(Q.testing_worker_expire, worker)
        self.dead = []
        await self.rescuer.rescue()

    # -- invariants --------------------------------------------------------------------------

    @invariant()
    def database_equals_model(self) -> None:
        actual = self._call(self._snapshot)
        expected = self.model.snapshot()
        for part in expected:
            assert actual[part] == expected[part], _diff(part, actual[part], expected[part])

    async def _snapshot(self) -> dict[str, Any]:
        db = self.env.db
        steps = await db.fetch(SNAP_STEPS)
        jobs = {r["id"]: r for r in await db.fetch(SNAP_JOBS)}
        counts: dict[tuple[UUID, str, int], Counter[tuple[str, int, bool]]] = {}
        for j in jobs.values():
            counts.setdefault((j["workflow_run"], j["step"], j["idx"]), Counter())[
                (j["state"], j["attempt"], j["cancel_requested"])] += 1
        live = {}
        for s in steps:
            job = jobs.get(s["job_id"])
            if job is not None:
                live[(s["run_id"], s["step"], s["idx"])] = (job["state"], job["attempt"])
        return {
            "runs": {r["id"]: r["state"] for r in await db.fetch(SNAP_RUNS)},
            "steps": {(s["run_id"], s["step"], s["idx"]): s["state"] for s in steps},
            "jobs": counts,
            "live": live,
            "signals": {(r["run_id"], r["name"]): r["consumed"]
                        for r in await db.fetch(SNAP_SIGNALS)},
            "results": {(s["run_id"], s["step"], s["idx"]): _json(s["result"]) for s in steps
                        if s["state"] == "completed"},
        }

    @invariant()
    def steps_start_after_their_dependencies(self) -> None:
        assert not self.world.early, self.world.early
        early = self._call(self.env.db.fetch, EARLY_JOBS)
        assert not early, [
            f"a job of step {r['step']} of run {r['workflow_run']} exists while its "
            f"dependency {r['dep']}[{r['idx']}] is {r['state']}" for r in early]

    @invariant()
    def results_are_written_once(self) -> None:
        rows = self._call(self.env.db.fetch, SNAP_STEPS)
        now = {(r["run_id"], r["step"], r["idx"]): r for r in rows}
        for key, result in self.results.items():
            row = now.get(key)
            state = None if row is None else row["state"]
            assert state == "completed", f"step {key} was completed and is now {state}"
            assert row is not None
            assert row["result"] == result, (
                f"step {key}'s result was {result}, is now {row['result']}")
        for key, row in now.items():
            if row["state"] == "completed":
                self.results.setdefault(key, row["result"])

    @invariant()
    def runs_end_as_their_steps_say(self) -> None:
        for r in self._call(self.env.db.fetch, RUN_CHECK):
            state = r["state"]
            assert (state == "completed") == r["all_completed"], (
                f"run {r['id']} is {state}; all its steps completed: {r['all_completed']}")
            assert (state == "failed") == bool(r["any_failed"]), (
                f"run {r['id']} is {state}; a step of it failed: {r['any_failed']}")
            assert (state == "failed") == bool(r["failed_discarded"]), (
                f"run {r['id']} is {state}; a step of it was discarded: "
                f"{r['failed_discarded']}")
            if state in ("failed", "cancelled"):
                assert r["live_jobs"] == 0, (
                    f"run {r['id']} is {state} but {r['live_jobs']} step job(s) of it wait "
                    "to run or run unasked to stop")


async def _blocked_by(db: Database, pid: int) -> None:
    """Return once another session waits for a lock backend `pid` holds (the
    server's own record, read again until it says so)."""
    while not await db.fetchval(BLOCKED_BY, pid):  # noqa: ASYNC110
        await trio.sleep(0.005)


def _json(text: str | None) -> Any:
    return None if text is None else json.loads(text)


def _diff(part: str, actual: dict[Any, Any], expected: dict[Any, Any]) -> str:
    lines = [f"workflow {part}: the database differs from the model"]
    for key in sorted(set(actual) | set(expected), key=str):
        if actual.get(key) != expected.get(key):
            lines.append(f"  {key}: database={actual.get(key)!r} model={expected.get(key)!r}")
    return "\n".join(lines)


#: The workflow machine's budget, from the chosen profile's (``nasiko-ci``: 50
#: examples of up to 30 steps): a modest share of the machines' minutes.
WORKFLOW_EXAMPLES = 0.2
WORKFLOW_STEPS = 0.5


def workflow_profile() -> settings:
    """`runner.profile()`, scaled to this machine's budget."""
    base = profile()
    return settings(base, max_examples=max(1, int(base.max_examples * WORKFLOW_EXAMPLES)),
                    stateful_step_count=max(5, int(base.stateful_step_count * WORKFLOW_STEPS)))


async def run_workflow_state_machine(
    db_or_dsn: Database | str,
    machine: type[WorkflowStateMachine] = WorkflowStateMachine,
    *,
    settings: settings | None = None,
    rule_timeout: float = 20.0,
) -> None:
    """Run `machine` against a migrated database of its own, from a trio test."""
    await run_machine(db_or_dsn, machine, settings=settings or workflow_profile(),
                      rule_timeout=rule_timeout)
