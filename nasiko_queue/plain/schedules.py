"""
Cron schedules: periodic plain jobs, each tick enqueued once however many
replicas run the scheduler.

>>> nightly = Schedule("nightly-report", "0 3 * * *", SendReport(), timezone="Europe/Berlin")
>>> worker = Worker(queue, executors, schedules=[nightly])

A `Schedule` names a cron expression (five fields, or six with seconds first;
cronsim's dialect, the Debian cron rules for time zones), an IANA time zone and
the job to enqueue at each tick. The `Scheduler` runs in every worker whose
`QueueConfig.scheduler` is on (or standalone, in the application's nursery).

Exactly once: ``nasiko_queue_schedules`` holds each schedule's last tick. A
tick is enqueued by the one transaction that moves that row forward to it, and
the job is inserted in that same transaction, so a crash between the two
cannot lose or double a tick, and of several schedulers that see the same tick
(replicas started together, each waking on it) one moves the row and enqueues,
the others wait for its row lock, see the tick taken and do nothing.

Missed ticks: a schedule seen for the first time records its current tick and
enqueues nothing (no history is replayed). A tick is *on time* when the
scheduler reaches it within `SchedulerConfig.grace` seconds. One reached later
(every replica was down, or the database was) is a missed tick: with
`Schedule.catch_up` (the default) the most recent missed tick is enqueued once,
however many were missed; without it, missed ticks are skipped. The row keeps
the expression and zone its tick belongs to: after a deploy changes them, a
late tick is recorded as a first sight's is (it was not missed; it only came
before the change), and an on-time one is enqueued.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any
from uuid import UUID
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

import attrs
import trio
from cronsim import CronSim, CronSimError

from ..config import QueueConfig
from ..db.statements import Q
from ..engine.retry import one_line
from ..errors import ConfigurationError
from ..queue import Queue
from .args import JobArgs, JobOptions

__all__ = ["Schedule", "Scheduler", "SchedulerConfig", "SchedulerRound", "Tick"]

log = logging.getLogger("nasiko_queue.schedules")

#: Longest schedule name (the primary key of nasiko_queue_schedules).
MAX_NAME = 200
#: A reference time for checking an expression at construction.
_EPOCH = datetime(2000, 1, 1, tzinfo=UTC)


def _name(_inst: object, _attr: attrs.Attribute[str], value: str) -> None:
    if not isinstance(value, str) or not 0 < len(value) <= MAX_NAME:
        raise ConfigurationError(f"a schedule name is 1 to {MAX_NAME} characters, got {value!r}")


def _zone(_inst: object, _attr: attrs.Attribute[str], value: str) -> None:
    try:
        ZoneInfo(value)
    except (ZoneInfoNotFoundError, ValueError, TypeError) as exc:
        raise ConfigurationError(
            f"schedule time zone {value!r} is not an IANA time zone name (such as 'UTC' or "
            f"'Europe/Berlin'): {exc}") from None


def _cron(_inst: object, _attr: attrs.Attribute[str], value: str) -> None:
    if not isinstance(value, str):
        raise ConfigurationError(f"a cron expression is a string, got {value!r}")
    try:
        next(CronSim(value, _EPOCH))
    except (CronSimError, StopIteration) as exc:
        raise ConfigurationError(
            f"bad cron expression {value!r}: {exc or 'it never fires'} (five fields: minute "
            "hour day-of-month month day-of-week, or six with seconds first)") from None


def _job(_inst: object, _attr: attrs.Attribute[Any], value: Any) -> None:
    if not (isinstance(value, JobArgs) or callable(value)):
        raise ConfigurationError(f"a schedule's job is a JobArgs instance or a function "
                                 f"returning one, got {value!r}")


@attrs.frozen
class Schedule:
    """
    A plain job enqueued at every tick of a cron expression.

    Args:
        name: identifies the schedule across replicas and restarts (its row in
            nasiko_queue_schedules); renaming it starts it afresh.
        cron: ``"*/5 * * * *"``, or six fields with seconds first
            (``"*/10 * * * * *"``); cronsim's syntax (L, W, #, names).
        job: the job to enqueue, or a function of no arguments returning it
            (called at each tick, for fresh values).
        timezone: the IANA zone the expression is read in. Across a DST change
            a job at a fixed local time that falls in the skipped hour runs at
            the first minute after it, and one in the repeated hour runs once
            (the Debian cron rules).
        options: the queue, priority, attempts and uniqueness of its jobs,
            instead of the job type's `options`.
        catch_up: on start-up, or after an outage, enqueue the most recent tick
            missed meanwhile (once, not every missed one); False skips them.

    Raises:
        ConfigurationError: a bad expression, an unknown time zone, a bad name.
    """

    name: str = attrs.field(validator=_name)
    cron: str = attrs.field(validator=_cron)
    job: JobArgs | Callable[[], JobArgs] = attrs.field(validator=_job)
    timezone: str = attrs.field(default="UTC", validator=_zone, kw_only=True)
    options: JobOptions | None = attrs.field(default=None, kw_only=True)
    catch_up: bool = attrs.field(default=True, kw_only=True)

    @property
    def zone(self) -> ZoneInfo:
        return ZoneInfo(self.timezone)

    def next_tick(self, after: datetime) -> datetime:
        """The first tick strictly after `after` (aware), in UTC."""
        local = _aware(after).astimezone(self.zone)
        return next(CronSim(self.cron, local)).astimezone(UTC)

    def ticks(self, after: datetime, count: int) -> list[datetime]:
        """The next `count` ticks strictly after `after`, in UTC."""
        out: list[datetime] = []
        at = after
        for _ in range(count):
            at = self.next_tick(at)
            out.append(at)
        return out

    def last_tick(self, at: datetime) -> datetime | None:
        """The latest tick at or before `at` (aware), in UTC; None if there is none."""
        found = self._latest(at)
        if found is None:
            return None
        # The ticks are the forward walk's chain, each from the one before. The
        # reverse walk may yield a time that chain skips (at Lord Howe's 30-minute
        # change, 02:00+10:30 of "0 */2 * * *": the chain goes 00:00+11, then
        # 04:00+10:30): such a tick would be enqueued only if a round happened to
        # fall after it, and replicas could disagree. Step back to the chain.
        before = self._latest(found - timedelta(seconds=1))
        if before is not None and self.next_tick(before) != found:
            found = before
            while (following := self.next_tick(found)) <= at:
                found = following
        return found

    def _latest(self, at: datetime) -> datetime | None:
        """`last_tick` without the chain's check: the reverse walk, corrected by the
        forward walk from the time it yields."""
        at = _aware(at)
        local = at.astimezone(self.zone)
        # cronsim's reverse walk yields ticks strictly before a whole second,
        # and counts the whole second itself when given a fraction past it.
        probe = local if local.microsecond else local + timedelta(microseconds=1)
        try:
            found = next(CronSim(self.cron, probe, reverse=True)).astimezone(UTC)
        except StopIteration:
            return None
        # The forward walk is the reference (it owns the DST rules): step to the
        # last forward tick not after `at`.
        while found > at:
            earlier = self._latest(found - timedelta(seconds=1))
            if earlier is None:
                return None
            found = earlier
        while (following := self.next_tick(found)) <= at:
            found = following
        return found

    def make_job(self) -> JobArgs:
        """The job of one tick."""
        job = self.job if isinstance(self.job, JobArgs) else self.job()
        if not isinstance(job, JobArgs):
            raise TypeError(f"schedule {self.name!r}: its job function returned {job!r}, "
                            "not a JobArgs instance")
        return job


def _aware(at: datetime) -> datetime:
    if at.tzinfo is None:
        raise ValueError(f"an aware datetime is needed (with a tzinfo), got {at!r}")
    return at


@attrs.frozen(kw_only=True)
class SchedulerConfig:
    """How the scheduler treats late ticks and database failures."""

    #: Seconds after its time within which a tick counts as on time; reached
    #: later, it was missed (see `Schedule.catch_up`).
    grace: float = 60.0
    #: First wait before a round that failed is tried again; doubles up to the cap
    #: (never past the next tick).
    retry_initial_delay: float = 0.1
    retry_max_delay: float = 10.0

    @classmethod
    def of(cls, config: QueueConfig) -> SchedulerConfig:
        return cls(grace=config.schedule_grace, retry_initial_delay=config.retry_initial_delay,
                   retry_max_delay=config.retry_max_delay)


@attrs.frozen
class Tick:
    """A tick this scheduler enqueued."""

    name: str
    at: datetime
    job_id: UUID


@attrs.frozen(kw_only=True)
class SchedulerRound:
    """What one `Scheduler.run_once` did, schedule by schedule."""

    #: Ticks this scheduler enqueued.
    enqueued: tuple[Tick, ...] = ()
    #: Schedules seen for the first time, or for the first time since their
    #: expression or zone changed: their current tick recorded, nothing enqueued.
    recorded: tuple[str, ...] = ()
    #: Schedules moved past missed ticks without enqueuing (catch_up off).
    skipped: tuple[str, ...] = ()
    #: Schedules whose round failed (logged); tried again shortly.
    failed: tuple[str, ...] = ()


class Scheduler:
    """
    Enqueues the ticks of cron schedules; safe to run in every replica.

    >>> async with trio.open_nursery() as nursery:
    ...     nursery.start_soon(Scheduler(queue, [nightly]).run)

    Args:
        queue: where the jobs go.
        schedules: with distinct names.
        config: its grace and retry delays (`SchedulerConfig.of(queue.config)`
            by default).
        clock: the wall clock, an aware datetime (tests give their own).
    """

    def __init__(self, queue: Queue, schedules: Sequence[Schedule],
                 config: SchedulerConfig | None = None, *,
                 clock: Callable[[], datetime] = lambda: datetime.now(UTC)) -> None:
        names = [s.name for s in schedules]
        doubled = sorted({n for n in names if names.count(n) > 1})
        if doubled:
            raise ConfigurationError(f"schedule names must be distinct; given twice: {doubled}")
        self.queue = queue
        self.schedules = tuple(schedules)
        self.config = config or SchedulerConfig.of(queue.config)
        self.clock = clock
        # The latest tick of each schedule known to be in the database (moved by
        # us or by another replica): a tick at or before it needs no statement.
        self._known: dict[str, datetime] = {}

    async def run_once(self, now: datetime | None = None) -> SchedulerRound:
        """
        One round at wall time `now` (default: the clock): for each schedule
        whose latest tick at or before `now` is newer than the last one
        recorded, move the record forward and enqueue it (or record or skip it,
        see the module's docstring). A failure is logged and reported in the
        result; the other schedules still run.
        """
        now = _aware(self.clock() if now is None else now)
        enqueued: list[Tick] = []
        recorded: list[str] = []
        skipped: list[str] = []
        failed: list[str] = []
        for schedule in self.schedules:
            tick = schedule.last_tick(now)
            known = self._known.get(schedule.name)
            if tick is None or (known is not None and tick <= known):
                continue
            try:
                outcome = await self._advance(schedule, tick, now)
            except Exception as exc:
                failed.append(schedule.name)
                log.warning("schedule %s: tick %s not enqueued yet (%s); trying again",
                            schedule.name, tick.isoformat(), one_line(exc))
                continue
            self._known[schedule.name] = tick
            if isinstance(outcome, Tick):
                enqueued.append(outcome)
            elif outcome == "recorded":
                recorded.append(schedule.name)
            elif outcome == "skipped":
                skipped.append(schedule.name)
        return SchedulerRound(enqueued=tuple(enqueued), recorded=tuple(recorded),
                              skipped=tuple(skipped), failed=tuple(failed))

    async def _advance(self, schedule: Schedule, tick: datetime,
                       now: datetime) -> Tick | str | None:
        """Move `schedule` to `tick` and enqueue it, in one transaction."""
        late = (now - tick).total_seconds() > self.config.grace
        async with self.queue.db.transaction() as tx:
            spec = (schedule.name, tick, schedule.cron, schedule.timezone)
            moved = await tx.fetchrow(Q.schedule_advance, *spec)
            if moved is None:
                if await tx.fetchval(Q.schedule_first_sight, *spec) is not None:
                    log.info("schedule %s: first seen; from tick %s on, each tick is enqueued",
                             schedule.name, tick.isoformat())
                    return "recorded"
                # The row is there: it was already, at this tick or past it (another
                # scheduler has the tick), or another scheduler's first sight
                # inserted it meanwhile, maybe at an earlier tick (its clock
                # behind ours). Advance from it, as from any row: else this tick
                # waited for that scheduler alone, and was lost if it stopped.
                moved = await tx.fetchrow(Q.schedule_advance, *spec)
                if moved is None:
                    return None  # another scheduler has it (or a later tick)
            if moved["paused_at"] is not None:
                log.info("schedule %s: tick %s skipped (the schedule is paused)",
                         schedule.name, tick.isoformat())
                return "skipped"
            if late and moved["changed"]:
                # The stored tick was the old expression's (or zone's): this one
                # was never missed, it only precedes the change. Start afresh
                # from it, as a new schedule does.
                log.info("schedule %s: its expression or time zone changed; from tick %s on, "
                         "each tick of %r (%s) is enqueued", schedule.name, tick.isoformat(),
                         schedule.cron, schedule.timezone)
                return "recorded"
            if late and not schedule.catch_up:
                log.info("schedule %s: missed tick %s skipped (catch_up is off)",
                         schedule.name, tick.isoformat())
                return "skipped"
            # Called only by the scheduler that took the tick; if it raises, the
            # transaction rolls back and the tick is tried again next round.
            job = schedule.make_job()
            job_id = await self.queue.enqueue(job, tx=tx, run_at=tick, options=schedule.options)
        log.debug("schedule %s: tick %s enqueued as job %s%s", schedule.name, tick.isoformat(),
                  job_id, " (late: caught up)" if late else "")
        return Tick(schedule.name, tick, job_id)

    def next_wake(self, now: datetime) -> datetime:
        """The wall time of the next tick of any schedule, strictly after `now`."""
        return min(s.next_tick(now) for s in self.schedules)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """
        A round now and at every tick, until cancelled. Sleeps on trio's clock
        until the next tick of the wall clock, which it reads again each round
        (no drift accumulates). A failed round is retried after a backoff
        (never later than the next tick); a failure never ends the loop.
        """
        task_status.started()
        if not self.schedules:
            await trio.sleep_forever()
        delay = self.config.retry_initial_delay
        while True:
            try:
                result = await self.run_once()
                failed = bool(result.failed)
            except Exception as exc:  # a bug of ours: logged, the loop goes on
                log.exception("scheduler round failed (%s)", one_line(exc))
                failed = True
            now = self.clock()
            wait = (self.next_wake(now) - now).total_seconds()
            if failed:
                wait = min(wait, delay)
                delay = min(delay * 2, self.config.retry_max_delay)
            else:
                delay = self.config.retry_initial_delay
            await trio.sleep_until(trio.current_time() + max(0.0, wait))
