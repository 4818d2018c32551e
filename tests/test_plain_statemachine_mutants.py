"""
The plain-job state machine finds real bugs: each test plants one, in one
feature, and asserts that the machine fails. (The control, the unbroken engine
passing, is tests/test_plain_statemachine.py.) Each prints how many examples the
hunt took; Hypothesis stops at the first failure (not shrunk: shrinking against
a real database is most of a hunt's time).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from hypothesis import Phase, settings

import nasiko_queue.job_admin
import nasiko_queue.jobs
import nasiko_queue.plain_jobs
import nasiko_queue.queue
from nasiko_queue.testing.mutants import plant_sql
from nasiko_queue.testing.plain_machine import PlainStateMachine, plain_profile
from nasiko_queue.testing.runner import expect_failure

#: The machine's own budget, without the shrink phase.
HUNT = settings(plain_profile(), phases=[Phase.explicit, Phase.generate])


#: Each priority's scan of the claim takes every less urgent one's due jobs too, in
#: due order: the job due first wins, whatever its priority.
ORDER = ("AND priority = priorities.priority", "AND priority >= priorities.priority")
DUE = ("AND run_at <= now()", "")

MUTANTS: dict[str, Callable[[pytest.MonkeyPatch], None]] = {
    # The claim takes the job due first, whatever its priority.
    "claim_ignores_priority": lambda mp: plant_sql(
        mp, nasiko_queue.plain_jobs, plain_claim=ORDER, plain_finish_many_and_claim=ORDER),
    # The claim takes scheduled jobs before their run_at.
    "claim_ignores_run_at": lambda mp: plant_sql(
        mp, nasiko_queue.plain_jobs, plain_claim=DUE, plain_finish_many_and_claim=DUE),
    # A crash's retry is due at once, whatever the backoff said.
    "retry_ignores_backoff": lambda mp: plant_sql(mp, nasiko_queue.plain_jobs, plain_retry=(
        "now() + make_interval(secs => $3::double precision)",
        "now() + make_interval(secs => 0 * $3::double precision)")),
    # A crash on the last attempt makes the job available again instead of discarding it.
    "retry_never_discards": lambda mp: plant_sql(mp, nasiko_queue.plain_jobs, plain_retry=(
        "attempt >= max_attempts", "attempt >= max_attempts + 1000", 4)),
    # The unique insert never meets its key (each row's key made its own).
    "unique_ignores_the_key": lambda mp: plant_sql(
        mp, nasiko_queue.queue,
        plain_insert=("$9, $10::text[]", "$9 || gen_random_uuid()::text, $10::text[]"),
        plain_insert_notify=("$9, $10::text[]", "$9 || gen_random_uuid()::text, $10::text[]")),
    # A cancel of a running job lets the run end completed.
    "cancel_of_running_completes": lambda mp: plant_sql(mp, nasiko_queue.plain_jobs, plain_end=(
        "SET state = $3,",
        "SET state = CASE WHEN $3::text = 'cancelled' THEN 'completed' ELSE $3 END,")),
    # The rescue gives a dead worker's job back with its attempt not counted.
    "rescue_does_not_count_the_attempt": lambda mp: plant_sql(
        mp, nasiko_queue.jobs, plain_rescue=(
            "        claim_token = NULL\n    FROM nasiko_queue_workers AS w",
            "        claim_token = NULL,\n"
            "        attempt = CASE WHEN j.cancel_requested OR j.attempt >= j.max_attempts\n"
            "                       THEN j.attempt ELSE j.attempt - 1 END\n"
            "    FROM nasiko_queue_workers AS w")),
    # The dead-letter queue's retry keeps the attempts of the runs before.
    "dead_letter_retry_keeps_the_attempts": lambda mp: plant_sql(
        mp, nasiko_queue.job_admin, plain_requeue=("attempt = 0,", "")),
    # A crash after a cancel was asked for makes the job available again.
    "crash_after_cancel_retries": lambda mp: plant_sql(mp, nasiko_queue.plain_jobs, plain_retry=(
        "SET state = CASE WHEN cancel_requested THEN 'cancelled'", "SET state = CASE")),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MUTANTS))
async def test_the_plain_machine_finds_the_planted_bug(
    dsn: str, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    MUTANTS[name](monkeypatch)
    found = await expect_failure(dsn, PlainStateMachine, settings=HUNT)
    print(f"\nmutant {name}: found in example {found.examples}: {found.error!r}"[:400])
