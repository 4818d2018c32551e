"""
Terminalization: drive a job's target to a state that will never change again.

When a job fails for good (attempt cap, invalid payload, last panic, exhausted
stuck job), nobody will ever finish its agent or connector. Left alone, the
agent would stay 'deploying' and its build 'building' forever, and every client
waiting on them would wait forever (the original's RUN-4 bug). docs/rules.md §6.

The functions here run on the asyncio side with one connection, inside the
transaction that also marks the job failed: either both happen or neither does,
so a database error in the "any successful build?" check deletes nothing.
"""

from __future__ import annotations

import logging
from uuid import UUID

import asyncpg

from ..db.statements import Q

log = logging.getLogger("nasiko_queue.terminalize")


async def terminalize_agent(
    conn: asyncpg.Connection, agent_id: UUID, own_build_id: UUID | None
) -> str:
    """
    Fail the agent's unfinished builds, then fail or delete the agent.

    Builds in 'building', and this job's own build if still 'queued', become
    'failed'. An agent that has ever built successfully keeps its row and, if it
    was 'deploying', becomes 'failed' (a running agent stays running). One that
    never built is deleted, which cascades to its builds and jobs. Returns what
    happened: 'failed', 'kept' or 'deleted'.
    """
    await conn.execute(Q.agent_builds_fail_unfinished, agent_id, own_build_id)
    if await conn.fetchval(Q.agent_has_success, agent_id):
        done = await conn.execute(Q.agent_mark_failed, agent_id)
        outcome = "failed" if done.endswith(" 1") else "kept"
    else:
        await conn.execute(Q.agent_delete, agent_id)
        outcome = "deleted"
    log.info("agent %s terminalized: %s", agent_id, outcome)
    return outcome


async def terminalize_connector(conn: asyncpg.Connection, connector_id: UUID) -> str:
    """
    Fail the connector's pending and building builds, then fail or delete it.

    A connector with a successful build keeps its row and becomes 'failed' only
    if it was still pending or building; one that never built is deleted (with
    its builds and jobs). Returns 'failed', 'kept' or 'deleted'.
    """
    await conn.execute(Q.connector_builds_fail_unfinished, connector_id)
    if await conn.fetchval(Q.connector_has_success, connector_id):
        done = await conn.execute(Q.connector_mark_failed, connector_id)
        outcome = "failed" if done.endswith(" 1") else "kept"
    else:
        await conn.execute(Q.connector_delete, connector_id)
        outcome = "deleted"
    log.info("connector %s terminalized: %s", connector_id, outcome)
    return outcome


async def terminalize_target(
    conn: asyncpg.Connection,
    agent_id: UUID | None,
    connector_id: UUID | None,
    own_build_id: UUID | None,
) -> str | None:
    """Terminalize whichever target the job row names; None if it names none."""
    if agent_id is not None:
        return await terminalize_agent(conn, agent_id, own_build_id)
    if connector_id is not None:
        return await terminalize_connector(conn, connector_id)
    return None
