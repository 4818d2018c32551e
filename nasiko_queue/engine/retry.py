"""
The retry policy of final updates: a finished job's result is never lost.

A final update (done, failed, back to pending, a lost claim given back) that
fails is tried again with growing pauses until it lands (docs/rules.md §5). If it
were dropped, the job would stay `in_progress` until a rescue or the sweep, which
would run a finished build again. Each try is shielded from a hard stop and
bounded by `cleanup_timeout` in the store; only the pause between tries can be
cancelled, and then one last try is made.

What is retried for as long as it lasts is one list (`errors.is_transient`:
outages, deadlocks, lock time-outs). An update the database refuses on its
merits (a trigger, a constraint, a value it cannot hold) is tried
`terminalize_tries` times, then the caller's fallbacks take over in order (a
job's outcome written as a minimal one, then the job ended with "could not
record the outcome"), each with the same number of tries; when the last is
refused too, `FinalWriteRefused` is raised for the caller to log. So no input
and no rule of the application's can wedge a slot on one job.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

import attrs
import trio

from ..config import QueueConfig
from ..errors import FinalWriteRefused, NotWithinTheStopsBound, is_transient
from ..job_errors import storable

log = logging.getLogger("nasiko_queue.worker")

T = TypeVar("T")


@attrs.define(eq=False)
class Budget:
    """
    Until when a last write (a give-back, a lost claim's resolution, the
    wind-down's finishes) may begin another try: never while its lane runs,
    since no rescue takes a live worker's rows; once the lane closes, one
    `cleanup_timeout` more (`LaneState.last_write`). The try under way then is
    let finish (it is bounded by the store), and no try follows: a retried
    write takes two bounds from the close at most (a hard stop's cancel, which
    comes beside the close, still makes its one last try first).
    """

    give_up_at: float = math.inf
    #: The pause between two tries, while one is under way: cut short at `give_up_at`.
    nap: trio.CancelScope | None = None

    def close_in(self, seconds: float) -> None:
        self.give_up_at = min(self.give_up_at, trio.current_time() + seconds)
        if self.nap is not None:
            self.nap.deadline = min(self.nap.deadline, self.give_up_at)

    def spent(self) -> bool:
        return trio.current_time() >= self.give_up_at


class RetryPolicy:
    """Backoff for final updates, from `QueueConfig` (`retry_*_delay`, `terminalize_tries`)."""

    def __init__(self, config: QueueConfig) -> None:
        self.config = config

    async def final(
        self,
        what: str,
        op: Callable[[], Awaitable[T]],
        *,
        fallbacks: Sequence[Callable[[], Awaitable[T]]] = (),
        budget: Budget | None = None,
    ) -> T:
        """
        Run `op` until it succeeds, through outages; after `terminalize_tries`
        refusals on the merits, the next of `fallbacks` takes over; after as
        many of the last one, raise `FinalWriteRefused` (from the refusal).
        With a `budget`, raise `NotWithinTheStopsBound` instead of beginning a
        try once it is spent.
        """
        delay = self.config.retry_initial_delay
        rejected = 0
        remaining = list(fallbacks)
        while True:
            if budget is not None and budget.spent():
                raise NotWithinTheStopsBound(f"{what} update: not within the stop's bound")
            with trio.CancelScope(shield=True):
                try:
                    return await op()
                except NotWithinTheStopsBound:
                    raise  # a fallback's own retries ran out of the same budget
                except Exception as exc:
                    failure: BaseException = exc
            if not is_transient(failure):
                rejected += 1
                if rejected >= self.config.terminalize_tries:
                    if not remaining:
                        raise FinalWriteRefused(what, failure) from failure
                    log.error("%s update rejected %d times (%s); falling back", what, rejected,
                              one_line(failure))
                    op, rejected = remaining.pop(0), 0
                    continue
            if budget is not None and budget.spent():
                raise NotWithinTheStopsBound(f"{what} update: not within the stop's bound "
                                             f"({one_line(failure)})")
            log.warning("%s update failed (%s); retrying in %.2fs", what, one_line(failure),
                        delay, exc_info=failure)
            try:
                with trio.move_on_after(delay) as nap:
                    if budget is not None:
                        nap.deadline = min(nap.deadline, budget.give_up_at)
                        budget.nap = nap
                    try:
                        await trio.sleep_forever()
                    finally:
                        if budget is not None and budget.nap is nap:
                            budget.nap = None
            except trio.Cancelled:
                with trio.CancelScope(shield=True):
                    try:
                        await op()
                    except Exception:
                        log.exception("last %s update failed; the job waits for a rescue "
                                      "or the sweep", what)
                raise
            delay = min(delay * 2, self.config.retry_max_delay)


def one_line(exc: BaseException) -> str:
    """`Type: first line of the message`, for log lines."""
    text = str(exc).strip().splitlines()
    return storable(f"{type(exc).__name__}: {text[0] if text else ''}")
