"""
One job as an operator sees it: its row, its payload with secrets masked, and
the error of every crashed attempt (`nasiko-queue job ID`).

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

from ._sql import Q
from .database import Database
from .job_errors import MASK, JobError, job_errors, plain_json
from .payloads import BUILTIN_PAYLOAD_TYPES, Payload, _sealed_fields
from .secrets import is_sealed_token


@attrs.frozen(kw_only=True)
class JobView:
    """A job row, its masked payload and its kept errors."""

    id: UUID
    kind: str | None
    status: str
    attempt: int
    error_msg: str | None
    agent_id: UUID | None
    connector_id: UUID | None
    owner_id: UUID
    created_at: datetime
    picked_at: datetime | None
    completed_at: datetime | None
    claimed_by: UUID | None
    #: The payload as stored, secrets masked; None when it is not JSON at all.
    payload: Any
    errors: tuple[JobError, ...]

    def to_json(self) -> dict[str, Any]:
        view = {f.name: plain_json(getattr(self, f.name)) for f in attrs.fields(JobView)
                if f.name != "errors"}
        view["errors"] = [e.to_json() for e in self.errors]
        return view


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


async def job_view(db: Database, job_id: UUID) -> JobView | None:
    """The job `job_id`, or None when its row is gone (its errors may remain)."""
    row = await db.fetchrow(Q.job_show, job_id)
    if row is None:
        return None
    try:
        payload = mask_payload(json.loads(row["payload"]))
    except (ValueError, RecursionError):
        payload = None
    return JobView(
        id=row["id"], kind=row["kind"], status=row["status"], attempt=row["attempt"],
        error_msg=row["error_msg"], agent_id=row["agent_id"], connector_id=row["connector_id"],
        owner_id=row["owner_id"], created_at=row["created_at"], picked_at=row["picked_at"],
        completed_at=row["completed_at"], claimed_by=row["claimed_by"], payload=payload,
        errors=tuple(await job_errors(db, job_id)))
