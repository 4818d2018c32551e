"""
The state machine finds real bugs: each test breaks the engine on purpose and
asserts that the machine fails, with a shrunk counterexample. A harness that
never fails proves nothing. (The control, the unbroken engine passing the
machine, is tests/test_statemachine.py.)
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import settings

import nasiko_queue.jobs
from nasiko_queue import Database, Queue, Worker, open_database
from nasiko_queue.jobs import ClaimedJob, JobStore, PgJobStore, RecoveryResult
from nasiko_queue.testing.machine import QueueStateMachine, profile, run_queue_state_machine

#: Enough examples to find each bug; Hypothesis stops at the first failure and shrinks it.
HUNT = settings(profile(), max_examples=100)


class _Mutant(QueueStateMachine):
    """A machine whose engine has one bug planted by `mutate_store` / `mutate_worker`."""

    store_class: type[PgJobStore] = PgJobStore
    worker_class: type[Worker] = Worker

    def make_store(self) -> JobStore:
        return self.store_class(self.env.db, self.config, runnable_kinds=self.executors.kinds,
                                known_kinds=self.known)

    def make_worker(self) -> Worker:
        return self.worker_class(self.queue, self.executors, store=self.make_store())


async def _expect_failure(dsn: str, machine: type[QueueStateMachine], *,
                          rule_timeout: float = 20.0) -> str:
    """Run the machine; it must fail. Returns the shrunk example Hypothesis reports."""
    async with open_database(dsn) as db:
        with pytest.raises(BaseException) as caught:  # noqa: PT011 (any failure counts)
            await run_queue_state_machine(db, machine, settings=HUNT,
                                          rule_timeout=rule_timeout)
    # Hypothesis may report several distinct bugs at once, as an exception group.
    failures = _leaves(caught.value)
    reports = ["\n".join(getattr(exc, "__notes__", [])) for exc in failures]
    for report in reports:
        assert "state." in report, f"no falsifying example reported: {failures!r}"
        steps = [line for line in report.splitlines() if line.startswith("state.")]
        assert 1 <= len(steps) <= 8, f"not shrunk to a short example:\n{report}"
    return "\n".join(reports)


def _leaves(exc: BaseException) -> list[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for inner in exc.exceptions for leaf in _leaves(inner)]
    return [exc]


class CapOffByOne(Worker):
    def _out_of_attempts(self, job: ClaimedJob) -> bool:
        return job.old_attempt > self.config.max_attempts  # bug: > instead of >=


class ResetKeepsPickedAt(PgJobStore):
    async def reset(self, job: ClaimedJob) -> bool:
        # bug: back to pending but picked_at kept
        return await self._db.fetchval(
            "UPDATE build_jobs SET status = 'pending' WHERE id = $1 AND attempt = $2 "
            "AND status = 'in_progress' RETURNING id", job.id, job.attempt) is not None


class SweepIgnoresAttempt(PgJobStore):
    async def recover(self) -> RecoveryResult:
        # bug: every stuck job goes back to pending, however many attempts it used
        rows = await self._db.fetch(
            "UPDATE build_jobs SET status = 'pending', picked_at = NULL "
            "WHERE status = 'in_progress' AND picked_at < now() - make_interval(mins => $1) "
            "RETURNING id", self._config.stuck_job_mins)
        return RecoveryResult(failed=0, reset=len(rows))


@pytest.mark.slow
async def test_finds_an_off_by_one_in_the_cap(dsn: str) -> None:
    notes = await _expect_failure(dsn, type("M", (_Mutant,), {"worker_class": CapOffByOne}))
    assert "state.enqueue(" in notes


@pytest.mark.slow
async def test_finds_a_panic_reset_that_keeps_picked_at(dsn: str) -> None:
    notes = await _expect_failure(dsn, type("M", (_Mutant,),
                                            {"store_class": ResetKeepsPickedAt}))
    assert re.search(r"state\.drain(_with_two_workers)?\(", notes), notes


@pytest.mark.slow
async def test_finds_a_sweep_that_ignores_attempt(dsn: str) -> None:
    notes = await _expect_failure(dsn, type("M", (_Mutant,),
                                            {"store_class": SweepIgnoresAttempt}))
    assert "state.poison_job()" in notes or "state.age_stuck_jobs()" in notes, notes


@pytest.mark.slow
async def test_finds_terminalization_that_forgets_connectors(
    dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    real: Callable[..., Any] = nasiko_queue.jobs.terminalize_target

    async def forgets_connectors(conn: Any, agent_id: Any, connector_id: Any,
                                 own_build_id: Any) -> Any:
        if agent_id is None:
            return None  # bug: connectors are never terminalized
        return await real(conn, agent_id, connector_id, own_build_id)

    monkeypatch.setattr(nasiko_queue.jobs, "terminalize_target", forgets_connectors)
    await _expect_failure(dsn, QueueStateMachine)


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


class _BlockingWake(QueueStateMachine):
    def make_queue(self, db: Database) -> Queue:
        return BlockingWakeQueue(db, config=self.config, secrets=self.env.secrets)


@pytest.mark.slow
async def test_finds_a_wake_that_blocks(dsn: str) -> None:
    notes = await _expect_failure(dsn, _BlockingWake, rule_timeout=1.0)
    assert "state.enqueue_burst()" in notes
