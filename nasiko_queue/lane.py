"""
A lane: one source of jobs in a worker, with its own slots.

A worker runs one lane for build jobs (when it has build executors) and one per
queue of plain jobs it is given (River's shape: a producer per queue). Each
lane has its own state (`WorkerState.lane`: local buffer, statements in flight,
drains), its own `Producer`, `Completer` and slots, and its own store: the
build lane's `PgJobStore`, or a `PlainJobStore` bound to the queue. So a queue's
concurrency limit is simply its lane's slot count, its claim is one index scan
of its own queue, and a busy queue never holds a slot another queue needs.
The lanes share the worker's counters, its heartbeat, leadership and fence.
"""

from __future__ import annotations

import logging

import attrs
import trio

from .completer import Completer
from .errors import is_transient
from .jobs import ClaimOutcomeUnknown, LaneStore
from .plain_jobs import PlainJobStore
from .producer import Producer
from .retry import one_line
from .slots import Slots
from .state import WorkerState

log = logging.getLogger("nasiko_queue.worker")


@attrs.define(eq=False)
class Lane:
    """One lane's parts; `Worker` builds them and runs `start` in its work nursery."""

    #: "builds", or the queue's name.
    name: str
    state: WorkerState
    store: LaneStore
    producer: Producer
    completer: Completer
    executor: Slots[LaneStore]

    def start(self, nursery: trio.Nursery) -> None:
        """The producer and the slots, as tasks of the worker's work nursery."""
        nursery.start_soon(self.producer.run, name=f"producer {self.name}")
        for n in range(self.state.config.concurrency):
            nursery.start_soon(self.executor.run_slot, name=f"slot {self.name} {n}")

    def lost_claim(self, exc: ClaimOutcomeUnknown) -> None:
        self.producer.lost(exc)

    async def refresh_due(self) -> None:
        """
        After a drain: when this queue's next scheduled job is due, so that the
        drain loop wakes for it then instead of at its next poll. An outage
        leaves the poll to find it.
        """
        store = self.store
        if not isinstance(store, PlainJobStore):
            return
        try:
            due = await store.next_due()
        except Exception as exc:
            log.warning("queue %r: could not read when the next job is due (%s)", self.name,
                        one_line(exc), exc_info=not is_transient(exc))
            self.state.next_due = float("inf")
            return
        self.state.next_due = float("inf") if due is None else trio.current_time() + due
