"""
The queue handle applications hold: enqueue, and waking in-process workers.

Enqueue inserts the job row (inside the caller's transaction when one is given,
so the target rows, the build row and the job commit or vanish together) and
wakes the worker after commit: in-process workers directly, every other worker
(any process, any replica) through a NOTIFY sent in the inserting transaction,
once per transaction. The wake is fire-and-forget (docs/rules.md §4): a full
wake channel already guarantees a drain, so a wake that does not fit is dropped,
and enqueue never waits for a worker.
"""

from __future__ import annotations

import enum
import json
import math
import os
from collections.abc import Awaitable, Callable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from datetime import datetime, timedelta
from functools import partial
from typing import Any, TypeVar, overload
from uuid import UUID, uuid4

import asyncpg
import attrs
import trio

from .builds.payloads import BUILTIN_PAYLOAD_TYPES, MAX_KIND_LENGTH, Payload, PayloadCodec
from .config import QueueConfig
from .db.database import Database, Transaction, retry_conflicts
from .db.statements import Q
from .errors import InvalidPayload, PayloadTooLarge, ResultTimeout, leaves
from .payload_size import stored_size
from .plain.args import Job, JobArgs, JobOptions, Unique, check_run_at, delay_seconds
from .plain.limits import PartitionMode, QueueLimit, Rate
from .plain.limits import clear_limit as clear_queue_limit
from .plain.limits import limits as queue_limits
from .plain.limits import set_limit as set_queue_limit
from .plain.results import Results, open_results
from .secrets import SecretBox
from .workflows.definition import Workflow
from .workflows.runs import RunView, SignalResult

T = TypeVar("T")

# -- enqueue (issue #13) --
#: Rows of one statement of `enqueue_many`: a batch of more goes in several
#: statements of one transaction, so that no call builds one giant statement
#: (its arrays are held whole by the client and the server while it runs).
ENQUEUE_MANY_CHUNK = 2_000
#: Rows of the first statement of a batch sent a chunk ahead (`_insert_pipelined`):
#: nothing overlaps the encoding of the first chunk but the server's warm-up, so
#: a smaller one starts the inserts sooner (issue #25: the first batch on a
#: connection, 5,000 jobs, 98-122 ms before, 84-88 ms with this and the warm-up).
FIRST_CHUNK = 1_000

#: Inserts a unique enqueue tries while the job holding its key keeps ending
#: between the insert and the look-up of its id.
UNIQUE_TRIES = 5


class CancelResult(enum.StrEnum):
    """
    What `Queue.cancel` did. A `str` enum: each member equals (and prints as) the
    string `cancel` answered before it was an enum, so ``== "cancelling"`` and
    f-strings keep working.
    """

    #: The job was waiting (or scheduled): it ended `cancelled` now and never runs.
    CANCELLED = "cancelled"
    #: The job was running: its worker was asked to stop it (at its next
    #: heartbeat); the run ends `cancelled`, unless it had already returned.
    CANCELLING = "cancelling"
    #: The job had already ended; nothing changed.
    ALREADY_COMPLETED = "already completed"
    ALREADY_DISCARDED = "already discarded"
    ALREADY_CANCELLED = "already cancelled"


async def cancel_plain_job(db: Database, job_id: UUID) -> CancelResult | None:
    """The one cancel (`Queue.cancel`, `admin.jobs.cancel`): None for an id that is
    no plain job. A workflow step's cancel locks its run, then the parent run,
    and may meet a parent's retry or cancel locking them the other way round:
    run again if the server aborted it for that."""
    answer: str | None = await retry_conflicts(lambda: db.fetchval(Q.plain_cancel, job_id))
    return None if answer is None else CancelResult(answer)


