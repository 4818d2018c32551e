"""
The ``nasiko-queue`` command: migrate, run a worker, inspect or prune the queue, make a key, demo.

Thin on purpose: each command parses its options, calls the public API inside one
`trio.run`, and renders the result. Everything worth testing without a terminal
lives elsewhere (`status.queue_status`, `demo.run_demo`).

Errors are for operators, not for developers: a database that cannot be reached,
a wrong DSN or a schema that is not migrated ends the command with one line on
stderr and exit code 1 (2 for a usage error such as a missing ``--dsn``), never
with a traceback. The DSN's password never appears in any message. The one
exception is `worker` facing a server that is down or starting: it logs one line
per try and waits for it (docs/rules.md §5), as it does for an outage once running.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from datetime import timedelta
from typing import Any, TypeVar
from urllib.parse import urlsplit

import asyncpg
import attrs
import click
import trio
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from . import __version__
from ._sql import Q
from .config import QueueConfig
from .database import Database, open_database
from .demo import DemoReport, run_demo
from .embedded import EmbeddedPostgres
from .errors import ConfigurationError, NasikoQueueError, is_transient
from .executors import Executors
from .job_admin import (
    STATES,
    BulkResult,
    JobFilter,
    JobNotFound,
    JobRefused,
    JobSummary,
    cancel,
    count_matching,
    discard,
    discard_matching,
    list_jobs,
    retry,
    retry_matching,
)
from .job_errors import JobError, job_errors
from .job_view import JobView, job_view
from .migrate import load_migrations, migrate
from .payloads import McpServerUpload
from .queue import Queue
from .retention import BATCH_SIZE, parse_duration, prune
from .schedules import Schedule
from .secrets import SecretBox, generate_master_key
from .status import QueueStatus, queue_status
from .worker import Worker

log = logging.getLogger("nasiko_queue.cli")

T = TypeVar("T")

#: Where the worker's master key comes from. Never a command-line option: those
#: are visible to every user of the machine in `ps`.
MASTER_KEY_ENV = "NASIKO_QUEUE_MASTER_KEY"
#: The dashboard's login token (`dashboard --token`, `worker --http --dashboard`).
DASHBOARD_TOKEN_ENV = "NASIKO_QUEUE_DASHBOARD_TOKEN"  # noqa: S105 (a variable's name)

#: Exit code of a worker stopped by a second signal (128 + SIGINT, as shells report
#: Ctrl-C), so that scripts can tell a hard stop from a clean one.
EXIT_HARD_STOP = 130

_LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


# -- errors -----------------------------------------------------------------------


class OperatorError(click.ClickException):
    """
    A mistake in how the command was called (no DSN, a bad key, a wrong --executors).

    One line and exit code 2, like click's usage errors, but without the usage
    text: the message already says what to change.
    """

    exit_code = 2


def _where(dsn: str) -> str:
    """The DSN as it may be shown: host, port and database, never user or password."""
    try:
        parts = urlsplit(dsn)
        host = parts.hostname or "localhost"
        port = parts.port or 5432
    except ValueError:
        return "the database"
    database = parts.path.lstrip("/") or "(default database)"
    return f"{host}:{port}/{database}"


def _check_dsn(dsn: str) -> None:
    """Refuse a malformed DSN up front, where the message can say what is wrong."""
    try:
        parts = urlsplit(dsn)
        parts.port  # noqa: B018 - parsing the port is the check
    except ValueError as exc:
        raise OperatorError(f"--dsn is not a valid database URL ({exc})") from None
    if parts.scheme not in ("postgresql", "postgres"):
        raise OperatorError("--dsn must be a URL like postgresql://user@host:5432/database")


def _leaves(exc: BaseException) -> Iterator[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            yield from _leaves(inner)
    else:
        yield exc


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__


def _explain(exc: BaseException, dsn: str | None) -> str | None:
    """
    One line for an error an operator can fix, or None for a bug (which keeps its traceback).

    Exceptions may arrive wrapped in exception groups by the nurseries they crossed;
    the message is that of the first leaf the operator can do something about.
    """
    where = _where(dsn) if dsn else "the database"
    for leaf in _leaves(exc):
        if isinstance(leaf, asyncpg.UndefinedTableError):
            return (f"{where} has no nasiko-queue schema ({_first_line(leaf)}); "
                    "run `nasiko-queue migrate` first")
        if isinstance(leaf, asyncpg.PostgresError):
            return f"database error at {where}: {_first_line(leaf)}"
        if isinstance(leaf, asyncpg.InterfaceError):
            return f"cannot use {where}: {_first_line(leaf)}"
        if isinstance(leaf, TimeoutError):
            return f"timed out talking to {where}"
        if isinstance(leaf, OSError):
            return f"cannot connect to {where}: {leaf.strerror or _first_line(leaf)}"
        if isinstance(leaf, NasikoQueueError):
            return _first_line(leaf)
    return None


def _run(dsn: str | None, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
    """`trio.run(fn, *args)`, with operator errors turned into one-line CLI errors."""
    try:
        return trio.run(fn, *args)
    except KeyboardInterrupt:
        click.echo("interrupted", err=True)
        sys.exit(EXIT_HARD_STOP)
    except Exception as exc:
        message = _explain(exc, dsn)
        if message is None:
            raise
        raise click.ClickException(message) from None


# -- options ----------------------------------------------------------------------


def _require_dsn(dsn: str | None) -> str:
    if not dsn:
        raise OperatorError("no database given: pass --dsn or set DATABASE_URL")
    _check_dsn(dsn)
    return dsn


dsn_option = click.option(
    "--dsn",
    envvar="DATABASE_URL",
    show_envvar=True,
    metavar="URL",
    help="PostgreSQL URL, e.g. postgresql://user@host:5432/database.",
)

stuck_option = click.option(
    "--stuck-job-mins",
    type=click.IntRange(min=1),
    default=QueueConfig().stuck_job_mins,
    show_default=True,
    help="A job in progress for longer than this counts as stuck.",
)


def _log_level_option(default: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    return click.option(
        "--log-level",
        type=click.Choice(_LOG_LEVELS, case_sensitive=False),
        default=default,
        show_default=True,
        help="Log messages at this level and above (to stderr).",
    )


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="nasiko-queue")
def main() -> None:
    """A durable job queue on PostgreSQL: run workers and look after the queue."""


# -- migrate ----------------------------------------------------------------------


@main.command("migrate", short_help="Bring the database schema up to date.")
@dsn_option
def migrate_command(dsn: str | None) -> None:
    """Bring the database schema up to date (safe to run again, and from many hosts)."""
    dsn = _require_dsn(dsn)

    async def go() -> list[str]:
        async with open_database(dsn) as db:
            return await migrate(db)

    applied = _run(dsn, go)
    if applied:
        click.echo(f"applied migrations: {', '.join(applied)}")
    else:
        click.echo("schema is up to date")


# -- worker -----------------------------------------------------------------------


def _import_attribute(spec: str, option: str) -> Any:
    """Import ``module:attribute`` for `option`; the current directory is importable."""
    module_name, sep, attr_path = spec.partition(":")
    if not sep or not module_name or not attr_path:
        raise OperatorError(f"{option}: expected module:attribute, e.g. myapp.jobs:executors")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        target: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise OperatorError(f"{option}: cannot import {module_name!r}: {exc}") from None
    for part in attr_path.split("."):
        try:
            target = getattr(target, part)
        except AttributeError:
            raise OperatorError(
                f"{option}: {module_name!r} has no attribute {attr_path!r}"
            ) from None
    return target


def load_executors(spec: str) -> Executors:
    """
    Import ``module:attribute`` and return the `Executors` it names.

    The attribute may be an `Executors` or a callable taking no arguments that
    returns one (so that an application can build its registry lazily). The
    current directory is importable, as for ``python -m``, so that a project's
    own modules are found when the command runs from the project's folder.
    """
    target = _import_attribute(spec, "--executors")
    if not isinstance(target, Executors) and callable(target):
        target = target()
    if not isinstance(target, Executors):
        raise OperatorError(
            f"--executors: {spec} is a {type(target).__name__}, not an Executors "
            "(or a function with no arguments that returns one)"
        )
    if not len(target):
        raise OperatorError(f"--executors: {spec} has no executor registered")
    return target


def _master_key() -> SecretBox | None:
    text = os.environ.get(MASTER_KEY_ENV)
    if not text:
        return None
    try:
        return SecretBox.from_base64(text)
    except ConfigurationError as exc:
        raise OperatorError(f"{MASTER_KEY_ENV}: {exc}") from None


@attrs.define
class _Shutdown:
    """What the signals asked for so far (the first stops gently, the second at once)."""

    graceful: bool = False
    hard: bool = False
    #: Set by the first signal (wakes a worker still waiting for its database).
    requested: trio.Event = attrs.Factory(trio.Event)


async def _watch_signals(
    signals: AsyncIterator[int], worker: Worker, scope: trio.CancelScope, shutdown: _Shutdown
) -> None:
    """First SIGINT/SIGTERM: `worker.stop()` (docs/rules.md §8, graceful). Second: hard stop."""
    async for signum in signals:
        name = signal.Signals(signum).name
        if not shutdown.graceful:
            shutdown.graceful = True
            shutdown.requested.set()
            log.info("%s: stopping once the running jobs finish (send it again to stop now)",
                     name)
            worker.stop()
        else:
            shutdown.hard = True
            log.warning("%s again: stopping now; running jobs go back to pending", name)
            scope.cancel()
            return


async def _check_schema(db: Database) -> None:
    """
    Fail fast on a database the worker cannot use.

    The worker itself never gives up on the database (it waits and reconnects,
    docs/rules.md §5), which is right once it runs, but a wrong DSN or an unmigrated
    database at startup is a mistake to report, not an outage to wait out.
    """
    applied = {row["version"] for row in await db.fetch(Q.migrations_applied)}
    missing = [m.version for m in load_migrations() if m.version not in applied]
    if missing:
        raise NasikoQueueError(
            f"the database schema is not up to date (missing {', '.join(missing)}); "
            "run `nasiko-queue migrate` first"
        )


def _unreachable(exc: BaseException) -> bool:
    """
    Whether `exc` is an outage to wait out: the one list of transient errors
    (`errors.is_transient`) that the worker and the sweep use too.

    One case differs at start-up: a host name that does not resolve is taken as
    a mistake in the DSN and reported, like anything the server itself refuses
    (no such database, a wrong password, no schema).
    """
    if any(isinstance(leaf, socket.gaierror) for leaf in _leaves(exc)):
        return False
    return is_transient(exc)


async def _check_schema_when_up(
    db: Database, dsn: str, config: QueueConfig, shutdown: _Shutdown
) -> bool:
    """
    `_check_schema`, waiting out a server that cannot be reached yet.

    docs/rules.md §5: losing the database makes the worker wait and reconnect, never exit;
    that holds at startup too (a worker may come up before its database). Returns
    False when a signal asked the worker to stop before the database answered.
    """
    delay = config.retry_initial_delay
    while True:
        try:
            await _check_schema(db)
            return True
        except Exception as exc:
            if not _unreachable(exc):
                raise
            log.warning("%s; retrying in %.1fs", _explain(exc, dsn), delay)
        with trio.move_on_after(delay):
            await shutdown.requested.wait()
        if shutdown.requested.is_set():
            return False
        delay = min(delay * 2, config.retry_max_delay)


async def _work(dsn: str, executors: Executors, config: QueueConfig,
                secrets: SecretBox | None, schedules: Sequence[Schedule] = (),
                http: tuple[str, int] | None = None, with_dashboard: bool = False) -> int:
    shutdown = _Shutdown()
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with open_database(dsn) as db:
            queue = Queue(db, config=config, secrets=secrets)
            worker = Worker(queue, executors, schedules=schedules)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_watch_signals, signals, worker, nursery.cancel_scope,
                                   shutdown)
                if http is not None:
                    # Imported only here: the [http] extra stays optional (checked
                    # by `_parse_http` before anything runs).
                    from .web.server import HttpService

                    dashboard = None
                    if with_dashboard:
                        from .web.dashboard import dashboard_app

                        token = os.environ.get(DASHBOARD_TOKEN_ENV) or None
                        dashboard = dashboard_app(db, token=token, read_only=token is None,
                                                  config=config, schedules=schedules)
                    service = HttpService(queue, worker, host=http[0], port=http[1],
                                          dashboard=dashboard)
                    await nursery.start(service.run)
                if await _check_schema_when_up(db, dsn, config, shutdown):
                    await worker.run()
                nursery.cancel_scope.cancel()
    return EXIT_HARD_STOP if shutdown.hard else 0


def _parse_http(_ctx: click.Context, _param: click.Parameter,
                value: str | None) -> tuple[str, int] | None:
    """`--http HOST:PORT`: where to serve health and metrics; needs the [http] extra."""
    if value is None:
        return None
    from .web.bind import parse_bind

    try:
        bind = parse_bind(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from exc
    try:
        import nasiko_queue.web.server  # noqa: F401
    except ImportError as exc:
        raise OperatorError(str(exc)) from None
    return bind


@main.command("worker", short_help="Run jobs until stopped.")
@dsn_option
@click.option("--executors", "executors_spec", required=True, metavar="MODULE:ATTRIBUTE",
              help="Where the Executors registry is, e.g. myapp.jobs:executors.")
@click.option("--concurrency", type=click.IntRange(min=1), default=1, show_default=True,
              envvar="NASIKO_QUEUE_CONCURRENCY", show_envvar=True,
              help="Build jobs run at once by this process; also the concurrency of each "
                   "queue of --queues that names none.")
@click.option("--queues", "queues_spec", metavar="NAME[=N],...", default=None,
              envvar="NASIKO_QUEUE_QUEUES", show_envvar=True,
              help="The queues of plain jobs this process runs, each with how many jobs at "
                   "once, e.g. 'default=10,email=2'. Default: every queue the registered "
                   "plain job types name, --concurrency each. 'none': no plain jobs.")
@click.option("--builds/--no-builds", default=True, show_default=True,
              envvar="NASIKO_QUEUE_BUILDS", show_envvar=True,
              help="Whether this process runs build jobs (when build executors are "
                   "registered).")
@click.option("--prefetch", type=click.IntRange(min=0), default=0, show_default=True,
              help="Jobs claimed ahead of the free slots, for throughput on short jobs. "
                   "A stop gives unstarted ones back with their attempt restored.")
@click.option("--poll-interval", type=click.FloatRange(min=0, min_open=True),
              default=QueueConfig().poll_interval, show_default=True,
              help="Seconds of quiet before looking for jobs again.")
@stuck_option
@click.option("--recovery-interval", type=click.FloatRange(min=0, min_open=True),
              default=QueueConfig().recovery_interval, show_default=True,
              help="Seconds between sweeps for stuck jobs.")
@click.option("--max-attempts", type=click.IntRange(min=1),
              default=QueueConfig().max_attempts, show_default=True,
              help="Runs per job (a crash is retried at once while runs remain) before it "
                   "fails for good. Replicas sharing a table should agree on it.")
@click.option("--heartbeat-interval", type=click.FloatRange(min=0, min_open=True),
              default=QueueConfig().heartbeat_interval, show_default=True,
              help="Seconds between heartbeats of this worker's row.")
@click.option("--lease", type=click.FloatRange(min=0, min_open=True),
              default=QueueConfig().lease, show_default=True,
              help="Seconds without a heartbeat after which a worker counts as dead and the "
                   "leader gives its jobs back (at least three heartbeat intervals).")
@click.option("--rescue-interval", type=click.FloatRange(min=0, min_open=True),
              default=QueueConfig().rescue_interval, show_default=True,
              help="Seconds between the leader's rescues of dead workers' jobs.")
@click.option("--schedules", "schedules_spec", metavar="MODULE:ATTRIBUTE", default=None,
              envvar="NASIKO_QUEUE_SCHEDULES", show_envvar=True,
              help="Cron schedules whose ticks this process enqueues: a sequence of "
                   "Schedule (or a function returning one), e.g. myapp.jobs:schedules.")
@click.option("--scheduler/--no-scheduler", default=True, show_default=True,
              envvar="NASIKO_QUEUE_SCHEDULER", show_envvar=True,
              help="Whether this process runs the cron scheduler for --schedules (every "
                   "replica may: each tick is enqueued once).")
@click.option("--maintenance/--no-maintenance", default=True, show_default=True,
              envvar="NASIKO_QUEUE_MAINTENANCE", show_envvar=True,
              help="Whether this worker stands for the maintenance leadership (rescue, "
                   "the stuck sweep, retention).")
@click.option("--claim-synchronous-commit/--no-claim-synchronous-commit", default=True,
              show_default=True,
              help="Whether a claim sent on its own waits for its commit to reach the disk. "
                   "Off: a little less from wake to start, but a server crash can forget "
                   "the last moments' claims while their jobs run, and those run twice.")
@click.option("--job-timeout", type=click.FloatRange(min=0, min_open=True), default=None,
              help="Run-time limit of every job, in seconds; a run past it is cancelled "
                   "and counts as a crash. Default: none.")
@click.option("--http", "http", metavar="HOST:PORT", default=None, callback=_parse_http,
              envvar="NASIKO_QUEUE_HTTP", show_envvar=True,
              help="Serve /health/live, /health/ready and /metrics (Prometheus) there, e.g. "
                   "127.0.0.1:9181. Needs the [http] extra. Default: off.")
@click.option("--dashboard", "with_dashboard", is_flag=True,
              help="With --http: serve the dashboard there too (actions need "
                   "NASIKO_QUEUE_DASHBOARD_TOKEN; without it, read-only).")
@_log_level_option("INFO")
def worker_command(
    dsn: str | None,
    executors_spec: str,
    concurrency: int,
    queues_spec: str | None,
    builds: bool,
    prefetch: int,
    poll_interval: float,
    stuck_job_mins: int,
    recovery_interval: float,
    max_attempts: int,
    heartbeat_interval: float,
    lease: float,
    rescue_interval: float,
    schedules_spec: str | None,
    scheduler: bool,
    maintenance: bool,
    claim_synchronous_commit: bool,
    job_timeout: float | None,
    http: tuple[str, int] | None,
    with_dashboard: bool,
    log_level: str,
) -> None:
    """
    Run jobs until stopped.

    The first SIGINT or SIGTERM stops gracefully: nothing more is claimed, the
    running jobs finish, and the exit code is 0. A second signal stops at once:
    running jobs are cancelled and put back to pending (their attempt stays
    counted), and the exit code is 130, so that a script can tell the two apart.

    The secrets master key, needed to run McpServerUpload jobs with env values,
    is read from NASIKO_QUEUE_MASTER_KEY (base64; see `nasiko-queue keygen`).

    Roles: by default one process runs everything its executors cover (the
    build jobs, every queue, maintenance). To scale them apart, run several
    with --queues, --no-builds and --no-maintenance (or the environment
    variables shown), e.g. one for builds and maintenance and one for
    `--no-builds --no-maintenance --queues email=20`.
    """
    dsn = _require_dsn(dsn)
    queues = parse_queues(queues_spec, concurrency)
    logging.basicConfig(level=log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    executors = load_executors(executors_spec)
    runs_builds = builds and bool(executors.kinds)
    runs_queues = bool(queues) if queues is not None else bool(executors.plain_types)
    if not (runs_builds or runs_queues):
        raise click.UsageError(
            "this worker would run nothing: "
            + ("--no-builds, and " if executors.kinds else "no build executors, and ")
            + ("no queue (--queues)" if queues is not None else "no plain job types"))
    secrets = _master_key()
    if secrets is None and McpServerUpload.kind in executors.kinds:
        log.warning("%s is not set: secret env values of McpServerUpload jobs will be dropped",
                    MASTER_KEY_ENV)
    try:
        config = QueueConfig(concurrency=concurrency, prefetch=prefetch,
                             poll_interval=poll_interval, stuck_job_mins=stuck_job_mins,
                             recovery_interval=recovery_interval, max_attempts=max_attempts,
                             heartbeat_interval=heartbeat_interval, lease=lease,
                             rescue_interval=rescue_interval, maintenance=maintenance,
                             job_timeout=job_timeout, queues=queues, builds=builds,
                             scheduler=scheduler,
                             claim_synchronous_commit=claim_synchronous_commit)
    except ConfigurationError as exc:
        raise click.UsageError(str(exc)) from exc
    schedules = load_schedules(schedules_spec) if schedules_spec else ()
    if with_dashboard and http is None:
        raise click.UsageError("--dashboard is served on --http HOST:PORT: give both")
    # `http` only when given: without it, `_work` is called exactly as before.
    extra: tuple[object, ...] = ()
    if http is not None:
        extra = (http, with_dashboard)
    sys.exit(_run(dsn, _work, dsn, executors, config, secrets, schedules, *extra))


def load_schedules(spec: str) -> tuple[Schedule, ...]:
    """``module:attribute`` naming a sequence of `Schedule` (or a function returning one)."""
    target = _import_attribute(spec, "--schedules")
    if callable(target) and not isinstance(target, Schedule):
        target = target()
    items = (target,) if isinstance(target, Schedule) else target
    if not isinstance(items, Sequence) or not all(isinstance(s, Schedule) for s in items):
        raise OperatorError(f"--schedules: {spec} is not a sequence of Schedule (or a "
                            "function with no arguments that returns one)")
    return tuple(items)


def parse_queues(spec: str | None, default: int) -> dict[str, int] | None:
    """``"default=10,email"`` as ``{"default": 10, "email": default}``; None for None."""
    if spec is None:
        return None
    spec = spec.strip()
    if spec.lower() == "none":
        return {}
    queues: dict[str, int] = {}
    for item in spec.split(","):
        name, sep, count = item.strip().partition("=")
        name = name.strip()
        if not name:
            raise click.BadParameter(f"{spec!r}: expected NAME[=N],..., e.g. default=10,email=2",
                                     param_hint="--queues")
        try:
            queues[name] = int(count) if sep else default
        except ValueError:
            raise click.BadParameter(f"{item.strip()!r}: N must be a whole number",
                                     param_hint="--queues") from None
    return queues


# -- status -----------------------------------------------------------------------


@main.command("dashboard", short_help="Serve the web dashboard (needs the [http] extra).")
@dsn_option
@click.option("--bind", default="127.0.0.1:9182", show_default=True, metavar="HOST:PORT",
              help="Where to listen. Only this machine by default: expose it on purpose.")
@click.option("--token", envvar=DASHBOARD_TOKEN_ENV, show_envvar=True,
              default=None, metavar="TOKEN",
              help="What the login form asks for before any action. Without it the "
                   "dashboard is read-only.")
@click.option("--read-only", is_flag=True, help="Show no actions and refuse every one.")
@click.option("--schedules", "schedules_spec", metavar="MODULE:ATTRIBUTE", default=None,
              help="The worker's schedules, to show their cron expressions and next runs.")
@stuck_option
def dashboard_command(dsn: str | None, bind: str, token: str | None, read_only: bool,
                      schedules_spec: str | None, stuck_job_mins: int) -> None:
    """
    Serve the web dashboard: queues, jobs, dead letters, workers, schedules;
    retry, cancel, discard and pause/resume behind a token.
    """
    dsn = _require_dsn(dsn)
    try:
        from hypercorn.config import Config as HypercornConfig
        from hypercorn.trio import serve

        from .web.dashboard import dashboard_app
    except ImportError as exc:
        raise OperatorError(f"`nasiko-queue dashboard` needs the [http] extra: "
                            f"pip install 'nasiko-queue[http]' ({exc})") from None
    schedules = load_schedules(schedules_spec) if schedules_spec else ()
    config = QueueConfig(stuck_job_mins=stuck_job_mins)
    hyper = HypercornConfig()
    hyper.bind = [bind]
    hyper.accesslog = None

    async def serve_dashboard() -> None:
        async with open_database(dsn) as db:
            app = dashboard_app(db, token=token or None, read_only=read_only, config=config,
                                schedules=schedules)
            mode = "read-only" if read_only or not token else "actions need the token"
            click.echo(f"dashboard on http://{bind}/ ({mode})", err=True)
            await serve(app, hyper)  # type: ignore[arg-type]

    _run(dsn, serve_dashboard)


@main.command("status", short_help="Show the queue's health.")
@dsn_option
@stuck_option
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of tables.")
def status_command(dsn: str | None, stuck_job_mins: int, as_json: bool) -> None:
    """Show job counts, held and stuck jobs, the pending backlog, and the claim's plan."""
    dsn = _require_dsn(dsn)

    async def go() -> QueueStatus:
        async with open_database(dsn) as db:
            return await queue_status(db, stuck_job_mins=stuck_job_mins)

    status = _run(dsn, go)
    if as_json:
        click.echo(json.dumps(status.to_json(), indent=2))
    else:
        _render_status(_wide_console(), status)


