"""
The worker: one trio nursery that turns wake-ups into drains.

Shape (SPEC §5, §8)::

    run()
      recover stuck jobs (retried until the database answers), then started()
      nursery "timers":  the recovery timer (first tick one period after start,
                         missed ticks skipped; it also prunes when
                         `QueueConfig.retention` is set), and the LISTEN task (a
                         dedicated connection whose notifications feed the wake
                         channel; reconnects with backoff and drains after a loss)
      nursery "executors": one child task per claimed job
      drain loop:        drain; then wait for a wake (channel of capacity 64) or
                         the poll timeout (5 s, re-armed after every drain);
                         coalesce the wakes that piled up; drain again

A drain claims jobs until none is pending, never more at once than there are
free executor slots (`QueueConfig.concurrency`, 1 as in the original: the
next claim then waits for the running job). Each claimed job goes through the
attempt cap, payload parsing and the soft-delete check before its executor
runs in a nursery of its own, so that an exception ("panic") lands in
`reset_panicked_job` instead of taking the worker down.

Stopping: `stop()` (or closing every send side of the wake channel) lets the
running executors finish and claims nothing more. Cancelling `run()` cancels
the executors, and their jobs go back to pending at once, shielded, so no
replica waits for the sweep.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
from collections.abc import Awaitable, Callable
from typing import TypeVar
from uuid import UUID

import attrs
import trio

from .config import QueueConfig
from .errors import InvalidPayload, is_transient
from .executors import Executors, JobContext
from .jobs import (
    INVALID_PAYLOAD,
    JOB_PANICKED,
    MAX_ATTEMPTS_EXCEEDED,
    TARGET_DELETED,
    ClaimedJob,
    JobStatus,
    JobStore,
    PgJobStore,
    RecoveryResult,
)
from .payloads import BUILTIN_PAYLOAD_TYPES, Payload, PayloadCodec, Target, raw_build_id
from .queue import Queue
from .retention import prune

log = logging.getLogger("nasiko_queue.worker")

T = TypeVar("T")


@attrs.define
class WorkerStats:
    """Counters since the worker started; for tests, `status` and benchmarks."""

    drains_started: int = 0
    drains_completed: int = 0
    claimed: int = 0
    done: int = 0
    failed: int = 0
    panicked: int = 0
    released: int = 0
    recoveries: int = 0
    claim_errors: int = 0
    running: int = 0
    #: LISTEN connections established (1 after start; each reconnect adds one).
    listen_connects: int = 0
    #: Notifications received on the LISTEN connection.
    notifications: int = 0
    #: Finished jobs deleted by the retention prune of the recovery tick.
    pruned: int = 0


@attrs.define(eq=False)
class _Finish:
    """One slot's request to the completer: record this job's outcome, maybe hand on."""

    job: ClaimedJob
    build_id: UUID
    done: trio.Event = attrs.Factory(trio.Event)
    status: JobStatus | None = None
    next_job: ClaimedJob | None = None
    #: The slot stopped waiting (a hard stop): hand it nothing.
    abandoned: bool = False


class Worker:
    """
    Runs jobs from one queue with one registry of executors.

    >>> worker = Worker(queue, executors)
    >>> async with trio.open_nursery() as nursery:
    ...     await nursery.start(worker.run)
    ...     await queue.enqueue(payload)      # wakes this worker after commit
    ...     worker.stop()                     # graceful: running jobs finish

    Args:
        queue: the queue to drain; its config supplies every constant.
        executors: one executor per kind this worker runs; it claims only those
            kinds (plus kinds no payload type knows, which fail as invalid).
        store: the database operations; `PgJobStore` unless a test gives a fake.
    """

    def __init__(
        self,
        queue: Queue,
        executors: Executors,
        *,
        store: JobStore | None = None,
    ) -> None:
        if not len(executors):
            raise ValueError("a worker needs at least one registered executor")
        self.queue = queue
        self.config: QueueConfig = queue.config
        self.executors = executors
        types = {t.kind: t for t in BUILTIN_PAYLOAD_TYPES}
        types.update({t.kind: t for t in executors.payload_types})
        self._codec = PayloadCodec(types=types.values(), secrets=queue.secrets)
        self._store: JobStore = store or PgJobStore(
            queue.db,
            self.config,
            runnable_kinds=executors.kinds,
            known_kinds=frozenset(types) | self.config.other_kinds,
        )
        self._wake_send, self._wake_recv = trio.open_memory_channel[None](
            self.config.wake_capacity
        )
        self._slots = trio.Semaphore(self.config.concurrency)
        # Several slots: their finishes go through one completer, which records
        # every finish queued at that moment in one statement.
        self._finish_send, self._finish_recv = trio.open_memory_channel[_Finish](math.inf)
        self._stop = trio.Event()
        self._started = False
        self._changed = trio.Event()
        self.stats = WorkerStats()

    # -- signals -----------------------------------------------------------

    def wake(self) -> None:
        """Ask for a drain. Never blocks: a wake that does not fit is dropped."""
        with contextlib.suppress(trio.WouldBlock, trio.ClosedResourceError,
                                 trio.BrokenResourceError):
            self._wake_send.send_nowait(None)

    def stop(self) -> None:
        """Graceful stop: claim nothing more, let running executors finish, return."""
        self._stop.set()
        self._wake_send.close()

    async def drain_once(self) -> None:
        """
        Wake the worker and wait until a drain that began after this call is over.

        "Over" means the claim found nothing runnable and no executor is running.
        Meant for tests and tools that need to know the queue has been worked,
        without sleeping.
        """
        target = self.stats.drains_started + 1
        self.wake()
        while not (self.stats.drains_completed >= target and self.stats.running == 0):
            if self._stop.is_set():
                raise RuntimeError("the worker is stopping; no further drain will run")
            await self._changed.wait()

    async def wait_for(self, condition: Callable[[WorkerStats], bool]) -> None:
        """
        Wait until `condition(worker.stats)` holds; checked whenever the stats change.

        A test signal in the manner of River's: wait on what the worker did (say
        ``lambda s: s.done >= 3``) instead of sleeping and hoping.
        """
        while not condition(self.stats):
            await self._changed.wait()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    # -- the loop -------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """
        Run until stopped (returns) or cancelled (running jobs go back to pending).

        Use with `nursery.start(worker.run)`: it reports itself started once the
        startup recovery sweep has run.
        """
        if self._started:
            raise RuntimeError("a Worker runs once; create a new one")
        self._started = True
        if await self._until_success("startup recovery", self._recover) is None:
            task_status.started()  # stopped before the database ever answered
            log.info("worker stopped before it started")
            return
        self.queue._add_waker(self.wake)
        try:
            async with trio.open_nursery() as timers:
                timers.start_soon(self._recovery_timer)
                if self.config.concurrency > 1:
                    timers.start_soon(self._completer)
                if self.config.listen and self.config.notify_channel is not None:
                    # Returns once LISTEN is established (or its first try failed),
                    # so that an enqueue after `nursery.start(worker.run)` wakes us.
                    await timers.start(self._listener, self.config.notify_channel)
                async with trio.open_nursery() as executors:
                    task_status.started()
                    log.info("worker started (kinds: %s)", ", ".join(sorted(self.executors)))
                    await self._drain_loop(executors)
                # Every executor has finished; the timers have nothing left to guard.
                timers.cancel_scope.cancel()
        finally:
            self.queue._remove_waker(self.wake)
            self._stop.set()
            self._notify()
        log.info("worker stopped")

    async def _drain_loop(self, executors: trio.Nursery) -> None:
        while True:
            await self._drain(executors)
            if self._stop.is_set():
                return
            with trio.move_on_after(self.config.poll_interval):
                try:
                    await self._wake_recv.receive()
                except trio.EndOfChannel:
                    return
            # Wakes that arrived during the drain are all answered by the next one.
            while True:
                try:
                    self._wake_recv.receive_nowait()
                except trio.WouldBlock:
                    break
                except trio.EndOfChannel:
                    return
            if self._stop.is_set():
                return

    async def _drain(self, executors: trio.Nursery) -> None:
        """Claim and start jobs until none is pending (or a claim fails)."""
        self.stats.drains_started += 1
        try:
            while not self._stop.is_set():
                await self._slots.acquire()
                free = 1
                while True:  # claim as many jobs as there are free slots
                    try:
                        self._slots.acquire_nowait()
                    except trio.WouldBlock:
                        break
                    free += 1
                if self._stop.is_set():
                    self._release_slots(free)
                    return
                jobs = await self._claim(free)
                if jobs is None:
                    self._release_slots(free)
                    return
                self._release_slots(free - len(jobs))
                if not jobs:
                    return
                self.stats.claimed += len(jobs)
                for job in jobs:
                    self.stats.running += 1
                    executors.start_soon(self._run_job, job, name=f"job {job.id}")
        finally:
            self.stats.drains_completed += 1
            self._notify()

    async def _claim(self, limit: int) -> list[ClaimedJob] | None:
        """
        The claim, shielded and bounded: a hard stop must not cut it after the
        server committed it, or the job would sit in_progress with no executor
        until the sweep. None when it failed (logged; the drain stops).
        """
        with trio.CancelScope(shield=True):
            with trio.move_on_after(self.config.cleanup_timeout):
                try:
                    return await self._store.claim(limit)
                except Exception as exc:
                    self.stats.claim_errors += 1
                    log.error("claim failed (%s); waiting for the next wake or poll",
                              _one_line(exc), exc_info=not is_transient(exc))
                    return None
            self.stats.claim_errors += 1
            log.error("claim took over %.1fs; waiting for the next wake or poll",
                      self.config.cleanup_timeout)
        return None

    def _release_slots(self, n: int) -> None:
        for _ in range(n):
            self._slots.release()

    # -- one job --------------------------------------------------------------

    async def _run_job(self, first: ClaimedJob) -> None:
        """
        Run a job in its executor slot, then any job handed on to the same slot.

        A job whose executor returned is finished by the statement that also
        claims the next job for this slot (`finish_and_claim`), so the slot
        goes straight on with it: one round trip per job instead of two.
        """
        job: ClaimedJob | None = first
        try:
            while job is not None:
                current = job
                job = None
                try:
                    job = await self._process(current)
                except Exception:
                    # Not the executor (its crashes are handled in _process) and not
                    # the database (final updates retry): a bug of ours. Keep the other
                    # jobs running; this one stays in_progress for the recovery sweep.
                    log.exception("job %s: internal error; left for the recovery sweep",
                                  current.id)
        finally:
            self.stats.running -= 1
            self._slots.release()
            self._notify()

    async def _process(self, job: ClaimedJob) -> ClaimedJob | None:
        """Take one claimed job through SPEC §5 steps 1-5; return a job handed on, if any."""
        store = self._store
        if self._out_of_attempts(job):
            log.warning("job %s: attempt %d exceeds the cap; failing", job.id, job.attempt)
            await self._fail(job, MAX_ATTEMPTS_EXCEEDED, own_build_id=_raw_build_id(job))
            return None
        try:
            payload = self._codec.decode(json.loads(job.payload))
        except Exception as exc:  # any failure to parse is the payload's, not ours
            log.warning("job %s: invalid payload: %s", job.id,
                        exc if isinstance(exc, InvalidPayload) else type(exc).__name__)
            await self._fail(job, INVALID_PAYLOAD, own_build_id=_raw_build_id(job))
            return None
        if job.target_soft_deleted:
            log.warning("job %s (%s %s): target agent is deleted; not running", job.id,
                        payload.kind, payload.label())
            await self._fail(job, TARGET_DELETED, own_build_id=payload.build_id, terminalize=False)
            return None
        executor = self.executors.executor_for(payload.kind)
        if executor is None:  # the claim filters on our kinds, so this is a bug
            raise RuntimeError(f"claimed a {payload.kind} job without an executor for it")
        ctx = JobContext(
            job_id=job.id,
            attempt=job.attempt,
            payload=payload,
            owner_id=job.owner_id,
            target=Target(agent_id=job.agent_id, connector_id=job.connector_id),
            db=self.queue.db,
        )
        log.info("job %s (%s %s): attempt %d starting", job.id, payload.kind, payload.label(),
                 job.attempt)
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(executor, ctx)
        except Exception as exc:  # the executor raised: an ExceptionGroup from its nursery
            self.stats.panicked += 1
            log.error("job %s (%s %s) panicked on attempt %d", job.id, payload.kind,
                      payload.label(), job.attempt, exc_info=exc)
            await self._reset_panicked_job(job, payload)
            return None
        except BaseException:
            # Cancelled: a hard stop. The job never finished; hand it back now.
            await self._release(job)
            raise
        handed_on: list[ClaimedJob] = []
        if self._stop.is_set():
            status = await self._final(
                "finish", lambda: store.finish_from_build(job, payload.build_id))
        elif self.config.concurrency > 1:
            status, handed_on = await self._finish_batched(job, payload.build_id)
        else:
            status, handed_on = await self._final(
                "finish", lambda: store.finish_and_claim(job, payload.build_id, 1))
        if status is not None:
            if status == "done":
                self.stats.done += 1
            else:
                self.stats.failed += 1
        log.info("job %s (%s %s): %s", job.id, payload.kind, payload.label(), status or "gone")
        self.stats.claimed += len(handed_on)
        return handed_on[0] if handed_on else None

    async def _finish_batched(
        self, job: ClaimedJob, build_id: UUID
    ) -> tuple[JobStatus | None, list[ClaimedJob]]:
        """Hand the finish to the completer and wait for it (several slots only)."""
        request = _Finish(job=job, build_id=build_id)
        self._finish_send.send_nowait(request)
        try:
            await request.done.wait()
        except trio.Cancelled:
            # A hard stop: make sure the outcome lands (a no-op if the completer
            # already wrote it), and give back a job claimed for us meanwhile.
            request.abandoned = True
            with trio.CancelScope(shield=True), trio.move_on_after(self.config.cleanup_timeout):
                try:
                    await self._store.finish_from_build(job, build_id)
                    if request.next_job is not None:
                        await self._store.unclaim(request.next_job)
                except Exception:
                    log.exception("job %s: finish after a hard stop failed; the sweep will "
                                  "recover it", job.id)
            raise
        return request.status, [request.next_job] if request.next_job else []

    async def _completer(self) -> None:
        """
        Record finishes in batches: everything queued when the previous statement
        returned goes into the next one, which also claims a job for each slot.

        Nothing waits to fill a batch — a lone finish goes out at once — so no
        job is delayed; under load, the finishes that pile up during one round
        trip share the next.
        """
        while True:
            batch = [await self._finish_recv.receive()]
            while True:
                try:
                    batch.append(self._finish_recv.receive_nowait())
                except trio.WouldBlock:
                    break
            wanted = 0 if self._stop.is_set() else sum(not r.abandoned for r in batch)
            statuses, claimed = await self._final(
                "finish",
                functools.partial(self._store.finish_many_and_claim,
                                  [(r.job, r.build_id) for r in batch], wanted),
            )
            for request in batch:
                request.status = statuses.get(request.job.id)
                if claimed and not request.abandoned:
                    request.next_job = claimed.pop(0)
                request.done.set()
            for extra in claimed:  # a slot went away while we claimed for it
                with trio.CancelScope(shield=True), \
                        trio.move_on_after(self.config.cleanup_timeout):
                    try:
                        await self._store.unclaim(extra)
                    except Exception:
                        log.exception("job %s: could not be given back; the recovery sweep "
                                      "will", extra.id)

    def _out_of_attempts(self, job: ClaimedJob) -> bool:
        """The cap (SPEC §5 step 1): this claim is one more than MAX_ATTEMPTS allows."""
        return job.old_attempt >= self.config.max_attempts

    async def _reset_panicked_job(self, job: ClaimedJob, payload: Payload) -> None:
        """
        SPEC §5 [decision]: the documented rule, old_attempt + 1 >= MAX_ATTEMPTS fails.

        So a job that always raises runs exactly MAX_ATTEMPTS times and ends
        failed with attempt = MAX_ATTEMPTS; otherwise it goes back to the front
        of the queue, and this drain retries it at once.
        """
        if job.old_attempt + 1 >= self.config.max_attempts:
            await self._fail(job, JOB_PANICKED, own_build_id=payload.build_id)
        elif await self._final("reset", lambda: self._store.reset(job)):
            # Retry at once. With one slot the drain's next claim takes it anyway;
            # with more, the drain may already have ended, so ask for another.
            self.wake()

    async def _fail(
        self, job: ClaimedJob, message: str, *, own_build_id: UUID | None, terminalize: bool = True
    ) -> None:
        def fail(terminalize: bool) -> Callable[[], Awaitable[bool]]:
            return lambda: self._store.fail(
                job, message, own_build_id=own_build_id, terminalize=terminalize
            )

        ours = await self._final(
            "fail",
            fail(terminalize),
            # The target's terminalization is refused for good: mark the job alone.
            fallback=fail(False) if terminalize else None,
        )
        if ours:
            self.stats.failed += 1

    async def _release(self, job: ClaimedJob) -> None:
        with trio.CancelScope(shield=True), trio.move_on_after(self.config.cleanup_timeout):
            try:
                if await self._store.reset(job):
                    self.stats.released += 1
                    log.warning("job %s: cancelled by a hard stop; back to pending", job.id)
            except Exception:
                log.exception("job %s: could not be put back after a hard stop; "
                              "the recovery sweep will", job.id)

    async def _final(
        self,
        what: str,
        op: Callable[[], Awaitable[T]],
        *,
        fallback: Callable[[], Awaitable[T]] | None = None,
    ) -> T:
        """
        A final update: retried with backoff until it succeeds (SPEC §5 [decision]).

        A finished job's result must not be lost, or the sweep would run the
        build again. So each attempt is shielded from a hard stop (bounded by
        `cleanup_timeout`); only the wait between attempts can be cancelled, and
        then one last attempt is made. When the database keeps rejecting `op`
        on its merits (not an outage), `fallback` takes over after
        `terminalize_tries` attempts.
        """
        delay = self.config.retry_initial_delay
        rejected = 0
        while True:
            failure: BaseException = trio.TooSlowError(
                f"took over {self.config.cleanup_timeout}s")
            with trio.CancelScope(shield=True), trio.move_on_after(self.config.cleanup_timeout):
                try:
                    return await op()
                except Exception as exc:
                    failure = exc
            if not is_transient(failure):
                rejected += 1
                if fallback is not None and rejected >= self.config.terminalize_tries:
                    log.error("%s update rejected %d times (%s); falling back", what, rejected,
                              _one_line(failure))
                    op, fallback, rejected = fallback, None, 0
                    continue
            log.warning("%s update failed (%s); retrying in %.2fs", what, _one_line(failure),
                        delay, exc_info=failure)
            try:
                await trio.sleep(delay)
            except trio.Cancelled:
                with trio.CancelScope(shield=True), \
                        trio.move_on_after(self.config.cleanup_timeout):
                    try:
                        await op()
                    except Exception:
                        log.exception("last %s update failed; the sweep will recover the job",
                                      what)
                raise
            delay = min(delay * 2, self.config.retry_max_delay)

    # -- recovery -------------------------------------------------------------

    async def _recover(self) -> RecoveryResult:
        result = await self._store.recover()
        self.stats.recoveries += 1
        self._notify()
        return result

    async def _prune(self) -> None:
        """The retention part of a recovery tick (`QueueConfig.retention`)."""
        if self.config.retention is None:
            return
        try:
            self.stats.pruned += await prune(self.queue.db, self.config.retention)
        except Exception as exc:
            log.warning("retention prune failed (%s); next try at the next tick",
                        _one_line(exc))
        self._notify()

    # -- LISTEN ---------------------------------------------------------------

    def _on_notification(self, _payload: str) -> None:
        """Runs on the trio thread, from asyncpg's listener callback; never blocks."""
        self.stats.notifications += 1
        self.wake()

    async def _listener(
        self, channel: str, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """
        LISTEN on `channel` on a dedicated connection and turn notifications into wakes.

        When the connection is lost, reconnect with backoff, and once LISTEN is back
        wake the worker: whatever was enqueued while nobody listened sent its
        notification into the void. The poll stays the safety net throughout.
        """
        delay = self.config.retry_initial_delay
        started = False
        while True:
            try:
                async with self.queue.db.listen(channel, self._on_notification) as lost:
                    self.stats.listen_connects += 1
                    if started:
                        log.info("LISTEN %s re-established; draining what it missed", channel)
                        self.wake()
                    else:
                        started = True
                        task_status.started()
                    self._notify()
                    connected_at = trio.current_time()
                    await lost.wait()
                    if trio.current_time() - connected_at > self.config.retry_max_delay:
                        delay = self.config.retry_initial_delay  # it was a healthy connection
                    log.warning("LISTEN connection lost; reconnecting in %.2fs", delay)
            except Exception as exc:
                log.warning("LISTEN %s failed (%s); retrying in %.2fs", channel,
                            _one_line(exc), delay)
            if not started:  # do not hold the worker's start hostage: the poll covers
                started = True
                task_status.started()
            await trio.sleep(delay)
            delay = min(delay * 2, self.config.retry_max_delay)

    async def _recovery_timer(self) -> None:
        """Sweep every `recovery_interval`; first tick one period in, missed ticks skipped."""
        period = self.config.recovery_interval
        next_tick = trio.current_time() + period
        while True:
            await trio.sleep_until(next_tick)
            try:
                await self._recover()
            except Exception:
                log.exception("recovery sweep failed; next one in %.0fs", period)
            else:
                self.wake()  # the sweep is one of the three signals: drain what it freed
            await self._prune()
            now = trio.current_time()
            next_tick += period
            if next_tick <= now:  # the sweep overran: skip, never replay, missed ticks
                next_tick += math.ceil((now - next_tick) / period) * period
                if next_tick <= now:
                    next_tick += period

    async def _until_success(self, what: str, op: Callable[[], Awaitable[T]]) -> T | None:
        """Retry `op` with backoff until it succeeds; None if `stop()` came first."""
        delay = self.config.retry_initial_delay
        while True:
            try:
                return await op()
            except Exception as exc:
                log.warning("%s failed (%s); retrying in %.2fs", what, _one_line(exc), delay)
            with trio.move_on_after(delay):
                await self._stop.wait()
            if self._stop.is_set():
                return None
            delay = min(delay * 2, self.config.retry_max_delay)


def _raw_build_id(job: ClaimedJob) -> UUID | None:
    try:
        return raw_build_id(json.loads(job.payload))
    except ValueError:
        return None


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"
