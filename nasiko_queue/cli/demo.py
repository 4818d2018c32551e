"""
The demo: every path a job can take, run for real against PostgreSQL.

First the general job queue, as any application uses it (`demo_queue`: plain
jobs, retries, a dead letter retried, an awaited result, a workflow with a
fan-out, a cron schedule). Then the Nasiko build worker, one application of
the queue: it plays the application's part around the queue, it creates agents,
connectors and build rows the way the original's enqueue points do, and
registers simulated executors (fakes of the outside world: no Docker, no
GitHub, just the rows a real build would write, and a short sleep where the
build would take minutes). A real `Worker` then drains the queue, and the demo
compares what each job, build row and target ended as with what docs/rules.md
says.

So it is both a tour for a new user and an end-to-end check: `nasiko-queue
demo` exits non-zero when any scenario ends differently from the contract.

.. versionadded:: 0.1.0
"""

from __future__ import annotations

import enum
import json
import logging
import secrets
import uuid
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from uuid import UUID

import attrs
import trio
from rich import box
from rich.console import Console, ConsoleRenderable
from rich.logging import RichHandler
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from ..builds.payloads import BUILTIN_PAYLOAD_TYPES, McpServerUpload, Payload, StandaloneBuild
from ..builds.store import BUILD_FAILED, JOB_PANICKED, TARGET_DELETED
from ..config import QueueConfig
from ..db.database import Database, open_database
from ..db.migrate import migrate
from ..db.statements import Q
from ..engine.contracts import INVALID_PAYLOAD, MAX_ATTEMPTS_EXCEEDED
from ..engine.worker import Worker
from ..errors import NasikoQueueError, leaves
from ..executors import Executors, JobContext
from ..queue import Queue
from ..secrets import SecretBox, generate_master_key
from ..testing import enqueue_with_target, insert_agent, insert_agent_build
from .demo_queue import TOUR_QUEUES, SimulatedCrash, TourRow, render_tour, run_tour

#: Seconds each simulated build step takes in the demo; tests pass 0.
DEFAULT_DELAY = 0.3
#: How often the progress display reads the jobs' statuses.
PROGRESS_EVERY = 0.2
#: The demo gives up (and reports the unfinished scenarios as mismatches) after this.
DEFAULT_GIVE_UP_AFTER = 120.0

#: The env key of the McpServerUpload scenario's secret. Its value is random per
#: run, so that finding it in the payload column could not be a coincidence.
_DEMO_ENV_KEY = "API_TOKEN"


class Behaviour(enum.Enum):
    """What a simulated executor does with its job."""

    #: Build, deploy, write 'success'.
    SUCCEED = "succeed"
    #: Build, then write 'failed' on the build row and the target.
    FAIL = "fail"
    #: Raise on the first two runs, succeed on the third.
    FLAKY = "flaky"
    #: Raise on every run.
    CRASH = "crash"
    #: Hard-delete its own agent while "building" (as a user deleting it would).
    VANISH = "vanish"


class Setup(enum.Enum):
    """How a scenario's job gets into the queue."""

    #: `enqueue_with_target`, as an enqueue point would.
    NORMAL = "normal"
    #: The agent is soft-deleted (deleted_at set) before the job runs.
    SOFT_DELETED = "soft-deleted"
    #: Raw SQL writes a payload that misses required fields.
    INVALID_PAYLOAD = "invalid"
    #: The job is staged as if it had already run MAX_ATTEMPTS times.
    ATTEMPTS_USED = "attempts used"


@attrs.frozen(kw_only=True)
class Outcome:
    """How a scenario's rows ended: expected (from docs/rules.md) or observed."""

    #: build_jobs.status, or "gone" when the row was deleted by a cascade.
    job: str
    #: build_jobs.attempt; for a gone row, the last attempt its executor saw (0: never ran).
    attempt: int
    error_msg: str | None
    #: The job's own build row status, or "gone".
    build: str
    #: agents.status / mcp_connectors.build_status, "deleted", or "soft-deleted (<status>)".
    target: str
    #: How many times the executor ran.
    runs: int

    def cells(self) -> tuple[str, str, str, str, str]:
        """The report's cells: job (status #attempt), error, build, target, runs."""
        return (f"{self.job} #{self.attempt}", _abbreviate(self.error_msg), self.build,
                self.target, str(self.runs))

    def summary(self) -> str:
        """The whole outcome in one cell, for the report's "expected" column."""
        job, error, build, target, runs = self.cells()
        error = f" ({error})" if self.error_msg else ""
        return f"{job}{error} · {build} · {target} · {runs}"


