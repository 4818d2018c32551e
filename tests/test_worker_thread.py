"""
The worker thread's edges (issue #26): a database that never answers makes the
start time out and leaves no thread; the process's exit stops it gracefully (a
job in flight at exit completes), for apps with no shutdown hook of their own.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import psycopg
import pytest

import nasiko_queue as nq
from nasiko_queue import Executors, PlainJobContext

from .conftest import FAST
from .helpers import TEST_DEADLINE
from .test_aio import Resize


def test_a_start_that_times_out_leaves_no_thread() -> None:
    """Nothing listens on port 1: the worker waits for its database (as a worker
    process would), the start gives up after its timeout and stops it hard."""
    executors = Executors()

    @executors.register(Resize)
    async def never(_ctx: PlainJobContext[Resize]) -> None:
        raise AssertionError("no job can be claimed without a database")

    before = {t.name for t in threading.enumerate()}
    with pytest.raises(TimeoutError, match="had not started"):
        nq.start_worker_thread("postgresql://nobody@127.0.0.1:1/none", executors,
                               config=FAST, start_timeout=0.5)
    after = {t.name for t in threading.enumerate()}
    assert "nasiko-queue worker" not in after - before


EXITING_APP = '''
import sys
import threading
from typing import Any, ClassVar

import attrs
import psycopg

import nasiko_queue as nq
from nasiko_queue import sync as nq_sync


@attrs.frozen(kw_only=True)
class Report(nq.JobArgs):
    kind: ClassVar[str] = "report"
    n: int


executors = nq.Executors()
THREAD: list[nq.WorkerThread] = []
STARTED = threading.Event()


@executors.register(Report)
async def report(ctx: nq.PlainJobContext[Report]) -> dict[str, Any]:
    print("running", flush=True)
    STARTED.set()
    # In flight until the worker is asked to stop: it can only complete if the
    # stop was graceful, and the only stop is the one atexit makes.
    worker = THREAD[0].worker
    assert worker is not None
    await worker.state.stopping.wait()
    return {"n": ctx.payload.n, "finished": "after the stop"}


dsn = sys.argv[1]
with psycopg.connect(dsn, autocommit=True) as conn:
    nq_sync.enqueue(conn, Report(n=7))
THREAD.append(nq.start_worker_thread(dsn, executors))
assert STARTED.wait(60)
print("exiting with the job in flight", flush=True)
'''


def test_the_process_exit_stops_it_gracefully(dsn: str, tmp_path: Path) -> None:
    program = tmp_path / "app.py"
    program.write_text(textwrap.dedent(EXITING_APP))
    done = subprocess.run([sys.executable, str(program), dsn], capture_output=True,
                          text=True, timeout=TEST_DEADLINE, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["running", "exiting with the job in flight"]
    with psycopg.connect(dsn) as conn:
        row = conn.execute("SELECT state, result FROM nasiko_queue_jobs").fetchall()
    assert row == [("completed", {"n": 7, "finished": "after the stop"})]
