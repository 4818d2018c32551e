"""
The plain-job state machine finds real bugs: each test plants one, in one
feature, and asserts that the machine fails. (The control, the unbroken engine
passing, is tests/test_plain_statemachine.py.) Each prints how many examples the
hunt took; Hypothesis stops at the first failure (not shrunk: shrinking against
a real database is most of a hunt's time).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
import pytest
from hypothesis import Phase, settings

import nasiko_queue.admin.jobs
import nasiko_queue.builds.store
import nasiko_queue.plain.schedules
import nasiko_queue.plain.store
import nasiko_queue.queue
from nasiko_queue import Queue, QueueConfig
from nasiko_queue.engine.lane import Lane
from nasiko_queue.engine.worker import Worker
from nasiko_queue.errors import leaves
from nasiko_queue.testing.mutants import plant_sql, swap
from nasiko_queue.testing.plain_machine import PlainStateMachine, plain_profile
from nasiko_queue.testing.runner import expect_failure

#: Twice the machine's own budget (each rule added makes a given one rarer: the
#: rescue mutant went unfound in 30 examples once the lane and cancel-race rules
#: came), without the shrink phase.
HUNT = settings(plain_profile(), phases=[Phase.explicit, Phase.generate],
                max_examples=2 * plain_profile().max_examples)


#: Each priority's scan of the claim takes every less urgent one's due jobs too, in
#: due order: the job due first wins, whatever its priority.
ORDER = ("AND priority = priorities.priority", "AND priority >= priorities.priority")
DUE = ("AND run_at <= now()", "")
#: An explicit run_at ($7) read and dropped: the job is due after its delay.
NO_RUN_AT = ("coalesce($7::timestamptz,",
             "coalesce(CASE WHEN $7::timestamptz IS NULL THEN NULL::timestamptz END,")

#: The cancel before issue #20: one statement of three parts sharing one snapshot.
#: When a claim holds the row, the part that waits finds it running and changes
#: nothing, the others saw it available: no row, "no such job", and the job runs.
THREE_PART_CANCEL = """
WITH waiting AS (
    UPDATE nasiko_queue_jobs
    SET state = 'cancelled', finished_at = now(), error_msg = 'cancelled'
    WHERE id = $1 AND state = 'available'
    RETURNING 'cancelled'::text AS state
), running AS (
    UPDATE nasiko_queue_jobs SET cancel_requested = true
    WHERE id = $1 AND state = 'running'
    RETURNING 'cancelling'::text AS state
)
SELECT state FROM waiting
UNION ALL SELECT state FROM running
UNION ALL SELECT 'already ' || state FROM nasiko_queue_jobs
          WHERE id = $1 AND state NOT IN ('available', 'running')
"""

async def _reset_by_attempt(self: nasiko_queue.plain.store.PlainJobStore, job: Any) -> bool:
    """`PlainJobStore.reset` as it was before issue #45: guarded by the attempt."""
    status = await self._db.execute(
        "UPDATE nasiko_queue_jobs SET state = 'available', claim_token = NULL "
        "WHERE id = $1 AND attempt = $2 AND state = 'running'", job.id, job.attempt)
    return not status.endswith(" 0")


async def _statements_one_by_one(self: Queue, statements: list[Any],
                                 tx: Any) -> dict[int, Any]:
    """`Queue._insert_statements` with each statement committed by itself (no tx)."""
    holders: dict[int, Any] = {}
    for statement in statements:
        inserted = await self._insert(*statement[:3], tx)
        holders.update(await nasiko_queue.queue._unique_holders(
            statement, inserted, (tx or self.db).fetchval))
    return holders


