"""
The worker: one trio nursery that turns wake-ups into drains.

Shape (docs/rules.md §5, §8)::

    run()
      recover stuck jobs (retried until the database answers), then started()
      nursery "timers":  the recovery timer (first tick one period after start,
                         missed ticks skipped; it also prunes when
                         `QueueConfig.retention` is set), and the LISTEN task (a
                         dedicated connection whose notifications feed the wake
                         channel; reconnects with backoff and drains after a loss)
      nursery "work":    the fetcher, the one task that talks to the queue for
                         the slots: it claims, records finishes and gives back
                         jobs that never started; and `concurrency` slot tasks,
                         each taking claimed jobs from the local buffer and
                         running each executor in a nursery of its own
      drain loop:        ask the fetcher to drain; then wait for a wake
                         (channel of capacity 64) or the poll timeout (5 s,
                         re-armed after every drain); coalesce the wakes that
                         piled up; drain again

A drain claims jobs until a claim comes back short, never more at once than
the slots and the prefetch buffer have room for (`QueueConfig.concurrency`, 1
as in the original, plus `QueueConfig.prefetch`, 0 as in the original: the
next claim then waits for the running job). When a slot's executor returns,
the slot hands the finish to the fetcher and takes its next job; the fetcher
records every finish queued at that moment and claims the room they freed in
one statement, so a worker spends one round trip per job at most, and fewer
when jobs end close together. Each claimed job goes through the attempt cap,
payload parsing and the soft-delete check before its executor runs in a
nursery of its own, so that an exception ("panic") lands in
`reset_panicked_job` instead of taking the worker down.

Stopping: `stop()` (or closing every send side of the wake channel) lets the
running executors finish, records their outcomes, gives back what the buffer
holds (attempts restored: those jobs never ran) and claims nothing more.
Cancelling `run()` cancels the executors, and their jobs go back to pending at
once, shielded, so no replica waits for the sweep.
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import math
from collections.abc import Awaitable, Callable
from typing import TypeVar
from uuid import UUID

import attrs
import trio

from .config import QueueConfig
from .database import Listening
from .errors import InvalidPayload, OutcomeUnknown, is_transient
from .executors import Executors, JobContext
from .jobs import (
    INVALID_PAYLOAD,
    JOB_PANICKED,
    MAX_ATTEMPTS_EXCEEDED,
    TARGET_DELETED,
    ClaimedJob,
    ClaimOutcomeUnknown,
    JobStatus,
    JobStore,
    LostClaim,
    PgJobStore,
    RecoveryResult,
)
from .payloads import BUILTIN_PAYLOAD_TYPES, Payload, PayloadCodec, Target
from .queue import Queue
from .retention import prune

log = logging.getLogger("nasiko_queue.worker")

T = TypeVar("T")

#: Statements the fetcher keeps in flight at once (see `Worker._fetcher`).
_STATEMENTS_IN_FLIGHT = 2


def _stats_changed(stats: WorkerStats, attribute: attrs.Attribute[int], value: int) -> int:
    """attrs `on_setattr` hook: every change of a counter wakes `Worker.wait_for`."""
    lot = stats._changed_lot
    if lot is not None and attribute.name != "_changed_lot":
        lot.unpark_all()
    return value


@attrs.define(on_setattr=_stats_changed)
class WorkerStats:
    """
    Counters since the worker started; for tests, `status` and benchmarks.

    Every assignment wakes whoever waits in `Worker.wait_for`, whichever counter
    it is (`running` and `buffered` change without any other signal).
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
    #: Statements the fetcher sent (claims, and finish batches with their claim):
    #: divided by `done + failed`, the round trips per job.
    statements: int = 0
    #: Jobs in a slot now (executor running, or the job being checked or failed).
    running: int = 0
    #: Claimed jobs waiting in the local buffer for a slot.
    buffered: int = 0
    #: Finished jobs whose outcome the fetcher has yet to record.
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
    _changed_lot: trio.lowlevel.ParkingLot | None = attrs.field(
        default=None, repr=False, eq=False, alias="_changed_lot")


@attrs.frozen
class _Finish:
    """A slot's executor returned: the fetcher records the outcome from the build row."""

    job: ClaimedJob
    build_id: UUID
    #: "<kind> <label>", computed by the slot: the fetcher runs no code of the
    #: payload type's, so a bug there cannot take the fetcher down.
    label: str


