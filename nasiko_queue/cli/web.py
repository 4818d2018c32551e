"""
`nasiko-queue dashboard`: the web dashboard (the [http] extra).
"""

from __future__ import annotations

import signal
import sys

import click
import trio

from ..config import QueueConfig
from ..db.database import open_database
from ..web.bind import login_message, login_url, new_token, parse_bind
from .common import (
    DASHBOARD_TOKEN_ENV,
    EXIT_HARD_STOP,
    OperatorError,
    _require_dsn,
    _run,
    dsn_option,
    main,
    stuck_option,
)
from .worker import (
    _check_schema,
    allowed_host_option,
    load_schedules,
)

# -- status -----------------------------------------------------------------------


@main.command("dashboard", short_help="Serve the web dashboard (needs the [http] extra).")
@dsn_option
@click.option("--bind", default="127.0.0.1:9182", show_default=True, metavar="HOST:PORT",
              help="Where to listen. Only this machine by default: expose it on purpose.")
@click.option("--token", envvar=DASHBOARD_TOKEN_ENV, show_envvar=True,
              default=None, metavar="TOKEN",
              help=f"What the login asks for before any action. Set it in the environment "
                   f"({DASHBOARD_TOKEN_ENV}): on the command line `ps` shows it to every "
                   "local user. Without it, one is made for this run and a login URL "
                   "printed.")
@click.option("--read-only", is_flag=True, help="Show no actions and refuse every one.")
@click.option("--schedules", "schedules_spec", metavar="MODULE:ATTRIBUTE", default=None,
              help="The worker's schedules, to show their cron expressions and next runs.")
@allowed_host_option
@click.option("--session-idle-mins", type=click.FloatRange(min=0, min_open=True),
              default=30.0, show_default=True,
              help="A login session unused for this long ends.")
@click.option("--session-max-hours", type=click.FloatRange(min=0, min_open=True),
              default=12.0, show_default=True,
              help="A login session ends this long after the login, used or not.")
@stuck_option
@click.pass_context
def dashboard_command(ctx: click.Context, dsn: str | None, bind: str, token: str | None,
                      read_only: bool, schedules_spec: str | None,
                      allowed_hosts: tuple[str, ...], session_idle_mins: float,
                      session_max_hours: float, stuck_job_mins: int) -> None:
    """
    Serve the web dashboard: queues, jobs, dead letters, workers, schedules;
    retry, cancel, discard and pause/resume behind a token.
    """
    dsn = _require_dsn(dsn)
    try:
        host, port = parse_bind(bind)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--bind") from None
    try:
        from hypercorn.config import Config as HypercornConfig
        from hypercorn.trio import serve

        from ..web.auth import HostCheck, Sessions
        from ..web.bind import reporting_bind_errors
        from ..web.dashboard import dashboard_app
    except ImportError as exc:
        raise OperatorError(f"`nasiko-queue dashboard` needs the [http] extra: "
                            f"pip install 'nasiko-queue[http]' ({exc})") from None
    try:
        HostCheck(app=None, allowed=allowed_hosts)  # type: ignore[arg-type]
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--allowed-host") from None
    if token and ctx.get_parameter_source("token") == click.core.ParameterSource.COMMANDLINE:
        click.echo(f"warning: --token on the command line is visible in `ps` to every local "
                   f"user; set {DASHBOARD_TOKEN_ENV} instead", err=True)
    generated = not token and not read_only
    if generated:
        token = new_token()
    schedules = load_schedules(schedules_spec) if schedules_spec else ()
    config = QueueConfig(stuck_job_mins=stuck_job_mins)
    hyper = HypercornConfig()
    hyper.bind = [f"[{host}]:{port}" if ":" in host else f"{host}:{port}"]
    hyper.accesslog = None
    sessions = Sessions(idle=session_idle_mins * 60, lifetime=session_max_hours * 3600)

    async def serve_dashboard() -> None:
        # Ctrl-C and SIGTERM are ours from the start, as for `worker`: the first
        # stops the server gracefully (exit 0), or the start-up where it is, a
        # second stops at once (130). Left to trio, the KeyboardInterrupt could
        # land in any task, the database bridge's included: under load the
        # process then hung, or trio failed with an internal error while the
        # bridge's loop was starting (a SIGINT 0.68 s into start-up, CI).
        stop = trio.Event()
        serving = False
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async with trio.open_nursery() as nursery:

                async def watch_signals() -> None:
                    async for signum in signals:
                        name = signal.Signals(signum).name
                        if stop.is_set():
                            click.echo(f"{name} again: stopping now", err=True)
                            hard.append(signum)
                            nursery.cancel_scope.cancel()
                            return
                        click.echo(f"{name}: stopping", err=True)
                        stop.set()
                        if not serving:  # still starting: nothing to finish
                            nursery.cancel_scope.cancel()
                            return

                nursery.start_soon(watch_signals)
                async with open_database(dsn) as db:
                    # A wrong DSN, an unmigrated database or a server that is down
                    # is a one-line error now, not a dashboard whose every page fails.
                    await _check_schema(db)
                    app = dashboard_app(db, token=token or None, read_only=read_only,
                                        config=config, schedules=schedules,
                                        allowed_hosts=allowed_hosts, sessions=sessions)
                    mode = "read-only" if read_only else "actions need the token"

                    async def run_server(*, task_status: trio.TaskStatus[list[str]]
                                         = trio.TASK_STATUS_IGNORED) -> None:
                        # Starlette is an ASGI app; hypercorn's own types are narrower.
                        await serve(app, hyper,  # type: ignore[arg-type]
                                    shutdown_trigger=stop.wait, task_status=task_status)
                        nursery.cancel_scope.cancel()  # served and stopped: the end

                    serving = True
                    with reporting_bind_errors(bind):  # a busy port, named in one line
                        binds = await nursery.start(run_server)
                    # Said once it listens (a busy port prints only its error).
                    bound = str(binds[0])
                    click.echo(f"dashboard on {bound}/ ({mode})", err=True)
                    if generated and token:
                        click.echo(login_message(login_url(
                            host, int(bound.rsplit(":", 1)[1]), token)), err=True)
                    # The server runs in the nursery until a signal stops it; the
                    # database stays open meanwhile.
                    await trio.sleep_forever()

    hard: list[int] = []
    _run(dsn, serve_dashboard)
    if hard:
        sys.exit(EXIT_HARD_STOP)
