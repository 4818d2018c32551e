"""The Hypothesis state machine on the real engine (issue #3)."""

from __future__ import annotations

from nasiko_queue.testing.machine import run_queue_state_machine


async def test_engine_matches_the_model(dsn: str) -> None:
    await run_queue_state_machine(dsn)