class Worker:
    """
    Runs jobs from one queue with one registry of executors.

    >>> worker = Worker(queue, executors)
    >>> async with trio.open_nursery() as nursery:
    ...     await nursery.start(worker.run)
    ...     await queue.enqueue(payload)      # wakes this worker after commit
    ...     worker.stop()                     # graceful: running jobs finish

    Args:
        queue: the queue to drain; its config supplies every constant.
        executors: one executor per kind this worker runs; it claims only those
            kinds (plus kinds no payload type knows, which fail as invalid).
        store: the database operations; `PgJobStore` unless a test gives a fake.
    """

    def __init__(
        self,
        queue: Queue,
        executors: Executors,
        *,
        store: JobStore | None = None,
    ) -> None:
        if not len(executors):
            raise ValueError("a worker needs at least one registered executor")
        self.queue = queue
        self.config: QueueConfig = queue.config
        self.executors = executors
        types = {t.kind: t for t in BUILTIN_PAYLOAD_TYPES}
        types.update({t.kind: t for t in executors.payload_types})
        self._codec = PayloadCodec(types=types.values(), secrets=queue.secrets)
        self._store: JobStore = store or PgJobStore(
            queue.db,
            self.config,
            runnable_kinds=executors.kinds,
            known_kinds=frozenset(types) | self.config.other_kinds,
        )
        self._wake_send, self._wake_recv = trio.open_memory_channel[None](
            self.config.wake_capacity
        )
        # Claimed jobs no slot has taken yet, each with the (trio) time it was
        # claimed, oldest first; slots park on `_job_ready` while it is empty.
        self._buffer: collections.deque[tuple[ClaimedJob, float]] = collections.deque()
        self._job_ready = trio.lowlevel.ParkingLot()
        # Finishes handed over by the slots, for the fetcher's next statement.
        self._finishes: list[_Finish] = []
        # Set to make the fetcher look at its work again (a finish, room, a drain).
        self._kicked = trio.Event()
        # Set while no drain runs: the fetcher claims to fill the room only
        # while it is clear (a drain), and ends the drain by setting it.
        self._drain_ended = trio.Event()
        self._drain_ended.set()
        # Past `prefetch_ttl`: claim only for idle slots until a slot runs dry.
        self._prefetch_paused = False
        # Graceful or hard stop under way: slots take nothing more from the buffer.
        self._closing = False
        self._slots_alive = 0
        self._woken = False
        # Statements of the fetcher in flight, and the jobs their claims may take.
        self._in_flight = 0
        self._reserved = 0
        # Claims whose answer was lost, waiting to be resolved, and resolutions
        # under way: what they took is given back (`JobStore.resolve_lost_claim`).
        self._lost_claims: list[LostClaim] = []
        self._resolving = 0
        self._stop = trio.Event()
        self._started = False
        self._changed = trio.lowlevel.ParkingLot()
        self.stats = WorkerStats(_changed_lot=self._changed)

    # -- signals -----------------------------------------------------------

    def wake(self) -> None:
        """Ask for a drain. Never blocks: a wake that does not fit is dropped."""
        # Until the drain loop takes it: a wake handed straight to the waiting
        # loop never shows in the channel's buffer, and `drain_once` must see it.
        self._woken = True
        with contextlib.suppress(trio.WouldBlock, trio.ClosedResourceError,
                                 trio.BrokenResourceError):
            self._wake_send.send_nowait(None)

    def stop(self) -> None:
        """Graceful stop: claim nothing more, let running executors finish, return."""
        self._stop.set()
        self._wake_send.close()
        self._end_drain()
        self._kick()

    async def drain_once(self) -> None:
        """
        Wake the worker and wait until a drain that began after this call is over.

        "Over" means a claim came back short (nothing more runnable), no job
        is running or waiting in the buffer, and every outcome is recorded.
        Meant for tests and tools that need to know the queue has been worked,
        without sleeping.
        """
        target = self.stats.drains_started + 1
        self.wake()
        while not (self.stats.drains_completed >= target and self._idle()):
            if self._stop.is_set():
                raise RuntimeError("the worker is stopping; no further drain will run")
            await self._changed.park()

    async def wait_for(self, condition: Callable[[WorkerStats], bool]) -> None:
        """
        Wait until `condition(worker.stats)` holds; checked whenever the stats change.

        A test signal in the manner of River's: wait on what the worker did (say
        ``lambda s: s.done >= 3``) instead of sleeping and hoping.
        """
        while not condition(self.stats):
            await self._changed.park()

    def _idle(self) -> bool:
        """Nothing in hand and nothing about to start: no drain running or asked for."""
        stats = self.stats
        return (stats.running == 0 and stats.buffered == 0 and stats.finishing == 0
                and not self._draining and not self._woken and not self._in_flight
                and not self._lost_claims and not self._resolving)

    def _notify(self) -> None:
        """Wake `drain_once` and `wait_for` (counters do so by themselves)."""
        self._changed.unpark_all()

    def _kick(self) -> None:
        self._kicked.set()

    # -- the loop -------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """
        Run until stopped (returns) or cancelled (running jobs go back to pending).

        Use with `nursery.start(worker.run)`: it reports itself started once the
        startup recovery sweep has run.
        """
        if self._started:
            raise RuntimeError("a Worker runs once; create a new one")
        self._started = True
        if not await self._startup_recovery():
            task_status.started()  # stopped before the database ever answered
            log.info("worker stopped before it started")
            return
        self.queue._add_waker(self.wake)
        try:
            async with trio.open_nursery() as timers:
                timers.start_soon(self._recovery_timer)
                if self.config.listen and self.config.notify_channel is not None:
                    # Returns once LISTEN is established (or its first try failed),
                    # so that an enqueue after `nursery.start(worker.run)` wakes us.
                    await timers.start(self._listener, self.config.notify_channel)
                async with trio.open_nursery() as work:
                    work.start_soon(self._fetcher, name="fetcher")
                    for n in range(self.config.concurrency):
                        work.start_soon(self._slot, name=f"slot {n}")
                    task_status.started()
                    log.info("worker started (kinds: %s)", ", ".join(sorted(self.executors)))
                    try:
                        await self._drain_loop()
                    finally:
                        self._close()
                # Every slot has returned and the fetcher has recorded their
                # outcomes; the timers have nothing left to guard.
                timers.cancel_scope.cancel()
        finally:
            self.queue._remove_waker(self.wake)
            self._stop.set()
            self._notify()
        log.info("worker stopped")

    @property
    def _draining(self) -> bool:
        return not self._drain_ended.is_set()

    def _end_drain(self) -> None:
        self._drain_ended.set()

    def _close(self) -> None:
        """Slots take nothing more; the fetcher gives the buffer back and winds down."""
        self._closing = True
        self._end_drain()
        self._job_ready.unpark_all()
        self._kick()

    async def _drain_loop(self) -> None:
        while True:
            await self._drain()
            if self._stop.is_set():
                return
            with trio.move_on_after(self.config.poll_interval):
                try:
                    await self._wake_recv.receive()
                except trio.EndOfChannel:
                    return
            # Wakes that arrived during the drain are all answered by the next one.
            while True:
                try:
                    self._wake_recv.receive_nowait()
                except trio.WouldBlock:
                    break
                except trio.EndOfChannel:
                    return
            if self._stop.is_set():
                return
            self._woken = False  # the drain below answers every wake so far

    async def _drain(self) -> None:
        """Have the fetcher claim until a claim comes back short (or fails)."""
        self.stats.drains_started += 1
        self._drain_ended = trio.Event()
        self._kick()
        try:
            if not self._stop.is_set():
                await self._drain_ended.wait()
        finally:
            self._end_drain()
            self.stats.drains_completed += 1
            self._notify()

    def _room(self) -> int:
        """How many jobs the next claim may take: free slots plus free buffer places."""
        if self._closing or self._stop.is_set():
            return 0
        capacity = self.config.concurrency
        if not self._prefetch_paused:
            capacity += self.config.prefetch
        return max(0, capacity - len(self._buffer) - self.stats.running - self._reserved)

    # -- the slots ------------------------------------------------------------

    async def _slot(self) -> None:
        """Take claimed jobs from the buffer and run them, one at a time, until closing."""
        self._slots_alive += 1
        try:
            while True:
                job = await self._take()
                if job is None:
                    return
                self.stats.running += 1
                finish: _Finish | None = None
                try:
                    finish = await self._process(job)
                except Exception:
                    # Not the executor (its crashes are handled in _process) and not
                    # the database (final updates retry): a bug, ours or in a payload
                    # type's code. Keep the other jobs running, and count it as a
                    # crash of this job, so that it is retried or failed, never
                    # left in_progress for the sweep.
                    log.exception("job %s: internal error; counted as a crash", job.id)
                    await self._reset_panicked_job(job, None)
                finally:
                    # No checkpoint between the executor's return and this hand-over:
                    # a hard stop cannot come between them and lose the outcome.
                    self.stats.running -= 1
                    if finish is not None:
                        self._finishes.append(finish)
                        self.stats.finishing += 1
                    self._kick()
                    self._notify()
        finally:
            self._slots_alive -= 1
            self._kick()

    async def _take(self) -> ClaimedJob | None:
        """The oldest buffered job, waiting for one if need be; None once closing."""
        # A hard stop may already be on its way: then take nothing (what the
        # buffer holds goes back unstarted, its attempt restored).
        await trio.lowlevel.checkpoint_if_cancelled()
        while not self._buffer:
            if self._closing:
                return None
            if self._prefetch_paused:  # we run dry: prefetching is worth it again
                self._prefetch_paused = False
                self._kick()
            await self._job_ready.park()
        if self._closing:
            return None  # a stop: what the buffer holds goes back, never starts
        job, _claimed_at = self._buffer.popleft()
        self.stats.buffered -= 1
        return job

    # -- the fetcher ----------------------------------------------------------

    async def _fetcher(self) -> None:
        """
        The one task that claims for this worker, records its finishes, and
        gives back jobs that never started.

        A statement records every finish queued since the last one and claims
        for the room they freed (`finish_many_and_claim`); in a drain with no
        finish waiting, a plain claim fills the room. Nothing waits to fill a
        batch, so no outcome is delayed by more than a statement in flight.

        Two statements may be in flight at once, each claiming at most half of
        the slots and buffer, so that half the slots run their jobs while the
        other half's next jobs are claimed: the worker's CPU and the server's
        then work at the same time instead of taking turns. (Claims never
        exceed the room: jobs a statement in flight may claim count as taken.)

        On a stop it records the outcomes of the last running jobs and gives
        back the buffer; on a hard stop it does so shielded and bounded.
        """
        try:
            async with trio.open_nursery() as statements:
                await self._fetch_until_closed(statements)
        finally:
            with trio.CancelScope(shield=True):
                await self._wind_down()

    async def _fetch_until_closed(self, statements: trio.Nursery) -> None:
        ttl = self.config.prefetch_ttl
        # One slot: one statement at a time, so jobs start in the order claimed
        # (the buffer already overlaps the slot's work with the statement).
        in_flight = 1 if self.config.concurrency == 1 else _STATEMENTS_IN_FLIGHT
        while True:
            free = self._in_flight < in_flight
            expired = self._buffer and self._oldest_claim() + ttl <= trio.current_time()
            if self._lost_claims:
                for claim in self._lost_claims:
                    statements.start_soon(self._resolve, claim)
                self._lost_claims.clear()
            elif self._buffer and (self._closing or expired):
                await self._give_back(expired=not self._closing)
            elif self._finishes and free:
                batch, self._finishes = self._finishes, []
                want = self._claim_size()
                statements.start_soon(self._send_finishes, batch, want, self._begin(want))
            elif self._draining and free and self._claim_size():
                want = self._claim_size()
                statements.start_soon(self._send_claim, want, self._begin(want))
            elif self._closing and not self._slots_alive and not self._in_flight \
                    and not self._resolving:
                return
            else:
                deadline = self._oldest_claim() + ttl if self._buffer else math.inf
                with trio.move_on_at(deadline):
                    await self._kicked.wait()
                self._kicked = trio.Event()

    def _oldest_claim(self) -> float:
        return min(claimed_at for _job, claimed_at in self._buffer)

    def _claim_size(self) -> int:
        """The next statement's claim: the room left; with several slots, at most
        half the capacity, so that two statements in flight stagger the slots."""
        if self.config.concurrency == 1:
            return self._room()
        capacity = self.config.concurrency + self.config.prefetch
        return min(self._room(), -(-capacity // _STATEMENTS_IN_FLIGHT))

    def _begin(self, want: int) -> int:
        """Book a statement in flight and the room its claim may take; the drain it is in."""
        self._in_flight += 1
        self._reserved += want
        self.stats.statements += 1
        return self.stats.drains_started

    def _done(self, want: int) -> None:
        self._in_flight -= 1
        self._reserved -= want
        self._kick()

    async def _send_finishes(self, batch: list[_Finish], want: int, drain: int) -> None:
        finishing = [(f.job, f.build_id) for f in batch]
        tries = 0

        async def send() -> tuple[dict[UUID, JobStatus | None], list[ClaimedJob]]:
            # Only the first try claims: a retry, or the last try after a hard
            # stop, would claim jobs that nobody takes if its answer is lost.
            nonlocal tries
            tries += 1
            try:
                return await self._store.finish_many_and_claim(
                    finishing, want if tries == 1 else 0)
            except ClaimOutcomeUnknown as exc:
                self._lost(exc)  # the claim is given back; the finishes are sent again
                raise OutcomeUnknown(str(exc)) from exc

        try:
            statuses, claimed = await self._final("finish", send)
            self._accept(claimed, want, drain)
            verbose = log.isEnabledFor(logging.INFO)
            for finish in batch:
                status = statuses.get(finish.job.id)
                if status == "done":
                    self.stats.done += 1
                elif status is not None:
                    self.stats.failed += 1
                if verbose:
                    log.info("job %s (%s): %s", finish.job.id, finish.label, status or "gone")
            self.stats.finishing -= len(batch)
        finally:
            self._done(want)
            self._notify()

    async def _send_claim(self, want: int, drain: int) -> None:
        try:
            claimed = await self._claim(want)
            if claimed is None:
                if drain == self.stats.drains_started:
                    self._end_drain()  # logged; the next wake or poll tries again
            else:
                self._accept(claimed, want, drain)
        finally:
            self._done(want)
            self._notify()

    def _accept(self, claimed: list[ClaimedJob], wanted: int, drain: int) -> None:
        """
        Claimed jobs into the buffer. A claim that came back short ends the
        drain, if it was sent during that drain: one sent before the wake may
        not have seen the job that caused it.
        """
        if wanted and len(claimed) < wanted and drain == self.stats.drains_started:
            self._end_drain()
        if not claimed:
            return
        now = trio.current_time()
        if self._buffer and claimed[0].created_at < self._buffer[-1][0].created_at:
            # Two statements in flight returned out of order: oldest job first still.
            merged = sorted([*self._buffer, *((job, now) for job in claimed)],
                            key=lambda entry: entry[0].created_at)
            self._buffer = collections.deque(merged)
        else:
            self._buffer.extend((job, now) for job in claimed)
        self.stats.buffered += len(claimed)
        self.stats.claimed += len(claimed)
        self._job_ready.unpark(count=len(claimed))

    async def _give_back(self, *, expired: bool) -> None:
        """
        Buffered jobs back to pending, attempts restored: on closing, all of
        them; else those past `prefetch_ttl`, and prefetching pauses until a
        slot runs dry, or we would claim the same jobs straight back.
        """
        if expired:
            # The same comparison as the fetcher's, so at least one job goes.
            now, ttl = trio.current_time(), self.config.prefetch_ttl
            jobs = [job for job, claimed_at in self._buffer if claimed_at + ttl <= now]
            self._buffer = collections.deque(
                entry for entry in self._buffer if entry[1] + ttl > now)
            self._prefetch_paused = True
        else:
            jobs = [job for job, _ in self._buffer]
            self._buffer.clear()
        self.stats.buffered -= len(jobs)
        with trio.CancelScope(shield=True):  # bounded by the store
            try:
                self.stats.returned += await self._store.unclaim(jobs)
            except Exception as exc:
                log.warning("%d unstarted job(s) could not be given back (%s); the recovery "
                            "sweep will", len(jobs), _one_line(exc))
        log.info("gave back %d job(s) that never started (%s)", len(jobs),
                 "waited past prefetch_ttl" if expired else "stopping")
        self._notify()

    async def _wind_down(self) -> None:
        """
        After the loop (graceful) or on a hard stop (shielded): record the
        finishes of the last slots and give back the buffer.

        It waits for every slot, however long an executor takes to notice a
        hard stop (the work nursery waits for them anyway), so that an outcome
        handed over late is still recorded. Each statement is bounded instead:
        one that cannot be sent in time is logged, and the sweep recovers its jobs.
        """
        self._closing = True
        while self._lost_claims or self._buffer or self._finishes or self._slots_alive:
            if self._lost_claims:
                claim = self._lost_claims.pop()
                with trio.move_on_after(2 * self.config.cleanup_timeout) as scope:
                    await self._resolve(claim)
                if scope.cancelled_caught:
                    log.error("a claim whose answer was lost could not be resolved in time; "
                              "its jobs wait for the recovery sweep")
            elif self._buffer:
                await self._give_back(expired=False)
            elif self._finishes:
                batch, self._finishes = self._finishes, []
                # One try, then one more after a backoff at most (a hard stop may be
                # under way): each bounded by the store.
                with trio.move_on_after(2 * self.config.cleanup_timeout) as scope:
                    await self._send_finishes(batch, 0, self._begin(0))
                if scope.cancelled_caught:
                    self.stats.finishing -= len(batch)
                    log.error("the outcomes of %d finished job(s) may not be recorded (the "
                              "database did not answer in time); the recovery sweep will "
                              "recover what is left", len(batch))
            else:
                await self._kicked.wait()
                self._kicked = trio.Event()

    async def _claim(self, limit: int) -> list[ClaimedJob] | None:
        """
        The claim, shielded (and bounded by the store): a hard stop must not cut
        it after the server committed it, or the job would sit in_progress with no
        executor. None when it failed (logged; the drain stops); a claim whose
        answer was lost is resolved (`_lost`).
        """
        with trio.CancelScope(shield=True):
            try:
                return await self._store.claim(limit)
            except ClaimOutcomeUnknown as exc:
                self.stats.claim_errors += 1
                self._lost(exc)
            except Exception as exc:
                self.stats.claim_errors += 1
                log.error("claim failed (%s); waiting for the next wake or poll",
                          _one_line(exc), exc_info=not is_transient(exc))
        return None

    def _lost(self, exc: ClaimOutcomeUnknown) -> None:
        """A claim's answer was lost: the fetcher gives back what it took, at once."""
        log.warning("a claim got no answer (%s); giving back whatever it took", _one_line(exc))
        self._lost_claims.append(exc.claim)
        self._kick()

    async def _resolve(self, claim: LostClaim) -> None:
        """Give back what a lost claim took (retried until the database answers)."""
        self._resolving += 1
        try:
            given = await self._final("lost claim", lambda: self._store.resolve_lost_claim(claim))
            self.stats.lost_claims += 1
            self.stats.returned += given
            if given:
                self.wake()  # they are pending again: claim them (or let a replica)
        finally:
            self._resolving -= 1
            self._kick()
            self._notify()

    # -- one job --------------------------------------------------------------

    async def _process(self, job: ClaimedJob) -> _Finish | None:
        """
        Take one claimed job through docs/rules.md §5 steps 1-4 and run its executor.

        Returns the finish for the fetcher to record (step 5) when the executor
        returned; every other outcome (cap, invalid payload, deleted target,
        panic) is written here.
        """
        if self._out_of_attempts(job):
            log.warning("job %s: attempt %d exceeds the cap; failing", job.id, job.attempt)
            await self._fail(job, MAX_ATTEMPTS_EXCEEDED, own_build_id=None)
            return None
        payload = self._parse(job)
        if payload is None:
            # The build id comes from the row, read by PostgreSQL (`job_fail`).
            await self._fail(job, INVALID_PAYLOAD, own_build_id=None)
            return None
        if job.target_soft_deleted:
            log.warning("job %s (%s %s): target agent is deleted; not running", job.id,
                        payload.kind, _label(payload))
            await self._fail(job, TARGET_DELETED, own_build_id=payload.build_id, terminalize=False)
            return None
        executor = self.executors.executor_for(payload.kind)
        if executor is None:  # the claim filters on our kinds, so this is a bug
            raise RuntimeError(f"claimed a {payload.kind} job without an executor for it")
        ctx = JobContext(
            job_id=job.id,
            attempt=job.attempt,
            payload=payload,
            owner_id=job.owner_id,
            target=Target(agent_id=job.agent_id, connector_id=job.connector_id),
            db=self.queue.db,
        )
        label = f"{payload.kind} {_label(payload)}"
        log.info("job %s (%s): attempt %d starting", job.id, label, job.attempt)
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(executor, ctx)
        except Exception as exc:  # the executor raised: an ExceptionGroup from its nursery
            self.stats.panicked += 1
            log.error("job %s (%s) panicked on attempt %d", job.id, label, job.attempt,
                      exc_info=exc)
            await self._reset_panicked_job(job, payload.build_id)
            return None
        except BaseException:
            # Cancelled: a hard stop. The job never finished; hand it back now.
            await self._release(job)
            raise
        return _Finish(job=job, build_id=payload.build_id, label=label)

    def _parse(self, job: ClaimedJob) -> Payload | None:
        """
        The job's payload, or None (logged) when it is not one: whatever the
        row holds — JSON no payload type accepts, nesting deep enough to exhaust
        Python's recursion limit, a payload over `max_payload_bytes` that the
        claim did not even send — fails this job alone.
        """
        if job.payload is None:
            log.warning("job %s: invalid payload: over max_payload_bytes (%d)", job.id,
                        self.config.max_payload_bytes)
            return None
        try:
            return self._codec.decode(json.loads(job.payload))
        except Exception as exc:  # RecursionError included: any failure is the payload's
            log.warning("job %s: invalid payload: %s", job.id,
                        exc if isinstance(exc, InvalidPayload) else type(exc).__name__)
            return None

    def _out_of_attempts(self, job: ClaimedJob) -> bool:
        """The cap (docs/rules.md §5 step 1): this claim is one more than MAX_ATTEMPTS allows."""
        return job.old_attempt >= self.config.max_attempts

    async def _reset_panicked_job(self, job: ClaimedJob, build_id: UUID | None) -> None:
        """
        docs/rules.md §5: the documented rule, old_attempt + 1 >= MAX_ATTEMPTS fails.

        So a job that always raises runs exactly MAX_ATTEMPTS times and ends
        failed with attempt = MAX_ATTEMPTS; otherwise it goes back to the front
        of the queue, and this drain retries it at once.
        """
        if job.old_attempt + 1 >= self.config.max_attempts:
            await self._fail(job, JOB_PANICKED, own_build_id=build_id)
        else:
            await self._final("reset", lambda: self._store.reset(job))
            # Retry at once. With one slot the drain's next claim takes it anyway;
            # with more, the drain may already have ended, so ask for another.
            self.wake()

    async def _fail(
        self, job: ClaimedJob, message: str, *, own_build_id: UUID | None, terminalize: bool = True
    ) -> None:
        def fail(terminalize: bool) -> Callable[[], Awaitable[bool]]:
            return lambda: self._store.fail(
                job, message, own_build_id=own_build_id, terminalize=terminalize
            )

        ours = await self._final(
            "fail",
            fail(terminalize),
            # The target's terminalization is refused for good: mark the job alone.
            fallback=fail(False) if terminalize else None,
        )
        if ours:
            self.stats.failed += 1

    async def _release(self, job: ClaimedJob) -> None:
        # Shielded; bounded by the store (cleanup_timeout on both sides of the bridge).
        with trio.CancelScope(shield=True):
            try:
                if await self._store.reset(job):
                    self.stats.released += 1
                    log.warning("job %s: cancelled by a hard stop; back to pending", job.id)
            except Exception:
                log.exception("job %s: could not be put back after a hard stop; "
                              "the recovery sweep will", job.id)

    async def _final(
        self,
        what: str,
        op: Callable[[], Awaitable[T]],
        *,
        fallback: Callable[[], Awaitable[T]] | None = None,
    ) -> T:
        """
        A final update: retried with backoff until it succeeds (docs/rules.md §5).

        A finished job's result must not be lost, or the sweep would run the
        build again. So each attempt is shielded from a hard stop (and bounded
        by `cleanup_timeout` in the store, on both sides of the trio/asyncio
        bridge); only the wait between attempts can be cancelled, and then one
        last attempt is made. When the database keeps rejecting `op` on its
        merits (not an outage), `fallback` takes over after `terminalize_tries`
        attempts.
        """
        delay = self.config.retry_initial_delay
        rejected = 0
        while True:
            with trio.CancelScope(shield=True):
                try:
                    return await op()
                except Exception as exc:
                    failure: BaseException = exc
            if not is_transient(failure):
                rejected += 1
                if fallback is not None and rejected >= self.config.terminalize_tries:
                    log.error("%s update rejected %d times (%s); falling back", what, rejected,
                              _one_line(failure))
                    op, fallback, rejected = fallback, None, 0
                    continue
            log.warning("%s update failed (%s); retrying in %.2fs", what, _one_line(failure),
                        delay, exc_info=failure)
            try:
                await trio.sleep(delay)
            except trio.Cancelled:
                with trio.CancelScope(shield=True):
                    try:
                        await op()
                    except Exception:
                        log.exception("last %s update failed; the sweep will recover the job",
                                      what)
                raise
            delay = min(delay * 2, self.config.retry_max_delay)

    # -- recovery -------------------------------------------------------------

    async def _recover(self) -> RecoveryResult:
        result = await self._store.recover()
        self.stats.recoveries += 1
        self._notify()
        return result

    async def _prune(self) -> None:
        """The retention part of a recovery tick (`QueueConfig.retention`)."""
        if self.config.retention is None:
            return
        try:
            self.stats.pruned += await prune(self.queue.db, self.config.retention)
        except Exception as exc:
            log.warning("retention prune failed (%s); next try at the next tick",
                        _one_line(exc))
        self._notify()

    # -- LISTEN ---------------------------------------------------------------

    def _on_notification(self, _payload: str) -> None:
        """Runs on the trio thread, from asyncpg's listener callback; never blocks."""
        self.stats.notifications += 1
        self.wake()

    async def _listener(
        self, channel: str, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """
        LISTEN on `channel` on a dedicated connection and turn notifications into wakes.

        When the connection is lost, reconnect with backoff, and once LISTEN is back
        wake the worker: whatever was enqueued while nobody listened sent its
        notification into the void. The poll stays the safety net throughout.
        """
        delay = self.config.retry_initial_delay
        started = False
        while True:
            try:
                async with self.queue.db.listen(channel, self._on_notification) as listening:
                    self.stats.listen_connects += 1
                    if started:
                        log.info("LISTEN %s re-established; draining what it missed", channel)
                        self.wake()
                    else:
                        started = True
                        task_status.started()
                    self._notify()
                    connected_at = trio.current_time()
                    await self._until_lost(listening)
                    if trio.current_time() - connected_at > self.config.retry_max_delay:
                        delay = self.config.retry_initial_delay  # it was a healthy connection
                    log.warning("LISTEN connection lost; reconnecting in %.2fs", delay)
            except Exception as exc:
                log.warning("LISTEN %s failed (%s); retrying in %.2fs", channel,
                            _one_line(exc), delay)
            if not started:  # do not hold the worker's start hostage: the poll covers
                started = True
                task_status.started()
            await trio.sleep(delay)
            delay = min(delay * 2, self.config.retry_max_delay)

    async def _until_lost(self, listening: Listening) -> None:
        """
        Return once the LISTEN connection is lost, or stops answering: every
        `listen_check_interval` it is asked a trivial question, bounded by
        `cleanup_timeout` (a hung connection raises nothing by itself).
        """
        async with trio.open_nursery() as nursery:

            async def lost() -> None:
                await listening.lost.wait()
                nursery.cancel_scope.cancel()

            nursery.start_soon(lost)
            while True:
                await trio.sleep(self.config.listen_check_interval)
                if not await listening.check(self.config.cleanup_timeout):
                    log.warning("the LISTEN connection did not answer within %.1fs",
                                self.config.cleanup_timeout)
                    self.stats.listen_hangs += 1
                    nursery.cancel_scope.cancel()
                    return

    async def _recovery_timer(self) -> None:
        """Sweep every `recovery_interval`; first tick one period in, missed ticks skipped."""
        period = self.config.recovery_interval
        next_tick = trio.current_time() + period
        while True:
            await trio.sleep_until(next_tick)
            try:
                await self._recover()
            except Exception:
                log.exception("recovery sweep failed; next one in %.0fs", period)
            else:
                self.wake()  # the sweep is one of the three signals: drain what it freed
            await self._prune()
            now = trio.current_time()
            next_tick += period
            if next_tick <= now:  # the sweep overran: skip, never replay, missed ticks
                next_tick += math.ceil((now - next_tick) / period) * period
                if next_tick <= now:
                    next_tick += period

    async def _startup_recovery(self) -> bool:
        """
        The sweep before `started()` (docs/rules.md §5), retried with backoff while the
        database is away; False if `stop()` came first.

        Only an outage is waited for. An error the database gives on its merits
        (a bug, a table it refuses) is logged and the worker starts anyway: the
        sweep runs again at every recovery tick, and one bad row must never keep
        every replica from starting.
        """
        delay = self.config.retry_initial_delay
        while True:
            try:
                await self._recover()
                return True
            except Exception as exc:
                if not is_transient(exc):
                    log.error("startup recovery failed (%s); starting anyway, the next "
                              "recovery tick tries again", _one_line(exc), exc_info=exc)
                    return True
                log.warning("startup recovery failed (%s); retrying in %.2fs",
                            _one_line(exc), delay)
            with trio.move_on_after(delay):
                await self._stop.wait()
            if self._stop.is_set():
                return False
            delay = min(delay * 2, self.config.retry_max_delay)


def _label(payload: Payload) -> str:
    """`payload.label()`, for logs; a bug in a payload type's label is not the job's end."""
    try:
        return payload.label()
    except Exception as exc:
        return f"<label() raised {type(exc).__name__}>"


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"
