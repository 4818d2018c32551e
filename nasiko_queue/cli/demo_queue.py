"""
The demo's first part: the general job queue, as an application uses it.

Before the build scenarios (the Nasiko build worker, one application of the
queue), the demo runs what a FastAPI or Django application would: plain jobs on
three queues, a job that fails twice and succeeds on its third run, one that
runs out of attempts into the dead letters and is retried from there once its
"mail server" is back, a blocking ``def`` executor whose result the caller
awaits, a workflow that fans out over a list and joins the results, and a cron
schedule ticking every second. A real `Worker` runs them all, and each line of
the table says what happened next to what must happen; the demo exits non-zero
when one differs.

.. versionadded:: 0.2.0
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import ClassVar
from uuid import UUID

import attrs
import trio
from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from ..admin.view import job_view
from ..config import QueueConfig
from ..db.database import Database
from ..engine.worker import Worker
from ..errors import JobFailed, RunFailed
from ..executors import Executors, PlainJobContext
from ..job_admin import retry
from ..plain.args import Backoff, JobArgs, JobOptions
from ..plain.schedules import Schedule
from ..queue import Queue
from ..workflows.definition import StepContext, Workflow


class SimulatedCrash(RuntimeError):
    """What a simulated executor raises on purpose; the demo's log marks it as expected."""


#: Retries in the tour come back after a fifth of a second, not Oban's curve.
QUICK = Backoff(base=0.2, exponent=0, jitter=0)

#: The queues the tour's worker runs, with their slots: each its own lane.
TOUR_QUEUES = {"email": 2, "payments": 1, "media": 1, "default": 1}


@attrs.frozen(kw_only=True)
class SendEmail(JobArgs):
    kind: ClassVar[str] = "tour.send_email"
    options: ClassVar[JobOptions] = JobOptions(queue="email")
    to: str


@attrs.frozen(kw_only=True)
class ChargeCard(JobArgs):
    kind: ClassVar[str] = "tour.charge_card"
    options: ClassVar[JobOptions] = JobOptions(queue="payments", max_attempts=5)
    cents: int


@attrs.frozen(kw_only=True)
class Notify(JobArgs):
    kind: ClassVar[str] = "tour.notify"
    options: ClassVar[JobOptions] = JobOptions(queue="email", max_attempts=2)
    to: str


@attrs.frozen(kw_only=True)
class Thumbnail(JobArgs):
    kind: ClassVar[str] = "tour.thumbnail"
    options: ClassVar[JobOptions] = JobOptions(queue="media")
    url: str


@attrs.frozen(kw_only=True)
class Tick(JobArgs):
    kind: ClassVar[str] = "tour.tick"


@attrs.frozen
class Report:
    regions: list[str]


report = Workflow("tour_report", input_type=Report)


@report.step()
async def regions(ctx: StepContext) -> list[str]:
    return list(ctx.input.regions)


@report.step(map_over=regions)  # once per region, side by side
async def sales(ctx: StepContext) -> int:
    return 100 * (ctx.index or 0) + 100  # a fake of the region's figure


@report.step(after=[sales])
async def total(ctx: StepContext) -> int:
    return sum(ctx.results["sales"])


@attrs.frozen
class TourRow:
    """One line of the tour's table."""

    what: str
    observed: str
    expected: str

    @property
    def ok(self) -> bool:
        return self.observed == self.expected


@attrs.define
class _World:
    """The executors' outside world: a mail server that is down, then back."""

    mail_server_up: bool = False
    card_runs: int = 0
    ticked: trio.Event = attrs.field(factory=trio.Event)


def _executors(world: _World) -> Executors:
    executors = Executors()

    @executors.register(SendEmail)
    async def send_email(ctx: PlainJobContext[SendEmail]) -> str:
        return f"sent to {ctx.payload.to}"

    @executors.register(ChargeCard, backoff=QUICK)
    async def charge_card(ctx: PlainJobContext[ChargeCard]) -> str:
        world.card_runs += 1
        if ctx.attempt < 3:
            raise SimulatedCrash("the payment gateway timed out")
        return f"charged {ctx.payload.cents} cents"

    @executors.register(Notify, backoff=QUICK)
    async def notify(ctx: PlainJobContext[Notify]) -> str:
        if not world.mail_server_up:
            raise SimulatedCrash("the mail server refused the connection")
        return f"notified {ctx.payload.to}"

    @executors.register(Thumbnail)
    def thumbnail(ctx: PlainJobContext[Thumbnail]) -> str:
        time.sleep(0.05)  # blocking work: a plain def runs in a thread of its own
        return ctx.payload.url.rsplit(".", 1)[0] + "-64.png"

    @executors.register(Tick)
    async def tick(ctx: PlainJobContext[Tick]) -> None:
        world.ticked.set()

    executors.register_workflow(report)
    return executors


