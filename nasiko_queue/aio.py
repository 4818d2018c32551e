"""
The asyncio client: enqueue, cancel and await results from an asyncio
application (FastAPI, aiohttp, ...) with its own asyncpg connection or pool.

No trio loop runs here: each call is one statement (or a few) on the asyncpg
connection the caller gives, so an enqueue made on a connection inside
``async with conn.transaction():`` commits or vanishes with the caller's own
rows, and its NOTIFY is sent only if it commits. Jobs are encoded by the codec
`Queue.enqueue` uses and inserted by the SQL function
`nasiko_queue.nasiko_queue_enqueue` (migration 0019; named with the queue's
schema, so the connection's search path need not know it), which applies
`Queue.enqueue`'s defaults and checks: one rule for every entry point. Plain jobs
only: a build job is enqueued with its target by `Queue.enqueue` (the function
refuses the build kinds).

Importing this module leaves asyncio as it was: no trio-asyncio loop or policy
is set up outside a trio run the library starts.

>>> job_id = await aio.enqueue(pool, SendEmail(to="a@example.com", subject="hi"))
>>> async with pool.acquire() as conn, conn.transaction():
...     await conn.execute("INSERT INTO orders ...")
...     await aio.enqueue(conn, SendEmail(...))     # commits with the order
>>> url = await aio.result(pool, job_id, timeout=30)
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from datetime import datetime, timedelta
from typing import Any, TypeAlias, TypeVar, overload
from uuid import UUID, uuid4

import asyncpg

from .builds.payloads import PayloadCodec
from .config import MAX_PAYLOAD_BYTES, NOTIFY_CHANNEL
from .db.database import CONFLICT_TRIES
from .db.statements import Q
from .errors import JobFailed, NoSuchJob, ResultTimeout
from .plain.args import Job, JobArgs, JobOptions, Unique
from .plain.enqueue_call import batch_json, enqueue_call, enqueue_calls, make_codec
from .plain.results import RESULTS_CHANNEL, decode_result
from .queue import CancelResult
from .secrets import SecretBox

__all__ = ["cancel", "enqueue", "enqueue_many", "result"]

T = TypeVar("T")

#: An asyncpg connection or pool (a pool runs each call on a connection of its own).
#: Any: asyncpg ships no type information.
AsyncpgConn: TypeAlias = Any


#: The codec of jobs without secrets, made once (a codec holds no state per call).
_NO_SECRETS = make_codec(None)


def _codec(secrets: SecretBox | None) -> PayloadCodec:
    return _NO_SECRETS if secrets is None else make_codec(secrets)


async def enqueue(
    conn: AsyncpgConn,
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
    Add plain job `args`; return its id (or, for a unique job whose key is held,
    the holder's). Arguments as for `Queue.enqueue`; `secrets` seals the job's
    secret fields (as `Queue(db, secrets=...)`).

    Raises:
        TypeError: `args` is not a `JobArgs`.
        InvalidPayload, PayloadTooLarge, ValueError, SecretsNotConfigured: as
            `Queue.enqueue`, before anything is sent.
        asyncpg.PostgresError: what the function refuses (SQLSTATE 22023, with
            its message), or the database's own errors.
    """
    call = enqueue_call(_codec(secrets), args, run_at=run_at, delay=delay, options=options,
                        unique=unique, max_payload_bytes=max_payload_bytes)
    job_id: UUID = await conn.fetchval(Q.enqueue_function, *call.params())
    return job_id


async def enqueue_many(
    conn: AsyncpgConn,
    jobs: Sequence[JobArgs | Job],
    *,
    secrets: SecretBox | None = None,
    max_payload_bytes: int = MAX_PAYLOAD_BYTES,
) -> list[UUID]:
    """
    Add plain jobs in one statement, all or none; their ids in the order given
    (a unique job whose key is held: the holder's). A `Job` carries what
    `enqueue` takes beside the job. A bad one raises naming its index (jobs[i]).
    """
    if not jobs:
        return []
    calls = enqueue_calls(_codec(secrets), jobs, max_payload_bytes=max_payload_bytes)
    ids: list[UUID] = await conn.fetchval(Q.enqueue_function_many, batch_json(calls))
    return ids


