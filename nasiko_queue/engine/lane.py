"""
A lane: one source of jobs in a worker, with its own slots.

A worker runs one lane for build jobs (when it has build executors) and one per
queue of plain jobs it is given (River's shape: a producer per queue). Each
lane has its own state (`LaneState`: local buffer, statements in flight,
drains), its own drain loop, `Producer`, `Completer` and slots, and its own store: the
build lane's `PgJobStore`, or a `PlainJobStore` bound to the queue. So a queue's
concurrency limit is simply its lane's slot count, its claim is one index scan
of its own queue, and a busy queue never holds a slot another queue needs, nor
waits for another's drain. The lanes share the worker's counters, its
connections, heartbeat, leadership and fence (`WorkerState`).
"""

from __future__ import annotations

import logging

import attrs
import trio

from ..errors import is_transient
from ..plain.store import PlainJobStore
from .completer import Completer
from .contracts import ClaimOutcomeUnknown, LaneStore
from .producer import Producer
from .retry import one_line
from .slots import Slots
from .state import LaneState

log = logging.getLogger("nasiko_queue.worker")


@attrs.define(eq=False)
class Lane:
    """
    One lane's parts and its drain loop; `Worker` builds them and runs `start`
    in its work nursery.

    The drain loop: begin a drain (the producer claims until a claim comes back
    short), wait for it to end, read when the lane's next scheduled job is due,
    then wait for a wake, the poll (`poll_interval`, re-armed after every drain)
    or the due job, whichever comes first; drain again. A lane never waits for
    another lane's drain: a lane whose slots are all busy for an hour is simply
    still draining, while the others claim, run and poll on their own.
    """

    #: "builds", or the queue's name.
    name: str
    state: LaneState
    store: LaneStore
    producer: Producer
    completer: Completer
    executor: Slots[LaneStore]

    def start(self, nursery: trio.Nursery) -> None:
        """The drain loop, the producer and the slots, as tasks of the work nursery."""
        nursery.start_soon(self.run, name=f"drain loop {self.name}")
        nursery.start_soon(self.producer.run, name=f"producer {self.name}")
        for n in range(self.state.config.concurrency):
            nursery.start_soon(self.executor.run_slot, name=f"slot {self.name} {n}")

    def lost_claim(self, exc: ClaimOutcomeUnknown) -> None:
        self.producer.lost(exc)

    # -- wakes ---------------------------------------------------------------------

    def wake(self) -> bool:
        """
        Ask this lane for a drain; never blocks. True when a drain under way
        answers it (begun here, or re-armed), False when the loop's next one will.

        The wake is on the path from an enqueue to its job's start, so it acts
        here rather than through another task: while the loop waits, it begins
        the drain itself, and the producer claims on its next pass; during a
        drain it re-arms it (`LaneState.rearm`), so that a claim already in
        flight, which may not have seen the new job, does not end the drain when
        it comes back short.
        """
        state = self.state
        if state.stopping.is_set() or state.closing:
            return False
        if state.waiting:
            state.waiting = False
            state.drain_begun = True
            state.begin_drain()
            state.wake_event.set()
            return True
        if state.draining:
            state.rearm()
            return True
        state.woken = True  # between a drain's end and the next wait
        return False

    # -- the drain loop ------------------------------------------------------------

    async def run(self) -> None:
        """Drain, wait for a wake, the poll or the next due job; until stopped."""
        state, poll = self.state, self.state.config.poll_interval
        try:
            while True:
                if not state.drain_begun:  # else a wake began it already
                    state.begin_drain()
                    if state.stopping.is_set():
                        # Stopped before this lane's first drain: that drain claims
                        # nothing and ends at once (the stop ended the drains under
                        # way, not this one), so that every lane drains at least once.
                        state.end_drain()
                state.drain_begun = False
                state.woken = False  # the drain answers every wake so far
                try:
                    await state.drain_ended.wait()
                    if not state.stopping.is_set():
                        await self.refresh_due()
                finally:
                    self._drain_over()
                if state.stopping.is_set():
                    return
                if state.woken:
                    continue
                state.wake_event = trio.Event()
                state.waiting = True
                try:
                    with trio.move_on_at(min(trio.current_time() + poll,
                                             state.next_due)) as state.wait_scope:
                        await state.wake_event.wait()
                finally:
                    state.waiting = False
                    state.wait_scope = None
        finally:
            if state.drain_begun:  # begun by a wake just before the stop
                state.drain_begun = False
                self._drain_over()
            state.close()

    def _drain_over(self) -> None:
        state = self.state
        state.end_drain()
        state.drains_completed += 1
        state.stats.drains_completed += 1
        state.notify()

    async def refresh_due(self) -> None:
        """
        After a drain: when this queue's next scheduled job is due, so that the
        drain loop wakes for it then instead of at its next poll. An outage
        leaves the poll to find it.
        """
        store, state = self.store, self.state
        if not isinstance(store, PlainJobStore):
            return
        # What `LaneState.due_at` learns from here on outlives the answer, which
        # may have been read before the write it learned of.
        state.due_learned = float("inf")
        try:
            due = await store.next_due()
        except Exception as exc:
            log.warning("queue %r: could not read when the next job is due (%s)", self.name,
                        one_line(exc), exc_info=not is_transient(exc))
            state.next_due = state.due_learned
            return
        read = float("inf") if due is None else trio.current_time() + due
        state.next_due = min(read, state.due_learned)
