"""
What the parts of a worker share: its counters, the worker's state and each lane's.

A worker is a handful of small objects (each lane's `producer.Producer`,
`completer.Completer` and slots, the heartbeat, the maintenance services, the
listener) that run as tasks of one nursery and hand work to each other through
two kinds of state: `WorkerState`, what the whole worker shares (counters, the
stop, the fence, the running executors' scopes), and one `LaneState` per lane
(the local buffer of claimed jobs, the finishes waiting to be recorded, the
statements in flight, the drain under way). Keeping them in objects, not in flags
spread across the parts, is what lets each part be read on its own: every field
says who sets it and who waits on it; and keeping each lane's apart is what
keeps a busy lane from holding up another.
"""

from __future__ import annotations

import bisect
import collections
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from uuid import UUID

import attrs
import trio

from ..config import QueueConfig
from .contracts import BuildReport, ClaimedJob, ClaimKey, JobResult, LostClaim, Starting
from .lookahead import LookAhead
from .retry import Budget

#: Statements the producer keeps in flight at once with several slots.
STATEMENTS_IN_FLIGHT = 2

#: Seconds a start write (`JobContext.mark_building`) waits before it is sent:
#: a run that reports sooner supersedes it (its build row goes from 'queued' to
#: its outcome in one write, as a reader polling it would most likely have seen
#: anyway), and one that runs longer has it sent with the next statement. So
#: short runs pay for no write nobody would see, and their start and report
#: seldom meet in two statements in flight (one waiting for the other's row
#: lock). Against builds of minutes, invisible.
START_WRITE_DELAY = 0.005


def _stats_changed(stats: WorkerStats, attribute: attrs.Attribute[int], value: int) -> int:
    """attrs `on_setattr` hook: every change of a counter wakes `Worker.wait_for`."""
    lot = stats._changed_lot
    # `if lot`: nobody waiting is the usual case, and a ParkingLot's len is cheap
    # beside unpark_all (about 0.5 µs per counter change, several per job).
    if lot and attribute.name != "_changed_lot":
        lot.unpark_all()
    return value


@attrs.define(on_setattr=_stats_changed)
class WorkerStats:
    """
    Counters since the worker started; for tests, `status` and benchmarks.

    Every assignment wakes whoever waits in `Worker.wait_for`, whichever counter
    it is (`running` and `buffered` change without any other signal). They are the
    worker's test signals: wait on what it did (``lambda s: s.done >= 3``),
    never sleep and hope.
    """

    drains_started: int = 0
    drains_completed: int = 0
    claimed: int = 0
    done: int = 0
    failed: int = 0
    panicked: int = 0
    #: Jobs cancelled by a hard stop and put back (their attempt stays counted).
    released: int = 0
    #: Claimed jobs given back without having started (prefetched, at a stop or
    #: past `prefetch_ttl`): their attempts restored.
    returned: int = 0
    recoveries: int = 0
    claim_errors: int = 0
    #: Statements the producer sent (claims, and finish batches with their claim):
    #: divided by `done + failed`, the round trips per job.
    statements: int = 0
    #: Jobs in a slot now (executor running, or the job being checked or failed).
    running: int = 0
    #: Claimed jobs waiting in the local buffer for a slot.
    buffered: int = 0
    #: Finished jobs whose outcome the completer has yet to record.
    finishing: int = 0
    #: LISTEN connections established (1 after start; each reconnect adds one).
    listen_connects: int = 0
    #: Notifications received on the LISTEN connection.
    notifications: int = 0
    #: LISTEN connections replaced because they stopped answering the check.
    listen_hangs: int = 0
    #: Finished jobs deleted by the retention prune of the recovery tick.
    pruned: int = 0
    #: Claims whose answer was lost (no answer in time, or the connection broke):
    #: the jobs they took were found by the claim's token and given back.
    lost_claims: int = 0
    #: Heartbeats that landed, and that failed (an outage, a late answer).
    heartbeats: int = 0
    heartbeat_failures: int = 0
    #: Times this worker registered a row (1, plus one per new identity after
    #: it was cut off or declared dead).
    registrations: int = 0
    #: Times it took the maintenance leadership.
    elected: int = 0
    #: Times it stopped its own jobs: cut off from the database for longer than
    #: `lease - heartbeat_interval`, or told by a heartbeat it was declared dead.
    fenced: int = 0
    #: Rescue rounds it ran as leader, and the dead workers' jobs it gave back or
    #: failed.
    rescues: int = 0
    rescued: int = 0
    #: Runs cancelled at their run-time limit (each counts as a crash).
    timed_out: int = 0
    #: Plain jobs whose run crashed and that wait for their backoff to run again.
    retried: int = 0
    #: Plain jobs stopped while running at a cancel's request.
    cancelled: int = 0
    #: Start writes (`JobContext.mark_building`) whose statement committed: each
    #: build row then says 'building', unless it had already moved past 'queued'.
    marked_building: int = 0
    _changed_lot: trio.lowlevel.ParkingLot | None = attrs.field(
        default=None, repr=False, eq=False, alias="_changed_lot")


