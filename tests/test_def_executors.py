"""
Plain ``def`` executors and workflow steps run in worker threads (issue #46).

Blocking job code (the Django ORM, requests, boto3) is what most applications
have. A ``def`` runs once in a thread of its own, its result lands, the loop stays
free for every other job, and a stopped run (its timeout, a hard stop) is stopped
inside its thread at its next Python line. Real PostgreSQL and real workers; the
executors' "outside world" is a threading.Event the test holds.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, ClassVar

import attrs
import pytest
import trio

from nasiko_queue import (
    Executors,
    JobArgs,
    JobContext,
    JobOptions,
    PlainJobContext,
    Queue,
    StepContext,
    Worker,
    Workflow,
    threaded,
)
from nasiko_queue.testing import enqueue_with_target

from .helpers import TEST_DEADLINE, LogEvent, job_row, running


@attrs.frozen(kw_only=True)
class Thumbnail(JobArgs):
    kind: ClassVar[str] = "thumbnail"
    options: ClassVar[JobOptions] = JobOptions(queue="media", max_attempts=3)
    url: str


@attrs.frozen(kw_only=True)
class Ping(JobArgs):
    kind: ClassVar[str] = "ping"
    options: ClassVar[JobOptions] = JobOptions(queue="pings")


def no_backoff(_attempt: int) -> float:
    return 0.0


async def wait_thread_event(event: threading.Event) -> None:
    """Wait, from trio, for an event a worker thread sets."""
    with trio.fail_after(TEST_DEADLINE):
        await trio.to_thread.run_sync(event.wait, abandon_on_cancel=True)


def busy_until(gate: threading.Event) -> None:
    """Blocking code that runs Python lines while it waits (a poll loop, a
    chunked download): the kind a stop can interrupt."""
    while not gate.wait(0.01):
        pass


async def plain_state(queue: Queue, job_id: Any) -> tuple[str, int, str | None]:
    row = await queue.db.fetchrow(
        "SELECT state, attempt, result::text AS result FROM nasiko_queue_jobs WHERE id = $1",
        job_id)
    return row["state"], row["attempt"], row["result"]


async def test_a_def_executor_runs_once_in_a_thread_and_its_result_lands(queue: Queue) -> None:
    calls: list[tuple[int, str]] = []
    executors = Executors()

    @executors.register(Thumbnail)
    def make(ctx: PlainJobContext[Thumbnail]) -> dict[str, str]:
        calls.append((threading.get_ident(), ctx.payload.url))
        return {"url": ctx.payload.url + ".png"}

    job_id = await queue.enqueue(Thumbnail(url="a"))
    async with running(queue, executors) as worker:
        await worker.wait_for(lambda s: s.done >= 1)
    [(thread, url)] = calls
    assert (thread != threading.get_ident(), url) == (True, "a")
    assert await plain_state(queue, job_id) == ("completed", 1, '{"url": "a.png"}')


async def test_a_blocked_def_executor_leaves_the_loop_to_other_jobs(queue: Queue) -> None:
    started, gate = threading.Event(), threading.Event()
    executors = Executors()

    @executors.register(Thumbnail)
    def blocking(ctx: PlainJobContext[Thumbnail]) -> None:
        started.set()
        busy_until(gate)

    @executors.register(Ping)
    async def ping(ctx: PlainJobContext[Ping]) -> str:
        return "pong"

    slow = await queue.enqueue(Thumbnail(url="slow"))
    async with running(queue, executors) as worker:
        await wait_thread_event(started)
        fast = await queue.enqueue(Ping())
        await worker.wait_for(lambda s: s.done >= 1)  # while the thread still blocks
        assert await plain_state(queue, fast) == ("completed", 1, '"pong"')
        assert (await plain_state(queue, slow))[0] == "running"
        gate.set()
        await worker.wait_for(lambda s: s.done >= 2)
    assert await plain_state(queue, slow) == ("completed", 1, None)


async def test_a_def_executor_past_its_timeout_is_stopped_in_its_thread(queue: Queue) -> None:
    never, cleaned_up = threading.Event(), threading.Event()
    executors = Executors()

    @executors.register(Thumbnail, timeout=0.2, backoff=no_backoff)
    def make(ctx: PlainJobContext[Thumbnail]) -> int:
        if ctx.attempt == 1:
            try:
                busy_until(never)
            except Exception:  # an executor's own handler does not swallow the stop
                return -1
            finally:
                cleaned_up.set()
        return ctx.attempt

    job_id = await queue.enqueue(Thumbnail(url="t"))
    async with running(queue, executors) as worker:
        await worker.wait_for(lambda s: s.done >= 1)
        assert worker.stats.retried == 1
    assert cleaned_up.is_set()
    assert await plain_state(queue, job_id) == ("completed", 2, "2")


async def test_graceful_stop_lets_a_def_executor_finish(queue: Queue) -> None:
    started, gate = threading.Event(), threading.Event()
    executors = Executors()

    @executors.register(Thumbnail)
    def make(ctx: PlainJobContext[Thumbnail]) -> str:
        started.set()
        busy_until(gate)
        return "done"

    job_id = await queue.enqueue(Thumbnail(url="g"))
    worker = Worker(queue, executors)
    with trio.fail_after(TEST_DEADLINE):
        async with trio.open_nursery() as nursery:
            await nursery.start(worker.run)
            await wait_thread_event(started)
            worker.stop()
            gate.set()
    assert await plain_state(queue, job_id) == ("completed", 1, '"done"')


async def test_hard_stop_stops_a_def_executor_and_gives_its_job_back(queue: Queue) -> None:
    started, never, ended = threading.Event(), threading.Event(), threading.Event()
    executors = Executors()

    @executors.register(Thumbnail)
    def make(ctx: PlainJobContext[Thumbnail]) -> None:
        started.set()
        try:
            busy_until(never)
        finally:
            ended.set()

    job_id = await queue.enqueue(Thumbnail(url="h"))
    worker = Worker(queue, executors)
    with trio.fail_after(TEST_DEADLINE):
        async with trio.open_nursery() as nursery:
            await nursery.start(worker.run)
            await wait_thread_event(started)
            nursery.cancel_scope.cancel()
    # The thread was stopped (and waited for) before the worker returned, and the
    # job is available again at once, its attempt counted.
    assert ended.is_set()
    assert (await plain_state(queue, job_id))[:2] == ("available", 1)


async def test_a_thread_blocked_in_c_is_left_after_the_grace_and_its_result_dropped(
    queue: Queue, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(threaded, "THREAD_STOP_GRACE", 0.2)
    started, gate = threading.Event(), threading.Event()
    executors = Executors()

    @executors.register(Thumbnail, timeout=0.2, backoff=no_backoff)
    def make(ctx: PlainJobContext[Thumbnail]) -> str:
        if ctx.attempt == 1:
            started.set()
            gate.wait()  # one C call: a stop cannot land until it returns
            return "late first run"
        return "second run"

    job_id = await queue.enqueue(Thumbnail(url="c"))
    with LogEvent("did not stop within") as left:
        async with running(queue, executors) as worker:
            await worker.wait_for(lambda s: s.done >= 1)
            with trio.fail_after(TEST_DEADLINE):
                await left.event.wait()
            gate.set()
    assert await plain_state(queue, job_id) == ("completed", 2, '"second run"')


async def test_a_def_build_executor_reports_through_its_context(queue: Queue) -> None:
    seen: list[str] = []

    def build(ctx: JobContext[Any]) -> None:
        ctx.mark_building()
        seen.append(threading.current_thread().name)
        ctx.report_success()

    executors = Executors()
    executors.register(_upload_type(), build)
    job = await enqueue_with_target(queue, "Upload")
    async with running(queue, executors) as worker:
        await worker.wait_for(lambda s: s.done >= 1)
    assert seen
    assert seen[0] != threading.main_thread().name
    assert (await job_row(queue.db, job.job_id) or {})["status"] == "done"


def _upload_type() -> type[Any]:
    from nasiko_queue import Upload

    return Upload


async def test_a_def_workflow_step_runs_in_a_thread(queue: Queue) -> None:
    wf = Workflow("threaded_steps")
    threads: list[int] = []

    @wf.step()
    def count(ctx: StepContext) -> list[int]:
        threads.append(threading.get_ident())
        return [1, 2, 3]

    @wf.step(after=[count])
    async def total(ctx: StepContext) -> int:
        return sum(ctx.results["count"])

    executors = Executors()
    executors.register_workflow(wf)
    run_id = await queue.start(wf)
    async with running(queue, executors):
        with trio.fail_after(TEST_DEADLINE):
            assert await queue.run_result(run_id) == 6
    assert threads
    assert threads[0] != threading.get_ident()


def test_is_async_callable_sees_through_partials_and_call_methods() -> None:
    import functools

    async def a(ctx: Any) -> None: ...

    def s(ctx: Any) -> None: ...

    class AsyncCall:
        async def __call__(self, ctx: Any) -> None: ...

    checks: list[Callable[..., Any]] = [a, functools.partial(a), AsyncCall()]
    assert all(threaded.is_async_callable(f) for f in checks)
    assert not threaded.is_async_callable(s)
    assert not threaded.is_async_callable(functools.partial(s))


async def test_a_run_never_clears_a_stop_with_a_null_exception(
    queue: Queue, monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Regression: every def run ended with PyThreadState_SetAsyncExc(thread, NULL)
    # to drop a stop that might be pending. On CPython 3.11 that call leaves the
    # interpreter's async-exception flag set for good, and the whole process ran
    # slower from then on (the state-machine hunts after this file went from 24 s
    # to past their 300 s timeout). A pending stop is taken, never cleared.
    sent: list[object] = []
    real = threaded._set_async_exc
    monkeypatch.setattr(threaded, "_set_async_exc",
                        lambda thread, exc: (sent.append(exc), real(thread, exc))[1])
    executors = Executors()

    @executors.register(Thumbnail, timeout=0.2, backoff=no_backoff)
    def make(ctx: PlainJobContext[Thumbnail]) -> int:
        if ctx.attempt == 1:
            busy_until(threading.Event())  # stopped by its timeout
        return ctx.attempt

    job_id = await queue.enqueue(Thumbnail(url="n"))
    async with running(queue, executors) as worker:
        await worker.wait_for(lambda s: s.done >= 1)
    assert await plain_state(queue, job_id) == ("completed", 2, "2")
    assert sent == [threaded.RunStopped]


async def test_a_run_cancelled_before_its_thread_starts_is_not_waited_for(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Found by review: a def run cancelled before trio handed it to a thread never
    started, yet the stop waited the whole grace (shielded) for its thread, holding
    up a hard stop, and logged that the thread "did not stop". It returns at once
    now; the function never runs."""
    monkeypatch.setattr(threaded, "THREAD_STOP_GRACE", 0.5)
    ran: list[int] = []
    run = threaded.in_thread(lambda ctx: ran.append(ctx), "never")
    with LogEvent("did not stop within") as left, trio.fail_after(TEST_DEADLINE), \
            trio.CancelScope() as scope:
        scope.cancel()
        await run(1)
    assert (ran, left.count) == ([], 0)