def _render_status(console: Console, status: QueueStatus) -> None:
    counts = Table(title="jobs by status")
    counts.add_column("status")
    counts.add_column("jobs", justify="right")
    for name, n in status.counts.items():
        counts.add_row(name, str(n))
    console.print(counts)

    held = Table(title="now", show_header=False)
    held.add_column("what")
    held.add_column("value")
    held.add_row("in progress", str(status.in_progress))
    held.add_row("oldest claim",
                 status.oldest_picked_at.isoformat() if status.oldest_picked_at else "-")
    stuck = f"{status.stuck} (over {status.stuck_job_mins} min)"
    held.add_row("stuck", f"[yellow]{stuck}[/]" if status.stuck else stuck)
    held.add_row("oldest pending",
                 "-" if status.oldest_pending_age is None
                 else _duration(status.oldest_pending_age))
    console.print(held)

    workers = Table(title="workers")
    for column in ("id", "host", "pid", "state", "heartbeat", "holding", "roles"):
        workers.add_column(column)
    for w in status.workers:
        state = "alive" if w.alive else ("dead" if w.dead_at else "[yellow]overdue[/]")
        workers.add_row(w.id[:8], escape(w.host), str(w.pid), state,
                        f"{w.heartbeat_age:.1f}s ago", str(w.holding),
                        ", ".join(w.roles) or "-")
    console.print(workers)

    if status.queues:
        queues = Table(title="queues of plain jobs")
        columns = ("available", "scheduled", "running", "completed", "discarded", "cancelled")
        queues.add_column("queue")
        for column in columns:
            queues.add_column(column, justify="right")
        queues.add_column("oldest due")
        for q in status.queues:
            age = q.oldest_available_age
            queues.add_row(escape(q.queue), *(str(getattr(q, c)) for c in columns),
                           "-" if age is None else _duration(age))
        console.print(queues)

    style = "bold yellow" if status.claim_plan.is_warning else "green"
    console.print(f"[{style}]{escape(status.claim_plan.describe())}[/]")


