"""
Results a caller can await (issue #22): what a plain job's executor returned.

Written by the worker: the executor's return value is unstructured by the wire
format's one cattrs converter and encoded as compact JSON (`encode_result`);
the completing statement writes it with the completion, so a completed job and
its result commit together, or neither does. A value that JSON cannot hold, or
one over `QueueConfig.max_result_bytes`, is refused: the job is discarded with
the reason (never truncated; retrying would only run the side effects again).

Read by the caller: `Results.wait` LISTENs (one connection shared by every wait
of a `Results` block), records the wait (`nasiko_queue_result_waits`), then
reads the job's row; the trigger of migration 0017 sends one NOTIFY, the job's
id, when a job somebody waits for ends, by whichever path. So a wait costs no
polling while LISTEN is up; while it is down (an outage), waits read the row
every `poll_interval` seconds, and every wait reads it again when LISTEN comes
back, since what ended meanwhile notified nobody. A read that fails for the
outage is tried again at the next poll: only the caller's timeout ends a wait.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any, TypeVar, overload
from uuid import UUID, uuid4

import trio

from ..builds.payloads import converter
from ..config import QueueConfig
from ..db.database import Database
from ..db.statements import Q
from ..engine.contracts import JobResult
from ..engine.retry import one_line
from ..errors import JobFailed, NoSuchJob, NoSuchRun, ResultTimeout, RunFailed, is_transient

log = logging.getLogger("nasiko_queue.results")

#: The NOTIFY channel of ended jobs that somebody waits for (migration 0017).
RESULTS_CHANNEL = "nasiko_queue_results"

T = TypeVar("T")

_JSON = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False, allow_nan=False)


class ResultRefused(Exception):
    """An executor's return value that cannot be stored; the message says why."""


def encode_result(value: object, limit: int) -> JobResult | None:
    """
    The result row's JSON of an executor's return `value` (None: no result).

    attrs classes, enums and the rest of what the wire format's converter
    knows become their JSON form, as payloads do.

    Raises:
        ResultRefused: not JSON (a set, an object the converter does not know,
            NaN or an infinite float), a NUL character (jsonb cannot hold one),
            or over `limit` bytes encoded.
    """
    if value is None:
        return None
    try:
        text = _JSON.encode(converter.unstructure(value))
        size = len(text.encode())
    except (TypeError, ValueError, RecursionError) as exc:  # UnicodeError is a ValueError
        raise ResultRefused(f"the result is not JSON: {one_line(exc)}") from None
    if "\\u0000" in text.replace("\\\\", ""):  # an escaped NUL, not an escaped backslash
        raise ResultRefused("the result holds a NUL character (\\u0000), which PostgreSQL's "
                            "jsonb cannot store")
    if size > limit:
        raise ResultRefused(f"the result is {size} bytes encoded, over max_result_bytes "
                            f"({limit})")
    return JobResult(text)


@overload
def decode_result(value: object, result_type: None = None) -> Any: ...


@overload
def decode_result(value: object, result_type: type[T]) -> T: ...


def decode_result(value: object, result_type: type[T] | None = None) -> Any:
    """A stored result (parsed JSON, as asyncpg returns jsonb: text) as `result_type`
    (structured by the wire format's converter), or as parsed JSON when None."""
    data = json.loads(value) if isinstance(value, str) else value
    return data if result_type is None else converter.structure(data, result_type)


