"""
What every command of the ``nasiko-queue`` CLI shares: the `main` group, the
operator's errors (one line, never a traceback, never the DSN's password), the
common options, and `_run` (one `trio.run` with a database).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import Any, TypeVar
from urllib.parse import urlsplit

import asyncpg
import attrs
import click
import trio
from rich.console import Console

from .. import __version__
from ..admin.retention import parse_duration
from ..config import QueueConfig
from ..engine.signals import EXIT_HARD_STOP as EXIT_HARD_STOP
from ..errors import CannotConnect, NasikoQueueError, NotMigrated, leaves
from ..web.bind import DASHBOARD_TOKEN_ENV as DASHBOARD_TOKEN_ENV  # re-exported

log = logging.getLogger("nasiko_queue.cli")

T = TypeVar("T")

#: Where the worker's master key comes from. Never a command-line option: those
#: are visible to every user of the machine in `ps`.
MASTER_KEY_ENV = "NASIKO_QUEUE_MASTER_KEY"
#: The dashboard's login token (`dashboard --token`, `worker --http --dashboard`).


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
    for leaf in leaves(exc):
        if isinstance(leaf, asyncpg.UndefinedTableError):
            # NotMigrated says what to do itself; the server's words are its cause.
            said = leaf.__cause__ if isinstance(leaf, NotMigrated) and leaf.__cause__ else leaf
            return (f"{where} has no nasiko-queue schema ({_first_line(said)}); "
                    "run `nasiko-queue migrate` first")
        if isinstance(leaf, asyncpg.PostgresError):
            return f"database error at {where}: {_first_line(leaf)}"
        if isinstance(leaf, asyncpg.InterfaceError):
            return f"cannot use {where}: {_first_line(leaf)}"
        if isinstance(leaf, TimeoutError):
            return f"timed out talking to {where}"
        if isinstance(leaf, CannotConnect):
            return f"cannot connect to {where}: connection refused"
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
    except BaseExceptionGroup as group:
        # Ctrl-C through a nursery (the dashboard's server) arrives grouped.
        if any(isinstance(leaf, KeyboardInterrupt) for leaf in leaves(group)):
            click.echo("interrupted", err=True)
            sys.exit(EXIT_HARD_STOP)
        message = _explain(group, dsn) if isinstance(group, ExceptionGroup) else None
        if message is None:
            raise
        raise click.ClickException(message) from None
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


def _wide_console() -> Console:
    """
    A console for wide tables: a terminal's own width, else 160 columns.

    Rich assumes 80 columns when output is not a terminal, which folds the
    demo's report into slivers in a CI log or a file for no reason.
    """
    return Console() if sys.stdout.isatty() else Console(width=160)


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


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="nasiko-queue")
def main() -> None:
    """A durable job queue on PostgreSQL: run workers and look after the queue."""
