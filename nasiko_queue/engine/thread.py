"""
The worker in a thread of an application that is not a trio program.

An asyncio application (FastAPI, aiohttp) or a synchronous one (Django, Flask)
runs its jobs in its own process, as the Mastra seed's default mode does, by
starting `start_worker_thread(...)` with the app and stopping it with the app:
the thread runs `trio.run` with a `Worker` of its own (its own database pool, on
its own trio-asyncio loop), so the application's event loop, if it has one, is
never touched. The guarantees are a worker process's: claims, heartbeats,
rescue, retries are the same code. `stop()` is the graceful stop (docs/rules.md
§8: nothing more is claimed, the running jobs finish); past its `timeout` it
stops hard, and the running jobs go back to pending, as on a second Ctrl-C.

>>> with start_worker_thread(dsn, executors) as worker_thread:   # returns once started
...     serve_the_app()
... # leaving the block: graceful stop, joined
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import math
import os
import threading
import weakref
from collections.abc import Awaitable, Callable, Sequence
from types import TracebackType
from typing import Any, TypeVar

import trio

from ..config import QueueConfig
from ..db.database import DatabaseConfig, open_database
from ..db.migrate import migrate as migrate_database
from ..executors import Executors
from ..plain.schedules import Schedule
from ..queue import Queue
from ..secrets import SecretBox
from .state import WorkerStats
from .worker import Worker

log = logging.getLogger("nasiko_queue.thread")

T = TypeVar("T")


class WorkerThread:
    """
    A `Worker` running in a daemon thread; from `start_worker_thread`.

    Attributes:
        worker: the running worker (its `stats`, its lanes), once started.
        queue: its `Queue` (on the thread's own pool).
    """

    def __init__(self, database: DatabaseConfig | str, executors: Executors, *,
                 config: QueueConfig | None = None, secrets: SecretBox | None = None,
                 schedules: Sequence[Schedule] = (), migrate: bool = False,
                 stop_at_exit: bool = True, name: str = "nasiko-queue worker") -> None:
        self._database = database
        self._executors = executors
        self._config = config
        self._secrets = secrets
        self._schedules = schedules
        self._migrate = migrate
        self.worker: Worker | None = None
        self.queue: Queue | None = None
        self._stop_at_exit = stop_at_exit
        self._token: trio.lowlevel.TrioToken | None = None
        #: Around everything the thread does (the database's opening included),
        #: so that a hard stop can end it at any point.
        self._scope: trio.CancelScope | None = None
        #: Set once `_token` and `_scope` are (or the thread has ended).
        self._reachable = threading.Event()
        self._started = threading.Event()
        self._stop_requested = False
        #: Set in a child process forked while the thread ran: see `_forked_off`.
        self._forked = False
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)

    # -- the application's side ------------------------------------------------

    def start(self, *, timeout: float | None = 60.0) -> None:
        """Start the thread; return once the worker has started (its startup
        recovery done), or raise what stopped it from starting (the error
        itself: a wrong DSN's, an unmigrated database's)."""
        self._thread.start()
        if not self._started.wait(timeout):
            self.stop(timeout=0)
            raise TimeoutError(f"the worker thread had not started after {timeout}s")
        if self._error is not None:
            raise _unwrapped(self._error)
        if self.worker is None:
            raise RuntimeError("the worker thread was stopped before it had started")
        if self._stop_at_exit:
            # A daemon thread is frozen at exit, its jobs left for the rescue to
            # find a lease later; atexit runs before that: stop gracefully.
            atexit.register(self.stop)
        # A forked child (gunicorn --preload) has this object but not the thread.
        _STARTED.add(self)

    def stop(self, *, timeout: float | None = 30.0) -> None:
        """
        Stop gracefully and join: nothing more is claimed, the running jobs
        finish. Past `timeout` seconds (None: no limit) it stops hard: the jobs
        still running are cancelled and go back to pending at once, as they do
        when the wait is interrupted (a second Ctrl-C during the exit's stop).
        From inside the worker (an executor) it only asks for the graceful stop:
        the thread cannot wait for itself.

        Raises:
            RuntimeError: the worker had stopped on an error of its own (its
                cause): a supervisor should know the jobs were not being run;
                or this is a process forked after the start (see `_forked_off`).
        """
        self._not_forked()
        self._stop_requested = True  # before anything: a start under way stops at once
        if threading.current_thread() is self._thread:
            if self.worker is not None:
                self.worker.stop()
            return
        atexit.unregister(self.stop)
        if self._thread.is_alive():
            self.request_stop()
            try:
                self._thread.join(timeout)
            except BaseException:  # KeyboardInterrupt: stop hard, then let it go on
                self._stop_hard("the wait for it was interrupted")
                raise
            if self._thread.is_alive():
                self._stop_hard(f"it had not stopped after {timeout}s")
        if self._error is not None and self.worker is not None:
            raise RuntimeError("the worker thread had stopped on an error") \
                from _unwrapped(self._error)

    def _stop_hard(self, why: str) -> None:
        log.warning("stopping the worker thread now (running jobs go back to pending): %s",
                    why)
        self._reachable.wait()
        if self._scope is not None:
            self._in_trio(self._scope.cancel)
        self._thread.join()

    def request_stop(self) -> None:
        """Ask for the graceful stop and return at once, even while an executor
        blocks the worker's loop (a sync ORM call): it takes effect as soon as
        that loop runs, and no claim begins after it. `stop()` or `join()`
        waits for the running jobs.

        Raises:
            RuntimeError: this is a process forked after the start.
        """
        self._not_forked()
        # Seen by the thread if the worker starts after this (it stops at once),
        # or the worker is already there to be stopped: either way, once.
        self._stop_requested = True
        if self.worker is not None:
            if threading.current_thread() is self._thread:
                self.worker.stop()
            else:
                self._in_trio(self.worker.stop)

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the thread to end; True if it has.

        Raises:
            RuntimeError: this is a process forked after the start.
        """
        self._not_forked()
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def wait_for(self, condition: Callable[[WorkerStats], bool], *,
                 timeout: float | None = None) -> None:
        """
        Block until `condition(worker.stats)` holds (``lambda s: s.done >= 1``):
        for a script or a test that must know its jobs have run, without sleeping.

        Raises:
            TimeoutError: it did not hold within `timeout` seconds.
        """
        self._not_forked()
        worker = self.worker
        if worker is None:
            raise RuntimeError("the worker thread is not running")

        async def wait() -> None:
            with trio.move_on_after(math.inf if timeout is None else timeout):
                await worker.wait_for(condition)
                return
            raise TimeoutError(f"the worker's condition did not hold within {timeout}s")

        self.run(wait)

    def run(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """Run async function `fn(*args)` in the worker's trio loop and return its
        value (a test's `worker.wait_for(...)`, a `queue.enqueue(...)`).

        Raises:
            RuntimeError: the worker thread is not running, or stopped meanwhile
                (not trio's own Cancelled, which an `except Exception` misses).
        """
        self._not_forked()
        if self._token is None:
            raise RuntimeError("the worker thread is not running")
        try:
            return trio.from_thread.run(fn, *args, trio_token=self._token)
        except (trio.Cancelled, trio.RunFinishedError):
            raise RuntimeError("the worker thread stopped") from None

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def __enter__(self) -> WorkerThread:
        return self

    def __exit__(self, _type: type[BaseException] | None, _value: BaseException | None,
                 _tb: TracebackType | None) -> None:
        self.stop()

    def _in_trio(self, fn: Callable[[], None]) -> None:
        """`fn()` in the worker's loop, as soon as it runs; not waited for (an
        executor may block that loop for seconds)."""
        if self._token is None:
            return
        with contextlib.suppress(trio.RunFinishedError):  # it stopped by itself meanwhile
            self._token.run_sync_soon(fn)

    def _forked_off(self) -> None:
        """In a child process forked after the start: the thread did not come
        along (a fork copies only the thread that forks), so nothing here may
        reach it; its worker goes on in the parent. The child's copy of the
        `threading.Thread` says it has ended, so without `_forked` its `stop()`
        and `join()` would return as if the worker had stopped: a gunicorn
        --preload app would believe it had stopped a worker it never had."""
        self._forked = True
        self._token = None
        self.worker = self.queue = None
        atexit.unregister(self.stop)

    def _not_forked(self) -> None:
        if self._forked:
            raise RuntimeError(
                "this process was forked after the worker thread started: the thread "
                "and its worker are the parent's; start one in this process instead")

    # -- the thread's side -------------------------------------------------------

    def _main(self) -> None:
        try:
            trio.run(self._run)
        except BaseException as exc:
            self._error = exc
            if self._started.is_set():  # after the start: only the log knows now
                log.exception("the worker thread stopped on an error")
            else:  # `start` raises it in the caller
                log.debug("the worker thread could not start", exc_info=True)
        finally:
            # Ended: a child forked from now on has nothing of it to miss.
            _STARTED.discard(self)
            self._reachable.set()
            self._started.set()

    async def _run(self) -> None:
        with trio.CancelScope() as self._scope:
            self._token = trio.lowlevel.current_trio_token()
            self._reachable.set()
            async with open_database(self._database) as db:
                if self._migrate:
                    await migrate_database(db)
                queue = Queue(db, config=self._config, secrets=self._secrets)
                worker = Worker(queue, self._executors, schedules=self._schedules)
                async with trio.open_nursery() as nursery:
                    await nursery.start(worker.run)
                    self.queue, self.worker = queue, worker
                    if self._stop_requested:
                        worker.stop()
                    self._started.set()


#: Worker threads started in this process, for `_after_fork`.
_STARTED: weakref.WeakSet[WorkerThread] = weakref.WeakSet()


def _after_fork() -> None:
    for thread in list(_STARTED):
        thread._forked_off()
    _STARTED.clear()


os.register_at_fork(after_in_child=_after_fork)


def _unwrapped(exc: BaseException) -> BaseException:
    """The one error inside nurseries' exception groups, or `exc` as it is."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc


def start_worker_thread(database: DatabaseConfig | str, executors: Executors, *,
                        config: QueueConfig | None = None, secrets: SecretBox | None = None,
                        schedules: Sequence[Schedule] = (), migrate: bool = False,
                        stop_at_exit: bool = True,
                        start_timeout: float | None = 60.0) -> WorkerThread:
    """
    Run a worker for `executors` in a thread of this process; return once it has
    started. Stop it with `.stop()` (graceful, then hard past its timeout), or use
    the result as a context manager. `migrate=True` applies the migrations first.
    With `stop_at_exit` (the default) the process's exit stops it gracefully too
    (atexit), for apps with no shutdown hook of their own (Django).
    Arguments as for `Queue` and `Worker`; `database` a DSN or a `DatabaseConfig`.

    From a FastAPI lifespan, a Django ``AppConfig.ready``, a Flask app factory: one
    per process (or more, each its own worker).
    """
    thread = WorkerThread(database, executors, config=config, secrets=secrets,
                          schedules=schedules, migrate=migrate, stop_at_exit=stop_at_exit)
    thread.start(timeout=start_timeout)
    return thread
