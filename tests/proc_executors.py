"""
Executors for the process tests: ``nasiko-queue worker --executors tests.proc_executors:executors``.

A module of its own because the workers are real processes that import it by name.
Every run of every job is recorded in the `executions` table (the test creates it
with `EXECUTIONS_DDL`), with the worker's pid, so a test can count runs per job
across processes, including runs whose process was killed.

What a run does is chosen by the test through the job's label (`payload.label()`:
the agent or connector name), ``MODE[@ATTEMPTS][:ANYTHING]``:

* ``ok``: report success at once.
* ``work``: a simulated build of a few milliseconds, then success.
* ``gate``: wait until the test lets go of the advisory lock `GATE`, then success
  (a cross-process event: the executor blocks in PostgreSQL, nobody polls).
* ``hang``: mark the build 'building' and never return (until killed or cancelled).

With ``@1,2`` the mode applies on those attempts only; other attempts are ``ok``.
A run counts as *finished* when its build row says 'success': that write and the
run's ``finished_at`` are one statement, so they commit or vanish together.
"""

from __future__ import annotations

import os
from typing import Any

import trio

from nasiko_queue import Executors, JobContext
from nasiko_queue.builds.payloads import BUILTIN_PAYLOAD_TYPES

#: Advisory lock key of the ``gate`` mode (advisory locks are per database).
GATE = 7_4242

#: Seconds a ``work`` run takes: long enough that outages catch jobs mid-build.
WORK_SECONDS = 0.005

EXECUTIONS_DDL = """
CREATE TABLE executions (
    seq         bigserial PRIMARY KEY,
    job_id      uuid NOT NULL,
    build_id    uuid NOT NULL,
    attempt     integer NOT NULL,
    replica     text NOT NULL,
    started_at  timestamptz NOT NULL DEFAULT clock_timestamp(),
    finished_at timestamptz
);
"""

_START_AGENT = """
WITH b AS (UPDATE agent_builds SET status = 'building' WHERE id = $2 AND status = 'queued')
INSERT INTO executions (job_id, build_id, attempt, replica) VALUES ($1, $2, $3, $4)
RETURNING seq
"""
_START_CONNECTOR = """
WITH b AS (UPDATE mcp_connector_builds SET status = 'building'
           WHERE id = $2 AND status = 'pending')
INSERT INTO executions (job_id, build_id, attempt, replica) VALUES ($1, $2, $3, $4)
RETURNING seq
"""
_FINISH_AGENT = """
WITH b AS (UPDATE agent_builds SET status = 'success' WHERE id = $2)
UPDATE executions SET finished_at = clock_timestamp() WHERE seq = $1
"""
_FINISH_CONNECTOR = """
WITH b AS (UPDATE mcp_connector_builds SET status = 'success', completed_at = now()
           WHERE id = $2)
UPDATE executions SET finished_at = clock_timestamp() WHERE seq = $1
"""


def parse_mode(label: str, attempt: int) -> str:
    """The mode this attempt runs in (see the module's docstring)."""
    spec = label.split(":", 1)[0]
    mode, _, attempts = spec.partition("@")
    if mode not in ("ok", "work", "gate", "hang"):
        return "ok"
    if attempts and str(attempt) not in attempts.split(","):
        return "ok"
    return mode


async def record_and_run(ctx: JobContext[Any]) -> None:
    connector = ctx.target.connector_id is not None
    build_id = ctx.payload.build_id
    seq = await ctx.db.fetchval(
        _START_CONNECTOR if connector else _START_AGENT,
        ctx.job_id, build_id, ctx.attempt, f"pid{os.getpid()}",
    )
    mode = parse_mode(ctx.payload.label(), ctx.attempt)
    if mode == "hang":
        await trio.sleep_forever()
    elif mode == "gate":
        await ctx.db.execute("SELECT pg_advisory_xact_lock_shared($1)", GATE)
    elif mode == "work":
        await trio.sleep(WORK_SECONDS)  # the simulated build itself, not a wait for anything
    await ctx.db.execute(_FINISH_CONNECTOR if connector else _FINISH_AGENT, seq, build_id)


executors = Executors()
for _type in BUILTIN_PAYLOAD_TYPES:
    executors.register(_type, record_and_run)