@attrs.frozen(kw_only=True)
class Scenario:
    """One path through the worker, and what docs/rules.md says it ends as."""

    key: str
    kind: str
    description: str
    expected: Outcome
    behaviour: Behaviour = Behaviour.SUCCEED
    setup: Setup = Setup.NORMAL
    agent_status: str = "deploying"
    prior_success: bool = False
    #: The McpServerUpload scenario with a secret env value.
    with_secret: bool = False

    @property
    def is_connector(self) -> bool:
        return self.kind == "McpServerUpload"

    @property
    def crashes(self) -> bool:
        """Its executor raises on purpose (the worker logs an ERROR for each run)."""
        return self.behaviour in (Behaviour.CRASH, Behaviour.FLAKY)

    @property
    def refused(self) -> bool:
        """The worker refuses to run it, on purpose (and logs a WARNING saying why)."""
        return self.setup in (Setup.SOFT_DELETED, Setup.INVALID_PAYLOAD, Setup.ATTEMPTS_USED)


@attrs.frozen(kw_only=True)
class DemoRow:
    """One line of the report: a scenario, what happened, and whether it matches."""

    kind: str
    scenario: str
    observed: Outcome
    expected: Outcome
    #: A check beyond the rows (the secret at rest), shown under the table.
    note: str = ""
    note_ok: bool = True

    @property
    def ok(self) -> bool:
        return self.observed == self.expected and self.note_ok


@attrs.frozen
class DemoReport:
    """Every scenario's row; `ok` when each one ended as docs/rules.md says."""

    rows: tuple[DemoRow, ...]
    #: The general queue's part, run first.
    tour: tuple[TourRow, ...] = ()

    @property
    def ok(self) -> bool:
        return (bool(self.rows) and all(row.ok for row in self.rows)
                and all(row.ok for row in self.tour))


def _done(runs: int = 1, attempt: int = 1, target: str = "running") -> Outcome:
    return Outcome(job="done", attempt=attempt, error_msg=None, build="success", target=target,
                   runs=runs)


def _failed(error: str, *, attempt: int = 1, runs: int = 1, target: str = "failed") -> Outcome:
    return Outcome(job="failed", attempt=attempt, error_msg=error, build="failed", target=target,
                   runs=runs)


def _gone(*, attempt: int, runs: int) -> Outcome:
    return Outcome(job="gone", attempt=attempt, error_msg=None, build="gone", target="deleted",
                   runs=runs)


#: The scenarios, in the order they are enqueued (and so claimed).
SCENARIOS: tuple[Scenario, ...] = (
    Scenario(key="upload-ok", kind="Upload", description="zip upload builds and deploys",
             expected=_done()),
    Scenario(key="standalone-ok", kind="StandaloneBuild",
             description="new build of a running agent (agent row untouched)",
             agent_status="running", prior_success=True, expected=_done()),
    Scenario(key="clone-ok", kind="Clone", description="legacy Clone row still runs",
             expected=_done()),
    Scenario(key="mcp-ok", kind="McpServerUpload",
             description="MCP server with a secret env value; sealed at rest",
             with_secret=True, expected=_done()),
    Scenario(key="github-fail", kind="GithubClone",
             description="clone fails: executor writes build and agent 'failed'",
             behaviour=Behaviour.FAIL, expected=_failed(BUILD_FAILED)),
    Scenario(key="mcp-fail", kind="McpServerUpload",
             description="MCP build fails: build and connector 'failed'",
             behaviour=Behaviour.FAIL, expected=_failed(BUILD_FAILED)),
    Scenario(key="update-flaky", kind="Update",
             description="executor raises twice, then succeeds (retried at once)",
             behaviour=Behaviour.FLAKY, prior_success=True, expected=_done(runs=3, attempt=3)),
    Scenario(key="rollback-crash", kind="Rollback",
             description="executor always raises; agent has a good build → agent 'failed'",
             behaviour=Behaviour.CRASH, agent_status="running", prior_success=True,
             expected=_failed(JOB_PANICKED, attempt=3, runs=3)),
    Scenario(key="upload-crash", kind="Upload",
             description="executor always raises; agent never built → deleted with its "
                         "builds and this job",
             behaviour=Behaviour.CRASH, expected=_gone(attempt=3, runs=3)),
    Scenario(key="github-vanish", kind="GithubClone",
             description="agent hard-deleted mid-build; the job row goes by cascade",
             behaviour=Behaviour.VANISH, expected=_gone(attempt=1, runs=1)),
    Scenario(key="update-soft-deleted", kind="Update",
             description="agent soft-deleted before the job runs; executor never runs",
             setup=Setup.SOFT_DELETED, prior_success=True,
             expected=_failed(TARGET_DELETED, runs=0, target="soft-deleted (deploying)")),
    Scenario(key="upload-invalid", kind="Upload",
             description="payload missing required fields (raw SQL); agent terminalized",
             setup=Setup.INVALID_PAYLOAD, prior_success=True,
             expected=_failed(INVALID_PAYLOAD, runs=0)),
    Scenario(key="standalone-max", kind="StandaloneBuild",
             description="staged as already run 3 times; running agent stays running",
             setup=Setup.ATTEMPTS_USED, agent_status="running", prior_success=True,
             expected=_failed(MAX_ATTEMPTS_EXCEEDED, attempt=4, runs=0, target="running")),
)


