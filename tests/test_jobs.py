"""
The job store's statements on their own: exclusive claims under concurrency,
and the claim token that keeps a stale worker's late write off a job that has
since been handed to someone else.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import trio

from nasiko_queue import Queue
from nasiko_queue.builds.store import BUILD_FAILED, PgJobStore
from nasiko_queue.engine.contracts import JobStatus
from nasiko_queue.testing import KINDS, enqueue_with_target, set_build_status

from .helpers import build_state, connector_state, job_row


def _store(queue: Queue) -> PgJobStore:
    kinds = frozenset(KINDS)
    return PgJobStore(queue.db, queue.config, runnable_kinds=kinds, known_kinds=kinds)


async def test_concurrent_claims_are_exclusive(queue: Queue) -> None:
    """Eight claimers race over 300 jobs: each job is claimed exactly once
    (without SKIP LOCKED, or FOR UPDATE, some are taken twice)."""
    for _ in range(300):
        await enqueue_with_target(queue, "Upload")
    claimed: Counter[Any] = Counter()
    store = _store(queue)

    async def claimer() -> None:
        while jobs := await store.claim(1):
            for job in jobs:
                claimed[job.id] += 1

    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            for _ in range(8):
                nursery.start_soon(claimer)
    assert len(claimed) == 300
    assert set(claimed.values()) == {1}
    attempts = await queue.db.fetch("SELECT DISTINCT attempt FROM build_jobs")
    assert [r["attempt"] for r in attempts] == [1]


async def test_batched_claim_takes_the_oldest_first(queue: Queue) -> None:
    jobs = [await enqueue_with_target(queue, kind) for kind in KINDS]
    claimed = await _store(queue).claim(4)
    assert [j.id for j in claimed] == [j.job_id for j in jobs[:4]]
    assert [j.old_attempt for j in claimed] == [0, 0, 0, 0]


async def test_a_stale_claim_cannot_touch_the_job(queue: Queue) -> None:
    """Worker A is cut off past the threshold; the sweep hands the job to B (attempt
    2). A's late finish, fail and reset all find the row no longer theirs."""
    store = _store(queue)
    job = await enqueue_with_target(queue, "Upload", prior_success=True)
    (stale,) = await store.claim(1)
    await queue.db.execute("UPDATE build_jobs SET attempt = attempt + 1 WHERE id = $1",
                           job.job_id)  # the sweep reset it and B claimed it
    before = await job_row(queue.db, job.job_id)
    await set_build_status(queue.db, job.payload, "success")
    assert await store.finish_from_build(stale, job.build_id) is None
    assert await store.fail(stale, BUILD_FAILED, own_build_id=job.build_id,
                            terminalize=True) is False
    assert await store.reset(stale) is False
    assert await job_row(queue.db, job.job_id) == before
    assert await build_state(queue.db, job.build_id) == "success"  # nothing terminalized


async def test_finish_reads_the_connector_table_for_connector_jobs(queue: Queue) -> None:
    store = _store(queue)
    job = await enqueue_with_target(queue, "McpServerUpload")
    (claimed,) = await store.claim(1)
    # An agent build row with the same id would be read by mistake: there is none,
    # and the connector build says success.
    await set_build_status(queue.db, job.payload, "success")
    assert await store.finish_from_build(claimed, job.build_id) is JobStatus.DONE


async def test_connector_terminalization_leaves_a_running_connector_running(
    queue: Queue,
) -> None:
    """§6: with a successful build, only a pending/building connector becomes failed."""
    store = _store(queue)
    job = await enqueue_with_target(queue, "McpServerUpload", prior_success=True)
    await queue.db.execute(
        "UPDATE mcp_connectors SET build_status = 'running', url = 'http://x/mcp' "
        "WHERE id = $1", job.target_id)
    (claimed,) = await store.claim(1)
    assert await store.fail(claimed, BUILD_FAILED, own_build_id=job.build_id, terminalize=True)
    assert await connector_state(queue.db, job.target_id) == "running"
    # Its pending build (this job's) failed, with completed_at.
    row = await queue.db.fetchrow(
        "SELECT status, completed_at FROM mcp_connector_builds WHERE id = $1", job.build_id)
    assert row is not None
    assert row["status"] == "failed"
    assert row["completed_at"] is not None


