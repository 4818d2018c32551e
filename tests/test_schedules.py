"""
Cron schedules (issue #11): each tick enqueued exactly once however many
schedulers run, first sight records without enqueuing, catch-up of the latest
missed tick, time zones across DST.

Rounds are driven with explicit wall times (`Scheduler.run_once(now)`) against
a real PostgreSQL; the loop's timing is driven on trio's mock clock. The
issue's proof with four replica processes is in test_schedule_processes.py.
"""

from __future__ import annotations

import itertools
import re
import sys
import types
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, ClassVar, cast

import attrs
import pytest
import trio
import trio.testing

from nasiko_queue import (
    ConfigurationError,
    Database,
    DatabaseConfig,
    Executors,
    JobArgs,
    JobOptions,
    PlainJobContext,
    Queue,
    QueueConfig,
    Schedule,
    Scheduler,
    SchedulerConfig,
    Worker,
    open_database,
)
from nasiko_queue.plain.schedules import SchedulerRound

from .conftest import FAST, MASTER_KEY
from .helpers import TEST_DEADLINE


@attrs.frozen(kw_only=True)
class Report(JobArgs):
    kind: ClassVar[str] = "cron_report"
    options: ClassVar[JobOptions] = JobOptions(queue="reports")
    n: int = 0


EVERY_MINUTE = Schedule("minutely", "* * * * *", Report())
#: Half a minute past a minute: the current tick is 12:00:00.
T0 = datetime(2024, 5, 1, 12, 0, 30, tzinfo=UTC)


def at(minutes: float) -> datetime:
    """`minutes` after 12:00:00 on T0's day."""
    return T0.replace(second=0) + timedelta(minutes=minutes)


async def cron_jobs(db: Database) -> list[tuple[datetime, str, str, int]]:
    rows = await db.fetch("SELECT run_at, kind, queue, priority FROM nasiko_queue_jobs "
                          "ORDER BY run_at, id")
    return [(r["run_at"], r["kind"], r["queue"], r["priority"]) for r in rows]


async def run_at_values(db: Database) -> list[datetime]:
    return [row[0] for row in await cron_jobs(db)]


async def last_tick(db: Database, name: str) -> datetime | None:
    value: datetime | None = await db.fetchval(
        "SELECT last_tick FROM nasiko_queue_schedules WHERE name = $1", name)
    return value


@asynccontextmanager
async def databases(dsn: str, count: int) -> AsyncIterator[list[Database]]:
    """`count` databases (pools) on one trio-asyncio loop: separate connections."""
    async with AsyncExitStack() as stack:
        yield [await stack.enter_async_context(open_database(DatabaseConfig(
            dsn=dsn, max_connections=2))) for _ in range(count)]


# -- ticks and validation (no database) ----------------------------------------------


def utc(*args: int) -> datetime:
    return datetime(*args, tzinfo=UTC)


def test_ticks_follow_the_time_zone_across_dst() -> None:
    # 09:00 in New York is 13:00 UTC in summer time, 14:00 after 3 November 2024.
    new_york = Schedule("ny", "0 9 * * *", Report(), timezone="America/New_York")
    assert new_york.ticks(utc(2024, 11, 1), 4) == [
        utc(2024, 11, 1, 13), utc(2024, 11, 2, 13), utc(2024, 11, 3, 14), utc(2024, 11, 4, 14)]
    # 02:30 in Berlin does not exist on 31 March 2024 (02:00 -> 03:00): it runs
    # at 03:00 CEST, the first minute after the gap; on 27 October 02:30 comes
    # twice (03:00 -> 02:00): it runs once, at the first.
    berlin = Schedule("berlin", "30 2 * * *", Report(), timezone="Europe/Berlin")
    assert berlin.ticks(utc(2024, 3, 30), 3) == [
        utc(2024, 3, 30, 1, 30), utc(2024, 3, 31, 1, 0), utc(2024, 4, 1, 0, 30)]
    assert berlin.ticks(utc(2024, 10, 26), 3) == [
        utc(2024, 10, 26, 0, 30), utc(2024, 10, 27, 0, 30), utc(2024, 10, 28, 1, 30)]
    # A schedule by the minute keeps real-time spacing through the repeated hour.
    quarter = Schedule("q", "*/30 * * * *", Report(), timezone="Europe/Berlin")
    assert quarter.ticks(utc(2024, 10, 27, 0, 0), 3) == [
        utc(2024, 10, 27, 0, 30), utc(2024, 10, 27, 1, 0), utc(2024, 10, 27, 1, 30)]
    # The latest tick at or before a time agrees with the forward walk.
    assert berlin.last_tick(utc(2024, 3, 31, 0, 59, 59)) == utc(2024, 3, 30, 1, 30)
    assert berlin.last_tick(utc(2024, 3, 31, 1, 0)) == utc(2024, 3, 31, 1, 0)
    assert berlin.last_tick(utc(2024, 10, 27, 1, 45)) == utc(2024, 10, 27, 0, 30)