@attrs.frozen(kw_only=True)
class Staged:
    """A scenario's rows, once enqueued."""

    scenario: Scenario
    job_id: UUID
    build_id: UUID
    target_id: UUID
    #: The McpServerUpload secret's plaintext (None for other scenarios).
    secret: str | None = None


@attrs.define
class SimulatedWorld:
    """
    The simulated executors and what they saw; one instance per demo run.

    Executors find their scenario by the job's build id, so that one function
    serves every kind, and they record each run's attempt number, so that the
    report can show how often a job whose row is gone ran.
    """

    delay: float
    scenarios: dict[UUID, Staged] = attrs.Factory(dict)
    runs: dict[UUID, list[int]] = attrs.Factory(dict)
    #: Whether the McpServerUpload executor received the secret decrypted.
    secret_received: dict[UUID, bool] = attrs.Factory(dict)

    def add(self, staged: Staged) -> None:
        self.scenarios[staged.build_id] = staged
        self.runs[staged.build_id] = []

    def executors(self) -> Executors:
        executors = Executors()
        for payload_type in BUILTIN_PAYLOAD_TYPES:
            executors.register(payload_type, self.execute)
        return executors

    async def execute(self, ctx: JobContext[Payload]) -> None:
        """The one simulated executor: start, "build", then do what the scenario says."""
        build_id = ctx.payload.build_id
        staged = self.scenarios[build_id]
        self.runs[build_id].append(ctx.attempt)
        behaviour = staged.scenario.behaviour
        await self._start(ctx)
        await trio.sleep(self.delay)
        if behaviour is Behaviour.CRASH or (
            behaviour is Behaviour.FLAKY and len(self.runs[build_id]) <= 2
        ):
            raise SimulatedCrash(f"simulated crash of the {ctx.payload.kind} executor")
        if behaviour is Behaviour.VANISH:
            # What the API's DELETE of an agent does, while the build is running.
            await ctx.db.execute(Q.agent_delete, ctx.target.agent_id)
            await trio.sleep(self.delay)
        success = behaviour is not Behaviour.FAIL and self._secret_ok(ctx, staged)
        # After a VANISH these writes find no rows, as the original's do.
        await self._finish(ctx, success=success)

    def _secret_ok(self, ctx: JobContext[Payload], staged: Staged) -> bool:
        """The executor must get the plaintext the application enqueued, not the sealed text."""
        if staged.secret is None:
            return True
        payload = ctx.payload
        value = payload.env.get(_DEMO_ENV_KEY) if isinstance(payload, McpServerUpload) else None
        received = value is not None and value.reveal() == staged.secret
        self.secret_received[payload.build_id] = received
        return received

    async def _start(self, ctx: JobContext[Payload]) -> None:
        # The build row through the context: written with the worker's next
        # statement, no round trip of its own (the target's own row is ours to write).
        ctx.mark_building()
        if ctx.target.connector_id is not None:
            await ctx.db.execute(Q.connector_set_build_status, ctx.target.connector_id,
                                 "building", None)
        elif not isinstance(ctx.payload, StandaloneBuild):
            await ctx.db.execute(Q.agent_set_status, ctx.target.agent_id, "deploying")

    async def _finish(self, ctx: JobContext[Payload], *, success: bool) -> None:
        # Written by the statement that records the job's outcome, atomically with it.
        if success:
            ctx.report_success()
        else:
            ctx.report_failure()
        if ctx.target.connector_id is not None:
            if success:
                url = f"http://mcp-{ctx.target.connector_id.hex[:8]}.demo:8080"
                await ctx.db.execute(Q.connector_set_build_status, ctx.target.connector_id,
                                     "running", url)
            else:
                await ctx.db.execute(Q.connector_set_build_status, ctx.target.connector_id,
                                     "failed", None)
        elif not isinstance(ctx.payload, StandaloneBuild):
            await ctx.db.execute(Q.agent_set_status, ctx.target.agent_id,
                                 "running" if success else "failed")


