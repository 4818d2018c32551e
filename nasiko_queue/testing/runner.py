"""
What the state machines share: a machine bound to a database and to the test's
trio loop, the settings profiles, and a run that must fail (for mutation tests).

Hypothesis runs synchronously in a worker thread (`trio.to_thread`); each rule
calls back into the test's trio loop with `DatabaseMachine._call`
(`trio.from_thread.run`), so the database pool, the workers and their
nurseries all live in the test's own trio run (hypothesis-trio is dead;
trio-asyncpg-notes §4).

Settings profiles: ``nasiko-ci`` (the default: 50 examples of up to 30 steps,
derandomized so every run is the same) and ``nasiko-thorough`` (400 examples of
up to 50 steps, random); choose with NASIKO_QUEUE_HYPOTHESIS_PROFILE.

.. versionadded:: 0.2.0
"""

from __future__ import annotations

import inspect
import logging
import os
import sys
import traceback
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any, ClassVar, TypeVar

import attrs
import trio
from hypothesis import HealthCheck, settings
from hypothesis.errors import Flaky
from hypothesis.stateful import RuleBasedStateMachine, initialize, run_state_machine_as_test

from ..db.database import Database, open_database
from ..db.statements import Q
from ..errors import leaves
from ..secrets import SecretBox

T = TypeVar("T")

log = logging.getLogger("nasiko_queue.testing")