def test_the_latest_tick_is_always_one_the_forward_walk_has() -> None:
    """Lord Howe moves its clocks by 30 minutes: on 7 April 2024 02:00 local
    (+11) becomes 01:30 (+10:30). cronsim's reverse walk from 15:30 UTC yields
    02:00+10:30, which the forward walk of "0 */2 * * *" skips (its ticks are
    13:00 and 17:30 UTC). Taken as the latest tick, it was enqueued only when a
    round happened to fall between 15:30 and 17:30, so replicas could disagree
    (found by a fuzz of last_tick against the forward walk)."""
    lord_howe = Schedule("lh", "0 */2 * * *", Report(), timezone="Australia/Lord_Howe")
    forward = lord_howe.ticks(utc(2024, 4, 6, 9), 6)
    assert utc(2024, 4, 6, 13) in forward
    assert utc(2024, 4, 6, 15, 30) not in forward
    for minute in range(0, 120, 7):
        at = utc(2024, 4, 6, 15, 30) + timedelta(minutes=minute)
        assert lord_howe.last_tick(at) == max(t for t in [*forward, utc(2024, 4, 6, 9)]
                                              if t <= at), at

def test_six_fields_tick_every_second() -> None:
    every_second = Schedule("s", "* * * * * *", Report())
    start = utc(2024, 5, 1, 12, 0, 0)
    assert every_second.ticks(start, 3) == [start + timedelta(seconds=n) for n in (1, 2, 3)]
    assert every_second.last_tick(start + timedelta(seconds=2.5)) == start + timedelta(seconds=2)
    assert every_second.last_tick(start) == start


@pytest.mark.parametrize("expr", ["61 * * * *", "* * *", "every minute", "0 0 31 2 *", ""])
def test_a_bad_cron_expression_is_refused(expr: str) -> None:
    with pytest.raises(ConfigurationError, match="bad cron expression"):
        Schedule("bad", expr, Report())


@pytest.mark.parametrize("zone", ["Mars/Olympus_Mons", "", "../etc/passwd", "CEST+1"])
def test_an_unknown_time_zone_is_refused(zone: str) -> None:
    with pytest.raises(ConfigurationError, match="not an IANA time zone"):
        Schedule("bad", "* * * * *", Report(), timezone=zone)


def test_a_job_must_be_job_args_or_a_function() -> None:
    with pytest.raises(ConfigurationError, match="JobArgs instance or a function"):
        Schedule("bad", "* * * * *", cast(Any, "Report"))
    returns_junk = Schedule("junk", "* * * * *", cast(Any, lambda: "Report"))
    with pytest.raises(TypeError, match="not a JobArgs instance"):
        returns_junk.make_job()


async def test_schedule_names_must_be_distinct(queue: Queue) -> None:
    with pytest.raises(ConfigurationError, match="given twice"):
        Scheduler(queue, [EVERY_MINUTE, Schedule("minutely", "0 * * * *", Report())])


# -- rounds at explicit times, real database --------------------------------------------


async def test_first_sight_records_the_current_tick_and_enqueues_nothing(queue: Queue) -> None:
    result = await Scheduler(queue, [EVERY_MINUTE]).run_once(T0)
    assert result == SchedulerRound(recorded=("minutely",))
    assert await last_tick(queue.db, "minutely") == at(0)
    assert await cron_jobs(queue.db) == []


