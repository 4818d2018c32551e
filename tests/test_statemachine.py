"""The Hypothesis state machine on the real engine (issue #3)."""

from __future__ import annotations

import attrs

from nasiko_queue.testing.machine import (
    HARNESS_CONFIG,
    QueueStateMachine,
    SteeredQueueStateMachine,
    run_queue_state_machine,
)


async def test_engine_matches_the_model(dsn: str) -> None:
    await run_queue_state_machine(dsn)


class ConcurrentMachine(QueueStateMachine):
    """Issue #5's options switched on: three executors per worker (batched claims,
    batched finishes), two jobs prefetched, and LISTEN/NOTIFY wakes."""

    config = attrs.evolve(HARNESS_CONFIG, concurrency=3, prefetch=2, listen=True)


async def test_engine_matches_the_model_with_three_executors_per_worker(dsn: str) -> None:
    await run_queue_state_machine(dsn, ConcurrentMachine)


class PrefetchMachine(QueueStateMachine):
    """One executor with three jobs prefetched: hangs and graceful stops mid-run
    stay in, so every stop gives back a buffer the model says was never claimed."""

    config = attrs.evolve(HARNESS_CONFIG, prefetch=3, listen=True)


async def test_engine_matches_the_model_with_prefetch(dsn: str) -> None:
    await run_queue_state_machine(dsn, PrefetchMachine)


async def test_engine_matches_the_model_in_steered_cases(dsn: str) -> None:
    """Issue #24's cases: a target's job failing for good beside a sibling that
    succeeded, executors that write their build row and report through ctx."""
    await run_queue_state_machine(dsn, SteeredQueueStateMachine)
