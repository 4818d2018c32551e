"""
A worker's slots: each runs one claimed job at a time, its executor guarded.

Every lane of a worker (the build jobs, each queue of plain jobs) runs
`concurrency` slots of its own. A slot takes the first job of its lane's local
buffer and hands it to the lane's pipeline (`run_claimed`: `builds.executor.JobExecutor`
for build jobs, `plain.executor.PlainJobExecutor` for plain ones), which runs
the executor through `run_guarded`: guarded, so that whatever it raises (a
"panic"), from its own code or from tasks it starts in nurseries of its own, is
caught and counted instead of taking the worker down; and in the slot's cancel
scope, bounded by the job's run-time limit and by the fence, which the worker
cancels when it loses its lease (and a plain job's cancel request too).

A slot runs its jobs back to back in one cancel scope (a *streak*), not one
scope per job: entering and leaving a trio cancel scope costs about 4 µs, a
tenth of what a do-nothing job costs the worker with look-ahead. The scope
belongs to the job that runs (its deadline is that job's limit; the fence and a
cancel request find it under that job's claim) only while it runs. Once
cancelled, a scope is spent: the run it cut short (or that returned just as
the cancel came) unwinds to the slot as `_Cut`, the slot leaves the scope, deals
with the job outside it, and opens a new one for the next.

When the executor returns, the slot hands the job to the completer and takes its
next job at once. A hard stop cancels the executor; the job goes back at once
(shielded, bounded), its attempt counted.
"""

from __future__ import annotations

import abc
import enum
import logging
import math
from collections.abc import Awaitable, Callable, Iterable
from typing import Generic, Protocol, TypeVar
from uuid import UUID

import trio

from ..builds.payloads import PayloadCodec
from ..config import QueueConfig
from ..executors import Executors
from ..job_errors import JobError, describe
from ..queue import Queue
from .completer import Completer
from .contracts import ClaimedJob, LaneStore
from .retry import RetryPolicy, one_line
from .state import Finish, LaneState

log = logging.getLogger("nasiko_queue.worker")

S = TypeVar("S", bound=LaneStore)


class Ran(enum.Enum):
    """How `Slots.run_guarded` ended."""

    #: The executor returned.
    RETURNED = "returned"
    #: It raised; the error is kept.
    CRASHED = "crashed"
    #: It ran past its limit and was cancelled; kept as an error too.
    TIMED_OUT = "timed out"
    #: The fence (or a cancel request) stopped it; the job is given back or ended.
    FENCED = "fenced"


#: What a pipeline does once its executor's run has ended (`Slots.run_guarded`):
#: retry or end the job by the lane's rule, or return the finish for the completer.
Settle = Callable[[Ran, JobError | None], Awaitable[Finish | None]]


class _Cut(BaseException):
    """
    A run ended while its slot's cancel scope was cancelled: cut short by the
    fence, a cancel request or its limit, or returning (or raising) just as one
    came. No await can run in a cancelled scope, so the run unwinds to the slot
    with what it needs, and the slot deals with the job outside the scope.
    """

    def __init__(self, job: ClaimedJob, label: str, limit: float | None, started: float,
                 secrets: Callable[[], Iterable[str]], settle: Settle,
                 outcome: BaseException | None) -> None:
        super().__init__()
        self.job = job
        self.label = label
        self.limit = limit
        self.started = started
        self.secrets = secrets
        self.settle = settle
        #: What the executor raised (None: it returned).
        self.outcome = outcome
        #: When the slot took the job (`trio.current_time()`), for the look-ahead.
        self.took = started
        #: The worker's `fence_epoch` when the slot took the job.
        self.epoch = 0


def _uncancelled(exc: BaseException) -> BaseException | None:
    """`exc` without its `trio.Cancelled` (None: nothing else), as a cancel
    scope that catches its own cancellation would leave it."""
    if isinstance(exc, trio.Cancelled):
        return None
    if isinstance(exc, BaseExceptionGroup):
        return exc.split(trio.Cancelled)[1]
    return exc


