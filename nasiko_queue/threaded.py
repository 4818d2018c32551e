"""
Plain ``def`` executors: run in a worker thread, stopped at their next Python line.

Most job code an application already has is synchronous: the Django ORM,
``requests``, boto3. Celery, RQ, Dramatiq and procrastinate all take such
functions as tasks, so the registry does too: a ``def`` executor (or workflow
step) runs in a thread of its own (`trio.to_thread.run_sync`), and the trio loop
that drives every other job, the heartbeats and the claims stays free.

A thread cannot be cancelled the way a trio task can. When its run must stop
(its timeout, a cancel request, a hard stop, a fence), the worker raises
`RunStopped` inside the thread, which Python delivers at the thread's next
line of Python code (`PyThreadState_SetAsyncExc`, as Dramatiq's time limits
do), and then waits up to `THREAD_STOP_GRACE` seconds for the thread to end
before it goes on as for any stopped run. A thread blocked inside one C call (a
socket read with no timeout) ends only when that call returns: give such calls
timeouts of their own. One that has not ended by then is left running, its
result dropped, and the log names the job.

`RunStopped` is a `BaseException`, so an executor's ``except Exception`` does not
swallow it; ``finally`` blocks and ``with`` statements still run.

Each run has a thread of its own: the lane's slots already bound how many of
its jobs run at once, so one queue's blocked threads never hold back another
queue's (trio's shared default limiter of 40 threads would).
"""

from __future__ import annotations

import ctypes
import functools
import inspect
import logging
import threading
from collections.abc import Awaitable, Callable
from typing import Any, Final

import trio

log = logging.getLogger("nasiko_queue.threaded")

#: Seconds a stopped ``def`` executor's thread is waited for once told to stop.
THREAD_STOP_GRACE: Final = 5.0


class RunStopped(BaseException):
    """Raised inside a ``def`` executor's thread when its run is stopped."""


def is_async_callable(fn: Callable[..., Any]) -> bool:
    """Whether calling `fn` runs it on the loop (an ``async def``, directly or wrapped)."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
        getattr(fn, "__call__", None))  # noqa: B004 - an async __call__, not callability


def _set_async_exc(thread_id: int, exc: type[BaseException]) -> None:
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_id), ctypes.py_object(exc))


class _StoppableCall:
    """One call of a ``def`` executor in a worker thread, which `stop()` interrupts."""

    def __init__(self, fn: Callable[[Any], Any], ctx: Any) -> None:
        self._fn = fn
        self._ctx = ctx
        self._lock = threading.Lock()
        self._thread: int | None = None
        self._stopped = False
        self._sent = False
        self._entered = False
        self.ended = threading.Event()

    def __call__(self) -> Any:
        try:
            with self._lock:
                self._entered = True
                if self._stopped:
                    raise RunStopped
                self._thread = threading.get_ident()
            try:
                return self._fn(self._ctx)
            finally:
                self._leave()
        finally:
            self.ended.set()

    def _leave(self) -> None:
        # A stop sent as the executor returned is still pending: Python raises it
        # at this thread's next check (a call, a loop's jump back). Take it here,
        # before the thread goes back to trio's thread machinery, by running a
        # few such checks once the thread is marked gone (after which `stop()`
        # sends nothing). A pending stop is never cleared with
        # ``PyThreadState_SetAsyncExc(id, NULL)``: on CPython 3.11 that leaves
        # the interpreter's "async exception pending" flag set for good, and
        # every thread of the process then runs slower (the state machines ran
        # 5 times slower after one ``def`` job).
        while True:
            try:
                with self._lock:
                    self._thread = None
                    sent = self._sent
                if sent:
                    for _ in range(3):
                        _checkpoint()
            except RunStopped:
                continue
            return

    def stop(self) -> bool:
        """
        Raise `RunStopped` in the thread at its next Python line (or before it
        starts). Returns whether the call had begun in a thread: a run cancelled
        before trio handed it to one never begins, and there is nothing to wait for.
        """
        with self._lock:
            self._stopped = True
            if self._thread is not None:
                self._sent = True
                _set_async_exc(self._thread, RunStopped)
            return self._entered


def _checkpoint() -> None:
    """A call: a point where Python raises an exception pending for this thread."""


def in_thread(fn: Callable[[Any], Any], what: str) -> Callable[[Any], Awaitable[Any]]:
    """
    An async executor that runs the ``def`` executor `fn` in a worker thread
    (`what` names it in the log). A ``def`` that returns an awaitable (a lambda
    around an ``async def``) has it awaited on the loop.
    """

    @functools.wraps(fn)
    async def run(ctx: Any) -> Any:
        report = getattr(ctx, "_run", None)  # a build job's RunReport
        if report is not None and report.on_building is not None:
            # `ctx.mark_building()` queues a write on the worker's loop: from the
            # thread, it goes through trio.
            report.on_building = functools.partial(
                trio.from_thread.run_sync, report.on_building,
                trio_token=trio.lowlevel.current_trio_token())
        call = _StoppableCall(fn, ctx)
        try:
            value = await trio.to_thread.run_sync(call, abandon_on_cancel=True,
                                                  limiter=trio.CapacityLimiter(1))
        except trio.Cancelled:
            if not call.stop():
                raise  # cancelled before a thread took it: it never runs
            with trio.move_on_after(THREAD_STOP_GRACE) as waited:
                waited.shield = True
                await trio.to_thread.run_sync(call.ended.wait, abandon_on_cancel=True)
            if waited.cancelled_caught:
                log.warning("job %s (%s): its def executor's thread did not stop within "
                            "%.0f s of its run being stopped (blocked in a call that Python "
                            "cannot interrupt); it is left running and its result is dropped",
                            getattr(ctx, "job_id", "?"), what, THREAD_STOP_GRACE)
            raise
        if inspect.isawaitable(value):
            return await value
        return value

    return run
