"""
Workflows for the workflow process tests (tests/test_workflow_processes.py):
``nasiko-queue worker --executors tests.wf_proc_executors:executors``.

A module of its own because the workers are real processes that import it by
name. Every run of every step is recorded by the step itself in the `wf_ledger`
table (the test creates it with `LEDGER_DDL`), with the worker's pid, the
attempt, what the step received from the steps before it, and the database's
clock at its start and end; so a test counts runs per step across processes,
including runs whose process was killed, and compares their starts with their
run's end on one clock.

The shape (`make_workflow`): ``prepare`` returns a list of ``items`` strings;
``work`` maps over it (one job per item); ``gather`` is the fan-in (gets the
items' results in item order); ``publish`` ends the chain. Where a run stops
is chosen by the test through the run's input: ``{"items": N, "gate":
"work:2"}`` makes the first attempt of that step (``step`` or ``step:index``)
wait for the advisory lock `GATE` the test holds, a cross-process event: the
step blocks in PostgreSQL, nobody polls, and the kill lands mid-step.
"""

from __future__ import annotations

import json
import os
from typing import Any

from nasiko_queue import Executors, StepContext, Workflow

from .proc_executors import GATE

LEDGER_DDL = """
CREATE TABLE wf_ledger (
    seq         bigserial PRIMARY KEY,
    run_id      uuid NOT NULL,
    step        text NOT NULL,
    idx         integer NOT NULL,
    job_id      uuid NOT NULL,
    attempt     integer NOT NULL,
    replica     text NOT NULL,
    received    jsonb,
    started_at  timestamptz NOT NULL DEFAULT clock_timestamp(),
    finished_at timestamptz
);
"""

_START = """
INSERT INTO wf_ledger (run_id, step, idx, job_id, attempt, replica, received)
VALUES ($1, $2, $3, $4, $5, $6, $7::jsonb) RETURNING seq
"""
_FINISH = "UPDATE wf_ledger SET finished_at = clock_timestamp() WHERE seq = $1"

#: The workflow whose steps are retried after a kill, and the one whose steps
#: have one attempt only (a kill fails the run).
NAME = "wfkill"
FRAGILE_NAME = "wfkill_fragile"


def item_result(item: str, index: int) -> str:
    """What ``work`` returns for an item: the fan-in's expected list is built from it."""
    return f"{item}@{index}"


async def _record(ctx: StepContext, received: Any) -> int:
    """The ledger row of this run of the step; blocks at the gate if it names this run."""
    job = ctx.job
    idx = 0 if ctx.index is None else ctx.index
    seq: int = await job.db.fetchval(_START, ctx.run_id, ctx.step, idx, job.job_id,
                                     job.attempt, f"pid{os.getpid()}", json.dumps(received))
    gate = ctx.input.get("gate")
    here = ctx.step if ctx.index is None else f"{ctx.step}:{ctx.index}"
    if gate == here and job.attempt == 1:
        await job.db.execute("SELECT pg_advisory_xact_lock_shared($1)", GATE)
    return seq


async def _done(ctx: StepContext, seq: int) -> None:
    await ctx.job.db.execute(_FINISH, seq)


def make_workflow(name: str, max_attempts: int) -> Workflow:
    wf = Workflow(name, max_attempts=max_attempts)

    @wf.step()
    async def prepare(ctx: StepContext) -> list[str]:
        seq = await _record(ctx, None)
        await _done(ctx, seq)
        return [f"i{k}" for k in range(ctx.input["items"])]

    @wf.step(map_over=prepare)
    async def work(ctx: StepContext) -> str:
        seq = await _record(ctx, ctx.item)
        assert ctx.index is not None
        await _done(ctx, seq)
        return item_result(ctx.item, ctx.index)

    @wf.step(after=[work])
    async def gather(ctx: StepContext) -> list[str]:
        seq = await _record(ctx, ctx.results["work"])
        await _done(ctx, seq)
        results: list[str] = ctx.results["work"]
        return results

    @wf.step(after=[gather])
    async def publish(ctx: StepContext) -> str:
        seq = await _record(ctx, ctx.results["gather"])
        await _done(ctx, seq)
        return f"published {len(ctx.results['gather'])}"

    return wf


WORKFLOW = make_workflow(NAME, max_attempts=3)
FRAGILE = make_workflow(FRAGILE_NAME, max_attempts=1)

executors = Executors()
executors.register_workflow(WORKFLOW)
executors.register_workflow(FRAGILE)
