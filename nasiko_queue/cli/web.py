"""
`nasiko-queue dashboard`: the web dashboard (the [http] extra).
"""

from __future__ import annotations

import click
import trio

from ..config import QueueConfig
from ..db.database import open_database
from .common import (
    DASHBOARD_TOKEN_ENV,
    OperatorError,
    _require_dsn,
    _run,
    dsn_option,
    main,
    stuck_option,
)
from .worker import (
    load_schedules,
)

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

        from ..web.bind import reporting_bind_errors
        from ..web.dashboard import dashboard_app
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
            async with trio.open_nursery() as nursery:
                with reporting_bind_errors(bind):  # a busy port, named in one line
                    binds: list[str] = await nursery.start(serve, app, hyper)
                # Said once it listens (a busy port prints only its error).
                click.echo(f"dashboard on {binds[0]}/ ({mode})", err=True)

    _run(dsn, serve_dashboard)
