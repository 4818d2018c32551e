"""
The rules of plain jobs (`nasiko_queue_jobs`) as code: what every row must be.

`PlainModel` has no I/O. Given the same events as the real engine (enqueue,
time passing, a worker's drain in which each run does what its plan says, a
cancel, a worker that dies holding a job, the leader's rescue) it says what
every plain job's state and attempt must be, which job a claim must take, and
what `Queue.cancel` and a unique enqueue must answer. `plain_machine.py`
drives the real engine and this model side by side. Keep it plain: it is the
documentation of migrations/0010_plain_jobs.sql and `plain/executor.py`.

Time is the model's own clock (`now`, seconds); the machine moves the rows'
`run_at` back in SQL by the same amounts, so a job is due in the database
exactly when it is due here. All delays are multiples of `TICK` seconds, so
the few seconds an example really takes never change which jobs are due.

.. versionadded:: 0.2.0
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Iterable
from uuid import UUID

import attrs

#: Every delay, backoff and advance of the clock is a multiple of this (seconds).
TICK = 60

AVAILABLE = "available"
RUNNING = "running"
COMPLETED = "completed"
DISCARDED = "discarded"
CANCELLED = "cancelled"
#: The states a job never leaves (except by a retry from the dead-letter queue).
ENDED = frozenset({COMPLETED, DISCARDED, CANCELLED})
#: The default states a unique key is unique within (`Unique`).
WAITING_OR_RUNNING = frozenset({AVAILABLE, RUNNING})


class Run(enum.Enum):
    """What one run of a plain job's executor does."""

    #: It returns: the job is completed.
    RETURN = "return"
    #: It raises: available again after its backoff, discarded on its last attempt.
    RAISE = "raise"
    #: It never returns by itself: stopped by a cancel, or by a hard stop.
    HANG = "hang"
    #: Its job is cancelled while it runs, and it raises before the worker's
    #: heartbeat delivers the cancel (or is stopped by it): cancelled either way.
    CANCEL_THEN_RAISE = "cancel_then_raise"


class OnHang(enum.Enum):
    """What the machine does about a run that hangs."""

    #: `Queue.cancel(job)`, delivered by the worker's next heartbeat: cancelled.
    CANCEL = "cancel"
    #: The worker is stopped hard: the job is available again at once, attempt counted.
    HARD_STOP = "hard_stop"
    #: The worker is cut off (declared dead; it learns so at its next heartbeat):
    #: the fence stops the run and puts the job back, available at once with the
    #: attempt counted; the worker registers anew and drains on.
    FENCE = "fence"


def backoff(attempt: int) -> float:
    """The machine's backoff: deterministic, so that windows are exact (no jitter)."""
    return float(TICK * attempt)


@attrs.define
class PlainJob:
    id: UUID
    queue: str
    priority: int
    max_attempts: int
    #: When it is due, on the model's clock; and the order of the event that set it
    #: (ties on run_at are decided by which was written first, as in the database).
    run_at: int
    seq: int
    unique_key: str | None = None
    unique_states: frozenset[str] = WAITING_OR_RUNNING
    #: What each run does, by attempt (1-based); past the end: RETURN.
    plan: tuple[Run, ...] = ()
    state: str = AVAILABLE
    attempt: int = 0
    cancel_requested: bool = False
    #: The dead worker that holds it (None: not held, or held by a live drain).
    holder: UUID | None = None
    #: Set by a crash's retry: the backoff it waits (the window is [it, it + slack]).
    backoff: float | None = None

    def run_of(self, attempt: int) -> Run:
        return self.plan[attempt - 1] if attempt <= len(self.plan) else Run.RETURN

    def holds_key(self) -> bool:
        """Its key is taken by it: it is in one of the states it is unique within."""
        return self.unique_key is not None and self.state in self.unique_states


@attrs.define
class DrainResult:
    """What a drain ran, in order (job ids, one per executor call)."""

    runs: list[UUID] = attrs.Factory(list)
    #: The job whose hang ended the drain with a hard stop (if one did).
    hard_stopped: UUID | None = None


