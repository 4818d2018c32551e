"""
Ctrl-C at any moment of start-up exits without a traceback (issue #46).

`nasiko-queue worker` and `dashboard` are interrupted at moments spread over
their start-up: during the imports (the console script's entry takes SIGINT
quietly until the command is imported), during trio's start, and once running
(the first signal stops gracefully). Every one must end with no traceback, and
with status 0, 130, or click's one-line "Aborted!". The moments are where the
interrupt lands, not waits for anything; Python's own start-up (measured here,
before any code of this package runs) is left out.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from .test_cli import REPO

#: Seconds after this package's first code runs at which SIGINT is sent.
MOMENTS = (0.0, 0.05, 0.12, 0.25, 0.4, 0.6, 0.9, 1.3)


def _python_start_up() -> float:
    """Seconds Python itself takes before the console script's first import of
    ours (an interrupt there is Python's own: its traceback is not ours to
    hide), with a margin: twice the slowest of three bare start-ups, on this
    machine under its present load."""
    took = []
    for _ in range(3):
        began = time.monotonic()
        subprocess.run([sys.executable, "-c", "import re, sys"], check=True)
        took.append(time.monotonic() - began)
    return 2 * max(took)


def _script() -> Path:
    script = Path(sys.executable).parent / "nasiko-queue"
    if not script.exists():
        pytest.skip(f"no nasiko-queue console script beside {sys.executable}: the package "
                    "is not installed in this environment")
    return script


@pytest.mark.slow
@pytest.mark.parametrize("command", [
    ["worker", "--executors", "tests.cli_executors:executors"],
    ["dashboard", "--bind", "127.0.0.1:0"],
], ids=["worker", "dashboard"])
def test_ctrl_c_during_start_up_prints_no_traceback(dsn: str, command: list[str]) -> None:
    script = _script()
    base = _python_start_up()
    for moment in (base + m for m in MOMENTS):
        proc = subprocess.Popen([str(script), *command, "--dsn", dsn], cwd=REPO,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        time.sleep(moment)
        proc.send_signal(signal.SIGINT)
        try:
            out, _ = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
            pytest.fail(f"SIGINT at {moment}s: still running 30 s later\n{out}")
        assert "Traceback" not in out, (moment, out)
        # 0: stopped gracefully; 130: interrupted while importing; 1: click's own
        # "Aborted!" for an interrupt between its parsing and the command's start.
        clean = proc.returncode in (0, 130) or (
            proc.returncode == 1 and out.strip().endswith("Aborted!"))
        assert clean, (moment, proc.returncode, out)


@pytest.mark.parametrize("command", [
    ["worker", "--executors", "tests.cli_executors:executors"],
    ["dashboard", "--bind", "127.0.0.1:0"],
], ids=["worker", "dashboard"])
def test_ctrl_c_while_start_up_waits_on_the_database_exits_cleanly(
    dsn: str, command: list[str],
) -> None:
    """Found by CI (the test above, `dashboard`, interrupted 0.68 s in): a SIGINT
    while the dashboard's start-up talked to the database reached trio's own
    KeyboardInterrupt, which landed in the database bridge's task and failed
    with "internal error in Trio". Made deterministic: the start-up's first read
    waits on a lock this test holds, and the signal is sent once the server
    shows the wait."""
    import psycopg

    with psycopg.connect(dsn, autocommit=True) as holder, \
            psycopg.connect(dsn, autocommit=True) as watcher:
        holder.execute("BEGIN")
        holder.execute("LOCK TABLE nasiko_queue.nasiko_queue_migrations "
                       "IN ACCESS EXCLUSIVE MODE")
        proc = subprocess.Popen([str(_script()), *command, "--dsn", dsn], cwd=REPO,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            deadline = time.monotonic() + 60
            while not watcher.execute(
                    "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                    "AND wait_event_type = 'Lock' AND pid <> %s",
                    (holder.info.backend_pid,)).fetchone()[0]:  # type: ignore[index]
                assert proc.poll() is None, proc.communicate()[0]
                # Each look is a round trip to the server, which is the event's
                # only witness (the child process reports nothing before it listens).
                assert time.monotonic() < deadline, "the start-up never read the database"
            proc.send_signal(signal.SIGINT)
            out, _ = proc.communicate(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
            holder.execute("ROLLBACK")
    assert "Traceback" not in out, out
    assert proc.returncode in (0, 130), (proc.returncode, out)
