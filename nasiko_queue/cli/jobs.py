"""
`nasiko-queue job`, `nasiko-queue jobs` and `nasiko-queue enqueue`: one job's view;
list, retry, cancel and discard jobs (the dead letters); enqueue a plain job.
"""

from __future__ import annotations

import difflib
import json
import sys
import uuid
from collections.abc import Awaitable, Callable, Iterable
from datetime import datetime
from functools import partial
from typing import Any

import attrs
import click
from rich.markup import escape
from rich.table import Table

from ..admin.jobs import (
    DEFAULT_STATE,
    STATES,
    BulkResult,
    JobFilter,
    JobNotFound,
    JobRefused,
    JobSummary,
    cancel,
    count_jobs,
    discard,
    discard_matching,
    list_jobs,
    retry,
    retry_matching,
)
from ..admin.view import JobView, job_view
from ..builds.payloads import converter, describe_structure_error
from ..config import QueueConfig
from ..db.database import Database, open_database
from ..db.statements import Q
from ..errors import InvalidPayload
from ..executors import Executors
from ..job_errors import JobError, job_errors
from ..plain.args import (
    DEFAULT_QUEUE,
    JobArgs,
    JobOptions,
    Unique,
    check_run_at,
    delay_seconds,
)
from ..queue import Queue, plain_json_payload, unique_of
from .common import (
    OperatorError,
    _Age,
    _parse_older_than,
    _require_dsn,
    _run,
    _wide_console,
    dsn_option,
    main,
)
from .worker import load_executors

# -- job --------------------------------------------------------------------------