async def cancel(conn: AsyncpgConn, job_id: UUID) -> CancelResult | None:
    """Cancel a plain job, as `Queue.cancel` does (the rule is the database's,
    migration 0013); None when no plain job has this id.

    A workflow step's cancel locks its run, then (a child run's) the parent run,
    and may meet a parent's cancel locking them the other way round: PostgreSQL
    aborts one side. Run again, as the trio API runs it (up to
    `CONFLICT_TRIES` times), each try in a savepoint of the caller's
    transaction (or a transaction of its own), so that an abort leaves the
    caller's transaction usable; a cycle through rows the caller's transaction
    locked before this call raises after the last try (retry that transaction)."""
    answer: str | None = await _run_again_on_conflict(conn, Q.plain_cancel, job_id)
    return None if answer is None else CancelResult(answer)


async def _run_again_on_conflict(conn: AsyncpgConn, statement: str, *args: Any) -> Any:
    """`fetchval(statement, *args)`, run again when PostgreSQL aborted it for a
    deadlock or a serialization failure (`db.database.retry_conflicts`, on
    asyncio): each try in a savepoint, or a transaction of its own (on a pool,
    on a connection of its own)."""
    for attempt in range(1, CONFLICT_TRIES + 1):
        try:
            if isinstance(conn, asyncpg.Pool):
                async with conn.acquire() as held, held.transaction():
                    return await held.fetchval(statement, *args)
            async with conn.transaction():
                return await conn.fetchval(statement, *args)
        except (asyncpg.DeadlockDetectedError, asyncpg.SerializationError):
            if attempt == CONFLICT_TRIES:
                raise
            await asyncio.sleep(0.01 * 2 ** attempt)
    raise AssertionError("unreachable")


@overload
async def result(conn: AsyncpgConn, job_id: UUID, result_type: None = None, *,
                 timeout: float | None = None) -> Any: ...  # noqa: ASYNC109


@overload
async def result(conn: AsyncpgConn, job_id: UUID, result_type: type[T], *,
                 timeout: float | None = None) -> T: ...  # noqa: ASYNC109


async def result(conn: AsyncpgConn, job_id: UUID, result_type: type[Any] | None = None, *,
                 timeout: float | None = None) -> Any:  # noqa: ASYNC109
    """
    The result of plain job `job_id` once it has completed (None when its
    executor returned None), decoded as `result_type` when given; as
    `Queue.result`.

    It LISTENs for the job's end (the trigger of migration 0017 notifies once it
    ends, by whichever path), so a wait costs no polling. It needs a connection
    of its own while it waits: give a pool (it takes one for the wait), or a
    connection that is not inside a transaction (a NOTIFY is delivered between
    transactions only).

    A notification lost with its connection is not waited for: the wait reads
    the row again every `RESULT_POLL` seconds, and at once when its connection
    closes. Given a pool, it then goes on with another of its connections
    (after a pause that grows while none can be had, as in an outage); given a
    connection, it raises `ConnectionError`.

    Raises:
        JobFailed: it was discarded or cancelled (its last error attached).
        NoSuchJob: no plain job has this id (or it was deleted meanwhile).
        ResultTimeout: it had not ended within `timeout` seconds.
        ConnectionError: the connection given (not a pool) closed meanwhile.
    """
    pause = _RECONNECT_FIRST
    try:
        async with asyncio.timeout(timeout):
            while True:
                try:
                    async with _listening(conn) as (listener, ended):
                        return await _wait(listener, ended, job_id, result_type)
                except _CONNECTION_LOST as exc:
                    if not isinstance(conn, asyncpg.Pool) or conn.is_closing():
                        raise ConnectionError(f"the connection (or pool) closed while waiting "
                                              f"for job {job_id}'s result") from exc
                await asyncio.sleep(pause)  # then LISTEN and read again, on another
                pause = min(2 * pause, RESULT_POLL)
    except TimeoutError:
        raise ResultTimeout(f"job {job_id} had not ended after {timeout}s") from None


