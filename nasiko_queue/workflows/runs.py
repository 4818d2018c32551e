"""
Runs: start, signal, cancel, retry, and a run's view. Each is one statement
calling a function of migration 0018, so each is one transaction that locks
the run's row: a cancel, a signal and a step's end never interleave.
"""

from __future__ import annotations

import enum
import json
from datetime import datetime
from typing import Any
from uuid import UUID, uuid4

import attrs

from ..builds.payloads import converter
from ..db.database import Database, Transaction, retry_conflicts
from ..db.statements import Q
from ..errors import InvalidPayload
from .definition import Workflow

__all__ = ["RunView", "SignalResult", "StepView", "start_run"]


class SignalResult(enum.StrEnum):
    """What `Queue.signal` did."""

    #: Its step was waiting: it completed with the payload.
    DELIVERED = "delivered"
    #: Its step does not wait yet: kept, and consumed when it does.
    KEPT = "kept"
    #: A signal of this name was sent to the run before: refused (delivered once).
    ALREADY_SENT = "already sent"
    #: The run's workflow has no signal step of this name: refused.
    NO_SUCH_SIGNAL = "no such signal"
    #: The run has ended: refused.
    RUN_COMPLETED = "run completed"
    RUN_FAILED = "run failed"
    RUN_CANCELLED = "run cancelled"


@attrs.frozen(kw_only=True)
class StepView:
    """One step row of a run: index 0 for a step that is not mapped; a mapped
    step's head (its state, and its items' results in order) at index -1, then
    one row per item at its index."""

    step: str
    index: int
    state: str
    result: Any
    error: str | None
    job_id: UUID | None
    child_run: UUID | None


@attrs.frozen(kw_only=True)
class RunView:
    """A run as its rows say now."""

    id: UUID
    workflow: str
    state: str
    input: Any
    result: Any
    failed_step: str | None
    error: str | None
    unique_key: str | None
    parent_run: UUID | None
    parent_step: str | None
    created_at: datetime
    finished_at: datetime | None
    steps: tuple[StepView, ...]

    def step(self, name: str) -> StepView:
        """The step `name`'s row (a mapped step's head)."""
        for s in self.steps:
            if s.step == name:
                return s
        raise KeyError(name)


def _json_text(what: str, value: Any) -> str:
    try:
        text = json.dumps(converter.unstructure(value), separators=(",", ":"),
                          allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise InvalidPayload(f"a workflow's {what} must be JSON: {exc}") from None
    if "\\u0000" in text.replace("\\\\", ""):
        raise InvalidPayload(f"a workflow's {what} holds a NUL character, which "
                             "PostgreSQL's jsonb cannot store")
    return text


async def start_run(db: Database | Transaction, wf: Workflow, input: Any, *,
                    unique: str | None = None, channel: str | None,
                    encoded: bool = False) -> UUID:
    """Start a run of `wf`; its id, or the id of the run holding `unique`."""
    if unique is not None and (not isinstance(unique, str) or not unique):
        raise ValueError(f"a unique key is a non-empty string, got {unique!r}")
    if wf.input_type is not None and input is not None and not encoded \
            and not isinstance(input, wf.input_type):
        raise InvalidPayload(f"{wf.name}'s input is a {wf.input_type.__name__}, not "
                             f"{type(input).__name__}")
    definition = json.dumps(wf.definition(channel), separators=(",", ":"))
    run_id: UUID = await db.fetchval(Q.workflow_start, uuid4(), wf.name, definition,
                                     _json_text("input", input), unique)
    return run_id


async def signal_run(db: Database, run_id: UUID, name: str, payload: Any) -> SignalResult | None:
    body = _json_text("signal payload", payload)
    answer: str | None = await retry_conflicts(
        lambda: db.fetchval(Q.workflow_signal, run_id, name, body))
    return None if answer is None else SignalResult(answer)


async def get_run(db: Database, run_id: UUID) -> RunView | None:
    row = await db.fetchrow(Q.workflow_get, run_id)
    if row is None:
        return None
    steps = await db.fetch(Q.workflow_get_steps, run_id)
    return RunView(
        id=row["id"], workflow=row["workflow"], state=row["state"],
        input=_loads(row["input"]), result=_loads(row["result"]),
        failed_step=row["failed_step"], error=row["error"], unique_key=row["unique_key"],
        parent_run=row["parent_run"], parent_step=row["parent_step"],
        created_at=row["created_at"], finished_at=row["finished_at"],
        steps=tuple(StepView(step=s["step"], index=s["idx"],
                             state=s["state"], result=_loads(s["result"]), error=s["error"],
                             job_id=s["job_id"], child_run=s["child_run"]) for s in steps))


def _loads(text: str | None) -> Any:
    return None if text is None else json.loads(text)
