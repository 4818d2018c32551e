"""
A Hypothesis state machine that drives the real engine's plain jobs against
`PlainModel`.

Every step does something to the queue — enqueue a job (a priority, a delay,
a unique key, how many attempts, what each run does; through `Queue.enqueue` or
the SQL function `nasiko_queue_enqueue`, as `nasiko_queue.aio` calls it), let time pass (the
rows' run_at moved back in SQL, never a sleep), let a real `Worker` drain the
queue (a hung run cancelled through `Queue.cancel` and the worker's
heartbeat, or the worker stopped hard), cancel a job, have a registered worker
claim a job and die (with a cancel of that job waiting for the claim's row lock,
in one rule), run the leader's rescue, retry a dead job — and then
compares every row with the model and checks the invariants:

* every row's state and attempt are the model's, and an available job is due
  exactly when the model says so;
* each drain runs the jobs the model says, in its order (priority, then
  run_at), and no run starts before its job's run_at or while a due job of a
  lower priority number waits in its queue (checked by the executor itself,
  in the database, at the start of each run);
* a crashed job's run_at lies in its backoff window (the machine's backoff
  is deterministic: `plain_model.backoff`);
* at most one job per unique key among the jobs in that key's states;
* a cancelled job never runs again;
* a short job claimed ahead of a long one (the adaptive look-ahead of issue
  #25) never waits for a slot longer than the look-ahead's TTL: it starts, or
  goes back for another worker.

Settings: the profiles of `runner.py` (``nasiko-ci`` by default), with fewer
and longer examples (`plain_profile`); it runs as the build-job machine does
(`nasiko_queue.testing.runner`).

.. versionadded:: 0.2.0
"""

from __future__ import annotations

import uuid
from collections import Counter
from datetime import UTC, datetime, timedelta
from functools import partial
from typing import Any, ClassVar
from uuid import UUID

import asyncpg
import attrs
import trio
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import invariant, precondition, rule

from .. import aio
from ..admin import jobs as job_admin
from ..builds.store import PgJobStore
from ..config import QueueConfig
from ..db.database import Database
from ..db.statements import Q
from ..engine.contracts import ClaimedJob, JobResult, WorkerIdentity
from ..engine.state import WorkerStats
from ..engine.worker import Worker
from ..executors import Executors, PlainJobContext
from ..plain.args import Job, JobArgs, JobOptions, Unique
from ..plain.schedules import Schedule, Scheduler, SchedulerRound
from ..plain.store import PlainJobStore
from ..queue import Queue
from .fixtures import insert_agent, insert_agent_build, make_payload
from .plain_model import (
    AVAILABLE,
    CANCELLED,
    DISCARDED,
    RUNNING,
    TICK,
    WAITING_OR_RUNNING,
    OnHang,
    PlainModel,
    Run,
    backoff,
)
from .runner import DatabaseMachine, profile, run_machine

#: The queue the machine's workers run, and one no worker runs (never claimed).
QUEUE = "default"
OTHER_QUEUE = "elsewhere"
#: Another queue the workers run, in a lane of its own, whose one job at a time
#: holds its slot until the drain of `QUEUE` is over (`drain_beside_a_busy_lane`).
BUSY_QUEUE = "busy"
#: Unique keys drawn (None: not unique), and the states they are unique within.
KEYS = (None, None, "a", "b")
KEY_STATES = (WAITING_OR_RUNNING, WAITING_OR_RUNNING | {"completed"})
#: Seconds a crash's retry may come after its claim (the window's upper slack).
RETRY_SLACK = 5.0

#: `enqueue_batch`'s refusals: which kind's statement the server refuses.
PLAIN = "plain"
BUILD = "build"
REFUSED_TABLES = {PLAIN: "nasiko_queue_jobs", BUILD: "build_jobs"}
#: A trigger that refuses every row of {table} (dropped once the batch is answered).
REFUSE = """
CREATE OR REPLACE FUNCTION refuse_batch() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN RAISE EXCEPTION 'refused by the machine'; END $$;
CREATE TRIGGER refuse_batch BEFORE INSERT ON {table}
FOR EACH ROW EXECUTE FUNCTION refuse_batch();
"""

#: The worker's configuration: one slot on the machine's queue (and one on the
#: busy lane's), no build lane, no maintenance of its own (the machine plays the
#: leader), slow polls, no LISTEN connection (the machine wakes its workers
#: itself, in process; one per drain's worker took a third of its start and stop).
PLAIN_CONFIG = QueueConfig(
    queues={QUEUE: 1, BUSY_QUEUE: 1},
    builds=False,
    maintenance=False,
    listen=False,
    poll_interval=60.0,
    recovery_interval=3600.0,
    retry_initial_delay=0.01,
    retry_max_delay=0.05,
)

#: The machine's worker for `drain_then_fence`: it heartbeats only when told to
#: (`beat_once`), so that no beat of its own fences it a second time.
FENCED_CONFIG = attrs.evolve(PLAIN_CONFIG, heartbeat_interval=3600.0, lease=3 * 3600.0)

#: What the leader does to a worker paused past its lease: declared dead ($1).
DECLARE_DEAD = "UPDATE nasiko_queue_workers SET dead_at = now() WHERE id = $1"

#: Moves run_at and attempted_at of every job back by $1 seconds: time passes
#: for the schedule. Every row, not only the waiting ones: a job a dead worker
#: holds keeps its run_at when the rescue gives it back, and must then be due
#: (and ordered) as the model says; attempted_at moves with it, so that a
#: crashed job's backoff window keeps its width (and a claim only gets older,
#: which the rescue's lease check allows); and the value a running job's claim
#: replaced, which a give-back restores.
AGE_JOBS = """
UPDATE nasiko_queue_jobs
SET run_at = run_at - make_interval(secs => $1::double precision),
    attempted_at = attempted_at - make_interval(secs => $1::double precision),
    previous_attempted_at = previous_attempted_at - make_interval(secs => $1::double precision)
"""

