"""
What an executor raised, kept per attempt (`nasiko_queue_job_errors`).

`build_jobs.error_msg` keeps the fixed messages of docs/rules.md (the original's
code reads them); the exception itself is kept here so that a failed job can be
understood: its type, its message and a bounded traceback, for every crashed or
timed-out attempt, with the worker that ran it. Secret values of the payload
(its `Secret` fields, such as `env`) are masked in the message and the
traceback before anything is stored or returned, as written and in their usual
escaped forms (`secret_forms`): an executor that puts a token in an exception
message does not write it to the database.
"""

from __future__ import annotations

import json
import re
import traceback as tb
from collections.abc import Iterable, Mapping
from datetime import datetime
from typing import Any
from urllib.parse import quote, quote_plus
from uuid import UUID

import attrs

from .db.database import Database
from .db.statements import Q
from .secrets import Secret

#: Longest message kept, in characters.
MAX_MESSAGE = 2_000
#: Longest traceback kept, in characters: its end, where the innermost frames
#: and the exception are.
MAX_TRACEBACK = 8_000
#: Secret values shorter than this are not masked (a one-letter value would
#: blank every such letter of the traceback); real secrets are longer.
MIN_MASKED = 4
MASK = "********"
#: What PostgreSQL text cannot hold in any database: the NUL character (refused
#: outright), and lone surrogates (a Python string may hold them; they have no
#: UTF-8 form, so the client cannot even send them). A database in a narrower
#: encoding than UTF-8 refuses more; the minimal outcome (`minimal_text`) is
#: plain ASCII for that.
_UNSTORABLE = re.compile("[\x00\ud800-\udfff]")


def storable(text: str) -> str:
    """
    `text` as PostgreSQL text can store it: a NUL becomes the four characters
    ``\\x00`` (visible, as Python would print it) and a lone surrogate U+FFFD.
    Every error text nasiko-queue stores passes through here, so that what an
    executor raised can never make the row's write fail.
    """
    if _UNSTORABLE.search(text) is None:  # the usual case: no copy
        return text
    return _UNSTORABLE.sub(lambda m: "\\x00" if m.group() == "\x00" else "\ufffd", text)


def minimal_text(text: str, limit: int = 200) -> str:
    """`text` as any database stores it: printable ASCII (others escaped), bounded;
    for an outcome written again after the database refused it."""
    escaped = "".join(c if " " <= c <= "~" else ascii(c)[1:-1] for c in text[:limit])
    return escaped if len(text) <= limit else escaped + "..."


@attrs.frozen(kw_only=True)
class JobError:
    """One crashed attempt's error."""

    attempt: int
    #: "crash" (the executor raised) or "timeout" (it ran past its limit).
    reason: str
    #: The exception's class, qualified by its module.
    error_type: str
    message: str
    traceback: str
    #: When it was kept, and by which worker (None outside a worker); set when read.
    at: datetime | None = None
    worker_id: UUID | None = None

    def to_json(self) -> dict[str, Any]:
        return {f.name: plain_json(getattr(self, f.name)) for f in attrs.fields(JobError)}


def one_line_error(error: JobError, limit: int = 500) -> str:
    """The error as one line, for a row's `error_msg`: "Type: message", bounded."""
    name = error.error_type.rpartition(".")[2] or error.error_type
    first = error.message.splitlines()[0] if error.message else ""
    line = storable(f"{name}: {first}" if first else name)
    return line if len(line) <= limit else line[:limit] + "…"


def plain_json(value: Any) -> Any:
    """A JSON-ready value: ids and times as text."""
    return str(value) if isinstance(value, UUID | datetime) else value


def secret_values(payload: object) -> list[str]:
    """Every `Secret` value a payload holds (in fields or maps of them), to mask."""
    found: list[str] = []
    kind = type(payload)
    if not attrs.has(kind):
        return found
    for field in attrs.fields(kind):
        value = getattr(payload, field.name)
        values: Iterable[object] = value.values() if isinstance(value, Mapping) else (value,)
        found.extend(v.reveal() for v in values if isinstance(v, Secret))
    return found


def secret_forms(secret: str) -> set[str]:
    """
    The ways `secret` can appear in an exception's text: as it is, and as the
    usual escapes write it: `repr` or `ascii` (an f-string's ``{token!r}``, a
    container's repr), JSON (a request body in an HTTP error) and URL encoding
    (a query string). An executor that wrote ``{token!r}`` of a value holding a
    quote or a backslash left its escaped form in plain sight.
    """
    forms = {secret, repr(secret)[1:-1], ascii(secret)[1:-1], repr(secret.encode())[2:-1],
             json.dumps(secret)[1:-1], json.dumps(secret, ensure_ascii=False)[1:-1],
             quote(secret, safe=""), quote_plus(secret)}
    return {form for form in forms if form}


def describe(exc: BaseException, *, attempt: int, reason: str,
             secrets: Iterable[str] = ()) -> JobError:
    """
    The error to keep for `exc`. An exception group from the executor's nursery
    that holds one exception is described by that one (what the executor raised).
    """
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    masked = sorted({form for s in secrets for form in secret_forms(s) if len(form) >= MIN_MASKED},
                    key=len, reverse=True)

    def mask(text: str) -> str:
        for secret in masked:
            text = text.replace(secret, MASK)
        return text

    message = storable(mask(str(exc)))
    trace = storable(mask("".join(tb.format_exception(exc))))
    if len(message) > MAX_MESSAGE:
        message = message[:MAX_MESSAGE] + f"… ({len(message) - MAX_MESSAGE} characters cut)"
    if len(trace) > MAX_TRACEBACK:
        trace = f"… ({len(trace) - MAX_TRACEBACK} characters cut)\n" + trace[-MAX_TRACEBACK:]
    kind = type(exc)
    return JobError(attempt=attempt, reason=reason,
                    error_type=storable(f"{kind.__module__}.{kind.__qualname__}"),
                    message=message, traceback=trace)


async def job_errors(db: Database, job_id: UUID) -> list[JobError]:
    """Every error kept for a job, oldest first (also after the job row is gone)."""
    rows = await db.fetch(Q.job_errors_of, job_id)
    return [JobError(attempt=r["attempt"], reason=r["reason"], error_type=r["error_type"],
                     message=r["message"], traceback=r["traceback"], at=r["at"],
                     worker_id=r["worker_id"]) for r in rows]
