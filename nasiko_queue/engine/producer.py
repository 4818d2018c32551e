"""
The producer: the one task that claims jobs for a worker's slots.

It sends every statement the slots need: a claim for the room they have (free
slots, plus the prefetch buffer), carrying the finishes (and the executors' start
writes) the completer has queued since the previous statement. Claimed jobs go
into the local buffer, oldest first, where the slots take them.

Two statements may be in flight at once with several slots, each claiming at
most half of the slots and buffer, so that half the slots run their jobs while
the other half's next jobs are claimed: the worker's CPU and the server's then
work at the same time instead of taking turns. Claims never exceed the room:
jobs a statement in flight may claim count as taken. With one slot, one
statement at a time, so jobs start in the order claimed.

It also gives back jobs that never started (on a stop, or past the lane's TTL,
`prefetch_ttl` or, for an adaptive lane, `prefetch_auto_ttl`, so that an idle
slot or replica can take them: attempts restored), and resolves claims
whose answer was lost (`JobStore.resolve_lost_claim`). On a stop it waits for
the last slots, has their finishes recorded and gives back the buffer; on a
hard stop it does so shielded, each statement bounded.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable
from datetime import MINYEAR, UTC, datetime

import trio

from ..errors import FinalWriteRefused, NotWithinTheStopsBound, is_transient
from .completer import Completer
from .contracts import ClaimedJob, ClaimOutcomeUnknown, LaneStore, LostClaim, Starting
from .retry import Budget, RetryPolicy, one_line
from .state import STATEMENTS_IN_FLIGHT, Finish, LaneState

log = logging.getLogger("nasiko_queue.worker")


class Producer:
    """
    Claims into the local buffer; gives back what never started; resolves lost claims.

    Args:
        state: the lane's state.
        store: the database operations.
        completer: whose queued finishes ride on each statement.
        retry: the retry policy (for lost claims).
        wake: asks the worker for another drain (jobs went back to pending).
    """

    def __init__(self, state: LaneState, store: LaneStore, completer: Completer,
                 retry: RetryPolicy, wake: Callable[[], None]) -> None:
        self.state = state
        self.store = store
        self.completer = completer
        self.retry = retry
        self.wake = wake
        self.config = state.config

    async def run(self) -> None:
        """Until the worker closes and the last slot is done; then wind down, shielded."""
        try:
            async with trio.open_nursery() as statements:
                await self._produce(statements)
        finally:
            with trio.CancelScope(shield=True):
                await self._wind_down()

    async def _produce(self, statements: trio.Nursery) -> None:
        state, ttl = self.state, self.state.prefetch_ttl
        in_flight = 1 if self.config.concurrency == 1 else STATEMENTS_IN_FLIGHT
        completer = self.completer
        while True:
            now = trio.current_time()
            free = state.in_flight < in_flight
            expired = state.buffer and state.oldest_claim() + ttl <= now
            starts = completer.starts_due(now)
            if state.lost_claims:
                for claim in state.lost_claims:
                    statements.start_soon(self.resolve, claim)
                state.lost_claims.clear()
            elif state.fenced_out:
                await self._give_back(self._take_fenced_out(), "taken out of the buffer "
                                      "by the fence")
            elif state.buffer and (state.closing or expired):
                if state.reserved:
                    # A claim in flight may read the table after the give-back
                    # commits and take the same jobs straight back (to give them
                    # back again): give back once it has landed (`_done` kicks).
                    await state.wait_kicked()
                else:
                    await self.give_back(expired=not state.closing)
            elif (state.finishes or (starts and not state.in_flight)) and free:
                # Start writes that are due ride on whatever goes next; alone only
                # when nothing is in flight (what is will be answered soon).
                want = state.claim_size()
                statements.start_soon(self._send_finishes, completer.take_batch(), want,
                                      self._begin(want), completer.take_starts(now))
            elif state.draining and free and state.claim_size():
                want = state.claim_size()
                if starts:  # the finish statement claims too, and carries them
                    statements.start_soon(self._send_finishes, [], want, self._begin(want),
                                          completer.take_starts(now))
                else:
                    statements.start_soon(self._send_claim, want, self._begin(want))
            elif state.draining and state.fenced:
                state.end_drain()  # cut off: nothing can be claimed until registered anew
            elif state.closing and not state.slots_alive and not state.in_flight \
                    and not state.resolving:
                return
            else:
                wake_at = state.oldest_claim() + ttl if state.buffer else float("inf")
                if state.starts and not starts:  # the next start write falls due
                    wake_at = min(wake_at, state.starts[0][0])
                await state.wait_kicked(wake_at)

    # -- statements --------------------------------------------------------------

    def _begin(self, want: int) -> tuple[int, int]:
        """Book a statement in flight and the room its claim may take; the drain it
        is in, and the fence epoch it is sent under."""
        state = self.state
        state.in_flight += 1
        state.reserved += want
        state.stats.statements += 1
        return state.drain_id, state.worker.fence_epoch

    def _done(self, want: int) -> None:
        self.state.in_flight -= 1
        self.state.reserved -= want
        self.state.kick()
        self.state.notify()

    async def _send_finishes(self, batch: list[Finish], want: int, sent: tuple[int, int],
                             starts: list[Starting] | None = None,
                             budget: Budget | None = None) -> None:
        try:
            claimed = await self.completer.send(batch, want, starts, budget=budget)
            if claimed is None:  # no claim ran: the drain goes on, and claims again
                await self._accept([], 0, sent)
            else:
                await self._accept(claimed, want, sent)
        finally:
            self._done(want)

    async def _send_claim(self, want: int, sent: tuple[int, int]) -> None:
        try:
            claimed = await self.claim(want)
            if claimed is None:
                if sent[0] == self.state.drain_id:
                    self.state.end_drain()  # logged; the next wake or poll tries again
            else:
                await self._accept(claimed, want, sent)
        finally:
            self._done(want)

    async def claim(self, limit: int) -> list[ClaimedJob] | None:
        """
        One claim, shielded (and bounded by the store): a hard stop must not cut
        it after the server committed it, or the job would sit in_progress with
        no executor. None when it failed (logged; the drain stops); a claim whose
        answer was lost is resolved.
        """
        with trio.CancelScope(shield=True):
            try:
                return await self.store.claim(limit)
            except ClaimOutcomeUnknown as exc:
                self.state.stats.claim_errors += 1
                self.lost(exc)
            except Exception as exc:
                self.state.stats.claim_errors += 1
                log.error("claim failed (%s); waiting for the next wake or poll",
                          one_line(exc), exc_info=not is_transient(exc))
        return None

    async def _accept(self, claimed: list[ClaimedJob], wanted: int,
                      sent: tuple[int, int]) -> None:
        """
        Claimed jobs into the buffer. A claim that came back short ends the
        drain, if it was sent during that drain: one sent before the wake may
        not have seen the job that caused it.

        A claim answered after a fence (the worker is fenced now, or was since
        the claim was sent) never reaches a slot: its jobs go straight back,
        attempts restored, or, if the database cannot be reached, are left to
        the rescue. Else the fenced worker would run them beside the rescue's
        re-run.
        """
        state = self.state
        drain, epoch = sent
        if wanted and len(claimed) < wanted and drain == state.drain_id:
            state.end_drain()
        if not claimed:
            return
        if state.fenced or epoch != state.worker.fence_epoch:
            await self._give_back(claimed, "claimed just before the fence")
            return
        now = trio.current_time()
        if state.buffer and claimed[0].order < state.buffer[-1][0].order:
            # Two statements in flight returned out of order: oldest job first still.
            merged = sorted([*state.buffer, *((job, now) for job in claimed)],
                            key=lambda entry: entry[0].order)
            state.buffer = collections.deque(merged)
        else:
            state.buffer.extend((job, now) for job in claimed)
        state.stats.buffered += len(claimed)
        state.stats.claimed += len(claimed)
        wall = datetime.now(UTC)
        for job in claimed:
            # Against the database's clock (created_at, run_at): a skew shows here.
            # A run_at of -infinity (written by SQL) has no latency to observe.
            if job.created_at.year > MINYEAR:
                state.claim_latency.observe(max(0.0, (wall - job.created_at).total_seconds()))
        state.job_ready.unpark(count=len(claimed))

    # -- lost claims -------------------------------------------------------------

    def lost(self, exc: ClaimOutcomeUnknown) -> None:
        """A claim's answer was lost: give back what it took, at once."""
        log.warning("a claim got no answer (%s); giving back whatever it took", one_line(exc))
        self.state.lost_claims.append(exc.claim)
        self.state.kick()

    async def resolve(self, claim: LostClaim) -> None:
        """Give back what a lost claim took (retried until the database answers)."""
        state = self.state
        state.resolving += 1
        landed: list[int] = []  # also what a hard stop's last try gave back

        async def resolve() -> int:
            landed.append(await self.store.resolve_lost_claim(claim))
            return landed[-1]

        try:
            with state.last_write() as budget:
                await self.retry.final("lost claim", resolve, budget=budget)
        except (FinalWriteRefused, NotWithinTheStopsBound) as exc:
            log.error("a claim whose answer was lost could not be resolved (%s); its jobs "
                      "wait for a rescue or the sweep", one_line(exc))
        finally:
            if landed:
                state.stats.lost_claims += 1
                state.stats.returned += landed[-1]
                if landed[-1]:
                    self.wake()  # they are pending again: claim them (or let a replica)
            state.resolving -= 1
            state.kick()
            state.notify()

    # -- giving back -------------------------------------------------------------

    async def give_back(self, *, expired: bool) -> None:
        """
        Buffered jobs back to pending, attempts restored: on closing, all of
        them; else those past the lane's TTL (`LaneState.prefetch_ttl`), and
        prefetching pauses until a slot runs dry, or we would claim the same
        jobs straight back.
        """
        state = self.state
        if expired:
            # The same comparison as the loop's, so at least one job goes.
            now, ttl = trio.current_time(), state.prefetch_ttl
            jobs = [job for job, claimed_at in state.buffer if claimed_at + ttl <= now]
            state.buffer = collections.deque(
                entry for entry in state.buffer if entry[1] + ttl > now)
            state.prefetch_paused = True
        else:
            jobs = [job for job, _ in state.buffer]
            state.buffer.clear()
        state.stats.buffered -= len(jobs)
        await self._give_back(jobs, "waited past its TTL" if expired else "stopping")

    def _take_fenced_out(self) -> list[ClaimedJob]:
        jobs, self.state.fenced_out = self.state.fenced_out, []
        return jobs

    async def _give_back(self, jobs: list[ClaimedJob], why: str) -> None:
        state = self.state
        for job in jobs:
            # A cancel mark of a buffered job is spent: the give-back ends it
            # cancelled (plain_unclaim), and no slot will run this claim.
            state.cancels.discard(job.claim)
        # Retried until it lands, as the other final writes are: while this
        # worker lives, no rescue or sweep takes its rows, so a give-back
        # dropped on one failure left its jobs running unstarted for the
        # worker's whole life. Once the lane closes, bounded as the other last
        # writes (the rows are then the rescue's once the worker is gone).
        landed: list[int] = []  # also what a hard stop's last try gave back

        async def unclaim() -> int:
            landed.append(await self.store.unclaim(jobs))
            return landed[-1]

        failure = "a hard stop came first"
        try:
            with state.last_write() as budget:
                await self.retry.final("give-back", unclaim, budget=budget)
        except (FinalWriteRefused, NotWithinTheStopsBound) as exc:
            failure = one_line(exc)
        finally:
            if landed:
                state.stats.returned += landed[-1]
                log.info("gave back %d of %d job(s) that never started (%s)", landed[-1],
                         len(jobs), why)
            else:
                log.warning("%d unstarted job(s) could not be given back (%s); a rescue or "
                            "the sweep will", len(jobs), failure)
        state.notify()

    # -- winding down ------------------------------------------------------------

    async def _wind_down(self) -> None:
        """
        After the loop (graceful) or on a hard stop (shielded): record the
        finishes of the last slots and give back the buffer.

        It waits for every slot, however long an executor takes to notice a
        hard stop (the work nursery waits for them anyway), so that an outcome
        handed over late is still recorded. Each statement is bounded instead:
        one that cannot be sent in time is logged, and its jobs are left for a
        rescue or the sweep.
        """
        state = self.state
        # As a stop does: the slots take nothing more and return once their run
        # ends. Here also when the loop above raised (a bug): the slots waited for
        # jobs that would never come, and the wind-down for them, so the worker
        # hung instead of ending with the error.
        state.close()
        while (state.lost_claims or state.buffer or state.fenced_out or state.finishes
               or state.starts or state.slots_alive):
            if state.fenced_out:
                await self._give_back(self._take_fenced_out(), "taken out of the buffer "
                                      "by the fence")
            elif state.lost_claims:
                await self.resolve(state.lost_claims.pop())  # bounded: `last_write`
            elif state.buffer:
                await self.give_back(expired=False)
            elif state.finishes or state.starts:
                batch, starts = self.completer.take_batch(), self.completer.take_starts()
                try:
                    with state.last_write() as budget:
                        await self._send_finishes(batch, 0, self._begin(0), starts,
                                                  budget=budget)
                except NotWithinTheStopsBound:
                    self.completer.dropped(batch, starts)
            else:
                await state.wait_kicked()