class BusyDatabase(NasikoQueueError):
    """
    The database already has unfinished jobs; the demo will not run there.

    The demo's worker runs every kind with simulated executors, so it would
    "build" those jobs too. Use a scratch database, or no --dsn at all (the demo
    then starts a private server).
    """


#: Printed before the worker starts, so that the log lines of the failures the
#: scenarios provoke on purpose do not read as the demo going wrong.
SIMULATED_NOTE = (
    "Starting the worker. Some scenarios make their executor crash, or give the worker a "
    "job it must refuse, so the log below has errors and warnings: they are simulated on "
    "purpose and marked [cyan]EXPECTED[/]. A line marked ERROR or WARNING would be a real "
    "problem; the tables check how every job ended."
)


class DemoLog(RichHandler):
    """
    The library's log lines, drawn through the demo's console, one line each.

    Through the console, so that they appear above the live progress display
    instead of tearing it; one line each, because the demo's crashes are
    simulated and their tracebacks would only bury the story. The lines the
    scenarios provoke on purpose (a `SimulatedCrash`, and the one warning with
    which the worker refuses each job staged to be refused) are marked
    EXPECTED and dimmed; every other line keeps its level and colour, so a real
    problem still stands out.
    """

    def __init__(self, console: Console) -> None:
        super().__init__(console=console, show_path=False, show_time=False)
        self.setFormatter(_OneLineFormatter("%(name)s: %(message)s"))
        self._refusals: set[str] = set()
        #: Whether the record being emitted is an expected one (set by `emit`).
        self._expected = False

    @classmethod
    @contextmanager
    def shown(cls, console: Console, level: str) -> Iterator[DemoLog]:
        """Show the ``nasiko_queue`` loggers' records from `level` up, for the block."""
        handler = cls(console)
        logger = logging.getLogger("nasiko_queue")
        old_level = logger.level
        logger.addHandler(handler)
        logger.setLevel(level.upper())
        try:
            yield handler
        finally:
            logger.removeHandler(handler)
            logger.setLevel(old_level)

    def expect_refusal(self, job_id: UUID) -> None:
        """The worker will refuse this job on purpose; its first warning is expected."""
        self._refusals.add(str(job_id))

    def is_expected(self, record: logging.LogRecord) -> bool:
        """Whether a scenario provoked this record on purpose (each refusal counts once)."""
        error = getattr(record, "job_error", None)  # a crash, as the worker logs it
        if error is not None:
            return bool(error.error_type == _SIMULATED)
        exc = record.exc_info[1] if record.exc_info else None
        if exc is not None:
            return all(isinstance(leaf, SimulatedCrash) for leaf in leaves(exc))
        if record.levelno != logging.WARNING:
            return False
        message = record.getMessage()
        for job_id in self._refusals:
            if job_id in message:
                self._refusals.discard(job_id)
                return True
        return False

    def emit(self, record: logging.LogRecord) -> None:
        self._expected = self.is_expected(record)
        super().emit(record)

    def get_level_text(self, record: logging.LogRecord) -> Text:
        if self._expected:
            return Text("EXPECTED", style="cyan")
        return super().get_level_text(record)

    def render_message(self, record: logging.LogRecord, message: str) -> ConsoleRenderable:
        rendered = super().render_message(record, message)
        if self._expected and isinstance(rendered, Text):
            rendered.stylize("dim")
        return rendered


#: How a kept error names the demo's crashes (`JobError.error_type`).
_SIMULATED = f"{SimulatedCrash.__module__}.{SimulatedCrash.__qualname__}"


