"""
The transition service: applies the workflow transitions that a step job's end
could not apply at once, a bounded piece per transaction (migration 0033).

A step's end still takes its transition in the finish's own transaction when
the run's row is free and the transition is small (the common case: a chain's
next step, a fan-out's first 100 items, a small join). What is left over is
recorded in the database as due (`nasiko_queue_workflow_due`): a transition
whose run's row another transaction held (the finish never waits for it: it
holds a connection every lane of the worker needs), a fan-out's further
pieces (its cursor is on the step's head row), the join of a large fan-out.
Each worker that runs workflows has one of these services; any of them takes
any run's due work, one run's piece at a time (`nasiko_queue_wf_apply_due`
locks the run's row SKIP LOCKED, so two services never wait for each other).

Shaped like the maintenance services (River's): a config, a `run_once()` that
applies one piece and says how many due rows it took (tests call it), and a
`run()` loop woken by the NOTIFY that a due row sends (the worker's listener
hands it over: `kick`), with a poll as the safety net for a lost one.

A piece runs on a pooled connection (the main pool, like an executor's
statements), never on the engine's connections that claims and finishes use.
Nothing holds a stop: a stop between pieces leaves the rest due for the next
worker, and a piece the stop abandons mid-way commits or rolls back whole, on
its own.
"""

from __future__ import annotations

import logging
import math

import asyncpg
import attrs
import trio

from ..config import QueueConfig
from ..db.database import Database
from ..db.statements import Q
from ..engine.listener import TRANSITION_PAYLOAD
from ..engine.retry import one_line

__all__ = ["TRANSITION_PAYLOAD", "TransitionConfig", "TransitionService"]

log = logging.getLogger("nasiko_queue.workflows")

#: Items a piece of a fan-out enqueues in one transaction of the service.
DEFAULT_PIECE = 1000


@attrs.frozen(kw_only=True)
class TransitionConfig:
    """How the service applies what is due."""

    #: Due job ends, and items of a fan-out, per transaction.
    piece: int = DEFAULT_PIECE
    #: Seconds between looks when no NOTIFY came (a lost one, no listener).
    poll_interval: float = 5.0
    #: Seconds one piece may take before the service stops waiting for it (it
    #: then commits or rolls back on its own; the next look takes what is left).
    bound: float = 60.0
    #: Seconds to wait after a failed piece before the next look.
    retry_delay: float = 1.0

    @classmethod
    def of(cls, config: QueueConfig) -> TransitionConfig:
        return cls(poll_interval=config.poll_interval,
                   bound=max(60.0, config.cleanup_timeout),
                   retry_delay=config.retry_max_delay)


class TransitionService:
    """
    Applies due workflow transitions, a piece per transaction.

    Args:
        db: where; each piece is one statement on a pooled connection.
        config: the piece size and the poll.
    """

    def __init__(self, db: Database, config: TransitionConfig) -> None:
        self.db = db
        self.config = config
        self._kicked = trio.Event()
        #: Due rows taken since start (tests and benchmarks read it).
        self.applied = 0
        #: Pieces run since start.
        self.pieces = 0

    def kick(self) -> None:
        """Something is due (a NOTIFY): look now. Never blocks."""
        self._kicked.set()

    async def run_once(self) -> int:
        """Apply one piece; how many due rows it took (0: nothing due it could take)."""
        piece = self.config.piece
        bound = self.config.bound

        async def apply(conn: asyncpg.Connection) -> int:
            taken: int = await conn.fetchval(Q.workflow_apply_due, piece, timeout=bound)
            return taken

        taken = await self.db.run_bounded(apply, bound=bound)
        self.pieces += 1
        self.applied += taken
        return taken

    async def drain(self) -> int:
        """Pieces until nothing is due that this service can take; how many rows."""
        total = 0
        while taken := await self.run_once():
            total += taken
        return total

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
                  ) -> None:
        """Look at start, then at every kick or poll, until cancelled; each look
        drains. A failed piece is logged and looked at again later."""
        task_status.started()
        while True:
            self._kicked = trio.Event()
            try:
                await self.drain()
            except Exception as exc:
                log.warning("workflow transitions: a piece failed (%s); next look in %.1fs",
                            one_line(exc), self.config.retry_delay)
                await trio.sleep(self.config.retry_delay)
                continue
            with trio.move_on_after(self.config.poll_interval
                                    if math.isfinite(self.config.poll_interval) else 3600):
                await self._kicked.wait()