#: Upper bounds (seconds) of the buckets of `Timings`: from a few milliseconds
#: (a claim right after its enqueue) to an hour (a long build).
TIMING_BUCKETS: tuple[float, ...] = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                                     5.0, 10.0, 30.0, 60.0, 300.0, 900.0, 3600.0)


@attrs.define(eq=False)
class Timings:
    """
    A fixed-bucket histogram kept in memory (a bisect and two additions per
    observation), read by the metrics endpoint (`nasiko_queue.web`) when there is
    one: the worker records it either way, and imports nothing for it.
    """

    buckets: tuple[float, ...] = TIMING_BUCKETS
    #: Observations per bucket (not cumulative); the last one is above every bound.
    counts: list[int] = attrs.field(init=False)
    count: int = 0
    total: float = 0.0

    def __attrs_post_init__(self) -> None:
        self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, seconds)] += 1
        self.count += 1
        self.total += seconds


@attrs.frozen
class Finish:
    """A slot's executor returned: the completer records the outcome from the build row."""

    job: ClaimedJob
    #: The build row that decides a build job's outcome; None for a plain job.
    build_id: UUID | None
    #: "<kind> <label>", computed by the slot: the completer runs no code of the
    #: payload type's, so a bug there cannot take it down.
    label: str
    #: What the executor reported: a build job's report through its context, for
    #: the completer's statement to write to the build row (None: the build row
    #: decides as it is); a plain job's returned value (None: it returned None).
    report: BuildReport | JobResult | None = None