class _OneLineFormatter(logging.Formatter):
    """Formats a record without its traceback, naming the innermost exception instead."""

    def format(self, record: logging.LogRecord) -> str:
        saved = record.exc_info, record.exc_text
        record.exc_info, record.exc_text = None, None
        try:
            text = super().format(record)
        finally:
            record.exc_info, record.exc_text = saved
        error = getattr(record, "job_error", None)
        if error is not None:  # the message's first line, and the error in short
            lines = error.message.strip().splitlines()
            return (text.splitlines()[0].rstrip(":") +
                    f" ({error.error_type.rsplit('.', 1)[-1]}: {lines[0] if lines else ''})")
        exc = record.exc_info[1] if record.exc_info else None
        if exc is not None:
            leaf = next(iter(leaves(exc)))
            lines = str(leaf).strip().splitlines()
            text += f" ({type(leaf).__name__}: {lines[0] if lines else ''})"
        return text




async def run_demo(
    dsn: str,
    *,
    console: Console,
    delay: float = DEFAULT_DELAY,
    give_up_after: float = DEFAULT_GIVE_UP_AFTER,
    log_level: str | None = None,
) -> DemoReport:
    """
    Migrate `dsn`, enqueue every scenario, drain them with a real `Worker`, report.

    Args:
        dsn: a scratch database (it keeps the demo's rows afterwards).
        console: where the progress display and the report are drawn.
        delay: seconds each simulated build step sleeps; 0 in tests.
        give_up_after: seconds to wait for the jobs; then the worker is
            cancelled and the unfinished scenarios are reported as mismatches.
        log_level: show the library's log from this level up through `console`,
            the lines the scenarios provoke on purpose marked EXPECTED (None:
            leave logging alone).

    Raises:
        BusyDatabase: the database has pending or running jobs of its own.
    """
    if log_level is None:
        return await _run_demo(dsn, console, delay, give_up_after, None)
    with DemoLog.shown(console, log_level) as log:
        return await _run_demo(dsn, console, delay, give_up_after, log)


async def _run_demo(
    dsn: str, console: Console, delay: float, give_up_after: float, log: DemoLog | None
) -> DemoReport:
    async with open_database(dsn) as db:
        applied = await migrate(db)
        console.print(escape(f"Schema: applied {', '.join(applied)}.") if applied
                      else "Schema: up to date.")
        await _refuse_busy(db)
        if log is not None:
            console.print(SIMULATED_NOTE)
        console.print("[bold]Part 1: the job queue[/] (plain jobs, retries, a dead letter, "
                      "an awaited result, a workflow, a schedule).")
        tour = tuple(await run_tour(db, give_up_after=give_up_after))
        render_tour(console, list(tour))
        console.print("[bold]Part 2: the Nasiko build worker[/], an application of the "
                      "queue (simulated container builds).")
        box = SecretBox.from_base64(generate_master_key())
        config = QueueConfig(poll_interval=0.5, recovery_interval=30.0)
        queue = Queue(db, config=config, secrets=box)
        world = SimulatedWorld(delay=delay)
        staged = [await _stage(queue, scenario) for scenario in SCENARIOS]
        for item in staged:
            world.add(item)
        kinds = sorted({s.kind for s in SCENARIOS})
        console.print(escape(f"Enqueued {len(staged)} jobs of {len(kinds)} kinds: "
                             f"{', '.join(kinds)}."))
        at_rest = await _secret_at_rest(db, staged)
        if log is not None:
            for item in staged:
                if item.scenario.refused:
                    log.expect_refusal(item.job_id)

        worker = Worker(queue, world.executors())
        async with trio.open_nursery() as nursery:
            await nursery.start(worker.run)
            finished = False
            with trio.move_on_after(give_up_after):
                await _show_progress(db, staged, console)
                finished = True
            if finished:
                worker.stop()  # graceful: an executor still running finishes first
            else:
                nursery.cancel_scope.cancel()
        rows = tuple([await _observe(db, item, world, at_rest) for item in staged])
    report = DemoReport(rows, tour)
    _render(console, report)
    return report