class Queue:
    """
    One job queue: a database, its configuration, and the key that seals secrets.

    Args:
        db: from `open_database()`.
        config: the constants of docs/rules.md §3 and the worker's knobs.
        secrets: seals the secret fields of payloads (the `env` of
            McpServerUpload, and of Upload, Clone and GithubClone unless
            `config.seal_agent_env` is off) at enqueue and opens them for the
            executor. Required only when a payload carries secrets.
    """

    def __init__(
        self,
        db: Database,
        *,
        config: QueueConfig | None = None,
        secrets: SecretBox | None = None,
    ) -> None:
        self.db = db
        self.config = config or QueueConfig()
        self.secrets = secrets
        self._codec = PayloadCodec(secrets=secrets, seal_compat_fields=self.config.seal_agent_env)
        self._wakers: set[Callable[[], None]] = set()

    async def enqueue(
        self,
        payload: Payload | JobArgs,
        *,
        tx: Transaction | None = None,
        owner_id: UUID | None = None,
        run_at: datetime | None = None,
        delay: float | timedelta | None = None,
        options: JobOptions | None = None,
        unique: Unique | None = None,
    ) -> UUID:
        """
        Add a job; return its id.

        Args:
            payload: a build `Payload` (built-in or registered by the
                application), or a plain job's `JobArgs`.
            tx: a transaction from `db.transaction()`. The job is inserted in it
                and the worker is woken only once it commits; if it rolls back,
                the job never existed.
            owner_id: build jobs: `build_jobs.owner_id`. Defaults to the
                payload's own owner (the caller for Update and Rollback);
                required for payloads that carry none (StandaloneBuild).
            run_at, delay: plain jobs: not claimable before this time (aware
                datetime), or before this many seconds from now on the
                database's clock. A worker running the queue wakes when it is due.
            options: plain jobs: the queue, priority, attempts and uniqueness,
                instead of the type's `options`.
            unique: plain jobs: enqueue only if no job holds this key in one of
                its states; else insert nothing and return that job's id.

        Raises:
            PayloadTooLarge: the encoded payload exceeds `max_payload_bytes`.
            SecretsNotConfigured: the payload has values to seal (a non-empty
                `env`) and no key was given.
            InvalidPayload: with `seal_agent_env` off, an env value that would
                read back as a sealed one.
            ValueError: no owner could be determined; a schedule, options or a
                unique key for a build job; a naive `run_at`.
            TypeError: `payload` is neither a `JobArgs` nor a build `Payload`.
        """
        if isinstance(payload, JobArgs):
            return await self._enqueue_plain(payload, tx, run_at, delay, options, unique)
        if not isinstance(payload, Payload):  # the annotation is not checked at run time
            raise _not_a_job(payload)
        if run_at is not None or delay is not None or options is not None or unique is not None:
            raise ValueError(
                f"{payload.kind} is a build job: it runs as soon as a worker is free, in the "
                "order enqueued, in build_jobs (which the original worker's claim shares, and "
                "would take a scheduled row at once); run_at, delay, options and unique are "
                "for plain jobs (JobArgs)")
        job_id: UUID = await self._insert(Q.job_insert, Q.job_insert_notify,
                                          self._row(payload, owner_id), tx)
        return job_id

    async def _enqueue_plain(self, args: JobArgs, tx: Transaction | None,
                             run_at: datetime | None, delay: float | timedelta | None,
                             options: JobOptions | None, unique: Unique | None) -> UUID:
        opts = options or type(args).options
        unique = unique_of(args, opts, unique)
        job_id, _inserted = await self._insert_plain(
            self._plain_row(args, opts, run_at, delay), unique, tx)
        return job_id

    async def enqueue_json(
        self,
        kind: str,
        args: Mapping[str, Any],
        *,
        tx: Transaction | None = None,
        run_at: datetime | None = None,
        delay: float | timedelta | None = None,
        options: JobOptions | None = None,
        unique: Unique | None = None,
    ) -> UUID:
        """
        Add a plain job of `kind` whose arguments are the JSON object `args`,
        without its `JobArgs` type (it need not be importable here: the worker
        that runs `kind` decodes it); return its id. The row is what `enqueue`
        writes for a job of that kind with those fields: ``{"kind": kind,
        **args}``. Nothing is sealed (no type says which fields are secret).
        `nasiko-queue enqueue` calls it. Arguments as for `enqueue`; `options`
        defaults to `JobOptions()` (queue "default").

        Raises:
            InvalidPayload: a kind that is empty, too long or a build job's; `args`
                not a JSON object, or naming another kind.
            PayloadTooLarge, ValueError: as `enqueue`.
        """
        job_id, _inserted = await self._enqueue_json(kind, args, tx=tx, run_at=run_at,
                                                     delay=delay, options=options,
                                                     unique=unique)
        return job_id

    async def _enqueue_json(
        self, kind: str, args: Mapping[str, Any], *, tx: Transaction | None = None,
        run_at: datetime | None = None, delay: float | timedelta | None = None,
        options: JobOptions | None = None, unique: Unique | None = None,
    ) -> tuple[UUID, bool]:
        """`enqueue_json`, and whether it inserted (False: a unique key's holder)."""
        text = plain_json_payload(kind, args)
        opts = options or JobOptions()
        return await self._insert_plain(
            self._plain_columns(kind, self._checked_size(kind, text), opts, run_at, delay),
            unique, tx)

    async def _insert_plain(self, columns: tuple[object, ...], unique: Unique | None,
                            tx: Transaction | None) -> tuple[UUID, bool]:
        """Insert a plain job; its id and True, or a unique key's holder and False."""
        job_id = uuid4()
        row = (job_id, *columns,
               None if unique is None else unique.key,
               None if unique is None else sorted(unique.states))
        # A unique job that meets its key inserts nothing: return the holder's id.
        # Between the two statements the holder may end; then insert again.
        for _ in range(UNIQUE_TRIES):
            inserted = await self._insert(Q.plain_insert, Q.plain_insert_notify, row, tx)
            if inserted is not None:
                return job_id, True
            assert unique is not None
            holder = await (tx or self.db).fetchval(Q.plain_unique_holder, unique.key)
            if holder is not None:
                holder_id: UUID = holder
                return holder_id, False
        raise RuntimeError(f"unique key {row[-2]!r}: the job holding it kept changing; "
                           f"tried {UNIQUE_TRIES} times")

    def _plain_row(self, args: JobArgs, opts: JobOptions, run_at: datetime | None,
                   delay: float | timedelta | None) -> tuple[object, ...]:
        """A plain job's queue, kind, payload, priority, attempts, run_at and delay."""
        return self._plain_columns(args.kind, self._encoded(args), opts, run_at, delay)

    def _plain_columns(self, kind: str, text: str, opts: JobOptions, run_at: datetime | None,
                       delay: float | timedelta | None) -> tuple[object, ...]:
        if run_at is not None and delay is not None:
            raise ValueError("give run_at or delay, not both")
        check_run_at(run_at)
        seconds = delay_seconds(delay) or 0.0
        return (opts.queue, kind, text, opts.priority, opts.max_attempts, run_at, seconds)

    def _encoded(self, payload: Payload | JobArgs) -> str:
        return self._checked_size(payload.kind, self._codec.dumps(payload))

    def _checked_size(self, kind: str, text: str) -> str:
        # Counted as the claim counts it (the stored jsonb's text), so that a
        # payload accepted here is never discarded there as over the limit.
        size = stored_size(text, limit=self.config.max_payload_bytes)
        if size > self.config.max_payload_bytes:
            raise PayloadTooLarge(
                f"{kind} payload is {size} bytes; the limit is "
                f"{self.config.max_payload_bytes} (QueueConfig.max_payload_bytes)"
            )
        return text

    async def cancel(self, job_id: UUID) -> CancelResult | None:
        """
        Cancel a plain job. The cancel locks the job's row, then decides on the
        state it holds then (a claim or a run's end in flight is waited for, never
        missed): a waiting (or scheduled) job ends `cancelled` at once and never
        runs; a running one is asked to stop: the worker that runs it cancels its
        executor at its next heartbeat (within `heartbeat_interval`) and the job
        ends `cancelled` (or as its run ended, if it returned first). Returns
        `CancelResult.CANCELLED`, `CANCELLING`, or `ALREADY_<STATE>` for a job
        that had already ended (nothing changes), or None: no plain job has this
        id. A `str` enum: ``== "cancelling"`` still works.

        Build jobs cannot be cancelled (docs/rules.md has no such state: their
        targets' rules decide how they end); their ids return None.
        """
        return await cancel_plain_job(self.db, job_id)

    # -- limits across replicas (issue #23) --

    async def set_limit(self, queue: str, *, concurrency: int | None = None,
                        rate: Rate | None = None, partition_by: str | None = None,
                        partition_mode: PartitionMode | str = PartitionMode.NONE
                        ) -> QueueLimit:
        """
        Limit the plain-job queue `queue` across every worker, at once and
        without a deploy: at most `concurrency` of its jobs running, at most
        `rate` starts per period (per `partition_by` key when given), claims
        shared between keys by `partition_mode`. Replaces the queue's limits;
        workers are woken so that a raised limit is used at once. Applies on
        top of each worker's own `QueueConfig.queues`.
        """
        limit = QueueLimit(queue=queue, concurrency=concurrency, rate=rate,
                           partition_by=partition_by, partition_mode=partition_mode)
        await set_queue_limit(self.db, limit)
        await self._notify_workers()
        return limit

    async def clear_limit(self, queue: str) -> bool:
        """The queue unlimited again (its per-worker slots still apply); False if
        it had no limits."""
        cleared = await clear_queue_limit(self.db, queue)
        if cleared:
            await self._notify_workers()
        return cleared

    async def limits(self) -> list[QueueLimit]:
        """Every limited queue, with its running jobs and starts in the window now."""
        return await queue_limits(self.db)

    async def _notify_workers(self) -> None:
        if self.config.notify_channel is not None:
            await self.db.execute(Q.queue_notify, self.config.notify_channel)

    # -- workflows (issue #22) --
    async def start(self, workflow: Workflow, input: Any = None, *,
                    unique: str | None = None, tx: Transaction | None = None) -> UUID:
        """
        Start a run of `workflow` with `input` (of its `input_type`, or JSON);
        return the run's id. Its first steps are enqueued in the same
        transaction (`tx`, when given: the run exists only if it commits).
        `unique`: at most one run ever has this key; a second start inserts
        nothing and returns the first run's id.

        Raises:
            InvalidPayload: the input is not JSON, or not the workflow's type.
        """
        from .workflows.runs import start_run

        run_id = await start_run(tx or self.db, workflow, input, unique=unique,
                                 channel=self.config.notify_channel)
        if tx is None:
            self.wake()
        else:
            tx.call_after_commit(self.wake)
        return run_id

    async def signal(self, run_id: UUID, name: str, payload: Any = None) -> SignalResult | None:
        """
        Send signal `name` with `payload` (JSON) to run `run_id`: delivered once.
        Returns `SignalResult.DELIVERED` (its step waited and completed with the
        payload), `KEPT` (its step waits later and gets it then), `ALREADY_SENT`,
        `NO_SUCH_SIGNAL` or `RUN_<STATE>` (refused, nothing changed), or None: no
        such run.
        """
        from .workflows.runs import signal_run

        answer = await signal_run(self.db, run_id, name, payload)
        self.wake()
        return answer

    async def run(self, run_id: UUID) -> RunView | None:
        """A run's state, result, failed step and error, and each step's row; None:
        no such run."""
        from .workflows.runs import get_run

        return await get_run(self.db, run_id)

    async def run_result(self, run_id: UUID, result_type: type[Any] | None = None, *,
                         timeout: float | None = None) -> Any:  # noqa: ASYNC109
        """
        Wait for run `run_id` to end and return its result (the result of the
        step nothing depends on; several such steps: an object of their results
        by name), structured as `result_type` when given. Woken by NOTIFY, as
        `result` is.

        Raises:
            RunFailed: the run failed or was cancelled (`.step`, `.error`).
            NoSuchRun: no run has this id.
            ResultTimeout: it had not ended within `timeout` seconds.
        """
        with trio.move_on_after(math.inf if timeout is None else timeout):  # as `result`
            async with self.results() as results:
                return await results.wait_run(run_id, result_type=result_type)
        raise ResultTimeout(f"run {run_id} had not ended after {timeout}s")

    async def cancel_run(self, run_id: UUID) -> str | None:
        """Cancel a running run: its waiting steps are cancelled, its running steps'
        jobs asked to stop (their ends change nothing), none starts; its child runs
        are cancelled. 'cancelled', 'already <state>', or None: no such run."""
        answer: str | None = await retry_conflicts(
            lambda: self.db.fetchval(Q.workflow_cancel, run_id))
        return answer

    async def retry_run(self, run_id: UUID) -> str | None:
        """Run a failed (or cancelled) run again: its failed, cancelled and
        never-started steps go back to waiting for their dependencies, completed
        steps keep their results, and child runs are resumed (retried, or waited
        for), not started anew. 'retried', 'not failed: <state>', 'still stopping:
        <steps>' (a step asked to stop still runs: nothing changed; retry once it
        has ended), or None."""
        answer: str | None = await retry_conflicts(
            lambda: self.db.fetchval(Q.workflow_retry, run_id))
        self.wake()
        return answer

    # -- results (issue #22) --
    @overload
    async def result(self, job_id: UUID, result_type: None = None, *,
                     timeout: float | None = None) -> Any: ...  # noqa: ASYNC109

    @overload
    async def result(self, job_id: UUID, result_type: type[T], *,
                     timeout: float | None = None) -> T: ...  # noqa: ASYNC109

    # ASYNC109: a `timeout` argument rather than only trio's `fail_after`, so that
    # asyncio callers (`nasiko_queue.aio`) get the same call, and its expiry raises
    # `ResultTimeout` (the job goes on) rather than a bare `trio.TooSlowError`.
    async def result(self, job_id: UUID, result_type: type[Any] | None = None, *,
                     timeout: float | None = None) -> Any:  # noqa: ASYNC109
        """
        Wait for plain job `job_id` to end and return what its executor returned
        (None if it returned nothing): parsed JSON, or structured as
        `result_type` (an attrs class, say) by the wire format's converter.
        Woken by NOTIFY when the job ends, from any worker; it reads the job's
        row only then (or every `poll_interval` while LISTEN is down). Opens one
        LISTEN connection for the call; to wait for many jobs, share one
        with `results()`.

        Raises:
            JobFailed: the job was discarded or cancelled; `.error` is its last error.
            NoSuchJob: no plain job has this id (or retention deleted it).
            ResultTimeout: it had not ended within `timeout` seconds (None: no limit).
        """
        # The timeout covers the LISTEN connection's opening too: in an outage
        # that alone can take `connect_timeout`.
        with trio.move_on_after(math.inf if timeout is None else timeout):
            async with self.results() as results:
                return await results.wait(job_id, result_type=result_type)
        raise ResultTimeout(f"job {job_id} had not ended after {timeout}s")

    def results(self) -> AbstractAsyncContextManager[Results]:
        """
        One LISTEN connection for many waits: ``async with queue.results() as r:``
        then ``await r.wait(job_id, timeout=..., result_type=...)`` from any
        number of tasks (as `result`).
        """
        return open_results(self.db, self.config)

    async def enqueue_many(
        self,
        payloads: Sequence[Payload | JobArgs | Job],
        *,
        tx: Transaction | None = None,
        owner_id: UUID | None = None,
    ) -> list[UUID]:
        """
        Add many jobs; return their ids, in the order given.

        A batch goes in statements of at most `ENQUEUE_MANY_CHUNK` (2,000) rows,
        all in one transaction: the caller's `tx`, or one of its own when there is
        more than one statement. A bad payload refuses the whole batch (its index
        is in the message) and nothing is enqueued. With `tx`, or up to 2,000
        payloads, every payload is encoded and checked before anything is sent;
        a larger batch without `tx` is encoded a chunk ahead, in a worker thread,
        while the server inserts the chunk before (the trio loop stays free), and
        a bad payload rolls back the chunks already sent. The jobs are claimed in
        the order given (within a queue and a priority, for plain jobs). One
        NOTIFY per transaction, as for `enqueue`; with `tx`, they commit or
        vanish with it. Build payloads and plain jobs may be mixed (statements
        for each). A bare `JobArgs` takes its type's `options`; wrap it in a
        `Job` to give it what `enqueue` takes: ``Job(args, options=...,
        run_at=..., delay=..., unique=...)``. Unique jobs (a `unique=`, their
        options' or their type's `unique_key()`) go in the batch's statements,
        in order: one whose key is held (by an earlier job, or by one earlier in
        the same batch) inserts nothing and its place in the answer holds the
        holder's id, as `enqueue` returns it.

        Args:
            payloads: build `Payload`s, plain `JobArgs` and `Job`s, of any mix
                of kinds.
            tx: as for `enqueue`.
            owner_id: the owner of every build payload that names none of its own.

        Raises:
            As `enqueue`, for the first payload that fails, with its index.
        """
        batch = _Batch(self, payloads, owner_id)
        if tx is not None or len(payloads) <= ENQUEUE_MANY_CHUNK:
            holders = await self._insert_statements(batch.all(), tx)
        else:
            holders = await self._insert_pipelined(batch)
        ids = batch.ids
        for index, holder in holders.items():
            ids[index] = holder
        return ids

    # -- enqueue (issue #13) --
    async def _insert_statements(self, statements: list[_Statement],
                                 tx: Transaction | None) -> dict[int, UUID]:
        """
        Encoded statements, in order. Without `tx`, all of them cross to asyncio
        at once, on a kept connection: one statement (with no unique job) commits
        by itself; several run in one transaction of their own, begun and
        committed in that crossing. Returns the holders of the unique jobs that
        inserted nothing, by their index in the batch.
        """
        holders: dict[int, UUID] = {}
        if not statements:
            return holders
        if tx is not None:
            # The first NOTIFYs (once per transaction) and wakes after commit, as
            # one `enqueue` does; the others only insert.
            first, *rest = statements
            inserted = await self._insert(*first[:3], tx)
            holders.update(await _unique_holders(first, inserted, tx.fetchval))
            for statement in rest:
                inserted = await tx.fetchval(statement[0], *statement[2])
                holders.update(await _unique_holders(statement, inserted, tx.fetchval))
            return holders
        channel = self.config.notify_channel

        async def insert(conn: asyncpg.Connection) -> None:
            # The first statement NOTIFYs: once per transaction, sent at its commit.
            for index, statement in enumerate(statements):
                quiet, notifying, columns, _uniques = statement
                if index == 0 and channel is not None:
                    inserted = await conn.fetchval(notifying, *columns, channel)
                else:
                    inserted = await conn.fetchval(quiet, *columns)
                holders.update(await _unique_holders(statement, inserted, conn.fetchval))

        async def insert_all(conn: asyncpg.Connection) -> None:
            if len(statements) == 1 and not statements[0][3]:
                await insert(conn)
                return
            # Not `async with conn.transaction()`: when the connection is lost
            # mid-batch, its exit raises "cannot call Transaction.__aexit__()"
            # over the error that says what happened (issue #24).
            transaction = conn.transaction()
            await transaction.start()
            try:
                await insert(conn)
            except BaseException:
                if not conn.is_closed():
                    await transaction.rollback()
                raise
            await transaction.commit()

        await self.db.run_kept(insert_all)
        self.wake()
        return holders

    async def _insert_pipelined(self, batch: _Batch) -> dict[int, UUID]:
        """
        A large batch in a transaction of its own, each chunk encoded (in a worker
        thread) while the server inserts the one before: the client's encoding
        and the server's inserts overlap instead of taking turns. The first
        chunk is smaller (`FIRST_CHUNK`) and encoded while the connection warms
        up for it.
        """
        holders: dict[int, UUID] = {}
        async with self.db.transaction() as own:
            # The server's share of the first statement goes on while the first
            # chunk is encoded, not after it: the transaction's BEGIN, and the
            # insert run once with no rows, which makes asyncpg look up its array
            # types on this connection (a catalog query of 7 to 18 ms the first
            # time) and the server plan it and open the table and its indexes.
            query, empty = batch.first_insert()
            statement = await _beside(
                partial(own.execute, query, *empty),
                partial(trio.to_thread.run_sync, batch.next_statement, FIRST_CHUNK))
            encode = partial(trio.to_thread.run_sync, batch.next_statement)
            first = True
            while statement is not None:
                following = await _beside(
                    partial(self._insert_one, statement, first, own, holders), encode)
                statement, first = following, False
        return holders

    async def _insert_one(self, statement: _Statement, first: bool, tx: Transaction,
                          holders: dict[int, UUID]) -> None:
        quiet, notifying, columns, _uniques = statement
        if first:
            inserted = await self._insert(quiet, notifying, columns, tx)
        else:
            inserted = await tx.fetchval(quiet, *columns)
        holders.update(await _unique_holders(statement, inserted, tx.fetchval))

    async def _insert(self, plain: str, notifying: str, args: Sequence[object],
                      tx: Transaction | None) -> Any:
        """
        Run an insert (`plain`), or its twin that also NOTIFYs (`notifying`, the
        channel as its last argument) when this is the first insert of `tx` or
        there is no `tx`: one NOTIFY per transaction, delivered only if it commits.
        Wake the local workers after commit. Returns the statement's first value.
        """
        channel = self.config.notify_channel
        if tx is None:
            # The insert and its NOTIFY in one statement: one crossing, one commit,
            # on a kept connection (no pool round trip of tasks and timers).
            query, params = (plain, args) if channel is None else (notifying, (*args, channel))
            value = await self.db.run_kept(lambda conn: conn.fetchval(query, *params))
            self.wake()
            return value
        if channel is None or channel in tx._notified:
            value = await tx.fetchval(plain, *args)
        else:
            value = await tx.fetchval(notifying, *args, channel)
            tx._notified.add(channel)
        tx.call_after_commit(self.wake)
        return value

    def _row(self, payload: Payload,
             owner_id: UUID | None) -> tuple[UUID | None, UUID | None, UUID, str]:
        """A job's columns (agent, connector, owner, payload text), checked and sealed."""
        owner = owner_id if owner_id is not None else payload.job_owner()
        if owner is None:
            raise ValueError(
                f"a {payload.kind} payload names no owner; pass enqueue(..., owner_id=<user id>)"
            )
        text = self._encoded(payload)
        target = payload.target()
        return (target.agent_id, target.connector_id, owner, text)

    def wake(self) -> None:
        """Wake every worker running in this process on this queue; never blocks."""
        for wake in list(self._wakers):
            wake()

    def _add_waker(self, wake: Callable[[], None]) -> None:
        self._wakers.add(wake)

    def _remove_waker(self, wake: Callable[[], None]) -> None:
        self._wakers.discard(wake)