#: `testing_worker_expire` moves a dead worker's build claims back with its
#: heartbeat; this does the same for its plain claims (the rescue takes only
#: jobs claimed before the worker's lease ended).
AGE_PLAIN_CLAIMS = """
UPDATE nasiko_queue_jobs SET attempted_at = attempted_at - interval '1 minute'
WHERE claimed_by = $1 AND state = 'running'
"""

#: At the start of a run: was this job due when claimed, and did a due job with a
#: lower priority number wait in its queue then? (One slot: nothing else moves.)
CLAIM_CHECK = """
SELECT j.run_at <= j.attempted_at AS was_due,
       (SELECT count(*) FROM nasiko_queue_jobs AS o
        WHERE o.queue = j.queue AND o.state = 'available' AND o.run_at <= j.attempted_at
          AND o.priority < j.priority) AS higher_waiting
FROM nasiko_queue_jobs AS j WHERE j.id = $1
"""

#: Unique keys held by more than one job (in the states each is unique within).
DUPLICATE_KEYS = """
SELECT unique_key, count(*) AS n FROM nasiko_queue_jobs
WHERE unique_key IS NOT NULL AND state = ANY (unique_states)
GROUP BY unique_key HAVING count(*) > 1
"""

#: Sessions of this database waiting for a lock that backend $1 holds.
BLOCKED_BY = """
SELECT count(*) FROM pg_stat_activity
WHERE datname = current_database() AND $1::int = ANY (pg_blocking_pids(pid))
"""

SNAPSHOT = """
SELECT id, state, attempt, CASE WHEN state = 'available' THEN run_at <= now() END AS due,
       cancel_requested,
       extract(epoch FROM run_at - attempted_at)::double precision AS waits
FROM nasiko_queue_jobs
"""

# -- a long job among short ones (issue #25: the adaptive look-ahead) ------------------

#: The queue of `long_job_among_short_ones`, which two workers of that rule's own run.
MIXED_QUEUE = "mixed"
#: Their `prefetch_auto_ttl`, shorter than the default's second so that the rule
#: is quick; and a wait so generous (`prefetch_auto_wait`) that the short runs
#: before the long one surely leave the lane a look-ahead (its sizing has tests
#: of its own, in tests/test_prefetch.py).
MIXED_TTL = 0.2
#: LISTEN on: the idle worker learns of the jobs given back by the other one's NOTIFY.
MIXED_CONFIG = attrs.evolve(PLAIN_CONFIG, queues={MIXED_QUEUE: 1}, prefetch_auto_ttl=MIXED_TTL,
                            prefetch_auto_wait=5.0, listen=True)
#: The long run lasts until every short job of its rule has run, at most this long.
LONG_RUN = 3.0
#: What a short job's wait may exceed the TTL by: the give-back's statement and
#: a busy machine's scheduling (a job held behind the long run waits `LONG_RUN`).
WAIT_SLACK = 1.5
#: Seconds from a job's claim to now (the start of its run), on the server's clock.
CLAIM_WAIT = """
SELECT extract(epoch FROM clock_timestamp() - attempted_at)::double precision
FROM nasiko_queue_jobs WHERE id = $1
"""


class MixedWorld:
    """The runs of one `long_job_among_short_ones`: which job is long, and how
    long each short one waited from its claim to its start."""

    def __init__(self, long: UUID | None = None, shorts: int = 0) -> None:
        self.long = long
        self.shorts_left = shorts
        self.shorts_done = trio.Event()
        self.long_started = trio.Event()
        #: (job, seconds from its claim to its start) of every short run.
        self.waits: list[tuple[UUID, float]] = []

    async def run(self, ctx: PlainJobContext[Any]) -> None:
        waited = await ctx.db.fetchval(CLAIM_WAIT, ctx.job_id)
        if ctx.job_id == self.long:
            self.long_started.set()
            with trio.move_on_after(LONG_RUN):
                await self.shorts_done.wait()
            return
        self.waits.append((ctx.job_id, waited))
        self.shorts_left -= 1
        if self.shorts_left <= 0:
            self.shorts_done.set()


@attrs.frozen(kw_only=True)
class JobSpec:
    """One job the machine enqueues: its options, its schedule, what its runs do."""

    priority: int
    #: Seconds from now until it is due (a multiple of TICK).
    delay: int
    #: Instead of `delay`: an explicit run_at, this many seconds from now (in the
    #: past, now, or later; a multiple of TICK). None: `delay`.
    run_at: int | None
    key: str | None
    key_states: frozenset[str]
    max_attempts: int
    plan: tuple[Run, ...]
    #: Enqueued on a queue no worker of the machine runs.
    elsewhere: bool
    #: The entry point (issue #26): `Queue.enqueue`, or the SQL function
    #: `nasiko_queue_enqueue` as `nasiko_queue.aio` calls it (the call built from
    #: the same codec, run on the machine's connection). Every entry point obeys
    #: the one model.
    via: str = "queue"


#: Explicit run_at offsets (seconds from now) of a job enqueued by itself: in the
#: past, now, later; and of a job due now. None: the job gives a delay instead.
RUN_AT = (None, None, -60 * TICK, 0, 2 * TICK)
RUN_AT_DUE = (None, None, -60 * TICK, 0)
#: In a batch, no explicit run_at ties with a delay of the same batch: the
#: client's clock is read before the statement, the server's per row during it,
#: so the two would order a tie differently from the order given.
BATCH_RUN_AT = (None, None, -60 * TICK, -TICK, 3 * TICK)


