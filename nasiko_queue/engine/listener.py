"""
The listener: LISTEN on a dedicated connection, and every notification a wake.

Every enqueue (in any process) sends one NOTIFY per transaction, and so do the
statements that put jobs back to pending; the listener turns each into a wake of
the worker, so that a job enqueued anywhere starts at once anywhere. A retry
written with a backoff sends one naming its queue (`due_payload`): only that
queue's lanes wake, to read when it falls due and sleep until then. The
connection is a dedicated one (a pool's release would drop its listeners), and
it is watched: when it is lost, the listener reconnects with backoff and then
wakes the worker, since whatever was enqueued meanwhile sent its notification
into the void; and every `listen_check_interval` it must answer a trivial query
within `cleanup_timeout`, because a connection that hangs without a reset
raises nothing and delivers nothing, for hours. The worker's poll stays the
safety net throughout.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import trio

from ..config import QueueConfig
from ..db.database import Database, Listening
from .retry import one_line
from .state import WorkerState

log = logging.getLogger("nasiko_queue.worker")

#: How a notification names one queue (`due_payload`); any other payload
#: (an enqueue's is empty) wakes every lane.
QUEUE_PAYLOAD_PREFIX = "queue:"


def due_payload(queue: str) -> str:
    """The payload of a notification for queue `queue` alone: a job of it falls
    due later (statement `queue_notify_due`)."""
    return QUEUE_PAYLOAD_PREFIX + queue


def payload_queue(payload: str) -> str | None:
    """The queue a notification names (`due_payload`); None: it is for every lane."""
    if payload.startswith(QUEUE_PAYLOAD_PREFIX):
        return payload[len(QUEUE_PAYLOAD_PREFIX):]
    return None


#: The payload of a NOTIFY that says a workflow transition is due (migration
#: 0033): it wakes the worker's `TransitionService`, not its lanes.
TRANSITION_PAYLOAD = "nasiko_queue.transition"


class Listener:
    """
    Turns notifications on `channel` into wakes.

    Args:
        db: opens the dedicated connection.
        channel: the NOTIFY channel (`QueueConfig.notify_channel`).
        state: the counters (`listen_connects`, `notifications`, `listen_hangs`).
        wake: the worker's wake (every lane), after a reconnect; never blocks.
        on_notify: called with each notification's payload (None: `wake`); it
            wakes the lanes the payload names (`payload_queue`); never blocks.
        on_transition: called instead for a due workflow transition's
            (`TRANSITION_PAYLOAD`); None: those go to `on_notify` too.
    """

    def __init__(self, db: Database, channel: str, state: WorkerState,
                 wake: Callable[[], None],
                 on_notify: Callable[[str], None] | None = None,
                 on_transition: Callable[[], None] | None = None) -> None:
        self.db = db
        self.channel = channel
        self.state = state
        self.wake = wake
        self.on_notify = on_notify
        self.on_transition = on_transition
        self.config: QueueConfig = state.config

    def _on_notification(self, payload: str) -> None:
        """Runs on the trio thread, from asyncpg's listener callback; never blocks."""
        self.state.stats.notifications += 1
        if payload == TRANSITION_PAYLOAD and self.on_transition is not None:
            self.on_transition()
            return
        if self.on_notify is None:
            self.wake()
        else:
            self.on_notify(payload)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """
        Listen until cancelled. Reports itself started once LISTEN is established
        (or its first try failed: the worker's start is not held hostage, the poll
        covers), so that an enqueue after `nursery.start(worker.run)` wakes it.
        """
        stats = self.state.stats
        delay = self.config.retry_initial_delay
        started = False
        while True:
            try:
                async with self.db.listen(self.channel, self._on_notification) as listening:
                    stats.listen_connects += 1
                    if started:
                        log.info("LISTEN %s re-established; draining what it missed",
                                 self.channel)
                        self.wake()
                        if self.on_transition is not None:
                            self.on_transition()
                    else:
                        started = True
                        task_status.started()
                    connected_at = trio.current_time()
                    self.state.listening = True
                    try:
                        await self._until_lost(listening)
                    finally:
                        self.state.listening = False
                    if trio.current_time() - connected_at > self.config.retry_max_delay:
                        delay = self.config.retry_initial_delay  # it was a healthy connection
                    log.warning("LISTEN connection lost; reconnecting in %.2fs", delay)
            except Exception as exc:
                log.warning("LISTEN %s failed (%s); retrying in %.2fs", self.channel,
                            one_line(exc), delay)
            if not started:
                started = True
                task_status.started()
            await trio.sleep(delay)
            delay = min(delay * 2, self.config.retry_max_delay)

    async def _until_lost(self, listening: Listening) -> None:
        """Return once the connection is lost, or stops answering the check."""
        async with trio.open_nursery() as nursery:

            async def lost() -> None:
                await listening.lost.wait()
                nursery.cancel_scope.cancel()

            nursery.start_soon(lost)
            while True:
                await trio.sleep(self.config.listen_check_interval)
                if not await listening.check(self.config.cleanup_timeout):
                    log.warning("the LISTEN connection did not answer within %.1fs",
                                self.config.cleanup_timeout)
                    self.state.stats.listen_hangs += 1
                    nursery.cancel_scope.cancel()
                    return
