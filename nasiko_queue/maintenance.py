"""
Maintenance services: the work on the queue as a whole, not on one job.

Each service is a small object with its configuration, a `run_once()` that does
one round and returns what it did (tests call it directly), and a `run()` loop
that the worker starts in its nursery:

* `StuckJobSweeper` — the recovery sweep of docs/rules.md §7: jobs stuck
  `in_progress` past `stuck_job_mins` go back to pending, or fail and terminalize
  when out of attempts. Every `recovery_interval`, the first one period after
  start, missed ticks skipped, never replayed.
* `Pruner` — retention: deletes finished jobs older than `QueueConfig.retention`,
  after each sweep.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Awaitable, Callable
from datetime import timedelta

import attrs
import trio

from .config import QueueConfig
from .database import Database
from .jobs import JobStore, RecoveryResult
from .retention import prune
from .retry import one_line
from .state import WorkerStats

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
                 on_swept: Callable[[], None]) -> None:
        self.config = config
        self.store = store
        self.stats = stats
        self.on_swept = on_swept

    async def run_once(self) -> RecoveryResult:
        result = await self.store.recover()
        self.stats.recoveries += 1
        return result

    async def run(self, *, then: Callable[[], Awaitable[object]] | None = None) -> None:
        """
        Sweep every period until cancelled; a failed sweep is logged, not fatal.
        `then` runs after every tick, swept or not (the pruner).
        """
        period = self.config.interval
        next_tick = trio.current_time() + period
        while True:
            await trio.sleep_until(next_tick)
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
