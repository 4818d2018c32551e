"""
The worker: a supervisor whose nursery turns wake-ups into drains.

Shape (docs/rules.md §5, §8)::

    run()
      register the worker's row, the startup sweep (both retried while the
      database is away), then started()
      nursery "timers": the `HeartbeatService` (renews the row every 3 s, holds
                        the maintenance leadership, fences the worker when cut
                        off; shielded, so that a hard stop keeps the lease
                        until the last executor has returned), the recovery
                        timer (`StuckJobSweeper`: first tick one period after
                        start, missed ticks skipped; each tick also prunes,
                        `Pruner`), the `JobRescuer` (dead workers'
                        jobs back to pending), all three on the leader only, the
                        `Scheduler` (cron ticks, on every replica that has it:
                        the database decides who enqueues each tick), the
                        `TransitionService` when it runs workflows (applies the
                        transitions a step's end left due, a piece per
                        transaction, on a pooled connection: migration 0033),
                        and the `Listener` (LISTEN on a dedicated connection;
                        every notification is a wake, but a due transition's,
                        which kicks the service)
      nursery "work":   the wake relay (the wake channel's receive side,
                        capacity 64: wakes sent before the lanes run, and the
                        stop when its send side closes), and one `Lane` per
                        source of jobs: the build jobs (when it has build
                        executors), and each queue of plain jobs it runs.
                        Each lane has its drain loop (`Lane.run`: start a
                        drain, wait for it to end, read when its next
                        scheduled job is due, then wait for a wake, the poll
                        timeout (5 s, re-armed after every drain) or the next
                        due job; drain again), its `Producer` (claims into the
                        lane's local buffer, carrying the `Completer`'s queued
                        finishes on each statement; gives back what never
                        started; resolves lost claims) and its slots
                        (`Slots.run_slot`: each runs one job at a time, its
                        executor guarded in the slot's cancel scope, one
                        per streak of jobs, so that its exceptions, and those of any task it
                        starts, feed `reset_panicked_job`)

The lanes never wait for each other: a lane whose slots are all busy (a build of
30 minutes) is still draining while every other lane claims, runs and polls on
its own. What they share is the worker's: its connections, heartbeat, counters
and fence (`WorkerState`). A wake reaches every lane at once.

The fence is one, worker-wide: when the worker loses its lease, every running
executor is cancelled, every buffer emptied, and `fence_epoch` moves on; a claim
sent before it and answered after gives its jobs back (attempts restored)
instead of buffering them, and a slot that was about to start a job gives it
back too. After the fence no job starts until the worker is registered anew,
and a lane claims no look-ahead until the runs the fence stopped in it have
ended (`LaneState.fence_settling`): their jobs go back first in line, and keep it.

A drain claims jobs until a claim comes back short, never more at once than a
lane's slots and prefetch buffer have room for (for the build lane
`QueueConfig.concurrency`, 1 as in the original, plus `QueueConfig.prefetch`, 0
as in the original; for a queue, its own concurrency from `QueueConfig.queues`,
plus its look-ahead, adaptive by default: `engine.lookahead`).

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
from collections.abc import Callable, Collection, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any
from uuid import UUID

import attrs
import trio

from ..builds.executor import JobExecutor
from ..builds.payloads import BUILTIN_PAYLOAD_TYPES, AnyPayload, PayloadCodec
from ..builds.store import PgJobStore
from ..config import QueueConfig
from ..errors import is_transient
from ..executors import Executors
from ..plain.executor import PlainJobExecutor
from ..plain.schedules import Schedule, Scheduler, SchedulerConfig
from ..plain.store import PlainJobStore
from ..queue import Queue
from .completer import Completer
from .contracts import JobStore, LaneStore
from .heartbeat import HeartbeatService
from .lane import Lane
from .listener import TRANSITION_PAYLOAD, Listener, payload_queue
from .maintenance import JobRescuer, Pruner, RescuerConfig, StuckJobSweeper, SweeperConfig
from .producer import Producer
from .retry import RetryPolicy, one_line
from .slots import Slots
from .state import LaneState, WorkerState, WorkerStats

if TYPE_CHECKING:
    from ..workflows.transitions import TransitionService

#: The kinds of the queue's own plain job types (a workflow's signal timer and
#: cron start): their queues are served even when `QueueConfig.queues` omits them.
OWN_KIND_PREFIX = "nasiko_queue."

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
            builds = attrs.evolve(self.config, prefetch=self.config.lane_prefetch(builds=True))
            self.lanes.append(self._lane("builds", LaneState(builds, self.state),
                                         self._store, JobExecutor))
        for name, concurrency in self._queues():
            lane_state = LaneState(attrs.evolve(
                self.config, concurrency=concurrency,
                prefetch=self.config.lane_prefetch(builds=False)), self.state)
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
                                          on_fence=self.fence, on_resume=self._resume,
                                          on_elected=self.rescuer.kick,
                                          on_cancels=self._cancel_running,
                                          queues=self._served(),
                                          dsn=None if queue.db is None else queue.db.config.dsn)
        self.sweeper = StuckJobSweeper(SweeperConfig.of(self.config), self._store,
                                       self.stats, on_swept=self.wake,
                                       leading=self.state.is_leader)
        self.pruner = Pruner(queue.db, self.config.retention, self.stats)
        #: Enqueues the cron schedules' ticks; None without schedules or with
        #: `QueueConfig.scheduler` off.
        self.scheduler: Scheduler | None = None
        if schedules and self.config.scheduler:
            self.scheduler = Scheduler(queue, schedules, SchedulerConfig.of(self.config))
        #: Applies the workflow transitions a step's end left due (migration
        #: 0033); None unless this worker runs workflows.
        self.transitions: TransitionService | None = None
        if executors.workflows:
            from ..workflows.transitions import TransitionConfig, TransitionService

            self.transitions = TransitionService(queue.db, TransitionConfig.of(self.config))
        self._started = False
        #: The lanes run: a wake goes to them directly, not through the channel.
        self._lanes_running = False

    def _worker_id(self) -> UUID | None:
        worker_id: UUID | None = getattr(self._store, "worker_id", None)
        return worker_id

    def _served(self) -> tuple[tuple[str, int], ...]:
        """Every queue its lanes serve ("builds" too), with its concurrency."""
        return tuple((lane.name, lane.state.config.concurrency) for lane in self.lanes)

    def _queues(self) -> tuple[tuple[str, int], ...]:
        """
        The plain queues this worker runs: configured, or those its types name.

        Configured, they include the queues of the queue's own job types this
        worker registered (kinds ``nasiko_queue.*``: a workflow's signal timers
        and cron starts, queue "workflows"), `concurrency` each, unless named:
        a worker that runs workflows under ``queues={"agents": 4}`` would
        otherwise never fire a signal's timeout nor start a scheduled run.
        """
        if self.config.queues is None:
            names = sorted({t.options.queue for t in self.executors.plain_types})
            return tuple((name, self.config.concurrency) for name in names)
        queues = dict(self.config.queues)
        for own in self.executors.plain_types:
            if own.kind.startswith(OWN_KIND_PREFIX):
                queues.setdefault(own.options.queue, self.config.concurrency)
        return tuple(sorted(queues.items()))

    def _lane(self, name: str, state: LaneState, store: LaneStore,
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
            lane.state.kick()
        self.wake()

    def fence(self, _why: str) -> None:
        """
        The worker lost its lease (the heartbeat calls this): stop every running
        job, take what is buffered out of the slots' reach, claim nothing until
        registered anew. The producer gives the buffered jobs back at once,
        attempts restored, as it does a claim answered after the fence (its
        write names each job's claim, so a job the leader rescued meanwhile is
        left as it is); if the database cannot be reached, the leader's rescue
        gives them back with the rest. Claims in flight now are answered under
        an older `fence_epoch`: their jobs go back instead of into a buffer
        (`Producer`).
        """
        state = self.state
        state.fenced = True  # the heartbeat's fence sets it first; a caller's may not
        state.fence_epoch += 1
        for scope in state.job_scopes.values():
            scope.cancel()
        for lane in self.lanes:
            lane_state = lane.state
            dropped = len(lane_state.buffer)
            lane_state.fenced_out.extend(job for job, _ in lane_state.buffer)
            lane_state.buffer.clear()
            state.stats.buffered -= dropped
            # Its stopped runs go back first: no look-ahead until they have ended.
            lane_state.fence_settling = lane_state.running
            lane_state.end_drain()
            lane_state.kick()
        state.notify()

    def _cancel_running(self, ids: tuple[UUID, ...]) -> None:
        """
        The heartbeat found cancel requests for plain jobs this worker holds:
        stop their executors; their runs end `cancelled`. A job still in a
        lane's buffer is marked too, and ends `cancelled` without starting.
        """
        wanted = set(ids)
        state = self.state
        for claim, scope in state.job_scopes.items():
            if claim[0] in wanted and claim not in state.cancels:
                state.cancels.add(claim)
                scope.cancel()
        for lane in self.lanes:
            for job, _claimed_at in lane.state.buffer:
                if job.id in wanted:
                    state.cancels.add(job.claim)

    # -- signals -----------------------------------------------------------

    def wake(self) -> None:
        """
        Ask every lane for a drain. Never blocks: a wake that does not fit is dropped.

        The wake is on the path from an enqueue (a NOTIFY on the listener, or an
        in-process enqueue) to its job's start, so once the lanes run it goes to
        each directly (`Lane.wake`: it begins the lane's drain if the lane
        waits, or re-arms the drain under way). Before they run it goes into
        the wake channel (capacity 64; a wake that does not fit is dropped: a
        drain is coming anyway), whose relay hands it on once they do.
        """
        self._wake()

    def _on_notify(self, payload: str) -> None:
        """
        A notification: a wake of every lane, or, when it names a queue
        (`listener.payload_queue`: a job of it falls due later), of that
        queue's lane alone, which drains and then reads when its next job is
        due. One this worker does not serve wakes nothing, and neither does a
        due workflow transition's (`TRANSITION_PAYLOAD`, which comes here only
        when this worker runs no transition service): the service that applies
        it enqueues the steps, and those enqueues wake their lanes.
        """
        if payload == TRANSITION_PAYLOAD:
            return
        queue = payload_queue(payload)
        if queue is None or not self._lanes_running:
            self.wake()
            return
        for lane in self.lanes:
            if lane.name == queue:
                lane.wake()

    def _wake(self) -> list[bool]:
        """`wake`; for each lane, True when a drain under way answers it."""
        if self._lanes_running:
            return [lane.wake() for lane in self.lanes]
        with contextlib.suppress(trio.WouldBlock, trio.ClosedResourceError,
                                 trio.BrokenResourceError):
            self._wake_send.send_nowait(None)
        return [False] * len(self.lanes)

    @property
    def wakes_pending(self) -> int:
        """Wakes waiting in the channel (at most `wake_capacity`)."""
        return self._wake_send.statistics().current_buffer_used

    async def _relay_wakes(self) -> None:
        """The wake channel's receive side: hand each wake to the lanes; the end
        of the channel (every send side closed) stops the worker."""
        async with self._wake_recv:
            async for _wake in self._wake_recv:
                for lane in self.lanes:
                    lane.wake()
        self.stop()

    def stop(self) -> None:
        """Graceful stop: claim nothing more, let running executors finish, return."""
        self.state.stopping.set()
        self._wake_send.close()
        for lane in self.lanes:
            lane.state.end_drain()
            lane.state.wake_event.set()
            lane.state.kick()

    def idle(self) -> bool:
        """No lane holds, runs or is about to claim anything."""
        return all(lane.state.idle() for lane in self.lanes)

    async def drain_once(self, *, lanes: Collection[str] | None = None) -> None:
        """
        Wake the worker and wait until, in every lane (or in the lanes named:
        "builds", or a queue's name), a drain that began after this call (or
        that this call's wake re-armed) is over.

        "Over" means a claim came back short (nothing more runnable), no job
        is running or waiting in the lane's buffer, and every outcome is
        recorded. Meant for tests and tools that need to know the queue has
        been worked, without sleeping. A lane whose slots are all busy is
        draining until one frees: name the other lanes to wait for them alone.

        A worker that runs workflows also applies, before and after, the
        workflow transitions due that its service can take (migration 0033: a
        step's end whose run's row was busy, a fan-out's further pieces), so
        that the steps they enqueue are there when this returns.
        """
        transitions = self.transitions
        if transitions is not None:
            await transitions.drain()
        state = self.state
        answered = self._wake()
        unknown = set(lanes or ()) - {lane.name for lane in self.lanes}
        if unknown:
            raise ValueError(f"this worker has no lane {sorted(unknown)}")
        # Per lane: the drain that answers (begun or re-armed by this wake), else
        # the next one.
        targets = [(lane, lane.state.drains_started + (0 if ok else 1))
                   for lane, ok in zip(self.lanes, answered, strict=True)
                   if lanes is None or lane.name in lanes]
        while not all(lane.state.drains_completed >= target and lane.state.idle()
                      for lane, target in targets):
            if state.stopping.is_set():
                raise RuntimeError("the worker is stopping; no further drain will run")
            await state.changed.park()
        if transitions is not None:
            await transitions.drain()

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
        # The heartbeat outlives a hard stop's cancellation until the last
        # executor has returned: one that shields itself still runs, and a lease
        # left to lapse would let the rescue run its job again elsewhere at once.
        heartbeat = trio.CancelScope(shield=True)
        try:
            async with trio.open_nursery() as timers:
                await timers.start(self._heartbeat, heartbeat)
                timers.start_soon(partial(self.sweeper.run, then=self.pruner.run_once))
                timers.start_soon(self.rescuer.run)
                if self.scheduler is not None:
                    await timers.start(self.scheduler.run)
                transitions = self.transitions
                if transitions is not None:
                    await timers.start(transitions.run)
                channel = self.config.notify_channel
                if self.config.listen and channel is not None:
                    listener = Listener(self.queue.db, channel, state, self.wake,
                                        self._on_notify,
                                        on_transition=None if transitions is None
                                        else transitions.kick)
                    await timers.start(listener.run)
                try:
                    async with trio.open_nursery() as work:
                        work.start_soon(self._relay_wakes, name="wake relay")
                        for lane in self.lanes:
                            lane.start(work)
                        self._lanes_running = True
                        task_status.started()
                        log.info("worker started (kinds: %s; lanes: %s)",
                                 ", ".join(sorted(self.executors)),
                                 ", ".join(f"{lane.name}={lane.state.config.concurrency}"
                                           for lane in self.lanes))
                finally:
                    self._lanes_running = False
                    heartbeat.cancel()
                # Every slot has returned and the producer has had their outcomes
                # recorded; the timers have nothing left to guard.
                timers.cancel_scope.cancel()
        finally:
            self.queue._remove_waker(self.wake)
            state.stopping.set()
            await self._deregister()
            state.notify()
        log.info("worker stopped")

    async def _heartbeat(self, scope: trio.CancelScope, *,
                         task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        with scope:
            await self.heartbeat.run(task_status=task_status)

    async def _deregister(self) -> None:
        """Remove the worker's row and release its leadership (shielded, bounded)."""
        with trio.CancelScope(shield=True):
            try:
                await self._store.deregister_worker()
            except Exception as exc:
                log.warning("could not deregister the worker (%s); its row expires and "
                            "the leader gives back anything it held", one_line(exc))

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
