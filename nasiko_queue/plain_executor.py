"""
What each slot of a plain queue's lane does with one claimed job.

The steps, in order:

1. the attempt cap (the claim is past the job's `max_attempts`, as after a
   crash on the last attempt that could not be written): discarded
   `max attempts exceeded`;
2. the executor (none registered here for the kind, as during a rolling deploy
   that adds one: a retry after the backoff, with that as the error);
3. the arguments (any failure to parse: discarded `invalid job payload`; bad
   input is not retried, and the worker goes on);
4. the run, guarded in a cancel scope of its own, bounded by the job's run-time
   limit and by the fence (`Slots.run_guarded`, the same as build jobs). A
   return completes the job (the completer's batched statement); a crash or a
   timeout makes it available again after its backoff, or discards it on its
   last attempt; a cancel request stops it and ends it `cancelled`.
"""

from __future__ import annotations

import json
import logging
from uuid import UUID

from .errors import InvalidPayload
from .executors import PlainJobContext
from .job_args import JobArgs
from .job_errors import JobError, one_line_error, secret_values
from .jobs import INVALID_PAYLOAD, MAX_ATTEMPTS_EXCEEDED, ClaimedJob
from .plain_jobs import CANCELLED, DISCARDED, PlainJobStore
from .slots import Ran, Slots, label_of
from .state import Finish

log = logging.getLogger("nasiko_queue.worker")


class PlainJobExecutor(Slots[PlainJobStore]):
    """The pipeline of one queue of plain jobs, run by its lane's slots;
    constructed as `Slots`, with that queue's `PlainJobStore`."""

    async def run_once(self, job: ClaimedJob) -> Finish | None:
        assert job.max_attempts is not None
        assert job.queue is not None
        if job.attempt > job.max_attempts:
            log.warning("job %s: attempt %d exceeds its %d; discarding", job.id, job.attempt,
                        job.max_attempts)
            await self._end(job, DISCARDED, MAX_ATTEMPTS_EXCEEDED)
            return None
        assert job.kind is not None
        executor = self.executors.plain_executor_for(job.kind)
        if executor is None:
            missing = JobError(attempt=job.attempt, reason="crash",
                               error_type="nasiko_queue.NoExecutor",
                               message=f"no executor for kind {job.kind!r} in this worker",
                               traceback="")
            log.error("job %s: %s", job.id, missing.message)
            await self._keep(job, missing)
            await self._retry(job, missing)
            return None
        args = self._parse_args(job)
        if args is None:
            await self._end(job, DISCARDED, INVALID_PAYLOAD)
            return None
        label = f"{args.kind} {label_of(args)}"
        ctx = PlainJobContext(job_id=job.id, attempt=job.attempt, max_attempts=job.max_attempts,
                              queue=job.queue, payload=args, db=self.queue.db)
        limit = self.executors.timeout_for(args.kind) or self.config.job_timeout
        ran, error = await self.run_guarded(job, lambda: executor(ctx), label, limit,
                                            lambda: secret_values(args))
        if error is not None:  # it crashed or timed out: kept, logged
            await self._retry(job, error)
            return None
        if ran is Ran.FENCED:
            return None
        return Finish(job=job, build_id=None, label=label)

    async def reset_panicked_job(self, job: ClaimedJob, build_id: UUID | None) -> None:
        """An internal error around the run (not the executor's): a crash."""
        await self._retry(job, JobError(attempt=job.attempt, reason="crash",
                                        error_type="nasiko_queue.InternalError",
                                        message="internal error; see the worker's log",
                                        traceback=""))

    async def on_fenced(self, job: ClaimedJob, label: str) -> bool:
        # A cancel request cancels the same scope as the fence; the fence wins
        # (the job is given back) when both came.
        claim = (job.id, job.attempt)
        if claim not in self.state.cancels:
            return False
        self.state.cancels.discard(claim)
        if self.state.fenced:
            return False
        log.warning("job %s (%s): cancelled while running (attempt %d)", job.id, label,
                    job.attempt)
        await self._end(job, CANCELLED, "cancelled")
        return True

    def _parse_args(self, job: ClaimedJob) -> JobArgs | None:
        if job.payload is None:
            log.warning("job %s: invalid payload: over max_payload_bytes (%d)", job.id,
                        self.config.max_payload_bytes)
            return None
        try:
            args = self.codec.decode_args(json.loads(job.payload))
            if args.kind != job.kind:  # another writer's row: the columns disagree
                raise InvalidPayload(f"payload kind {args.kind!r} is not the row's "
                                     f"{job.kind!r}")
            return args
        except Exception as exc:  # RecursionError included: any failure is the payload's
            log.warning("job %s: invalid payload: %s", job.id,
                        exc if isinstance(exc, InvalidPayload) else type(exc).__name__)
            return None

    async def _retry(self, job: ClaimedJob, error: JobError) -> None:
        assert job.kind is not None
        try:
            delay = float(self.executors.backoff_for(job.kind)(job.attempt))
        except Exception:
            log.exception("job %s: the backoff of kind %r raised; retrying in 60s", job.id,
                          job.kind)
            delay = 60.0
        line = one_line_error(error)
        state = await self.retry.final("retry", lambda: self.store.retry(job, delay, line))
        if state == DISCARDED:
            self.state.stats.failed += 1
            log.error("job %s: discarded after %d attempt(s): %s", job.id, job.attempt, line)
        elif state == CANCELLED:  # a cancel was asked for while it ran
            self.state.stats.cancelled += 1
            log.warning("job %s: cancelled (its cancel came before the crash)", job.id)
        elif state is not None:
            self.state.stats.retried += 1
            log.info("job %s: attempt %d failed; next run in %.1fs", job.id, job.attempt, delay)
            if delay <= 0:
                self.wake()

    async def _end(self, job: ClaimedJob, state: str, error: str | None) -> None:
        if await self.retry.final("end", lambda: self.store.end(job, state, error)):
            if state == CANCELLED:
                self.state.stats.cancelled += 1
            else:
                self.state.stats.failed += 1
