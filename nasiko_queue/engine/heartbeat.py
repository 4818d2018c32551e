"""
The heartbeat: a worker is a row, kept alive, and fenced when it cannot be.

A worker registers a row in `nasiko_queue_workers` (id, host, pid, the kinds it
claims, its lease) before it claims anything, and every claim names it
(`build_jobs.claimed_by`). Every `heartbeat_interval` (3 s) it renews the row's
`heartbeat_at`, on a pool of its own so that no amount of work starves it, and,
in the same statement, holds or takes the maintenance leadership: one row per
role in `nasiko_queue_leaders`, held while renewed before it expires (`lease`,
15 s), taken by the first heartbeat after it has expired. The leader runs the
rescue, the stuck sweep and retention (`maintenance`).

A worker whose heartbeat is older than its lease is presumed dead: the leader
gives its jobs back. Two things keep that from running a job twice:

* **the fence.** A worker that could not renew its heartbeat for
  `lease - heartbeat_interval` (12 s) — the database unreachable, the network
  cut — stops its own jobs (their executors are cancelled, their results never
  written) and gives back its buffer, one interval before anyone may take them. When
  the database answers again, it retires that identity (declares it dead: the
  leader gives its jobs back) and registers anew. A heartbeat that finds its row
  declared dead (a pause longer than the lease: SIGSTOP, a VM frozen) does the
  same at once;
* **the claim token.** Every write to a claimed job names the claim (id,
  attempt, in progress): once the job was given back, a late write from the old
  run changes nothing.
"""

from __future__ import annotations

import logging
import math
import os
import socket
import time
import uuid
from collections.abc import Callable
from uuid import UUID

import trio

from ..config import QueueConfig
from ..errors import is_transient
from .contracts import MAINTENANCE_ROLE, JobStore, WorkerIdentity
from .loop_watch import LoopWatch
from .retry import one_line
from .state import WorkerState

log = logging.getLogger("nasiko_queue.worker")


