"""
The job executor: what each slot does with one claimed job (docs/rules.md §5).

A worker runs `concurrency` slots. Each takes the oldest job from the local
buffer and takes it through the steps, in order:

1. the attempt cap (the claim was one more than `max_attempts` allows: fail
   `max attempts exceeded`, terminalize);
2. the payload (any failure to parse: fail `invalid job payload`, terminalize);
3. the soft-delete check (fail `target deleted`; only its own build row ends);
4. the executor, in a child nursery of its own, so that whatever it raises (a
   "panic") lands in `reset_panicked_job` instead of taking the worker down, and
   so that it may start tasks of its own; bounded by the job's run-time limit
   when one is set, past which it is cancelled and counts as a crash.

When the executor returns, the slot hands the job to the completer and takes its
next job at once. A hard stop cancels the executor; the job goes back to pending
at once (shielded, bounded), its attempt counted.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Awaitable, Callable
from uuid import UUID

import trio

from .completer import Completer
from .config import QueueConfig
from .errors import InvalidPayload
from .executors import Executors, JobContext
from .job_errors import JobError, describe, secret_values
from .jobs import (
    INVALID_PAYLOAD,
    JOB_PANICKED,
    MAX_ATTEMPTS_EXCEEDED,
    TARGET_DELETED,
    ClaimedJob,
    JobStore,
)
from .payloads import Payload, PayloadCodec, Target
from .queue import Queue
from .retry import RetryPolicy, one_line
from .state import Finish, WorkerState

log = logging.getLogger("nasiko_queue.worker")


class JobExecutor:
    """
    The per-job pipeline, and the slots that run it.

    Args:
        state: the worker's shared state (the buffer, the counters).
        store: the database operations.
        queue: the queue (its database is the executors' `ctx.db`).
        executors: the registry; one executor per kind.
        codec: parses payloads (the built-in and the registered types).
        completer: takes the finished jobs.
        retry: the retry policy of final updates.
        wake: asks the worker for another drain (a crashed job's retry).
    """

    def __init__(self, state: WorkerState, store: JobStore, queue: Queue,
                 executors: Executors, codec: PayloadCodec, completer: Completer,
                 retry: RetryPolicy, wake: Callable[[], None]) -> None:
        self.state = state
        self.store = store
        self.queue = queue
        self.executors = executors
        self.codec = codec
        self.completer = completer
        self.retry = retry
        self.wake = wake
        self.config: QueueConfig = state.config

    # -- the slots ----------------------------------------------------------------

    async def run_slot(self) -> None:
        """Take claimed jobs from the buffer and run them, one at a time, until closing."""
        state = self.state
        state.slots_alive += 1
        try:
            while True:
                job = await self._take()
                if job is None:
                    return
                state.stats.running += 1
                finish: Finish | None = None
                try:
                    finish = await self.run_once(job)
                except Exception:
                    # Not the executor (its crashes are handled in run_once) and not
                    # the database (final updates retry): a bug, ours or in a payload
                    # type's code. Keep the other jobs running, and count it as a
                    # crash of this job, so that it is retried or failed, never
                    # left in_progress.
                    log.exception("job %s: internal error; counted as a crash", job.id)
                    await self.reset_panicked_job(job, None)
                finally:
                    # No checkpoint between the executor's return and this hand-over:
                    # a hard stop cannot come between them and lose the outcome.
                    state.stats.running -= 1
                    if finish is not None:
                        self.completer.add(finish)
                    state.kick()
                    state.notify()
        finally:
            state.slots_alive -= 1
            state.kick()

    async def _take(self) -> ClaimedJob | None:
        """The oldest buffered job, waiting for one if need be; None once closing."""
        state = self.state
        # A hard stop may already be on its way: then take nothing (what the
        # buffer holds goes back unstarted, its attempt restored).
        await trio.lowlevel.checkpoint_if_cancelled()
        while not state.buffer:
            if state.closing:
                return None
            if state.prefetch_paused:  # we run dry: prefetching is worth it again
                state.prefetch_paused = False
                state.kick()
            await state.job_ready.park()
        if state.closing:
            return None  # a stop: what the buffer holds goes back, never starts
        job, _claimed_at = state.buffer.popleft()
        state.stats.buffered -= 1
        return job

    # -- one job ------------------------------------------------------------------

    async def run_once(self, job: ClaimedJob) -> Finish | None:
        """
        Take one claimed job through steps 1-4 and run its executor.

        Returns the finish for the completer to record (step 5) when the executor
        returned; every other outcome (cap, invalid payload, deleted target,
        panic) is written here.
        """
        if self._out_of_attempts(job):
            log.warning("job %s: attempt %d exceeds the cap; failing", job.id, job.attempt)
            await self._fail(job, MAX_ATTEMPTS_EXCEEDED, own_build_id=None)
            return None
        payload = self._parse(job)
        if payload is None:
            # The build id comes from the row, read by PostgreSQL (`job_fail`).
            await self._fail(job, INVALID_PAYLOAD, own_build_id=None)
            return None
        if job.target_soft_deleted:
            log.warning("job %s (%s %s): target agent is deleted; not running", job.id,
                        payload.kind, _label(payload))
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
        label = f"{payload.kind} {_label(payload)}"
        log.info("job %s (%s): attempt %d starting", job.id, label, job.attempt)
        limit = self.executors.timeout_for(payload.kind) or self.config.job_timeout
        # Cancelled by the fence (the worker lost its lease) only; a hard stop
        # cancels from outside and passes through it.
        fence = trio.CancelScope()
        # Per claim, not per job: a crashed run's reset commits before this run's
        # bookkeeping ends, and another slot may already be running the job again.
        claim = (job.id, job.attempt)
        self.state.job_scopes[claim] = fence
        try:
            with fence, trio.move_on_after(math.inf if limit is None else limit) as limited:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(executor, ctx)
        except Exception as exc:  # the executor raised: an ExceptionGroup from its nursery
            self.state.stats.panicked += 1
            # Logged and kept with the payload's secret values masked: the
            # executor's message may quote them.
            error = describe(exc, attempt=job.attempt, reason="crash",
                             secrets=secret_values(payload))
            # The traceback as text, not exc_info: a formatter would print the
            # exception as raised, secrets and all. Handlers that want the error
            # itself find it in `record.job_error`.
            log.error("job %s (%s) panicked on attempt %d:\n%s", job.id, label, job.attempt,
                      error.traceback.rstrip(), extra={"job_error": error})
            await self._keep(job, error)
            await self.reset_panicked_job(job, payload.build_id)
            return None
        except BaseException:
            # Cancelled: a hard stop. The job never finished; hand it back now.
            await self._release(job)
            raise
        finally:
            del self.state.job_scopes[claim]
        if limited.cancelled_caught:
            self.state.stats.timed_out += 1
            log.error("job %s (%s) ran past its limit of %ss on attempt %d; cancelled, counted "
                      "as a crash", job.id, label, limit, job.attempt)
            await self._keep(job, JobError(
                attempt=job.attempt, reason="timeout", error_type="nasiko_queue.JobTimeout",
                message=f"ran past its limit of {limit}s", traceback=""))
            await self.reset_panicked_job(job, payload.build_id)
            return None
        if fence.cancelled_caught:
            # The worker is cut off or was declared dead: the run's outcome is not
            # written; the job is given back (by us if we can, else by the leader).
            log.warning("job %s (%s): stopped by the fence on attempt %d", job.id, label,
                        job.attempt)
            await self._release(job, why="the fence")
            return None
        return Finish(job=job, build_id=payload.build_id, label=label)

    async def _keep(self, job: ClaimedJob, error: JobError) -> None:
        """Keep the attempt's error; an outage loses it (logged), never the job."""
        try:
            await self.store.record_error(job, error)
        except Exception as exc:
            log.warning("job %s: could not keep the error of attempt %d (%s)", job.id,
                        job.attempt, one_line(exc))

    def fence(self) -> None:
        """Stop every running job's executor (the worker lost its lease)."""
        for scope in self.state.job_scopes.values():
            scope.cancel()

    def _parse(self, job: ClaimedJob) -> Payload | None:
        """
        The job's payload, or None (logged) when it is not one: whatever the
        row holds — JSON no payload type accepts, nesting deep enough to exhaust
        Python's recursion limit, a payload over `max_payload_bytes` that the
        claim did not even send — fails this job alone.
        """
        if job.payload is None:
            log.warning("job %s: invalid payload: over max_payload_bytes (%d)", job.id,
                        self.config.max_payload_bytes)
            return None
        try:
            return self.codec.decode(json.loads(job.payload))
        except Exception as exc:  # RecursionError included: any failure is the payload's
            log.warning("job %s: invalid payload: %s", job.id,
                        exc if isinstance(exc, InvalidPayload) else type(exc).__name__)
            return None

    def _out_of_attempts(self, job: ClaimedJob) -> bool:
        """The cap (step 1): this claim is one more than MAX_ATTEMPTS allows."""
        return job.old_attempt >= self.config.max_attempts

    async def reset_panicked_job(self, job: ClaimedJob, build_id: UUID | None) -> None:
        """
        The documented rule: old_attempt + 1 >= MAX_ATTEMPTS fails.

        So a job that always raises runs exactly MAX_ATTEMPTS times and ends
        failed with attempt = MAX_ATTEMPTS; otherwise it goes back to the front
        of the queue, and this drain retries it at once.
        """
        if job.old_attempt + 1 >= self.config.max_attempts:
            await self._fail(job, JOB_PANICKED, own_build_id=build_id)
        else:
            await self.retry.final("reset", lambda: self.store.reset(job))
            # Retry at once. With one slot the drain's next claim takes it anyway;
            # with more, the drain may already have ended, so ask for another.
            self.wake()

    async def _fail(
        self, job: ClaimedJob, message: str, *, own_build_id: UUID | None, terminalize: bool = True
    ) -> None:
        def fail(terminalize: bool) -> Callable[[], Awaitable[bool]]:
            return lambda: self.store.fail(
                job, message, own_build_id=own_build_id, terminalize=terminalize
            )

        ours = await self.retry.final(
            "fail",
            fail(terminalize),
            # The target's terminalization is refused for good: mark the job alone.
            fallback=fail(False) if terminalize else None,
        )
        if ours:
            self.state.stats.failed += 1

    async def _release(self, job: ClaimedJob, *, why: str = "a hard stop") -> None:
        # Shielded; bounded by the store (cleanup_timeout on both sides of the bridge).
        with trio.CancelScope(shield=True):
            try:
                if await self.store.reset(job):
                    self.state.stats.released += 1
                    log.warning("job %s: cancelled by %s; back to pending", job.id, why)
            except Exception as exc:
                log.warning("job %s: could not be put back after %s (%s); a rescue or the "
                            "sweep will", job.id, why, one_line(exc))


def _label(payload: Payload) -> str:
    """`payload.label()`, for logs; a bug in a payload type's label is not the job's end."""
    try:
        return payload.label()
    except Exception as exc:
        return f"<label() raised {type(exc).__name__}>"
