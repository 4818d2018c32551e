"""
A Hypothesis state machine that drives the real engine against `QueueModel`.

Every step does something to the queue — enqueue a job of any kind (valid or
not, for an agent or a connector, with or without an earlier successful
build), let a worker drain with each run's outcome chosen by Hypothesis,
crash a worker right after its claim, age stuck rows, sweep, delete targets,
run two workers at once — and then compares the whole database with the model
and checks the invariants of docs/rules.md. A failure comes back shrunk to the
shortest sequence of steps that breaks a rule.

Use it on your own executors: they meet a scripted outside world
(`ScriptedWorld`) that tells each run what to do, and must report through the
build row as the built-in ones do, by writing it or through their context
(`ctx.report_success()`, ...; the built-in scripted executors do it the second way
for every other job, and both ways must leave the same rows)::

    from nasiko_queue.testing.machine import QueueStateMachine, run_queue_state_machine

    class MyMachine(QueueStateMachine):
        def make_executors(self, world):
            executors = Executors()
            @executors.register(Upload)
            async def build(ctx):
                outcome = world.begin(ctx)          # what the fake world does this run
                await my_build_pipeline(ctx, fake_backend(outcome))
            return executors

    async def test_my_executors(dsn):               # a pytest-trio test
        await run_queue_state_machine(dsn, MyMachine)

How it runs (in a worker thread, each rule calling back into the test's trio
loop) and its settings profiles (``nasiko-ci`` by default; ``nasiko-thorough``
with NASIKO_QUEUE_HYPOTHESIS_PROFILE): `nasiko_queue.testing.runner`, which
the plain-job machine shares.

.. versionadded:: 0.1.0
"""

from __future__ import annotations

import uuid
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any, ClassVar
from uuid import UUID, uuid4

import attrs
import trio
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import invariant, precondition, rule

from ..builds.payloads import BUILTIN_PAYLOAD_TYPES, Payload
from ..builds.store import PgJobStore
from ..config import QueueConfig
from ..db.database import Database
from ..db.statements import Q
from ..engine.contracts import MAINTENANCE_ROLE, BuildReport, JobStore, WorkerIdentity
from ..engine.worker import Worker
from ..executors import Executors, JobContext
from ..queue import Queue
from ..secrets import SecretBox
from .fixtures import (
    KINDS,
    insert_agent,
    insert_agent_build,
    insert_connector,
    insert_connector_build,
    make_payload,
)
from .model import (
    CLASSIC_OUTCOMES,
    JOB_PANICKED,
    TERMINALIZING,
    Outcome,
    QueueModel,
    TargetKind,
    TargetState,
)
from .runner import DatabaseMachine, run_machine
from .runner import profile as profile

#: Invalid payloads the machine enqueues (by plain SQL, as a buggy or foreign writer would).
INVALID_SHAPES = ("missing_fields", "unknown_kind", "wrong_type", "not_an_object")

#: The configuration the machine runs the engine with: the default limits, a tiny
#: wake channel (so that a burst of enqueues fills it) and quick retries.
HARNESS_CONFIG = QueueConfig(
    wake_capacity=4,
    poll_interval=60.0,
    recovery_interval=3600.0,
    retry_initial_delay=0.01,
    retry_max_delay=0.05,
    # The machine's own rules play the leader (`rescue`, `recovery_sweep`), one step
    # at a time; a drain's worker running maintenance of its own meanwhile would
    # make what happens depend on timing.
    maintenance=False,
    # The machine wakes its workers itself (`drain_once`), in process: a LISTEN
    # connection of each drain's worker took a third of the time a worker takes
    # to start and stop. Machines that check wakes switch it on (tests/
    # test_statemachine.py: ConcurrentMachine, PrefetchMachine).
    listen=False,
)


class SimulatedCrash(Exception):
    """What a scripted executor raises for `Outcome.RAISE`."""


