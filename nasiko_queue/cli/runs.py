"""
`nasiko-queue run` and `nasiko-queue runs`: one workflow run's steps with every
attempt of their jobs; list, cancel and retry runs (issue #22). The shape of
`job` and `jobs`: one thing by id, and a group for listings and actions.
"""

from __future__ import annotations

import json
import sys
import uuid
from collections.abc import Awaitable, Callable
from datetime import datetime
from typing import Any

import click
from rich.markup import escape
from rich.table import Table

from ..admin.runs import (
    DEFAULT_LIMIT,
    JOBS_PER_PAGE,
    STATES,
    RunDetail,
    RunFilter,
    RunNotFound,
    RunRefused,
    RunSummary,
    StepDetail,
    StepJob,
    cancel_run,
    list_runs,
    retry_run,
    run_detail,
)
from ..db.database import Database, open_database
from .common import OperatorError, _require_dsn, _run, _wide_console, dsn_option, main

#: The longest a result or input is shown on one line of `run` (--json: whole).
SHOWN_CHARS = 200

# -- run --------------------------------------------------------------------------


def _time(at: datetime | None) -> str:
    return at.isoformat(timespec="seconds") if at is not None else "-"


def _clock(at: datetime | None) -> str:
    return at.strftime("%H:%M:%S") if at is not None else "-"


def _json_line(value: Any) -> str:
    text = json.dumps(value, separators=(",", ":"), default=str)
    return text if len(text) <= SHOWN_CHARS else text[:SHOWN_CHARS] + "…"


def _job_lines(job: StepJob, pad: str, mapped: bool) -> list[str]:
    took = f" ({job.seconds:.3f} s)" if job.seconds is not None else ""
    item = f" item {job.index}" if mapped else ""
    replaced = "" if job.live else " (replaced by a retry of the run)"
    lines = [f"{pad}job {job.id}{item}: {job.state}, attempt {job.attempt}/{job.max_attempts},"
             f" {_clock(job.attempted_at)} → {_clock(job.finished_at)}{took}{replaced}"]
    if job.more_errors:
        lines.append(f"{pad}  (earlier errors: nasiko-queue job {job.id})")
    for e in job.errors:
        lines.append(f"{pad}  attempt {e.attempt} {e.reason} at {_clock(e.at)}: "
                     f"{e.error_type}: {e.message.splitlines()[0] if e.message else ''}")
    if job.error_msg and not job.errors:
        lines.append(f"{pad}  error: {job.error_msg}")
    return lines


def _states(counts: dict[str, int]) -> str:
    return ", ".join(f"{n} {state}" for state, n in sorted(counts.items()))


def _step_lines(step: StepDetail) -> list[str]:
    pad = "  " * step.depth
    head = f"{pad}{step.name}"
    if step.after:
        head += f" ← {', '.join(step.after)}"
    head += f"  [{step.state}]"
    if step.kind != "job":
        head += f" ({step.kind} step)"
    if step.map_over:
        head += f" once per item of {step.map_over}: {step.item_count} item(s)"
    lines = [head]
    inner = pad + "    "
    if step.map_over and step.item_count:
        lines.append(f"{inner}items: {_states(step.item_states)}")
    if step.map_over or len(step.jobs) < step.job_count:
        shown = "" if len(step.jobs) == step.job_count else f" ({len(step.jobs)} on this page)"
        lines.append(f"{inner}jobs: {_states(step.job_states) or 'none'}{shown}")
    if step.child_run is not None:
        lines.append(f"{inner}child run {step.child_run}")
    if step.state == "completed" and not step.map_over:
        lines.append(f"{inner}result: {_json_line(step.result)}")
    if step.error:
        lines.append(f"{inner}error: {step.error}")
    for it in step.items:
        text = f"{inner}[{it.index}] {it.state}"
        if it.state == "completed":
            text += f": {_json_line(it.result)}"
        if it.error:
            text += f": {it.error}"
        lines.append(text)
    for job in step.jobs:
        lines.extend(_job_lines(job, inner, step.map_over is not None))
    return lines


def run_lines(run: RunDetail) -> list[str]:
    """`nasiko-queue run`'s text: the run, then its steps as an indented graph
    (each under its deepest dependency, its dependencies named), each with its
    counts and its jobs on the page, their attempts in time order; then the
    next page's option, if there is one."""
    lines = [f"run {run.id}  workflow {run.workflow}  [{run.state}]",
             f"  started {_time(run.created_at)}  ended {_time(run.finished_at)}"]
    if run.parent_run is not None:
        lines.append(f"  child of run {run.parent_run} (its step {run.parent_step})")
    if run.unique_key is not None:
        lines.append(f"  unique key {run.unique_key}")
    if run.failed_step is not None:
        lines.append(f"  failed at step {run.failed_step}: {run.error}")
    elif run.error:
        lines.append(f"  {run.error}")
    lines.append(f"  input: {_json_line(run.input)}")
    if run.state == "completed":
        lines.append(f"  result: {_json_line(run.result)}")
    lines.append("steps (indented by dependency, ← the steps each runs after):")
    for step in run.steps:
        lines.extend("  " + line for line in _step_lines(step))
    for e in run.events:
        lines.append(f"{_time(e.at)} {e.action} by {e.actor}")
    if run.next_cursor is not None:
        lines.append(f"more jobs: --after {run.next_cursor}")
    return lines


@main.command("run", short_help="Show one workflow run: its steps, attempts and errors.")
@click.argument("run_id", type=click.UUID)
@dsn_option
@click.option("--limit", type=click.IntRange(min=1), default=JOBS_PER_PAGE,
              show_default=True, help="Step jobs per page.")
