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
                        jobs back to pending), all three on the leader only, and
                        the `Listener` (LISTEN on a dedicated connection; every
                        notification is a wake)
      nursery "work":   the `Producer` (claims into the local buffer, carrying the
                        `Completer`'s queued finishes on each statement; gives
                        back what never started; resolves lost claims) and
                        `concurrency` slots (`JobExecutor.run_slot`: each runs one
                        job at a time, its executor in a child nursery whose
                        exceptions feed `reset_panicked_job`)
      the drain loop:   start a drain; wait for it to end; then wait for a wake
                        (the wake channel, capacity 64) or the poll timeout (5 s,
                        re-armed after every drain); coalesce the wakes that piled
                        up; drain again

A drain claims jobs until a claim comes back short, never more at once than the
slots and the prefetch buffer have room for (`QueueConfig.concurrency`, 1 as in
the original, plus `QueueConfig.prefetch`, 0 as in the original).

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
from collections.abc import Callable
from functools import partial

import trio

from .completer import Completer
from .config import QueueConfig
from .errors import is_transient
from .executors import Executors
from .heartbeat import HeartbeatService
from .job_executor import JobExecutor
from .jobs import ClaimOutcomeUnknown, JobStore, PgJobStore
from .listener import Listener
from .maintenance import (
    JobRescuer,
    Pruner,
    RescuerConfig,
    StuckJobSweeper,
    SweeperConfig,
)
from .payloads import BUILTIN_PAYLOAD_TYPES, PayloadCodec
from .producer import Producer
from .queue import Queue
from .retry import RetryPolicy, one_line
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
        self._store: JobStore = store or PgJobStore(
            queue.db,
            self.config,
            runnable_kinds=executors.kinds,
            known_kinds=frozenset(types) | self.config.other_kinds,
        )
        self._wake_send, self._wake_recv = trio.open_memory_channel[None](
            self.config.wake_capacity
        )
        self.state = WorkerState(self.config)
        self.stats: WorkerStats = self.state.stats
        retry = RetryPolicy(self.config)
        self.completer = Completer(self.state, self._store, retry,
                                   on_lost_claim=self._lost_claim)
        self.producer = Producer(self.state, self._store, self.completer, retry, self.wake)
        self.executor = JobExecutor(
            self.state, self._store, queue, executors,
            PayloadCodec(types=types.values(), secrets=queue.secrets),
            self.completer, retry, self.wake)
        self.rescuer = JobRescuer(RescuerConfig.of(self.config), self._store, self.state,
                                  on_rescued=self.wake)
        self.heartbeat = HeartbeatService(self.state, self._store,
                                          tuple(sorted(executors.kinds)),
                                          on_fence=self._fence, on_resume=self._resume,
                                          on_elected=self.rescuer.kick)
        self.sweeper = StuckJobSweeper(SweeperConfig.of(self.config), self._store,
                                       self.stats, on_swept=self.wake,
                                       leading=self.state.is_leader)
        self.pruner = Pruner(queue.db, self.config.retention, self.stats)
        self._started = False

    @property
    def is_leader(self) -> bool:
        """Whether this worker runs maintenance now (rescue, the stuck sweep, retention)."""
        return self.state.is_leader()

    def _resume(self) -> None:
        """Registered anew after a fence: claim again, at once."""
        self.state.kick()
        self.wake()

    def _fence(self, _why: str) -> None:
        """The worker lost its lease: stop every running job, drop what is buffered
        (the leader gives it back with the rest), claim nothing until registered anew."""
        state = self.state
        self.executor.fence()
        dropped = len(state.buffer)
        state.buffer.clear()
        state.stats.buffered -= dropped
        state.end_drain()
        state.kick()
        state.notify()

    def _lost_claim(self, exc: ClaimOutcomeUnknown) -> None:
        self.producer.lost(exc)

    # -- signals -----------------------------------------------------------

    def wake(self) -> None:
        """Ask for a drain. Never blocks: a wake that does not fit is dropped."""
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
        self.state.end_drain()
        self.state.kick()

    async def drain_once(self) -> None:
        """
        Wake the worker and wait until a drain that began after this call is over.

        "Over" means a claim came back short (nothing more runnable), no job
        is running or waiting in the buffer, and every outcome is recorded.
        Meant for tests and tools that need to know the queue has been worked,
        without sleeping.
        """
        state = self.state
        target = self.stats.drains_started + 1
        self.wake()
        while not (self.stats.drains_completed >= target and state.idle()):
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
                channel = self.config.notify_channel
                if self.config.listen and channel is not None:
                    listener = Listener(self.queue.db, channel, state, self.wake)
                    await timers.start(listener.run)
                async with trio.open_nursery() as work:
                    work.start_soon(self.producer.run, name="producer")
                    for n in range(self.config.concurrency):
                        work.start_soon(self.executor.run_slot, name=f"slot {n}")
                    task_status.started()
                    log.info("worker started (kinds: %s)", ", ".join(sorted(self.executors)))
                    try:
                        await self._drain_loop()
                    finally:
                        state.close()
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
        while True:
            await self._drain()
            if stopping.is_set():
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
            if stopping.is_set():
                return
            self.state.woken = False  # the drain below answers every wake so far

    async def _drain(self) -> None:
        """Have the producer claim until a claim comes back short (or fails)."""
        state = self.state
        state.begin_drain()
        try:
            if not state.stopping.is_set():
                await state.drain_ended.wait()
        finally:
            state.end_drain()
            self.stats.drains_completed += 1
            state.notify()

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