class ScriptedWorld:
    """
    The fake outside world: which `Outcome` each run of each job has.

    Executors call `begin(ctx)` at the start of every run; it records the run
    and returns what the outside world does this time. The built-in scripted
    executors then write what a real executor would: the jobs in `via_ctx`
    through their context (`report_through_ctx`: folded into the worker's own
    statements, issue #13), the others by writing the build row (`report`). The
    two ways must leave the same rows, so the model does not tell them apart.
    """

    def __init__(self) -> None:
        self.plans: dict[UUID, tuple[Outcome, ...]] = {}
        #: Jobs whose executor reports through `ctx` instead of writing the row.
        self.via_ctx: set[UUID] = set()
        #: Jobs whose executor writes the row *and* then reports the other
        #: outcome through `ctx` (`report_both_ways`).
        self.both_ways: set[UUID] = set()
        self.runs: Counter[UUID] = Counter()
        self.hung = trio.Event()
        #: Set by the machine for one drain: ask for a graceful stop during run n.
        self.stop_during_run: int | None = None
        self.request_stop: Callable[[], None] = lambda: None
        self._runs_this_drain = 0

    def new_drain(self, stop_during_run: int | None, request_stop: Callable[[], None]) -> None:
        self.hung = trio.Event()
        self.stop_during_run = stop_during_run
        self.request_stop = request_stop
        self._runs_this_drain = 0

    def begin(self, ctx: JobContext[Any]) -> Outcome:
        self.runs[ctx.job_id] += 1
        self._runs_this_drain += 1
        if self._runs_this_drain == self.stop_during_run:
            self.request_stop()  # SIGTERM arrives while this job runs
        plan = self.plans.get(ctx.job_id, ())
        index = ctx.attempt - 1
        return plan[index] if index < len(plan) else Outcome.SUCCEED

    async def hang(self) -> None:
        """Never return, and say so (the machine then hard-stops the worker)."""
        self.hung.set()
        await trio.sleep_forever()

    @staticmethod
    async def report(ctx: JobContext[Any], build_status: str,
                     target_status: str | None = None) -> None:
        """Write the build row, and optionally the target, as a real executor would."""
        payload: Payload = ctx.payload
        if ctx.target.connector_id is not None:
            await ctx.db.execute(Q.connector_build_set_status, payload.build_id, build_status)
            if target_status is not None:
                url = "http://mcp.local/mcp" if target_status == "running" else None
                await ctx.db.execute(Q.connector_set_build_status, ctx.target.connector_id,
                                     target_status, url)
        else:
            await ctx.db.execute(Q.agent_build_set_status, payload.build_id, build_status)
            if target_status is not None:
                await ctx.db.execute(Q.agent_set_status, ctx.target.agent_id, target_status)

    @staticmethod
    async def report_through_ctx(ctx: JobContext[Any], build_status: str,
                                 target_status: str | None = None) -> None:
        """
        As `report`, but the build row through the context: 'building' as a start
        write (`ctx.mark_building()`), 'success' and 'failed' folded into the
        job's finish (`ctx.report_success()`, `ctx.report_failure()`). The target
        is written at once, as before.
        """
        if build_status == "building":
            ctx.mark_building()
        elif build_status == "success":
            ctx.report_success()
        elif build_status == "failed":
            ctx.report_failure()
        else:
            raise ValueError(f"no context report for build status {build_status!r}")
        if target_status is not None:
            await ScriptedWorld._set_target(ctx, target_status)

    @staticmethod
    async def report_both_ways(ctx: JobContext[Any], build_status: str,
                               target_status: str | None = None) -> None:
        """
        As `report`, then the other outcome through the context: a 'success'
        written and `ctx.report_failure()`, a 'failed' written and
        `ctx.report_success()`. The folded report meets a row already settled,
        which stays as written and decides the job (docs/rules.md §5 step 4), so
        the rows are those `report` leaves.
        """
        await ScriptedWorld.report(ctx, build_status, target_status)
        if build_status == "success":
            ctx.report_failure()
        elif build_status == "failed":
            ctx.report_success()
        else:
            ctx.mark_building()

    @staticmethod
    async def _set_target(ctx: JobContext[Any], status: str) -> None:
        if ctx.target.connector_id is not None:
            url = "http://mcp.local/mcp" if status == "running" else None
            await ctx.db.execute(Q.connector_set_build_status, ctx.target.connector_id,
                                 status, url)
        else:
            await ctx.db.execute(Q.agent_set_status, ctx.target.agent_id, status)


def scripted_executors(
    world: ScriptedWorld, payload_types: Sequence[type[Payload]] = BUILTIN_PAYLOAD_TYPES
) -> Executors:
    """One executor for every payload type that does exactly what `world` scripts."""

    async def run(ctx: JobContext[Any]) -> None:
        outcome = world.begin(ctx)
        report = (world.report_through_ctx if ctx.job_id in world.via_ctx
                  else world.report_both_ways if ctx.job_id in world.both_ways
                  else world.report)
        if outcome is Outcome.SUCCEED:
            await report(ctx, "success", "running")
        elif outcome is Outcome.FAIL:
            await report(ctx, "failed", "failed")
        elif outcome is Outcome.RAISE:
            await report(ctx, "building")
            raise SimulatedCrash(f"scripted crash on attempt {ctx.attempt}")
        elif outcome is Outcome.HANG:
            await report(ctx, "building")
            await world.hang()
        elif outcome is Outcome.DELETE_TARGET:
            if ctx.target.connector_id is not None:
                await ctx.db.execute(Q.connector_delete, ctx.target.connector_id)
            else:
                await ctx.db.execute(Q.agent_delete, ctx.target.agent_id)
        elif outcome is Outcome.SOFT_DELETE:
            if ctx.target.agent_id is not None:
                await ctx.db.execute(Q.agent_soft_delete, ctx.target.agent_id)
            await report(ctx, "success", "running")
        elif outcome is Outcome.REPORT_BUILDING:
            await report(ctx, "building")
        # Outcome.NO_REPORT: return with the build row as it was.

    executors = Executors()
    for payload_type in payload_types:
        executors.register(payload_type, run)
    return executors