class Results:
    """
    Waits for jobs' results over one LISTEN connection; from `open_results`.

    Args:
        db: the queue's database.
        poll_interval: seconds between reads of a waited job's row while LISTEN
            is down.
        retry_initial_delay, retry_max_delay: backoff of LISTEN's reconnects.
    """

    def __init__(self, db: Database, config: QueueConfig) -> None:
        self._db = db
        self._config = config
        self._events: dict[UUID, set[trio.Event]] = {}
        #: Whether LISTEN is up: waits then read their row only when notified.
        self.listening = False
        #: Test signal: called with the job's id each time a wait has read its
        #: row, found it not ended, and blocks until it is woken.
        self.on_waiting: Callable[[UUID], None] | None = None

    async def wait(self, job_id: UUID, *, timeout: float | None = None,  # noqa: ASYNC109
                   result_type: type[Any] | None = None) -> Any:  # (see `Queue.result`)
        """
        The result of plain job `job_id` once it has completed (None if its
        executor returned None), decoded as `result_type` when given.

        Raises:
            JobFailed: it was discarded or cancelled (its last error attached).
            NoSuchJob: no plain job has this id (or it was deleted meanwhile).
            ResultTimeout: it had not ended within `timeout` seconds.
        """
        def conclude(row: Any) -> tuple[bool, Any]:
            if row is None:
                raise NoSuchJob(f"no plain job {job_id}")
            if row["state"] == "completed":
                return True, (None if row["result"] is None
                              else decode_result(row["result"], result_type))
            if row["state"] in ("discarded", "cancelled"):
                raise JobFailed(job_id, row["state"], row["error_msg"])
            return False, None

        with trio.move_on_after(math.inf if timeout is None else timeout) as scope:
            # The jobs' channel: a read that held the row while the job was due
            # wakes its queue's workers (statement `result_wait_and_read`).
            return await self._wait(job_id, Q.plain_result, Q.result_wait_and_read, conclude,
                                    (self._config.notify_channel,))
        assert scope.cancelled_caught
        raise ResultTimeout(f"job {job_id} had not ended after {timeout}s")

    async def wait_run(self, run_id: UUID, *, timeout: float | None = None,  # noqa: ASYNC109
                       result_type: type[Any] | None = None) -> Any:
        """
        The result of workflow run `run_id` once it has completed, decoded as
        `result_type` when given; woken as `wait` is (migration 0018's trigger on
        a run's end notifies its waiters the same way).

        Raises:
            RunFailed: it failed or was cancelled (its failed step and error attached).
            NoSuchRun: no run has this id.
            ResultTimeout: it had not ended within `timeout` seconds.
        """
        def conclude(row: Any) -> tuple[bool, Any]:
            if row is None:
                raise NoSuchRun(f"no workflow run {run_id}")
            if row["state"] == "completed":
                return True, (None if row["result"] is None
                              else decode_result(row["result"], result_type))
            if row["state"] in ("failed", "cancelled"):
                raise RunFailed(run_id, row["state"], row["failed_step"], row["error"])
            return False, None

        with trio.move_on_after(math.inf if timeout is None else timeout) as scope:
            return await self._wait(run_id, Q.workflow_result, Q.workflow_result_wait_and_read,
                                    conclude)
        assert scope.cancelled_caught
        raise ResultTimeout(f"run {run_id} had not ended after {timeout}s")

    async def _wait(self, job_id: UUID, read: str, wait_and_read: str,
                    conclude: Callable[[Any], tuple[bool, Any]],
                    wait_args: tuple[object, ...] = ()) -> Any:
        """Read row `read` of `job_id` (a job's or a run's) until `conclude` says it
        has ended (True and the value), woken by its NOTIFY in between. While LISTEN
        is up, `wait_and_read` records the wait and reads the row FOR SHARE in one
        statement, before every read: an end whose trigger ran before the wait
        existed still holds the row until it commits, so the read waits for it and
        sees the end; an end that locks the row later finds the wait and notifies;
        and a wait consumed by an end that an operator then retried is recorded anew."""
        waiter = uuid4()
        event = self._watch(job_id)
        recorded = False
        try:
            while True:
                armed = self.listening
                try:
                    if armed:
                        recorded = True  # before the insert: removing a row not there is
                        row = await self._db.fetchrow(wait_and_read, job_id,  # harmless
                                                      waiter, *wait_args)
                    else:
                        row = await self._db.fetchrow(read, job_id)
                except Exception as exc:
                    if not is_transient(exc):
                        raise
                    # An outage: the wait goes on (only its timeout ends it), and
                    # reads again at the next poll, or once LISTEN is back.
                    log.warning("could not read %s (%s); reading again in %.1fs", job_id,
                                one_line(exc), self._config.poll_interval)
                    armed = False
                else:
                    ended, value = conclude(row)
                    if ended:
                        return value
                if self.on_waiting is not None:
                    self.on_waiting(job_id)
                if armed and self.listening:
                    await event.wait()
                else:
                    with trio.move_on_after(self._config.poll_interval):
                        await event.wait()
                event = self._rewatch(job_id, event)
        finally:
            self._unwatch(job_id, event)
            if recorded:
                with trio.CancelScope(shield=True), \
                        trio.move_on_after(self._config.cleanup_timeout):
                    try:
                        await self._db.execute(Q.result_wait_remove, job_id, waiter)
                    except Exception as exc:  # the job's end removes it anyway
                        log.warning("could not remove the wait for job %s: %s", job_id,
                                    one_line(exc))

    def _watch(self, job_id: UUID) -> trio.Event:
        event = trio.Event()
        self._events.setdefault(job_id, set()).add(event)
        return event

    def _rewatch(self, job_id: UUID, old: trio.Event) -> trio.Event:
        self._unwatch(job_id, old)
        return self._watch(job_id)

    def _unwatch(self, job_id: UUID, event: trio.Event) -> None:
        events = self._events.get(job_id)
        if events is not None:
            events.discard(event)
            if not events:
                del self._events[job_id]

    def _on_notify(self, payload: str) -> None:
        try:
            job_id = UUID(payload)
        except ValueError:
            return
        for event in self._events.get(job_id, ()):
            event.set()

    def _wake_all(self) -> None:
        for events in self._events.values():
            for event in events:
                event.set()

    async def listen(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
                     ) -> None:
        """LISTEN until cancelled, reconnecting with backoff; started once LISTEN is up
        or its first try failed (waits poll meanwhile)."""
        config = self._config
        delay = config.retry_initial_delay
        started = False
        while True:
            try:
                async with self._db.listen(RESULTS_CHANNEL, self._on_notify) as listening:
                    self.listening = True
                    self._wake_all()  # what ended while nobody listened
                    if not started:
                        started = True
                        task_status.started()
                    delay = config.retry_initial_delay
                    try:
                        while not listening.lost.is_set():
                            with trio.move_on_after(config.listen_check_interval):
                                await listening.lost.wait()
                            if not listening.lost.is_set() and not await listening.check(
                                    config.cleanup_timeout):
                                break
                    finally:
                        self.listening = False
                        self._wake_all()  # they poll until it is back
                log.warning("LISTEN %s lost; reconnecting in %.2fs", RESULTS_CHANNEL, delay)
            except Exception as exc:
                log.warning("LISTEN %s failed (%s); retrying in %.2fs", RESULTS_CHANNEL,
                            one_line(exc), delay)
            if not started:
                started = True
                task_status.started()
            await trio.sleep(delay)
            delay = min(delay * 2, config.retry_max_delay)


@asynccontextmanager
async def open_results(db: Database, config: QueueConfig) -> AsyncIterator[Results]:
    """A `Results` whose LISTEN connection lives as long as the block."""
    results = Results(db, config)
    # The block's own exception (JobFailed, ResultTimeout, the caller's) is raised
    # as itself, not inside the ExceptionGroup of the LISTEN task's nursery.
    failure: Exception | None = None
    async with trio.open_nursery() as nursery:
        await nursery.start(results.listen)
        try:
            yield results
        except Exception as exc:
            failure = exc
        finally:
            nursery.cancel_scope.cancel()
    if failure is not None:
        raise failure