@attrs.define(eq=False)
class WorkerState:
    """
    What every lane of a worker shares: its counters, its signals, its lease.

    Who touches what:

    * `stop()` sets `stopping`; the heartbeat sets `fenced` and `leader_until`,
      and the worker's fence bumps `fence_epoch`;
    * the slots of every lane register each running executor's cancel scope in
      `job_scopes` (so that the fence and a cancel request reach them, whatever
      their lane) and record `run_seconds`; the producers `claim_latency`.

    Each lane's own work (its buffer, statements, drains) is in its `LaneState`,
    so that nothing one lane waits for can hold up another. `notify()` wakes
    `drain_once` and `wait_for` (counters do so by themselves).
    """

    config: QueueConfig
    stats: WorkerStats = attrs.field(init=False)
    changed: trio.lowlevel.ParkingLot = attrs.Factory(trio.lowlevel.ParkingLot)
    #: `stop()` was called: claim nothing more.
    stopping: trio.Event = attrs.Factory(trio.Event)
    #: Until when (trio time) this worker surely holds the maintenance
    #: leadership: the last renewal's send time plus the lease, less one
    #: heartbeat interval of margin. Maintenance runs only before it.
    leader_until: float = float("-inf")
    #: Cut off (or declared dead): claim nothing, start nothing, until registered
    #: anew.
    fenced: bool = False
    #: Bumped by every fence: a statement sent under an earlier epoch whose claim
    #: is answered after the fence gives its jobs back instead of running them.
    fence_epoch: int = 0
    #: The cancel scope of each running job's executor (its slot's, while the
    #: job runs), every lane's, by claim (`ClaimedJob.claim`: job id, attempt,
    #: token): two runs of one job may overlap in one worker for a moment (a
    #: crashed run's reset commits, another slot claims it), of the same attempt
    #: even (a fenced run unwinding, and a claim after an operator's retry).
    job_scopes: dict[ClaimKey, trio.CancelScope] = attrs.Factory(dict)
    #: Claims whose run was asked to stop (a cancel of a plain job): their scope
    #: in `job_scopes` is cancelled (or, for a job still buffered, it never
    #: starts), and the run ends `cancelled`.
    cancels: set[ClaimKey] = attrs.Factory(set)
    #: Seconds each executor ran (every lane's), and from each job's becoming
    #: claimable (a build job's `created_at`, a plain job's `run_at`) to its claim.
    run_seconds: Timings = attrs.Factory(Timings)
    claim_latency: Timings = attrs.Factory(Timings)
    #: The LISTEN connection is established now (set by the `Listener`).
    listening: bool = False

    def __attrs_post_init__(self) -> None:
        self.stats = WorkerStats(_changed_lot=self.changed)

    def notify(self) -> None:
        """Wake `drain_once` and `wait_for`."""
        self.changed.unpark_all()

    def is_leader(self) -> bool:
        return trio.current_time() < self.leader_until


