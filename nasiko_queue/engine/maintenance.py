"""
Maintenance services: the work on the queue as a whole, not on one job.

Each service is a small object with its configuration, a `run_once()` that does
one round and returns what it did (tests call it directly), and a `run()` loop
that the worker starts in its nursery:

* `StuckJobSweeper` — the recovery sweep of docs/rules.md §7: jobs stuck
  `in_progress` past `stuck_job_mins` go back to pending, or fail and terminalize
  when out of attempts; plain jobs `running` past it that no live worker holds
  go back to available, or are discarded on their last attempt (cancelled if
  asked). Every `recovery_interval`, the first one period after
  start, missed ticks skipped, never replayed.
* `Pruner` — retention: deletes finished jobs older than `QueueConfig.retention`,
  after each sweep.
* `JobRescuer` — the rescue of dead workers' jobs: every `rescue_interval`,
  workers whose heartbeat is older than their lease are declared dead, and their
  jobs go back to pending (attempt counted) or, out of attempts, fail and
  terminalize: the stuck sweep's transition, reached in seconds.

All of them run on the maintenance leader only (`WorkerState.is_leader`): one
replica at a time sweeps, rescues and prunes, whatever the number of replicas.
The startup sweep is the exception (every worker runs it before it starts, as
docs/rules.md §5 says; it is safe from many replicas at once).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Awaitable, Callable
from datetime import timedelta

import attrs
import trio

from ..admin.retention import prune
from ..config import QueueConfig
from ..db.database import Database
from .contracts import JobStore, RecoveryResult, RescueResult
from .retry import one_line
from .state import WorkerState, WorkerStats

log = logging.getLogger("nasiko_queue.worker")


@attrs.frozen(kw_only=True)
class SweeperConfig:
    """When the stuck-job sweep runs."""

    #: Seconds between sweeps; the first comes one period after start.
    interval: float

    @classmethod
    def of(cls, config: QueueConfig) -> SweeperConfig:
        return cls(interval=config.recovery_interval)


class StuckJobSweeper:
    """
    The recovery sweep (the 60-minute rule), on a timer.

    Args:
        config: its period.
        store: runs the sweep's statements (`JobStore.recover`).
        stats: counts the sweeps (`recoveries`).
        on_swept: called after each sweep that succeeded: the sweep is one of the
            worker's three signals, so this wakes a drain for what it freed.
    """

    def __init__(self, config: SweeperConfig, store: JobStore, stats: WorkerStats,
                 on_swept: Callable[[], None],
                 leading: Callable[[], bool] = lambda: True) -> None:
        self.config = config
        self.store = store
        self.stats = stats
        self.on_swept = on_swept
        self.leading = leading

    async def run_once(self) -> RecoveryResult:
        result = await self.store.recover()
        self.stats.recoveries += 1
        return result

    async def run(self, *, then: Callable[[], Awaitable[object]] | None = None) -> None:
        """
        Sweep every period until cancelled, while leading; a failed sweep is
        logged, not fatal. `then` runs after every tick swept or not (the pruner).
        """
        period = self.config.interval
        next_tick = trio.current_time() + period
        while True:
            await trio.sleep_until(next_tick)
            if self.leading():
                try:
                    await self.run_once()
                except Exception:
                    log.exception("recovery sweep failed; next one in %.0fs", period)
                else:
                    self.on_swept()
                if then is not None:
                    await then()
            now = trio.current_time()
            next_tick += period
            if next_tick <= now:  # the sweep overran: skip, never replay, missed ticks
                next_tick += math.ceil((now - next_tick) / period) * period
                if next_tick <= now:
                    next_tick += period


class Pruner:
    """
    Retention: delete done and failed jobs completed longer ago than `older_than`.

    Args:
        db: where to delete.
        older_than: `QueueConfig.retention`; None: nothing to do.
        stats: counts what went (`pruned`).
    """

    def __init__(self, db: Database, older_than: timedelta | None, stats: WorkerStats) -> None:
        self.db = db
        self.older_than = older_than
        self.stats = stats

    async def run_once(self) -> int:
        """Prune once; return how many jobs went. A failure is logged (next tick tries)."""
        if self.older_than is None:
            return 0
        try:
            pruned = await prune(self.db, self.older_than)
        except Exception as exc:
            log.warning("retention prune failed (%s); next try at the next tick", one_line(exc))
            return 0
        self.stats.pruned += pruned
        return pruned


@attrs.frozen(kw_only=True)
class RescuerConfig:
    """When the rescue runs."""

    #: Seconds between rounds.
    interval: float

    @classmethod
    def of(cls, config: QueueConfig) -> RescuerConfig:
        return cls(interval=config.rescue_interval)


class JobRescuer:
    """
    Gives back the jobs of workers that stopped heartbeating, on the leader.

    Args:
        config: its period.
        store: `JobStore.rescue`.
        state: whether this worker leads (`is_leader`), and the counters.
        on_rescued: called when jobs went back to pending (wakes a drain here;
            the statement NOTIFYs the other replicas).
    """

    def __init__(self, config: RescuerConfig, store: JobStore, state: WorkerState,
                 on_rescued: Callable[[], None]) -> None:
        self.config = config
        self.store = store
        self.state = state
        self.on_rescued = on_rescued
        self._kicked = trio.Event()

    def kick(self) -> None:
        """Run a round now (this worker was just elected: a dead leader's jobs wait)."""
        self._kicked.set()

    async def run_once(self) -> RescueResult:
        result = await self.store.rescue()
        stats = self.state.stats
        stats.rescues += 1
        stats.rescued += result.rescued + result.failed
        if result.rescued:
            self.on_rescued()
        return result

    async def run(self) -> None:
        """
        A round every period while leading, and one as soon as this worker is
        elected (else the first round after a fail-over would come up to a
        period late), until cancelled; failures are logged.
        """
        period = self.config.interval
        while True:
            with trio.move_on_after(period):
                await self._kicked.wait()
            self._kicked = trio.Event()
            if not self.state.is_leader():
                continue
            try:
                await self.run_once()
            except Exception as exc:
                log.warning("rescue failed (%s); next round in %.0fs", one_line(exc), period)