@main.command("job", short_help="Show one job: its row, payload and errors.")
@click.argument("job_id", type=click.UUID)
@dsn_option
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of tables.")
def job_command(job_id: uuid.UUID, dsn: str | None, as_json: bool) -> None:
    """
    Show the job JOB_ID: status, attempts, times, the worker holding it, its payload
    (secret values masked), what its executor returned (a plain job's result) and
    the error of every crashed attempt, with its traceback. Errors outlive a job
    deleted with its target: they are shown alone.
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
        for name, value in view.shown():
            if name == "error_msg" and view.source == "plain":
                name = "error"
            row.add_row(name, "-" if value is None else escape(str(value)))
        console.print(row)
        console.print(escape(json.dumps(view.payload, indent=2)))
        if view.result is not None:
            console.print("[bold]result[/]")
            console.print(escape(json.dumps(view.result, indent=2)))
    for e in errors:
        console.print(f"[bold]attempt {e.attempt}[/] {e.reason} at {e.at} "
                      f"(worker {e.worker_id or '-'}): {escape(e.error_type)}: "
                      f"{escape(e.message)}")
        console.print(escape(e.traceback.rstrip()), style="dim")


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
        click.option("--state", type=click.Choice((*STATES, _ANY)), default=DEFAULT_STATE,
                     show_default=True,
                     help="Only jobs in this state; any: every state. The default, the "
                          "dead letters, is JobFilter's too."),
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
                    return await count_jobs(db, where)
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
    _bulk_command("retry", partial(retry, actor="cli"), partial(retry_matching, actor="cli"),
                  dsn, job_ids, all_matching, yes,
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
    _bulk_command("discard", partial(discard, actor="cli"),
                  partial(discard_matching, actor="cli"), dsn, job_ids, all_matching, yes,
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
                    out.append((job_id, await cancel(db, job_id, actor="cli"), True))
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


# -- enqueue ----------------------------------------------------------------------


def _parse_run_at(_ctx: click.Context, _param: click.Parameter,
                  value: str | None) -> datetime | None:
    if value is None:
        return None
    try:
        at = datetime.fromisoformat(value)
    except ValueError:
        raise click.BadParameter(f"{value!r} is not an ISO 8601 time, e.g. "
                                 "2030-01-01T09:00:00+00:00") from None
    if at.tzinfo is None:
        raise click.BadParameter(f"{value!r} has no UTC offset; add one, e.g. "
                                 f"{value}+00:00 (or Z)")
    try:
        check_run_at(at)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None
    return at


def _parse_delay(_ctx: click.Context, _param: click.Parameter,
                 value: float | None) -> float | None:
    try:
        return delay_seconds(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


def _did_you_mean(kind: str, known: Iterable[str]) -> str:
    close = difflib.get_close_matches(kind, sorted(known), n=1)
    return f"; did you mean {close[0]!r}?" if close else ""


def check_registered(executors: Executors, kind: str, args: dict[str, Any], spec: str,
                     *, any_kind: bool = False) -> JobArgs | None:
    """
    The job `executors` would run for `kind` and `args` (decoded as the worker
    decodes them): refuse a kind it does not run (None with `any_kind`), or
    arguments its type would not decode.
    """
    types = {t.kind: t for t in executors.plain_types}
    if kind not in types:
        if any_kind:
            return None
        raise InvalidPayload(f"{spec} registers no plain job of kind {kind!r}"
                             f"{_did_you_mean(kind, types)} (--any-kind enqueues it anyway)")
    try:
        job: JobArgs = converter.structure(args, types[kind])
    except Exception as exc:
        raise InvalidPayload(f"invalid {kind} payload: {describe_structure_error(exc)}"
                             ) from None
    return job


async def check_served(db: Database, kind: str) -> None:
    """Refuse a kind that no live worker runs (a typo: given back every 15 s for ever)."""
    live = {r["kind"] for r in await db.fetch(Q.workers_live_kinds)}
    if kind in live:
        return
    if not live:
        raise OperatorError(f"no live worker to check kind {kind!r} against: give --executors "
                            "MODULE:ATTR (your registry), or --any-kind to enqueue it anyway")
    raise OperatorError(f"no live worker runs kind {kind!r}{_did_you_mean(kind, live)} (give "
                        "--executors MODULE:ATTR to check against your registry, or "
                        "--any-kind to enqueue it anyway)")


@main.command("enqueue", short_help="Enqueue a plain job; print its id.")
@click.argument("kind")
@click.argument("args_json", metavar="JSON", default="{}")
@dsn_option
@click.option("--queue", default=None,
              help="The queue it goes to (a worker runs the queues it is given). "
                   f"Default: the type's, with --executors; else {DEFAULT_QUEUE!r}.")
@click.option("--priority", type=click.IntRange(-32768, 32767), default=None,
              help="Lower runs first within its queue. Default: the type's, with "
                   "--executors; else 0.")
@click.option("--run-at", default=None, metavar="ISO", callback=_parse_run_at,
              help="Not before this time (ISO 8601 with a UTC offset).")
@click.option("--delay", type=float, default=None, metavar="SECONDS", callback=_parse_delay,
              help="Not before this many seconds from now (0 to 100 years).")
@click.option("--unique", "unique_key", default=None, metavar="KEY",
              help="Only if no waiting or running job holds KEY; else print that "
                   "job's id.")
@click.option("--max-attempts", type=click.IntRange(min=1), default=None,
              help="Runs before the job is discarded. Default: the type's, with "
                   f"--executors; else {JobOptions().max_attempts}.")
@click.option("--executors", "executors_spec", default=None, metavar="MODULE:ATTR",
              help="Check KIND and the JSON's field types against this registry, as the "
                   "worker will decode them (default: against the kinds live workers run).")
@click.option("--any-kind", is_flag=True,
              help="Enqueue KIND even if no registry or live worker names it (a worker "
                   "deployed later).")
def enqueue_command(kind: str, args_json: str, dsn: str | None, queue: str | None,
                    priority: int | None, run_at: datetime | None, delay: float | None,
                    unique_key: str | None, max_attempts: int | None,
                    executors_spec: str | None, any_kind: bool) -> None:
    """
    Enqueue a plain job of KIND whose arguments are the JSON object JSON (default
    {}), and print its id: the row `Queue.enqueue` writes for a job of that kind
    with those fields. A KIND that no worker would run (a typo) is refused: with
    --executors, KIND must be registered there, the JSON's fields are decoded as
    the worker will, and the type's options (queue, priority, attempts) are the
    defaults; without it, a live worker must run KIND. --any-kind
    enqueues it anyway. With --unique, a key held by a waiting or running job
    enqueues nothing and prints that job's id (and says so on stderr).

        nasiko-queue enqueue send_email '{"to": "a@example.com"}' --queue email
    """
    try:
        args = json.loads(args_json)
        if not isinstance(args, dict):
            raise InvalidPayload(f"JSON must be an object of the job's fields, not "
                                 f"{type(args).__name__} {args_json!r}")
        plain_json_payload(kind, args)
        if run_at is not None and delay is not None:
            raise InvalidPayload("give --run-at or --delay, not both")
        job = None
        if executors_spec is not None:
            job = check_registered(load_executors(executors_spec), kind, args,
                                   executors_spec, any_kind=any_kind)
        # A registered kind is enqueued as `Queue.enqueue` enqueues its type: its
        # options and its unique key, unless flags say otherwise.
        typed = job.options if job is not None else JobOptions()
        options = attrs.evolve(
            typed, queue=typed.queue if queue is None else queue,
            priority=typed.priority if priority is None else priority,
            max_attempts=typed.max_attempts if max_attempts is None else max_attempts)
        unique = Unique(unique_key) if unique_key is not None else None
        if job is not None:
            unique = unique_of(job, options, unique)
    except json.JSONDecodeError as exc:
        raise OperatorError(f"JSON is not valid JSON ({exc})") from None
    except (InvalidPayload, ValueError) as exc:
        raise OperatorError(str(exc)) from None
    dsn = _require_dsn(dsn)

    async def go() -> tuple[uuid.UUID, bool]:
        async with open_database(dsn) as db:
            if executors_spec is None and not any_kind:
                await check_served(db, kind)
            return await Queue(db, config=QueueConfig())._enqueue_json(
                kind, args, run_at=run_at, delay=delay, options=options, unique=unique)

    job_id, inserted = _run(dsn, go)
    if not inserted:
        held = unique.key if unique is not None else unique_key
        click.echo(f"job {job_id} already holds unique key {held!r}: nothing enqueued",
                   err=True)
    click.echo(str(job_id))