def _job_specs(*, due: bool = False, batch: bool = False) -> st.SearchStrategy[JobSpec]:
    run_at = BATCH_RUN_AT if batch else RUN_AT_DUE if due else RUN_AT
    return st.builds(
        JobSpec,
        priority=st.sampled_from((0, 1, -1)),
        delay=st.just(0) if due else st.sampled_from((0, 2 * TICK, 60 * TICK)),
        run_at=st.sampled_from(run_at),
        key=st.sampled_from(KEYS), key_states=st.sampled_from(KEY_STATES),
        max_attempts=st.sampled_from((3, 1, 2)),
        plan=st.lists(st.sampled_from((Run.RAISE, Run.RETURN, Run.HANG,
                                       Run.CANCEL_THEN_RAISE)),
                      max_size=3).map(tuple),
        elsewhere=st.just(False) if due else st.sampled_from((False, False, True)),
        via=st.sampled_from(ENTRY_POINTS))


#: How the machine's jobs are enqueued: see `JobSpec.via`.
ENTRY_POINTS = ("queue", "sql function")


@attrs.frozen(kw_only=True)
class MachineTask(JobArgs):
    """The machine's one job type: its runs do what `PlainWorld.plans` says."""

    kind: ClassVar[str] = "plain_machine_task"
    options: ClassVar[JobOptions] = JobOptions(queue=QUEUE, max_attempts=3)
    n: int


#: The machine's schedule: a tick every TICK seconds, its jobs on a queue no
#: worker runs. The schedulers' wall clock is the model's, from this epoch (a
#: minute boundary long past: every tick's job is due at once).
SCHEDULE = Schedule("machine-tick", "* * * * *", MachineTask(n=-1),
                    options=JobOptions(queue=OTHER_QUEUE))
SCHEDULE_EPOCH = datetime(2026, 1, 1, tzinfo=UTC)


class SimulatedCrash(Exception):
    """What a run planned to `Run.RAISE` raises."""


class PlainWorld:
    """What each run of each job does, and a record of every run."""

    def __init__(self) -> None:
        self.plans: dict[UUID, tuple[Run, ...]] = {}
        self.runs: Counter[UUID] = Counter()
        #: The jobs run in this drain, in order.
        self.log: list[UUID] = []
        #: Runs that started although their job was not due, or while a due job
        #: of a lower priority number waited in the queue.
        self.bad_claims: list[str] = []
        self.hung = trio.Event()
        self.hung_job: UUID | None = None
        #: The busy lane's run: started, and allowed to end.
        self.busy_started = trio.Event()
        self.busy_release = trio.Event()
        #: The runs of the last `long_job_among_short_ones`.
        self.mixed = MixedWorld()

    def new_drain(self) -> None:
        self.log = []
        self.rearm()

    def rearm(self) -> None:
        self.hung = trio.Event()
        self.hung_job = None

    async def begin(self, ctx: PlainJobContext[Any]) -> Run:
        self.runs[ctx.job_id] += 1
        self.log.append(ctx.job_id)
        row = await ctx.db.fetchrow(CLAIM_CHECK, ctx.job_id)
        if row is not None and not row["was_due"]:
            self.bad_claims.append(f"job {ctx.job_id} ran before its run_at")
        if row is not None and row["higher_waiting"]:
            self.bad_claims.append(f"job {ctx.job_id} ran while {row['higher_waiting']} due "
                                   "job(s) of a lower priority number waited")
        plan = self.plans.get(ctx.job_id, ())
        return plan[ctx.attempt - 1] if ctx.attempt <= len(plan) else Run.RETURN

    async def hang(self, job_id: UUID) -> None:
        self.hung_job = job_id
        self.hung.set()
        await trio.sleep_forever()


def plain_executors(world: PlainWorld) -> Executors:
    executors = Executors()

    async def run(ctx: PlainJobContext[MachineTask]) -> None:
        if ctx.queue == BUSY_QUEUE:  # holds its lane's one slot until released
            world.busy_started.set()
            await world.busy_release.wait()
            return
        if ctx.queue == MIXED_QUEUE:
            await world.mixed.run(ctx)
            return
        outcome = await world.begin(ctx)
        if outcome is Run.RAISE:
            raise SimulatedCrash(f"planned crash on attempt {ctx.attempt}")
        if outcome is Run.CANCEL_THEN_RAISE:
            assert await ctx.db.fetchval(Q.plain_cancel, ctx.job_id) == "cancelling"
            raise SimulatedCrash(f"planned crash after a cancel on attempt {ctx.attempt}")
        if outcome is Run.HANG:
            await world.hang(ctx.job_id)

    executors.register(MachineTask, run, backoff=backoff)
    return executors


