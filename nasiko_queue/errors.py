"""
Every exception nasiko-queue raises on purpose.

Each class's docstring says when it is raised; the docstring is also its default
message, so most subclasses are just a docstring.
"""

from __future__ import annotations

from uuid import UUID

import asyncpg
import trio


class NasikoQueueError(Exception):
    """A nasiko-queue operation failed."""

    def __init__(self, message: str | None = None) -> None:
        super().__init__(message or (self.__doc__ or "").strip())


class InvalidPayload(NasikoQueueError, ValueError):
    """
    A job payload does not match any payload type.

    Raised when a payload is parsed (by the worker, which then fails that one job
    with 'invalid job payload') or when an application builds one by hand. The
    message names the field; it never repeats the field's value, which may be a
    secret.
    """


class PayloadTooLarge(NasikoQueueError, ValueError):
    """The encoded payload is larger than `QueueConfig.max_payload_bytes`; it was not enqueued."""


class SecretsNotConfigured(NasikoQueueError):
    """
    A payload carries secret values but no master key is configured.

    Give `Queue(..., secrets=SecretBox.from_base64(key))`, or set
    NASIKO_QUEUE_MASTER_KEY for the CLI. `nasiko-queue keygen` prints a new key.
    """


class SecretDecryptError(NasikoQueueError):
    """A sealed value did not decrypt: wrong master key, wrong owner, or damaged text."""


class MigrationError(NasikoQueueError):
    """The database schema could not be brought up to date."""


class CannotConnect(NasikoQueueError, ConnectionRefusedError):
    """
    PostgreSQL refused the connection: the message says where. Still a
    `ConnectionRefusedError`, so that it is an outage wherever one is handled (a
    worker waits for the server and tries again).
    """

    def __init__(self, message: str, errno: int | None = None) -> None:
        OSError.__init__(self, errno, message)

    def __str__(self) -> str:
        return str(self.strerror)


# asyncpg ships no types: its exception classes are Any to mypy.
class NotMigrated(NasikoQueueError, asyncpg.UndefinedTableError):  # type: ignore[misc]
    """
    A table of the queue is missing: the database has not been migrated (the
    message says how). Still asyncpg's `UndefinedTableError` (SQLSTATE 42P01).
    """


class ConfigurationError(NasikoQueueError, ValueError):
    """A setting is out of range or two settings contradict each other."""


class CannotListen(NasikoQueueError):
    """An HTTP service could not listen where it was told (a busy port, a foreign address)."""


class JobFailed(NasikoQueueError):
    """
    `Queue.result`: the job ended without a result: discarded (its attempts ran
    out, its payload or its result was refused) or cancelled. `error` is its last
    error, as the job row keeps it.
    """

    def __init__(self, job_id: UUID, state: str, error: str | None) -> None:
        said = f": {error}" if error and error != state else ""
        super().__init__(f"job {job_id} was {state}{said}")
        self.job_id = job_id
        self.state = state
        self.error = error


class NoSuchJob(NasikoQueueError, LookupError):
    """`Queue.result`: no plain job has this id (never enqueued, or deleted by retention)."""


class RunFailed(NasikoQueueError):
    """
    `Queue.run_result`: the workflow run ended without a result: failed (a step
    was discarded, a signal timed out, a child failed) or cancelled. `step` is
    the step that failed (None for a cancel), `error` its error.
    """

    def __init__(self, run_id: UUID, state: str, step: str | None, error: str | None) -> None:
        at = f" at step {step}" if step else ""
        said = f": {error}" if error and error != state else ""
        super().__init__(f"run {run_id} {state}{at}{said}")
        self.run_id = run_id
        self.state = state
        self.step = step
        self.error = error


class NoSuchRun(NasikoQueueError, LookupError):
    """`Queue.run_result`: no workflow run has this id."""


class ResultTimeout(NasikoQueueError, TimeoutError):
    """`Queue.result`: the job had not ended when the timeout passed (it goes on)."""


class OutcomeUnknown(NasikoQueueError):
    """
    A statement went out and its answer did not come back in time (or its
    connection broke while it was on its way): it may or may not have committed.

    Raised by the bounded operations of the worker's own statements
    (`Database.run_bounded`). `backend_pid` names the server process that
    received it, so that the caller can make sure that process has gone (and
    with it the statement: committed or rolled back, but no longer on its way)
    before it looks at what the statement did.
    """

    def __init__(self, message: str | None = None, *, backend_pid: int | None = None) -> None:
        super().__init__(message)
        self.backend_pid = backend_pid


class NotWithinTheStopsBound(NasikoQueueError):
    """
    A last write (a give-back, a lost claim's resolution, the last finishes)
    stopped retrying through an outage: the worker is stopping and its bound
    (`cleanup_timeout` after the stop, and the try under way) has passed. Its
    jobs are left for the rescue, once the worker is gone.
    """


class FinalWriteRefused(NasikoQueueError):
    """
    A final write (a job's outcome) was refused on its merits, and so was
    every fallback given for it: retrying would not change the answer.

    Raised by `RetryPolicy.final`; `__cause__` is the last refusal. The caller
    logs it and goes on: the row stays as it was (a running job is given back
    by the rescue once its worker stops or dies).
    """

    def __init__(self, what: str, cause: BaseException) -> None:
        super().__init__(f"{what} update refused: {type(cause).__name__}: {cause}")
        self.what = what


