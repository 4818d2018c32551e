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

import json
from collections.abc import Callable, Sequence
from typing import Any
from uuid import UUID, uuid4

from ._sql import Q
from .config import QueueConfig
from .database import Database, Transaction
from .errors import PayloadTooLarge
from .payloads import Payload, PayloadCodec
from .secrets import SecretBox


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
        payload: Payload,
        *,
        tx: Transaction | None = None,
        owner_id: UUID | None = None,
    ) -> UUID:
        """
        Add a job; return its id.

        Args:
            payload: any `Payload`, built-in or registered by the application.
            tx: a transaction from `db.transaction()`. The job is inserted in it
                and the worker is woken only once it commits; if it rolls back,
                the job never existed.
            owner_id: `build_jobs.owner_id`. Defaults to the payload's own owner
                (the caller for Update and Rollback); required for payloads that
                carry none (StandaloneBuild).

        Raises:
            PayloadTooLarge: the encoded payload exceeds `max_payload_bytes`.
            SecretsNotConfigured: the payload has values to seal (a non-empty
                `env`) and no key was given.
            InvalidPayload: with `seal_agent_env` off, an env value that would
                read back as a sealed one.
            ValueError: no owner could be determined.
        """
        job_id: UUID = await self._insert(Q.job_insert, Q.job_insert_notify,
                                          self._row(payload, owner_id), tx)
        return job_id

    async def enqueue_many(
        self,
        payloads: Sequence[Payload],
        *,
        tx: Transaction | None = None,
        owner_id: UUID | None = None,
    ) -> list[UUID]:
        """
        Add many jobs in one statement; return their ids, in the order given.

        Every payload is encoded and checked before anything is sent, so a bad
        one refuses the whole batch (its index is in the message) and inserts
        nothing. The jobs are claimed in the order given. One NOTIFY per
        transaction, as for `enqueue`; with `tx`, they commit or vanish with it.

        Args:
            payloads: built-in or registered `Payload`s, of any mix of kinds.
            tx: as for `enqueue`.
            owner_id: the owner of every payload that names none of its own.

        Raises:
            As `enqueue`, for the first payload that fails, with its index.
        """
        rows = []
        for index, payload in enumerate(payloads):
            try:
                rows.append(self._row(payload, owner_id))
            except Exception as exc:
                exc.add_note(f"payload {index} of the {len(payloads)} given to enqueue_many; "
                             "nothing was enqueued")
                raise
        if not rows:
            return []
        ids = [uuid4() for _ in rows]
        columns = (ids, *([r[i] for r in rows] for i in range(4)))
        await self._insert(Q.jobs_insert_many, Q.jobs_insert_many_notify, columns, tx)
        return ids

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
            # The insert and its NOTIFY in one statement: one crossing, one commit.
            if channel is None:
                value = await self.db.fetchval(plain, *args)
            else:
                value = await self.db.fetchval(notifying, *args, channel)
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
        text = json.dumps(self._codec.encode(payload), separators=(",", ":"))
        size = len(text.encode("utf-8"))
        if size > self.config.max_payload_bytes:
            raise PayloadTooLarge(
                f"{payload.kind} payload is {size} bytes; the limit is "
                f"{self.config.max_payload_bytes} (QueueConfig.max_payload_bytes)"
            )
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
