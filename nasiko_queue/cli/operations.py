"""
The operator's commands: `migrate`, `status`, `prune` and `keygen`.
"""

from __future__ import annotations

import json

import click
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from ..admin.retention import BATCH_SIZE, prune
from ..admin.status import QueueStatus, queue_status
from ..db.database import open_database
from ..db.migrate import migrate
from ..secrets import generate_master_key
from .common import (
    _Age,
    _parse_older_than,
    _require_dsn,
    _run,
    _wide_console,
    dsn_option,
    main,
    stuck_option,
)

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
    """What the database holds, the general queue first: the queues of plain jobs,
    the workers, then the build jobs (only where there are any: an application
    that does not use them sees no build table of zeros)."""
    if status.queues:
        queues = Table(title="queues")
        columns = ("available", "scheduled", "running", "completed", "discarded", "cancelled")
        queues.add_column("queue")
        for column in columns:
            queues.add_column(column, justify="right")
        queues.add_column("oldest due")
        queues.add_column("done 1m/5m", justify="right")
        for q in status.queues:
            age = q.oldest_available_age
            queues.add_row(escape(q.queue), *(str(getattr(q, c)) for c in columns),
                           "-" if age is None else _duration(age),
                           f"{q.completed_1m}/{q.completed_5m}")
        console.print(queues)
    elif not any(status.counts.values()):
        console.print("no jobs yet")

    for unserved in status.unserved:
        console.print(f"[bold yellow]{escape(unserved.describe())}[/]")

    workers = Table(title="workers")
    for column in ("id", "host", "pid", "state", "heartbeat", "holding", "roles", "queues"):
        workers.add_column(column)
    for w in status.workers:
        state = "alive" if w.alive else ("dead" if w.dead_at else "[yellow]overdue[/]")
        served = ("?" if w.queues is None
                  else ", ".join(f"{name}×{n}" for name, n in sorted(w.queues.items())) or "-")
        workers.add_row(w.id[:8], escape(w.host), str(w.pid), state,
                        f"{w.heartbeat_age:.1f}s ago", str(w.holding),
                        ", ".join(w.roles) or "-", escape(served))
    console.print(workers)

    if not any(status.counts.values()):
        return
    counts = Table(title="build jobs by status")
    counts.add_column("status")
    counts.add_column("jobs", justify="right")
    for name, n in status.counts.items():
        counts.add_row(name, str(n))
    console.print(counts)

    held = Table(title="build jobs now", show_header=False)
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


# -- prune ------------------------------------------------------------------------


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


# -- keygen -----------------------------------------------------------------------


@main.command("keygen", short_help="Print a new secrets master key.")
def keygen_command() -> None:
    """Print a new secrets master key (for NASIKO_QUEUE_MASTER_KEY); keep it secret."""
    click.echo(generate_master_key())
