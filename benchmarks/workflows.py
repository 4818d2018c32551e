"""
The workflow workload (issue #22): chains of five steps, each a plain job whose
completion enqueues the next in the same transaction (the trigger of migration
0018), against a plain-job drain of as many jobs measured right before it, at
the same concurrency, in the same process.

Figures:

* **drain**: `runs` runs started up front, one in-process worker (concurrency
  `concurrency`) runs them to their end: runs/s and steps/s, and steps/s as a
  ratio to the plain drain's jobs/s (what a step costs over a plain job: reading
  its inputs, the transition in the completion).
* **transition latency**: one step's job completion to the next step's job
  start, from the jobs' own timestamps (the next job's `attempted_at`, its
  claim, minus the previous job's `finished_at`, its completion: both the
  server's clock at the start of their transactions), p50/p99. Taken twice: in
  the drain above (a step queues behind the other runs' steps), and over
  `serial_runs` runs started one after another on an idle worker, where it is
  the wake path alone (the completion's commit, its NOTIFY, the claim).
"""

from __future__ import annotations

import time
from collections import defaultdict
from datetime import datetime
from typing import Any

import trio

from nasiko_queue import Executors, PlainJobContext, Queue, StepContext, Workflow, open_database
from nasiko_queue.engine.worker import Worker

from .plain import BenchPing
from .workloads import _bench_config, _percentiles, _sql, reset_jobs

#: Steps of one run, in a chain.
CHAIN_STEPS = 5


def chain_workflow() -> Workflow:
    wf = Workflow("bench_chain")
    previous = None
    for i in range(1, CHAIN_STEPS + 1):
        async def step(ctx: StepContext, i: int = i) -> int:
            return i

        previous = wf.step(name=f"s{i}", after=[] if previous is None else [previous])(step)
    return wf


def _executors(wf: Workflow) -> Executors:
    ex = Executors()
    ex.register_workflow(wf)

    @ex.register(BenchPing)
    async def noop(ctx: PlainJobContext[BenchPing]) -> None:
        return None

    return ex


def _reset(dsn: str) -> None:
    reset_jobs(dsn)
    _sql(dsn, "TRUNCATE nasiko_queue_workflow_runs CASCADE")


def _transitions(rows: list[Any]) -> list[float]:
    """Seconds from each step's completion to the next step's claim, per run."""
    by_run: dict[Any, dict[int, tuple[datetime, datetime]]] = defaultdict(dict)
    for r in rows:
        by_run[r["workflow_run"]][int(r["step"][1:])] = (r["attempted_at"], r["finished_at"])
    gaps = []
    for steps in by_run.values():
        for i in range(2, CHAIN_STEPS + 1):
            gaps.append((steps[i][0] - steps[i - 1][1]).total_seconds())
    return gaps


async def _timestamps(queue: Queue) -> list[float]:
    rows = await queue.db.fetch(
        "SELECT workflow_run, payload->>'step' AS step, attempted_at, finished_at "
        "FROM nasiko_queue_jobs WHERE workflow_run IS NOT NULL AND state = 'completed'")
    return _transitions(rows)


def workflow_drain(dsn: str, runs: int, concurrency: int, serial_runs: int) -> dict[str, Any]:
    """The plain drain, the workflow drain and the serial runs (see the module)."""
    wf = chain_workflow()
    ex = _executors(wf)
    jobs = runs * CHAIN_STEPS

    async def drain(queue: Queue, want: int) -> float:
        worker = Worker(queue, ex)
        async with trio.open_nursery() as nursery:
            t0 = time.perf_counter()
            await nursery.start(worker.run)
            await worker.wait_for(lambda s: s.done + s.failed >= want)
            elapsed = time.perf_counter() - t0
            worker.stop()
        if worker.stats.failed:
            raise RuntimeError(f"workflow drain: {worker.stats.failed} jobs failed")
        return elapsed

    async def main() -> dict[str, Any]:
        async with open_database(dsn) as db:
            queue = Queue(db, config=_bench_config(concurrency=concurrency))
            # The plain drain: as many jobs as the runs have steps.
            await queue.enqueue_many([BenchPing(n=i) for i in range(jobs)])
            plain = jobs / await drain(queue, jobs)

            async with db.transaction() as tx:
                for i in range(runs):
                    await queue.start(wf, {"n": i}, tx=tx)
            elapsed = await drain(queue, jobs)
            done = await db.fetchval("SELECT count(*) FROM nasiko_queue_workflow_runs "
                                     "WHERE state = 'completed'")
            if done != runs:
                raise RuntimeError(f"workflow drain: {done} of {runs} runs completed")
            loaded = await _timestamps(queue)

            await db.execute("TRUNCATE nasiko_queue_workflow_runs CASCADE")
            await db.execute("DELETE FROM nasiko_queue_jobs")
            worker = Worker(queue, ex)
            async with trio.open_nursery() as nursery:
                await nursery.start(worker.run)
                for i in range(serial_runs):
                    run_id = await queue.start(wf, {"n": i})
                    # Bounded: a smoke test that breaks fails instead of hanging.
                    await queue.run_result(run_id, timeout=60.0)
                worker.stop()
            idle = await _timestamps(queue)
        steps_per_s = jobs / elapsed
        return {"runs": runs, "steps_per_run": CHAIN_STEPS, "concurrency": concurrency,
                "plain_jobs_per_s": plain, "runs_per_s": runs / elapsed,
                "steps_per_s": steps_per_s, "steps_vs_plain": steps_per_s / plain,
                "transition_loaded": _percentiles(loaded),
                "serial_runs": serial_runs, "transition_idle": _percentiles(idle)}

    _reset(dsn)
    try:
        return trio.run(main)
    finally:
        _reset(dsn)


