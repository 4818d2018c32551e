"""
Lock order (issue #9): replicas failing jobs of the same targets never deadlock.

Failing a job for good locks its row, then terminalizes its target; deleting an
agent that never built cascades to its other jobs' rows. Two replicas failing
two jobs of one agent used to lock job row → builds → agent in opposite orders
(109 deadlocks for 300 agents × 2 jobs on 2 replicas), each costing
`deadlock_timeout` and, in the sweep, the whole tick. Now every such
transaction locks the target first.
"""

from __future__ import annotations

import contextlib
import uuid

import attrs
import pytest
import trio

from nasiko_queue import Database, Queue, Worker, open_database
from nasiko_queue.builds.store import PgJobStore
from nasiko_queue.testing import KINDS, insert_agent, insert_agent_build, make_payload

from .conftest import FAST, MASTER_KEY
from .helpers import TEST_DEADLINE, LogEvent, executors_for_all, succeed

AGENTS = 120


#: An application trigger that takes a moment (an audit log, say). It widens the
#: window in which two terminalizations of one agent overlap, as two processes on
#: two machines would, so that the test does not depend on the scheduler's luck.
SLOW_BUILD_TRIGGER = """
CREATE FUNCTION audit_build() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN PERFORM pg_sleep(0.02); RETURN NEW; END;
$$;
CREATE TRIGGER audit_build BEFORE UPDATE ON agent_builds
    FOR EACH ROW EXECUTE FUNCTION audit_build();
"""


async def _many_agents_with_doomed_jobs(db: Database, queue: Queue) -> list[uuid.UUID]:
    """Per agent (never built): two pending jobs out of attempts, one after the
    other in claim order, and one exhausted job stuck in progress for the sweep;
    all committed at once."""
    agents = []
    async with db.transaction() as tx:
        for n in range(AGENTS):
            owner = uuid.uuid4()
            agent = await insert_agent(tx, owner_id=owner, name=f"a{n}")
            build = await insert_agent_build(tx, agent)
            payload = make_payload("Upload", target_id=agent, build_id=build, owner_id=owner)
            for status in ("pending", "pending", "in_progress"):
                job = await queue.enqueue(payload, tx=tx)
                await tx.execute(
                    "UPDATE build_jobs SET status = $2, attempt = 3, picked_at = "
                    "CASE WHEN $2 = 'in_progress' THEN now() - interval '2 hours' END "
                    "WHERE id = $1", job, status)
            agents.append(agent)
    return agents


@pytest.mark.slow
async def test_replicas_failing_jobs_of_the_same_targets_never_deadlock(dsn: str) -> None:
    """Three replicas (a pool each, four slots each) fail 240 capped jobs of 120
    agents while two sweeps fail the agents' stuck jobs: every agent is deleted once,
    no job is left, and PostgreSQL reports no deadlock to anyone."""
    config = attrs.evolve(FAST, concurrency=4)
    kinds = frozenset(KINDS)
    with LogEvent("deadlock") as deadlocks, trio.fail_after(TEST_DEADLINE):
        async with open_database(dsn) as setup_db, contextlib.AsyncExitStack() as pools:
            setup = Queue(setup_db, config=FAST, secrets=MASTER_KEY)
            await setup_db.execute(SLOW_BUILD_TRIGGER)
            dbs = [await pools.enter_async_context(open_database(dsn)) for _ in range(3)]
            workers = [Worker(Queue(db, config=config, secrets=MASTER_KEY),
                              executors_for_all(succeed)) for db in dbs]
            async with trio.open_nursery() as replicas:
                for worker in workers:
                    await replicas.start(worker.run)
                # The jobs arrive once the replicas run (their startup sweeps would
                # otherwise take every agent before any claim).
                agents = await _many_agents_with_doomed_jobs(setup_db, setup)
                async with trio.open_nursery() as drains:
                    for worker in workers:
                        drains.start_soon(worker.drain_once)
                    for _ in range(2):
                        store = PgJobStore(setup_db, FAST, runnable_kinds=kinds,
                                           known_kinds=kinds)
                        drains.start_soon(store.recover)
                for worker in workers:
                    worker.stop()
            left = await setup_db.fetchval("SELECT count(*) FROM build_jobs")
            kept = await setup_db.fetchval("SELECT count(*) FROM agents WHERE id = ANY($1)",
                                           agents)
    assert deadlocks.count == 0
    assert (left, kept) == (0, 0)
