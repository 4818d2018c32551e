"""
The state machine finds real bugs: each test breaks the engine on purpose and
asserts that the machine fails, with a shrunk counterexample. A harness that
never fails proves nothing. (The control, the unbroken engine passing the
machine, is tests/test_statemachine.py.)
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, NamedTuple
from uuid import UUID

import pytest
import trio
from hypothesis import Phase, settings

import nasiko_queue.builds.executor
import nasiko_queue.builds.store
import nasiko_queue.builds.terminalize
from nasiko_queue import Database, Queue, Worker
from nasiko_queue.builds.executor import JobExecutor
from nasiko_queue.builds.store import PgJobStore
from nasiko_queue.engine.contracts import ClaimedJob, RecoveryResult
from nasiko_queue.testing.machine import (
    QueueStateMachine,
    SteeredQueueStateMachine,
    profile,
    run_queue_state_machine,
)
from nasiko_queue.testing.model import Outcome
from nasiko_queue.testing.mutants import plant_sql, swap
from nasiko_queue.testing.runner import expect_failure

#: The machine's default profile (`nasiko-ci`: 50 examples of up to 30 steps,
#: derandomized): each planted bug must be found within the budget a user's own
#: run of the machine has. Hypothesis stops at the first failure and shrinks it.
HUNT = profile()

#: The build jobs' finish statements: without and with the executors' reports,
#: each for every kind and for some (the machine's worker runs every kind; a
#: mutant planted in all four cannot hide in the one a run does not send).
_EVERY_FINISH = ("jobs_finish_many_and_claim", "jobs_finish_many_and_claim_kinds",
                 "jobs_finish_reported_and_claim", "jobs_finish_reported_and_claim_kinds")


async def _expect_failure(dsn: str, machine: type[QueueStateMachine], *,
                          rule_timeout: float = 20.0, shrink: bool = True) -> str:
    """
    Run the machine; it must fail. Returns the example Hypothesis reports.

    With `shrink`, the example must come back shrunk to at most 8 steps (rules,
    not counting the checks after each). Shrinking against a real database is
    most of a hunt's time, so the newer mutants only show that the default
    profile finds their bug (the first five show the shrinking too).
    """
    hunt = HUNT if shrink else settings(HUNT, phases=[Phase.explicit, Phase.generate])
    found = await expect_failure(dsn, machine, settings=hunt, rule_timeout=rule_timeout)
    if shrink:
        for report, steps in zip(found.reports, found.steps, strict=True):
            assert len(steps) <= 8, f"not shrunk to a short example:\n{report}"
    return "\n".join(found.reports)


def cap_off_by_one(self: JobExecutor, job: ClaimedJob) -> bool:
    return job.old_attempt > self.config.build_max_attempts  # bug: > instead of >=


async def reset_keeps_picked_at(self: PgJobStore, job: ClaimedJob) -> bool:
    # bug: back to pending but picked_at kept
    return await self._db.fetchval(
        "UPDATE build_jobs SET status = 'pending' WHERE id = $1 AND attempt = $2 "
        "AND status = 'in_progress' RETURNING id", job.id, job.attempt) is not None


async def sweep_ignores_attempt(self: PgJobStore) -> RecoveryResult:
    # bug: every stuck job goes back to pending, however many attempts it used
    rows = await self._db.fetch(
        "UPDATE build_jobs SET status = 'pending', picked_at = NULL "
        "WHERE status = 'in_progress' AND picked_at < now() - make_interval(mins => $1) "
        "RETURNING id", self._config.stuck_job_mins)
    return RecoveryResult(failed=0, reset=len(rows))


@pytest.mark.slow
async def test_finds_terminalization_that_forgets_connectors(
    dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    real: Callable[..., Any] = nasiko_queue.builds.store.terminalize_target

    async def forgets_connectors(conn: Any, agent_id: Any, connector_id: Any,
                                 own_build_id: Any) -> Any:
        if agent_id is None:
            return None  # bug: connectors are never terminalized
        return await real(conn, agent_id, connector_id, own_build_id)

    swap(monkeypatch, nasiko_queue.builds.store, "terminalize_target", forgets_connectors)
    await _expect_failure(dsn, QueueStateMachine)


async def endless_crash_retries(self: JobExecutor, job: ClaimedJob,
                                build_id: UUID | None) -> None:
    # bug: a crash always goes back to pending, however many runs it had
    await self.retry.final("reset", lambda: self.store.reset(job))
    self.wake()


async def fails_an_attempt_early(self: JobExecutor, job: ClaimedJob,
                                 build_id: UUID | None) -> None:
    if job.old_attempt + 2 >= self.config.build_max_attempts:  # bug: + 2
        await self._fail(job, nasiko_queue.builds.executor.JOB_PANICKED, own_build_id=build_id)
    else:
        await self.retry.final("reset", lambda: self.store.reset(job))
        self.wake()


class M(QueueStateMachine):
    """
    The machine the swapped methods are hunted with. A machine's name seeds its
    derandomized examples (`nasiko_queue.testing.runner`); these hunts were
    written against a machine called M, and another name's examples can take a
    shrink longer than a test may run (the sweep's, over 300 s).
    """


class Swap(NamedTuple):
    """A bug planted by swapping a method for a buggy copy."""

    owner: type
    method: str
    bug: Callable[..., Any]
    #: Whether the example must come back shrunk (to at most 8 steps).
    shrink: bool
    #: The rules of which the example must show one.
    rules: str


SWAPS = {
    "an_off_by_one_in_the_cap": Swap(
        JobExecutor, "_out_of_attempts", cap_off_by_one, True, "enqueue|enqueue_exhausted"),
    "a_panic_reset_that_keeps_picked_at": Swap(
        PgJobStore, "reset", reset_keeps_picked_at, True,
        "drain(_with_two_workers)?|hard_stop_mid_run"),
    "a_sweep_that_ignores_attempt": Swap(
        PgJobStore, "recover", sweep_ignores_attempt, True,
        "poison_job|age_stuck_jobs|stall|stale_writer"),
    "crash_retries_that_never_end": Swap(
        JobExecutor, "reset_panicked_job", endless_crash_retries, False,
        "enqueue|enqueue_crash_loop|hard_stop_mid_run"),
    "a_crash_that_fails_its_job_an_attempt_early": Swap(
        JobExecutor, "reset_panicked_job", fails_an_attempt_early, False,
        "enqueue|enqueue_crash_loop|hard_stop_mid_run"),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SWAPS))
async def test_finds_a_swapped_method(
    dsn: str, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    owner, method, bug, shrink, rules = SWAPS[name]
    swap(monkeypatch, owner, method, bug)
    notes = await _expect_failure(dsn, M, shrink=shrink)
    assert re.search(rf"state\.({rules})\(", notes), notes


@pytest.mark.slow
@pytest.mark.parametrize("unit", ["secs", "hours"])
async def test_finds_a_sweep_whose_threshold_is_in_the_wrong_unit(
    dsn: str, monkeypatch: pytest.MonkeyPatch, unit: str
) -> None:
    """make_interval(secs => 60) or (hours => 60) instead of (mins => 60)."""
    wrong = ("make_interval(mins => $1)", f"make_interval({unit} => $1)")
    plant_sql(monkeypatch, nasiko_queue.builds.store, jobs_stuck_exhausted=wrong,
              jobs_reset_stuck=wrong,
              job_fail=("make_interval(mins => $4)", f"make_interval({unit} => $4)"))
    notes = await _expect_failure(dsn, QueueStateMachine, shrink=False)
    assert re.search(r"state\.(age_stuck_jobs|poison_job|stall|stale_writer)\(", notes), notes


@pytest.mark.slow
async def test_finds_a_finish_that_takes_any_status_but_failed_as_success(
    dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only a run that returns with its build row neither 'success' nor 'failed'
    shows this bug, so the machine's executors play those outcomes (the default
    examples, which follow the machine's source, may hold too few of them)."""
    plant_sql(monkeypatch, nasiko_queue.builds.store, **dict.fromkeys(_EVERY_FINISH, (
        "SET status = CASE WHEN o.build_status = 'success' THEN 'done' ELSE 'failed' END,\n"
        "        error_msg = CASE WHEN o.build_status = 'success' THEN NULL ELSE $5 END,",
        "SET status = CASE WHEN o.build_status = 'failed' THEN 'failed' ELSE 'done' END,\n"
        "        error_msg = CASE WHEN o.build_status = 'failed' THEN $5 END,")))
    notes = await _expect_failure(dsn, _Unreported, shrink=False)
    assert "state.enqueue(" in notes, notes


class _Unreported(QueueStateMachine):
    """Runs that return without an outcome on their build row (or succeed)."""

    outcomes = (Outcome.NO_REPORT, Outcome.REPORT_BUILDING)


@pytest.mark.slow
@pytest.mark.parametrize("write", ["finish", "fail", "reset"])
async def test_finds_final_writes_that_do_not_check_the_claim_is_current(
    dsn: str, monkeypatch: pytest.MonkeyPatch, write: str
) -> None:
    """A write guarded by the job id and status only, not by the claim (its
    attempt and token): a worker whose claim was handed on overwrites its
    successor's."""
    statements, guard, unguarded = {
        "finish": (_EVERY_FINISH,
                   "AND coalesce(j.status, '') = 'in_progress' AND j.attempt = o.attempt\n"
                   "      AND j.claim_token = o.token",
                   "AND coalesce(j.status, '') = 'in_progress'"),
        "fail": (("job_fail",),
                 "WHERE id = $1 AND status = 'in_progress' AND attempt = $2\n"
                 "  AND claim_token IS NOT DISTINCT FROM $6::uuid",
                 "WHERE id = $1 AND status = 'in_progress' AND $2::int IS NOT NULL\n"
                 "  AND ($6::uuid IS NULL OR true)"),
        "reset": (("job_reset_to_pending",),
                  "WHERE id = $1 AND status = 'in_progress' AND attempt = $2 AND claim_token = $4",
                  "WHERE id = $1 AND status = 'in_progress' AND $2::int IS NOT NULL "
                  "AND $4::uuid IS NOT NULL"),
    }[write]
    # The claim is still passed, but no longer compared with the row's.
    plant_sql(monkeypatch, nasiko_queue.builds.store,
              **dict.fromkeys(statements, (guard, unguarded)))
    # Which rule meets the stale write first depends on timing (a hard stop's
    # release is a reset too); any failing example counts.
    await _expect_failure(dsn, QueueStateMachine, shrink=False)


@pytest.mark.slow
@pytest.mark.parametrize("message", ["JOB_PANICKED", "BUILD_FAILED", "MAX_ATTEMPTS_EXCEEDED"])
async def test_finds_a_changed_error_message(
    dsn: str, monkeypatch: pytest.MonkeyPatch, message: str
) -> None:
    """The engine writes a message that is not the documented one (the model spells
    each out itself; it does not import the engine's)."""
    changed = getattr(nasiko_queue.builds.store, message).replace(" ", "  ", 1)
    for module in (nasiko_queue.builds.store, nasiko_queue.builds.executor):
        if hasattr(module, message):
            monkeypatch.setattr(module, message, changed)
    await _expect_failure(dsn, QueueStateMachine, shrink=False)


@pytest.mark.slow
@pytest.mark.parametrize("bug", ["takes_live_workers_jobs", "ignores_attempts"])
async def test_finds_a_rescue_that_takes_the_wrong_jobs(
    dsn: str, monkeypatch: pytest.MonkeyPatch, bug: str
) -> None:
    """The rescue gives back jobs of workers that still heartbeat, or resets jobs
    with no attempts left instead of failing them."""
    if bug == "takes_live_workers_jobs":
        plant_sql(monkeypatch, nasiko_queue.builds.store, jobs_rescue=(
            "WHERE w.id = j.claimed_by AND w.dead_at IS NOT NULL",
            "WHERE w.id = j.claimed_by"))
    else:
        plant_sql(
            monkeypatch, nasiko_queue.builds.store,
            jobs_rescue=("AND j.status = 'in_progress' AND j.attempt < $1",
                         "AND j.status = 'in_progress' AND $1::int IS NOT NULL"),
            jobs_held_by_dead_exhausted=("AND j.attempt >= $1", "AND j.attempt >= $1 + 100"))
    notes = await _expect_failure(dsn, QueueStateMachine, shrink=False)
    assert re.search(r"state\.(rescue|stale_writer)\(", notes), notes


@pytest.mark.slow
async def test_finds_a_sweep_that_takes_a_live_workers_job(
    dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The 60-minute rule applied to a job a heartbeating worker still holds."""
    live = ("  AND NOT EXISTS (SELECT 1 FROM nasiko_queue_workers AS w\n"
            "                  WHERE w.id = j.claimed_by AND w.dead_at IS NULL)", "")
    plant_sql(
        monkeypatch, nasiko_queue.builds.store,
        jobs_stuck_exhausted=live,
        jobs_reset_stuck=("AND NOT EXISTS (SELECT 1 FROM nasiko_queue_workers AS w  "
                          "-- as in jobs_stuck_exhausted\n" + " " * 22 +
                          "WHERE w.id = b.claimed_by AND w.dead_at IS NULL)", ""))
    await _expect_failure(dsn, QueueStateMachine, shrink=False)


class BlockingWakeQueue(Queue):
    """The original's bug: enqueue waits for room in the wake channel."""

    async def enqueue(self, payload: Any, **kwargs: Any) -> Any:
        saved, self._wakers = self._wakers, set()
        try:
            job_id = await super().enqueue(payload, **kwargs)
        finally:
            self._wakers = saved
        for wake in list(self._wakers):
            worker = getattr(wake, "__self__", None)
            if isinstance(worker, Worker):
                await worker._wake_send.send(None)  # bug: blocks when the channel is full
        return job_id


#: Seconds an enqueue of the blocking-wake machine may take: the wake blocks an
#: enqueue forever, and every shrink step that meets it waits this long.
ENQUEUE_TIMEOUT = 1.0


class _BlockingWake(QueueStateMachine):
    def make_queue(self, db: Database) -> Queue:
        return BlockingWakeQueue(db, config=self.config, secrets=self.env.secrets)

    async def _enqueue(self, *args: Any, **kwargs: Any) -> None:
        """
        Bounded tightly, where the planted wake blocks; the other rules keep the
        default rule timeout. A 1 s bound on every rule would make a drain slowed
        by CPU load a false hang, which the hunt would then shrink instead of the
        planted bug.
        """
        with trio.fail_after(ENQUEUE_TIMEOUT):
            await super()._enqueue(*args, **kwargs)


@pytest.mark.slow
async def test_finds_a_wake_that_blocks(dsn: str) -> None:
    notes = await _expect_failure(dsn, _BlockingWake)
    assert "state.enqueue_burst()" in notes


# -- folded build-row writes (issue #13) ----------------------------------------------
# Every other job of the machine's scripted executors reports through its context
# (`ScriptedWorld.via_ctx`), so the folded path meets every rule; each mutant breaks
# that path alone.

_FINISHES = ("jobs_finish_reported_and_claim", "jobs_finish_reported_and_claim_kinds")


def _in_both_finishes(monkeypatch: pytest.MonkeyPatch, old: str, new: str) -> None:
    plant_sql(monkeypatch, nasiko_queue.builds.store, **dict.fromkeys(_FINISHES, (old, new)))


@pytest.mark.slow
async def test_finds_a_folded_report_that_is_ignored(
    dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The finish drops what the executor reported: its build row is read as it
    stands ('queued'), so a reported success ends failed and its row never says so."""
    _in_both_finishes(monkeypatch, "FROM input WHERE reported IN ('success', 'failed')",
                      "FROM input WHERE false AND reported IN ('success', 'failed')")
    notes = await _expect_failure(dsn, QueueStateMachine, shrink=False)
    assert re.search(r"state\.(enqueue|enqueue_burst|drain)", notes), notes


@pytest.mark.slow
async def test_finds_a_folded_report_written_without_its_jobs_finish(
    dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The build row is written whether or not the job's finish landed: a stale
    worker (its claim handed on) writes 'success' over a build another run owns."""
    tied = ("b.status IN ('queued', 'building')\n"
            "      AND EXISTS (SELECT 1 FROM finished AS f "
            "WHERE f.build_id = r.build_id AND f.folded)")
    _in_both_finishes(monkeypatch, tied, "b.status IN ('queued', 'building')")
    notes = await _expect_failure(dsn, QueueStateMachine, shrink=False)
    assert "state.stale_writer(" in notes, notes


class _ConnectorsOnly(QueueStateMachine):
    """The machine with McpServerUpload jobs alone: the default examples run few
    connector jobs through an executor, and a connector build row lives in a table
    of its own."""

    kinds = ("McpServerUpload",)


@pytest.mark.slow
async def test_the_connector_machine_passes_on_the_real_engine(dsn: str) -> None:
    """The control of the mutant below."""
    await run_queue_state_machine(dsn, _ConnectorsOnly)


@pytest.mark.slow
async def test_finds_a_folded_report_written_for_the_wrong_build(
    dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A connector's report is written for the wrong build (the flag that says which
    table holds its build row is read the wrong way round, so it looks for an agent
    build): the job ends done while its connector build stays 'pending'."""
    _in_both_finishes(
        monkeypatch,
        "    WHERE b.id = r.build_id AND r.is_connector AND b.status IN ('pending', 'building')",
        "    WHERE b.id = r.build_id AND NOT r.is_connector "
        "AND b.status IN ('pending', 'building')")
    await _expect_failure(dsn, _ConnectorsOnly, shrink=False)


# -- issue #24: a mutant for each kind of case the build machines steer at ----------


@pytest.mark.slow
async def test_finds_a_terminalization_that_fails_a_running_agent(
    dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The original's terminalization: every agent with a successful build becomes
    'failed', also one running on a sibling job's build (docs/rules.md §6 keeps it)."""
    plant_sql(monkeypatch, nasiko_queue.builds.terminalize, agent_mark_failed=(
        "WHERE id = $1 AND status = 'deploying'", "WHERE id = $1"))
    notes = await _expect_failure(dsn, SteeredQueueStateMachine, shrink=False)
    assert "state.target_with_several_jobs(" in notes, notes


@pytest.mark.slow
async def test_finds_a_folded_report_that_overrides_a_settled_build_row(
    dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The finish takes what the executor reported through its context even when it
    had already written its build row 'success' or 'failed' (which stays): the job
    ends as the report says, its build row says the other."""
    _in_both_finishes(monkeypatch,
                      "THEN (SELECT CASE WHEN l.status IN ('success', 'failed') THEN l.status",
                      "THEN (SELECT CASE WHEN false THEN l.status")
    notes = await _expect_failure(dsn, SteeredQueueStateMachine, shrink=False)
    assert "state.enqueue_both_ways(" in notes, notes


@pytest.mark.slow
async def test_finds_a_give_back_that_keeps_the_attempt(
    dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A job claimed ahead and given back at a stop keeps the attempt its claim
    counted: it never ran, yet it has one run fewer left (and a job given back
    often enough fails unrun). The steered machine stops a worker whose buffer
    holds prefetched jobs in every example that draws that step."""
    plant_sql(monkeypatch, nasiko_queue.builds.store, jobs_unclaim=(
        "attempt = j.attempt - 1", "attempt = j.attempt"))
    notes = await _expect_failure(dsn, SteeredQueueStateMachine, shrink=False)
    assert "state.stop_with_a_full_buffer(" in notes, notes
