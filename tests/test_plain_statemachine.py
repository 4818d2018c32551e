"""The Hypothesis state machine on plain jobs (issue #11): the engine against
`PlainModel`. The mutants it must find are in test_plain_statemachine_mutants.py."""

from __future__ import annotations

from nasiko_queue.testing.plain_machine import run_plain_state_machine


async def test_plain_jobs_match_the_model(dsn: str) -> None:
    await run_plain_state_machine(dsn)