# -- fan-out (issue #45) ---------------------------------------------------------------


def fan_out_workflow(items: int) -> Workflow:
    """`plan` returns `items` numbers, `work` maps over them (a no-op each), `join`
    gets their results."""
    wf = Workflow(f"bench_fan_{items}")

    @wf.step()
    async def plan(ctx: StepContext) -> list[int]:
        return list(range(items))

    @wf.step(map_over=plan)
    async def work(ctx: StepContext) -> int:
        return int(ctx.item)

    @wf.step(after=[work])
    async def join(ctx: StepContext) -> int:
        return len(ctx.results["work"])

    return wf


def fan_out(dsn: str, items: int, concurrency: int) -> dict[str, Any]:
    """
    One run whose `plan` step returns `items` items, on one in-process worker at
    `concurrency` (default settings otherwise). From the jobs' own timestamps
    (the server's clock), seconds from the plan step's end (its job's
    `finished_at`) to: the first item's start (the first `attempted_at` among
    the items), the last item's enqueue (the fan-out's last piece landed), and
    the join's start (`join`'s `attempted_at`: every item ran, the join was
    made). Also the worst statement of the worker's own (claims and finishes):
    the longest `attempted_at` to `finished_at` is not it, so the lanes'
    statements are not timed here; the transition service's pieces are counted.
    """
    wf = fan_out_workflow(items)
    ex = _executors(wf)

    async def main() -> dict[str, Any]:
        async with open_database(dsn) as db:
            queue = Queue(db, config=_bench_config(concurrency=concurrency))
            worker = Worker(queue, ex)
            t0 = time.perf_counter()
            async with trio.open_nursery() as nursery:
                await nursery.start(worker.run)
                run_id = await queue.start(wf, None)
                result = await queue.run_result(run_id, timeout=3600.0)
                worker.stop()
            wall = time.perf_counter() - t0
            if result != items:
                raise RuntimeError(f"fan-out: the join got {result!r}, not {items}")
            row = await db.fetchrow(
                """
                WITH jobs AS (
                    SELECT payload ->> 'step' AS step, created_at, attempted_at, finished_at
                    FROM nasiko_queue_jobs WHERE workflow_run = $1
                ), p AS (SELECT finished_at AS at FROM jobs WHERE step = 'plan'),
                w AS (SELECT min(attempted_at) AS first, max(created_at) AS last_enqueued,
                             max(finished_at) AS last_done FROM jobs WHERE step = 'work'),
                j AS (SELECT created_at, attempted_at FROM jobs WHERE step = 'join')
                SELECT extract(epoch FROM w.first - p.at) AS first_item,
                       extract(epoch FROM w.last_enqueued - p.at) AS last_enqueue,
                       extract(epoch FROM j.attempted_at - p.at) AS join_start,
                       extract(epoch FROM j.created_at - w.last_done) AS join_made
                FROM p, w, j
                """, run_id)
            assert row is not None
            service = worker.transitions
            return {"items": items, "concurrency": concurrency, "wall_s": wall,
                    "first_item_s": float(row["first_item"]),
                    "last_enqueue_s": float(row["last_enqueue"]),
                    "join_start_s": float(row["join_start"]),
                    "last_item_to_join_s": float(row["join_made"]),
                    "service_pieces": None if service is None else service.pieces,
                    "items_per_s": items / float(row["join_start"])}

    _reset(dsn)
    try:
        return trio.run(main)
    finally:
        _reset(dsn)


if __name__ == "__main__":
    import json
    import sys

    # python -m benchmarks.workflows DSN [ITEMS ...]: the fan-out rows.
    target = sys.argv[1]
    for size in [int(a) for a in sys.argv[2:]] or [10_000, 100_000]:
        print(json.dumps(fan_out(target, size, concurrency=10)), flush=True)
