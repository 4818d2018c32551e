"""
A worker's slots: each runs one claimed job at a time, its executor guarded.

Every lane of a worker (the build jobs, each queue of plain jobs) runs
`concurrency` slots of its own. A slot takes the first job of its lane's local
buffer and hands it to the lane's pipeline (`run_once`: `builds.executor.JobExecutor`
for build jobs, `plain.executor.PlainJobExecutor` for plain ones), which runs
the executor through `run_guarded`: guarded, so that whatever it raises (a
"panic"), from its own code or from tasks it starts in nurseries of its own, is
caught and counted instead of taking the worker down; in a cancel scope of its
own, bounded by the job's run-time limit and by the fence, which the worker
cancels when it loses its lease (and a plain job's cancel request too).

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
            while True:
                job = await self._take()
                if job is None:
                    return
                state.stats.running += 1
                state.running += 1
                finish: Finish | None = None
                took = trio.current_time()
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
                    state.running -= 1
                    # The run is over: a cancel mark of its claim is stale (one
                    # delivered as it crashed would else stop the job's next run
                    # of the same attempt number, after a dead-letter retry).
                    state.cancels.discard((job.id, job.attempt))
                    if state.look_ahead is not None:  # "auto": its size follows
                        state.look_ahead.observe(trio.current_time() - took)
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

    @abc.abstractmethod
    async def run_once(self, job: ClaimedJob) -> Finish | None:
        """One claimed job, through the lane's steps; the finish of one whose
        executor returned, for the completer (every other outcome is written)."""

    @abc.abstractmethod
    async def reset_panicked_job(self, job: ClaimedJob, build_id: UUID | None) -> None:
        """A run crashed: retry the job or end it, by the lane's rule."""

    async def run_guarded(self, job: ClaimedJob, call: Callable[[], Awaitable[None]],
                          label: str, limit: float | None,
                          secrets: Callable[[], Iterable[str]]) -> tuple[Ran, JobError | None]:
        """
        Run one executor call (step 4) guarded, bounded by `limit` seconds (None:
        unbounded) and by the fence. Returns how it ended, with the error kept
        and logged of a crash or a timeout (its message masked with `secrets()`,
        computed only then). A hard stop gives the job back and re-raises.

        The executor runs in this slot's task, inside one cancel scope of its
        own, rather than as the child of a nursery opened for it: that kept
        nothing more (whatever the executor raises, from its own code or from
        tasks it starts in nurseries of its own, arrives here as its
        exception either way, and lands in `reset_panicked_job`), and cost
        about 13 µs more per job. The scope is the fence and the limit at
        once: its deadline is the limit, and the fence (the worker lost its
        lease) or a cancel request cancels it.
        """
        log.info("job %s (%s): attempt %d starting", job.id, label, job.attempt)
        started = trio.current_time()
        # Cancelled by the fence or a cancel request, or at its deadline; a hard
        # stop cancels from outside and passes through it.
        scope = trio.CancelScope(deadline=math.inf if limit is None else started + limit)
        # Per claim, not per job: a crashed run's reset commits before this run's
        # bookkeeping ends, and another slot may already be running the job again.
        claim = (job.id, job.attempt)
        if self.state.fenced or claim in self.state.cancels:
            # The fence (or a cancel request) came while the job was being
            # prepared, or waited in the buffer: it never starts.
            return await self._stopped(job, label, started=False)
        self.state.job_scopes[claim] = scope
        try:
            with scope:
                await call()
        except Exception as exc:  # the executor raised
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
        except BaseException:
            # Cancelled: a hard stop. The job never finished; hand it back now.
            await self._release(job)
            raise
        finally:
            del self.state.job_scopes[claim]
            self.state.run_seconds.observe(trio.current_time() - started)
        if not scope.cancelled_caught:
            return Ran.RETURNED, None
        # The one scope was cancelled: by its deadline, unless the fence or a
        # cancel request did (they win, as when they were scopes of their own).
        stopped = self.state.fenced or claim in self.state.cancels
        if not stopped and trio.current_time() >= scope.deadline:
            self.state.stats.timed_out += 1
            log.error("job %s (%s) ran past its limit of %ss on attempt %d; cancelled, counted "
                      "as a crash", job.id, label, limit, job.attempt)
            error = JobError(attempt=job.attempt, reason="timeout",
                             error_type="nasiko_queue.JobTimeout",
                             message=f"ran past its limit of {limit}s", traceback="")
            await self._keep(job, error)
            return Ran.TIMED_OUT, error
        return await self._stopped(job, label, started=True)

    async def _stopped(self, job: ClaimedJob, label: str, *,
                       started: bool) -> tuple[Ran, None]:
        """The fence or a cancel request stopped the run (or kept it from starting)."""
        if await self.on_fenced(job, label):
            return Ran.FENCED, None
        if not started:  # it never ran: given back as it was, attempt restored
            with trio.CancelScope(shield=True):  # bounded by the store
                try:
                    self.state.stats.returned += await self.store.unclaim([job])
                    log.warning("job %s (%s): the fence came before it started; given back",
                                job.id, label)
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
