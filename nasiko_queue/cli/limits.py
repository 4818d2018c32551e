"""
Limits across replicas (issue #23): ``nasiko-queue limits`` lists them,
``nasiko-queue limit set QUEUE ...`` and ``limit clear QUEUE`` change them for
every worker at once, without a deploy (the workers are woken).
"""

from __future__ import annotations

import json

import click

from ..db.database import open_database
from ..plain.limits import PartitionMode, QueueLimit, Rate
from ..queue import Queue
from .common import _require_dsn, _run, dsn_option, main


def _show(limit: QueueLimit) -> str:
    parts = []
    if limit.concurrency is not None:
        parts.append(f"concurrency {limit.concurrency} ({limit.running} running)")
    if limit.rate is not None:
        per = "per key " if limit.partition_by else ""
        parts.append(f"rate {limit.rate.limit} {per}per {limit.rate.per:g}s "
                     f"({limit.window_starts} in the window)")
    if limit.partition_by is not None:
        parts.append(f"partition by {limit.partition_by} ({limit.partition_mode})")
    return f"{limit.queue}: " + ", ".join(parts or ["no limit"])


@main.command("limits", short_help="List the queues' limits across replicas.")
@dsn_option
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of lines.")
def limits_command(dsn: str | None, as_json: bool) -> None:
    """Every limited queue: its limits, its running jobs and its starts in the window."""
    dsn = _require_dsn(dsn)

    async def go() -> list[QueueLimit]:
        async with open_database(dsn) as db:
            return await Queue(db).limits()

    found = _run(dsn, go)
    if as_json:
        click.echo(json.dumps([
            {"queue": x.queue, "concurrency": x.concurrency,
             "rate": None if x.rate is None else {"limit": x.rate.limit, "per": x.rate.per},
             "partition_by": x.partition_by, "partition_mode": str(x.partition_mode),
             "running": x.running, "window_starts": x.window_starts} for x in found],
            indent=2))
    elif not found:
        click.echo("no queue has limits")
    else:
        for limit in found:
            click.echo(_show(limit))


@main.group("limit", short_help="Set or clear a queue's limits across replicas.")
def limit_group() -> None:
    """Set or clear a queue's limits; every worker applies them at its next claim."""


@limit_group.command("set")
@dsn_option
@click.argument("queue_name", metavar="QUEUE")
@click.option("--concurrency", type=click.IntRange(min=1), default=None,
              help="At most this many of the queue's jobs running across every worker.")
@click.option("--rate", type=click.IntRange(min=1), default=None,
              help="At most this many starts per --per seconds across every worker.")
@click.option("--per", type=click.FloatRange(min=0, min_open=True), default=None,
              help="The rate's period, in seconds.")
@click.option("--partition-by", default=None, metavar="ARG",
              help="The job arg whose value partitions the queue (the rate is per key).")
@click.option("--partition-mode", type=click.Choice([m.value for m in PartitionMode]),
              default=PartitionMode.NONE.value, show_default=True,
              help="round_robin: one job per key in turn; serial: also one running per key.")
def limit_set_command(dsn: str | None, queue_name: str, concurrency: int | None,
                      rate: int | None, per: float | None, partition_by: str | None,
                      partition_mode: str) -> None:
    """Replace the limits of QUEUE (a queue of plain jobs)."""
    dsn = _require_dsn(dsn)
    if (rate is None) != (per is None):
        raise click.UsageError("--rate and --per go together")
    try:
        limit = QueueLimit(queue=queue_name, concurrency=concurrency,
                           rate=None if rate is None or per is None else Rate(rate, per=per),
                           partition_by=partition_by, partition_mode=partition_mode)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None

    async def go() -> None:
        async with open_database(dsn) as db:
            await Queue(db).set_limit(limit.queue, concurrency=limit.concurrency,
                                      rate=limit.rate, partition_by=limit.partition_by,
                                      partition_mode=limit.partition_mode)

    _run(dsn, go)
    click.echo(f"set {_show(limit)}")


@limit_group.command("clear")
@dsn_option
@click.argument("queue_name", metavar="QUEUE")
def limit_clear_command(dsn: str | None, queue_name: str) -> None:
    """QUEUE unlimited again (each worker's own slots still apply)."""
    dsn = _require_dsn(dsn)

    async def go() -> bool:
        async with open_database(dsn) as db:
            return await Queue(db).clear_limit(queue_name)

    cleared = _run(dsn, go)
    click.echo(f"cleared the limits of {queue_name}" if cleared
               else f"{queue_name} had no limits")