async def test_each_tick_is_enqueued_once(queue: Queue) -> None:
    scheduler = Scheduler(queue, [EVERY_MINUTE])
    await scheduler.run_once(T0)
    # On the tick, a little after it, again at the same time, between ticks.
    for now in (at(1), at(1), at(1.5), at(2) + timedelta(milliseconds=3), at(2.99), at(3)):
        await scheduler.run_once(now)
        # A scheduler that knows nothing (another replica, or this one
        # restarted) at the same time: the database says the tick is taken.
        assert await Scheduler(queue, [EVERY_MINUTE]).run_once(now) == SchedulerRound()
    assert await cron_jobs(queue.db) == [(at(n), "cron_report", "reports", 0) for n in (1, 2, 3)]
    assert await last_tick(queue.db, "minutely") == at(3)



async def test_a_tick_is_enqueued_when_another_first_sight_wins_the_race_behind_it(
    queue: Queue,
) -> None:
    """
    Two schedulers see a new schedule at once. The other one, its clock a
    minute behind, inserts the schedule's row at tick 12:00 and has not
    committed; ours finds no row to advance and tries its own first sight at
    12:01, which waits on the other's insert and, once that commits, inserts
    nothing. Ours then advances from the row it now sees and enqueues 12:01.
    It used to give up ("another scheduler has it") and remember 12:01 as
    known: the tick was the other scheduler's alone, and lost if it stopped.
    """
    from .test_cancel_race import _blocked_by

    scheduler = Scheduler(queue, [EVERY_MINUTE])
    rounds: list[SchedulerRound] = []
    async def ours() -> None:
        rounds.append(await scheduler.run_once(at(1)))

    with trio.fail_after(TEST_DEADLINE):
        async with trio.open_nursery() as nursery, queue.db.transaction() as other:
            await other.execute("INSERT INTO nasiko_queue_schedules (name, last_tick) "
                                "VALUES ('minutely', $1)", at(0))
            pid = await other.fetchval("SELECT pg_backend_pid()")
            nursery.start_soon(ours)
            await _blocked_by(queue.db, pid)  # our first sight waits on the insert
            # the other transaction has committed: ours goes on
    assert [[t.at for t in r.enqueued] for r in rounds] == [[at(1)]]
    assert await last_tick(queue.db, "minutely") == at(1)
    assert await run_at_values(queue.db) == [at(1)]

async def test_a_scheduler_whose_clock_lags_enqueues_nothing(queue: Queue) -> None:
    await Scheduler(queue, [EVERY_MINUTE]).run_once(T0)
    await Scheduler(queue, [EVERY_MINUTE]).run_once(at(5))
    assert await Scheduler(queue, [EVERY_MINUTE]).run_once(at(3)) == SchedulerRound()
    assert await run_at_values(queue.db) == [at(5)]
    assert await last_tick(queue.db, "minutely") == at(5)


async def test_racing_schedulers_enqueue_each_tick_once(dsn: str) -> None:
    """Eight schedulers, each on a pool of its own, run every round at once."""
    replicas = 8
    async with databases(dsn, replicas) as dbs:
        queues = [Queue(db, config=FAST, secrets=MASTER_KEY) for db in dbs]
        schedulers = [Scheduler(q, [EVERY_MINUTE]) for q in queues]
        rounds: list[SchedulerRound] = []

        async def round_at(scheduler: Scheduler, now: datetime) -> None:
            rounds.append(await scheduler.run_once(now))

        with trio.fail_after(TEST_DEADLINE):
            for minute in range(13):
                async with trio.open_nursery() as nursery:
                    for scheduler in schedulers:
                        nursery.start_soon(round_at, scheduler, at(minute) + timedelta(seconds=1))
        recorded = sum(len(r.recorded) for r in rounds)
        enqueued = [t.at for r in rounds for t in r.enqueued]
        assert recorded == 1  # the first round: one of them inserted the row
        assert sorted(enqueued) == [at(m) for m in range(1, 13)]
        assert await run_at_values(dbs[0]) == [at(m) for m in range(1, 13)]
        assert not any(r.failed for r in rounds)


