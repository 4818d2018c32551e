"""
One job as an operator sees it: its row, its payload with secrets masked, and
the error of every crashed attempt (`nasiko-queue job ID`). The job may be a
build job, a plain job, or the kept copy of a failed build job that was deleted
with its target (docs/rules.md §6): the dead-letter queue shows all three.

The payload is shown as stored, except the values of every secret field of its
payload type (sealed or, with `seal_agent_env=False`, plaintext) and any sealed
token elsewhere, which are masked: an operator's terminal is not the place for
them, and nothing here needs the master key.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from typing import Any
from uuid import UUID

import attrs

from ..builds.payloads import BUILTIN_PAYLOAD_TYPES, Payload, _sealed_fields
from ..db.database import Database
from ..db.statements import Q
from ..job_errors import MASK, JobError, job_errors, plain_json
from ..secrets import is_sealed_token


@attrs.frozen(kw_only=True)
class JobView:
    """
    A job row, its masked payload and its kept errors.

    `status` is the row's own word (a build job's `failed`, a plain job's
    `discarded`); `state` is the listing's (`nasiko_queue.job_admin`), the same
    for every table. A plain job's own words for `picked_at` and `completed_at`
    are `attempted_at` (when its last attempt was claimed) and `finished_at`;
    `shown()` and `to_json()` speak each job's words.
    """

    id: UUID
    kind: str | None
    status: str
    attempt: int
    error_msg: str | None
    agent_id: UUID | None
    connector_id: UUID | None
    #: None for a plain job (they have no owner).
    owner_id: UUID | None
    created_at: datetime
    picked_at: datetime | None
    completed_at: datetime | None
    claimed_by: UUID | None
    #: The payload as stored, secrets masked; None when it is not JSON at all.
    payload: Any
    errors: tuple[JobError, ...]
    #: Which table: "build", "plain", or "deleted_build" (a failed build job's
    #: kept copy; its target was deleted, `deleted_at` says when).
    source: str = "build"
    queue: str = "builds"
    state: str = ""
    target_deleted: bool = False
    deleted_at: datetime | None = None
    #: Plain jobs only.
    max_attempts: int | None = None
    run_at: datetime | None = None
    priority: int | None = None
    #: What its executor returned (issue #22), sealed tokens masked; None: none.
    result: Any = None
    #: A workflow step's job: its run (issue #22); None for any other job.
    workflow_run: UUID | None = None

    @property
    def attempted_at(self) -> datetime | None:
        """When its last attempt was claimed (a build job's `picked_at`)."""
        return self.picked_at

    @property
    def finished_at(self) -> datetime | None:
        """When it ended (a build job's `completed_at`)."""
        return self.completed_at

    def shown(self) -> list[tuple[str, Any]]:
        """The fields `nasiko-queue job` shows, in the job's own words, in order."""
        names = PLAIN_FIELDS if self.source == "plain" else BUILD_FIELDS
        return [(name, getattr(self, name)) for name in names]

    def to_json(self) -> dict[str, Any]:
        if self.source == "plain":
            view = {name: plain_json(value) for name, value in self.shown()}
            view["status"] = self.status
            view["id"] = plain_json(self.id)
            view["payload"] = self.payload
            view["result"] = self.result
            view["workflow_run"] = plain_json(self.workflow_run)
        else:
            view = {f.name: plain_json(getattr(self, f.name)) for f in attrs.fields(JobView)
                    if f.name != "errors"}
        view["errors"] = [e.to_json() for e in self.errors]
        return view


#: A plain job's fields as `nasiko-queue job` shows them.
PLAIN_FIELDS = ("source", "queue", "kind", "state", "priority", "attempt", "max_attempts",
                "error_msg", "created_at", "run_at", "attempted_at", "finished_at",
                "claimed_by")
#: A build job's (or a kept copy's) fields, in its table's words.
BUILD_FIELDS = ("source", "queue", "kind", "status", "attempt", "error_msg", "agent_id",
                "connector_id", "owner_id", "created_at", "picked_at", "completed_at",
                "claimed_by")


def mask_payload(payload: Any, types: tuple[type[Payload], ...] = BUILTIN_PAYLOAD_TYPES) -> Any:
    """The payload with its secret fields' values and every sealed token masked."""
    secret_fields: set[str] = set()
    if isinstance(payload, Mapping):
        for cls in types:
            if cls.kind == payload.get("kind"):
                secret_fields = {f.name for f in _sealed_fields(cls)}

    def mask(value: Any, secret: bool = False) -> Any:
        if isinstance(value, Mapping):
            return {k: mask(v, secret) for k, v in value.items()}
        if isinstance(value, list):
            return [mask(v, secret) for v in value]
        if isinstance(value, str) and (secret or is_sealed_token(value)):
            return MASK
        return value

    if not isinstance(payload, Mapping):
        return mask(payload)
    return {k: mask(v, k in secret_fields) for k, v in payload.items()}


#: A build job's status in the listing's words (`nasiko_queue.job_admin`).
BUILD_STATES = {"pending": "available", "in_progress": "running", "done": "completed",
                "failed": "discarded"}


def masked_json(text: str | None) -> Any:
    """
    Stored JSON text as an operator may see it: parsed, secret fields and sealed
    tokens masked (`mask_payload`); None for None or text that does not parse.
    What a job's payload and result go through, and a workflow run's input,
    result and step results (`admin.runs`).
    """
    try:
        return mask_payload(json.loads(text)) if text is not None else None
    except (ValueError, RecursionError):
        return None


_masked = masked_json


async def job_view(db: Database, job_id: UUID) -> JobView | None:
    """
    The job `job_id`, from whichever table holds it: build jobs, plain jobs, or
    the kept copies of failed build jobs deleted with their target. None when
    none does (its errors may remain).
    """
    row = await db.fetchrow(Q.job_show, job_id)
    if row is not None:
        return JobView(
            id=row["id"], kind=row["kind"], status=row["status"], attempt=row["attempt"],
            error_msg=row["error_msg"], agent_id=row["agent_id"],
            connector_id=row["connector_id"], owner_id=row["owner_id"],
            created_at=row["created_at"], picked_at=row["picked_at"],
            completed_at=row["completed_at"], claimed_by=row["claimed_by"],
            payload=_masked(row["payload"]), errors=tuple(await job_errors(db, job_id)),
            state=BUILD_STATES.get(row["status"], row["status"]))
    row = await db.fetchrow(Q.plain_get, job_id)
    if row is not None:
        return JobView(
            id=row["id"], kind=row["kind"], status=row["state"], attempt=row["attempt"],
            error_msg=row["error_msg"], agent_id=None, connector_id=None, owner_id=None,
            created_at=row["created_at"], picked_at=row["attempted_at"],
            completed_at=row["finished_at"], claimed_by=row["claimed_by"],
            payload=_masked(row["payload"]), errors=tuple(await job_errors(db, job_id)),
            source="plain", queue=row["queue"], state=row["state"],
            max_attempts=row["max_attempts"], run_at=row["run_at"], priority=row["priority"],
            result=_masked(row["result"]), workflow_run=row["workflow_run"])
    row = await db.fetchrow(Q.deleted_build_job_get, job_id)
    if row is not None:
        return JobView(
            id=row["id"], kind=row["kind"], status="failed", attempt=row["attempt"],
            error_msg=row["error_msg"], agent_id=row["agent_id"],
            connector_id=row["connector_id"], owner_id=row["owner_id"],
            created_at=row["created_at"], picked_at=row["picked_at"],
            completed_at=row["completed_at"], claimed_by=None,
            payload=_masked(row["payload"]), errors=tuple(await job_errors(db, job_id)),
            source="deleted_build", state="discarded", target_deleted=True,
            deleted_at=row["deleted_at"])
    return None
