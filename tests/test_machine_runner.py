"""
The machine runner's report of a found bug (`nasiko_queue.testing.runner`).

A planted bug that opens a race fails the machine on some interleavings only;
when the failing example passes on Hypothesis's final replay, Hypothesis raises a
`FlakyFailure` and puts the example's steps on it rather than on the error the
first run raised. The runner must still report the bug as found, with its steps.
"""

from __future__ import annotations

import logging

import pytest
import trio
from hypothesis import Phase, settings
from hypothesis.errors import Flaky
from hypothesis.stateful import rule

from nasiko_queue.testing.runner import DatabaseMachine, expect_failure, profile, run_machine


class FailsOnce(DatabaseMachine):
    """A machine whose one rule fails the first time any example calls it."""

    calls = 0

    @rule()
    def count(self) -> None:
        type(self).calls += 1
        assert type(self).calls > 1, "the first call fails, as a race that opened once"


async def test_a_bug_that_fails_once_is_reported_with_its_steps(dsn: str) -> None:
    FailsOnce.calls = 0
    hunt = settings(profile(), max_examples=5, stateful_step_count=3,
                    phases=[Phase.explicit, Phase.generate])
    found = await expect_failure(dsn, FailsOnce, settings=hunt)
    assert not found.replayed
    assert found.steps, found.reports
    assert all(steps for steps in found.steps), found.reports
    assert all("count" in step for steps in found.steps for step in steps)


class FailsEarlierOnReplay(DatabaseMachine):
    """
    A machine whose check fails at the second step of the first example that has
    two, then at the first step of the next example (Hypothesis's replay of the
    failing one): a replay that fails earlier than the first run, as a race the
    planted bug opens fails at another step each time (seen in CI: the
    workflow machine's diamond mutant).
    """

    failures = 0

    def __init__(self) -> None:
        super().__init__()
        self.steps = 0

    @rule()
    def count(self) -> None:
        self.steps += 1
        cls = FailsEarlierOnReplay  # not type(self): the runner binds a subclass
        if (cls.failures == 0 and self.steps == 2) or cls.failures == 1:
            cls.failures += 1
            raise AssertionError("the model and the engine disagree")


async def test_a_bug_whose_replay_fails_earlier_is_reported_from_the_machines_record(
        dsn: str) -> None:
    # Hypothesis then raises FlakyStrategyDefinition ("the second run stopped
    # drawing earlier") with no example and no trace of the AssertionError; the
    # hunt used to fail with "no falsifying example reported".
    FailsEarlierOnReplay.failures = 0
    hunt = settings(profile(), max_examples=10, stateful_step_count=3,
                    phases=[Phase.explicit, Phase.generate])
    found = await expect_failure(dsn, FailsEarlierOnReplay, settings=hunt)
    assert FailsEarlierOnReplay.failures == 2
    assert not found.replayed
    assert isinstance(found.error, AssertionError), found.error
    assert found.steps == (("count",),), found.reports
    assert "failed in count" in found.reports[0], found.reports
    assert "the model and the engine disagree" in found.reports[0], found.reports


async def test_a_flaky_run_carries_the_machines_record_of_its_failures(dsn: str) -> None:
    FailsEarlierOnReplay.failures = 0
    hunt = settings(profile(), max_examples=10, stateful_step_count=3,
                    phases=[Phase.explicit, Phase.generate])
    with pytest.raises(Flaky) as raised:
        await run_machine(dsn, FailsEarlierOnReplay, settings=hunt)
    notes = "\n".join(getattr(raised.value, "__notes__", []))
    assert "failed in count" in notes, notes
    assert "AssertionError: the model and the engine disagree" in notes, notes


class Hangs(DatabaseMachine):
    """A machine whose one rule never ends."""

    @rule()
    def hang(self) -> None:
        self._call(trio.sleep_forever)


async def test_a_step_past_the_rule_timeout_is_logged_with_its_name(
        dsn: str, caplog: pytest.LogCaptureFixture) -> None:
    # Seen under two CPU hogs: Hypothesis reported "inconsistent data generation"
    # and no error of the machine's; the log now names the step that overran.
    hunt = settings(profile(), max_examples=10, stateful_step_count=3,
                    phases=[Phase.explicit, Phase.generate])
    with (caplog.at_level(logging.WARNING, logger="nasiko_queue.testing"),
          pytest.raises(trio.TooSlowError)):
        await run_machine(dsn, Hangs, settings=hunt, rule_timeout=0.5)
    assert "machine step sleep_forever did not end within the rule timeout (0.5 s)" in (
        caplog.text)
