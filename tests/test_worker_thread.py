"""
The worker in a thread of an application (`start_worker_thread`): its stop from
every side, found by a bug hunt of the embedding paths. Each stop is waited for
on events, never on a clock; the timers here only end a test that would hang.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable
from typing import ClassVar

import attrs
import psycopg
import pytest
import trio

import nasiko_queue as nq
from nasiko_queue import Executors, JobArgs, PlainJobContext, Queue, WorkerThread
from nasiko_queue import sync as nq_sync

from .conftest import FAST
from .helpers import TEST_DEADLINE


@attrs.frozen
class Chore(JobArgs):
    kind: ClassVar[str] = "chore"
    n: int = 0


def _chores() -> Executors:
    executors = Executors()

    @executors.register(Chore)
    async def chore(ctx: PlainJobContext[Chore]) -> None:
        return None

    return executors


async def _state(queue: Queue, job_id: object) -> str:
    state: str = await queue.db.fetchval("SELECT state FROM nasiko_queue_jobs WHERE id = $1",
                                         job_id)
    return state


async def test_a_stop_called_by_an_executor_lets_its_job_end(queue: Queue, dsn: str) -> None:
    """`stop()` from inside an executor (its own thread) raised "this is a blocking
    function", which failed the job, and the worker went on."""
    executors = Executors()
    box: list[WorkerThread] = []

    @executors.register(Chore)
    async def chore(ctx: PlainJobContext[Chore]) -> str:
        box[0].stop()
        return "done"

    job_id = await queue.enqueue(Chore())
    thread = WorkerThread(dsn, executors, config=FAST, stop_at_exit=False)
    box.append(thread)
    await trio.to_thread.run_sync(thread.start)
    assert await trio.to_thread.run_sync(thread.join, TEST_DEADLINE)
    assert await _state(queue, job_id) == "completed"


async def test_a_request_to_stop_returns_while_an_executor_blocks_the_loop(
    queue: Queue, dsn: str
) -> None:
    """An executor blocking the worker's loop (a sync ORM call) held
    `request_stop()`, which promises to return at once, until it returned."""
    started, release = threading.Event(), threading.Event()
    executors = Executors()

    @executors.register(Chore)
    async def chore(ctx: PlainJobContext[Chore]) -> None:
        started.set()
        release.wait()  # blocks the loop, as a sync call would

    job_id = await queue.enqueue(Chore())
    thread = WorkerThread(dsn, executors, config=FAST, stop_at_exit=False)
    await trio.to_thread.run_sync(thread.start)
    returned: list[bool] = []

    def ask() -> None:
        assert started.wait(TEST_DEADLINE)
        # Ends the executor's block should `request_stop` wait for it (as it did).
        watchdog = threading.Timer(TEST_DEADLINE, release.set)
        watchdog.start()
        thread.request_stop()
        returned.append(not release.is_set())  # returned before the loop ran again
        watchdog.cancel()
        release.set()

    await trio.to_thread.run_sync(ask)
    assert await trio.to_thread.run_sync(thread.join, TEST_DEADLINE)
    assert returned == [True]
    assert await _state(queue, job_id) == "completed"


async def test_a_wait_under_way_when_the_worker_stops_says_so(dsn: str) -> None:
    """`wait_for` pending while the worker stopped raised trio's Cancelled, a
    BaseException that an application's `except Exception` misses."""
    thread = nq.start_worker_thread(dsn, _chores(), config=FAST, stop_at_exit=False)
    failed: list[BaseException] = []

    def wait() -> None:
        try:
            thread.wait_for(lambda stats: False)
        except BaseException as exc:  # the test looks at what it was
            failed.append(exc)

    waiter = threading.Thread(target=wait)
    waiter.start()
    await trio.to_thread.run_sync(thread.stop)
    await trio.to_thread.run_sync(waiter.join, TEST_DEADLINE)
    assert [type(e) for e in failed] == [RuntimeError]
    with pytest.raises(RuntimeError, match="stopped"):
        await trio.to_thread.run_sync(lambda: thread.wait_for(lambda stats: True))


async def test_a_stop_before_the_thread_runs_is_kept(queue: Queue, dsn: str) -> None:
    """A `stop()` that came before the thread was alive (a start under way in
    another thread) returned without a word; the worker then ran and took jobs."""
    job_id = await queue.enqueue(Chore())
    thread = WorkerThread(dsn, _chores(), config=FAST, stop_at_exit=False)
    thread.stop()
    await trio.to_thread.run_sync(thread.start)
    assert await trio.to_thread.run_sync(thread.join, TEST_DEADLINE)
    assert await _state(queue, job_id) == "available"


