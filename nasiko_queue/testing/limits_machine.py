"""
A Hypothesis state machine on limits across replicas (issue #23): the claim of a
limited queue, against a model that says exactly how many jobs each claim may
take, through every way a run ends.

The model holds the queue's limits (global concurrency, a rate per window, a
partition by key: round-robin or serial), the jobs and which run, the starts in
the current window, and which claim last served each key. A claim must take
exactly what the model admits: more is over-admission (a limit exceeded), fewer
is a leak (a slot or a start never given back: after a rescue of a dead
worker's jobs, a retry, a dead letter, a cancel, a give-back).

A partitioned claim must also take its jobs in turns, the rule of migration
0020: one job per key a round, the keys served longest ago (never: first) first
in each round, priority first within a key. So, for a key left with a job the
limits admitted: no other key took two more jobs than it (a backlog delays
another key by one round at most), and a key that took one more came before it
in turn (served longer ago, or as long ago and its last job's priority first).
Ties the model cannot see (due times, ids) are left open, nothing else.
Rate windows pass by ageing the starts ledger in SQL, never by waiting. Two
workers claim (one of them dies and is rescued), so the running count is the
fleet's, not a worker's.

Mutants it must find are planted by tests/test_limits_statemachine.py.

.. versionadded:: 0.3.0
"""

from __future__ import annotations

import json
import uuid
from collections import Counter
from functools import partial
from typing import ClassVar
from uuid import UUID

import attrs
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import invariant, precondition, rule

from ..builds.store import PgJobStore
from ..db.database import Database
from ..db.statements import Q
from ..engine.contracts import ClaimedJob, WorkerIdentity
from ..plain.args import JobArgs, JobOptions
from ..plain.limits import PartitionMode, Rate
from ..plain.store import PlainJobStore
from ..queue import Queue
from .runner import DatabaseMachine, profile, run_machine

QUEUE = "limited"
KEYS = ("a", "b", "c")


@attrs.frozen(kw_only=True)
class LimitedJob(JobArgs):
    kind: ClassVar[str] = "limits_machine_job"
    options: ClassVar[JobOptions] = JobOptions(queue=QUEUE, max_attempts=1000)
    key: str


@attrs.define
class _Job:
    key: str
    priority: int = 0
    state: str = "available"  # available | running | ended
    claimed: ClaimedJob | None = None
    worker: int | None = None
    #: The worker row that holds the run: none when claimed before workers registered
    #: (then no rescue frees it).
    holder: UUID | None = None