class Slots(abc.ABC, Generic[S]):
    """
    The slots of one lane, and what every pipeline shares.

    Args:
        state: the lane's state (the buffer, the counters).
        store: the lane's database operations.
        queue: the queue (its database is the executors' `ctx.db`).
        executors: the registry; one executor per kind.
        codec: parses payloads (the built-in and the registered types).
        completer: takes the finished jobs.
        retry: the retry policy of final updates.
        wake: asks the worker for another drain (a crashed job's retry).
    """

    def __init__(self, state: LaneState, store: S, queue: Queue,
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
            while await self._run_streak():
                pass
        finally:
            state.slots_alive -= 1
            state.kick()

    async def _run_streak(self) -> bool:
        """
        Run buffered jobs back to back in one cancel scope, until the slot
        closes (False) or the scope is spent (True: the caller opens another).
        """
        scope = trio.CancelScope()
        cut: _Cut | None = None
        try:
            with scope:
                while not scope.cancel_called:
                    job = await self._take()
                    if job is None:
                        return False
                    await self._run_job(job, scope)
        except _Cut as exc:
            cut = exc
        if cut is not None:
            # Out of the spent scope: the job's outcome can be written now.
            finish: Finish | None = None
            try:
                try:
                    finish = await self._settle_cut(cut)
                except Exception:
                    log.exception("job %s: internal error; counted as a crash", cut.job.id)
                    await self.reset_panicked_job(cut.job, None)
            finally:
                self._ran(cut.job, cut.took, cut.epoch, finish)
        return True

    async def _run_job(self, job: ClaimedJob, scope: trio.CancelScope) -> None:
        """One job of a streak, with the slot's bookkeeping around it."""
        state = self.state
        state.stats.running += 1
        state.running += 1
        finish: Finish | None = None
        took, epoch = trio.current_time(), state.worker.fence_epoch
        cut = False
        try:
            finish = await self.run_claimed(job, scope)
        except _Cut as exc:
            # Its bookkeeping waits until the slot has dealt with it (a cancel
            # request's mark is read there).
            cut = True
            exc.took, exc.epoch = took, epoch
            raise
        except Exception:
            # Not the executor (its crashes are handled in run_guarded) and not
            # the database (final updates retry): a bug, ours or in a payload
            # type's code. Keep the other jobs running, and count it as a
            # crash of this job, so that it is retried or failed, never
            # left in_progress.
            log.exception("job %s: internal error; counted as a crash", job.id)
            await self.reset_panicked_job(job, None)
        finally:
            if not cut:
                self._ran(job, took, epoch, finish)

    def _ran(self, job: ClaimedJob, took: float, epoch: int, finish: Finish | None) -> None:
        """A job's run is over: count it, and hand its finish to the completer.

        No checkpoint between the executor's return and this hand-over: a hard
        stop cannot come between them and lose the outcome."""
        state = self.state
        state.stats.running -= 1
        state.running -= 1
        if state.fence_settling and epoch != state.worker.fence_epoch:
            # A run the fence stopped (it began before the fence) has ended: its
            # job is back. Once all have, the look-ahead claims again.
            state.fence_settling -= 1
        # The run is over: a cancel mark of its claim is spent (a later
        # claim of the job, after a dead-letter retry, has a token of its own).
        state.cancels.discard(job.claim)
        if state.look_ahead is not None:  # "auto": its size follows
            state.look_ahead.observe(trio.current_time() - took)
        if finish is not None:
            self.completer.add(finish)
        state.kick()
        state.notify()

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
        if state.before_take is not None:
            state.before_take()
        if state.closing or (state.stopping.is_set() and state.prefetch() > 0):
            # A stop: what the buffer holds goes back, never starts. With look-ahead,
            # a graceful one as soon as it is asked, not once the lane closes a step
            # later: a run that returns without another await would else hand its
            # slot the next buffered job (issue #24). Without look-ahead the buffer
            # holds only the current drain step's claims, which run (SPEC §8).
            return None
        job, _claimed_at = state.buffer.popleft()
        state.stats.buffered -= 1
        return job

    async def run_once(self, job: ClaimedJob) -> Finish | None:
        """
        One claimed job through the lane's steps, in a cancel scope of its own;
        the finish of one whose executor returned, for the completer (every
        other outcome is written). What a slot does for each job of a streak,
        for tests and tools that run a job without a slot.
        """
        scope = trio.CancelScope()
        finish: Finish | None = None
        cut: _Cut | None = None
        try:
            with scope:
                finish = await self.run_claimed(job, scope)
        except _Cut as exc:
            cut = exc
        if cut is not None:  # settled out of the spent scope
            finish = await self._settle_cut(cut)
        return finish

    @abc.abstractmethod
    async def run_claimed(self, job: ClaimedJob, scope: trio.CancelScope) -> Finish | None:
        """One claimed job, through the lane's steps, its executor run in
        `scope` (by `run_guarded`); the finish of one whose executor returned,
        for the completer (every other outcome is written)."""

    @abc.abstractmethod
    async def reset_panicked_job(self, job: ClaimedJob, build_id: UUID | None) -> None:
        """A run crashed: retry the job or end it, by the lane's rule."""

    async def run_guarded(self, job: ClaimedJob, call: Callable[[], Awaitable[None]],
                          label: str, limit: float | None,
                          secrets: Callable[[], Iterable[str]], settle: Settle,
                          scope: trio.CancelScope) -> Finish | None:
        """
        Run one executor call (step 4) guarded, bounded by `limit` seconds (None:
        unbounded) and by the fence, then `settle` the job by how it ended (the
        error of a crash or a timeout kept and logged, its message masked with
        `secrets()`, computed only then). A hard stop gives the job back and
        re-raises.

        The executor runs in this slot's task, in the slot's cancel scope
        `scope`, rather than as the child of a nursery opened for it: that kept
        nothing more (whatever the executor raises, from its own code or from
        tasks it starts in nurseries of its own, arrives here as its
        exception either way, and lands in `reset_panicked_job`), and cost
        about 13 µs more per job. The scope is the fence and the limit at
        once: while the job runs, its deadline is the limit, and the fence
        (the worker lost its lease) or a cancel request cancels it. Once
        cancelled it is spent: the run unwinds to the slot (`_Cut`), which
        settles the job outside it.
        """
        log.info("job %s (%s): attempt %d starting", job.id, label, job.attempt)
        started = trio.current_time()
        # Per claim, not per job: a crashed run's reset commits before this run's
        # bookkeeping ends, and another slot may already be running the job again.
        claim = job.claim
        if self.state.fenced or claim in self.state.cancels:
            # The fence (or a cancel request) came while the job was being
            # prepared, or waited in the buffer: it never starts.
            return await settle(*await self._stopped(job, label, started=False))
        if limit is not None:
            scope.deadline = started + limit
        self.state.job_scopes[claim] = scope
        outcome: BaseException | None = None
        try:
            await call()
        except BaseException as exc:  # sorted out below, once the scope is the slot's again
            outcome = exc
        # The scope is the job's no more: nothing may cancel it from here on
        # (its deadline passes no checkpoint before this).
        del self.state.job_scopes[claim]
        if limit is not None:
            scope.deadline = math.inf
        self.state.run_seconds.observe(trio.current_time() - started)
        if scope.cancel_called:
            raise _Cut(job, label, limit, started, secrets, settle, outcome) from None
        if outcome is None:
            return await settle(Ran.RETURNED, None)
        if isinstance(outcome, Exception):  # the executor raised
            return await settle(*await self._crashed(job, label, outcome, secrets))
        # Cancelled: a hard stop. The job never finished; hand it back now.
        await self._release(job)
        raise outcome

    async def _settle_cut(self, cut: _Cut) -> Finish | None:
        """A run that ended in a cancelled scope, settled outside it: as if the
        scope had been the job's own and had caught its cancellation."""
        job, label = cut.job, cut.label
        if cut.outcome is None:  # it returned as the cancel came: its outcome stands
            return await cut.settle(Ran.RETURNED, None)
        rest = _uncancelled(cut.outcome)
        if rest is None and trio.current_effective_deadline() == -math.inf:
            # A hard stop came too: as with a scope of the job's own, which
            # leaves a cancellation from outside to the scope that made it, the
            # stop wins. The job goes back now; settling it would await under
            # the stop and leave it running.
            await self._release(job)
            raise cut.outcome
        if isinstance(rest, Exception):  # it raised something else too: a crash
            return await cut.settle(*await self._crashed(job, label, rest, cut.secrets))
        if rest is not None:  # a KeyboardInterrupt or the like: as a hard stop
            await self._release(job)
            raise rest
        # Cut short: by its limit, unless the fence or a cancel request did (they
        # win, as when they were scopes of their own).
        stopped = self.state.fenced or job.claim in self.state.cancels
        if (not stopped and cut.limit is not None
                and trio.current_time() >= cut.started + cut.limit):
            self.state.stats.timed_out += 1
            log.error("job %s (%s) ran past its limit of %ss on attempt %d; cancelled, counted "
                      "as a crash", job.id, label, cut.limit, job.attempt)
            error = JobError(attempt=job.attempt, reason="timeout",
                             error_type="nasiko_queue.JobTimeout",
                             message=f"ran past its limit of {cut.limit}s", traceback="")
            await self._keep(job, error)
            return await cut.settle(Ran.TIMED_OUT, error)
        return await cut.settle(*await self._stopped(job, label, started=True))

    async def _crashed(self, job: ClaimedJob, label: str, exc: Exception,
                       secrets: Callable[[], Iterable[str]]) -> tuple[Ran, JobError]:
        """The executor raised: count it, log it and keep its error."""
        self.state.stats.panicked += 1
        # Logged and kept with the payload's secret values masked: the
        # executor's message may quote them.
        error = describe(exc, attempt=job.attempt, reason="crash", secrets=secrets())
        # The traceback as text, not exc_info: a formatter would print the
        # exception as raised, secrets and all. Handlers that want the error
        # itself find it in `record.job_error`.
        log.error("job %s (%s) panicked on attempt %d:\n%s", job.id, label, job.attempt,
                  error.traceback.rstrip(), extra={"job_error": error})
        await self._keep(job, error)
        return Ran.CRASHED, error

    async def _stopped(self, job: ClaimedJob, label: str, *,
                       started: bool) -> tuple[Ran, None]:
        """The fence or a cancel request stopped the run (or kept it from starting)."""
        if await self.on_fenced(job, label):
            return Ran.FENCED, None
        if not started:  # it never ran: given back as it was, attempt restored
            # (a job asked to stop ends cancelled there, never run: plain_unclaim)
            why = ("a cancel came before it started; ended cancelled"
                   if job.claim in self.state.cancels
                   else "the fence came before it started; given back")
            with trio.CancelScope(shield=True):  # bounded by the store
                try:
                    self.state.stats.returned += await self.store.unclaim([job])
                    log.warning("job %s (%s): %s", job.id, label, why)
                except Exception as exc:
                    log.warning("job %s: could not be given back after the fence (%s); a "
                                "rescue or the sweep will", job.id, one_line(exc))
            return Ran.FENCED, None
        # The worker is cut off or was declared dead: the run's outcome is not
        # written; the job is given back (by us if we can, else by the leader).
        log.warning("job %s (%s): stopped by the fence on attempt %d", job.id, label,
                    job.attempt)
        await self._release(job, why="the fence")
        return Ran.FENCED, None

    async def on_fenced(self, job: ClaimedJob, label: str) -> bool:
        """A run's fence scope was cancelled: True when this lane dealt with it
        (a plain job's cancel); else it was the worker's fence."""
        return False

    async def _keep(self, job: ClaimedJob, error: JobError) -> None:
        """Keep the attempt's error; an outage loses it (logged), never the job."""
        try:
            await self.store.record_error(job, error)
        except Exception as exc:
            log.warning("job %s: could not keep the error of attempt %d (%s)", job.id,
                        job.attempt, one_line(exc))

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


def label_of(payload: _Labelled) -> str:
    """`payload.label()`, for logs; a bug in a payload type's label is not the job's end."""
    try:
        return payload.label()
    except Exception as exc:
        return f"<label() raised {type(exc).__name__}>"


class _Labelled(Protocol):
    def label(self) -> str: ...