class CountingStore(PgJobStore):
    """The real store, counting which statements the worker sends."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.calls: Counter[str] = Counter()

    async def claim(self, limit: int) -> Any:
        self.calls["claim"] += 1
        return await super().claim(limit)

    async def finish_from_build(self, *args: Any) -> Any:
        self.calls["finish"] += 1
        return await super().finish_from_build(*args)

    async def finish_many_and_claim(self, *args: Any, **kw: Any) -> Any:
        self.calls["finish_and_claim"] += 1
        return await super().finish_many_and_claim(*args, **kw)


async def test_one_round_trip_per_job_at_concurrency_one(queue: Queue) -> None:
    """Recording a finish claims the next job for the freed slot: 20 jobs cost
    20 finish-and-claim statements and one plain claim (the startup drain's
    first; drain_once's wake re-arms that drain, which goes on until a
    finish-and-claim comes back short), not 20 finishes plus 20-odd claims."""
    from nasiko_queue import Worker

    from .helpers import executors_for_all, succeed

    for _ in range(20):
        await enqueue_with_target(queue, "Upload")
    kinds = frozenset(KINDS)
    store = CountingStore(queue.db, queue.config, runnable_kinds=kinds, known_kinds=kinds)
    worker = Worker(queue, executors_for_all(succeed), store=store)
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            await nursery.start(worker.run)
            await worker.drain_once()
            worker.stop()
    assert worker.stats.done == 20
    assert store.calls == Counter({"finish_and_claim": 20, "claim": 1})


class CountingBatches(PgJobStore):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.batches: list[int] = []

    async def finish_many_and_claim(self, finishing: Any, limit: int, **kw: Any) -> Any:
        self.batches.append(len(finishing))
        return await super().finish_many_and_claim(finishing, limit, **kw)


async def test_several_slots_finish_through_the_fetcher(queue: Queue) -> None:
    """With concurrency 5, every finish goes through the fetcher, which records
    all the finishes queued at that moment in one statement and claims the
    slots their next jobs; every job still ends done exactly once."""
    import attrs

    from nasiko_queue import Worker

    from .helpers import executors_for_all, succeed

    runs: Counter[Any] = Counter()

    async def run(ctx: Any) -> None:
        runs[ctx.job_id] += 1
        await succeed(ctx)

    for _ in range(60):
        await enqueue_with_target(queue, "Upload")
    concurrent = Queue(queue.db, config=attrs.evolve(queue.config, concurrency=5))
    kinds = frozenset(KINDS)
    store = CountingBatches(queue.db, concurrent.config, runnable_kinds=kinds,
                            known_kinds=kinds)
    worker = Worker(concurrent, executors_for_all(run), store=store)
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            await nursery.start(worker.run)
            await worker.drain_once()
            worker.stop()
    assert sum(store.batches) == 60
    assert len(runs) == 60
    assert set(runs.values()) == {1}
    assert await queue.db.fetchval("SELECT count(*) FROM build_jobs WHERE status='done'") == 60


async def test_hard_stop_with_several_slots_puts_every_running_job_back(queue: Queue) -> None:
    import attrs

    from nasiko_queue import Worker

    from .helpers import executors_for_all

    started = trio.Semaphore(0)

    async def hang(ctx: Any) -> None:
        started.release()
        await trio.sleep_forever()

    jobs = [await enqueue_with_target(queue, "Upload") for _ in range(3)]
    concurrent = Queue(queue.db, config=attrs.evolve(queue.config, concurrency=3))
    worker = Worker(concurrent, executors_for_all(hang))
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            await nursery.start(worker.run)
            for _ in range(3):
                await started.acquire()
            nursery.cancel_scope.cancel()
    for job in jobs:
        row = await job_row(queue.db, job.job_id)
        assert row is not None
        assert (row["status"], row["attempt"], row["picked_at"]) == ("pending", 1, None)


# -- a replica that runs some of the kinds ----------------------------------------------


async def _pending_rows(queue: Queue, kinds_in_order: list[str]) -> list[Any]:
    """One pending job per entry, oldest first, with payloads of those kinds ('' for a
    payload with no kind at all)."""
    ids = []
    for kind in kinds_in_order:
        job = await enqueue_with_target(queue, "Upload")
        payload = '{"no": "kind"}' if kind == "" else f'{{"kind": "{kind}"}}'
        await queue.db.execute("UPDATE build_jobs SET payload = $2::jsonb, "
                               "created_at = clock_timestamp() WHERE id = $1",
                               job.job_id, payload)
        ids.append(job.job_id)
    return ids


async def test_a_replica_of_some_kinds_claims_them_and_the_unknown_oldest_first(
    queue: Queue,
) -> None:
    """docs/rules.md §5 for a replica that runs Update and Rollback only: it
    claims those and every kind no payload type knows (to fail them as invalid),
    oldest first across kinds, and leaves the known kinds it does not run."""
    order = ["Upload", "Update", "Mystery", "Upload", "", "Rollback", "Clone", "Update"]
    ids = await _pending_rows(queue, order)
    await queue.db.execute("DELETE FROM build_jobs WHERE NOT id = ANY($1)", ids)
    store = PgJobStore(queue.db, queue.config, runnable_kinds=frozenset({"Update", "Rollback"}),
                       known_kinds=frozenset(KINDS))
    claimed = [j.id for j in await store.claim(3)] + [j.id for j in await store.claim(10)]
    mine = [job_id for job_id, kind in zip(ids, order, strict=True)
            if kind not in ("Upload", "Clone")]
    assert claimed == mine
    assert await store.claim(5) == []
    left = {r["id"] for r in await queue.db.fetch(
        "SELECT id FROM build_jobs WHERE status = 'pending'")}
    assert left == {ids[0], ids[3], ids[6]}


async def test_the_claim_of_some_kinds_reads_only_their_rows(queue: Queue) -> None:
    """The claim's plan goes through build_jobs_pending_kind (0011), one kind at a
    time, never through the age-ordered index of every pending row, which made
    such a claim read the whole backlog of the kinds it leaves to others."""
    from nasiko_queue.db.statements import Q

    [update] = await _pending_rows(queue, ["Update"])
    await queue.db.execute(  # a backlog of 20,000 jobs of a kind it does not run
        "INSERT INTO build_jobs (agent_id, owner_id, payload) "
        "SELECT agent_id, owner_id, '{\"kind\": \"Upload\"}' FROM build_jobs, "
        "generate_series(1, 20000) WHERE id = $1", update)
    await queue.db.execute("ANALYZE build_jobs")

    async def plan(conn: Any) -> str:
        async with conn.transaction():
            await conn.execute("SET LOCAL plan_cache_mode = force_generic_plan")
            rows = await conn.fetch("EXPLAIN " + Q.job_claim_kinds, 1, ["Update"],
                                    list(KINDS), 1 << 20, None, None)
            return "\n".join(r[0] for r in rows)

    text = await queue.db.run(plan)
    assert "build_jobs_pending_kind" in text, text
    assert "build_jobs_work_queue" not in text, text
    assert "Seq Scan on build_jobs" not in text, text


async def test_a_worker_of_some_kinds_drains_them_through_the_batched_finish(
    queue: Queue,
) -> None:
    """The same claim inside `jobs_finish_many_and_claim_kinds`: a two-slot worker
    that runs Update only finishes every Update job and leaves the Uploads."""
    import attrs

    from nasiko_queue import Executors, Update

    from .helpers import running, succeed

    updates = [await enqueue_with_target(queue, "Update", prior_success=True)
               for _ in range(6)]
    uploads = [await enqueue_with_target(queue, "Upload") for _ in range(3)]
    executors = Executors()
    executors.register(Update, succeed)
    two = Queue(queue.db, config=attrs.evolve(queue.config, concurrency=2))
    async with running(two, executors) as worker:
        with trio.fail_after(30):
            await worker.wait_for(lambda s: s.done >= 6)
            await worker.drain_once()
    for job in updates:
        assert (await job_row(queue.db, job.job_id) or {})["status"] == "done"
    for job in uploads:
        assert (await job_row(queue.db, job.job_id) or {})["status"] == "pending"


async def test_a_row_with_an_enormous_kind_is_stored_and_claimed_as_unknown(
    queue: Queue,
) -> None:
    """Another writer's payload whose "kind" is 32,000 characters: the index of
    0011 holds only its first 100, so the row is stored (an index entry over 8 kB
    would refuse the insert) and a replica of some kinds claims it, to fail it."""
    [job_id] = await _pending_rows(queue, ["Update"])
    await queue.db.execute(  # random text: it does not compress below the limit
        "UPDATE build_jobs SET payload = jsonb_build_object('kind', (SELECT string_agg("
        "md5(random()::text), '') FROM generate_series(1, 1000))) WHERE id = $1", job_id)
    store = PgJobStore(queue.db, queue.config, runnable_kinds=frozenset({"Update"}),
                       known_kinds=frozenset(KINDS))
    assert [j.id for j in await store.claim(1)] == [job_id]