#: The tour's schedule: a tick every second (six fields: seconds first).
SCHEDULES = [Schedule("tour-every-second", "* * * * * *", Tick(), catch_up=False)]


async def run_tour(db: Database, *, give_up_after: float) -> list[TourRow]:
    """Enqueue the tour's jobs, run them with a real worker, and say how each ended."""
    config = QueueConfig(poll_interval=0.5, queues=TOUR_QUEUES)
    queue = Queue(db, config=config)
    world = _World()
    rows: list[TourRow] = []
    worker = Worker(queue, _executors(world), schedules=SCHEDULES)
    with trio.move_on_after(give_up_after) as waited:
        async with trio.open_nursery() as nursery:
            await nursery.start(worker.run)
            await _tour(db, queue, world, rows)
            worker.stop()
    if waited.cancelled_caught:  # the worker was cancelled with the rest
        rows.append(TourRow("the tour", "gave up waiting", "finished"))
    return rows


async def _ended(job: Awaitable[object]) -> str:
    """What a job (or run) came back with, or how it failed: a row's observation."""
    try:
        return str(await job)
    except (JobFailed, RunFailed) as exc:
        return str(exc)


async def _tour(db: Database, queue: Queue, world: _World, rows: list[TourRow]) -> None:
    emails = [await queue.enqueue(SendEmail(to=f"user{n}@example.com")) for n in range(3)]
    card = await queue.enqueue(ChargeCard(cents=1999))
    dead = await queue.enqueue(Notify(to="ops@example.com"))
    image = await queue.enqueue(Thumbnail(url="https://cdn.example.com/cat.jpg"))
    run_id = await queue.start(report, Report(["north", "south", "east", "west"]))

    sent = [await _ended(queue.result(job)) for job in emails]
    rows.append(TourRow("3 emails on queue 'email'", "; ".join(sent), "; ".join(
        f"sent to user{n}@example.com" for n in range(3))))
    charged = await _ended(queue.result(card))
    rows.append(TourRow("a card charge that fails twice",
                        f"{charged}, attempt {await _attempt(db, card)}",
                        "charged 1999 cents, attempt 3"))
    rows.append(TourRow("a def executor's result, awaited",
                        await _ended(queue.result(image)),
                        "https://cdn.example.com/cat-64.png"))
    rows.append(TourRow("a workflow fanning out over 4 regions",
                        f"total {await _ended(queue.run_result(run_id))}", "total 1000"))
    try:
        await queue.result(dead)
        first = "ran"
    except JobFailed as exc:
        first = f"{exc.state} after {await _attempt(db, dead)} attempts"
    rows.append(TourRow("a notification while mail is down", first,
                        "discarded after 2 attempts"))
    world.mail_server_up = True  # the operator fixes the mail server, then:
    await retry(db, dead, actor="demo")  # `nasiko-queue jobs retry ID`
    rows.append(TourRow("... retried from the dead letters", await _ended(queue.result(dead)),
                        "notified ops@example.com"))
    await world.ticked.wait()
    rows.append(TourRow("a cron schedule, every second", "ticked", "ticked"))


async def _attempt(db: Database, job_id: UUID) -> int:
    view = await job_view(db, job_id)
    assert view is not None  # the tour's own job, still kept
    return int(view.attempt)


def render_tour(console: Console, rows: list[TourRow],
                mark: Callable[[bool], str] = lambda ok: "[green]✓[/]" if ok else
                "[bold red]✗[/]") -> None:
    table = Table(title="The job queue: plain jobs, retries, dead letters, results, "
                        "a workflow, a schedule", box=box.SIMPLE_HEAD)
    for header in ("", "scenario", "what happened", "expected"):
        table.add_column(header)
    for row in rows:
        table.add_row(mark(row.ok), escape(row.what), escape(row.observed)
                      if row.ok else f"[red]{escape(row.observed)}[/]", escape(row.expected))
    console.print(table)