async def _refuse_busy(db: Database) -> None:
    counts = {row["status"]: row["n"] for row in await db.fetch(Q.jobs_count_by_status)}
    busy = counts.get("pending", 0) + counts.get("in_progress", 0)
    # The tour's worker would run (and give back, unknown) plain jobs of its queues.
    busy += await db.fetchval(Q.demo_plain_unfinished, [*TOUR_QUEUES, "workflows"])
    if busy:
        raise BusyDatabase(
            f"the database has {busy} unfinished job(s); the demo's simulated executors would "
            "run them. Use a scratch database, or omit --dsn for a private one"
        )


async def _stage(queue: Queue, scenario: Scenario) -> Staged:
    """Put one scenario's rows and job into the database, as its setup says."""
    name = f"{scenario.key}-{uuid.uuid4().hex[:6]}"
    if scenario.setup is Setup.INVALID_PAYLOAD:
        return await _stage_invalid(queue, scenario, name)
    secret = f"demo-{secrets.token_hex(8)}" if scenario.with_secret else None
    enqueued = await enqueue_with_target(
        queue,
        scenario.kind,
        name=name,
        agent_status=scenario.agent_status,
        prior_success=scenario.prior_success,
        deleted=scenario.setup is Setup.SOFT_DELETED,
        env={_DEMO_ENV_KEY: secret} if secret else None,
    )
    if scenario.setup is Setup.ATTEMPTS_USED:
        await queue.db.execute(Q.job_set_attempt, enqueued.job_id, queue.config.build_max_attempts)
    return Staged(scenario=scenario, job_id=enqueued.job_id, build_id=enqueued.build_id,
                  target_id=enqueued.target_id, secret=secret)


async def _stage_invalid(queue: Queue, scenario: Scenario, name: str) -> Staged:
    """
    A job whose payload no codec accepts, written past `enqueue` as a bug or an old release might.

    It names its build and agent (so the worker can end that build row) but
    lacks every other required field.
    """
    owner = uuid.uuid4()
    async with queue.db.transaction() as tx:
        agent = await insert_agent(tx, owner_id=owner, name=name, status=scenario.agent_status)
        if scenario.prior_success:
            await insert_agent_build(tx, agent, status="success", version_tag="v0")
        build = await insert_agent_build(tx, agent)
        payload = {"kind": scenario.kind, "build_id": str(build), "agent_id": str(agent)}
        job_id = await tx.fetchval(Q.job_insert, agent, None, owner, json.dumps(payload))
    return Staged(scenario=scenario, job_id=job_id, build_id=build, target_id=agent)


async def _secret_at_rest(db: Database, staged: Sequence[Staged]) -> dict[UUID, str]:
    """
    For each job with a secret: what its payload column holds for that key.

    Read before the worker runs, as anybody with SELECT on build_jobs would see it.
    """
    found: dict[UUID, str] = {}
    for item in staged:
        if item.secret is None:
            continue
        row = await db.fetchrow(Q.job_get, item.job_id)
        text = row["payload"] if row else ""
        if item.secret in text:
            found[item.job_id] = "PLAINTEXT"
        else:
            stored = json.loads(text).get("env", {}).get(_DEMO_ENV_KEY, "") if text else ""
            found[item.job_id] = stored
    return found


async def _show_progress(db: Database, staged: Sequence[Staged], console: Console) -> None:
    """
    Draw jobs finished / total until every job is done, failed or gone.

    Reads the rows rather than the worker's counters: a job whose target was
    deleted is finished too, though the worker never marked it.
    """
    ids = [item.job_id for item in staged]
    total = len(ids)
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn())
    with Progress(*columns, console=console, auto_refresh=False) as progress:
        task = progress.add_task("jobs finished", total=total)
        while True:
            unfinished = await db.fetchval(Q.jobs_count_unfinished, ids)
            progress.update(task, completed=total - unfinished)
            progress.refresh()
            if unfinished == 0:
                return
            await trio.sleep(PROGRESS_EVERY)


async def _observe(
    db: Database, staged: Staged, world: SimulatedWorld, at_rest: Mapping[UUID, str]
) -> DemoRow:
    scenario = staged.scenario
    runs = world.runs.get(staged.build_id, [])
    job = await db.fetchrow(Q.job_get, staged.job_id)
    if job is None:
        job_status, attempt, error = "gone", (runs[-1] if runs else 0), None
    else:
        job_status, attempt, error = job["status"], job["attempt"], job["error_msg"]
    if scenario.is_connector:
        build = await db.fetchval(Q.connector_build_get_status, staged.build_id)
        target = await _connector_state(db, staged.target_id)
    else:
        build = await db.fetchval(Q.agent_build_get_status, staged.build_id)
        target = await _agent_state(db, staged.target_id)
    observed = Outcome(job=job_status, attempt=attempt, error_msg=error, build=build or "gone",
                       target=target, runs=len(runs))
    note, note_ok = _secret_note(staged, world, at_rest)
    return DemoRow(kind=scenario.kind, scenario=scenario.description, observed=observed,
                   expected=scenario.expected, note=note, note_ok=note_ok)


