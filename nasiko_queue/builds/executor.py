"""
The build jobs' pipeline: what a build lane's slot does with one claimed job
(docs/rules.md §5).

A slot (`slots.Slots`) takes the oldest job from the lane's local buffer and
this takes it through the steps, in order:

1. the attempt cap (the claim was one more than `max_attempts` allows: fail
   `max attempts exceeded`, terminalize);
2. the payload (any failure to parse: fail `invalid job payload`, terminalize);
3. the soft-delete check (fail `target deleted`; only its own build row ends);
4. the executor, guarded (`Slots.run_guarded`): whatever it raises (a "panic")
   lands in `reset_panicked_job` instead of taking the worker down; bounded by
   the job's run-time limit when one is set, past which it is cancelled and
   counts as a crash.

When the executor returns, the slot hands the job to the completer (step 5: the
build row decides done or failed; what the executor reported through its context
is written to the build row in the same statement). A run that crashes drops its
report. A hard stop cancels the executor; the job
goes back to pending at once (shielded, bounded), its attempt counted.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable
from uuid import UUID

import trio

from ..engine.contracts import INVALID_PAYLOAD, MAX_ATTEMPTS_EXCEEDED, ClaimedJob, JobStore
from ..engine.retry import one_line
from ..engine.slots import Ran, Slots, label_of
from ..engine.state import Finish
from ..errors import FinalWriteRefused, InvalidPayload
from ..executors import JobContext, RunReport
from ..job_errors import JobError, secret_values
from .payloads import Payload, Target
from .store import JOB_PANICKED, TARGET_DELETED

log = logging.getLogger("nasiko_queue.worker")


class JobExecutor(Slots[JobStore]):
    """The build jobs' pipeline (docs/rules.md §5), run by the build lane's slots;
    constructed as `Slots`."""

    async def run_claimed(self, job: ClaimedJob, scope: trio.CancelScope) -> Finish | None:
        """
        Take one claimed job through steps 1-4 and run its executor (in `scope`).

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
                        payload.kind, label_of(payload))
            await self._fail(job, TARGET_DELETED, own_build_id=payload.build_id, terminalize=False)
            return None
        executor = self.executors.executor_for(payload.kind)
        if executor is None:  # the claim filters on our kinds, so this is a bug
            raise RuntimeError(f"claimed a {payload.kind} job without an executor for it")
        assert job.owner_id is not None  # build_jobs.owner_id is NOT NULL
        # What the executor reports through ctx; read only if it returns. (The
        # build id is read when needed: a payload type's property may be buggy.)
        run = RunReport(on_building=lambda: self.completer.start(job, payload.build_id))
        ctx = JobContext(
            job_id=job.id,
            attempt=job.attempt,
            payload=payload,
            owner_id=job.owner_id,
            target=Target(agent_id=job.agent_id, connector_id=job.connector_id),
            db=self.queue.db,
            _run=run,
        )
        label = f"{payload.kind} {label_of(payload)}"
        limit = self.executors.timeout_for(payload.kind) or self.config.job_timeout
        async def settle(ran: Ran, _error: JobError | None) -> Finish | None:
            if ran is Ran.CRASHED or ran is Ran.TIMED_OUT:
                # The error is kept and logged; the documented rule.
                await self.reset_panicked_job(job, payload.build_id)
                return None
            if ran is Ran.FENCED:
                return None
            return Finish(job=job, build_id=payload.build_id, label=label, report=run.outcome)

        return await self.run_guarded(job, lambda: executor(ctx), label, limit,
                                      lambda: secret_values(payload), settle, scope)

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
        return job.old_attempt >= self.config.build_max_attempts

    async def reset_panicked_job(self, job: ClaimedJob, build_id: UUID | None) -> None:
        """
        The documented rule: old_attempt + 1 >= MAX_ATTEMPTS fails.

        So a job that always raises runs exactly MAX_ATTEMPTS times and ends
        failed with attempt = MAX_ATTEMPTS; otherwise it goes back to the front
        of the queue, and this drain retries it at once.
        """
        if job.old_attempt + 1 >= self.config.build_max_attempts:
            await self._fail(job, JOB_PANICKED, own_build_id=build_id)
        else:
            try:
                await self.retry.final("reset", lambda: self.store.reset(job))
            except FinalWriteRefused as exc:  # an application's rule; never an input of ours
                log.error("job %s: could not record the outcome (%s); left in_progress, for "
                          "the rescue once this worker stops", job.id,
                          one_line(exc.__cause__ or exc))
                return
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

        try:
            ours = await self.retry.final(
                "fail",
                fail(terminalize),
                # The target's terminalization is refused for good: mark the job alone.
                fallbacks=[fail(False)] if terminalize else (),
            )
        except FinalWriteRefused as exc:  # an application's rule; never an input of ours
            log.error("job %s: could not record the outcome %r (%s); left in_progress, for "
                      "the rescue once this worker stops", job.id, message,
                      one_line(exc.__cause__ or exc))
            return
        if ours:
            self.state.stats.failed += 1