@attrs.define
class PlainModel:
    """Plain jobs: states, attempts, order, schedules, backoff, unique keys, cancel."""

    jobs: dict[UUID, PlainJob] = attrs.Factory(dict)
    now: int = 0
    #: Workers registered by the machine that died holding jobs: "alive" until
    #: their lease runs out, then "dead" once a rescue declared them.
    workers: dict[UUID, str] = attrs.Factory(dict)
    #: The latest tick of the machine's schedule recorded in the database (None:
    #: no scheduler has seen it yet).
    schedule_tick: int | None = None
    _seq: itertools.count[int] = attrs.field(factory=itertools.count)

    # -- the application ----------------------------------------------------------

    def holder_of(self, key: str) -> PlainJob | None:
        return next((j for j in self.jobs.values() if j.unique_key == key and j.holds_key()),
                    None)

    def enqueue(self, job_id: UUID, *, queue: str, priority: int, max_attempts: int,
                delay: int, plan: tuple[Run, ...], unique_key: str | None = None,
                unique_states: frozenset[str] = WAITING_OR_RUNNING,
                run_at: int | None = None) -> UUID:
        """A new job, due `delay` seconds from now, or at `run_at` on the model's
        clock when given (an explicit run_at: in the past, now or later); a
        unique one whose key is held inserts nothing and answers the holder's id."""
        if unique_key is not None:
            holder = self.holder_of(unique_key)
            if holder is not None:
                return holder.id
        due_at = self.now + delay if run_at is None else run_at
        self.jobs[job_id] = PlainJob(id=job_id, queue=queue, priority=priority,
                                     max_attempts=max_attempts, run_at=due_at,
                                     seq=next(self._seq), unique_key=unique_key,
                                     unique_states=unique_states, plan=plan)
        return job_id

    def cancel(self, job_id: UUID) -> str | None:
        """A waiting job ends cancelled; a running one is asked to stop; an ended
        one is left as it is (its state is the answer)."""
        job = self.jobs.get(job_id)
        if job is None:
            return None
        if job.state == AVAILABLE:
            job.state = CANCELLED
            return CANCELLED
        if job.state == RUNNING:
            job.cancel_requested = True
            return "cancelling"
        return job.state

    def advance(self, seconds: int) -> None:
        self.now += seconds

    def retry_dead(self, job_id: UUID) -> None:
        """The dead-letter queue's retry (`admin.jobs.retry`): a discarded or
        cancelled job is available again now, its attempts forgotten, and with
        them a cancel asked of the run that ended it (the retried job runs anew:
        an old request must not cancel it)."""
        job = self.jobs[job_id]
        assert job.state in (DISCARDED, CANCELLED)
        job.state, job.attempt, job.backoff = AVAILABLE, 0, None
        job.run_at, job.seq = self.now, next(self._seq)
        job.cancel_requested = False

    # -- schedules ------------------------------------------------------------------

    def schedule_round(self) -> tuple[int, int]:
        """
        Schedulers (any number, racing or one after another) run a round over
        the machine's one schedule, a tick every `TICK` seconds, at the model's
        clock: the first round records the current tick and enqueues nothing;
        each later round whose tick is newer than the one recorded enqueues it
        exactly once (the latest tick only, however many were missed); a round
        at a tick already recorded enqueues nothing. Returns (recorded,
        enqueued) over all the schedulers of the round.
        """
        tick = self.now - self.now % TICK
        if self.schedule_tick is None:
            self.schedule_tick = tick
            return 1, 0
        if tick > self.schedule_tick:
            self.schedule_tick = tick
            return 0, 1
        return 0, 0

    # -- claims ---------------------------------------------------------------------

    def due(self, job: PlainJob) -> bool:
        return job.state == AVAILABLE and job.run_at <= self.now

    def next_due(self, queue: str) -> PlainJob | None:
        """What a claim takes: the due job of the queue with the lowest priority
        number, then the earliest run_at (then the one written first)."""
        due = [j for j in self.jobs.values() if j.queue == queue and self.due(j)]
        return min(due, key=lambda j: (j.priority, j.run_at, j.seq), default=None)

    def _claim(self, queue: str, holder: UUID | None) -> PlainJob | None:
        job = self.next_due(queue)
        if job is not None:
            job.state, job.holder, job.backoff = RUNNING, holder, None
            job.attempt += 1  # counted at claim time
        return job

    def _crash(self, job: PlainJob) -> None:
        """A run raised: discarded on its last attempt, else available after its backoff."""
        if job.attempt >= job.max_attempts:
            job.state = DISCARDED
        else:
            job.state = AVAILABLE
            job.backoff = backoff(job.attempt)
            job.run_at, job.seq = self.now + int(job.backoff), next(self._seq)

    def drain(self, queue: str, on_hang: OnHang) -> DrainResult:
        """
        One worker (one slot) runs the queue until nothing is due: each claim
        takes `next_due`; a claim past the job's attempts discards it unrun; a
        run returns (completed), raises (`_crash`) or hangs. A hang is cancelled
        (the job ends cancelled, the drain goes on), fenced (available again at
        once, its attempt counted, run_at unchanged; the drain goes on) or ends
        the drain with a hard stop (available again, as for the fence).
        """
        result = DrainResult()
        while (job := self._claim(queue, None)) is not None:
            if job.attempt > job.max_attempts:
                job.state = DISCARDED  # "max attempts exceeded", never run
                continue
            result.runs.append(job.id)
            run = job.run_of(job.attempt)
            if run is Run.RETURN:
                job.state = COMPLETED
            elif run is Run.RAISE:
                self._crash(job)
            elif run is Run.CANCEL_THEN_RAISE or on_hang is OnHang.CANCEL:
                job.state, job.cancel_requested = CANCELLED, True
            elif on_hang is OnHang.FENCE:
                job.state = AVAILABLE
            else:
                job.state = AVAILABLE
                result.hard_stopped = job.id
                break
        return result

    # -- dead workers and the rescue ------------------------------------------------

    def claim_and_die(self, worker: UUID, queue: str) -> PlainJob | None:
        """A registered worker claims the next job and dies (no heartbeat, no run)."""
        self.workers[worker] = "alive"
        return self._claim(queue, worker)

    def claim_and_give_back(self, queue: str, cancelled: bool) -> tuple[PlainJob, str | None]:
        """
        A claim takes the next due job into a look-ahead buffer, where it may be
        cancelled ("cancelling": it is running); then it is given back unstarted
        (past the buffer's TTL, at a stop, at the fence): its attempt restored,
        its run_at as it was, available again; or, asked to stop meanwhile,
        cancelled, never run. Returns the job and the cancel's answer.
        """
        job = self._claim(queue, None)
        assert job is not None
        answer = self.cancel(job.id) if cancelled else None
        job.attempt -= 1
        job.state = CANCELLED if job.cancel_requested else AVAILABLE
        return job, answer

    def rescue(self) -> tuple[int, int, int]:
        """
        Every worker that died has missed its lease: the rescue declares each
        dead and ends its jobs' runs. A job asked to stop is cancelled; one on
        its last attempt is discarded; any other is available again, its
        attempt counted and its run_at as it was (so due at once).
        Returns (declared dead, available again, ended).
        """
        declared = sum(1 for s in self.workers.values() if s == "alive")
        rescued = ended = 0
        for job in self.jobs.values():
            if job.state != RUNNING or job.holder is None:
                continue
            if job.cancel_requested:
                job.state = CANCELLED
            elif job.attempt >= job.max_attempts:
                job.state = DISCARDED
            else:
                job.state = AVAILABLE
            job.holder = None
            if job.state == AVAILABLE:
                rescued += 1
            else:
                ended += 1
        for worker in self.workers:
            self.workers[worker] = "dead"
        return declared, rescued, ended

    # -- what the database must hold ---------------------------------------------------

    def rows(self) -> dict[UUID, tuple[str, int, bool | None, bool]]:
        """Each job: (state, attempt, whether it is due — for available jobs only,
        whether a cancel was asked of its run)."""
        return {j.id: (j.state, j.attempt, self.due(j) if j.state == AVAILABLE else None,
                       j.cancel_requested)
                for j in self.jobs.values()}

    def in_states(self, states: Iterable[str]) -> list[PlainJob]:
        wanted = frozenset(states)
        return [j for j in self.jobs.values() if j.state in wanted]