MUTANTS: dict[str, Callable[[pytest.MonkeyPatch], None]] = {
    # The claim takes the job due first, whatever its priority.
    "claim_ignores_priority": lambda mp: plant_sql(
        mp, nasiko_queue.plain.store, plain_claim=ORDER, plain_finish_many_and_claim=ORDER),
    # The claim takes scheduled jobs before their run_at.
    "claim_ignores_run_at": lambda mp: plant_sql(
        mp, nasiko_queue.plain.store, plain_claim=DUE, plain_finish_many_and_claim=DUE),
    # A crash's retry is due at once, whatever the backoff said.
    "retry_ignores_backoff": lambda mp: plant_sql(mp, nasiko_queue.plain.store, plain_retry=(
        "now() + make_interval(secs => $3::double precision)",
        "now() + make_interval(secs => 0 * $3::double precision)")),
    # A crash on the last attempt makes the job available again instead of discarding it.
    "retry_never_discards": lambda mp: plant_sql(mp, nasiko_queue.plain.store, plain_retry=(
        "attempt >= max_attempts", "attempt >= max_attempts + 1000")),
    # The unique insert never meets its key (each row's key made its own).
    "unique_ignores_the_key": lambda mp: plant_sql(
        mp, nasiko_queue.queue,
        plain_insert=("$9, $10::text[]", "$9 || gen_random_uuid()::text, $10::text[]"),
        plain_insert_notify=("$9, $10::text[]", "$9 || gen_random_uuid()::text, $10::text[]")),
    # A cancel of a running job lets the run end completed.
    "cancel_of_running_completes": lambda mp: plant_sql(mp, nasiko_queue.plain.store, plain_end=(
        "SELECT e.state, CASE WHEN e.state = 'cancelled'",
        "SELECT CASE WHEN e.state = 'cancelled' THEN 'completed' ELSE e.state END,\n"
        "               CASE WHEN e.state = 'cancelled'")),
    # A frozen worker's fence resets its job by id alone, not by its claim: after
    # a rescue it resets whatever run the job has now (issue #45).
    "stale_reset_names_the_job_not_the_claim": lambda mp: plant_sql(
        mp, nasiko_queue.plain.store, plain_reset=(
            "WHERE id = $1 AND claim_token = $2 AND state = 'running'",
            "WHERE id = $1 AND $2::uuid IS NOT NULL AND state = 'running'")),
    # main before issue #45: the fence's reset names the claim by its attempt; after
    # a rescue, an operator's retry (attempts from 0) and a new claim of the same
    # attempt, the frozen worker's reset takes the new run's row.
    "stale_reset_names_the_attempt_not_the_token": lambda mp: swap(
        mp, nasiko_queue.plain.store.PlainJobStore, "reset", _reset_by_attempt),
    # The rescue gives a dead worker's job back with its attempt not counted.
    "rescue_does_not_count_the_attempt": lambda mp: plant_sql(
        mp, nasiko_queue.builds.store, plain_rescue=(
            "        claim_token = NULL\n    FROM nasiko_queue_workers AS w",
            "        claim_token = NULL,\n"
            "        attempt = CASE WHEN nasiko_queue_run_end(j.cancel_requested,\n"
            "                                                 j.attempt >= j.max_attempts)\n"
            "                            = 'available' THEN j.attempt - 1 ELSE j.attempt END\n"
            "    FROM nasiko_queue_workers AS w")),
    # The dead-letter queue's retry keeps the attempts of the runs before.
    "dead_letter_retry_keeps_the_attempts": lambda mp: plant_sql(
        mp, nasiko_queue.admin.jobs, plain_requeue=("attempt = 0,", "")),
    # A crash after a cancel was asked for makes the job available again.
    "crash_after_cancel_retries": lambda mp: plant_sql(mp, nasiko_queue.plain.store, plain_retry=(
        "nasiko_queue_run_end(cancel_requested,", "nasiko_queue_run_end(false,")),
    # The cancel restates its rule in three parts of one snapshot (issue #20): a
    # cancel that waits for a claim is lost.
    "cancel_in_three_parts": lambda mp: plant_sql(mp, nasiko_queue.queue, plain_cancel=(
        "SELECT nasiko_queue.nasiko_queue_cancel($1)", THREE_PART_CANCEL)),
    # -- issue #24: a mutant of each kind the machine's newer rules cover --
    # `enqueue` drops an explicit run_at: the job is due after its delay (0), at once.
    "insert_ignores_run_at": lambda mp: plant_sql(
        mp, nasiko_queue.queue,
        **dict.fromkeys(("plain_insert", "plain_insert_notify"), NO_RUN_AT)),
    # The dead-letter retry keeps the cancel asked of the run that ended the job: the
    # retried job's first crash ends it cancelled instead of retrying it.
    "dead_letter_retry_keeps_the_cancel_request": lambda mp: plant_sql(
        mp, nasiko_queue.admin.jobs, plain_requeue=("cancel_requested = false, ", "")),
    # `enqueue_many` sends each kind's statement in a transaction of its own: a batch
    # refused on its plain statement leaves the build job its first statement wrote.
    "enqueue_many_in_separate_transactions": lambda mp: swap(
        mp, Queue, "_insert_statements", _statements_one_by_one),
    # A give-back of a claimed-ahead job ignores a cancel asked while it waited: the
    # job is available again, and the next claim runs it.
    "give_back_ignores_the_cancel": lambda mp: plant_sql(mp, nasiko_queue.plain.store,
        plain_unclaim=("nasiko_queue_run_end(j.cancel_requested, false)",
                       "nasiko_queue_run_end(false, false)")),
    # A schedule's tick moves forward when it is behind the tick *or at it*: every
    # scheduler of a round enqueues the tick again.
    "schedule_advance_at_its_own_tick": lambda mp: plant_sql(
        mp, nasiko_queue.plain.schedules, schedule_advance=("last_tick < $2", "last_tick <= $2")),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MUTANTS))