class HeartbeatService:
    """
    Registers the worker, heartbeats it, holds the leadership, fences it.

    Args:
        state: the shared state (`leader_until`, `fenced`, the counters).
        store: the database operations.
        kinds: the kinds the worker claims, for its row.
        on_fence: stops the worker's running jobs and gives back its buffer.
        on_resume: called once the worker has registered anew after a fence.
        on_elected: called when the worker takes the leadership.
        on_cancels: called with the plain jobs the worker runs whose cancel was
            asked for, after every heartbeat that found some.
        queues: the queues the worker serves with their concurrency, for its row.
        dsn: the database, for the loop watch (`loop_watch`), which renews the
            lease from a thread while the event loop is blocked; None: no watch.
    """

    def __init__(self, state: WorkerState, store: JobStore, kinds: tuple[str, ...],
                 on_fence: Callable[[str], None], on_resume: Callable[[], None],
                 on_elected: Callable[[], None] = lambda: None,
                 on_cancels: Callable[[tuple[UUID, ...]], None] = lambda _ids: None,
                 queues: tuple[tuple[str, int], ...] = (), dsn: str | None = None) -> None:
        self.state = state
        self.store = store
        self.kinds = kinds
        self.queues = queues
        self.on_fence = on_fence
        self.on_resume = on_resume
        self.on_elected = on_elected
        self.on_cancels = on_cancels
        self.config: QueueConfig = state.config
        self.role = MAINTENANCE_ROLE if self.config.maintenance else None
        #: The worker's current identity (a new one after each fence).
        self.identity: WorkerIdentity | None = None
        # Trio time by which a heartbeat must have landed, or the worker fences.
        self._fence = trio.CancelScope()
        self._was_leader = False
        self._landed_at: float | None = None
        #: Renews the lease from a thread while the loop is blocked (needs `dsn`).
        self.watch = None if dsn is None else LoopWatch(
            dsn, self._live_identity, self.config.heartbeat_interval)

    def _live_identity(self) -> UUID | None:
        identity = self.identity
        return None if identity is None or self.state.fenced else identity.id

    @property
    def fence_after(self) -> float:
        """Seconds without a heartbeat after which the worker stops its own jobs."""
        return self.config.lease - self.config.heartbeat_interval

    async def register(self) -> bool:
        """
        Register a new identity, retried with backoff while the database is away;
        False if the worker was stopped first. An error on the merits (no such
        table: an unmigrated database) is raised.
        """
        delay = self.config.retry_initial_delay
        stopping = self.state.stopping
        while True:
            identity = WorkerIdentity(id=uuid.uuid4(), host=socket.gethostname(),
                                      pid=os.getpid(), kinds=self.kinds,
                                      queues=self.queues)
            sent = trio.current_time()
            try:
                await self.store.register_worker(identity)
            except Exception as exc:
                if not is_transient(exc):
                    raise
                log.warning("could not register the worker (%s); retrying in %.2fs",
                            one_line(exc), delay)
            else:
                self.identity = identity
                self.state.stats.registrations += 1
                self._renewed(sent)
                log.info("worker %s registered (%s, pid %d)", identity.id, identity.host,
                         identity.pid)
                return True
            with trio.move_on_after(delay):
                await stopping.wait()
            if stopping.is_set():
                return False
            delay = min(delay * 2, self.config.retry_max_delay)

    @property
    def landed_at(self) -> float | None:
        """Trio time at which the last heartbeat (or registration) that landed was
        sent; None before the first. For health checks: fresh while within the lease."""
        return self._landed_at

    def _renewed(self, sent: float) -> None:
        """A heartbeat (or the registration) sent at `sent` landed."""
        self._landed_at = sent
        self._fence.deadline = sent + self.fence_after

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Heartbeat until cancelled; fence the worker when heartbeats stop landing."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._watch)
            if self.watch is not None:
                await nursery.start(self.watch.run)
            task_status.started()
            interval = self.config.heartbeat_interval
            while True:
                sent = trio.current_time()
                await self.beat_once(sent)
                await trio.sleep_until(sent + interval)

    async def beat_once(self, sent: float | None = None) -> None:
        """One heartbeat: renew the row and the leadership, or learn the worker is dead."""
        state = self.state
        sent = trio.current_time() if sent is None else sent
        try:
            beat = await self.store.heartbeat(self.role)
        except Exception as exc:
            state.stats.heartbeat_failures += 1
            if state.stats.heartbeat_failures == 1 or not state.fenced:
                log.warning("heartbeat failed (%s); the worker stops its jobs if none lands "
                            "within %.0fs of the last", one_line(exc), self.fence_after)
            return
        state.stats.heartbeats += 1
        if not beat.alive:
            # Declared dead (a pause longer than the lease): its jobs are being given
            # back. Stop them now, never write their results, and start afresh.
            self._fenced("the worker was declared dead (a pause longer than its lease)")
            await self._resume(retire=False)
            return
        if state.fenced:
            # The database answers again before anyone declared us dead: retire this
            # identity ourselves (the leader gives back what it held), start afresh.
            await self._resume(retire=True)
            return
        self._renewed(sent)
        if beat.cancels:
            self.on_cancels(beat.cancels)
        if beat.leader:
            state.leader_until = sent + self.config.lease - self.config.heartbeat_interval
            if not self._was_leader:
                state.stats.elected += 1
                log.info("worker %s leads maintenance", self._me())
                self.on_elected()
        else:
            state.leader_until = -math.inf
        self._was_leader = beat.leader

    def _me(self) -> str:
        return str(self.identity.id) if self.identity else "?"

    async def _watch(self) -> None:
        """Fence the worker when no heartbeat has landed for `fence_after` seconds."""
        while True:
            with self._fence:
                await trio.sleep_forever()
            watch = self.watch
            if (not self.state.fenced and watch is not None and watch.renewed_at is not None
                    and watch.renewed_within(self.fence_after)):
                # The loop was blocked (an executor's blocking call) and the watch
                # kept the lease meanwhile: count from its last renewal.
                since = time.monotonic() - watch.renewed_at
                self._fence = trio.CancelScope(
                    deadline=trio.current_time() + self.fence_after - since)
                continue
            if not self.state.fenced:
                # After a pause (SIGSTOP, a frozen VM) this fires before the next
                # heartbeat's answer can say the worker was declared dead.
                self._fenced(f"no heartbeat landed for {self.fence_after:.0f}s (cut off from "
                             "the database, or this process was paused)")
            # Fenced: wait for `_resume` to re-arm the deadline.
            self._fence = trio.CancelScope(deadline=math.inf)

    def _fenced(self, why: str) -> None:
        state = self.state
        if state.fenced:
            return
        state.fenced = True
        state.leader_until = -math.inf
        self._was_leader = False
        state.stats.fenced += 1
        log.error("%s: stopping its %d running job(s) before their lease can end elsewhere; "
                  "their results are not written", why, len(state.job_scopes))
        self.on_fence(why)

    async def _resume(self, *, retire: bool) -> None:
        """After a fence: retire the old identity (if asked), register a new one."""
        if retire:
            try:
                await self.store.retire_worker()
            except Exception as exc:
                log.warning("could not retire the old identity (%s); it expires instead",
                            one_line(exc))
        if await self.register():
            self.state.fenced = False
            log.info("worker resumes as %s", self._me())
            self.on_resume()