@click.option("--after", default=None, metavar="CURSOR",
              help="The page of jobs after this cursor (printed under the previous page).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of text.")
def run_command(run_id: uuid.UUID, dsn: str | None, limit: int, after: str | None,
                as_json: bool) -> None:
    """
    Show the workflow run RUN_ID: its state, the step that failed it and the
    error, then each step in dependency order with the steps it runs after, its
    state, its result (secret values masked), its jobs and items counted by
    state, and a page of the jobs it had (oldest first; a mapped step's with
    their items) with each attempt's times and last errors (a retried run keeps
    its failed jobs: they say why it failed).
    """
    dsn = _require_dsn(dsn)

    async def go() -> RunDetail | None:
        async with open_database(dsn) as db:
            return await run_detail(db, run_id, limit=limit, after=after)

    try:
        run = _run(dsn, go)
    except ValueError as exc:  # a malformed --after
        raise OperatorError(f"--after: {exc}") from None
    if run is None:
        raise click.ClickException(f"no run {run_id}")
    if as_json:
        click.echo(json.dumps(run.to_json(), indent=2))
        return
    for line in run_lines(run):
        click.echo(line)


# -- runs -------------------------------------------------------------------------


@main.group("runs", short_help="List, cancel and retry workflow runs.")
def runs_group() -> None:
    """Workflow runs: list them (newest started first), cancel and retry them."""


_ANY = "any"


@runs_group.command("list", short_help="List runs, newest started first.")
@dsn_option
@click.option("--workflow", default=None, help="Only runs of this workflow.")
@click.option("--state", type=click.Choice((*STATES, _ANY)), default=_ANY, show_default=True,
              help="Only runs in this state.")
@click.option("--limit", type=click.IntRange(min=1), default=DEFAULT_LIMIT, show_default=True,
              help="Runs per page.")
@click.option("--after", default=None, metavar="CURSOR",
              help="The page after this cursor (printed under the previous page).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
def runs_list_command(dsn: str | None, workflow: str | None, state: str, limit: int,
                      after: str | None, as_json: bool) -> None:
    """List workflow runs, newest started first, one page at a time."""
    dsn = _require_dsn(dsn)
    where = RunFilter(workflow=workflow, state=None if state == _ANY else state, limit=limit)

    async def go() -> list[RunSummary]:
        async with open_database(dsn) as db:
            return await list_runs(db, where, after=after)

    try:
        runs = _run(dsn, go)
    except ValueError as exc:  # a malformed --after
        raise OperatorError(f"--after: {exc}") from None
    nxt = runs[-1].cursor if len(runs) == limit else None
    if as_json:
        click.echo(json.dumps({"runs": [r.to_json() for r in runs], "next": nxt}, indent=2))
        return
    console = _wide_console()
    table = Table(title=f"{len(runs)} run{'' if len(runs) == 1 else 's'}")
    for column in ("id", "workflow", "state", "steps", "started", "ended", "failed step"):
        table.add_column(column, no_wrap=column not in ("workflow", "failed step"))
    for r in runs:
        failed = f"{r.failed_step}: {r.error}" if r.failed_step else (r.error or "-")
        table.add_row(str(r.id), escape(r.workflow), r.state, f"{r.completed}/{r.steps}",
                      _time(r.created_at), _time(r.finished_at), escape(failed))
    console.print(table)
    if nxt is not None:
        console.print(f"next page: --after {escape(nxt)}")


def _each(dsn: str | None, run_ids: tuple[uuid.UUID, ...],
          act: Callable[[Database, uuid.UUID], Awaitable[str]]) -> None:
    """Act on each run; refusals one per line on stderr and exit code 1."""
    dsn = _require_dsn(dsn)

    async def go() -> list[tuple[uuid.UUID, str, bool]]:
        out: list[tuple[uuid.UUID, str, bool]] = []
        async with open_database(dsn) as db:
            for run_id in run_ids:
                try:
                    out.append((run_id, await act(db, run_id), True))
                except (RunRefused, RunNotFound) as exc:
                    out.append((run_id, str(exc), False))
        return out

    failed = False
    for run_id, what, ok in _run(dsn, go):
        if ok:
            click.echo(f"{what} run {run_id}")
        else:
            click.echo(what, err=True)
            failed = True
    if failed:
        sys.exit(1)


@runs_group.command("cancel", short_help="Cancel running runs.")
@click.argument("run_ids", nargs=-1, type=click.UUID, required=True)
@dsn_option
def runs_cancel_command(run_ids: tuple[uuid.UUID, ...], dsn: str | None) -> None:
    """
    Cancel the runs RUN_ID...: their waiting steps are cancelled, their running
    steps' jobs stopped at their workers' next heartbeat, their child runs
    cancelled; no step starts after.
    """
    _each(dsn, run_ids, lambda db, run_id: cancel_run(db, run_id, actor="cli"))


@runs_group.command("retry", short_help="Run failed or cancelled runs again.")
@click.argument("run_ids", nargs=-1, type=click.UUID, required=True)
@dsn_option
def runs_retry_command(run_ids: tuple[uuid.UUID, ...], dsn: str | None) -> None:
    """
    Run the failed or cancelled runs RUN_ID... again: completed steps keep their
    results; the others start over once their dependencies have completed.
    """
    _each(dsn, run_ids, lambda db, run_id: retry_run(db, run_id, actor="cli"))
