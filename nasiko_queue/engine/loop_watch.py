"""
The loop watch: the lease does not depend on the event loop being free.

An ``async def`` executor that calls blocking code (``time.sleep``, ``requests``,
the Django ORM) holds the worker's trio loop for as long as the call lasts, and
with it the heartbeat. Past the lease the leader declared the worker dead and
gave its jobs back, and when the loop came back the fence threw the finished
result away: the job ran again, up to its last attempt. Nothing was wrong but
one blocking call, which is the first mistake every Django or FastAPI user makes.

So a thread of its own watches the loop. The loop ticks a timestamp every half
interval; while it ticks, the thread does nothing. When the loop has not ticked
for a heartbeat interval, the thread renews the worker's row itself, on a
connection of its own (asyncpg on an asyncio loop in that thread), so that the
process keeps its lease while it lives, and logs which job blocked the loop,
where, for how long, and the fix. Only an executor's blocking call is covered
(the loop thread's stack runs through a slot's `run_guarded`): a loop held by
other code keeps no lease, as before. The heartbeat's fence asks it, before stopping
the worker's jobs, whether a renewal landed meanwhile.

What it does not change: a process that is gone (killed, its host lost) stops
renewing, and its jobs are rescued once the lease ends; a process paused
whole (SIGSTOP) pauses this thread too, and is fenced as before; a database
that cannot be reached cannot be renewed from here either. A job that blocks
the loop for ever holds its lease for ever, as a ``def`` job blocked in a C call
would: its timeout is enforced by the loop, once the loop is back.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import sysconfig
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Any
from uuid import UUID

import asyncpg
import trio

from ..db.schema import SCHEMA
from ..db.statements import Q

log = logging.getLogger("nasiko_queue.worker")

#: Seconds between the watch's reports while the loop stays blocked.
REPORT_EVERY = 10.0

_STDLIB = sysconfig.get_paths()["stdlib"]
_OURS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class LoopWatch:
    """
    Renews worker `worker_id()`'s row while the trio loop is blocked, and names the blocker.

    Args:
        dsn: the database, reached on a connection of the watch's own.
        worker_id: the worker's current identity (None while it has none).
        interval: the heartbeat interval: the loop is blocked once it has not
            ticked for this long, and the watch renews at this pace.
        connect_timeout: seconds to open its connection, and for each renewal.
    """

    def __init__(self, dsn: str, worker_id: Callable[[], UUID | None], interval: float,
                 connect_timeout: float = 10.0) -> None:
        self.dsn = dsn
        self.worker_id = worker_id
        self.interval = interval
        self.connect_timeout = connect_timeout
        #: time.monotonic() of the loop's last tick.
        self._ticked = time.monotonic()
        #: time.monotonic() at which the last renewal the watch sent was sent (it landed).
        self.renewed_at: float | None = None
        #: Renewals that landed (for tests and metrics).
        self.renewals = 0
        self._stop = threading.Event()
        self._loop_thread: int | None = None
        self._conn: Any = None
        self._aio: asyncio.AbstractEventLoop | None = None

    def renewed_within(self, seconds: float) -> bool:
        """Whether a renewal sent in the last `seconds` landed."""
        return self.renewed_at is not None and time.monotonic() - self.renewed_at < seconds

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
                  ) -> None:
        """Tick for the watch's thread until cancelled; the thread ends with it."""
        self._loop_thread = threading.get_ident()
        self._stop.clear()
        thread = threading.Thread(target=self._watch, name="nasiko-queue loop watch",
                                  daemon=True)
        thread.start()
        task_status.started()
        try:
            while True:
                self._ticked = time.monotonic()
                await trio.sleep(self.interval / 2)
        finally:
            self._stop.set()

    # -- the watch's thread ------------------------------------------------------------

    def _watch(self) -> None:
        blocked_since: float | None = None
        reported_at = 0.0
        try:
            while not self._stop.wait(self.interval / 2):
                now = time.monotonic()
                stalled = now - self._ticked
                if stalled < self.interval:
                    if blocked_since is not None:
                        log.warning("the event loop is free again after %.1fs", stalled)
                    blocked_since = None
                    continue
                job, where = _blocker(sys._current_frames().get(self._loop_thread or -1))
                if job is None:
                    # Not an executor's blocking call (the loop is held by other
                    # code: the application's, a test harness's): not the watch's
                    # to cover, the lease runs as it would.
                    blocked_since = None
                    continue
                if blocked_since is None:
                    blocked_since, reported_at = self._ticked, 0.0
                self._renew()
                if now - reported_at >= REPORT_EVERY or reported_at == 0.0:
                    reported_at = now
                    self._report(now - blocked_since, job, where)
        finally:
            self._close()

    def _renew(self) -> None:
        worker = self.worker_id()
        if worker is None:
            return
        sent = time.monotonic()
        try:
            if self._aio is None:
                # A plain asyncio loop of the thread's own, whatever policy is set.
                self._aio = asyncio.SelectorEventLoop()
            landed = self._aio.run_until_complete(self._send(worker))
        except Exception as exc:
            log.warning("the loop watch could not renew the worker's lease (%s)",
                        type(exc).__name__)
            self._drop_connection()
            return
        if landed:
            self.renewed_at = sent
            self.renewals += 1

    async def _send(self, worker: UUID) -> bool:
        if self._conn is None or self._conn.is_closed():
            self._conn = await asyncpg.connect(self.dsn, timeout=self.connect_timeout)
            await self._conn.execute(Q.session_schema_append, SCHEMA,
                                     timeout=self.connect_timeout)
        return bool(await self._conn.fetchval(Q.worker_keep_alive, worker,
                                              timeout=self.connect_timeout))

    def _drop_connection(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None and self._aio is not None:
            try:
                self._aio.run_until_complete(conn.close(timeout=self.connect_timeout))
            except Exception:
                conn.terminate()

    def _close(self) -> None:
        self._drop_connection()
        if self._aio is not None:
            self._aio.close()
            self._aio = None

    def _report(self, blocked_for: float, job: str, where: str | None) -> None:
        what = f"job {job}"
        log.warning(
            "the event loop has been blocked for %.1fs by %s%s: blocking code in an async "
            "def executor holds every other job, the heartbeat and the claims. Make the "
            "executor a plain def (it then runs in a thread), or call the blocking code "
            "through trio.to_thread.run_sync. The loop watch keeps the worker's lease "
            "meanwhile.", blocked_for, what, f" at {where}" if where else "")


def _blocker(frame: FrameType | None) -> tuple[str | None, str | None]:
    """
    The job whose executor holds the loop thread (from the slot's frame on its
    stack, `run_guarded`, whose locals name the job), and the innermost line of
    the application's code there: neither the standard library nor this package.
    """
    job: str | None = None
    where: str | None = None
    while frame is not None:
        code = frame.f_code
        filename = os.path.abspath(code.co_filename)
        if where is None and not filename.startswith((_STDLIB, _OURS)):
            where = f"{code.co_filename}:{frame.f_lineno} in {code.co_name}"
        if code.co_name == "run_guarded" and filename.startswith(_OURS):
            claimed, label = frame.f_locals.get("job"), frame.f_locals.get("label")
            if claimed is not None:
                job = f"{claimed.id} ({label})" if label else str(claimed.id)
            break
        frame = frame.f_back
    return job, where