async def test_catch_up_enqueues_the_latest_missed_tick_once(queue: Queue) -> None:
    await Scheduler(queue, [EVERY_MINUTE]).run_once(T0)
    # Every replica was down for three hours: 180 ticks missed.
    restarted = Scheduler(queue, [EVERY_MINUTE])
    result = await restarted.run_once(at(180.5))
    assert [t.at for t in result.enqueued] == [at(180)]
    # Another replica starting at the same time, and the next round: nothing more.
    assert await Scheduler(queue, [EVERY_MINUTE]).run_once(at(180.6)) == SchedulerRound()
    await restarted.run_once(at(180.9))
    assert await run_at_values(queue.db) == [at(180)]
    # Then on time again.
    await restarted.run_once(at(181))
    assert await run_at_values(queue.db) == [at(180), at(181)]


HOURLY = Schedule("minutely", "0 * * * *", Report())
EVERY_FIVE = Schedule("minutely", "*/5 * * * *", Report())


async def test_a_changed_expression_replays_no_tick_from_before_the_change(
    queue: Queue,
) -> None:
    """
    A deploy changes an hourly schedule to every five minutes at 12:32. The
    stored tick, 12:00, was the hourly expression's; 12:30 of the new one was
    never missed (it only came before the change). It used to count as missed
    and be caught up at once: a run at 12:32 nobody scheduled. It is recorded,
    as a new schedule's first tick is, and 12:35 runs on time.
    """
    await Scheduler(queue, [HOURLY]).run_once(T0)
    deployed = Scheduler(queue, [EVERY_FIVE])
    assert await deployed.run_once(at(32)) == SchedulerRound(recorded=("minutely",))
    assert await cron_jobs(queue.db) == []
    assert await last_tick(queue.db, "minutely") == at(30)
    result = await deployed.run_once(at(35) + timedelta(seconds=2))
    assert [t.at for t in result.enqueued] == [at(35)]
    # Later outages are caught up as ever, under the new expression.
    result = await Scheduler(queue, [EVERY_FIVE]).run_once(at(200))
    assert [t.at for t in result.enqueued] == [at(200)]
    assert await run_at_values(queue.db) == [at(35), at(200)]


async def test_a_changed_expressions_tick_reached_on_time_is_enqueued(queue: Queue) -> None:
    await Scheduler(queue, [HOURLY]).run_once(T0)
    result = await Scheduler(queue, [EVERY_FIVE]).run_once(at(30) + timedelta(seconds=10))
    assert [t.at for t in result.enqueued] == [at(30)]
    rows = await queue.db.fetch("SELECT cron, timezone FROM nasiko_queue_schedules")
    assert [tuple(r) for r in rows] == [("*/5 * * * *", "UTC")]


async def test_a_changed_time_zone_replays_no_tick_from_before_the_change(queue: Queue) -> None:
    noon_utc = Schedule("noon", "0 12 * * *", Report())
    await Scheduler(queue, [noon_utc]).run_once(T0)  # 12:00 UTC recorded
    # Noon in New York is 16:00 UTC: at 16:05 UTC, after the deploy, it has passed.
    noon_ny = attrs.evolve(noon_utc, timezone="America/New_York")
    result = await Scheduler(queue, [noon_ny]).run_once(at(4 * 60 + 5))
    assert result == SchedulerRound(recorded=("noon",))
    assert await cron_jobs(queue.db) == []
    assert await last_tick(queue.db, "noon") == at(4 * 60)


async def test_a_row_from_before_the_expression_was_stored_catches_up_as_before(
    queue: Queue,
) -> None:
    await queue.db.execute("INSERT INTO nasiko_queue_schedules (name, last_tick) "
                           "VALUES ('minutely', $1)", at(0))
    result = await Scheduler(queue, [EVERY_MINUTE]).run_once(at(180.5))
    assert [t.at for t in result.enqueued] == [at(180)]
    rows = await queue.db.fetch("SELECT cron, timezone FROM nasiko_queue_schedules")
    assert [tuple(r) for r in rows] == [("* * * * *", "UTC")]


async def test_without_catch_up_missed_ticks_are_skipped(queue: Queue) -> None:
    no_catch_up = attrs.evolve(EVERY_MINUTE, catch_up=False)
    config = SchedulerConfig(grace=10.0)
    await Scheduler(queue, [no_catch_up], config).run_once(T0)
    restarted = Scheduler(queue, [no_catch_up], config)
    result = await restarted.run_once(at(180.5))  # 30 s late: missed
    assert result == SchedulerRound(skipped=("minutely",))
    assert await last_tick(queue.db, "minutely") == at(180)
    assert await cron_jobs(queue.db) == []
    # The next tick, reached within the grace, is on time.
    result = await restarted.run_once(at(181) + timedelta(seconds=9))
    assert [t.at for t in result.enqueued] == [at(181)]
    assert await run_at_values(queue.db) == [at(181)]