class PlainStateMachine(DatabaseMachine):
    """Plain jobs in the real engine against `PlainModel`, one step at a time."""

    runner: ClassVar[str] = "run_plain_state_machine"
    config: ClassVar[QueueConfig] = PLAIN_CONFIG

    def __init__(self) -> None:
        super().__init__()
        self.world = PlainWorld()
        self.queue = Queue(self.env.db, config=self.config)
        self.executors = plain_executors(self.world)
        self.model = PlainModel()
        self.dead: dict[UUID, PgJobStore] = {}
        #: The claims of the workers that died (`worker_dies`), with the worker:
        #: each may be a frozen process that resumes (`frozen_worker_resumes`).
        self.frozen: list[tuple[ClaimedJob, UUID]] = []
        self.cancelled_runs: dict[UUID, int] = {}
        self.rescuer = PgJobStore(self.env.db, self.config, runnable_kinds=frozenset(),
                                  known_kinds=frozenset())
        #: Build jobs the batches enqueued (no worker of the machine runs them).
        self.build_jobs = 0
        self.scheduler = Scheduler(self.queue, [SCHEDULE])

    # -- hooks (mutation tests swap these) -----------------------------------------

    def make_worker(self, config: QueueConfig | None = None) -> Worker:
        queue = self.queue if config is None else Queue(self.env.db, config=config)
        return Worker(queue, self.executors)

    # -- rules: the application --------------------------------------------------------

    @rule(jobs=st.lists(_job_specs(), min_size=1, max_size=4))
    def enqueue(self, jobs: list[JobSpec]) -> None:
        """Jobs, one enqueue each; a unique one whose key is held must answer the
        holder's id."""
        for spec in jobs:
            self._enqueue(spec)

    @rule(jobs=st.lists(_job_specs(due=True), min_size=1, max_size=4))
    def enqueue_due(self, jobs: list[JobSpec]) -> None:
        """Jobs due now on the queue the workers run (so that drains have work)."""
        for spec in jobs:
            self._enqueue(spec)

    def _enqueue(self, spec: JobSpec) -> None:
        job = self._job(spec, datetime.now(UTC))
        if spec.via == "queue":
            job_id = self._call(lambda: self.queue.enqueue(
                job.args, run_at=job.run_at, delay=job.delay, options=job.options,
                unique=job.unique))
        else:
            # What an asyncio application's `aio.enqueue(conn, ...)` runs: the
            # Database has the asyncpg connection's `fetchval`.
            job_id = self._call(lambda: aio.enqueue(
                self.env.db, job.args, run_at=job.run_at, delay=job.delay,
                options=job.options, unique=job.unique))
        self._enqueued(spec, job_id)

    def _job(self, spec: JobSpec, now: datetime) -> Job:
        """`spec` as a `Job` (an explicit run_at counted from `now`, the client's clock)."""
        options = JobOptions(queue=OTHER_QUEUE if spec.elsewhere else QUEUE,
                             priority=spec.priority, max_attempts=spec.max_attempts)
        unique = None if spec.key is None else Unique(spec.key, states=spec.key_states)
        args = MachineTask(n=len(self.model.jobs))
        if spec.run_at is None:
            return Job(args, options=options, delay=spec.delay, unique=unique)
        return Job(args, options=options, run_at=now + timedelta(seconds=spec.run_at),
                   unique=unique)

    def _enqueued(self, spec: JobSpec, job_id: UUID) -> None:
        """The model's enqueue of `spec`, which the engine answered with `job_id`."""
        expected = self.model.enqueue(
            job_id, queue=OTHER_QUEUE if spec.elsewhere else QUEUE, priority=spec.priority,
            max_attempts=spec.max_attempts, delay=spec.delay, plan=spec.plan,
            unique_key=spec.key, unique_states=spec.key_states,
            run_at=None if spec.run_at is None else self.model.now + spec.run_at)
        assert job_id == expected, (
            f"enqueue with key {spec.key!r} returned {job_id}; the model says {expected}")
        self.world.plans.setdefault(job_id, spec.plan)

    @rule(jobs=st.lists(_job_specs(batch=True), min_size=1, max_size=4),
          build=st.booleans(), refuse=st.sampled_from((None, None, PLAIN, BUILD)))
    def enqueue_batch(self, jobs: list[JobSpec], build: bool, refuse: str | None) -> None:
        """
        `Queue.enqueue_many` of plain jobs (delays, explicit run_at, unique keys),
        with a build job among them when `build` (one statement per kind, the
        build one first): the ids come back in the order given (a unique job
        whose key is held, by an earlier job or one earlier in the batch, answers
        its holder), and the jobs are claimed in that order. With `refuse`, the
        server refuses that kind's statement (a trigger that raises): the batch
        is one transaction, so nothing of it is left, not even the build job of
        a statement that went through.
        """
        refused = refuse == PLAIN or (refuse == BUILD and build)
        ids = self._call(self._enqueue_batch, jobs, build, refuse)
        if refused:
            assert ids is None, f"a batch whose {refuse} statement was refused went in: {ids}"
            return
        assert ids is not None, "a batch no trigger refused was refused"
        for spec, job_id in zip(jobs, ids[:len(jobs)], strict=True):
            self._enqueued(spec, job_id)
        if build:
            self.build_jobs += 1

    async def _enqueue_batch(self, jobs: list[JobSpec], build: bool,
                             refuse: str | None) -> list[UUID] | None:
        now = datetime.now(UTC)
        # Explicit run_at apart by a microsecond each: the order given.
        batch: list[Any] = [self._job(spec, now + timedelta(microseconds=i))
                            for i, spec in enumerate(jobs)]
        if build:
            owner = uuid.uuid4()
            agent = await insert_agent(self.env.db, owner_id=owner)
            build_id = await insert_agent_build(self.env.db, agent)
            batch.append(make_payload("Upload", target_id=agent, build_id=build_id,
                                      owner_id=owner))
        if refuse is not None:
            await self.env.db.execute(REFUSE.format(table=REFUSED_TABLES[refuse]))
        try:
            return await self.queue.enqueue_many(batch)
        except asyncpg.RaiseError as exc:
            if "refused by the machine" not in str(exc):
                raise
            return None
        finally:
            if refuse is not None:
                await self.env.db.execute(
                    f"DROP TRIGGER refuse_batch ON {REFUSED_TABLES[refuse]}")

    # -- rules: schedules ------------------------------------------------------------

    @rule(fresh=st.integers(0, 2))
    def schedulers_tick(self, fresh: int) -> None:
        """
        Schedulers run a round over the machine's one schedule at once, at the
        model's clock (`SCHEDULE_EPOCH` on): the one the machine keeps (which
        remembers the last tick it saw) and `fresh` new ones (replicas just
        started, which know nothing). Each tick is enqueued exactly once, the
        first round only records the schedule, and a round at a tick already
        taken enqueues nothing (docs/rules.md, schedules).
        """
        rounds = self._call(self._schedulers_tick, fresh)
        recorded, enqueued = self.model.schedule_round()
        ticks = [t for r in rounds for t in r.enqueued]
        assert not any(r.failed for r in rounds), rounds
        assert (sum(len(r.recorded) for r in rounds), len(ticks)) == (recorded, enqueued), (
            f"{1 + fresh} scheduler(s) recorded {[r.recorded for r in rounds]} and enqueued "
            f"{ticks}; the model says {recorded} recorded, {enqueued} enqueued")
        for tick in ticks:
            # The tick's job is due (its run_at is the tick, long past) on a queue
            # no worker of the machine runs.
            self.model.enqueue(tick.job_id, queue=OTHER_QUEUE, priority=0, max_attempts=3,
                               delay=0, plan=(), run_at=self.model.now - TICK)

    async def _schedulers_tick(self, fresh: int) -> list[SchedulerRound]:
        now = SCHEDULE_EPOCH + timedelta(seconds=self.model.now)
        schedulers = [self.scheduler] + [Scheduler(self.queue, [SCHEDULE]) for _ in range(fresh)]
        rounds: list[SchedulerRound] = []

        async def tick(scheduler: Scheduler) -> None:
            rounds.append(await scheduler.run_once(now))

        async with trio.open_nursery() as nursery:
            for scheduler in schedulers:
                nursery.start_soon(tick, scheduler)
        return rounds

    @rule(ticks=st.sampled_from((1, 2, 60)))
    def advance_time(self, ticks: int) -> None:
        """Time passes (every run_at moved back in SQL, never a sleep)."""
        self._call(self.env.db.execute, AGE_JOBS, float(ticks * TICK))
        self.model.advance(ticks * TICK)

    @precondition(lambda self: bool(self.model.jobs))
    @rule(data=st.data())
    def cancel(self, data: st.DataObject) -> None:
        job_id = data.draw(st.sampled_from(list(self.model.jobs)), label="job")
        result = self._call(self.queue.cancel, job_id)
        expected = self.model.cancel(job_id)
        # The model answers an ended job's state; the queue "already <state>".
        answer = None if result is None else result.removeprefix("already ")
        assert answer == expected, f"cancel({job_id}) said {result!r}, the model {expected!r}"

    def _dead(self) -> list[UUID]:
        return [j.id for j in self.model.in_states({DISCARDED, CANCELLED})]

    @precondition(lambda self: bool(self._dead()))
    @rule(data=st.data())
    def retry_dead_job(self, data: st.DataObject) -> None:
        """
        The dead-letter queue's retry (`admin.jobs.retry`): a discarded or
        cancelled job runs again from attempt 0, with no cancel asked (a job
        cancelled while it ran keeps no old request: the invariant compares
        `cancel_requested`, and a retried run that crashes is retried, not
        cancelled); it is refused, and nothing changes, while another job holds
        its unique key.
        """
        self._retry_dead(data.draw(st.sampled_from(self._dead()), label="job"))

    def _retry_dead(self, job_id: UUID) -> bool:
        """The dead-letter retry of `job_id`; False when refused (its key is held)."""
        job = self.model.jobs[job_id]
        held = job.unique_key is not None and self.model.holder_of(job.unique_key) is not None
        try:
            self._call(job_admin.retry, self.env.db, job_id)
        except job_admin.JobRefused:
            assert held, f"the retry of {job_id} was refused though its key is free"
            return False
        assert not held, f"the retry of {job_id} took a key another job holds"
        self.model.retry_dead(job_id)
        self.cancelled_runs.pop(job_id, None)  # it may run again, until cancelled again
        return True

    # -- rules: workers ------------------------------------------------------------------

    @rule()
    def drain(self) -> None:
        """
        A worker starts, runs the queue until nothing is due, and stops. A hung
        run is cancelled (`Queue.cancel`, then the worker's heartbeat delivers
        it) and the drain goes on.
        """
        self._drain_and_check(OnHang.CANCEL)

    @rule()
    def drain_then_hard_stop(self) -> None:
        """As `drain`, but a hung run is ended by stopping the worker hard (its
        job is available again at once, the attempt counted)."""
        self._drain_and_check(OnHang.HARD_STOP)

    @rule()
    def drain_then_fence(self) -> None:
        """
        As `drain`, but the worker of a hung run is cut off: declared dead (as
        the leader does to a worker paused past its lease), it learns so at its
        next heartbeat and fences: the run is stopped and its outcome never
        written, the job is available again at once (attempt counted), and the
        worker, registered anew, drains on.
        """
        self._drain_and_check(OnHang.FENCE)

    @rule()
    def drain_beside_a_busy_lane(self) -> None:
        """
        As `drain`, while another lane of the same worker (queue `BUSY_QUEUE`) is
        busy all through it: its one job holds its one slot until the drain of
        the machine's queue is over. Lanes never wait for each other, so the
        drain runs exactly what `drain` would (every due job of a lane with a
        free slot is claimed within the drain that follows its wake).
        """
        busy = self._call(lambda: self.queue.enqueue(
            MachineTask(n=len(self.model.jobs)), options=JobOptions(queue=BUSY_QUEUE)))
        self.model.enqueue(busy, queue=BUSY_QUEUE, priority=0, max_attempts=3, delay=0,
                           plan=(), unique_key=None, unique_states=WAITING_OR_RUNNING)
        self._drain_and_check(OnHang.CANCEL, busy=True)
        assert self.model.drain(BUSY_QUEUE, OnHang.CANCEL).runs == [busy]

    def _drain_and_check(self, on_hang: OnHang, *, busy: bool = False) -> None:
        ran = self._call(self._drain, on_hang, busy)
        expected = self.model.drain(QUEUE, on_hang)
        assert ran == expected.runs, (
            f"the drain ran {ran}; the model (priority, then run_at) says {expected.runs}")

    async def _drain(self, on_hang: OnHang, busy: bool = False) -> list[UUID]:
        worker = self.make_worker(FENCED_CONFIG if on_hang is OnHang.FENCE else None)
        world = self.world
        world.new_drain()
        world.busy_started, world.busy_release = trio.Event(), trio.Event()
        scope = trio.CancelScope()

        async def run(*, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
            with scope:
                await worker.run(task_status=task_status)

        async with trio.open_nursery() as nursery:
            await nursery.start(run)
            if busy:
                await world.busy_started.wait()
            hard = False
            while True:
                hung = world.hung
                if await self._drained_or_hung(worker, hung) and not hung.is_set():
                    break
                job_id = world.hung_job
                assert job_id is not None
                if on_hang is OnHang.HARD_STOP:
                    hard = True
                    break
                world.rearm()
                if on_hang is OnHang.FENCE:
                    await self._fence(worker)
                    continue
                before = worker.stats.cancelled
                answer = await self.queue.cancel(job_id)
                assert answer == "cancelling", f"cancel of a running job said {answer!r}"
                await worker.heartbeat.beat_once()
                await worker.wait_for(partial(_cancelled_more, before))
            if busy:  # the busy lane's job ends only now, completed
                world.busy_release.set()
                await worker.drain_once()
            if hard:
                scope.cancel()
            else:
                worker.stop()
        return list(world.log)

    async def _fence(self, worker: Worker) -> None:
        """Declare `worker` dead; its next heartbeat fences it, and the fenced run
        puts its job back."""
        await worker.wait_for(lambda s: s.heartbeats >= 1)  # its own first beat landed
        identity = worker.heartbeat.identity
        assert identity is not None
        released = worker.stats.released
        await self.env.db.execute(DECLARE_DEAD, identity.id)
        await worker.heartbeat.beat_once()
        await worker.wait_for(lambda s: s.released > released)

    @staticmethod
    async def _drained_or_hung(worker: Worker, hung: trio.Event) -> bool:
        """Wait until a drain of `worker` is over (True) or a run hangs (False)."""
        drained = False
        async with trio.open_nursery() as waiting:

            async def drain_once() -> None:
                nonlocal drained
                await worker.drain_once(lanes=[QUEUE])
                drained = True
                waiting.cancel_scope.cancel()

            async def watch_hang() -> None:
                await hung.wait()
                waiting.cancel_scope.cancel()

            waiting.start_soon(drain_once)
            waiting.start_soon(watch_hang)
        return drained

    @precondition(lambda self: self.model.next_due(QUEUE) is not None)
    @rule(cancelled=st.booleans(), rescued=st.booleans())
    def worker_dies(self, cancelled: bool, rescued: bool) -> None:
        """A registered worker claims the next due job and dies (SIGKILL): the row
        stays running, held by a worker that no longer heartbeats. With
        `cancelled`, the application cancels the job at once (it is running:
        "cancelling"; the rescue must end it cancelled); with `rescued`, the
        rescue runs at once (else at a later `rescue` step)."""
        claimed = self._call(self._claim_and_die)
        assert self.dead
        expected = self.model.claim_and_die(list(self.dead)[-1], QUEUE)
        assert expected is not None
        assert claimed == expected.id, (
            f"the claim took {claimed}; the model (priority, then run_at) says {expected.id}")
        if cancelled:
            answer = self._call(self.queue.cancel, expected.id)
            assert answer == self.model.cancel(expected.id) == "cancelling", answer
        if rescued:
            self.rescue()

    async def _claim_and_die(self) -> UUID | None:
        identity = await self._doomed_worker()
        plain = PlainJobStore(self.env.db, self.config, QUEUE, lambda: identity)
        jobs = await plain.claim(1)
        if jobs:
            self.frozen.append((jobs[0], identity))
        return jobs[0].id if jobs else None

    def _thawable(self) -> list[int]:
        """The frozen claims no longer current: their job was handed on."""
        return [i for i, (claim, holder) in enumerate(self.frozen)
                if not (self.model.jobs[claim.id].state == RUNNING
                        and self.model.jobs[claim.id].holder == holder)]

    @precondition(lambda self: self.model.next_due(QUEUE) is not None)
    @rule()
    def frozen_worker_resumes_after_a_retry(self) -> None:
        """
        The scenario of issue #45, in one step: a worker claims the next due job
        and freezes; the job is cancelled and the rescue ends it; an operator
        retries it (attempts from 0); another worker claims the next due job
        (this one again, when it is due first: attempt 1 again) and dies. The
        frozen worker resumes: its stale claim writes nothing.
        """
        self.worker_dies(cancelled=True, rescued=True)
        claim, holder = self.frozen[-1]
        if self._retry_dead(claim.id):
            self.worker_dies(cancelled=False, rescued=False)
        self.frozen.remove((claim, holder))
        wrote = self._call(self._stale_writes, claim, holder)
        assert wrote == [], f"the stale claim of {claim.id} wrote: {wrote}"

    @precondition(lambda self: bool(self._thawable()))
    @rule(data=st.data())
    def frozen_worker_resumes(self, data: st.DataObject) -> None:
        """
        A worker of `worker_dies` was frozen (SIGSTOP), not dead, and resumes
        once its claim was handed on: rescued, perhaps retried by an operator
        and claimed again, of the same attempt (issue #45). Every write of its
        stale claim (its fence's reset, the finish of a run that returned, a
        crash's retry, an end, a give-back) must change nothing.
        """
        i = data.draw(st.sampled_from(self._thawable()), label="frozen claim")
        claim, holder = self.frozen.pop(i)
        wrote = self._call(self._stale_writes, claim, holder)
        assert wrote == [], f"the stale claim of {claim.id} wrote: {wrote}"

    async def _stale_writes(self, claim: ClaimedJob, holder: UUID) -> list[str]:
        store = PlainJobStore(self.env.db, self.config, QUEUE, lambda: holder)
        wrote = []
        if await store.reset(claim):
            wrote.append("reset")
        statuses, _ = await store.finish_many_and_claim([(claim, None, JobResult("1"))], 0)
        if statuses.get(claim.id) is not None:
            wrote.append("finish")
        if await store.retry(claim, 0.0, "stale") is not None:
            wrote.append("retry")
        if await store.end(claim, DISCARDED, "stale") is not None:
            wrote.append("end")
        if await store.unclaim([claim]):
            wrote.append("give-back")
        return wrote

    async def _doomed_worker(self) -> UUID:
        """A registered worker that will die: its id (claims may name it)."""
        store = PgJobStore(self.env.db, self.config, runnable_kinds=frozenset(),
                           known_kinds=frozenset())
        identity = WorkerIdentity(id=uuid.uuid4(), host="plain-machine", pid=0,
                                  kinds=(MachineTask.kind,))
        await store.register_worker(identity)
        self.dead[identity.id] = store
        return identity.id

    @precondition(lambda self: self.model.next_due(QUEUE) is not None)
    @rule(rescued=st.booleans())
    def cancel_races_a_claim(self, rescued: bool) -> None:
        """
        The race of issue #20: a registered worker's claim takes the next due
        job, and the application cancels that job while the claim still holds
        its row (the cancel waits for the claim's lock, seen in the server's
        pg_stat_activity); the claim commits, the worker dies. The cancel must
        answer on the claim's outcome, "cancelling", never "no such job"; the
        rescue ends the job cancelled.
        """
        job = self.model.next_due(QUEUE)
        assert job is not None
        claimed, answer = self._call(self._claim_while_cancelling, job.id)
        expected = self.model.claim_and_die(list(self.dead)[-1], QUEUE)
        assert expected is not None
        assert claimed == expected.id, (
            f"the claim took {claimed}; the model (priority, then run_at) says {expected.id}")
        wanted = self.model.cancel(expected.id)
        assert answer == wanted == "cancelling", (
            f"a cancel that waited for the claim said {answer!r}, the model {wanted!r}")
        if rescued:
            self.rescue()

    async def _claim_while_cancelling(self, job_id: UUID) -> tuple[UUID | None, Any]:
        worker = await self._doomed_worker()
        db = self.env.db
        answers: list[Any] = []

        async def cancel() -> None:
            answers.append(await self.queue.cancel(job_id))

        # The claim's transaction commits on leaving; the nursery then waits for
        # the cancel's answer.
        async with trio.open_nursery() as nursery, db.transaction() as tx:
            pid = await tx.fetchval("SELECT pg_backend_pid()")
            rows = await tx.fetch(Q.plain_claim, QUEUE, 1, uuid.uuid4(), worker,
                                  self.config.max_payload_bytes, [], [])
            nursery.start_soon(cancel)
            # Until the cancel waits for the claim's lock (or answered: the
            # claim took another job, which the rule reports).
            while not answers and not await db.fetchval(BLOCKED_BY, pid):  # noqa: ASYNC110
                await trio.sleep(0.005)
        return (rows[0]["id"] if rows else None), answers[0]

    @precondition(lambda self: self.model.next_due(QUEUE) is not None)
    @rule(cancelled=st.booleans())
    def claim_ahead_and_give_back(self, cancelled: bool) -> None:
        """
        A look-ahead claim takes the next due job, and the job is given back
        unstarted (`plain_unclaim`: past its TTL, a stop, the fence); with
        `cancelled`, the application cancels it while it waits in the buffer
        ("cancelling"): the give-back must end it cancelled, never run.
        """
        claimed, answer = self._call(self._claim_and_give_back, cancelled)
        expected, wanted = self.model.claim_and_give_back(QUEUE, cancelled)
        assert claimed == expected.id, (
            f"the claim took {claimed}; the model (priority, then run_at) says {expected.id}")
        assert answer == wanted, f"the cancel said {answer!r}, the model {wanted!r}"

    async def _claim_and_give_back(self, cancelled: bool) -> tuple[UUID | None, Any]:
        plain = PlainJobStore(self.env.db, self.config, QUEUE, lambda: None)
        jobs = await plain.claim(1)
        if not jobs:
            return None, None
        answer = await self.queue.cancel(jobs[0].id) if cancelled else None
        given = await plain.unclaim(jobs)
        assert given == 1, f"the give-back took {given} row(s) back, not 1"
        return jobs[0].id, answer

    @precondition(lambda self: any(s == "alive" for s in self.model.workers.values()))
    @rule()
    def rescue(self) -> None:
        """The dead workers' leases run out; one round of the leader's rescue."""
        result = self._call(self._rescue)
        expected = self.model.rescue()
        got = (result.declared_dead, result.rescued, result.failed)
        assert got == expected, f"rescue did {got}; the model says {expected}"

    async def _rescue(self) -> Any:
        for worker, state in self.model.workers.items():
            if state == "alive":
                await self.env.db.execute(Q.testing_worker_expire, worker)
                await self.env.db.execute(AGE_PLAIN_CLAIMS, worker)
        return await self.rescuer.rescue()

    # -- rules: a long job among short ones (issue #25) ---------------------------------

    @precondition(lambda self: self.world.mixed.long is None)
    @rule(before=st.integers(1, 3), after=st.integers(1, 5))
    def long_job_among_short_ones(self, before: int, after: int) -> None:
        """
        One lane of one slot, the default look-ahead ("auto"): `before` short
        jobs, a long one, `after` short ones, in that order. The short runs give
        the lane its look-ahead, so it claims short jobs ahead of the long one;
        they must not wait out the long run: past the TTL they go back, and a
        second worker, idle, started once the long run began, runs them. The
        long run ends once every short job has run (at most `LONG_RUN`).

        Once per example (issue #24's budget): each run waits out the TTL on the
        wall clock, and drawn as often as the other rules it took 40% of the
        machine's time; a second run in one example meets nothing the first
        did not.
        """
        ids = self._call(self._long_among_short, before, after)
        for job_id in ids:
            self.model.enqueue(job_id, queue=MIXED_QUEUE, priority=0, max_attempts=3,
                               delay=0, plan=())
        ran = self.model.drain(MIXED_QUEUE, OnHang.CANCEL).runs
        assert sorted(ran) == sorted(ids), "every job of the rule ran once"

    async def _long_among_short(self, before: int, after: int) -> list[UUID]:
        now = datetime.now(UTC)
        first = len(self.model.jobs)
        batch = [Job(MachineTask(n=first + i), options=JobOptions(queue=MIXED_QUEUE),
                     run_at=now + timedelta(microseconds=i))  # claimed in this order
                 for i in range(before + 1 + after)]
        ids = await self.queue.enqueue_many(batch)
        mixed = self.world.mixed = MixedWorld(ids[before], before + after)
        a, b = self.make_worker(MIXED_CONFIG), self.make_worker(MIXED_CONFIG)
        async with trio.open_nursery() as nursery:
            await nursery.start(a.run)
            await mixed.long_started.wait()
            await nursery.start(b.run)
            await mixed.shorts_done.wait()
            a.stop()  # graceful: the long run, which sees the short ones done, completes
            b.stop()
        return list(ids)

    # -- invariants --------------------------------------------------------------------------

    @invariant()
    def database_equals_model(self) -> None:
        rows = self._call(self.env.db.fetch, SNAPSHOT)
        db = {r["id"]: (r["state"], r["attempt"], r["due"], r["cancel_requested"])
              for r in rows}
        expected = self.model.rows()
        assert db == expected, _diff(db, expected)
        # A crashed job waits out its backoff: run_at - attempted_at in the window.
        waits = {r["id"]: r["waits"] for r in rows}
        for job in self.model.in_states({AVAILABLE}):
            if job.backoff is not None:
                lo, hi = job.backoff, job.backoff + RETRY_SLACK
                wait = waits[job.id]
                assert wait is not None, f"job {job.id} crashed but was never claimed"
                assert lo <= wait <= hi, (
                    f"job {job.id} crashed on attempt {job.attempt}: its retry is "
                    f"{wait}s after its claim, the backoff window is [{lo}, {hi}]")

    @invariant()
    def claims_take_due_jobs_in_order(self) -> None:
        assert not self.world.bad_claims, self.world.bad_claims

    @invariant()
    def batches_leave_their_build_jobs_or_none(self) -> None:
        count = self._call(self.env.db.fetchval, "SELECT count(*) FROM build_jobs")
        assert count == self.build_jobs, (
            f"{count} build job(s) in the database; the batches that went in enqueued "
            f"{self.build_jobs} (a refused batch leaves none)")

    @invariant()
    def unique_keys_are_unique(self) -> None:
        duplicates = self._call(self.env.db.fetch, DUPLICATE_KEYS)
        assert not duplicates, [(r["unique_key"], r["n"]) for r in duplicates]

    @invariant()
    def cancelled_jobs_never_run_again(self) -> None:
        for job in self.model.in_states({CANCELLED}):
            runs = self.cancelled_runs.setdefault(job.id, self.world.runs[job.id])
            assert self.world.runs[job.id] == runs, f"cancelled job {job.id} ran again"

    @invariant()
    def short_jobs_never_wait_behind_a_long_one(self) -> None:
        late = [(job, round(waited, 3)) for job, waited in self.world.mixed.waits
                if waited > MIXED_TTL + WAIT_SLACK]
        assert not late, (
            f"short job(s) waited (seconds from claim to start) past the look-ahead's TTL "
            f"of {MIXED_TTL}s behind a long run: {late}")


def _cancelled_more(before: int, stats: WorkerStats) -> bool:
    return stats.cancelled > before


def _diff(actual: dict[Any, Any], expected: dict[Any, Any]) -> str:
    lines = ["plain jobs: database differs from the model (state, attempt, due, "
             "cancel_requested)"]
    for key in sorted(set(actual) | set(expected), key=str):
        if actual.get(key) != expected.get(key):
            lines.append(f"  {key}: database={actual.get(key)!r} model={expected.get(key)!r}")
    return "\n".join(lines)


#: The plain machine's budget, from the chosen profile's: fewer examples, each of
#: more steps (a crash on a last attempt takes an enqueue, a drain, time passing
#: and another drain; every step starts a worker, so the examples are fewer).
PLAIN_EXAMPLES = 0.6
PLAIN_STEPS = 5 / 3


def plain_profile() -> settings:
    """`machine.profile()` (``nasiko-ci``: 30 examples of up to 50 steps here)."""
    base = profile()
    return settings(base, max_examples=max(1, int(base.max_examples * PLAIN_EXAMPLES)),
                    stateful_step_count=int(base.stateful_step_count * PLAIN_STEPS))


async def run_plain_state_machine(
    db_or_dsn: Database | str,
    machine: type[PlainStateMachine] = PlainStateMachine,
    *,
    settings: settings | None = None,
    rule_timeout: float = 20.0,
) -> None:
    """Run `machine` against a migrated database of its own, from a trio test."""
    await run_machine(db_or_dsn, machine, settings=settings or plain_profile(),
                      rule_timeout=rule_timeout)