async def test_the_plain_machine_finds_the_planted_bug(
    dsn: str, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    MUTANTS[name](monkeypatch)
    found = await expect_failure(dsn, PlainStateMachine, settings=HUNT)
    print(f"\nmutant {name}: found in example {found.examples}: {found.error!r}"[:400])


# -- lanes (issue #20) -------------------------------------------------------------------


@attrs.define(eq=False)
class _CoupledLane(Lane):
    """main before #20: a lane's drain ended only once every lane's had, so a busy
    lane held up the others' claims, wakes and polls."""

    siblings: list[Lane] = attrs.Factory(list)

    async def refresh_due(self) -> None:
        for other in self.siblings:
            await other.state.drain_ended.wait()
        await super().refresh_due()


class _CoupledLanes(PlainStateMachine):
    def make_worker(self, config: QueueConfig | None = None) -> Worker:
        worker = super().make_worker(config)
        lanes = [_CoupledLane(**{f.name: getattr(lane, f.name) for f in attrs.fields(Lane)})
                 for lane in worker.lanes]
        for lane in lanes:
            lane.siblings = list(lanes)
        worker.lanes = list(lanes)
        return worker


@pytest.mark.slow
async def test_the_plain_machine_finds_lanes_that_wait_for_each_other(dsn: str) -> None:
    found = await expect_failure(dsn, _CoupledLanes, settings=HUNT)
    print(f"\nmutant coupled_lanes: found in example {found.examples}: {found.error!r}"[:400])
    assert any("state.drain_beside_a_busy_lane()" in step
               for steps in found.steps for step in steps), found.reports


# -- the fence (issue #20) -----------------------------------------------------------------


def _fence_without_cancelling(self: Worker, _why: str) -> None:
    """A fence that stops claiming but leaves the running executors running: the
    fenced worker would run its jobs beside the rescue's re-run."""
    self.state.fenced = True
    self.state.fence_epoch += 1


@pytest.mark.slow
async def test_the_plain_machine_finds_a_fence_that_does_not_stop_its_runs(
    dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    swap(monkeypatch, Worker, "fence", _fence_without_cancelling)
    found = await expect_failure(dsn, PlainStateMachine, settings=HUNT)
    print(f"\nmutant fence_without_cancelling: found in example {found.examples}: "
          f"{found.error!r}"[:400])
    assert any("state.drain_then_fence()" in step
               for steps in found.steps for step in steps), found.reports


# -- the adaptive look-ahead (issue #25) ---------------------------------------------------


def _auto_ttl_ignored(self: QueueConfig) -> float:
    """An adaptive lane that holds what it claimed ahead for the fixed prefetch's
    TTL (60 s): a short job waits out a long run claimed before it."""
    return self.prefetch_ttl


@pytest.mark.slow
async def test_the_plain_machine_finds_a_look_ahead_that_ignores_its_ttl(
    dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    swap(monkeypatch, QueueConfig, "lane_ttl", _auto_ttl_ignored)
    found = await expect_failure(dsn, PlainStateMachine, settings=HUNT)
    print(f"\nmutant auto_ttl_ignored: found in example {found.examples}: "
          f"{found.error!r}"[:400])
    assert any("state.long_job_among_short_ones(" in step
               for steps in found.steps for step in steps), found.reports
    assert any("behind a long run" in str(leaf) for leaf in leaves(found.error)), found.error