# -- what is worth retrying ------------------------------------------------------------
#
# One list, used by the worker (final updates, claims), the recovery sweep and the
# CLI: an error either can pass by waiting (retry it, however long that takes) or
# never will (a trigger's RAISE, a constraint, a permission: retrying it forever
# would wedge the worker on one job, so the caller falls back).

#: SQLSTATE classes where every code is about the moment, not the statement:
#: 08 connection exception, 53 insufficient resources (disk full, out of memory,
#: too many connections), 57 operator intervention (shutdown, crash, query
#: cancelled, cannot connect now), 58 system error (I/O).
_TRANSIENT_CLASSES = frozenset({"08", "53", "57", "58"})
#: Codes of those classes that waiting will not fix.
_NEVER_TRANSIENT = frozenset({
    "57P04",  # database_dropped
    "58P01",  # undefined_file
    "58P02",  # duplicate_file
})
#: Single codes of other classes that pass by waiting.
_TRANSIENT_CODES = frozenset({
    "40001",  # serialization_failure: retry, as PostgreSQL asks
    "40P01",  # deadlock_detected: retry, as PostgreSQL asks
    "40003",  # statement_completion_unknown
    "55P03",  # lock_not_available: the application's lock_timeout, or NOWAIT
    "55006",  # object_in_use
    "25006",  # read_only_sql_transaction: a standby after a fail-over, until promoted
    "25P03",  # idle_in_transaction_session_timeout: the session is gone
    "25P04",  # transaction_timeout (PostgreSQL 17)
    "72000",  # snapshot_too_old
})

#: Client-side errors that mean the connection, not the statement, failed.
#: OSError covers ConnectionError and TimeoutError (asyncpg's timeouts);
#: InternalClientError is asyncpg's word for a connection left in a state it
#: cannot go on from. asyncpg's InterfaceError is both "the connection is gone"
#: (closed, released on a loss, a pool closing) and "you called me wrong"; the
#: second kind is told apart below (`_is_misuse`).
_CONNECTION_ERRORS = (OSError, asyncpg.InterfaceError, asyncpg.InternalClientError,
                      trio.TooSlowError, OutcomeUnknown)

#: InterfaceErrors that a retry on a new connection would meet again: a setting
#: or a feature the client or the server lacks, an authentication method the
#: client cannot do, and a statement sent with the wrong number of arguments
#: (code and SQL out of step). Taken for an outage,
#: such an error would be retried for ever, and a claim would be taken for a lost
#: one. (A value that cannot be encoded for its parameter raises asyncpg's
#: DataError, a PostgresError of SQLSTATE 22000: refused on the merits already.)
#: An operation begun while another is in progress on the same connection is
#: not here: a new connection cures it.
_MISUSE_ERRORS = (asyncpg.ClientConfigurationError, asyncpg.UnsupportedClientFeatureError,
                  asyncpg.UnsupportedServerFeatureError)
_MISUSE_MESSAGES = (
    "the server expects ", "the number of query arguments cannot exceed",
    # authentication the client cannot do: the server asks for it on every connect
    "unsupported authentication method", "unsupported SASL Authentication methods",
    "could not verify server signature", "gssapi module not found",
    "sspilib module not found",
)


def _is_misuse(exc: BaseException) -> bool:
    return isinstance(exc, _MISUSE_ERRORS) or (
        type(exc) is asyncpg.InterfaceError and str(exc).startswith(_MISUSE_MESSAGES))


def _is_lost_connection(exc: BaseException) -> bool:
    return isinstance(exc, _CONNECTION_ERRORS) and not _is_misuse(exc)


def sqlstate(exc: BaseException) -> str:
    """The SQLSTATE of a PostgreSQL error, or '' for anything else."""
    return str(getattr(exc, "sqlstate", "") or "") if isinstance(exc, asyncpg.PostgresError) \
        else ""


def is_connection_error(exc: BaseException) -> bool:
    """
    Whether `exc` says the database could not be reached or the connection
    broke (an outage), as opposed to the server refusing a statement.
    """
    if isinstance(exc, BaseExceptionGroup):
        return all(is_connection_error(e) for e in exc.exceptions)
    return _is_lost_connection(exc) or sqlstate(exc)[:2] == "08" or \
        sqlstate(exc) in ("57P01", "57P02", "57P03")


def is_transient(exc: BaseException) -> bool:
    """
    Whether a database operation that raised `exc` may succeed if tried again later.

    Transient: outages (refused or dropped connections, a server shutting down or
    starting, time-outs, an answer that never came), the rollbacks PostgreSQL asks
    clients to retry (deadlock, serialization failure), lock waits cut off by a
    `lock_timeout`, a read-only server after a fail-over, exhausted resources.
    Not transient: whatever the server rejects on its merits — a constraint, a
    trigger that raises, a permission, a missing table, bad SQL — which retrying
    forever would turn into a wedged worker.
    """
    if isinstance(exc, BaseExceptionGroup):
        return all(is_transient(e) for e in exc.exceptions)
    if _is_lost_connection(exc):
        return True
    code = sqlstate(exc)
    if not code or code in _NEVER_TRANSIENT:
        return False
    return code[:2] in _TRANSIENT_CLASSES or code in _TRANSIENT_CODES


def leaves(exc: BaseException) -> list[BaseException]:
    """The exceptions an exception group holds, however nested (or `exc` alone):
    what a nursery raised, for callers that ask "was it an interrupt / a refused
    bind / an outage?" of each."""
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for inner in exc.exceptions for leaf in leaves(inner)]
    return [exc]