@attrs.define(eq=False)
class LaneState:
    """
    The mutable state of one lane (the build jobs, or one queue of plain jobs).

    Who touches what:

    * the lane's drain loop (`Lane.run`) begins drains (`begin_drain`) and
      waits for them to end; `Lane.wake` begins one at once when the loop waits;
    * the producer fills `buffer`, books `in_flight` statements and the room
      their claims may take (`reserved`), ends a drain when a claim comes back
      short, and collects `lost_claims` to resolve;
    * the slots take from `buffer` and count `running`;
    * the completer queues `finishes` and `starts` for the producer's next
      statement.

    `kick()` wakes the producer to look at its work again. What the lanes share
    (`stats`, `stopping`, the fence, the job scopes) is read through `worker`.
    """

    config: QueueConfig
    worker: WorkerState
    #: Claimed jobs no slot has taken yet, each with the (trio) time it was
    #: claimed, oldest first; slots park on `job_ready` while it is empty.
    buffer: collections.deque[tuple[ClaimedJob, float]] = attrs.Factory(collections.deque)
    job_ready: trio.lowlevel.ParkingLot = attrs.Factory(trio.lowlevel.ParkingLot)
    #: Finishes handed over by the slots, for the producer's next statement.
    finishes: list[Finish] = attrs.Factory(list)
    #: Start writes asked for by running executors (`JobContext.mark_building`),
    #: oldest first, each with the trio time from which it rides on the
    #: producer's next statement (`START_WRITE_DELAY`).
    starts: list[tuple[float, Starting]] = attrs.Factory(list)
    #: Claims whose answer was lost, waiting to be resolved; resolutions under way.
    lost_claims: list[LostClaim] = attrs.Factory(list)
    #: What a fence took out of the buffer, for the producer to give back.
    fenced_out: list[ClaimedJob] = attrs.Factory(list)
    resolving: int = 0
    #: Statements of the producer in flight, and the jobs their claims may take.
    in_flight: int = 0
    reserved: int = 0
    #: Past `prefetch_ttl`: claim only for idle slots until a slot runs dry.
    prefetch_paused: bool = False
    slots_alive: int = 0
    #: The lane is winding down (graceful or hard): slots take nothing more.
    closing: bool = False
    #: Last writes under way, retrying through outages while the lane runs
    #: (`last_write`): the close limits each.
    last_writes: set[Budget] = attrs.Factory(set)
    #: Set while no drain runs; the producer claims to fill the room only while
    #: it is clear, and ends the drain by setting it.
    drain_ended: trio.Event = attrs.Factory(trio.Event)
    kicked: trio.Event = attrs.Factory(trio.Event)
    #: Jobs in this lane's slots now (`stats.running` counts every lane's).
    running: int = 0
    #: How many runs the fence stopped in this lane's slots have not ended yet
    #: (their jobs are on their way back): claim no look-ahead until they have.
    #: Put back due at once and first in line, they would else run after whatever
    #: a look-ahead claim, sent as the worker registers anew, took meanwhile. Free
    #: slots still claim (their jobs start at once), so that one executor slow to
    #: unwind holds back no more than the look-ahead, and only until it ends.
    fence_settling: int = 0
    #: The drain under way (or last run) in this lane: a claim sent during an
    #: earlier drain, or before a wake that re-armed this one (`rearm`), must
    #: not end the current one.
    drain_id: int = 0
    #: Drains this lane began and ended (`stats` counts every lane's).
    drains_started: int = 0
    drains_completed: int = 0
    #: Trio time at which this lane's next scheduled job is due (plain lanes);
    #: the drain loop wakes then, not at its next poll. Read from the database
    #: after each drain (`Lane.refresh_due`) and lowered by `due_at` whenever
    #: this worker learns of an earlier one (a retry it wrote).
    next_due: float = float("inf")
    #: The earliest due time `due_at` learned since the read under way began:
    #: kept over that read's answer, which may predate the write it learned of.
    due_learned: float = float("inf")
    #: The drain loop's wait (`move_on_at` the poll or `next_due`), while it
    #: waits: `due_at` brings its deadline forward.
    wait_scope: trio.CancelScope | None = None
    #: The drain loop waits for a wake (or its poll): a wake begins the drain.
    waiting: bool = False
    #: A drain was begun (by a wake) that the drain loop has yet to wait for.
    drain_begun: bool = False
    #: Set by a wake that began a drain while the loop waited (or by a stop).
    wake_event: trio.Event = attrs.Factory(trio.Event)
    #: A wake the drain loop has yet to answer (it came between the end of a
    #: drain and the loop's next wait): the loop drains again at once.
    woken: bool = False
    #: The adaptive look-ahead, fed by the slots, when `config.prefetch` is
    #: "auto" (the lane's config has it resolved: `QueueConfig.lane_prefetch`).
    look_ahead: LookAhead | None = attrs.field(init=False, default=None)
    #: Seconds a prefetched job may wait in the buffer (`QueueConfig.lane_ttl`).
    prefetch_ttl: float = attrs.field(init=False, default=0.0)
    #: A test signal: called by a slot that has found a job in the buffer, just
    #: before it looks at a stop to decide whether the job starts. A test sets it
    #: to land a stop in that moment (a SIGTERM between a claim and its start)
    #: without sleeping; None otherwise.
    before_take: Callable[[], None] | None = None

    def __attrs_post_init__(self) -> None:
        self.drain_ended.set()
        if self.config.prefetch == "auto":
            self.look_ahead = LookAhead(self.config.concurrency,
                                        self.config.prefetch_auto_wait)
        self.prefetch_ttl = self.config.lane_ttl()

    # -- what the lanes share ------------------------------------------------------

    @property
    def stats(self) -> WorkerStats:
        return self.worker.stats

    @property
    def stopping(self) -> trio.Event:
        return self.worker.stopping

    @property
    def fenced(self) -> bool:
        return self.worker.fenced

    @property
    def job_scopes(self) -> dict[ClaimKey, trio.CancelScope]:
        return self.worker.job_scopes

    @property
    def cancels(self) -> set[ClaimKey]:
        return self.worker.cancels

    @property
    def run_seconds(self) -> Timings:
        return self.worker.run_seconds

    @property
    def claim_latency(self) -> Timings:
        return self.worker.claim_latency

    def notify(self) -> None:
        """Wake `drain_once` and `wait_for`."""
        self.worker.notify()

    # -- signals ---------------------------------------------------------------

    def kick(self) -> None:
        """Make the producer look at its work again (a finish, room, a drain)."""
        self.kicked.set()

    async def wait_kicked(self, deadline: float = float("inf")) -> None:
        with trio.move_on_at(deadline):
            await self.kicked.wait()
        self.kicked = trio.Event()

    # -- due times -------------------------------------------------------------

    def due_at(self, at: float) -> None:
        """
        A job of this lane falls due at trio time `at` (this worker wrote it: a
        retry after its backoff): the drain loop wakes then, whatever it is
        doing now. Its wait, if it waits, is re-armed to the earlier time; a
        read of the next due time under way keeps it too (its answer may have
        been read before the write); a drain under way leaves it in `next_due`
        for the wait that follows. Never blocks.
        """
        self.next_due = min(self.next_due, at)
        self.due_learned = min(self.due_learned, at)
        scope = self.wait_scope
        if scope is not None and at < scope.deadline:
            scope.deadline = at

    # -- drains ----------------------------------------------------------------

    @property
    def draining(self) -> bool:
        return not self.drain_ended.is_set()

    def begin_drain(self) -> None:
        self.drain_id += 1
        self.drains_started += 1
        self.stats.drains_started += 1
        self.drain_ended = trio.Event()
        self.kick()

    def end_drain(self) -> None:
        self.drain_ended.set()

    def rearm(self) -> None:
        """
        A wake during this drain: what the drain's claims in flight return no
        longer ends it (their `drain_id` is older), since they may have been
        sent before the job that caused the wake was committed. The producer,
        still draining, claims again as soon as a statement is free.
        """
        self.drain_id += 1

    @contextmanager
    def last_write(self) -> Iterator[Budget]:
        """
        The budget of a write that must land (a give-back, a lost claim's
        resolution, the wind-down's finishes), for `RetryPolicy.final`:
        unlimited while the lane runs, since no rescue takes a live worker's
        rows; from the close on (at once, if closed already) it may begin tries
        for one `cleanup_timeout` more, and the try under way then ends within
        its own bound. Else a stop that came during an outage's retries would
        wait for the outage to end.
        """
        budget = Budget()
        if self.closing:
            budget.close_in(self.config.cleanup_timeout)
        self.last_writes.add(budget)
        try:
            yield budget
        finally:
            self.last_writes.discard(budget)

    def close(self) -> None:
        """Slots take nothing more; the producer gives the buffer back and winds down."""
        self.closing = True
        for budget in self.last_writes:
            budget.close_in(self.config.cleanup_timeout)
        self.end_drain()
        self.wake_event.set()
        self.job_ready.unpark_all()
        self.kick()

    def idle(self) -> bool:
        """Nothing in hand and nothing about to start: no drain running or asked for."""
        return (self.running == 0 and not self.buffer and not self.finishes
                and not self.starts and not self.draining and not self.woken
                and not self.in_flight and not self.lost_claims and not self.resolving
                and not self.fenced_out)

    # -- room ------------------------------------------------------------------

    def prefetch(self) -> int:
        """Jobs to claim ahead of the free slots now: the fixed number, or what
        the look-ahead says."""
        if self.look_ahead is not None:
            return self.look_ahead.size
        prefetch = self.config.prefetch
        return prefetch if type(prefetch) is int else 0

    def room(self) -> int:
        """How many jobs the next claim may take: free slots plus free buffer places."""
        if self.closing or self.worker.stopping.is_set() or self.worker.fenced:
            return 0
        capacity = self.config.concurrency
        if not (self.prefetch_paused or self.fence_settling):
            capacity += self.prefetch()
        return max(0, capacity - len(self.buffer) - self.running - self.reserved)

    def claim_size(self) -> int:
        """The next statement's claim: the room left; with several slots, at most
        half the capacity, so that two statements in flight stagger the slots."""
        if self.config.concurrency == 1:
            return self.room()
        capacity = self.config.concurrency + self.prefetch()
        return min(self.room(), -(-capacity // STATEMENTS_IN_FLIGHT))

    def oldest_claim(self) -> float:
        return min(claimed_at for _job, claimed_at in self.buffer)