#: Seconds between reads of a waited job's row: a NOTIFY is lost with the
#: connection it was to arrive on (Queue.result's `poll_interval`, by default).
RESULT_POLL = 5.0
#: The first pause before a wait on a pool goes on with another connection.
_RECONNECT_FIRST = 0.05


class _ListenerClosed(Exception):
    """The waiting connection closed (asyncpg's termination callback)."""


#: What a wait meets when its connection is gone.
_CONNECTION_LOST = (_ListenerClosed, asyncpg.PostgresConnectionError, asyncpg.InterfaceError,
                    OSError)
#: Put in the queue of heard ids when the connection closes.
_CLOSED = ""


@contextlib.asynccontextmanager
async def _listening(conn: AsyncpgConn) -> AsyncIterator[tuple[asyncpg.Connection,
                                                             asyncio.Queue[str]]]:
    """A connection LISTENing on the results channel, and the ids it hears."""
    async with contextlib.AsyncExitStack() as stack:
        if isinstance(conn, asyncpg.Pool):
            listener = await stack.enter_async_context(conn.acquire())
        else:
            if conn.is_in_transaction():
                raise RuntimeError("aio.result waits on a connection outside any "
                                   "transaction (a NOTIFY arrives between transactions): "
                                   "give it the pool, or another connection")
            listener = conn
        ended: asyncio.Queue[str] = asyncio.Queue()

        def heard(_conn: object, _pid: int, _channel: str, payload: str) -> None:
            ended.put_nowait(payload)

        def closed(_conn: object) -> None:
            ended.put_nowait(_CLOSED)

        listener.add_termination_listener(closed)
        try:
            await listener.add_listener(RESULTS_CHANNEL, heard)
            try:
                yield listener, ended
            finally:
                with contextlib.suppress(asyncpg.InterfaceError, OSError):
                    await listener.remove_listener(RESULTS_CHANNEL, heard)
        finally:
            listener.remove_termination_listener(closed)


async def _wait(conn: asyncpg.Connection, ended: asyncio.Queue[str], job_id: UUID,
                result_type: type[Any] | None) -> Any:
    waiter = uuid4()
    try:
        while True:
            # Recorded (again: an end consumes it, and an operator may retry the job)
            # after LISTEN is up, and the row read FOR SHARE in the same statement:
            # an end in flight holds the row until it commits, so it is waited for,
            # not missed (as `Results.wait`).
            try:
                # NOTIFY_CHANNEL: `enqueue`'s (the SQL function's default); a
                # read that held the row while the job was due wakes its workers.
                row = await conn.fetchrow(Q.result_wait_and_read, job_id, waiter,
                                          NOTIFY_CHANNEL, timeout=RESULT_POLL)
            except TimeoutError as exc:
                # No answer: the read waits for the row's lock (a transaction
                # that holds it, ending or cancelling the job), or the peer is
                # gone without a word. A trivial query tells them apart.
                try:
                    await conn.fetchval(Q.health_ping, timeout=RESULT_POLL)
                except TimeoutError:
                    raise _ListenerClosed from exc
                continue  # alive: read again (asyncpg cancelled the read)
            if row is None:
                raise NoSuchJob(f"no plain job {job_id}")
            if row["state"] == "completed":
                return None if row["result"] is None else decode_result(row["result"],
                                                                       result_type)
            if row["state"] in ("discarded", "cancelled"):
                raise JobFailed(job_id, row["state"], row["error_msg"])
            # No word within RESULT_POLL: read the row again. A nested timeout,
            # not wait_for: on Python 3.11, wait_for drops a cancellation (the
            # caller's timeout) that comes as the queue answers.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(RESULT_POLL):
                    while (heard := await ended.get()) != str(job_id):
                        if heard == _CLOSED:
                            raise _ListenerClosed
    finally:
        # The job's end removes the wait too; this is for a wait given up.
        with contextlib.suppress(asyncpg.PostgresError, asyncpg.InterfaceError, OSError):
            await asyncio.shield(conn.execute(Q.result_wait_remove, job_id, waiter))