settings.register_profile(
    "nasiko-ci",
    max_examples=50,
    stateful_step_count=30,
    deadline=None,
    derandomize=True,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "nasiko-thorough",
    max_examples=400,
    stateful_step_count=50,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def profile() -> settings:
    """The settings profile chosen by NASIKO_QUEUE_HYPOTHESIS_PROFILE (default nasiko-ci)."""
    return settings.get_profile(os.environ.get("NASIKO_QUEUE_HYPOTHESIS_PROFILE", "nasiko-ci"))


@attrs.frozen
class StepFailure:
    """
    An exception raised in one of a machine's own methods (a rule, a check), as
    its example ended: the runner's record, kept whatever Hypothesis reports
    after. Why keep one: when the example's replay goes another way (a race the
    engine lost once, a step that overran under load), Hypothesis raises
    "inconsistent data generation" or "flaky" and the first error is gone.
    """

    #: The example it ended (1 is the first).
    example: int
    #: The machine's methods the traceback passes through, outermost first: the
    #: rule or check first, then the helpers it called.
    methods: tuple[str, ...]
    error: BaseException

    def describe(self) -> str:
        """The failure and its traceback, for a report."""
        where = " > ".join(self.methods)
        return (f"example {self.example} failed in {where}:\n"
                + "".join(traceback.format_exception(self.error)).rstrip())


@attrs.define
class MachineEnv:
    """What a machine needs from the trio side; set by `run_machine`."""

    db: Database
    #: Seconds one rule may take; a rule that blocks fails the example instead of hanging.
    rule_timeout: float
    #: The key for sealed payload fields.
    secrets: SecretBox
    #: Examples begun so far (each builds a machine).
    examples: int = 0
    #: The examples that ended in an exception of the machine's own, in order.
    failures: list[StepFailure] = attrs.Factory(list)


class DatabaseMachine(RuleBasedStateMachine):
    """
    A state machine on a database of its own: built only by `run_machine` (or a
    runner that calls it), which binds `env`; every example starts from empty
    tables.
    """

    _env: ClassVar[MachineEnv | None] = None
    #: The runner named in the error a machine built directly raises.
    runner: ClassVar[str] = "run_machine"

    def __init__(self) -> None:
        super().__init__()
        if self._env is None:
            raise RuntimeError(f"run the machine with {self.runner}(), which binds it to a "
                               "database and the test's trio loop")
        self.env: MachineEnv = self._env
        self.env.examples += 1

    def _call(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """Run `fn(*args)` in the test's trio loop, within the rule timeout."""

        async def bounded() -> T:
            with trio.fail_after(self.env.rule_timeout):
                return await fn(*args)

        try:
            return trio.from_thread.run(bounded)
        except trio.TooSlowError as exc:
            # Logged here because Hypothesis may not show it: when the example's
            # replay then fails earlier (a later step waiting on what this one
            # left), it reports inconsistent data generation instead.
            step = getattr(fn, "__qualname__", fn)
            log.warning("machine step %s did not end within the rule timeout (%.1f s)",
                        step, self.env.rule_timeout)
            exc.add_note(f"machine step {step} did not end within {self.env.rule_timeout} s: "
                         "most often an executor that never returned without saying so "
                         "(for Outcome.HANG, `await world.hang()`), or one that ran longer "
                         "than the step allows (run_queue_state_machine's rule_timeout)")
            raise

    @initialize()
    def start_empty(self) -> None:
        self._call(self.env.db.execute, Q.testing_empty_build_jobs)
        self._call(self.env.db.execute, Q.testing_empty_tables)

    def teardown(self) -> None:
        """
        Record the exception this example ends in, if one of the machine's
        methods raised it. Hypothesis calls `teardown` from a `finally` block,
        where `sys.exc_info()` is the exception on its way out (an exception
        some outer handler holds is told apart by its traceback, which does not
        pass through this machine). Subclasses call this.
        """
        raised = sys.exc_info()[1]
        methods = _raised_in(self, raised) if raised is not None else ()
        if raised is not None and methods:
            self.env.failures.append(StepFailure(self.env.examples, methods, raised))


def _raised_in(machine: DatabaseMachine, exc: BaseException) -> tuple[str, ...]:
    """The names of `machine`'s methods `exc`'s traceback passes through."""
    names = []
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_locals.get("self") is machine:
            names.append(tb.tb_frame.f_code.co_name)
        tb = tb.tb_next
    return tuple(names)


@asynccontextmanager
async def _bound(db_or_dsn: Database | str, rule_timeout: float,
                 secrets: SecretBox | None) -> AsyncIterator[MachineEnv]:
    async with _database(db_or_dsn) as db:
        yield MachineEnv(db=db, rule_timeout=rule_timeout,
                         secrets=secrets or SecretBox(b"t" * 32))


@asynccontextmanager
async def _database(db_or_dsn: Database | str) -> AsyncIterator[Database]:
    if isinstance(db_or_dsn, str):
        async with open_database(db_or_dsn) as db:
            yield db
    else:
        yield db_or_dsn


async def _run(env: MachineEnv, machine: type[DatabaseMachine], chosen: settings) -> None:
    # Hypothesis seeds a derandomized run from the machine class's source where it
    # finds it, else from its name. The bound class is made here, where no class
    # of its name is written, so a machine's examples follow its name alone: an
    # edit to the machine's code does not draw other examples.
    bound = type(machine.__name__, (machine,), {"_env": env})
    await trio.to_thread.run_sync(lambda: run_state_machine_as_test(bound, settings=chosen))


async def run_machine(
    db_or_dsn: Database | str,
    machine: type[DatabaseMachine],
    *,
    settings: settings,
    rule_timeout: float = 20.0,
    secrets: SecretBox | None = None,
) -> None:
    """
    Run `machine` against a migrated database, from a trio test.

    Args:
        db_or_dsn: an open `Database` or a DSN (the tables are emptied before
            every example: give it a database of its own).
        machine: the machine class.
        settings: Hypothesis settings.
        rule_timeout: seconds one rule may take.
        secrets: the key for sealed payload fields (a fixed test key by default).
    """
    async with _bound(db_or_dsn, rule_timeout, secrets) as env:
        try:
            await _run(env, machine, settings)
        except BaseException as exc:
            if _any_flaky(exc):
                _note_failures(exc, env)
            if isinstance(exc, Exception):
                # Hypothesis says to put the blob on "your test function"; here
                # that is the machine, which the runner builds its test from.
                exc.add_note(f"To replay this failure: put the @reproduce_failure(...) "
                             f"line printed above on the machine class "
                             f"({machine.__name__}), not on the test function.")
            raise


def _note_failures(exc: BaseException, env: MachineEnv) -> None:
    """Put the machine's own record of its failed examples on a flaky report."""
    if not env.failures:
        exc.add_note(f"(none of the {env.examples} examples failed in a method of the machine)")
    for failure in env.failures[:3]:
        exc.add_note(failure.describe())


@attrs.frozen
class Failure:
    """What a failing run of a machine reported."""

    error: BaseException
    #: One report a bug Hypothesis found (it may report several at once): the
    #: falsifying example's lines, its notes.
    reports: tuple[str, ...]
    #: For each report, its steps: the lines that call a rule (not set-up, checks
    #: or tear-down).
    steps: tuple[tuple[str, ...], ...]
    #: Examples begun before the run ended.
    examples: int
    #: Whether the failing example failed again when Hypothesis replayed it. A
    #: bug that opens a race fails on some interleavings only: Hypothesis then
    #: reports it as flaky, with the steps of the replay that passed.
    replayed: bool = True


async def expect_failure(
    db_or_dsn: Database | str,
    machine: type[DatabaseMachine],
    *,
    settings: settings,
    rule_timeout: float = 20.0,
    secrets: SecretBox | None = None,
) -> Failure:
    """
    Run `machine` as `run_machine` does; it must fail, with a falsifying example
    of at least one step in each report (AssertionError otherwise). For tests
    that plant a bug in the engine (`nasiko_queue.testing.mutants`): a harness
    that never fails proves nothing.
    """
    async with _bound(db_or_dsn, rule_timeout, secrets) as env:
        try:
            await _run(env, machine, settings)
        except BaseException as exc:  # any failure counts
            failure = _failure(exc, machine, env)
        else:
            raise AssertionError(f"{machine.__name__} passed {env.examples} examples: "
                                 "the planted bug was not found")
    return failure


def _failure(exc: BaseException, machine: type[DatabaseMachine], env: MachineEnv) -> Failure:
    found_leaves = leaves(exc)
    reports = tuple("\n".join(_notes(exc, leaf)) for leaf in found_leaves)
    rules = _rule_names(machine)
    steps = tuple(tuple(line for line in report.splitlines()
                        if line.startswith("state.") and line[6:].split("(")[0] in rules)
                  for report in reports)
    if all("state." in report and found for report, found in zip(reports, steps, strict=True)):
        return Failure(error=exc, reports=reports, steps=steps, examples=env.examples,
                       replayed=not _any_flaky(exc))
    # No example reported: Hypothesis's replay went another way and it raised
    # "flaky" or "inconsistent data generation" instead. The bug counts as found
    # when the machine's own record shows a check of its failing (an
    # AssertionError in a rule or an invariant): what a report would have shown.
    checks = rules | _invariant_names(machine)
    seen = [f for f in env.failures
            if isinstance(f.error, AssertionError) and f.methods[0] in checks]
    if _any_flaky(exc) and seen:
        first = seen[0]
        return Failure(error=first.error, reports=(first.describe(),),
                       steps=((first.methods[0],),), examples=env.examples, replayed=False)
    recorded = "\n".join(f.describe() for f in env.failures[:3]) or "(none)"
    for report, leaf, found in zip(reports, found_leaves, steps, strict=True):
        assert "state." in report, (f"no falsifying example reported: {leaf!r}; "
                                    f"the machine's failed examples:\n{recorded}")
        assert found, f"no step in the example:\n{report}"
    raise AssertionError(f"unreachable: {exc!r}")  # pragma: no cover


def _notes(exc: BaseException, leaf: BaseException) -> list[str]:
    """
    The notes on `leaf` and on every group that holds it, outermost first.

    Why the groups: when the failing example does not fail again on Hypothesis's
    final replay (a race the planted bug opens only on some interleavings),
    Hypothesis raises a `FlakyFailure` holding the first run's exception, which
    carries no notes, and puts the replayed example's steps on the group.
    """
    if exc is leaf:
        return list(getattr(leaf, "__notes__", []))
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            if any(found is leaf for found in leaves(inner)):
                return list(getattr(exc, "__notes__", [])) + _notes(inner, leaf)
    return []


def _any_flaky(exc: BaseException) -> bool:
    """Whether Hypothesis reported `exc` (or a group within it) as flaky."""
    if isinstance(exc, Flaky):
        return True
    return isinstance(exc, BaseExceptionGroup) and any(_any_flaky(e) for e in exc.exceptions)


def _invariant_names(machine: type[DatabaseMachine]) -> frozenset[str]:
    """The names of `machine`'s invariants (its checks after every step)."""
    return frozenset(name for name, member in inspect.getmembers(machine)
                     if getattr(member, "hypothesis_stateful_invariant", None) is not None)


def _rule_names(machine: type[DatabaseMachine]) -> frozenset[str]:
    """
    The names of `machine`'s rules, and of its own initializers (one that acts on
    the engine, as the workflow machine's starts and drains runs: a step), not
    `DatabaseMachine.start_empty` (emptying the tables) nor its invariants.
    """
    return frozenset(
        name for name, member in inspect.getmembers(machine)
        if getattr(member, "hypothesis_stateful_rule", None) is not None
        or (getattr(member, "hypothesis_stateful_initialize_rule", None) is not None
            and member is not DatabaseMachine.start_empty))
