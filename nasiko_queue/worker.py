"""
The worker: a supervisor whose nursery turns wake-ups into drains.

Shape (docs/rules.md §5, §8)::

    run()
      register the worker's row, the startup sweep (both retried while the
      database is away), then started()
      nursery "timers": the `HeartbeatService` (renews the row every 3 s, holds
                        the maintenance leadership, fences the worker when cut
                        off), the recovery timer (`StuckJobSweeper`: first tick
                        one period after start, missed ticks skipped; each tick
                        also prunes, `Pruner`), the `JobRescuer` (dead workers'
                        jobs back to pending), all three on the leader only, the
                        `Scheduler` (cron ticks, on every replica that has it:
                        the database decides who enqueues each tick), and the
                        `Listener` (LISTEN on a dedicated connection; every
                        notification is a wake)
      nursery "work":   one `Lane` per source of jobs: the build jobs (when it
                        has build executors), and each queue of plain jobs it
                        runs. Each lane has its `Producer` (claims into the
                        lane's local buffer, carrying the `Completer`'s queued
                        finishes on each statement; gives back what never
                        started; resolves lost claims) and its slots
                        (`Slots.run_slot`: each runs one job at a time, its
                        executor guarded in a cancel scope of its own, so
                        that its exceptions, and those of any task it
                        starts, feed `reset_panicked_job`)
      the drain loop:   start a drain in every lane; wait for them to end; read
                        when each queue's next scheduled job is due; then wait
                        for a wake (the wake channel, capacity 64), the poll
                        timeout (5 s, re-armed after every drain) or the next
                        due job, whichever comes first; coalesce the wakes that
                        piled up; drain again

A drain claims jobs until a claim comes back short, never more at once than a
lane's slots and prefetch buffer have room for (for the build lane
`QueueConfig.concurrency`, 1 as in the original, plus `QueueConfig.prefetch`, 0
as in the original; for a queue, its own concurrency from `QueueConfig.queues`).

Stopping: `stop()` (or closing every send side of the wake channel) lets the
running executors finish, records their outcomes, gives back what the buffer
holds (attempts restored: those jobs never ran) and claims nothing more.
Cancelling `run()` cancels the executors, and their jobs go back to pending at
once, shielded and bounded, so no replica waits for the sweep. Either way the
worker's row goes (or, if it still holds jobs, is declared dead, so that the
leader gives them back) and its leadership is released.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any
from uuid import UUID

import attrs
import trio

from .completer import Completer
from .config import QueueConfig
from .errors import is_transient
from .executors import Executors
from .heartbeat import HeartbeatService
from .job_executor import JobExecutor
from .jobs import JobStore, LaneStore, PgJobStore
from .lane import Lane
from .listener import Listener
from .maintenance import (
    JobRescuer,
    Pruner,
    RescuerConfig,
    StuckJobSweeper,
    SweeperConfig,
)
from .payloads import BUILTIN_PAYLOAD_TYPES, AnyPayload, PayloadCodec
from .plain_executor import PlainJobExecutor
from .plain_jobs import PlainJobStore
from .producer import Producer
from .queue import Queue
from .retry import RetryPolicy, one_line
from .schedules import Schedule, Scheduler, SchedulerConfig
from .slots import Slots
from .state import WorkerState, WorkerStats

__all__ = ["Worker", "WorkerStats"]

log = logging.getLogger("nasiko_queue.worker")


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
        schedules: cron schedules whose ticks this worker enqueues, when
            `QueueConfig.scheduler` is on (the `Scheduler`, in its timers
            nursery). Every replica may run the same ones: each tick is
            enqueued once. Their jobs run wherever their queue is worked.
    """

    def __init__(
        self,
        queue: Queue,
        executors: Executors,
        *,
        store: JobStore | None = None,
        schedules: Sequence[Schedule] = (),
    ) -> None:
        if not len(executors):
            raise ValueError("a worker needs at least one registered executor")
        self.queue = queue
        self.config: QueueConfig = queue.config
        self.executors = executors
        types: dict[str, type[AnyPayload]] = {t.kind: t for t in BUILTIN_PAYLOAD_TYPES}
        types.update({t.kind: t for t in executors.payload_types})
        build_kinds = frozenset(types) | self.config.other_kinds
        types.update({t.kind: t for t in executors.plain_types})
        self._store: JobStore = store or PgJobStore(
            queue.db,
            self.config,
            runnable_kinds=executors.kinds,
            known_kinds=build_kinds,
        )
        self._wake_send, self._wake_recv = trio.open_memory_channel[None](
            self.config.wake_capacity
        )
        self.state = WorkerState(self.config)
        self.stats: WorkerStats = self.state.stats
        self._retry = RetryPolicy(self.config)
        self._codec = PayloadCodec(types=types.values(), secrets=queue.secrets)
        #: The lanes it runs: the build jobs (if it has build executors), then one
        #: per queue of plain jobs.
        self.lanes: list[Lane] = []
        if executors.kinds and self.config.builds:
            self.lanes.append(self._lane("builds", self.state, self._store, JobExecutor))
        for name, concurrency in self._queues():
            lane_state = self.state.lane(attrs.evolve(self.config, concurrency=concurrency))
            plain = PlainJobStore(queue.db, self.config, name, self._worker_id)
            self.lanes.append(self._lane(name, lane_state, plain, PlainJobExecutor))
        if not self.lanes:
            raise ValueError("this worker has nothing to run: its build executors are off "
                             "(QueueConfig.builds) and it has no queue of plain jobs")
        first = self.lanes[0]
        # The first lane's parts, for tests and tools that look at one.
        self.producer, self.completer, self.executor = (first.producer, first.completer,
                                                        first.executor)
        self.rescuer = JobRescuer(RescuerConfig.of(self.config), self._store, self.state,
                                  on_rescued=self.wake)
        self.heartbeat = HeartbeatService(self.state, self._store,
                                          tuple(sorted(executors)),
                                          on_fence=self._fence, on_resume=self._resume,
                                          on_elected=self.rescuer.kick,
                                          on_cancels=self._cancel_running)
        self.sweeper = StuckJobSweeper(SweeperConfig.of(self.config), self._store,
                                       self.stats, on_swept=self.wake,
                                       leading=self.state.is_leader)
        self.pruner = Pruner(queue.db, self.config.retention, self.stats)
        #: Enqueues the cron schedules' ticks; None without schedules or with
        #: `QueueConfig.scheduler` off.
        self.scheduler: Scheduler | None = None
        if schedules and self.config.scheduler:
            self.scheduler = Scheduler(queue, schedules, SchedulerConfig.of(self.config))
        self._started = False
        #: The drain loop waits for a wake (or the poll): a wake begins the drain.
        self._idle = False
        #: A drain was begun (by a wake) that the drain loop has yet to wait for.
        self._drain_begun = False

    def _worker_id(self) -> UUID | None:
        worker_id: UUID | None = getattr(self._store, "worker_id", None)
        return worker_id

    def _queues(self) -> tuple[tuple[str, int], ...]:
        """The plain queues this worker runs: configured, or those its types name."""
        if self.config.queues is not None:
            return self.config.queues
        names = sorted({t.options.queue for t in self.executors.plain_types})
        return tuple((name, self.config.concurrency) for name in names)

    def _lane(self, name: str, state: WorkerState, store: LaneStore,
              pipeline: type[Slots[Any]]) -> Lane:
        lane: Lane
        completer = Completer(state, store, self._retry,
                              on_lost_claim=lambda exc: lane.lost_claim(exc))
        producer = Producer(state, store, completer, self._retry, self.wake)
        executor = pipeline(state, store, self.queue, self.executors, self._codec, completer,
                            self._retry, self.wake)
        lane = Lane(name=name, state=state, store=store, producer=producer,
                    completer=completer, executor=executor)
        return lane

    @property
    def is_leader(self) -> bool:
        """Whether this worker runs maintenance now (rescue, the stuck sweep, retention)."""
        return self.state.is_leader()

    def _resume(self) -> None:
        """Registered anew after a fence: claim again, at once."""
        for lane in self.lanes:
            lane.state.fenced = False
            lane.state.kick()
        self.wake()

    def _fence(self, _why: str) -> None:
        """The worker lost its lease: stop every running job, drop what is buffered
        (the leader gives it back with the rest), claim nothing until registered anew."""
        for lane in self.lanes:
            state = lane.state
            state.fenced = True
            lane.executor.fence()
            dropped = len(state.buffer)
            state.buffer.clear()
            state.stats.buffered -= dropped
            state.end_drain()
            state.kick()
        self.state.notify()

    def _cancel_running(self, ids: tuple[UUID, ...]) -> None:
        """The heartbeat found cancel requests for plain jobs this worker runs:
        stop their executors; their runs end `cancelled`."""
        wanted = set(ids)
        for lane in self.lanes:
            for claim, scope in lane.state.job_scopes.items():
                if claim[0] in wanted and claim not in lane.state.cancels:
                    lane.state.cancels.add(claim)
                    scope.cancel()

    # -- signals -----------------------------------------------------------

    def wake(self) -> None:
        """
        Ask for a drain. Never blocks: a wake that does not fit is dropped.

        The wake is on the path from an enqueue (a NOTIFY on the listener, or an
        in-process enqueue) to its job's start, so it acts at once rather than
        through another task: while the drain loop waits, it begins the drain
        here, and the producers claim on their next pass instead of after the
        drain loop's; during a drain it re-arms every lane that is draining
        (`WorkerState.rearm`), so that a claim already in flight, which may not
        have seen the new job, does not end the drain when it comes back short:
        the producer claims again straight away instead of after a round of the
        drain loop (and, for plain queues, the look-up of the next due job).
        """
        self._wake()

    def _wake(self) -> bool:
        """`wake`; True when a drain under way answers it (begun or re-armed by it in
        every lane), False when the drain loop's next drain will."""
        state = self.state
        if not state.stopping.is_set():
            if self._idle:
                self._begin_drain()
                self._signal()  # the drain loop waits for the drain begun here
                return True
            draining = [lane.state for lane in self.lanes if lane.state.draining]
            for lane_state in draining:
                lane_state.rearm()
            if len(draining) == len(self.lanes):
                return True  # every lane claims again: no further drain is needed
        self._signal()
        return False

    def _signal(self) -> None:
        """Hand a wake to the drain loop through the channel (dropped when it is full)."""
        self.state.woken = True
        with contextlib.suppress(trio.WouldBlock, trio.ClosedResourceError,
                                 trio.BrokenResourceError):
            self._wake_send.send_nowait(None)

    @property
    def wakes_pending(self) -> int:
        """Wakes waiting in the channel (at most `wake_capacity`)."""
        return self._wake_send.statistics().current_buffer_used

    def stop(self) -> None:
        """Graceful stop: claim nothing more, let running executors finish, return."""
        self.state.stopping.set()
        self._wake_send.close()
        for lane in self.lanes:
            lane.state.end_drain()
            lane.state.kick()

    async def drain_once(self) -> None:
        """
        Wake the worker and wait until a drain that began after this call (or
        that this call's wake re-armed in every lane) is over.

        "Over" means a claim came back short (nothing more runnable), no job
        is running or waiting in the buffer, and every outcome is recorded.
        Meant for tests and tools that need to know the queue has been worked,
        without sleeping.
        """
        state = self.state
        target = self.stats.drains_started + 1
        if self._wake():  # the drain under way answers it (begun or re-armed by it)
            target = self.stats.drains_started
        while not (self.stats.drains_completed >= target
                   and all(lane.state.idle() for lane in self.lanes) and state.idle()):
            if state.stopping.is_set():
                raise RuntimeError("the worker is stopping; no further drain will run")
            await state.changed.park()

    async def wait_for(self, condition: Callable[[WorkerStats], bool]) -> None:
        """
        Wait until `condition(worker.stats)` holds; checked whenever the stats change.

        A test signal in the manner of River's: wait on what the worker did (say
        ``lambda s: s.done >= 3``) instead of sleeping and hoping.
        """
        while not condition(self.stats):
            await self.state.changed.park()

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
        state = self.state
        if not (await self.heartbeat.register() and await self._startup_recovery()):
            task_status.started()  # stopped before the database ever answered
            log.info("worker stopped before it started")
            return
        self.queue._add_waker(self.wake)
        try:
            async with trio.open_nursery() as timers:
                await timers.start(self.heartbeat.run)
                timers.start_soon(partial(self.sweeper.run, then=self.pruner.run_once))
                timers.start_soon(self.rescuer.run)
                if self.scheduler is not None:
                    await timers.start(self.scheduler.run)
                channel = self.config.notify_channel
                if self.config.listen and channel is not None:
                    listener = Listener(self.queue.db, channel, state, self.wake)
                    await timers.start(listener.run)
                async with trio.open_nursery() as work:
                    for lane in self.lanes:
                        lane.start(work)
                    task_status.started()
                    log.info("worker started (kinds: %s; lanes: %s)",
                             ", ".join(sorted(self.executors)),
                             ", ".join(f"{lane.name}={lane.state.config.concurrency}"
                                       for lane in self.lanes))
                    try:
                        await self._drain_loop()
                    finally:
                        for lane in self.lanes:
                            lane.state.close()
                # Every slot has returned and the producer has had their outcomes
                # recorded; the timers have nothing left to guard.
                timers.cancel_scope.cancel()
        finally:
            self.queue._remove_waker(self.wake)
            state.stopping.set()
            await self._deregister()
            state.notify()
        log.info("worker stopped")

    async def _deregister(self) -> None:
        """Remove the worker's row and release its leadership (shielded, bounded)."""
        with trio.CancelScope(shield=True):
            try:
                await self._store.deregister_worker()
            except Exception as exc:
                log.warning("could not deregister the worker (%s); its row expires and "
                            "the leader gives back anything it held", one_line(exc))

    async def _drain_loop(self) -> None:
        stopping = self.state.stopping
        try:
            while True:
                await self._drain()
                if stopping.is_set():
                    return
                # The poll, or sooner when a lane's next scheduled job is due.
                wake_at = min([trio.current_time() + self.config.poll_interval,
                               *(lane.state.next_due for lane in self.lanes)])
                self._idle = True  # a wake now begins the next drain itself
                try:
                    with trio.move_on_at(wake_at):
                        try:
                            await self._wake_recv.receive()
                        except trio.EndOfChannel:
                            return
                finally:
                    self._idle = False
                # Wakes that arrived during the drain are all answered by the next one.
                while True:
                    try:
                        self._wake_recv.receive_nowait()
                    except trio.WouldBlock:
                        break
                    except trio.EndOfChannel:
                        return
                if stopping.is_set():
                    return
                self.state.woken = False  # the drain below answers every wake so far
        finally:
            if self._drain_begun:  # begun by a wake just before the stop
                self._drain_begun = False
                self._end_drain()

    def _begin_drain(self) -> None:
        """Begin a drain in every lane (their producers claim on their next pass)."""
        self._idle = False
        self._drain_begun = True
        self.stats.drains_started += 1
        for lane in self.lanes:
            lane.state.begin_drain()

    def _end_drain(self) -> None:
        for lane in self.lanes:
            lane.state.end_drain()
        self.stats.drains_completed += 1
        self.state.notify()

    async def _drain(self) -> None:
        """Have every lane's producer claim until a claim comes back short (or fails)."""
        if not self._drain_begun:  # else a wake began it already (`wake`)
            self._begin_drain()
        self._drain_begun = False
        try:
            if not self.state.stopping.is_set():
                for lane in self.lanes:
                    await lane.state.drain_ended.wait()
                for lane in self.lanes:
                    await lane.refresh_due()
        finally:
            self._end_drain()

    async def _startup_recovery(self) -> bool:
        """
        The sweep before `started()` (docs/rules.md §5), retried with backoff
        while the database is away; False if `stop()` came first.

        Only an outage is waited for. An error the database gives on its merits
        (a bug, a table it refuses) is logged and the worker starts anyway: the
        sweep runs again at every recovery tick, and one bad row must never keep
        every replica from starting.
        """
        delay = self.config.retry_initial_delay
        stopping = self.state.stopping
        while True:
            try:
                await self.sweeper.run_once()
                return True
            except Exception as exc:
                if not is_transient(exc):
                    log.error("startup recovery failed (%s); starting anyway, the next "
                              "recovery tick tries again", one_line(exc), exc_info=exc)
                    return True
                log.warning("startup recovery failed (%s); retrying in %.2fs",
                            one_line(exc), delay)
            with trio.move_on_after(delay):
                await stopping.wait()
            if stopping.is_set():
                return False
            delay = min(delay * 2, self.config.retry_max_delay)
