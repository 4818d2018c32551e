"""
Executors for the process tests of limits across replicas (test_limit_processes.py):
``nasiko-queue worker --executors tests.limit_executors:executors --queues api=N``.

Every run writes a ledger row (`limit_runs`) as it starts and stamps its end, with
the database's clock, so that a test can compute, across processes, how many
runs were under way at once and how many started in any window; a run whose
process is SIGKILLed keeps its row with no end.
"""

from __future__ import annotations

import os
from typing import ClassVar

import attrs
import trio

from nasiko_queue import Executors, JobArgs, JobOptions, PlainJobContext

#: Seconds a run takes: the simulated call itself, not a wait for anything.
WORK_SECONDS = 0.05

LEDGER_DDL = """
CREATE TABLE limit_runs (
    seq        bigserial PRIMARY KEY,
    job_id     uuid NOT NULL,
    attempt    integer NOT NULL,
    customer   text NOT NULL,
    replica    text NOT NULL,
    started_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    ended_at   timestamptz
);
"""


@attrs.frozen(kw_only=True)
class ApiCall(JobArgs):
    kind: ClassVar[str] = "limits_api_call"
    options: ClassVar[JobOptions] = JobOptions(queue="api", max_attempts=5)
    customer: str
    n: int = 0
    seconds: float = WORK_SECONDS


executors = Executors()


@executors.register(ApiCall)
async def call(ctx: PlainJobContext[ApiCall]) -> None:
    seq = await ctx.db.fetchval(
        "INSERT INTO limit_runs (job_id, attempt, customer, replica) VALUES ($1, $2, $3, $4) "
        "RETURNING seq", ctx.job_id, ctx.attempt, ctx.payload.customer, f"pid{os.getpid()}")
    await trio.sleep(ctx.payload.seconds)
    await ctx.db.execute("UPDATE limit_runs SET ended_at = clock_timestamp() WHERE seq = $1",
                         seq)
