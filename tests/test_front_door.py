"""
The front door (issue #21): Ctrl-C on a worker run from `trio.run` (`nq.run_worker`) or
from the CLI ends it cleanly (0 after a graceful stop, 130 after a hard one, no
traceback); a busy port is reported as a busy port; `local_database` starts a server
when DATABASE_URL is not set.

Every process here is waited on through what it prints, never a sleep.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

import nasiko_queue as nq

from .test_readme import ROOT, example_env, run_program

#: A worker whose one job runs until cancelled: the first Ctrl-C waits for it, the
#: second stops it. It prints "started" when the job runs.
HANGING = textwrap.dedent('''
    import sys
    from typing import ClassVar

    import attrs
    import trio

    import nasiko_queue as nq


    @attrs.frozen
    class Hang(nq.JobArgs):
        kind: ClassVar[str] = "hang"


    executors = nq.Executors()


    @executors.register(Hang)
    async def hang(ctx: nq.PlainJobContext[Hang]) -> None:
        print("started", file=sys.stderr, flush=True)
        await trio.sleep_forever()


    async def main(dsn: str) -> int:
        async with nq.open_database(dsn) as db:
            queue = nq.Queue(db)
            await queue.enqueue(Hang())
            return await nq.run_worker(nq.Worker(queue, executors))


    if __name__ == "__main__":
        with nq.local_database() as dsn:
            sys.exit(trio.run(main, dsn))
''')


async def test_run_worker_first_ctrl_c_waits_for_the_job_and_the_second_exits_130(
        dsn: str, tmp_path: Path, db: nq.Database) -> None:
    program = tmp_path / "hang.py"
    program.write_text(HANGING)
    env = example_env(dsn)

    async def second_interrupt(stderr: str) -> None:
        # The first SIGINT was answered and the job still runs: the process lives.
        assert "SIGINT: stopping once the running jobs finish" in stderr

    with trio.fail_after(120):
        async with trio.open_nursery():
            proc = await trio.lowlevel.open_process(
                [sys.executable, str(program)], stderr=subprocess.PIPE, env=env,
                cwd=tmp_path)
            assert proc.stderr is not None
            err = b""
            interrupts = 0
            try:
                while chunk := await proc.stderr.receive_some():
                    err += chunk
                    if interrupts == 0 and b"started" in err:
                        proc.send_signal(signal.SIGINT)
                        interrupts = 1
                    elif interrupts == 1 and b"stopping once the running jobs finish" in err:
                        await second_interrupt(err.decode())
                        assert proc.returncode is None
                        proc.send_signal(signal.SIGINT)
                        interrupts = 2
                code = await proc.wait()
            finally:
                if proc.returncode is None:
                    proc.kill()
    text = err.decode()
    assert code == nq.EXIT_HARD_STOP == 130, text
    assert "Traceback" not in text, text
    assert "SIGINT again: stopping now; running jobs go back to pending" in text
    # The hard stop gave the job back, its attempt counted.
    row = await db.fetchrow("SELECT state, attempt FROM nasiko_queue_jobs")
    assert (row["state"], row["attempt"]) == ("available", 1)


async def test_run_worker_stops_when_until_holds_and_on_stop(db: nq.Database) -> None:
    """In-process, no signal: `until` stops it gracefully, as `worker.stop()` does; 0."""
    from .cli_executors import Ping, executors

    queue = nq.Queue(db)
    for n in range(3):
        await queue.enqueue(Ping(n=n))
    worker = nq.Worker(queue, executors)
    with trio.fail_after(60):
        assert await nq.run_worker(worker, until=lambda stats: stats.done >= 3) == 0
    assert worker.stats.done == 3
    other = nq.Worker(queue, executors)
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            await nursery.start(nq.run_worker, other)
            other.stop()
    with pytest.raises(TypeError, match="until= needs a Worker"):
        await nq.run_worker(nq.Scheduler(queue, []), until=lambda stats: True)


async def test_run_worker_stops_a_lone_scheduler_on_the_first_ctrl_c(db: nq.Database) -> None:
    """A scheduler has nothing to finish: the first SIGINT ends it, and that is a 0."""
    from .cli_executors import schedules

    codes: list[int] = []

    async def run(*, task_status: trio.TaskStatus[None]) -> None:
        codes.append(await nq.run_worker(nq.Scheduler(nq.Queue(db), schedules),
                                         task_status=task_status))

    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            await nursery.start(run)
            os.kill(os.getpid(), signal.SIGINT)  # to its receiver, not to pytest
    assert codes == [0]


# -- the CLI's worker and Ctrl-C ------------------------------------------------------


async def _cli(args: list[str], env: dict[str, str], *, interrupt_after: str | None,
               cwd: Path) -> tuple[int, str]:
    """`nasiko-queue ARGS`; SIGINT once stderr has `interrupt_after`. Code, stderr."""
    program = cwd / "cli.py"
    program.write_text("import sys\nfrom nasiko_queue.cli import main\n"
                       f"sys.argv = ['nasiko-queue', *{args!r}]\nmain()\n")
    code, _out, err = await run_program(program, env, interrupt_after=interrupt_after)
    return code, err


@pytest.mark.slow
async def test_cli_worker_ends_on_ctrl_c_with_exit_0(dsn: str, tmp_path: Path) -> None:
    code, err = await _cli(["worker", "--executors", "tests.cli_executors:executors"],
                           {**example_env(dsn), "PYTHONPATH": str(ROOT)},
                           interrupt_after="worker started", cwd=tmp_path)
    assert code == 0, err
    assert "SIGINT: stopping once the running jobs finish" in err
    assert "Traceback" not in err, err


async def test_cli_dashboard_ends_on_ctrl_c_in_one_line(dsn: str, tmp_path: Path) -> None:
    """It says where it listens once it does (the real port for port 0); Ctrl-C then
    ends it with one line, no traceback (the interrupt arrives through hypercorn's
    nurseries, grouped)."""
    code, err = await _cli(["dashboard", "--bind", "127.0.0.1:0"], example_env(dsn),
                           interrupt_after="dashboard on http", cwd=tmp_path)
    # The first signal stops the server gracefully: exit 0, one line saying so.
    # (Left to trio, the KeyboardInterrupt could land in any task; under two CPU
    # hogs the process once hung past this test's deadline.)
    assert code == 0, err
    assert "Traceback" not in err, err
    assert err.splitlines()[-1] == "SIGINT: stopping", err
    assert "dashboard on http://127.0.0.1:0/" not in err


# -- a busy port ------------------------------------------------------------------------


@pytest.fixture
def busy_port() -> Iterator[int]:
    """A port of 127.0.0.1 that a socket of this test listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def _one_line_error(result: subprocess.CompletedProcess[str]) -> str:
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    return lines[0]