async def _agent_state(db: Database, agent_id: UUID) -> str:
    row = await db.fetchrow(Q.agent_get, agent_id)
    if row is None:
        return "deleted"
    status: str = row["status"]
    return f"soft-deleted ({status})" if row["soft_deleted"] else status


async def _connector_state(db: Database, connector_id: UUID) -> str:
    row = await db.fetchrow(Q.connector_get, connector_id)
    if row is None:
        return "deleted"
    return str(row["build_status"])


def _secret_note(
    staged: Staged, world: SimulatedWorld, at_rest: Mapping[UUID, str]
) -> tuple[str, bool]:
    if staged.secret is None:
        return "", True
    stored = at_rest.get(staged.job_id, "")
    sealed = stored.startswith("nq1:")
    received = world.secret_received.get(staged.build_id, False)
    shown = "the plaintext (!)" if stored == "PLAINTEXT" else f"{stored[:16]}… (sealed)"
    note = (f"payload column: {_DEMO_ENV_KEY} = {shown}; "
            f"executor {'received' if received else 'did NOT receive'} the plaintext")
    return note, sealed and received


#: Short names for the fixed error strings of docs/rules.md §5, to keep the report narrow;
#: the report prints the full strings under the table.
_ERROR_NAMES: Mapping[str, str] = {
    BUILD_FAILED: "build failed",
    JOB_PANICKED: "panicked",
    TARGET_DELETED: "target deleted",
    INVALID_PAYLOAD: "invalid payload",
    MAX_ATTEMPTS_EXCEEDED: "max attempts",
}


def _abbreviate(error_msg: str | None) -> str:
    if error_msg is None:
        return "-"
    return _ERROR_NAMES.get(error_msg, error_msg)


def _render(console: Console, report: DemoReport) -> None:
    table = Table(title="nasiko-queue demo: every path a job can take", box=box.SIMPLE_HEAD)
    table.add_column("", no_wrap=True)
    table.add_column("kind: scenario", ratio=3, min_width=24)
    for header in ("job", "error_msg", "build", "target", "runs"):
        table.add_column(header)
    table.add_column("expected (docs/rules.md)", ratio=2, min_width=20)
    for row in report.rows:
        cells = [
            escape(value) if value == want else f"[red]{escape(value)}[/]"
            for value, want in zip(row.observed.cells(), row.expected.cells(), strict=True)
        ]
        mark = "[green]✓[/]" if row.ok else "[bold red]✗[/]"
        table.add_row(mark, f"[bold]{escape(row.kind)}[/]: {escape(row.scenario)}", *cells,
                      escape(row.expected.summary()))
    console.print(table)
    shown = {row.observed.error_msg for row in report.rows} | {
        row.expected.error_msg for row in report.rows}
    if any(row.observed.job == "gone" for row in report.rows):
        console.print("  [dim]gone #n[/] = the job row was deleted with its target; "
                      "n is the last attempt its executor saw")
    for full, short in _ERROR_NAMES.items():
        if full in shown:
            console.print(f"  [dim]{short}[/] = {escape(repr(full))}")
    for row in report.rows:
        if row.note:
            mark = "[green]✓[/]" if row.note_ok else "[bold red]✗[/]"
            console.print(f"{mark} {escape(row.kind)} secret: {escape(row.note)}")
    bad = [row for row in report.rows if not row.ok]
    tour_bad = [row for row in report.tour if not row.ok]
    if tour_bad:
        console.print(f"[bold red]✗ {len(tour_bad)} of {len(report.tour)} job-queue "
                      "scenarios did not end as they must.[/]")
    if bad:
        console.print(f"[bold red]✗ {len(bad)} of {len(report.rows)} scenarios did not end as "
                      "docs/rules.md says.[/]")
    else:
        console.print(f"[bold green]✓ All {len(report.rows)} scenarios ended as docs/rules.md "
                      "says.[/]")