def test_an_interrupted_stop_still_puts_the_running_job_back(
    dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """
    Ctrl-C during the exit's graceful stop (KeyboardInterrupt in `join`) left
    the worker frozen with its job `running` until a rescue a lease later. The
    stop turns hard first: the job is back to available at once.
    """
    started = threading.Event()
    executors = Executors()

    @executors.register(Chore)
    async def chore(ctx: PlainJobContext[Chore]) -> None:
        started.set()
        await trio.sleep_forever()

    with psycopg.connect(dsn, autocommit=True) as conn:
        job_id = nq_sync.enqueue(conn, Chore())
    thread = WorkerThread(dsn, executors, config=FAST, stop_at_exit=False)
    thread.start()
    assert started.wait(TEST_DEADLINE)
    # Ctrl-C while `stop` waits in join: the first wait is interrupted.
    real_join = thread._thread.join
    interrupted: list[bool] = []

    def join(timeout: float | None = None) -> None:
        if not interrupted:
            interrupted.append(True)
            raise KeyboardInterrupt
        real_join(timeout)

    monkeypatch.setattr(thread._thread, "join", join)
    with pytest.raises(KeyboardInterrupt):
        thread.stop(timeout=None)
    assert not thread.running
    with psycopg.connect(dsn) as conn:
        row = conn.execute("SELECT state, attempt FROM nasiko_queue.nasiko_queue_jobs "
                           "WHERE id = %s",
                           (job_id,)).fetchone()
    assert row == ("available", 1)


def _child_calls_raise(calls: list[Callable[[], object]]) -> int:
    """In a forked child: 0 if every call raised RuntimeError, else 1 + the
    index of the first that did not (returned, or raised something else)."""
    for index, call in enumerate(calls):
        try:
            call()
        except RuntimeError:
            continue
        except BaseException:
            return 1 + index
        return 1 + index
    return 0


async def _exit_code_of_child(pid: int) -> int:
    ended: list[int] = []
    waiter = threading.Thread(target=lambda: ended.append(os.waitpid(pid, 0)[1]))
    waiter.start()
    await trio.to_thread.run_sync(waiter.join, TEST_DEADLINE)
    if not ended:
        os.kill(pid, signal.SIGKILL)
    assert ended
    return os.waitstatus_to_exitcode(ended[0])


async def test_a_forked_childs_stop_raises_as_the_readme_says(dsn: str) -> None:
    """In a child forked after the start, `stop()`, `request_stop()` and `join()`
    returned silently (the child's copy of the thread says it has ended), as if
    the worker had stopped; the README says a forked child's calls raise
    `RuntimeError`, as `wait_for()` and `run()` did."""
    thread = nq.start_worker_thread(dsn, _chores(), config=FAST, stop_at_exit=False)
    try:
        pid = os.fork()
        if pid == 0:  # the child: report, and leave without running any cleanup
            try:
                os._exit(_child_calls_raise([
                    lambda: thread.stop(timeout=1), thread.request_stop,
                    lambda: thread.join(1), lambda: thread.wait_for(lambda stats: True),
                ]))
            finally:
                os._exit(9)
        assert await _exit_code_of_child(pid) == 0
        assert thread.running  # the parent's worker goes on, its stop still its own
    finally:
        await trio.to_thread.run_sync(thread.stop)
    assert not thread.running


async def test_a_child_forked_after_the_stop_stops_as_the_parent_does(dsn: str) -> None:
    """A thread that had ended before the fork is not the parent's running
    worker: the child's `stop()` returns, as the parent's would."""
    thread = nq.start_worker_thread(dsn, _chores(), config=FAST, stop_at_exit=False)
    await trio.to_thread.run_sync(thread.stop)
    pid = os.fork()
    if pid == 0:
        try:
            thread.stop(timeout=1)
            os._exit(0 if thread.join(1) else 1)
        finally:
            os._exit(9)
    assert await _exit_code_of_child(pid) == 0


async def test_a_forked_child_cannot_reach_the_parents_worker(dsn: str) -> None:
    """After a fork (gunicorn --preload), the child's `wait_for(timeout=2)` waited
    for ever on a loop that exists only in the parent."""
    thread = nq.start_worker_thread(dsn, _chores(), config=FAST, stop_at_exit=False)
    try:
        pid = os.fork()
        if pid == 0:  # the child: report, and leave without running any cleanup
            try:
                thread.wait_for(lambda stats: True, timeout=2)
            except RuntimeError:
                os._exit(0)
            except BaseException:
                os._exit(2)
            os._exit(1)
        ended: list[int] = []
        waiter = threading.Thread(target=lambda: ended.append(os.waitpid(pid, 0)[1]))
        waiter.start()
        await trio.to_thread.run_sync(waiter.join, TEST_DEADLINE)
        if not ended:
            os.kill(pid, signal.SIGKILL)
        assert ended
        assert os.waitstatus_to_exitcode(ended[0]) == 0
        assert thread.running  # the parent's worker goes on
    finally:
        await trio.to_thread.run_sync(thread.stop)
