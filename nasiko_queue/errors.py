"""
Every exception nasiko-queue raises on purpose.

Each class's docstring says when it is raised; the docstring is also its default
message, so most subclasses are just a docstring.
"""

from __future__ import annotations

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


class ConfigurationError(NasikoQueueError, ValueError):
    """A setting is out of range or two settings contradict each other."""


#: PostgreSQL error classes that say "try again" rather than "this is wrong":
#: 08 connection, 40 transaction rollback (serialization, deadlock), 53
#: insufficient resources, 57 operator intervention (shutdown, cancel), 58 system.
_TRANSIENT_SQLSTATE_CLASSES = frozenset({"08", "40", "53", "57", "58"})


def is_transient(exc: BaseException) -> bool:
    """
    Whether a database operation that raised `exc` may succeed if tried again.

    Outages (refused or dropped connections, a server shutting down or starting,
    time-outs) and the rollbacks PostgreSQL asks clients to retry (deadlock,
    serialization failure) are transient. Anything the server rejects on its
    merits — a constraint, a trigger that raises, a missing table — is not:
    retrying it forever would wedge the worker on one job.
    """
    if isinstance(exc, BaseExceptionGroup):
        return all(is_transient(e) for e in exc.exceptions)
    if isinstance(exc, OSError | asyncpg.InterfaceError | asyncpg.InternalClientError
                  | trio.TooSlowError):
        # OSError covers TimeoutError and ConnectionError; InternalClientError is
        # asyncpg's word for a connection left in a state it cannot go on from.
        return True
    if isinstance(exc, asyncpg.PostgresError):
        return str(getattr(exc, "sqlstate", "") or "")[:2] in _TRANSIENT_SQLSTATE_CLASSES
    return False
