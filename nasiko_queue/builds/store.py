"""
The job row and every transition of it: claim, finish, fail, reset, recover.

`PgJobStore` is the worker's whole view of the database. Each method is one
crossing of the trio/asyncio bridge and, where it writes more than one row,
one transaction. The worker loop talks only to the `JobStore` protocol, so its
timer logic can be tested against an in-memory fake on trio's mock clock.

Every write to a claimed job is guarded by the claim itself (`id`, `attempt`,
`claim_token`, `status = 'in_progress'`): a job that the sweep or the rescue
has meanwhile handed to another worker, that an operator retried, or whose
target was deleted, is left alone and the write reports False. The attempt
alone would not do (the dead-letter retry counts attempts from 0 again), nor
the token alone (the original's SQL claims without writing it): see
`jobs_finish_many_and_claim` in queries.sql.

The worker's statements are bounded by `QueueConfig.cleanup_timeout` on both
sides of the trio/asyncio bridge (`Database.run_bounded`). A claim whose answer
does not come in time raises `ClaimOutcomeUnknown`; `resolve_lost_claim` then
finds what it took by the claim's token and gives it back.

Lock order: a transaction that may terminalize a target locks the target row
first, then the job row, then the builds (`agent_lock`). Without it, two
replicas failing two jobs of one agent deadlock: each holds its own job row and
waits for the other's, which the agent's delete cascades to.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Awaitable, Callable, Sequence
from typing import Final
from uuid import UUID

import asyncpg

from ..config import QueueConfig
from ..db.claims import end_claims_backend, fetch_claiming, without_flush_wait
from ..db.database import Database
from ..db.statements import Q
from ..engine.contracts import (
    MAX_ATTEMPTS_EXCEEDED,
    BuildReport,
    ClaimedJob,
    Finishing,
    Heartbeat,
    JobStatus,
    LostClaim,
    RecoveryResult,
    RescueResult,
    Starting,
    WorkerIdentity,
)
from ..errors import is_connection_error, is_transient
from ..job_errors import JobError, storable
from .payloads import raw_build_id
from .terminalize import terminalize_target

log = logging.getLogger("nasiko_queue.jobs")

TARGET_DELETED = "target deleted"
JOB_PANICKED = "job panicked during execution"
BUILD_FAILED = "build or deploy step failed — see the relevant *_builds row for details"
SWEEP_BATCH = 100
#: How long a recovery waits for a job's target row (`recovery_lock_wait`):
#: longer than any of the queue's own transactions holds it, much shorter than
#: a statement's time-out.
RECOVERY_LOCK_WAIT = "2s"


#: A status as the statements return it, without the enum's lookup per job.
_STATUS: Final = {s.value: s for s in JobStatus}


def _claimed(row: asyncpg.Record, worker: UUID | None, token: UUID) -> ClaimedJob:
    """A claimed row, field by field (a row of the finish also carries
    `finished_id` and `finished_status`, which are not the job's), claimed by
    `worker` with claim token `token`."""
    return ClaimedJob(id=row["id"], agent_id=row["agent_id"], connector_id=row["connector_id"],
                      owner_id=row["owner_id"], payload=row["payload"],
                      old_attempt=row["old_attempt"], created_at=row["created_at"],
                      target_soft_deleted=row["target_soft_deleted"], claimed_by=worker,
                      claim_token=token)


class PgJobStore:
    """
    `JobStore` on PostgreSQL.

    Args:
        db: the connection pool.
        config: supplies MAX_ATTEMPTS, the stuck threshold, the payload bound,
            the NOTIFY channel and `cleanup_timeout`, the bound on each of the
            worker's statements.
        runnable_kinds: payload kinds this worker has executors for.
        known_kinds: every kind a payload type exists for; a job of any other
            kind is claimed too, so that it fails as invalid instead of waiting
            forever.
    """

    def __init__(
        self,
        db: Database,
        config: QueueConfig,
        *,
        runnable_kinds: frozenset[str],
        known_kinds: frozenset[str],
    ) -> None:
        self._db = db
        self._config = config
        self._runnable = sorted(runnable_kinds)
        self._known = sorted(known_kinds | runnable_kinds)
        # A replica that runs every known kind claims with one ordered scan of the
        # pending rows; one that runs some of them, kind by kind (0011), so that a
        # backlog of the kinds it leaves to others costs it nothing.
        subset = not set(self._known) <= set(self._runnable)
        self._claim_sql = Q.job_claim_kinds if subset else Q.job_claim
        if not config.claim_synchronous_commit:
            self._claim_sql = without_flush_wait(self._claim_sql)
        # A batch in which nothing was reported goes without the build-row writes
        # (`jobs_finish_many_and_claim`): the server sets up every part of a
        # statement on each run, so unused writes still cost it (issue #25).
        self._finish_sql = (Q.jobs_finish_many_and_claim_kinds if subset
                            else Q.jobs_finish_many_and_claim)
        self._finish_reported_sql = (Q.jobs_finish_reported_and_claim_kinds if subset
                                     else Q.jobs_finish_reported_and_claim)
        self._bound = config.cleanup_timeout
        #: The worker this store claims for (`build_jobs.claimed_by`), once it
        #: registered; None: claims name no worker (the 60-minute rule covers
        #: them, as it does the original's).
        self.worker_id: UUID | None = None

    async def claim(self, limit: int) -> list[ClaimedJob]:
        """
        Claim up to `limit` pending jobs, oldest first (FOR UPDATE SKIP LOCKED).

        Raises:
            ClaimOutcomeUnknown: no answer in time; the claim may have taken jobs.
        """
        token, worker = uuid.uuid4(), self.worker_id
        args = (limit, self._runnable, self._known, self._config.max_payload_bytes, token,
                worker)
        rows = await fetch_claiming(self._db, self._claim_sql, args, token=token, claims=True,
                                    bound=self._bound)
        jobs = [_claimed(row, worker, token) for row in rows]
        jobs.sort(key=lambda j: j.order)
        return jobs

    async def finish_from_build(self, job: ClaimedJob, build_id: UUID) -> JobStatus | None:
        """
        The executor returned: done if its build row says 'success', else failed.

        Returns the status written, or None when the job is no longer ours (its
        target was hard-deleted during the build, which cascaded the row away).
        One job's `finish_many_and_claim` with no claim: the worker batches its
        finishes, so this is for tools and tests.
        """
        statuses, _ = await self.finish_many_and_claim([(job, build_id, None)], 0)
        return statuses.get(job.id)

    async def finish_many_and_claim(
        self, finishing: Sequence[Finishing], limit: int, *, starts: Sequence[Starting] = ()
    ) -> tuple[dict[UUID, JobStatus | None], list[ClaimedJob]]:
        """
        `finish_from_build` for every (job, build id, report) and `claim(limit)`,
        in one round trip: the worker's fetcher records every finish queued since
        its last statement and claims what its slots and prefetch buffer have room
        for, so the claim's SQL lives in two statements, not three. Returns each
        job's status (None: gone or no longer ours) and the claims.

        A finish whose executor reported through its context (`BuildReport`) also
        writes the build row, in this statement: the job is done exactly when its
        build row ends 'success'. A build row already 'success' or 'failed' is left
        as it is and decides. `starts` ride along too: each build row goes from
        'queued' ('pending') to 'building', and is otherwise left alone, so a start
        write that arrives late never hides an outcome. Together they spare an
        executor the two round trips of writing its build row itself.

        Raises:
            ClaimOutcomeUnknown: no answer in time (with `limit` > 0; without a
                claim, plain `OutcomeUnknown`). The finishes and starts are safe to
                send again: each finish is guarded by its claim, each build write by
                the row's status.
        """
        token, worker = uuid.uuid4(), self.worker_id
        sent = [(j, b, r.value if isinstance(r, BuildReport) else None)
                for j, b, r in finishing]
        sent += [(j, b, "building") for j, b in starts]
        args: tuple[object, ...] = (
            [j.id for j, _, _ in sent],
            [j.attempt for j, _, _ in sent],
            [j.is_connector_job for j, _, _ in sent],
            [b for _, b, _ in sent],
            BUILD_FAILED,
            limit,
            self._runnable,
            self._known,
            self._config.max_payload_bytes,
            token,
            worker,
        )
        tokens = [j.claim_token for j, _, _ in sent]
        sql, args = self._finish_sql, (*args, tokens)
        if any(r is not None for _, _, r in sent):
            sql, args = self._finish_reported_sql, (*args[:-1], [r for _, _, r in sent], tokens)
        rows = await fetch_claiming(self._db, sql, args, token=token,
                                    claims=limit > 0, bound=self._bound)
        statuses: dict[UUID, JobStatus | None] = {}
        claimed: list[ClaimedJob] = []
        for row in rows:
            if row["finished_id"] is not None:
                status = row["finished_status"]
                statuses[row["finished_id"]] = None if status is None else _STATUS[status]
            else:
                claimed.append(_claimed(row, worker, token))
        claimed.sort(key=lambda j: j.order)
        return statuses, claimed

    async def resolve_lost_claim(self, claim: LostClaim) -> int:
        """
        Give back whatever a claim with a lost answer took; return how many jobs.

        First the server process that received the claim is ended (and waited
        for), so that the claim is settled: committed or rolled back, not still
        on its way. Then every row carrying its token goes back to pending with
        its attempt restored (none of them reached an executor), and listening
        workers are woken. Safe to call again.
        """
        async def resolve(conn: asyncpg.Connection) -> int:
            await end_claims_backend(conn, claim, self._bound)
            row = await conn.fetchrow(Q.jobs_unclaim_lost, claim.token,
                                      self._config.stuck_job_mins, self._config.notify_channel,
                                      timeout=self._bound)
            return int(row["given_back"]) if row is not None else 0

        given: int = await self._db.run_bounded(resolve, bound=self._bound)
        if given:
            log.warning("gave back %d job(s) taken by a claim whose answer was lost", given)
        return given

    async def unclaim(self, jobs: list[ClaimedJob]) -> int:
        """
        Claimed jobs that never started go back to pending, their attempts
        restored (they never ran), and every listening worker is woken so an
        idle replica takes them at once. Returns how many went back.
        """
        if not jobs:
            return 0
        args = ([j.id for j in jobs], [j.attempt for j in jobs], self._config.notify_channel,
                [j.claim_token for j in jobs])
        row = await self._db.run_bounded(
            lambda conn: conn.fetchrow(Q.jobs_unclaim, *args, timeout=self._bound),
            bound=self._bound, generic=True)
        return int(row["given_back"]) if row is not None else 0

    async def fail(
        self,
        job: ClaimedJob,
        message: str,
        *,
        own_build_id: UUID | None,
        terminalize: bool,
    ) -> bool:
        """
        Mark the job failed with `message`, in one transaction with its target.

        With `terminalize`, the target goes terminal (docs/rules.md §6). Without it (the
        soft-deleted agent), only the job's own build row is ended. Returns
        False when the job is no longer ours. `own_build_id` None: read from the
        row (a payload that does not parse).
        """

        async def op(conn: asyncpg.Connection) -> bool:
            async with conn.transaction():
                return await self._fail_in(conn, job.id, job.attempt, job.claim_token,
                                           job.agent_id, job.connector_id, message,
                                           own_build_id, terminalize=terminalize,
                                           stuck_mins=None)

        ours: bool = await self._db.run_bounded(op, bound=self._bound)
        if not ours:
            log.info("job %s: row gone or no longer ours; not marked %r", job.id, message)
        return ours

    async def _fail_in(
        self,
        conn: asyncpg.Connection,
        job_id: UUID,
        attempt: int,
        token: UUID | None,
        agent_id: UUID | None,
        connector_id: UUID | None,
        message: str,
        own_build_id: UUID | None,
        *,
        terminalize: bool,
        stuck_mins: int | None,
        held_by: UUID | None = None,
    ) -> bool:
        """Fail one claimed job inside the caller's transaction, target locked first;
        the claim is (`job_id`, `attempt`, `token`)."""
        bound = self._bound if stuck_mins is None and held_by is None else None
        if bound is None:  # a recovery: a target locked elsewhere waits for the next round
            await conn.execute(Q.recovery_lock_wait, RECOVERY_LOCK_WAIT)
        if agent_id is not None:
            if await conn.fetchval(Q.agent_lock, agent_id, timeout=bound) is None:
                return False  # the agent is gone, and its jobs with it
        elif connector_id is not None and \
                await conn.fetchval(Q.connector_lock, connector_id, timeout=bound) is None:
            return False
        row = await conn.fetchrow(Q.job_fail, job_id, attempt, message, stuck_mins, held_by,
                                  token, timeout=bound)
        if row is None:
            return False
        build_id = own_build_id or raw_build_id(
            {"kind": row["kind"], "build_id": row["build_id"],
             "rollback_build_id": row["rollback_build_id"]})
        if terminalize:
            await terminalize_target(conn, row["agent_id"], row["connector_id"], build_id)
        elif build_id is not None and row["agent_id"] is not None:
            await conn.execute(Q.agent_build_fail_own, build_id, timeout=bound)
        return True

    async def reset(self, job: ClaimedJob) -> bool:
        """Back to pending with picked_at NULL (the attempt stays counted); NOTIFY."""
        row = await self._db.run_bounded(
            lambda conn: conn.fetchrow(Q.job_reset_to_pending, job.id, job.attempt,
                                       self._config.notify_channel, job.claim_token,
                                       timeout=self._bound),
            bound=self._bound)
        return row is not None

    async def discard_unrecorded(self, job: ClaimedJob, why: str) -> bool:
        """
        A finish the database refused on its merits, alone too (the completer's
        last fallback). A build job's `error_msg` holds only the fixed strings
        of docs/rules.md §5, so nothing is written: False, and the row is left
        `in_progress` for the rescue once this worker stops (or the sweep).
        """
        return False

    async def recover(self) -> RecoveryResult:
        """
        The two recovery steps of docs/rules.md §7.

        Exhausted stuck jobs are failed one by one, each in a transaction of its
        own with its target's terminalization (target locked first): one job
        whose target the database refuses to terminalize is failed alone, one
        that meets a lock or a conflict is left for the next sweep, and neither
        holds back the others. An outage aborts the sweep (the caller retries).
        Then the stuck jobs with attempts left go back to pending in one
        statement. Last, plain jobs get the same rule in one statement
        (`plain_sweep_stuck`): running past `stuck_job_mins` with no live worker
        holding them, available again, or discarded on their last attempt, or
        cancelled if asked. Any number of replicas may sweep at once.
        """
        mins = self._config.stuck_job_mins
        max_attempts = self._config.build_max_attempts
        failed = skipped = 0
        tried: list[UUID] = []
        while True:
            rows = await self._db.fetch(Q.jobs_stuck_exhausted, mins, max_attempts, tried,
                                        SWEEP_BATCH)
            for row in rows:
                tried.append(row["id"])
                outcome = await self._fail_stuck(row)
                failed += outcome == "failed"
                skipped += outcome == "skipped"
            if len(rows) < SWEEP_BATCH:
                break
        row = await self._db.fetchrow(Q.jobs_reset_stuck, mins, max_attempts,
                                      self._config.notify_channel)
        reset = int(row["reset"]) if row is not None else 0
        row = await self._db.fetchrow(Q.plain_sweep_stuck, mins, self._config.notify_channel)
        plain_reset = int(row["reset"]) if row is not None else 0
        plain_ended = int(row["ended"]) if row is not None else 0
        if plain_reset or plain_ended:
            log.warning("recovery: %d stuck plain job(s) available again, %d discarded or "
                        "cancelled", plain_reset, plain_ended)
        if failed:
            log.warning("recovery: %d stuck job(s) had no attempts left and failed", failed)
        if reset:
            log.warning("recovery: %d stuck job(s) reset to pending", reset)
        if skipped:
            log.warning("recovery: %d stuck job(s) met a lock or a conflict; next sweep", skipped)
        return RecoveryResult(failed=failed, reset=reset, skipped=skipped,
                              plain_reset=plain_reset, plain_ended=plain_ended)

    async def _fail_stuck(self, row: asyncpg.Record, *, held_by: UUID | None = None) -> str:
        """
        Fail one exhausted job of the sweep (stuck past the threshold) or of the
        rescue (held by dead worker `held_by`): 'failed', 'gone' (not ours to
        fail any more) or 'skipped' (a lock or a conflict: next round).
        """
        mins = None if held_by is not None else self._config.stuck_job_mins

        def fail(terminalize: bool) -> Callable[[asyncpg.Connection], Awaitable[bool]]:
            async def op(conn: asyncpg.Connection) -> bool:
                async with conn.transaction():
                    return await self._fail_in(
                        conn, row["id"], row["attempt"], row["claim_token"], row["agent_id"],
                        row["connector_id"], MAX_ATTEMPTS_EXCEEDED, None,
                        terminalize=terminalize, stuck_mins=mins, held_by=held_by)
            return op

        for terminalize in (True, False):
            try:
                ours = await self._db.run(fail(terminalize))
            except Exception as exc:
                if is_connection_error(exc):
                    raise
                if is_transient(exc):
                    log.warning("recovery: job %s: %s: %s; trying again at the next sweep",
                                row["id"], type(exc).__name__, exc)
                    return "skipped"
                if terminalize:
                    log.error("recovery: job %s failed for good, but its target could not be "
                              "terminalized (%s: %s); failing the job alone", row["id"],
                              type(exc).__name__, exc)
                    continue
                log.error("recovery: job %s could not be failed (%s: %s); left as it is",
                          row["id"], type(exc).__name__, exc)
                return "skipped"
            return "failed" if ours else "gone"
        return "skipped"  # not reached: the second pass returns

    # -- workers, heartbeats, leadership, rescue ------------------------------------

    async def register_worker(self, identity: WorkerIdentity) -> None:
        """Insert the worker's row; from now on this store's claims name it."""
        await self._db.execute(Q.worker_register, identity.id, identity.host, identity.pid,
                               list(identity.kinds), self._config.lease,
                               json.dumps(dict(identity.queues)))
        self.worker_id = identity.id

    async def heartbeat(self, role: str | None) -> Heartbeat:
        """
        Renew the worker's heartbeat (and hold or take `role`), on the control pool,
        bounded by `cleanup_timeout`.
        """
        if self.worker_id is None:
            raise RuntimeError("heartbeat before register_worker")
        args = (self.worker_id, role, self._config.lease)
        row = await self._db.run_bounded(
            lambda conn: conn.fetchrow(Q.worker_heartbeat, *args, timeout=self._bound),
            bound=self._bound, control=True)
        return Heartbeat(alive=bool(row and row["alive"]), leader=bool(row and row["leader"]),
                         cancels=tuple(row["cancels"]) if row is not None else ())

    async def retire_worker(self) -> None:
        """Declare this worker dead (it stopped its jobs); the leader rescues them."""
        if self.worker_id is not None:
            worker = self.worker_id
            await self._db.run_bounded(
                lambda conn: conn.execute(Q.worker_retire, worker, timeout=self._bound),
                bound=self._bound, control=True)

    async def deregister_worker(self) -> None:
        """A stop: release any role, and remove the row (or declare it dead if it
        still holds jobs, for the rescue to give back)."""
        if self.worker_id is not None:
            worker = self.worker_id
            await self._db.run_bounded(
                lambda conn: conn.execute(Q.worker_deregister, worker, timeout=self._bound),
                bound=self._bound, control=True)

    async def record_error(self, job: ClaimedJob, error: JobError) -> None:
        """Keep a crashed attempt's error (`nasiko_queue_job_errors`)."""
        await self._db.run_bounded(
            lambda conn: conn.execute(Q.job_error_insert, job.id, error.attempt, self.worker_id,
                                      error.reason, storable(error.error_type),
                                      storable(error.message), storable(error.traceback),
                                      timeout=self._bound),
            bound=self._bound)

    async def rescue(self) -> RescueResult:
        """
        One round of the leader's rescue.

        Workers whose heartbeat is older than their own lease are declared dead
        (each only if it has not heartbeated since it was seen). The jobs dead
        workers hold go back to pending, attempt counted, in one statement, or,
        out of attempts, fail `max attempts exceeded` and terminalize, each in a
        transaction of its own (as in the sweep: target locked first; refused:
        failed alone; locked: next round). Then dead rows past
        `dead_worker_retention` that hold nothing are forgotten.
        """
        declared = 0
        for row in await self._db.fetch(Q.workers_expired):
            if await self._db.fetchval(Q.worker_declare_dead, row["id"], row["heartbeat_at"]):
                declared += 1
                log.warning("worker %s missed its heartbeats (last %s); declared dead, its "
                            "jobs are rescued", row["id"], row["heartbeat_at"])
        failed = skipped = 0
        while True:
            rows = await self._db.fetch(Q.jobs_held_by_dead_exhausted,
                                        self._config.build_max_attempts, SWEEP_BATCH)
            for row in rows:
                outcome = await self._fail_stuck(row, held_by=row["claimed_by"])
                failed += outcome == "failed"
                skipped += outcome == "skipped"
            if len(rows) < SWEEP_BATCH or skipped:
                break
        row = await self._db.fetchrow(Q.jobs_rescue, self._config.build_max_attempts,
                                      self._config.notify_channel)
        rescued = int(row["rescued"]) if row is not None else 0
        row = await self._db.fetchrow(Q.plain_rescue, self._config.notify_channel)
        if row is not None:
            rescued += int(row["rescued"])
            failed += int(row["ended"])
        await self._db.execute(Q.workers_prune_dead, self._config.dead_worker_retention)
        if failed or rescued:
            log.warning("rescue: %d job(s) of dead workers back to pending, %d failed for "
                        "good", rescued, failed)
        return RescueResult(declared_dead=declared, failed=failed, rescued=rescued,
                            skipped=skipped)