@pytest.mark.parametrize("command", ["dashboard", "worker --http"])
async def test_a_busy_port_is_named_in_one_line(
        command: str, dsn: str, busy_port: int, tmp_path: Path) -> None:
    if command == "dashboard":
        args = ["dashboard", "--bind", f"127.0.0.1:{busy_port}"]
    else:
        args = ["worker", "--executors", "tests.cli_executors:executors", "--http",
                f"127.0.0.1:{busy_port}", "--log-level", "ERROR"]
    env = {**example_env(dsn), "PYTHONPATH": str(ROOT)}
    result = await trio.to_thread.run_sync(lambda: subprocess.run(
        [sys.executable, "-m", "nasiko_queue", *args], capture_output=True, text=True,
        env=env, cwd=tmp_path, timeout=120))
    assert result.returncode == 1, result.stderr
    assert _one_line_error(result) == (
        f"Error: cannot listen on 127.0.0.1:{busy_port}: address already in use")


# -- local_database ---------------------------------------------------------------------


def test_local_database_gives_database_url_when_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DATABASE_URL", "postgresql://someone@db.example/app")
    with nq.local_database() as dsn:
        assert dsn == "postgresql://someone@db.example/app"


@pytest.mark.slow
async def test_a_readme_block_runs_on_a_server_of_its_own(tmp_path: Path) -> None:
    """With no DATABASE_URL, `local_database()` starts a throw-away server."""
    from .test_readme import _block

    program = tmp_path / "example.py"
    program.write_text(_block("embedding"))
    env = {k: v for k, v in os.environ.items()
           if k not in ("DATABASE_URL", "NASIKO_QUEUE_TEST_DSN", "NASIKO_QUEUE_MASTER_KEY")}
    code, out, err = await run_program(program, env)
    assert (code, out) == (0, "done\n"), err