def _duration(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    if hours:
        return f"{hours}h {minutes:02d}m"
    if minutes:
        return f"{minutes}m {secs:02d}s"
    return f"{seconds:.1f}s"


# -- job --------------------------------------------------------------------------


@main.command("job", short_help="Show one job: its row, payload and errors.")
@click.argument("job_id", type=click.UUID)
@dsn_option
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of tables.")
def job_command(job_id: uuid.UUID, dsn: str | None, as_json: bool) -> None:
    """
    Show the job JOB_ID: status, attempts, times, the worker holding it, its payload
    (secret values masked) and the error of every crashed attempt, with its
    traceback. Errors outlive a job deleted with its target: they are shown alone.
    """
    dsn = _require_dsn(dsn)

    async def go() -> tuple[JobView | None, list[JobError]]:
        async with open_database(dsn) as db:
            view = await job_view(db, job_id)
            return view, list(view.errors) if view else await job_errors(db, job_id)

    view, errors = _run(dsn, go)
    if view is None and not errors:
        raise click.ClickException(f"no job {job_id} (and no errors kept for it)")
    if as_json:
        click.echo(json.dumps(view.to_json() if view else {
            "id": str(job_id), "gone": True, "errors": [e.to_json() for e in errors]},
            indent=2))
        return
    console = _wide_console()
    if view is None:
        console.print(f"job {job_id}: the row is gone (deleted with its target); "
                      f"{len(errors)} error(s) kept")
    else:
        row = Table(title=f"job {job_id}", show_header=False)
        row.add_column("field")
        row.add_column("value")
        if view.target_deleted:
            console.print(f"[yellow]a kept copy: its target was deleted with it at "
                          f"{view.deleted_at} (it cannot be retried)[/]")
        for name in ("source", "queue", "kind", "status", "attempt", "max_attempts",
                     "error_msg", "agent_id", "connector_id", "owner_id", "created_at",
                     "run_at", "picked_at", "completed_at", "claimed_by"):
            value = getattr(view, name)
            row.add_row(name, "-" if value is None else escape(str(value)))
        console.print(row)
        console.print(escape(json.dumps(view.payload, indent=2)))
    for e in errors:
        console.print(f"[bold]attempt {e.attempt}[/] {e.reason} at {e.at} "
                      f"(worker {e.worker_id or '-'}): {escape(e.error_type)}: "
                      f"{escape(e.message)}")
        console.print(escape(e.traceback.rstrip()), style="dim")


# -- prune ------------------------------------------------------------------------


@attrs.frozen
class _Age:
    """A duration as the user wrote it (for messages) and as a timedelta (for the query)."""

    text: str
    delta: timedelta


def _parse_older_than(_ctx: click.Context, _param: click.Parameter, value: str) -> _Age:
    try:
        return _Age(value.strip(), parse_duration(value))
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


@main.command("prune", short_help="Delete finished jobs older than a given age.")
@dsn_option
@click.option("--older-than", required=True, metavar="DURATION", callback=_parse_older_than,
              help="Age of completion, e.g. 30d, 12h, 90m, 2w.")
@click.option("--batch-size", type=click.IntRange(min=1), default=BATCH_SIZE,
              show_default=True, help="Rows deleted per statement.")
def prune_command(dsn: str | None, older_than: _Age, batch_size: int) -> None:
    """
    Delete done and failed jobs that completed more than --older-than ago.

    Deletes in small batches (one short transaction each) until none is left, and
    prints how many rows went. Pending and in-progress jobs are never touched.
    """
    dsn = _require_dsn(dsn)

    async def go() -> int:
        async with open_database(dsn) as db:
            return await prune(db, older_than.delta, batch_size)

    deleted = _run(dsn, go)
    click.echo(f"pruned {deleted} finished job{'' if deleted == 1 else 's'} "
               f"older than {older_than.text}")


# -- jobs -------------------------------------------------------------------------


@main.group("jobs", short_help="List, retry, cancel and discard jobs (the dead letters).")
def jobs_group() -> None:
    """
    The dead-letter queue and job listings, over build jobs (queue "builds") and
    plain jobs alike. Build jobs are listed in the plain jobs' states: pending is
    available, in_progress running, done completed, failed discarded.
    """


_ANY = "any"


def _parse_optional_age(ctx: click.Context, param: click.Parameter,
                        value: str | None) -> _Age | None:
    return None if value is None else _parse_older_than(ctx, param, value)


def _filter_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    for option in reversed((
        click.option("--queue", default=None, help='Only this queue ("builds": build jobs).'),
        click.option("--kind", default=None, help="Only this kind."),
        click.option("--state", type=click.Choice((*STATES, _ANY)), default="discarded",
                     show_default=True, help="Only jobs in this state (any: all)."),
        click.option("--older-than", default=None, metavar="DURATION",
                     callback=_parse_optional_age,
                     help="Only jobs that ended (or, unfinished, were created) longer "
                          "ago than this, e.g. 1h, 7d."),
    )):
        fn = option(fn)
    return fn


def _job_filter(queue: str | None, kind: str | None, state: str,
                older_than: _Age | None, limit: int = 50) -> JobFilter:
    return JobFilter(queue=queue, kind=kind, state=None if state == _ANY else state,
                     older_than=older_than.delta if older_than else None, limit=limit)


@jobs_group.command("list", short_help="List jobs, newest first (default: the dead letters).")
@dsn_option
@_filter_options
@click.option("--limit", type=click.IntRange(min=1), default=50, show_default=True,
              help="Jobs per page.")
@click.option("--after", default=None, metavar="CURSOR",
              help="The page after this cursor (printed under the previous page).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
def jobs_list_command(dsn: str | None, queue: str | None, kind: str | None, state: str,
                      older_than: _Age | None, limit: int, after: str | None,
                      as_json: bool) -> None:
    """
    List jobs, newest first: by default the dead letters (discarded plain jobs and
    failed build jobs, also those deleted with their target), one page at a time.
    """
    dsn = _require_dsn(dsn)
    where = _job_filter(queue, kind, state, older_than, limit)

    async def go() -> list[JobSummary]:
        async with open_database(dsn) as db:
            return await list_jobs(db, where, after=after)

    try:
        jobs = _run(dsn, go)
    except ValueError as exc:  # a malformed --after
        raise OperatorError(f"--after: {exc}") from None
    if as_json:
        click.echo(json.dumps({"jobs": [j.to_json() for j in jobs],
                               "next": jobs[-1].cursor if len(jobs) == limit else None},
                              indent=2))
        return
    console = _wide_console()
    table = Table(title=f"{len(jobs)} job{'' if len(jobs) == 1 else 's'}")
    for column in ("id", "queue", "kind", "state", "attempt", "at", "error"):
        table.add_column(column)
    for j in jobs:
        state_text = f"{j.state} (target deleted)" if j.target_deleted else j.state
        attempts = f"{j.attempt}/{j.max_attempts}" if j.max_attempts else str(j.attempt)
        table.add_row(str(j.id), escape(j.queue), escape(j.kind or "-"), state_text, attempts,
                      j.at.isoformat(timespec="seconds"), escape(j.error_msg or "-"))
    console.print(table)
    if len(jobs) == limit:
        console.print(f"next page: --after {escape(jobs[-1].cursor)}")


def _bulk_command(verb: str, one: Callable[[Database, uuid.UUID], Awaitable[object]],
                  matching: Callable[[Database, JobFilter], Awaitable[BulkResult]],
                  dsn: str | None, job_ids: tuple[uuid.UUID, ...], all_matching: bool,
                  yes: bool, where: JobFilter, filtered: bool) -> None:
    """
    Act on the jobs named, or with --all on every job the filters match: the
    count first, and nothing done without --yes. Refusals are printed one per
    job on stderr and make the exit code 1; the others are done anyway.
    """
    dsn = _require_dsn(dsn)
    if all_matching == bool(job_ids):
        raise OperatorError(f"name the jobs to {verb}, or pass --all (with filters)")
    if filtered and not all_matching:
        raise OperatorError("--queue, --kind, --state and --older-than go with --all")

    async def go() -> BulkResult | int:
        async with open_database(dsn) as db:
            if all_matching:
                if not yes:
                    return await count_matching(db, where)
                return await matching(db, where)
            done: list[uuid.UUID] = []
            refused: list[tuple[uuid.UUID, str]] = []
            for job_id in job_ids:
                try:
                    await one(db, job_id)
                except (JobRefused, JobNotFound) as exc:
                    refused.append((job_id, str(exc)))
                else:
                    done.append(job_id)
            return BulkResult(tuple(done), tuple(refused))

    result = _run(dsn, go)
    if isinstance(result, int):
        click.echo(f"{result} job{'' if result == 1 else 's'} match; nothing done: pass "
                   f"--yes to {verb} {'it' if result == 1 else 'them'}", err=True)
        sys.exit(1)
    for job_id in result.done:
        click.echo(f"{_DONE[verb]} {job_id}")
    for _job_id, reason in result.refused:
        click.echo(reason, err=True)
    if result.refused:
        sys.exit(1)


_DONE = {"retry": "retried", "discard": "discarded"}


def _bulk_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    fn = click.option("--yes", is_flag=True, help="With --all: do it (without: only count).")(fn)
    fn = click.option("--all", "all_matching", is_flag=True,
                      help="Every job the filters match (state: discarded unless given).")(fn)
    fn = _filter_options(fn)
    fn = dsn_option(fn)
    return click.argument("job_ids", nargs=-1, type=click.UUID)(fn)


def _filtered(queue: str | None, kind: str | None, older_than: _Age | None) -> bool:
    source = click.get_current_context().get_parameter_source("state")
    return (queue is not None or kind is not None or older_than is not None
            or source is not click.core.ParameterSource.DEFAULT)


@jobs_group.command("retry", short_help="Run dead jobs again.")
@_bulk_options
def jobs_retry_command(job_ids: tuple[uuid.UUID, ...], dsn: str | None, queue: str | None,
                       kind: str | None, state: str, older_than: _Age | None,
                       all_matching: bool, yes: bool) -> None:
    """
    Run the jobs JOB_ID... again, or with --all every job the filters match.

    A discarded or cancelled plain job becomes available with its attempts reset;
    a failed build job becomes pending with attempt 0, its build row queued and a
    failed agent deploying again. A build job whose agent was deleted when it
    failed for good is refused: enqueue a new job for a new agent instead.
    """
    _bulk_command("retry", retry, retry_matching, dsn, job_ids, all_matching, yes,
                  _job_filter(queue, kind, state, older_than),
                  _filtered(queue, kind, older_than))


@jobs_group.command("discard", short_help="Delete finished jobs for good.")
@_bulk_options
def jobs_discard_command(job_ids: tuple[uuid.UUID, ...], dsn: str | None, queue: str | None,
                         kind: str | None, state: str, older_than: _Age | None,
                         all_matching: bool, yes: bool) -> None:
    """
    Delete the finished jobs JOB_ID... (or with --all every match) and their kept
    errors. Waiting and running jobs are refused: cancel them first.
    """
    _bulk_command("discard", discard, discard_matching, dsn, job_ids, all_matching, yes,
                  _job_filter(queue, kind, state, older_than),
                  _filtered(queue, kind, older_than))


@jobs_group.command("cancel", short_help="Cancel waiting or running plain jobs.")
@click.argument("job_ids", nargs=-1, type=click.UUID, required=True)
@dsn_option
def jobs_cancel_command(job_ids: tuple[uuid.UUID, ...], dsn: str | None) -> None:
    """
    Cancel the plain jobs JOB_ID...: a waiting one ends cancelled at once, a running
    one is stopped by its worker at its next heartbeat. Build jobs cannot be cancelled.
    """
    dsn = _require_dsn(dsn)

    async def go() -> list[tuple[uuid.UUID, str, bool]]:
        out: list[tuple[uuid.UUID, str, bool]] = []
        async with open_database(dsn) as db:
            for job_id in job_ids:
                try:
                    out.append((job_id, await cancel(db, job_id), True))
                except (JobRefused, JobNotFound) as exc:
                    out.append((job_id, str(exc), False))
        return out

    failed = False
    for job_id, what, ok in _run(dsn, go):
        if ok:
            click.echo(f"{what} {job_id}")
        else:
            click.echo(what, err=True)
            failed = True
    if failed:
        sys.exit(1)


# -- keygen -----------------------------------------------------------------------


@main.command("keygen", short_help="Print a new secrets master key.")
def keygen_command() -> None:
    """Print a new secrets master key (for NASIKO_QUEUE_MASTER_KEY); keep it secret."""
    click.echo(generate_master_key())


# -- demo -------------------------------------------------------------------------


@main.command("demo", short_help="Run every path a job can take, and check it.")
@click.option("--dsn", metavar="URL",
              help="Run in this database (use a scratch one: the demo adds rows to it). "
                   "Default: a private PostgreSQL started for the demo and removed after.")
@click.option("--delay", type=click.FloatRange(min=0), default=0.3, hidden=True,
              help="Seconds each simulated build step takes (0 for tests).")
@_log_level_option("WARNING")
def demo_command(dsn: str | None, delay: float, log_level: str) -> None:
    """
    Show every path a job can take, with simulated builds and a real worker.

    Exits 1 if any scenario ends differently from what docs/rules.md says.
    """
    console = _wide_console()
    if dsn is not None:
        _check_dsn(dsn)
        report = _run(dsn, _demo_logged, dsn, console, delay, log_level)
    else:
        server = _start_embedded()
        try:
            console.print(f"Started a private PostgreSQL server at {escape(_where(server.dsn))} "
                          "(it is removed when the demo ends).")
            report = _run(server.dsn, _demo_logged, server.dsn, console, delay, log_level)
        finally:
            server.cleanup()
            console.print("Removed the private PostgreSQL server.")
    if not report.ok:
        sys.exit(1)


# -- bench ------------------------------------------------------------------------


def _import_bench_runner() -> Any:
    """
    `benchmarks.runner` of a source checkout: the current directory's, else this package's.

    The runner is not part of the wheel. After `pip install .` (not editable) the
    package's own folder is site-packages, so the checkout to use is the one the
    command runs in; an editable install or ``python -m nasiko_queue`` in a
    checkout finds its own. Anything else says where to run the command.
    """
    cwd = os.getcwd()
    checkout = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    found = next((root for root in (cwd, checkout)
                  if os.path.isfile(os.path.join(root, "benchmarks", "runner.py"))), None)
    if found is not None:
        sys.path.insert(0, found)
    try:
        runner = importlib.import_module("benchmarks.runner")
    except ImportError as exc:
        if found is not None:
            raise click.ClickException(
                f"cannot import the benchmark runner of {found}: {exc}") from None
        raise click.ClickException(
            "the benchmark runner is the benchmarks/ folder of a source checkout, and "
            f"neither {cwd} nor this installation has one: clone the repository and run "
            "`nasiko-queue bench` from its root") from None
    if not callable(getattr(runner, "run_benchmarks", None)):
        raise click.ClickException(
            f"{runner.__file__} is not nasiko-queue's benchmark runner: run "
            "`nasiko-queue bench` from the root of a nasiko-queue checkout")
    return runner


def _admin_sql(dsn: str, statement: str) -> None:
    async def go() -> None:
        conn = await asyncpg.connect(dsn)
        try:
            await conn.execute(statement)
        finally:
            await conn.close()

    import asyncio

    asyncio.run(go())


@main.command("bench", short_help="Measure throughput, latency and claim cost.")
@click.option("--dsn", metavar="URL",
              help="A server to benchmark on; a scratch database is created on it (needs "
                   "CREATEDB) and dropped after. Default: a private PostgreSQL with fsync on.")
@click.option("--full", is_flag=True, help="The bigger sweep (several minutes).")
@click.option("--tiny", is_flag=True, hidden=True, help="Tiny sizes, for smoke tests.")
@click.option("--out", type=click.Path(dir_okay=False), default="bench-results.json",
              show_default=True, help="Where to write the JSON results.")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False), default=None,
              help="Write a PNG plot here (needs matplotlib: pip install 'nasiko-queue[bench]').")
