"""
Enqueue from synchronous code (Django, Flask, scripts) over any DB-API connection.

`enqueue(connection_or_cursor, job)` runs one
``SELECT nasiko_queue.nasiko_queue_enqueue(...)``
(migration 0019) on the caller's connection, so it is part of whatever
transaction that connection is in: inside Django's ``transaction.atomic()`` the
job commits with the view's rows or vanishes with them, and its NOTIFY (which
wakes the workers) is sent only on commit. The job is encoded by the codec
`Queue.enqueue` uses; the defaults and checks are the SQL function's, the same
as `Queue.enqueue`'s. Plain jobs only.

Drivers whose parameter style is ``format`` or ``pyformat`` (``%s``): psycopg 3,
psycopg2, Django's ``connection`` (which wraps one of them). No trio, no asyncio.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import datetime, timedelta
from typing import Any
from uuid import UUID

from .builds.payloads import PayloadCodec
from .config import MAX_PAYLOAD_BYTES
from .db.statements import Q
from .plain.args import Job, JobArgs, JobOptions, Unique
from .plain.enqueue_call import batch_json, enqueue_call, enqueue_calls, make_codec
from .secrets import SecretBox

__all__ = ["enqueue", "enqueue_many"]

_DOLLAR = re.compile(r"\$\d+")


def _format_style(statement: str) -> str:
    """A named statement with ``%s`` for each ``$n`` (each used once, in order),
    without its comments (drivers read ``%s`` in comments too)."""
    statement = "\n".join(line for line in statement.splitlines()
                          if not line.lstrip().startswith("--"))
    numbers = [int(m.group()[1:]) for m in _DOLLAR.finditer(statement)]
    if numbers != list(range(1, len(numbers) + 1)) or "%" in statement:
        raise ValueError("a statement for DB-API drivers uses $1..$n once each, in order")
    return _DOLLAR.sub("%s", statement)


_ENQUEUE = _format_style(Q.enqueue_function)
_ENQUEUE_MANY = _format_style(Q.enqueue_function_many_text)
_NO_SECRETS = make_codec(None)


def _codec(secrets: SecretBox | None) -> PayloadCodec:
    return _NO_SECRETS if secrets is None else make_codec(secrets)


@contextmanager
def _cursor(conn: Any) -> Iterator[Any]:
    """The cursor given, or a new one of the connection given (closed after). A
    connection is told by its `commit` (Django's cursor wrapper has a `cursor`)."""
    if not hasattr(conn, "commit"):
        yield conn
        return
    cursor = conn.cursor()
    try:
        yield cursor
    finally:
        cursor.close()


def _uuid(value: Any) -> UUID:
    return value if isinstance(value, UUID) else UUID(str(value))


def enqueue(
    conn: Any,
    args: JobArgs,
    *,
    run_at: datetime | None = None,
    delay: float | timedelta | None = None,
    options: JobOptions | None = None,
    unique: Unique | None = None,
    secrets: SecretBox | None = None,
    max_payload_bytes: int = MAX_PAYLOAD_BYTES,
) -> UUID:
    """
    Add plain job `args` on DB-API connection (or cursor) `conn`, in its current
    transaction; return its id (or, for a unique job whose key is held, the
    holder's). Arguments as for `Queue.enqueue`.

    Raises:
        TypeError, InvalidPayload, PayloadTooLarge, ValueError, SecretsNotConfigured:
            as `nasiko_queue.aio.enqueue`, before anything is sent.
        The driver's own error for what the SQL function refuses (SQLSTATE 22023).
    """
    call = enqueue_call(_codec(secrets), args, run_at=run_at, delay=delay, options=options,
                        unique=unique, max_payload_bytes=max_payload_bytes)
    with _cursor(conn) as cursor:
        cursor.execute(_ENQUEUE, call.params())
        (job_id,) = cursor.fetchone()
    return _uuid(job_id)


def enqueue_many(
    conn: Any,
    jobs: Sequence[JobArgs | Job],
    *,
    secrets: SecretBox | None = None,
    max_payload_bytes: int = MAX_PAYLOAD_BYTES,
) -> list[UUID]:
    """Add plain jobs in one statement, all or none; their ids in the order given."""
    if not jobs:
        return []
    calls = enqueue_calls(_codec(secrets), jobs, max_payload_bytes=max_payload_bytes)
    with _cursor(conn) as cursor:
        cursor.execute(_ENQUEUE_MANY, (batch_json(calls),))
        (ids,) = cursor.fetchone()
    return [_uuid(i) for i in ids]
