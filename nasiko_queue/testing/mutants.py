"""
Planting bugs in the engine, for tests that show a state machine finds them
(`nasiko_queue.testing.runner.expect_failure`).

A mutant that plants nothing passes every machine and proves nothing, so each
helper refuses a plant that would change nothing: the SQL fragment to replace
must stand in its statement exactly as often as said (once, by default), the
statement must be one the module sends, and a method or function must exist to
be swapped. Plants go through a patcher (pytest's ``monkeypatch``), which undoes
them after the test; a function a migration installs is replaced in the test's
own database (`plant_function`), with the same check.

.. versionadded:: 0.2.0
"""

from __future__ import annotations

import inspect
import re
from types import ModuleType
from typing import Any, Protocol

import attrs

from ..db.database import Database
from ..db.schema import SCHEMA
from ..db.statements import Queries

#: A replacement in one statement: (old, new), or (old, new, n) where `old`
#: stands n times (every one is replaced).
Edit = tuple[str, str] | tuple[str, str, int]


class Patcher(Protocol):
    """Sets an attribute until the test ends (pytest's ``monkeypatch``)."""

    def setattr(self, target: Any, name: Any, value: Any = ..., raising: bool = ...) -> None: ...


def mutated(queries: Queries, **edits: Edit) -> Queries:
    """`queries` with text replaced in the named statements (each must apply as said)."""
    fields = {}
    for name, edit in edits.items():
        old, new, times = edit if len(edit) == 3 else (*edit, 1)
        text = getattr(queries, name)
        found = text.count(old)
        if found != times:
            raise AssertionError(f"{name} contains {old!r} {found} time(s), not {times}: "
                                 "update the mutant")
        fields[name] = text.replace(old, new)
    return attrs.evolve(queries, **fields)


def plant_sql(patch: Patcher, module: ModuleType, **edits: Edit) -> None:
    """
    Replace the statements `module` sends (its ``Q``) by mutants: for example
    ``plant_sql(monkeypatch, nasiko_queue.plain_jobs, plain_retry=("attempt >= max_attempts",
    "attempt > max_attempts", 4))``. Every statement named must be one the module uses.
    """
    queries = getattr(module, "Q", None)
    if not isinstance(queries, Queries):
        raise AssertionError(f"{module.__name__} has no statements (Q) to mutate")
    source = inspect.getsource(module)
    unused = [name for name in edits if not re.search(rf"\bQ\.{name}\b", source)]
    if unused:
        raise AssertionError(f"{module.__name__} does not send {unused}: plant them where "
                             "they are sent")
    patch.setattr(module, "Q", mutated(queries, **edits))


def swap(patch: Patcher, owner: type | ModuleType, name: str, replacement: Any) -> None:
    """
    Replace the method (of a class) or function (of a module) `name` by
    `replacement`, which has its signature (a method's takes ``self`` first).
    """
    current = getattr(owner, name, None)
    if not callable(current):
        raise AssertionError(f"{owner.__name__}.{name} is no method or function to swap")
    patch.setattr(owner, name, replacement)


#: The definition of the one function of that name in the queue's schema $2
#: (migrations install each once).
FUNCTION_DEF = """
SELECT pg_get_functiondef(p.oid) FROM pg_proc AS p
JOIN pg_namespace AS n ON n.oid = p.pronamespace
WHERE p.proname = $1 AND n.nspname = $2
"""


async def plant_function(db: Database, function: str, *edits: Edit) -> None:
    """
    Replace the PL/pgSQL (or SQL) function `function` of `db` by a mutant: its
    installed definition (as the server returns it) with each edit applied, each
    of whose fragments must stand in it exactly as often as said (once, by
    default). For the rules migrations install as functions (migration 0018's
    transitions): the test's database is its own, so nothing needs undoing.
    """
    rows = await db.fetch(FUNCTION_DEF, function, SCHEMA)
    if len(rows) != 1:
        raise AssertionError(f"{len(rows)} function(s) named {function}: update the mutant")
    text: str = rows[0][0]
    for edit in edits:
        old, new, times = edit if len(edit) == 3 else (*edit, 1)
        found = text.count(old)
        if found != times:
            raise AssertionError(f"{function} contains {old!r} {found} time(s), not {times}: "
                                 "update the mutant")
        text = text.replace(old, new)
    await db.execute(text)
