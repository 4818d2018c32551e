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
4. the run, guarded in its slot's cancel scope, bounded by the job's run-time
   limit and by the fence (`Slots.run_guarded`, the same as build jobs). A
   return completes the job (the completer's batched statement), with what the
   executor returned as its result (`results.encode_result`; a value that
   cannot be stored discards the job, "result refused: ..."); a crash or a
   timeout makes it available again after its backoff, or discards it on its
   last attempt; a cancel request stops it and ends it `cancelled`.

Every outcome written here (a retry, an end) cannot wedge the slot: its error
text is storable (`job_errors.storable`), its backoff clamped to what an
interval holds (`clamp_backoff`), and a write the database still refuses on its
merits (an application's trigger, a narrower encoding) is written again as a
minimal one (plain ASCII text; for a retry, `BACKOFF_FALLBACK`), then as a
discard, "could not record the outcome: ..."; if even that is refused, it is
logged and the row left running, for the rescue once this worker stops. An
outage is retried for as long as it lasts.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Awaitable, Callable
from typing import TypeVar
from uuid import UUID

import trio

from ..engine.contracts import INVALID_PAYLOAD, MAX_ATTEMPTS_EXCEEDED, ClaimedJob
from ..engine.retry import one_line
from ..engine.slots import Ran, Slots, label_of
from ..engine.state import Finish
from ..errors import FinalWriteRefused, InvalidPayload
from ..executors import PlainJobContext
from ..job_errors import JobError, minimal_text, one_line_error, secret_values
from .args import JobArgs
from .results import ResultRefused, encode_result
from .store import CANCELLED, DISCARDED, PlainJobStore

log = logging.getLogger("nasiko_queue.worker")

T = TypeVar("T")

#: The longest backoff kept, in seconds (a year): a longer one, or an infinite
#: one, waits this long. PostgreSQL's interval and timestamp ranges end far
#: beyond it; a backoff past them could not be written at all.
MAX_BACKOFF = 365 * 86_400.0
#: The backoff, in seconds, of a retry whose backoff function raised or
#: returned no number (NaN); also of a retry written again as a minimal one.
BACKOFF_FALLBACK = 60.0
#: The error of a job discarded because the database refused its outcome.
UNRECORDED = "could not record the outcome: "
#: The error of a job discarded because its executor's return value cannot be
#: stored (issue #22), before the reason.
RESULT_REFUSED = "result refused: "


def clamp_backoff(delay: float) -> float | None:
    """A backoff as the retry writes it: within [0, `MAX_BACKOFF`] (negative: at
    once; too long or infinite: `MAX_BACKOFF`); None for NaN (no delay at all)."""
    if math.isnan(delay):
        return None
    return min(max(delay, 0.0), MAX_BACKOFF)


class PlainJobExecutor(Slots[PlainJobStore]):
    """The pipeline of one queue of plain jobs, run by its lane's slots;
    constructed as `Slots`, with that queue's `PlainJobStore`."""

    async def run_claimed(self, job: ClaimedJob, scope: trio.CancelScope) -> Finish | None:
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
            await self._defer(job, missing)
            return None
        args = self._parse_args(job)
        if args is None:
            await self._end(job, DISCARDED, INVALID_PAYLOAD)
            return None
        label = f"{args.kind} {label_of(args)}"
        ctx = PlainJobContext(job_id=job.id, attempt=job.attempt, max_attempts=job.max_attempts,
                              queue=job.queue, payload=args, db=self.queue.db)
        limit = self.executors.timeout_for(args.kind) or self.config.job_timeout
        returned: list[object] = []

        async def run() -> None:
            returned.append(await executor(ctx))

        async def settle(ran: Ran, error: JobError | None) -> Finish | None:
            if error is not None:  # it crashed or timed out: kept, logged
                await self._retry(job, error)
                return None
            if ran is Ran.FENCED:
                return None
            try:
                result = encode_result(returned[0] if returned else None,
                                       self.config.max_result_bytes)
            except ResultRefused as exc:
                # Not retried: the run's effects are done, and the same run would
                # return the same value.
                log.error("job %s (%s): %s; discarding it", job.id, label, exc)
                await self._end(job, DISCARDED, f"{RESULT_REFUSED}{exc}")
                return None
            return Finish(job=job, build_id=None, label=label, report=result)

        return await self.run_guarded(job, run, label, limit, lambda: secret_values(args),
                                      settle, scope)

    async def reset_panicked_job(self, job: ClaimedJob, build_id: UUID | None) -> None:
        """An internal error around the run (not the executor's): a crash."""
        await self._retry(job, JobError(attempt=job.attempt, reason="crash",
                                        error_type="nasiko_queue.InternalError",
                                        message="internal error; see the worker's log",
                                        traceback=""))

    async def on_fenced(self, job: ClaimedJob, label: str) -> bool:
        # A cancel request cancels the same scope as the fence; the fence wins
        # (the job is given back) when both came.
        claim = job.claim
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

    def _backoff(self, job: ClaimedJob) -> float:
        """The job's backoff after this attempt, clamped; `BACKOFF_FALLBACK` (logged)
        when its function raised or returned no number."""
        assert job.kind is not None
        try:
            asked = float(self.executors.backoff_for(job.kind)(job.attempt))
        except Exception:
            log.exception("job %s: the backoff of kind %r raised; retrying in %.0fs", job.id,
                          job.kind, BACKOFF_FALLBACK)
            return BACKOFF_FALLBACK
        delay = clamp_backoff(asked)
        if delay is None:
            log.error("job %s: the backoff of kind %r returned %r; retrying in %.0fs", job.id,
                      job.kind, asked, BACKOFF_FALLBACK)
            return BACKOFF_FALLBACK
        if delay != asked and delay > 0:
            log.warning("job %s: the backoff of kind %r returned %r; waiting %.0fs (the "
                        "longest kept)", job.id, job.kind, asked, delay)
        return delay

    async def _final(self, job: ClaimedJob, what: str, op: Callable[[], Awaitable[T]],
                     minimal: Callable[[], Awaitable[T]],
                     discard: Callable[[str], Awaitable[T]]) -> T | None:
        """
        Write one outcome under the retry policy: `op`, then `minimal` (the same
        outcome, minimal text), then `discard` (with the last refusal's text),
        each once refused `terminalize_tries` times. None (logged) when even the
        discard is refused: the row stays running, for the rescue.
        """
        refusal: list[BaseException] = []

        async def remember(call: Callable[[], Awaitable[T]]) -> T:
            try:
                return await call()
            except Exception as exc:
                refusal[:] = [exc]
                raise

        cause: list[str] = []

        async def discarded() -> T:
            if not cause:  # logged once, whatever the tries
                cause.append(one_line(refusal[0]) if refusal else "refused")
                log.error("job %s: could not record the outcome (%s); discarding it", job.id,
                          cause[0])
            return await discard(minimal_text(UNRECORDED + cause[0]))

        try:
            return await self.retry.final(what, lambda: remember(op),
                                          fallbacks=[lambda: remember(minimal), discarded])
        except FinalWriteRefused as exc:
            log.error("job %s: could not record the outcome, nor discard it (%s); left "
                      "running, for the rescue once this worker stops", job.id,
                      one_line(exc.__cause__ or exc))
            return None

    async def _retry(self, job: ClaimedJob, error: JobError) -> None:
        delay = self._backoff(job)
        line = one_line_error(error)
        state = await self._final(
            job, "retry", lambda: self.store.retry(job, delay, line),
            lambda: self.store.retry(job, BACKOFF_FALLBACK, minimal_text(line)),
            lambda why: self._discard(job, why))
        if state == DISCARDED:
            self.state.stats.failed += 1
            log.error("job %s: discarded after %d attempt(s): %s", job.id, job.attempt, line,
                      extra={"job_error": error})
        elif state == CANCELLED:  # a cancel was asked for while it ran
            self.state.stats.cancelled += 1
            log.warning("job %s: cancelled (its cancel came before the crash)", job.id)
        elif state is not None:
            self.state.stats.retried += 1
            log.info("job %s: attempt %d failed; next run in %.1fs", job.id, job.attempt, delay)
            if delay <= 0:
                self.wake()
            else:
                # Its lane wakes when the backoff ends, not at its next poll: no
                # drain follows this write to read when the job falls due.
                self.state.due_at(trio.current_time() + delay)
            await self._tell_due(job)

    async def _tell_due(self, job: ClaimedJob) -> None:
        """
        The job is available again (now or after its backoff): tell the other
        workers serving its queue, which would else find it only at their poll
        (this worker may be busy, or gone, by then). One NOTIFY per such job;
        a failure is logged, and their poll finds the job.
        """
        try:
            await self.store.notify_due()
        except Exception as exc:
            log.warning("job %s: could not tell the other workers when it is due (%s); "
                        "their poll will find it", job.id, one_line(exc))

    async def _defer(self, job: ClaimedJob, missing: JobError) -> None:
        """No executor for the job's kind here (a rolling deploy): back for another
        worker after its backoff, the attempt not counted, so that it is never
        discarded for that alone (nor kept as an attempt's error: it never ran)."""
        delay = self._backoff(job)
        line = one_line_error(missing)
        state = await self._final(
            job, "defer", lambda: self.store.defer(job, delay, line),
            lambda: self.store.defer(job, BACKOFF_FALLBACK, minimal_text(line)),
            lambda why: self._discard(job, why))
        if state == CANCELLED:
            self.state.stats.cancelled += 1
            log.warning("job %s: cancelled (no executor here, and a cancel came)", job.id)
        elif state is not None:
            self.state.stats.retried += 1
            log.error("job %s: %s; given back unrun, for a worker that has one, in %.1fs",
                      job.id, missing.message, delay)
            await self._tell_due(job)

    async def _discard(self, job: ClaimedJob, why: str) -> str | None:
        return await self.store.end(job, DISCARDED, why)

    async def _end(self, job: ClaimedJob, state: str, error: str | None) -> None:
        text = None if error is None else minimal_text(error)
        written = await self._final(job, "end", lambda: self.store.end(job, state, error),
                                    lambda: self.store.end(job, state, text),
                                    lambda why: self.store.end(job, DISCARDED, why))
        if written == CANCELLED:
            self.state.stats.cancelled += 1
            if state != CANCELLED:
                log.warning("job %s: cancelled (its cancel came before it ended)", job.id)
        elif written is not None:
            self.state.stats.failed += 1