class LimitsStateMachine(DatabaseMachine):
    """The limited claim against `_Job`s and the model's limits (see the module)."""

    def __init__(self) -> None:
        super().__init__()
        self.queue = Queue(self.env.db)
        self.jobs: dict[UUID, _Job] = {}
        self.concurrency: int | None = None
        self.rate: int | None = None
        self.mode = PartitionMode.NONE
        self.window_starts = 0
        #: The claim that last took a job of each key (the turns table), by number.
        self.served: dict[str, int] = {}
        self.claims = 0
        self.key_starts: Counter[str] = Counter()
        self.workers: list[UUID] = []
        self.dead: set[int] = set()
        self.started = False

    # -- set-up ----------------------------------------------------------------------

    @rule(concurrency=st.one_of(st.none(), st.integers(1, 3)),
          rate=st.one_of(st.none(), st.integers(1, 4)), mode=st.sampled_from(PartitionMode))
    def set_limits(self, concurrency: int | None, rate: int | None,
                   mode: PartitionMode) -> None:
        if concurrency is None and rate is None and mode is PartitionMode.NONE:
            concurrency = 2
        partitioned = mode is not PartitionMode.NONE
        self._call(partial(self.queue.set_limit, QUEUE, concurrency=concurrency,
                           rate=None if rate is None else Rate(rate, per=60.0),
                           partition_by="key" if partitioned else None, partition_mode=mode))
        was_partitioned = self.mode is not PartitionMode.NONE
        if ((self.started and partitioned != was_partitioned)
                or (self.rate is None and rate is not None)):
            # The rate's keys changed meaning, or starts were not counted while no
            # rate was set: a fresh window (the ledger and the model both).
            self._call(self.env.db.execute, "DELETE FROM nasiko_queue_limit_starts")
            self.window_starts = 0
            self.key_starts.clear()
        self.concurrency, self.rate, self.mode = concurrency, rate, mode
        self.started = True

    @precondition(lambda self: not self.workers)
    @rule()
    def register_workers(self) -> None:
        store = PgJobStore(self.env.db, self.queue.config, runnable_kinds=frozenset(),
                           known_kinds=frozenset())
        for _ in range(2):
            worker = uuid.uuid4()
            self._call(store.register_worker,
                       WorkerIdentity(id=worker, host="limits-machine", pid=0, kinds=()))
            self.workers.append(worker)

    @rule(keys=st.lists(st.sampled_from(KEYS), min_size=1, max_size=4),
          priority=st.integers(0, 2))
    def enqueue(self, keys: list[str], priority: int) -> None:
        options = attrs.evolve(LimitedJob.options, priority=priority)
        for key in keys:
            job_id = self._call(partial(self.queue.enqueue, LimitedJob(key=key),
                                        options=options))
            self.jobs[job_id] = _Job(key=key, priority=priority)

    # -- the model's admission ---------------------------------------------------------

    def _running(self) -> list[_Job]:
        return [j for j in self.jobs.values() if j.state == "running"]

    def admits(self, asked: int, freed: tuple[UUID, ...] = ()) -> int:
        """How many jobs a claim of `asked` takes, the runs of `freed` ended first."""
        if not self.started:
            return min(asked, sum(j.state == "available" for j in self.jobs.values()))
        running = [j for i, j in self.jobs.items() if j.state == "running" and i not in freed]
        room = asked
        if self.concurrency is not None:
            room = min(room, self.concurrency - len(running))
        waiting = [j for j in self.jobs.values() if j.state == "available"]
        if self.mode is not PartitionMode.NONE:
            return max(0, min(room, sum(self._caps(freed).values())))
        if self.rate is not None:
            room = min(room, self.rate - self.window_starts)
        return max(0, min(room, len(waiting)))

    def _live_runs(self) -> list[UUID]:
        """Running jobs of live workers, in the model's order (not by random id: a
        falsifying example replays the same choices)."""
        return [i for i, j in self.jobs.items()
                if j.state == "running" and j.worker not in self.dead]

    def _caps(self, freed: tuple[UUID, ...] = ()) -> Counter[str]:
        """A partitioned claim's most jobs of each key: its due jobs, its rate budget
        left, and in serial mode one unless a job of the key runs."""
        caps = Counter(j.key for j in self.jobs.values() if j.state == "available")
        busy = {j.key for i, j in self.jobs.items() if j.state == "running" and i not in freed}
        for key in caps:
            if self.rate is not None:
                caps[key] = min(caps[key], max(0, self.rate - self.key_starts[key]))
            if self.mode is PartitionMode.SERIAL:
                caps[key] = min(caps[key], 0 if key in busy else 1)
        return caps

    def _in_turn(self, claimed: list[ClaimedJob], freed: tuple[UUID, ...]) -> None:
        """The claim took its jobs in the order the limits say (see the module)."""
        taken = [self.jobs[c.id] for c in claimed]
        left = [j for i, j in self.jobs.items()
                if j.state == "available" and i not in {c.id for c in claimed}]
        partitioned = self.started and self.mode is not PartitionMode.NONE
        part = (lambda j: j.key) if partitioned else (lambda j: "")
        for key in {part(j) for j in taken}:
            last = max(j.priority for j in taken if part(j) == key)
            rest = [j.priority for j in left if part(j) == key]
            assert not rest or last <= min(rest), (
                f"key {key!r}: a job of priority {last} was taken before one of {min(rest)}")
        if not partitioned:
            return
        caps = self._caps(freed)
        count = Counter(j.key for j in taken)
        for key, cap in caps.items():
            assert count[key] <= cap, f"key {key!r} took {count[key]} jobs, admitted {cap}"
            if count[key] == cap:
                continue
            # `key` had a job the limits admitted and did not get it: every key
            # served in that round came before it in turn.
            first = min(j.priority for j in left if j.key == key)
            for other in caps:
                if other == key or not count[other]:
                    continue
                assert count[other] <= count[key] + 1, (
                    f"key {other!r} took {count[other]} jobs while {key!r}, with jobs "
                    f"admitted, took {count[key]}: more than one round ahead")
                if count[other] == count[key] + 1:
                    last = max(j.priority for j in taken if j.key == other)
                    assert ((self.served.get(other, -1), last)
                            <= (self.served.get(key, -1), first)), (
                        f"key {other!r} (last served in claim {self.served.get(other)}) "
                        f"was served before key {key!r} (claim {self.served.get(key)}) "
                        f"in round {count[other]}: not in turn")
        if claimed:
            self.claims += 1
            self.served.update(dict.fromkeys(count, self.claims))

    def _store(self, worker: int) -> PlainJobStore:
        holder = self.workers[worker] if self.workers else None
        return PlainJobStore(self.env.db, self.queue.config, QUEUE, lambda: holder)

    def _took(self, claimed: list[ClaimedJob], worker: int, expected: int,
              freed: tuple[UUID, ...] = ()) -> None:
        assert len(claimed) == expected, (
            f"the claim took {len(claimed)} job(s); the limits admit {expected} "
            f"(concurrency {self.concurrency}, rate {self.rate} with "
            f"{self.window_starts} started, {self.mode}, "
            f"{len(self._running())} running)")
        keys = [json.loads(c.payload or "{}").get("key") for c in claimed]
        for job in claimed:
            assert self.jobs[job.id].state == "available", "claimed a job not available"
        self._in_turn(claimed, freed)
        if self.started and self.mode is PartitionMode.SERIAL:
            busy = {j.key for j in self._running()}
            assert len(set(keys)) == len(keys), f"two jobs of one key at once: {keys}"
            assert not busy & set(keys), f"a key already running was claimed: {keys}"
        for job in claimed:
            model = self.jobs[job.id]
            assert model.state == "available", f"claimed a job that was {model.state}"
            model.state, model.claimed, model.worker = "running", job, worker
            model.holder = self.workers[worker] if self.workers else None
        if self.started and self.rate is not None:
            self.window_starts += len(claimed)
            self.key_starts.update(keys)

    # -- claims ------------------------------------------------------------------------

    @rule(worker=st.integers(0, 1), asked=st.integers(1, 2))
    def claim(self, worker: int, asked: int) -> None:
        if worker in self.dead:
            worker = 1 - worker  # the live one claims: no step spent on nothing
        expected = self.admits(asked)
        self._took(self._call(self._store(worker).claim, asked), worker, expected)

    @precondition(lambda self: any(j.state == "running" and j.worker not in self.dead
                                   for j in self.jobs.values()))
    @rule(data=st.data(), asked=st.integers(0, 3))
    def finish_and_claim(self, data: st.DataObject, asked: int) -> None:
        job_id = data.draw(st.sampled_from(self._live_runs()))
        model = self.jobs[job_id]
        assert model.claimed is not None
        assert model.worker is not None
        expected = self.admits(asked, freed=(job_id,))
        done, claimed = self._call(self._store(model.worker).finish_many_and_claim,
                                   [(model.claimed, None, None)], asked)
        assert done[job_id] is not None
        model.state = "ended"
        self._took(claimed, model.worker, expected, freed=(job_id,))

    # -- other ends of a run -----------------------------------------------------------

    def _pick_running(self, data: st.DataObject) -> _Job:
        job_id = data.draw(st.sampled_from(self._live_runs()))
        return self.jobs[job_id]

    @precondition(lambda self: any(j.state == "running" and j.worker not in self.dead
                                   for j in self.jobs.values()))
    @rule(data=st.data(), how=st.sampled_from(("retry", "dead letter", "cancel", "give back")))
    def end_run(self, data: st.DataObject, how: str) -> None:
        model = self._pick_running(data)
        assert model.claimed is not None
        assert model.worker is not None
        store = self._store(model.worker)
        if how == "retry":
            assert self._call(store.retry, model.claimed, 0.0, "boom") == "available"
            model.state = "available"
        elif how == "dead letter":
            assert self._call(store.end, model.claimed, "discarded", "poison")
            model.state = "ended"
        elif how == "cancel":
            assert self._call(self.queue.cancel, model.claimed.id) == "cancelling"
            assert self._call(store.end, model.claimed, "cancelled", None)
            model.state = "ended"
        else:
            assert self._call(store.unclaim, [model.claimed]) == 1
            model.state = "available"
        model.claimed = model.worker = None

    @precondition(lambda self: len(self.workers) == 2 and not self.dead)
    @rule(worker=st.integers(0, 1))
    def worker_dies_and_is_rescued(self, worker: int) -> None:
        db: Database = self.env.db
        self._call(db.execute, "UPDATE nasiko_queue_workers SET dead_at = now(), "
                               "heartbeat_at = now() WHERE id = $1", self.workers[worker])
        self._call(db.fetchrow, Q.plain_rescue, None)
        self.dead.add(worker)
        for job in self.jobs.values():
            if job.state == "running" and job.worker == worker and job.holder is not None:
                job.state, job.claimed, job.worker = "available", None, None

    @rule()
    def the_window_passes(self) -> None:
        self._call(self.env.db.execute, "UPDATE nasiko_queue_limit_starts "
                                        "SET started_at = started_at - interval '61 seconds'")
        self.window_starts = 0
        self.key_starts.clear()

    @invariant()
    def running_matches(self) -> None:
        if not self.workers and not self.jobs:
            return
        running = self._call(self.env.db.fetchval,
                             "SELECT count(*) FROM nasiko_queue_jobs WHERE state = 'running'")
        assert running == len(self._running()), (running, len(self._running()))


#: Share of the profile's examples and steps.
LIMITS_EXAMPLES = 0.4


def limits_profile() -> settings:
    """`runner.profile()` (``nasiko-ci``: 20 examples of up to 30 steps here)."""
    base = profile()
    return settings(base, max_examples=max(1, int(base.max_examples * LIMITS_EXAMPLES)))


async def run_limits_state_machine(db_or_dsn: Database | str, *,
                                   chosen: settings | None = None) -> None:
    """Run the machine against a migrated database of its own, from a trio test."""
    await run_machine(db_or_dsn, LimitsStateMachine, settings=chosen or limits_profile())
