"""
The retry policy of final updates: a finished job's result is never lost.

A final update (done, failed, back to pending, a lost claim given back) that
fails is tried again with growing pauses until it lands (docs/rules.md §5). If it
were dropped, the job would stay `in_progress` until a rescue or the sweep, which
would run a finished build again. Each try is shielded from a hard stop and
bounded by `cleanup_timeout` in the store; only the pause between tries can be
cancelled, and then one last try is made.

What is retried is one list (`errors.is_transient`); an update the database
refuses on its merits (a trigger, a constraint) falls back, when the caller gives
a fallback, after `terminalize_tries` refusals, so that one target the database
will not delete cannot wedge the worker.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

import trio

from .config import QueueConfig
from .errors import is_transient

log = logging.getLogger("nasiko_queue.worker")

T = TypeVar("T")


class RetryPolicy:
    """Backoff for final updates, from `QueueConfig` (`retry_*_delay`, `terminalize_tries`)."""

    def __init__(self, config: QueueConfig) -> None:
        self.config = config

    async def final(
        self,
        what: str,
        op: Callable[[], Awaitable[T]],
        *,
        fallback: Callable[[], Awaitable[T]] | None = None,
    ) -> T:
        """Run `op` until it succeeds; `fallback` takes over after repeated refusals."""
        delay = self.config.retry_initial_delay
        rejected = 0
        while True:
            with trio.CancelScope(shield=True):
                try:
                    return await op()
                except Exception as exc:
                    failure: BaseException = exc
            if not is_transient(failure):
                rejected += 1
                if fallback is not None and rejected >= self.config.terminalize_tries:
                    log.error("%s update rejected %d times (%s); falling back", what, rejected,
                              one_line(failure))
                    op, fallback, rejected = fallback, None, 0
                    continue
            log.warning("%s update failed (%s); retrying in %.2fs", what, one_line(failure),
                        delay, exc_info=failure)
            try:
                await trio.sleep(delay)
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
    return f"{type(exc).__name__}: {text[0] if text else ''}"