async def test_scheduled_jobs_take_the_schedules_options_and_a_fresh_job_each_tick(
    queue: Queue,
) -> None:
    made: list[int] = []

    def make() -> Report:
        made.append(len(made))
        return Report(n=len(made))

    schedule = Schedule("hourly", "0 * * * *", make, timezone="Europe/Berlin",
                        options=JobOptions(queue="urgent", priority=-5))
    scheduler = Scheduler(queue, [schedule])
    await scheduler.run_once(at(0))  # first sight: the job function is not called
    assert made == []
    await scheduler.run_once(at(60))
    await scheduler.run_once(at(120))
    rows = await queue.db.fetch("SELECT queue, priority, payload->>'n' AS n, run_at "
                                "FROM nasiko_queue_jobs ORDER BY run_at")
    assert [(r["queue"], r["priority"], r["n"], r["run_at"]) for r in rows] == [
        ("urgent", -5, "1", at(60)), ("urgent", -5, "2", at(120))]


async def test_a_failing_job_function_holds_back_only_its_own_schedule(queue: Queue) -> None:
    def broken() -> Report:
        raise RuntimeError("no report today")

    scheduler = Scheduler(queue, [Schedule("broken", "* * * * *", broken), EVERY_MINUTE])
    await scheduler.run_once(T0)
    result = await scheduler.run_once(at(1))
    assert result.failed == ("broken",)
    assert [t.name for t in result.enqueued] == ["minutely"]
    # Its tick was not taken: it is enqueued once the function works.
    assert await last_tick(queue.db, "broken") == at(0)


async def test_a_database_outage_is_reported_not_raised() -> None:
    # A port nothing listens on: every statement fails to connect.
    config = DatabaseConfig(dsn="postgresql://root@127.0.0.1:9/none", connect_timeout=1.0)
    async with open_database(config) as db:
        scheduler = Scheduler(Queue(db, config=FAST), [EVERY_MINUTE])
        with trio.fail_after(TEST_DEADLINE):
            result = await scheduler.run_once(T0)
    assert result == SchedulerRound(failed=("minutely",))


# -- the loop, on trio's mock clock ---------------------------------------------------------