class QueueStateMachine(DatabaseMachine):
    """
    The engine against `QueueModel`, one Hypothesis step at a time.

    Subclass to test your own code; override any of:

    * `kinds`: which payload kinds the machine enqueues (default: all seven);
    * `make_payload(kind, target_id, build_id, owner_id, name)`: your payloads;
    * `make_executors(world)`: your executors, driven by `world.begin(ctx)`;
    * `make_queue(db)`: your `Queue` (configuration, secrets);
    * `config`: the `QueueConfig` (keep the tiny wake channel to test wakes);
    * `outcomes`: what `world.begin(ctx)` may tell a run to do. By default every
      `Outcome` with the built-in scripted executors, and `CLASSIC_OUTCOMES`
      (no `NO_REPORT`, no `REPORT_BUILDING`) once you override
      `make_executors`: set it to every `Outcome` when your executors play those
      two as well (return without reporting; report 'building' and return).
    """

    runner: ClassVar[str] = "run_queue_state_machine"
    kinds: ClassVar[tuple[str, ...]] = KINDS
    #: Whether every other valid job's scripted executor reports through its
    #: context (`ScriptedWorld.via_ctx`) rather than by writing the build row.
    ctx_reports: ClassVar[bool] = True
    config: ClassVar[QueueConfig] = HARNESS_CONFIG
    outcomes: ClassVar[tuple[Outcome, ...] | None] = None

    def __init__(self) -> None:
        super().__init__()
        self.world = ScriptedWorld()
        self.queue = self.make_queue(self.env.db)
        self.executors = self.make_executors(self.world)
        known = frozenset(t.kind for t in BUILTIN_PAYLOAD_TYPES) | self.executors.kinds
        self.model = QueueModel(max_attempts=self.config.build_max_attempts,
                                runnable=self.executors.kinds, known=known,
                                stuck_job_mins=self.config.stuck_job_mins)
        self.known = known
        self._check_payloads()
        self.store = self.make_store()
        self.finished: dict[UUID, tuple[Any, ...]] = {}
        self.attempts: dict[UUID, int] = {}
        self.enqueued: set[UUID] = set()
        # The worker of the next drain exists already, so that enqueues wake it
        # (into its channel) exactly as they wake a running worker.
        self.next_worker = self._new_worker()

    # -- hooks for users ----------------------------------------------------------------

    def make_queue(self, db: Database) -> Queue:
        return Queue(db, config=self.config, secrets=self.env.secrets)

    def make_executors(self, world: ScriptedWorld) -> Executors:
        return scripted_executors(world)

    def make_store(self) -> JobStore:
        """The job store every worker of the machine uses (a seam for mutation tests)."""
        return PgJobStore(self.env.db, self.config, runnable_kinds=self.executors.kinds,
                          known_kinds=self.known)

    def make_worker(self) -> Worker:
        return Worker(self.queue, self.executors, store=self.make_store())

    def make_payload(self, kind: str, *, target_id: UUID, build_id: UUID, owner_id: UUID,
                     name: str) -> Payload:
        return make_payload(kind, target_id=target_id, build_id=build_id, owner_id=owner_id,
                            name=name, env={"API_TOKEN": "s3cret-" + name})

    # -- plumbing ------------------------------------------------------------------------

    def _check_payloads(self) -> None:
        """A machine with executors of its own must make payloads they run: with
        the built-in payloads of `kinds` and only `MyUpload` registered, no job
        would ever reach an executor, and every example would pass unrun."""
        if type(self).make_executors is QueueStateMachine.make_executors:
            return
        for kind in self.kinds:
            made = self.make_payload(kind, target_id=uuid4(), build_id=uuid4(),
                                     owner_id=uuid4(), name="check").kind
            if made not in self.executors.kinds:
                raise TypeError(
                    f"{type(self).__name__}: `make_payload` makes {made!r} payloads for "
                    f"kind {kind!r}, and none of its executors runs them (they run: "
                    f"{sorted(self.executors.kinds)}); override `make_payload` to make "
                    "your own payload type")

    def _outcomes(self) -> tuple[Outcome, ...]:
        if self.outcomes is not None:
            chosen = self.outcomes
        elif type(self).make_executors is QueueStateMachine.make_executors:
            chosen = tuple(Outcome)
        else:
            chosen = CLASSIC_OUTCOMES
        # Hypothesis favours the first choices of a sampled_from; the empty plan
        # already means success, so the crash comes first.
        return tuple(sorted(chosen, key=lambda o: o is not Outcome.RAISE))

    def _plays(self, outcome: Outcome) -> bool:
        """Whether this machine's executors play `outcome` (the rules that script
        it run only then: a user's `outcomes` is what their executors do)."""
        return outcome in self._outcomes()

    def _playable(self, plan: Sequence[Outcome]) -> tuple[Outcome, ...]:
        """The plan as this machine's configuration can check it exactly."""
        if self.config.concurrency > 1:
            # With several jobs running at once, a hang (which hard-stops the
            # worker, cancelling its other jobs too) has no single right answer
            # for the model; there the executor crashes instead.
            plan = [Outcome.RAISE if o is Outcome.HANG else o for o in plan]
        elif self.config.prefetch:
            # With prefetch, a crashed job's retry runs behind the jobs already
            # in the buffer, at a point that depends on timing; the model runs it
            # at once. Failing instead keeps the order (and so which jobs a hang
            # or a stop cuts off) exact; the concurrent machine covers crashes.
            plan = [Outcome.FAIL if o is Outcome.RAISE else o for o in plan]
        return tuple(plan)

    def _new_worker(self) -> Worker:
        worker = self.make_worker()
        self.queue._add_waker(worker.wake)
        return worker

    def teardown(self) -> None:
        super().teardown()
        self.queue._remove_waker(self.next_worker.wake)

    # -- rules: the application ----------------------------------------------------------

    @rule(
        kind=st.sampled_from(KINDS),
        prior_success=st.booleans(),
        data=st.data(),
        stored_attempt=st.sampled_from((0, 0, 0, 1, 2, 3, 3, 4)),
    )
    def enqueue(self, kind: str, prior_success: bool, data: st.DataObject,
                stored_attempt: int) -> None:
        """
        A valid job for a new target (as the original's enqueue points create it).

        `stored_attempt` > 0 plays a row left by another writer with attempts
        already used (the original's inline-exhaustion test does exactly this).
        """
        if kind not in self.kinds:
            kind = self.kinds[0]
        plan = data.draw(st.lists(st.sampled_from(self._outcomes()), max_size=4), label="plan")
        self._call(self._enqueue, kind, prior_success, self._playable(plan), stored_attempt)

    @precondition(lambda self: self._plays(Outcome.RAISE))
    @rule(kind=st.sampled_from(KINDS), stored_attempt=st.sampled_from((0, 1, 2)),
          crashes=st.integers(1, 3), prior_success=st.booleans())
    def enqueue_crash_loop(self, kind: str, stored_attempt: int, crashes: int,
                           prior_success: bool) -> None:
        """
        A job whose executor crashes on each of its next `crashes` runs: the
        attempt rules at their edges (the retry at once, the last allowed run
        failing `job panicked during execution`, never a run past the cap).
        """
        if kind not in self.kinds:
            kind = self.kinds[0]
        plan = self._playable((Outcome.RAISE,) * (stored_attempt + crashes))
        self._call(self._enqueue, kind, prior_success, plan, stored_attempt)

    @rule(kind=st.sampled_from(KINDS), stored_attempt=st.sampled_from((3, 4)),
          prior_success=st.booleans())
    def enqueue_exhausted(self, kind: str, stored_attempt: int, prior_success: bool) -> None:
        """A job another writer left with its attempts used up: the cap fails it unrun."""
        if kind not in self.kinds:
            kind = self.kinds[0]
        self._call(self._enqueue, kind, prior_success, (), stored_attempt)

    @precondition(lambda self: self._plays(Outcome.HANG))
    @rule(kind=st.sampled_from(KINDS), prior_success=st.booleans())
    def hard_stop_mid_run(self, kind: str, prior_success: bool) -> None:
        """A job whose run hangs; the worker is stopped hard and puts it back."""
        if kind not in self.kinds:
            kind = self.kinds[0]
        self._call(self._enqueue, kind, prior_success, self._playable((Outcome.HANG,)))
        self.drain(hard=True, stop_during_run=None)

    async def _enqueue(self, kind: str, prior_success: bool, plan: tuple[Outcome, ...],
                       stored_attempt: int = 0, both_ways: bool = False) -> None:
        owner = uuid.uuid4()
        name = f"{kind.lower()}-{len(self.enqueued)}"
        connector = kind == "McpServerUpload"
        async with self.queue.db.transaction() as tx:
            target, builds = await self._insert_target(tx, owner, name, connector, prior_success)
            build = (await insert_connector_build(tx, target, owner_id=owner) if connector
                     else await insert_agent_build(tx, target))
            payload = self.make_payload(kind, target_id=target, build_id=build, owner_id=owner,
                                        name=name)
            job_id = await self.queue.enqueue(payload, tx=tx, owner_id=owner)
            if stored_attempt:
                await tx.execute(Q.job_set_attempt, job_id, stored_attempt)
        builds[build] = "pending" if connector else "queued"
        self.world.plans[job_id] = plan
        if both_ways:
            self.world.both_ways.add(job_id)
        elif self.ctx_reports and len(self.enqueued) % 2 == 0:
            self.world.via_ctx.add(job_id)  # every other job: no draw, same examples
        self._add(job_id, payload.kind, True, target, build, builds, connector, plan)
        self.model.jobs[job_id].attempt = stored_attempt

    async def _insert_target(self, tx: Any, owner: UUID, name: str, connector: bool,
                             prior_success: bool) -> tuple[UUID, dict[UUID, str]]:
        builds: dict[UUID, str] = {}
        if connector:
            target = await insert_connector(tx, owner_id=owner, name=name)
            if prior_success:
                builds[await insert_connector_build(tx, target, owner_id=owner,
                                                    status="success", version_tag="v0")] = \
                    "success"
        else:
            target = await insert_agent(tx, owner_id=owner, name=name)
            if prior_success:
                builds[await insert_agent_build(tx, target, status="success",
                                                version_tag="v0")] = "success"
        return target, builds

    def _add(self, job_id: UUID, kind: str | None, valid: bool, target: UUID,
             build: UUID | None, builds: dict[UUID, str], connector: bool,
             plan: tuple[Outcome, ...] = ()) -> None:
        self.model.add_target(TargetState(
            kind=TargetKind.CONNECTOR if connector else TargetKind.AGENT, id=target,
            status="pending" if connector else "deploying", builds=builds))
        self.model.add_job(job_id, kind=kind, valid=valid, target=target, build_id=build,
                           plan=plan)
        self.enqueued.add(job_id)

    @rule(shape=st.sampled_from(INVALID_SHAPES), connector=st.booleans(),
          prior_success=st.booleans())
    def enqueue_invalid(self, shape: str, connector: bool, prior_success: bool) -> None:
        """A job whose payload no payload type accepts, written by plain SQL."""
        self._call(self._enqueue_invalid, shape, connector, prior_success)

    async def _enqueue_invalid(self, shape: str, connector: bool, prior_success: bool) -> None:
        import json

        owner = uuid.uuid4()
        name = f"invalid-{len(self.enqueued)}"
        async with self.queue.db.transaction() as tx:
            target, builds = await self._insert_target(tx, owner, name, connector, prior_success)
            build = (await insert_connector_build(tx, target, owner_id=owner) if connector
                     else await insert_agent_build(tx, target))
            kind = "McpServerUpload" if connector else "Upload"
            body: Any
            if shape == "missing_fields":
                body = {"kind": kind, "build_id": str(build)}
            elif shape == "unknown_kind":
                body = {"kind": "NoSuchKind", "build_id": str(build)}
                kind = "NoSuchKind"
            elif shape == "wrong_type":
                valid = self.queue._codec.encode(make_payload(
                    kind, target_id=target, build_id=build, owner_id=owner, name=name))
                body = {**valid, "name": 42}
            else:
                body = ["not", "an", "object"]
            agent_id, connector_id = (None, target) if connector else (target, None)
            job_id = await tx.fetchval(Q.job_insert, agent_id, connector_id, owner,
                                       json.dumps(body))
        builds[build] = "pending" if connector else "queued"
        claim_kind = None if shape == "not_an_object" else kind
        own_build = None if shape == "not_an_object" else build
        self._add(job_id, claim_kind, False, target, own_build, builds, connector)
        if own_build is None:  # the model still needs to know the build row exists
            self.model.targets[target].builds[build] = builds[build]

    @rule()
    def enqueue_burst(self) -> None:
        """More enqueues than the wake channel holds, while no worker drains: none waits."""
        for i in range(self.config.wake_capacity + 1):
            self._call(self._enqueue, self.kinds[i % len(self.kinds)], False, ())

    @precondition(lambda self: bool(self.model.targets))
    @rule(data=st.data())
    def hard_delete_target(self, data: st.DataObject) -> None:
        # Insertion order, not UUID order: replays must draw the same target.
        target_id = data.draw(st.sampled_from(list(self.model.targets)), label="target")
        target = self.model.targets[target_id]
        sql = Q.connector_delete if target.kind is TargetKind.CONNECTOR else Q.agent_delete
        self._call(self.env.db.execute, sql, target_id)
        self.model.hard_delete(target_id)

    @precondition(lambda self: any(t.kind is TargetKind.AGENT and not t.soft_deleted
                                   for t in self.model.targets.values()))
    @rule(data=st.data())
    def soft_delete_agent(self, data: st.DataObject) -> None:
        choices = [t.id for t in self.model.targets.values()
                   if t.kind is TargetKind.AGENT and not t.soft_deleted]
        target_id = data.draw(st.sampled_from(choices), label="agent")
        self._call(self.env.db.execute, Q.agent_soft_delete, target_id)
        self.model.soft_delete(target_id)

    # -- rules: workers -------------------------------------------------------------------

    @rule(hard=st.booleans(), stop_during_run=st.none() | st.integers(1, 3))
    def drain(self, hard: bool, stop_during_run: int | None) -> None:
        """
        A worker starts (startup sweep), drains, and stops gracefully or hard
        once idle — or is asked to stop gracefully while its n-th job runs.
        """
        if self.config.concurrency > 1:
            stop_during_run = None  # which other jobs finish first is a race, as above
        self._call(self._drain, [self.next_worker], hard, stop_during_run)
        self.queue._remove_waker(self.next_worker.wake)
        self.model.drain(stop_after_runs=stop_during_run)
        self.next_worker = self._new_worker()

    @precondition(lambda self: not any(
        Outcome.HANG in j.remaining_plan() for j in self.model.jobs.values()
        if j.status in ("pending", "in_progress")))
    @rule()
    def drain_with_two_workers(self) -> None:
        """Two replicas drain the same table at once (SKIP LOCKED keeps claims apart)."""
        other = self.make_worker()
        self._call(self._drain, [self.next_worker, other], False)
        self.queue._remove_waker(self.next_worker.wake)
        self.model.drain()
        self.next_worker = self._new_worker()

    async def _drain(self, workers: list[Worker], hard: bool,
                     stop_during_run: int | None = None) -> None:
        self.world.new_drain(stop_during_run, workers[0].stop)
        hung = self.world.hung
        scopes = [trio.CancelScope() for _ in workers]

        async def run(worker: Worker, scope: trio.CancelScope, *,
                      task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
            with scope:
                await worker.run(task_status=task_status)

        async with trio.open_nursery() as nursery:
            for worker, scope in zip(workers, scopes, strict=True):
                await nursery.start(run, worker, scope)
            # Wait until every worker has drained, or an executor hangs.
            async with trio.open_nursery() as waiting:

                async def drain_once(worker: Worker) -> None:
                    try:
                        await worker.drain_once()
                    except RuntimeError:
                        # Asked to stop mid-drain: no further drain will run.
                        assert stop_during_run is not None
                        await worker.wait_for(lambda stats: stats.running == 0)

                async def drain_all() -> None:
                    # With two workers, one's NOTIFY (a crash's reset, a give-back)
                    # can start a drain on the other after its drain_once returned,
                    # and a stop would then give its claim back unrun: drain again
                    # until a round after which no worker has work of its own.
                    while True:
                        async with trio.open_nursery() as inner:
                            for worker in workers:
                                inner.start_soon(drain_once, worker)
                        if len(workers) == 1 or all(
                                w.idle() and w.stats.drains_started
                                == w.stats.drains_completed for w in workers):
                            break
                    waiting.cancel_scope.cancel()

                async def watch_hang() -> None:
                    await hung.wait()
                    waiting.cancel_scope.cancel()

                waiting.start_soon(drain_all)
                waiting.start_soon(watch_hang)
            if hard or hung.is_set():
                for scope in scopes:
                    scope.cancel()
            else:
                for worker in workers:
                    worker.stop()

    @rule(heartbeats=st.booleans())
    def crash_after_claim(self, heartbeats: bool = False) -> None:
        """
        A worker process claims a job and dies (SIGKILL): the row stays in_progress.
        With `heartbeats`, the worker is a registered row that the claim names (it
        stops heartbeating, and the rescue takes over once its lease is gone);
        without, it is a replica that does not heartbeat (the original's), whose
        rows only the 60-minute sweep recovers.
        """
        holder: UUID | None = None
        if heartbeats:
            worker = self._register()
            claimed = self._call(worker.claim, 1)
            holder = worker.worker_id
        else:
            claimed = self._call(self.store.claim, 1)
        expected = self.model.crash_claim(holder=holder)
        assert [j.id for j in claimed] == ([expected.id] if expected else []), (
            f"claim took {[j.id for j in claimed]}, the oldest claimable is "
            f"{expected.id if expected else None}")

    @rule()
    def poison_job(self) -> None:
        """
        The oldest job kills its worker every time it runs: claim, die, an hour
        passes, the sweep — until the sweep gives up on it (MAX_ATTEMPTS runs).
        """
        for _ in range(self.config.build_max_attempts + 1):
            self.crash_after_claim()
            self._age(self.config.stuck_job_mins + 1)
            self.recovery_sweep()

    @rule(data=st.data())
    def age_stuck_jobs(self, data: st.DataObject) -> None:
        """
        Time passes for every in_progress row (picked_at moved back in SQL): a
        little, just under the stuck threshold, just over it, or far over it, so
        that a sweep with its threshold in the wrong unit or off by some minutes
        takes (or leaves) the wrong rows.
        """
        mins = self.config.stuck_job_mins
        self._age(data.draw(st.sampled_from((2, mins - 1, mins + 1, 3 * mins)), label="minutes"))

    def _age(self, minutes: int) -> None:
        self._call(self.env.db.execute, Q.jobs_age_in_progress, minutes)
        self.model.age(minutes)

    @precondition(lambda self: bool(self.model.claimable()))
    @rule(data=st.data())
    def stall(self, data: st.DataObject) -> None:
        """
        A worker claims the oldest job and stalls (a long build, a pause) for a
        while, then a sweep runs: a job claimed a little or just under the
        threshold ago must be left alone, one just over or far over it handed on.
        """
        mins = self.config.stuck_job_mins
        minutes = data.draw(st.sampled_from((2, mins - 1, mins + 1, 3 * mins)), label="minutes")
        job = self.model.claimable()[0]
        self.crash_after_claim()
        self._age_one(job.id, minutes)
        self.recovery_sweep()

    @precondition(lambda self: bool(self.model.claimable()))
    @rule(handed_on_by=st.sampled_from(("sweep", "rescue")))
    def stale_writer(self, handed_on_by: str) -> None:
        """
        A worker claims the oldest job and is cut off (a network partition, a
        pause) until the job is handed on and another worker claims it: by the
        sweep, past the stuck threshold, for a replica that does not heartbeat;
        by the rescue, past its lease, for one that does (whose next heartbeat
        then says it was declared dead). Then the first worker comes back and
        writes every outcome it could write: a finish, a failure with
        terminalization, a reset. Its claim is no longer current, so none of them
        may change anything. (All three in one rule, so that each stale write is
        tried in every example that reaches this state.)
        """
        job = self.model.claimable()[0]
        if handed_on_by == "sweep":
            store = self.store
            stale = self._call(store.claim, 1)
            self.model.crash_claim()
            assert [j.id for j in stale] == [job.id], (stale, job.id)
            self._age_one(job.id, self.config.stuck_job_mins + 1)
            self.recovery_sweep()
        else:
            store = self._register()
            stale = self._call(store.claim, 1)
            self.model.crash_claim(holder=store.worker_id)
            assert [j.id for j in stale] == [job.id], (stale, job.id)
            assert store.worker_id is not None
            self._expire(store.worker_id)
            self._rescue_round()
        # The job's new holder (it went back to pending if it had attempts left):
        # other workers claim whatever is older first.
        while self.model.jobs.get(job.id) is not None and job.status == "pending":
            self.crash_after_claim()
        if handed_on_by == "rescue":
            assert not self._call(store.heartbeat, None).alive
        build = job.build_id or uuid.uuid4()
        for claim in stale:
            # Read from the build row, and with a report folded in (issue #13):
            # the report must not land without its job's finish.
            for report in (None, BuildReport.SUCCESS):
                statuses = self._call(store.finish_many_and_claim, [(claim, build, report)],
                                      0)[0]
                assert statuses.get(claim.id) in (None, "failed"), (
                    f"a stale finish of {claim.id} reported {statuses.get(claim.id)}")
            self._call(self._stale_fail, claim, build)
            self._call(store.reset, claim)

    # -- rules: heartbeats, leases, rescue, leadership ------------------------------

    def _register(self) -> PgJobStore:
        """A worker process of its own (a registered row), played by a bare store."""
        store = PgJobStore(self.env.db, self.config, runnable_kinds=self.executors.kinds,
                           known_kinds=self.known)
        identity = WorkerIdentity(id=uuid.uuid4(), host="machine", pid=0,
                                  kinds=tuple(sorted(self.executors.kinds)))
        self._call(store.register_worker, identity)
        self.model.workers[identity.id] = "alive"
        return store

    def _expire(self, worker: UUID) -> None:
        """A minute passes without a heartbeat from `worker` (longer than its lease)."""
        self._call(self.env.db.execute, Q.testing_worker_expire, worker)
        self.model.expire(worker)

    def _rescue_round(self) -> None:
        result = self._call(self.store.rescue)
        assert (result.declared_dead, result.failed, result.rescued) == self.model.rescue(), (
            result)

    @rule(data=st.data(), live_holder=st.booleans())
    def rescue(self, data: st.DataObject, live_holder: bool) -> None:
        """
        Time passes: one of the heartbeating workers that died (`crash_after_claim`
        with heartbeats) may see its lease run out; then a round of the leader's
        rescue gives back the jobs of every worker past its lease, or fails them.
        With `live_holder`, a worker whose heartbeat is still fresh holds the
        oldest job meanwhile (a new one, if none is waiting): the rescue must
        leave that one alone, unless this very step lets its lease run out.
        """
        if live_holder:
            if not self.model.claimable():
                self._call(self._enqueue, self.kinds[0], False, ())
            self.crash_after_claim(heartbeats=True)
        alive = [w for w, state in self.model.workers.items() if state == "alive"]
        if alive:
            worker = data.draw(st.none() | st.sampled_from(alive), label="expire")
            if worker is not None:
                self._expire(worker)
        self._rescue_round()

    @rule()
    def leader_dies(self) -> None:
        """
        Two workers stand for the maintenance leadership: exactly one wins. The
        leader dies (its hold runs out unrenewed); the other's next heartbeat
        takes over, and the old one, were it only paused, no longer leads.
        """
        first, second = self._register(), self._register()
        beats = [self._call(store.heartbeat, MAINTENANCE_ROLE) for store in (first, second)]
        assert [b.leader for b in beats] == [True, False], beats
        assert first.worker_id is not None
        self._call(self.env.db.execute, Q.testing_leader_expire, first.worker_id)
        assert self._call(second.heartbeat, MAINTENANCE_ROLE).leader
        assert not self._call(first.heartbeat, MAINTENANCE_ROLE).leader
        for store in (first, second):  # both stop: rows and role released
            self._call(store.deregister_worker)
            del self.model.workers[store.worker_id]  # type: ignore[arg-type]

    def _age_one(self, job_id: UUID, minutes: int) -> None:
        self._call(self.env.db.execute, Q.job_age_in_progress, job_id, minutes)
        state = self.model.jobs[job_id]
        if state.status == "in_progress":
            state.age_mins = minutes

    async def _stale_fail(self, job: Any, build: UUID) -> None:
        await self.store.fail(job, JOB_PANICKED, own_build_id=build, terminalize=True)

    @rule()
    def recovery_sweep(self) -> None:
        result = self._call(self.store.recover)
        assert (result.failed, result.reset) == self.model.recover()

    # -- invariants -------------------------------------------------------------------------

    @invariant()
    def database_equals_model(self) -> None:
        db = self._call(self._snapshot)
        assert db["jobs"] == self.model.job_rows(), _diff("jobs", db["jobs"],
                                                         self.model.job_rows())
        assert db["targets"] == self.model.target_rows(), _diff(
            "targets", db["targets"], self.model.target_rows())
        assert db["builds"] == self.model.build_rows(), _diff(
            "builds", db["builds"], self.model.build_rows())
        self._check_history(db["jobs"])
        self._check_terminal(db)
        holders = {j.id: j.holder for j in self.model.jobs.values()
                   if j.status == "in_progress" and j.holder is not None}
        for job_id, holder in holders.items():
            assert db["holders"].get(job_id) == holder, (
                f"job {job_id} is held by {db['holders'].get(job_id)}, the model says {holder}")

    async def _snapshot(self) -> dict[str, Any]:
        snapshot: dict[str, dict[Any, Any]] = {"jobs": {}, "targets": {}, "builds": {},
                                               "holders": {}}
        jobs, targets, builds = snapshot["jobs"], snapshot["targets"], snapshot["builds"]
        for r in await self.env.db.fetch(Q.snapshot_build_world):
            part = r["part"]
            if part == "job":
                jobs[r["id"]] = (r["status"], r["attempt"], r["error_msg"], r["picked"],
                                 r["completed"])
                if r["status"] == "in_progress":
                    snapshot["holders"][r["id"]] = r["claimed_by"]
            elif part in ("agent", "connector"):
                targets[r["id"]] = (part, r["status"], r["soft_deleted"])
            else:
                builds[r["id"]] = (r["target_id"], r["status"])
        return snapshot

    def _check_history(self, jobs: dict[UUID, tuple[Any, ...]]) -> None:
        for job_id, row in jobs.items():
            # A job runs at most MAX_ATTEMPTS times.
            assert self.world.runs[job_id] <= self.config.build_max_attempts, (
                f"job {job_id} ran {self.world.runs[job_id]} times")
            # Attempt never decreases.
            assert row[1] >= self.attempts.get(job_id, 0), f"attempt of {job_id} went down"
            self.attempts[job_id] = row[1]
            # Done and failed rows never change again.
            if job_id in self.finished:
                assert row == self.finished[job_id], f"finished job {job_id} changed: {row}"
            elif row[0] in ("done", "failed"):
                self.finished[job_id] = row
        for job_id in self.finished:
            assert job_id in jobs or job_id in self.model.gone, f"finished job {job_id} lost"
        # No job is lost: present once, or gone with its deleted target.
        for job_id in self.enqueued:
            assert (job_id in jobs) != (job_id in self.model.gone), f"job {job_id} lost"

    def _check_terminal(self, db: dict[str, Any]) -> None:
        """A job failed for good leaves no target non-terminal (when nothing else is live)."""
        live_targets = {self.model.jobs[j].target for j, row in db["jobs"].items()
                        if row[0] in ("pending", "in_progress") and j in self.model.jobs}
        for job_id, row in db["jobs"].items():
            # Failed for good by the engine; an ordinary failure reported by the
            # executor (build row not 'success') leaves the target as it was.
            if row[0] != "failed" or row[2] not in TERMINALIZING or job_id not in self.model.jobs:
                continue
            target_id = self.model.jobs[job_id].target
            if target_id in live_targets or target_id not in db["targets"]:
                continue
            kind, status, soft_deleted = db["targets"][target_id]
            open_builds = [s for t, s in db["builds"].values()
                           if t == target_id and s in ("building", "pending")]
            assert not open_builds, f"job {job_id} failed but target {target_id} has {open_builds}"
            if kind == "agent":
                assert soft_deleted or status != "deploying", (
                    f"job {job_id} failed for good but agent {target_id} is still deploying")
            else:
                assert status not in ("pending", "building"), (
                    f"job {job_id} failed for good but connector {target_id} is {status}")


class SteeredQueueStateMachine(QueueStateMachine):
    """
    `QueueStateMachine` with steps steered at cases its own steps reach rarely or
    never (issue #24): two jobs of one target, one failing for good beside a
    sibling that succeeded; an executor that writes its build row and also
    reports through its context; a graceful stop while a worker with look-ahead
    holds prefetched jobs in its buffer. Subclass it instead of
    `QueueStateMachine` to run your executors through these too.

    A machine of its own, not rules added to `QueueStateMachine`: a derandomized
    profile draws a machine's examples from its rules, and the mutant hunts of
    tests/test_statemachine_mutants.py (and their shrinks, within a test's time)
    were written against the base machine's.
    """

    @rule(kind=st.sampled_from(KINDS), plan=st.lists(
        st.sampled_from((Outcome.FAIL, Outcome.SUCCEED, Outcome.RAISE)), min_size=1,
        max_size=2))
    def enqueue_both_ways(self, kind: str, plan: list[Outcome]) -> None:
        """
        A job whose executor writes its build row and then reports the other
        outcome through its context (`ScriptedWorld.report_both_ways`, with the
        built-in scripted executors): the folded report meets a row already
        'success' or 'failed', which stays and decides the job.
        """
        if kind not in self.kinds:
            kind = self.kinds[0]
        self._call(self._enqueue, kind, False, self._playable(plan), 0, True)

    @precondition(lambda self: self.config.concurrency == 1 and self._plays(Outcome.RAISE))
    @rule(kind=st.sampled_from(KINDS), failing_first=st.booleans(),
          prior_success=st.booleans(), panics=st.booleans())
    def target_with_several_jobs(self, kind: str, failing_first: bool, prior_success: bool,
                                 panics: bool) -> None:
        """
        Two jobs for one target, each with a build row of its own: one succeeds,
        the other fails for good (its attempts used up by another writer, so the
        cap fails it unrun; or, with `panics`, it crashes on every run), and a
        worker drains both. Failing second, it meets a target its sibling left
        `running`, which terminalization leaves as it is (docs/rules.md §6: only
        a `deploying` agent, or a `pending` or `building` connector, becomes
        `failed`); failing first, it meets the target still deploying. One
        executor at a time, so that the two runs come in the order enqueued.
        """
        if kind not in self.kinds:
            kind = self.kinds[0]
        cap = self.config.build_max_attempts
        failing = ((self._playable((Outcome.RAISE,) * cap), 0) if panics else ((), cap))
        jobs = [((), 0), failing]
        if failing_first:
            jobs.reverse()
        ids = self._call(self._enqueue_for_one_target, kind, prior_success, jobs)
        # Drain until both have ended (a hang of an older job stops a drain short).
        for _ in range(cap + 2):
            if not any(self.model.jobs.get(j) is not None
                       and self.model.jobs[j].status in ("pending", "in_progress")
                       for j in ids):
                break
            self.drain(hard=False, stop_during_run=None)

    async def _enqueue_for_one_target(
        self, kind: str, prior_success: bool,
        jobs: Sequence[tuple[tuple[Outcome, ...], int]],
    ) -> list[UUID]:
        """Jobs (plan, stored attempt) for one new target, each with its own build row."""
        owner = uuid.uuid4()
        name = f"{kind.lower()}-{len(self.enqueued)}"
        connector = kind == "McpServerUpload"
        added: list[tuple[UUID, str, UUID, tuple[Outcome, ...], int]] = []
        async with self.queue.db.transaction() as tx:
            target, builds = await self._insert_target(tx, owner, name, connector, prior_success)
        for plan, stored_attempt in jobs:
            # A transaction each: the claim's order is created_at, which is the
            # transaction's start (two jobs of one transaction would tie).
            async with self.queue.db.transaction() as tx:
                build = (await insert_connector_build(tx, target, owner_id=owner) if connector
                         else await insert_agent_build(tx, target))
                payload = self.make_payload(kind, target_id=target, build_id=build,
                                            owner_id=owner, name=name)
                job_id = await self.queue.enqueue(payload, tx=tx, owner_id=owner)
                if stored_attempt:
                    await tx.execute(Q.job_set_attempt, job_id, stored_attempt)
            builds[build] = "pending" if connector else "queued"
            added.append((job_id, payload.kind, build, plan, stored_attempt))
        for job_id, payload_kind, build, plan, stored_attempt in added:
            self.world.plans[job_id] = plan
            if target not in self.model.targets:
                self._add(job_id, payload_kind, True, target, build, builds, connector, plan)
            else:
                self.model.add_job(job_id, kind=payload_kind, valid=True, target=target,
                                   build_id=build, plan=plan)
                self.enqueued.add(job_id)
            self.model.jobs[job_id].attempt = stored_attempt
        return [a[0] for a in added]

    @precondition(lambda self: self.config.concurrency == 1 and self._plays(Outcome.RAISE))
    @rule(kind=st.sampled_from(KINDS), look_ahead=st.integers(1, 3), behind=st.integers(1, 4),
          running=st.sampled_from((Outcome.SUCCEED, Outcome.FAIL, Outcome.RAISE)))
    def stop_with_a_full_buffer(self, kind: str, look_ahead: int, behind: int,
                                running: Outcome) -> None:
        """
        A graceful stop while the buffer holds prefetched jobs, in every example
        that draws this step (the base machine's drains reach one only when
        enough jobs happen to be pending; issue #24).

        Whatever the queue holds is drained first, so that the next claim takes
        this step's jobs alone: one job, then `behind` more, each for a new
        target. A worker with a look-ahead of `look_ahead` claims the first and
        up to `look_ahead` of the others in one statement (one slot: one
        statement at a time), and its executor asks for the stop as the run
        begins (`ScriptedWorld.stop_during_run`), so the stop lands while the
        buffer is full. The model decides: the running job ends as its run
        says; every job behind it is pending with its attempt as before its
        claim, whether it was claimed ahead and given back or never claimed.
        """
        if kind not in self.kinds:
            kind = self.kinds[0]
        self._drain_leftovers()
        self._call(self._enqueue, kind, False, self._playable((running,)))
        for i in range(behind):
            self._call(self._enqueue, self.kinds[(self.kinds.index(kind) + 1 + i)
                                                 % len(self.kinds)], False, ())
        worker = self._look_ahead_worker(look_ahead)
        self._call(self._drain, [worker], False, 1)
        self.model.drain(stop_after_runs=1)
        # The steering itself: the buffer held what was claimed ahead when the
        # stop came, and gave it back (the invariant checks how). One more when
        # the running job crashed and a claim sent during its run, with room
        # left, took it again after its reset (it goes back unstarted too).
        given = min(behind, look_ahead)
        assert given <= worker.stats.returned <= given + (running is Outcome.RAISE), (
            f"the stop gave back {worker.stats.returned} prefetched job(s), not {given} "
            f"(look-ahead {look_ahead}, {behind} behind, running {running.name}; "
            f"worker stats: {worker.stats})")

    def _drain_leftovers(self) -> None:
        """Drain until nothing is claimable and no claim is stuck (a hang stops
        a drain short: drain again; every drain runs each job once at least)."""
        def left() -> bool:
            return bool(self.model.claimable()) or any(
                self.model.stuck(j) for j in self.model.jobs.values())

        for _ in range((self.config.build_max_attempts + 1) * len(self.model.jobs) + 1):
            if not left():
                return
            self.drain(hard=False, stop_during_run=None)
        assert not left(), "jobs still claimable after draining every attempt"

    def _look_ahead_worker(self, look_ahead: int) -> Worker:
        """A worker of the machine's executors that claims `look_ahead` jobs ahead."""
        config = attrs.evolve(self.config, prefetch=look_ahead)
        queue = Queue(self.queue.db, config=config, secrets=self.queue.secrets)
        return Worker(queue, self.executors, store=self.make_store())


def _diff(what: str, actual: dict[Any, Any], expected: dict[Any, Any]) -> str:
    lines = [f"{what}: database differs from the model"]
    for key in sorted(set(actual) | set(expected), key=str):
        if actual.get(key) != expected.get(key):
            lines.append(f"  {key}: database={actual.get(key)!r} model={expected.get(key)!r}")
    return "\n".join(lines)


async def run_queue_state_machine(
    db_or_dsn: Database | str,
    machine: type[QueueStateMachine] = QueueStateMachine,
    *,
    settings: settings | None = None,
    secrets: SecretBox | None = None,
    rule_timeout: float = 20.0,
) -> None:
    """
    Run `machine` against a migrated database, from a trio test.

    Args:
        db_or_dsn: an open `Database` or a DSN (the tables are emptied before
            every example: give it a database of its own).
        machine: `QueueStateMachine` or your subclass.
        settings: Hypothesis settings; default `profile()`.
        secrets: the key for sealed payload fields (a fixed test key by default).
        rule_timeout: seconds one rule may take; a rule that blocks (a wake that
            waits, a drain that never ends) fails the example instead of hanging.
    """
    await run_machine(db_or_dsn, machine, settings=settings or profile(), secrets=secrets,
                      rule_timeout=rule_timeout)
