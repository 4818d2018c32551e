"""
The state machine as users point it at their own executors (the README's
harness block runs in tests/test_readme.py); what a bug hunt of the harness
found a user's machine could get wrong without being told.
"""

from __future__ import annotations

import types
from collections import Counter
from typing import Any, ClassVar

import pytest
from hypothesis import settings

from nasiko_queue import Executors, JobContext
from nasiko_queue.testing import Outcome
from nasiko_queue.testing.machine import (
    QueueStateMachine,
    ScriptedWorld,
    run_queue_state_machine,
)
from nasiko_queue.testing.runner import profile

from .test_readme import _module


def _readme(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    """The README's harness block: its payload type, pipeline and machine."""
    return _module("harness", monkeypatch)


async def test_a_machine_whose_payloads_no_executor_runs_is_refused(
    dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """
    A machine that registers its own payload type but leaves `make_payload` as
    it is enqueued built-in Upload payloads that nothing ran: every example
    passed, the executor never called once.
    """
    readme = _readme(monkeypatch)

    class Forgetful(readme.MyMachine):  # type: ignore[misc,name-defined]
        make_payload = QueueStateMachine.make_payload

    with pytest.raises(TypeError, match=r"makes 'Upload' payloads for kind 'Upload'"):
        await run_queue_state_machine(dsn, Forgetful, settings=settings(profile(),
                                                                        max_examples=1))


async def test_a_machine_plays_only_the_outcomes_it_names(
    dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`outcomes = (SUCCEED, FAIL)` still had runs told to raise and to hang (the
    steps that script them ran regardless)."""
    readme = _readme(monkeypatch)
    told: Counter[Outcome] = Counter()

    class Gentle(readme.MyMachine):  # type: ignore[misc,name-defined]
        outcomes: ClassVar[tuple[Outcome, ...]] = (Outcome.SUCCEED, Outcome.FAIL)

        def make_executors(self, world: ScriptedWorld) -> Executors:
            begin = world.begin

            def counting(ctx: JobContext[Any]) -> Outcome:
                outcome = begin(ctx)
                told[outcome] += 1
                return outcome

            world.begin = counting  # type: ignore[method-assign]
            executors: Executors = super().make_executors(world)
            return executors

    await run_queue_state_machine(dsn, Gentle, settings=settings(profile(), max_examples=20))
    assert told[Outcome.SUCCEED] > 0
    assert set(told) <= {Outcome.SUCCEED, Outcome.FAIL}
