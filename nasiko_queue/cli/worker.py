"""
`nasiko-queue worker`: run jobs until stopped, with its signals, its schema check and
the loaders of executors and schedules.
"""

from __future__ import annotations

import importlib
import logging
import os
import signal
import socket
import sys
from collections.abc import AsyncIterator, Sequence
from typing import Any

import click
import trio

from ..builds.payloads import McpServerUpload
from ..config import Prefetch, QueueConfig
from ..db.database import Database, open_database
from ..db.migrate import load_migrations
from ..db.statements import Q
from ..engine.signals import Shutdown as _Shutdown
from ..engine.signals import watch_signals
from ..engine.worker import Worker
from ..errors import ConfigurationError, NasikoQueueError, is_transient, leaves
from ..executors import Executors
from ..plain.schedules import Schedule
from ..queue import Queue
from ..secrets import SecretBox
from .common import (
    DASHBOARD_TOKEN_ENV,
    EXIT_HARD_STOP,
    MASTER_KEY_ENV,
    OperatorError,
    _explain,
    _log_level_option,
    _require_dsn,
    _run,
    dsn_option,
    log,
    main,
    stuck_option,
)

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
    # A class is callable too (a JobArgs type named by mistake): never called.
    if not isinstance(target, Executors | type) and callable(target):
        try:
            target = target()
        except TypeError as exc:
            raise OperatorError(f"--executors: {spec} could not be called with no arguments "
                                f"({exc})") from None
    if isinstance(target, type):
        raise OperatorError(
            f"--executors: {spec} is a class ({target.__name__}), not an Executors (or a "
            "function with no arguments that returns one)")
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


async def _watch_signals(
    signals: AsyncIterator[int], worker: Worker, scope: trio.CancelScope, shutdown: _Shutdown
) -> None:
    """First SIGINT/SIGTERM: `worker.stop()` (docs/rules.md §8, graceful). Second: hard stop."""
    await watch_signals(signals, worker.stop, scope, shutdown, logger=log, level=logging.INFO)


async def _check_schema(db: Database, *, builds: bool = False) -> None:
    """
    Fail fast on a database the worker cannot use.

    The worker itself never gives up on the database (it waits and reconnects,
    docs/rules.md §5), which is right once it runs, but a wrong DSN or an unmigrated
    database at startup is a mistake to report, not an outage to wait out. With
    `builds` (the worker has build executors), the build tables must all be
    found in one schema: where an application has an `agents` table of its own,
    they were created in the queue's schema beside it (`nasiko_queue.db.adopt`),
    and the build statements, which name them without a schema, would mix the two.
    """
    applied = {row["version"] for row in await db.fetch(Q.migrations_applied)}
    missing = [m.version for m in load_migrations() if m.version not in applied]
    if missing:
        raise NasikoQueueError(
            f"the database schema is not up to date (missing {', '.join(missing)}); "
            "run `nasiko-queue migrate` first"
        )
    if builds:
        found = {row["table_name"]: row["schema"]
                 for row in await db.fetch(Q.build_tables_schemas)}
        if len(set(found.values())) > 1:
            where = ", ".join(f"{table} in {schema}" for table, schema in found.items())
            raise NasikoQueueError(
                f"this worker has build executors, but the build tables are not in one "
                f"schema ({where}): some of those names are your application's own "
                "tables. Run build jobs in a database of their own, or start the worker "
                "without build executors")


def _unreachable(exc: BaseException) -> bool:
    """
    Whether `exc` is an outage to wait out: the one list of transient errors
    (`errors.is_transient`) that the worker and the sweep use too.

    One case differs at start-up: a host name that does not resolve is taken as
    a mistake in the DSN and reported, like anything the server itself refuses
    (no such database, a wrong password, no schema).
    """
    if any(isinstance(leaf, socket.gaierror) for leaf in leaves(exc)):
        return False
    return is_transient(exc)


