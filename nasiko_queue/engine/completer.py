"""
The completer: records the outcomes of jobs whose executors returned, in batches.

A slot whose executor returned hands the job over (`add`) and takes its next job
at once, without waiting for the outcome to be written. The finishes queued at
the moment the producer sends its next statement all ride on it
(`jobs_finish_many_and_claim`: the outcome of each is read from its build row,
done or failed, and the room they free is claimed in the same round trip), so a
worker spends one round trip per job at most, and fewer when jobs end close
together. Nothing waits to fill a batch.

Executors may report through their context instead of writing the build row
themselves (issue #13): a finish then carries the reported status, which the same
statement writes to the build row, and a start write (`JobContext.mark_building`)
is queued here and, once `START_WRITE_DELAY` has passed, rides on the next
statement as well (alone only when none is in flight); a report that comes first
supersedes it. So an executor's two build-row writes cost no round trip of their
own. A batch that carries any of them is sent as
`jobs_finish_reported_and_claim`; one that carries none, as the leaner
`jobs_finish_many_and_claim`, which neither locks nor writes a build row.

A batch that fails is sent again under the retry policy (`RetryPolicy.final`):
each finish is guarded by its claim, so one that landed on an earlier try is
not written twice. Only the first try claims: a retry, or the last try of a hard
stop, would claim jobs that nobody takes if its answer were lost. A batch the
database refuses on its merits (an application's trigger: retrying cannot
change the answer) is sent again one finish at a time, without claims or start
writes; a finish refused alone is given up (`LaneStore.discard_unrecorded`: a
plain job is discarded "could not record the outcome: ..."; a build job, whose
error_msg holds fixed strings only, is left for the rescue once its worker
stops), logged. So no finish wedges the lane.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from uuid import UUID

import trio

from ..errors import FinalWriteRefused, OutcomeUnknown
from ..job_errors import minimal_text
from .contracts import ClaimedJob, ClaimOutcomeUnknown, JobStatus, LaneStore, Starting
from .retry import Budget, RetryPolicy, one_line
from .state import START_WRITE_DELAY, Finish, LaneState

log = logging.getLogger("nasiko_queue.worker")


class Completer:
    """
    Queues finishes and sends them, with the producer's claim, as one statement.

    Args:
        state: the lane's state (`finishes`; the counters).
        store: the database operations.
        retry: the retry policy of final updates.
        on_lost_claim: called with a claim whose answer was lost (the producer
            gives back what it took).
    """

    def __init__(self, state: LaneState, store: LaneStore, retry: RetryPolicy,
                 on_lost_claim: Callable[[ClaimOutcomeUnknown], None]) -> None:
        self.state = state
        self.store = store
        self.retry = retry
        self.on_lost_claim = on_lost_claim

    def add(self, finish: Finish) -> None:
        """A slot's executor returned: queue its outcome for the next statement."""
        state = self.state
        if finish.report is not None and state.starts:
            # Its start write, not sent yet, is superseded by the report.
            state.starts = [s for s in state.starts if s[1][0] is not finish.job]
        state.finishes.append(finish)
        state.stats.finishing += 1
        state.kick()

    def start(self, job: ClaimedJob, build_id: UUID) -> None:
        """
        A running executor asked for its build row to say 'building' (not awaited):
        sent with the first statement after `START_WRITE_DELAY`, unless the run's
        report supersedes it first.
        """
        self.state.starts.append((trio.current_time() + START_WRITE_DELAY, (job, build_id)))
        self.state.kick()

    def take_batch(self) -> list[Finish]:
        batch, self.state.finishes = self.state.finishes, []
        return batch

    def starts_due(self, now: float) -> bool:
        """Whether a start write waits to be sent (its delay is over)."""
        return bool(self.state.starts) and self.state.starts[0][0] <= now

    def take_starts(self, now: float = float("inf")) -> list[Starting]:
        """The start writes due at `now` (all of them by default), for a statement."""
        starts = self.state.starts
        due = 0
        while due < len(starts) and starts[due][0] <= now:
            due += 1
        self.state.starts = starts[due:]
        return [start for _at, start in starts[:due]]

    async def send(self, batch: list[Finish], want: int,
                   starts: list[Starting] | None = None,
                   budget: Budget | None = None) -> list[ClaimedJob] | None:
        """
        Record every outcome of `batch`, write `starts`, and claim up to `want`
        jobs (on the first try only); return the claimed jobs, or None when no
        claim ran (the first try failed: the tries after it claim nothing), so
        that the producer does not take an empty answer for a short claim and
        end a drain that claimed nothing since its wake. Retried until it
        lands, or its `budget` (a stop's) is spent.
        """
        finishing = [(f.job, f.build_id, f.report) for f in batch]
        starting = starts or []
        tries = 0

        claim_ran = False

        async def send_once() -> tuple[dict[UUID, JobStatus | None], list[ClaimedJob]]:
            nonlocal tries, claim_ran
            tries += 1
            try:
                answer = await self.store.finish_many_and_claim(
                    finishing, want if tries == 1 else 0, starts=starting)
                claim_ran = tries == 1
                return answer
            except ClaimOutcomeUnknown as exc:
                self.on_lost_claim(exc)  # given back; the finishes are sent again
                raise OutcomeUnknown(str(exc)) from exc

        async def one_by_one() -> tuple[dict[UUID, JobStatus | None], list[ClaimedJob]]:
            if starting:
                log.error("%d start write(s) dropped: their batch was refused", len(starting))
                starting.clear()
            statuses: dict[UUID, JobStatus | None] = {}
            for finish in batch:  # each under the same budget: a stop bounds them all
                statuses.update(await self._finish_alone(finish, budget))
            return statuses, []

        statuses, claimed = await self.retry.final("finish", send_once, fallbacks=[one_by_one],
                                                   budget=budget)
        self.record(batch, statuses)
        if starting:
            self.state.stats.marked_building += len(starting)
        return claimed if claim_ran else None

    async def _finish_alone(self, finish: Finish,
                            budget: Budget | None) -> dict[UUID, JobStatus | None]:
        """One finish of a refused batch, alone; refused again, given up (logged)."""
        job = finish.job
        refusal: list[BaseException] = []

        async def alone() -> dict[UUID, JobStatus | None]:
            try:
                statuses, _ = await self.store.finish_many_and_claim(
                    [(job, finish.build_id, finish.report)], 0)
            except Exception as exc:
                refusal[:] = [exc]
                raise
            return statuses

        async def give_up() -> dict[UUID, JobStatus | None]:
            why = one_line(refusal[0]) if refusal else "refused"
            log.error("job %s: could not record the outcome (%s)", job.id, why)
            if await self.store.discard_unrecorded(
                    job, minimal_text(f"could not record the outcome: {why}")):
                log.error("job %s: discarded", job.id)
            return {}

        try:
            return await self.retry.final("finish", alone, fallbacks=[give_up], budget=budget)
        except FinalWriteRefused as exc:
            log.error("job %s: could not record the outcome, nor discard it (%s); left for "
                      "the rescue once this worker stops", job.id,
                      one_line(exc.__cause__ or exc))
            return {}

    def record(self, batch: list[Finish], statuses: dict[UUID, JobStatus | None]) -> None:
        stats = self.state.stats
        verbose = log.isEnabledFor(logging.INFO)
        for finish in batch:
            status = statuses.get(finish.job.id)
            if status == "done":
                stats.done += 1
            elif status is not None:
                stats.failed += 1
            if verbose:
                log.info("job %s (%s): %s", finish.job.id, finish.label, status or "gone")
        stats.finishing -= len(batch)

    def dropped(self, batch: list[Finish], starts: list[Starting] | None = None) -> None:
        """A hard stop gave up on `batch` (the database did not answer in time)."""
        self.state.stats.finishing -= len(batch)
        if starts:
            log.warning("%d start write(s) may not be recorded (the database did not "
                        "answer in time)", len(starts))
        if batch:
            log.error("the outcomes of %d finished job(s) may not be recorded (the database "
                      "did not answer in time); a rescue or the sweep recovers what is left",
                      len(batch))