def bench_command(dsn: str | None, full: bool, tiny: bool, out: str,
                  plot_path: str | None) -> None:
    """
    Run the benchmark workloads (drain, enqueue, latency, history, replicas) and the
    bare-asyncpg ceilings, in one run; every engine figure is also shown as a ratio
    to the ceilings, since absolute figures on a shared machine are noise.
    """
    from pathlib import Path

    runner = _import_bench_runner()
    sizes = runner.TINY if tiny else runner.FULL if full else runner.DEFAULT
    console = _wide_console()
    server: EmbeddedPostgres | None = None
    if dsn is not None:
        _check_dsn(dsn)
        where = f"a scratch database on {_where(dsn)}"
    else:
        try:
            server = EmbeddedPostgres(fsync=True)
            server.start()
        except (NasikoQueueError, OSError, subprocess.SubprocessError) as exc:
            if server is not None:
                server.cleanup()
            raise click.ClickException(
                f"cannot start a private PostgreSQL: {_first_line(exc)}") from None
        dsn = server.dsn
        where = "a private PostgreSQL (fsync on, synchronous_commit on)"
    name = f"nasiko_bench_{os.getpid()}"
    from .embedded import with_database

    scratch = with_database(dsn, name)
    try:
        try:
            _admin_sql(dsn, f'CREATE DATABASE "{name}"')
        except Exception as exc:
            why = _explain(exc, dsn) or _first_line(exc)
            raise click.ClickException(
                f"cannot create the scratch database {name}: {why}") from None
        try:
            async def do_migrate() -> None:
                async with open_database(scratch) as db:
                    await migrate(db)

            _run(scratch, do_migrate)
            console.print(f"Benchmarking on {escape(where)}.")
            result = runner.run_benchmarks(scratch, sizes, console=console, database=where)
        finally:
            _admin_sql(dsn, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        if server is not None:
            server.cleanup()
    console.print(runner.table(result))
    runner.write_json(result, Path(out))
    console.print(f"Results written to {escape(out)}.")
    if plot_path is not None:
        if runner.plot(result, Path(plot_path)):
            console.print(f"Plot written to {escape(plot_path)}.")
        else:
            console.print(escape("No plot: matplotlib is not installed "
                                 "(pip install 'nasiko-queue[bench]')."))


def _wide_console() -> Console:
    """
    A console for wide tables: a terminal's own width, else 160 columns.

    Rich assumes 80 columns when output is not a terminal, which folds the
    demo's report into slivers in a CI log or a file for no reason.
    """
    return Console() if sys.stdout.isatty() else Console(width=160)


def _start_embedded() -> EmbeddedPostgres:
    """Start the demo's own server, or end the command with one line saying why not."""
    try:
        server = EmbeddedPostgres()
    except (NasikoQueueError, OSError, subprocess.SubprocessError) as exc:
        raise click.ClickException(f"cannot start a private PostgreSQL: {_first_line(exc)}") \
            from None
    try:
        server.start()
    except (NasikoQueueError, OSError, subprocess.SubprocessError) as exc:
        server.cleanup()
        raise click.ClickException(f"cannot start a private PostgreSQL: {_first_line(exc)}") \
            from None
    return server


async def _demo_logged(dsn: str, console: Console, delay: float, log_level: str) -> DemoReport:
    """Run the demo with the library's log lines printed through the demo's console."""
    return await run_demo(dsn, console=console, delay=delay, log_level=log_level)


if __name__ == "__main__":  # pragma: no cover
    main()