async def _check_schema_when_up(
    db: Database, dsn: str, config: QueueConfig, shutdown: _Shutdown, *, builds: bool = False
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
            # A stop asked for while the read waits (a slow server, a lock held
            # on the bookkeeping table) ends the wait: nothing has started yet.
            async with trio.open_nursery() as nursery:

                async def stop_waiting() -> None:
                    await shutdown.requested.wait()
                    nursery.cancel_scope.cancel()

                nursery.start_soon(stop_waiting)
                await _check_schema(db, builds=builds)
                nursery.cancel_scope.cancel()
            return not shutdown.requested.is_set()
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
                http: tuple[str, int] | None = None, with_dashboard: bool = False,
                allowed_hosts: Sequence[str] = ()) -> int:
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
                    from ..web.server import HttpService

                    dashboard = None
                    token = os.environ.get(DASHBOARD_TOKEN_ENV) or None
                    generated = with_dashboard and token is None
                    if with_dashboard:
                        from ..web.bind import new_token
                        from ..web.dashboard import dashboard_app

                        token = token or new_token()
                        dashboard = dashboard_app(db, token=token, config=config,
                                                  schedules=schedules,
                                                  allowed_hosts=allowed_hosts)
                    service = HttpService(queue, worker, host=http[0], port=http[1],
                                          dashboard=dashboard)
                    await nursery.start(service.run)
                    if generated and token:
                        from ..web.bind import login_message, login_url

                        click.echo(login_message(login_url(service.host, service.port,
                                                           token)), err=True)
                builds = bool(executors.kinds) and config.builds
                if await _check_schema_when_up(db, dsn, config, shutdown, builds=builds):
                    await worker.run()
                nursery.cancel_scope.cancel()
    return EXIT_HARD_STOP if shutdown.hard else 0


allowed_host_option = click.option(
    "--allowed-host", "allowed_hosts", multiple=True, metavar="NAME[:PORT]",
    help="A name the dashboard answers to besides the address it listens on (a reverse "
         "proxy's, e.g. queue.example.com); repeatable. Any other Host header is refused "
         "(421): DNS rebinding.")


def _parse_prefetch(_ctx: click.Context, _param: click.Parameter,
                    value: str | None) -> Prefetch | None:
    """--prefetch: 'auto', a number of jobs >= 0, or unset (the default)."""
    if value is None:
        return None
    if value == "auto":
        return "auto"
    try:
        number = int(value)
    except ValueError:
        number = -1
    if number < 0:
        raise click.BadParameter(f"'auto' or an integer >= 0, not {value!r}")
    return number


def _parse_http(_ctx: click.Context, _param: click.Parameter,
                value: str | None) -> tuple[str, int] | None:
    """`--http HOST:PORT`: where to serve health and metrics; needs the [http] extra."""
    if value is None:
        return None
    from ..web.bind import parse_bind

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
@click.option("--prefetch", metavar="auto|N", default=None, callback=_parse_prefetch,
              help="Jobs each lane claims ahead of its free slots, for throughput on short "
                   "jobs: 'auto' (as many as its recent run times say will start within "
                   "50 ms; given back after 1 s unstarted) or a number (given back after "
                   "60 s). Default: 'auto' for queues of plain jobs, 0 for build jobs. A "
                   "stop gives unstarted ones back with their attempt restored.")
@click.option("--poll-interval", type=click.FloatRange(min=0, min_open=True),
              default=QueueConfig().poll_interval, show_default=True,
              help="Seconds of quiet before looking for jobs again.")
@stuck_option
@click.option("--recovery-interval", type=click.FloatRange(min=0, min_open=True),
              default=QueueConfig().recovery_interval, show_default=True,
              help="Seconds between sweeps for stuck jobs.")
@click.option("--build-max-attempts", type=click.IntRange(min=1),
              default=QueueConfig().build_max_attempts, show_default=True,
              help="Runs per build job (a crash is retried at once while runs remain) "
                   "before it fails for good. Replicas sharing a table should agree on it. "
                   "Plain jobs have their own (JobOptions.max_attempts).")
@click.option("--max-attempts", "old_max_attempts", type=click.IntRange(min=1), default=None,
              hidden=True, deprecated="use --build-max-attempts",
              help="The former name of --build-max-attempts.")
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
                   "NASIKO_QUEUE_DASHBOARD_TOKEN; without it, a token is made for the run "
                   "and a login URL printed).")
@allowed_host_option
@_log_level_option("INFO")
def worker_command(
    dsn: str | None,
    executors_spec: str,
    concurrency: int,
    queues_spec: str | None,
    builds: bool,
    prefetch: Prefetch | None,
    poll_interval: float,
    stuck_job_mins: int,
    recovery_interval: float,
    build_max_attempts: int,
    old_max_attempts: int | None,
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
    allowed_hosts: tuple[str, ...],
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
                             recovery_interval=recovery_interval,
                             build_max_attempts=build_max_attempts
                             if old_max_attempts is None else old_max_attempts,
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
        extra = (http, with_dashboard, allowed_hosts)
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