# -- enqueue (issue #13) ----------------------------------------------------------------

#: The kinds of the built-in build payloads: never a plain job's.
_BUILD_KINDS = frozenset(t.kind for t in BUILTIN_PAYLOAD_TYPES)


def plain_json_payload(kind: str, args: Mapping[str, Any]) -> str:
    """
    The stored payload of a plain job of `kind` with the fields `args` (a JSON
    object), as `enqueue` writes one: ``{"kind": kind, **args}``; checked.

    Raises:
        InvalidPayload: a kind `check_plain_kind` refuses; `args` not a JSON
            object, naming another kind, or holding a NUL character.
    """
    check_plain_kind(kind)
    if not isinstance(args, Mapping):
        raise InvalidPayload(f"the arguments of a {kind} job must be a JSON object, not "
                             f"{type(args).__name__}")
    if args.get("kind", kind) != kind:
        raise InvalidPayload(f"the arguments name kind {args['kind']!r}, not {kind!r}")
    try:
        text = json.dumps({"kind": kind, **args}, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise InvalidPayload(f"the arguments of a {kind} job are not JSON: {exc}") from None
    if "\\u0000" in text.replace("\\\\", ""):
        raise InvalidPayload(f"the arguments of a {kind} job hold a NUL character, "
                             "which PostgreSQL cannot store")
    return text


def check_plain_kind(kind: object) -> None:
    """
    Refuse what cannot be a plain job's kind: as a `JobArgs` type's is checked
    when registered (a non-empty string of at most `MAX_KIND_LENGTH` characters),
    with no control character, and not a built-in build payload's kind.
    """
    if not isinstance(kind, str) or not kind.strip():
        raise InvalidPayload(f"a job kind is a non-empty string, got {kind!r}")
    if len(kind) > MAX_KIND_LENGTH:
        raise InvalidPayload(f"a job kind has at most {MAX_KIND_LENGTH} characters; this "
                             f"one has {len(kind)}")
    if any(not c.isprintable() for c in kind):
        raise InvalidPayload(f"a job kind has no control characters, got {kind!r}")
    if kind in _BUILD_KINDS:
        raise InvalidPayload(f"{kind} is a build job's kind: build jobs are enqueued with "
                             "their target by the application, not as plain jobs")


#: One statement of `enqueue_many`: the insert, its NOTIFYing twin, its arrays,
#: and its unique jobs (their index in the batch, their place in the statement,
#: their id and their key); none: the statement answers nothing of use.
_Statement = tuple[str, str, tuple[list[Any], ...], tuple[tuple[int, int, UUID, str], ...]]


async def _beside(background: Callable[[], Awaitable[object]],
                  foreground: Callable[[], Awaitable[T]]) -> T:
    """`foreground()`'s answer, with `background()` run beside it (both done on
    return); the one error of either is raised as itself, not in a group."""
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(background)
            answer = await foreground()
    except BaseExceptionGroup as group:
        inner = leaves(group)
        if len(inner) == 1:
            raise inner[0] from None
        raise
    return answer


def unique_of(args: JobArgs, opts: JobOptions, unique: Unique | None) -> Unique | None:
    """A plain job's uniqueness: the enqueue's, else its options', else its type's key."""
    if unique is None:
        unique = opts.unique
    if unique is None:
        key = args.unique_key()
        unique = Unique(key) if key else None
    return unique


async def _unique_holders(statement: _Statement, inserted: Any,
                          fetchval: Callable[..., Awaitable[Any]]) -> dict[int, UUID]:
    """
    The holder of each unique job of `statement` that inserted nothing (its id is
    not in `inserted`), by its index in the batch; run in the statement's
    transaction, right after it. A holder that ended meanwhile leaves its key
    free: the job is inserted again alone (then it is claimed after the jobs of
    its statement that follow it), up to `UNIQUE_TRIES` times, as `enqueue` does.
    `fetchval` is the transaction's (trio) or the connection's (asyncio).
    """
    quiet, _notifying, columns, uniques = statement
    holders: dict[int, UUID] = {}
    if not uniques:
        return holders
    done = set(inserted or ())
    for index, place, job_id, key in uniques:
        if job_id in done:
            continue
        for _ in range(UNIQUE_TRIES):
            holder = await fetchval(Q.plain_unique_holder, key)
            if holder is not None:
                holders[index] = holder
                break
            again = await fetchval(quiet, *([column[place]] for column in columns))
            if again:
                break
        else:
            raise RuntimeError(f"unique key {key!r}: the job holding it kept changing; "
                               f"tried {UNIQUE_TRIES} times")
    return holders


@attrs.frozen
class _NoOptions:
    """What a bare `JobArgs` in a batch is enqueued with: nothing of its own."""

    options: JobOptions | None = None
    unique: Unique | None = None
    run_at: datetime | None = None
    delay: float | timedelta | None = None


_BARE = _NoOptions()


def _not_a_job(payload: object) -> TypeError:
    hint = (": a job given as a dict goes through enqueue_json(kind, args)"
            if isinstance(payload, Mapping) else "")
    return TypeError(f"enqueue expects a JobArgs instance (or a build Payload), not "
                     f"{type(payload).__name__}{hint}")


class _Batch:
    """
    The payloads of one `enqueue_many`, encoded in the order given into statements
    of at most `ENQUEUE_MANY_CHUNK` rows (build jobs and plain jobs apart), so that
    the first payload that fails is the one reported, whichever statement it is in.
    """

    def __init__(self, queue: Queue, payloads: Sequence[Payload | JobArgs | Job],
                 owner_id: UUID | None) -> None:
        self._queue = queue
        self._payloads = payloads
        self._owner_id = owner_id
        self._next = 0
        self._build: list[tuple[object, ...]] = []
        self._build_ids: list[UUID] = []
        self._plain: list[tuple[object, ...]] = []
        self._plain_ids: list[UUID] = []
        #: The unique jobs of the plain statement being filled (see `_Statement`).
        self._plain_unique: list[tuple[int, int, UUID, str]] = []
        #: Every job's id, in the order given.
        self.ids: list[UUID] = []
        self._random = b""
        self._random_at = 0

    def all(self) -> list[_Statement]:
        """Every statement of the batch (each payload checked before anything is sent)."""
        statements = []
        while (statement := self.next_statement()) is not None:
            statements.append(statement)
        return statements

    def first_insert(self) -> tuple[str, tuple[list[Any], ...]]:
        """The quiet twin of the statement the batch's first payload goes in, with
        empty arrays: run, it inserts nothing and warms the connection for it."""
        if isinstance(self._payloads[0], Payload):
            return Q.jobs_insert_many, ([],) * 5
        return Q.plain_insert_many, ([],) * 8

    def next_statement(self, rows: int = ENQUEUE_MANY_CHUNK) -> _Statement | None:
        """Encode payloads until a statement of `rows` is full, or the last one; None
        at the end."""
        payloads, queue = self._payloads, self._queue
        while self._next < len(payloads):
            index = self._next
            payload = payloads[index]
            job_id = self._new_id()
            try:
                if isinstance(payload, JobArgs | Job):
                    given: Job | _NoOptions
                    if isinstance(payload, Job):
                        args, given = payload.args, payload
                    else:  # a bare JobArgs: as Job(payload), without making one
                        args, given = payload, _BARE
                    opts = given.options or type(args).options
                    unique = unique_of(args, opts, given.unique)
                    row = queue._plain_row(args, opts, given.run_at, given.delay)
                    if unique is None:
                        self._plain.append((*row, None, None))
                    else:
                        self._plain_unique.append((index, len(self._plain), job_id,
                                                   unique.key))
                        self._plain.append((*row, unique.key, ",".join(sorted(unique.states))))
                    ids = self._plain_ids
                elif not isinstance(payload, Payload):
                    raise TypeError(f"enqueue_many takes build payloads, JobArgs and Jobs, "
                                    f"not {type(payload).__name__}")
                else:
                    self._build.append(queue._row(payload, self._owner_id))
                    ids = self._build_ids
            except Exception as exc:
                exc.add_note(f"payload {index} of the {len(payloads)} given to enqueue_many; "
                             "nothing was enqueued")
                raise
            ids.append(job_id)
            self.ids.append(job_id)
            self._next += 1
            if len(self._build) == rows:
                return self._take_build()
            if len(self._plain) == rows:
                return self._take_plain()
        if self._build:
            return self._take_build()
        if self._plain:
            return self._take_plain()
        return None

    def _new_id(self) -> UUID:
        """A random (version 4) job id; the random bytes drawn for a chunk at a time."""
        at = self._random_at
        if at == len(self._random):
            self._random, at = os.urandom(16 * ENQUEUE_MANY_CHUNK), 0
        self._random_at = at + 16
        return UUID(bytes=self._random[at:at + 16], version=4)

    def _take_build(self) -> _Statement:
        rows, ids = self._build, self._build_ids
        self._build, self._build_ids = [], []
        return (Q.jobs_insert_many, Q.jobs_insert_many_notify,
                (ids, *([r[i] for r in rows] for i in range(4))), ())

    def _take_plain(self) -> _Statement:
        rows, ids, uniques = self._plain, self._plain_ids, self._plain_unique
        self._plain, self._plain_ids, self._plain_unique = [], [], []
        if not uniques:
            return (Q.plain_insert_many, Q.plain_insert_many_notify,
                    (ids, *([r[i] for r in rows] for i in range(7))), ())
        return (Q.plain_insert_many_unique, Q.plain_insert_many_unique_notify,
                (ids, *([r[i] for r in rows] for i in range(9))), tuple(uniques))


