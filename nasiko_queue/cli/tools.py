"""
`nasiko-queue demo` and `nasiko-queue bench`: the demonstration and the benchmark runner.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from typing import Any

import asyncpg
import click
from rich.console import Console
from rich.markup import escape

from ..db.database import open_database
from ..db.embedded import EmbeddedPostgres
from ..db.migrate import migrate
from ..errors import NasikoQueueError
from .common import (
    _check_dsn,
    _explain,
    _first_line,
    _log_level_option,
    _run,
    _where,
    _wide_console,
    main,
)
from .demo import DemoReport, run_demo

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
    checkout = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
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
    from ..db.embedded import with_database

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