class RecordingScheduler(Scheduler):
    """The real loop; each round records its wall time instead of using the database."""

    def __init__(self, *args: Any, fail_first: int = 0, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.rounds: list[datetime] = []
        self.fail_first = fail_first

    async def run_once(self, now: datetime | None = None) -> SchedulerRound:
        self.rounds.append(self.clock())
        if len(self.rounds) <= self.fail_first:
            return SchedulerRound(failed=tuple(s.name for s in self.schedules))
        return SchedulerRound()


def mock_wall_clock(start: datetime) -> Any:
    """A wall clock that moves with trio's (mock) clock, plus a settable jump."""

    class Clock:
        offset = timedelta(0)

        def __call__(self) -> datetime:
            return start + timedelta(seconds=trio.current_time()) + self.offset

    return Clock()


async def test_the_loop_wakes_at_each_tick_of_the_wall_clock(
    autojump_clock: trio.testing.MockClock, queue: Queue,
) -> None:
    start = utc(2024, 5, 1, 12, 0, 3)
    clock = mock_wall_clock(start)
    every_ten = Schedule("ten", "*/10 * * * * *", Report())
    scheduler = RecordingScheduler(queue, [every_ten], clock=clock)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(scheduler.run)
        await trio.sleep(35)
        # The wall clock jumps 100 s ahead (NTP, a resumed VM): the loop reads it
        # again after its sleep and wakes at the wall clock's next ticks.
        clock.offset = timedelta(seconds=100)
        await trio.sleep(25)
        nursery.cancel_scope.cancel()
    assert scheduler.rounds == [
        start, *(utc(2024, 5, 1, 12, 0, s) for s in (10, 20, 30)),
        # Slept until 40 s on the old clock: 140 s now. Then every 10 s again.
        utc(2024, 5, 1, 12, 2, 20), utc(2024, 5, 1, 12, 2, 30), utc(2024, 5, 1, 12, 2, 40)]


async def test_the_loop_retries_a_failed_round_before_the_next_tick(
    autojump_clock: trio.testing.MockClock, queue: Queue,
) -> None:
    start = utc(2024, 5, 1, 12, 0, 0)
    scheduler = RecordingScheduler(
        queue, [EVERY_MINUTE], SchedulerConfig(retry_initial_delay=1.0, retry_max_delay=4.0),
        clock=mock_wall_clock(start), fail_first=5)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(scheduler.run)
        await trio.sleep(75)
        nursery.cancel_scope.cancel()
    offsets = [(r - start).total_seconds() for r in scheduler.rounds]
    # Retries after 1, 2, 4, 4, 4 s (capped); the sixth round succeeds, then the next tick.
    assert offsets == [0, 1, 3, 7, 11, 15, 60]


# -- in a worker ------------------------------------------------------------------------


async def test_a_worker_runs_its_schedules_and_their_jobs(queue: Queue) -> None:
    ran: list[Report] = []
    executors = Executors()

    @executors.register(Report)
    async def report(ctx: PlainJobContext[Report]) -> None:
        ran.append(ctx.payload)

    every_second = Schedule("every-second", "* * * * * *", Report())
    worker = Worker(queue, executors, schedules=[every_second])
    assert worker.scheduler is not None
    with trio.fail_after(TEST_DEADLINE):
        async with trio.open_nursery() as nursery:
            await nursery.start(worker.run)
            # Real time: the schedule ticks every second of the wall clock.
            await worker.wait_for(lambda s: s.done >= 2)
            worker.stop()
    ticks = await run_at_values(queue.db)
    assert len(ticks) >= 2
    assert all(t.microsecond == 0 for t in ticks)
    assert [b - a for a, b in itertools.pairwise(ticks)] == [
        timedelta(seconds=1)] * (len(ticks) - 1)


async def test_a_worker_with_the_scheduler_off_runs_none(queue: Queue) -> None:
    executors = Executors()

    @executors.register(Report)
    async def report(ctx: PlainJobContext[Report]) -> None:
        pass

    off = Queue(queue.db, config=attrs.evolve(FAST, scheduler=False))
    assert Worker(off, executors, schedules=[EVERY_MINUTE]).scheduler is None
    assert Worker(queue, executors).scheduler is None


def test_the_config_flag_defaults_on() -> None:
    assert QueueConfig().scheduler is True
    assert SchedulerConfig.of(QueueConfig(schedule_grace=5.0)).grace == 5.0
    with pytest.raises(ConfigurationError):
        QueueConfig(schedule_grace=0)


def readme_cron_example() -> str:
    """The python block of the docs' cron page (docs/guides/schedules.md)."""
    page = (Path(__file__).resolve().parent.parent / "docs" / "guides" / "schedules.md")
    [block] = re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.DOTALL)
    return str(block)


async def test_the_readme_example_defines_working_schedules(queue: Queue) -> None:
    block = readme_cron_example()
    # A module of its own, as when run as a script (type hints are resolved there).
    module = types.ModuleType("readme_cron")
    sys.modules[module.__name__] = module
    try:
        exec(compile(block, "docs/guides/schedules.md", "exec"), module.__dict__)  # noqa: S102
        await enqueue_the_readme_ticks(queue, module.SCHEDULES)
    finally:
        del sys.modules[module.__name__]


async def enqueue_the_readme_ticks(queue: Queue, schedules: list[Schedule]) -> None:
    scheduler = Scheduler(queue, schedules)
    await scheduler.run_once(utc(2024, 5, 6, 5, 29, 55))  # a Monday, 07:29:55 in Berlin
    result = await scheduler.run_once(utc(2024, 5, 6, 5, 30, 0))
    assert sorted((t.name, t.at) for t in result.enqueued) == [
        ("ten-seconds", utc(2024, 5, 6, 5, 30)), ("weekday-digest", utc(2024, 5, 6, 5, 30))]
    kinds = await queue.db.fetch("SELECT kind, queue FROM nasiko_queue_jobs")
    assert {(r["kind"], r["queue"]) for r in kinds} == {("send_digest", "email")}
