"""
How the run views' statements scale with the number of workflow runs (issue #22).

    python -m benchmarks.run_views_scale postgresql://.../scratch_db [RUNS]

Migrates the (scratch!) database, fills it with RUNS runs (default 200,000: 5
workflows, 1% failed, 2% running, the rest completed, one a second) of two
steps each, with a completed step job per step, ANALYZEs, then times each
statement the runs listing, a run's view and `/metrics` send (median of 5
after a warm-up, as `benchmarks.dashboard_scale` does), then the same as
generic plans, then without migration 0021's indexes (dropped, then built
again), to show what they are for.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

import trio

from nasiko_queue.admin.runs import run_detail
from nasiko_queue.db.database import Database, open_database
from nasiko_queue.db.migrate import migrate
from nasiko_queue.db.statements import Q


async def timed(db: Any, sql: str, args: Sequence[Any]) -> tuple[float, str]:
    """Median of 5 after a warm-up, in ms, and the plan's scans."""
    await db.fetch(sql, *args)
    took = []
    for _ in range(5):
        started = time.perf_counter()
        await db.fetch(sql, *args)
        took.append(time.perf_counter() - started)
    plan = await db.fetchval("EXPLAIN (FORMAT JSON)\n" + sql, *args)
    scans: list[str] = []

    def walk(n: dict[str, Any]) -> None:
        if "Scan" in n["Node Type"] and "Relation Name" in n:
            scans.append(f"{n['Node Type']} {n.get('Index Name') or n['Relation Name']}")
        for child in n.get("Plans", ()):
            walk(child)

    walk((json.loads(plan) if isinstance(plan, str) else plan)[0]["Plan"])
    return statistics.median(took) * 1000, "; ".join(dict.fromkeys(scans))

RUNS = """
INSERT INTO nasiko_queue_workflow_runs (id, workflow, definition, state, created_at,
                                        finished_at, failed_step, error)
SELECT gen_random_uuid(), 'wf' || (g % 5),
       '{"steps": [{"name": "a", "kind": "job", "after": []},
                   {"name": "b", "kind": "job", "after": ["a"]}]}',
       CASE WHEN g % 100 = 0 THEN 'failed' WHEN g % 50 = 1 THEN 'running' ELSE 'completed' END,
       now() - make_interval(secs => $1 - g),
       CASE WHEN g % 50 <> 1 THEN now() - make_interval(secs => $1 - g - 1) END,
       CASE WHEN g % 100 = 0 THEN 'b' END, CASE WHEN g % 100 = 0 THEN 'boom' END
FROM generate_series(1, $1) AS g
"""
STEPS = """
INSERT INTO nasiko_queue_workflow_steps (run_id, step, idx, state, job_id)
SELECT r.id, s, 0, CASE WHEN r.state = 'completed' THEN 'completed' ELSE 'blocked' END,
       gen_random_uuid()
FROM nasiko_queue_workflow_runs AS r, unnest(ARRAY['a', 'b']) AS s
"""
JOBS = """
INSERT INTO nasiko_queue_jobs (id, queue, kind, payload, state, max_attempts, workflow_run,
                               attempted_at, finished_at, attempt)
SELECT s.job_id, 'workflows', r.workflow || '.' || s.step,
       jsonb_build_object('kind', r.workflow || '.' || s.step, 'run', r.id::text,
                          'step', s.step, 'idx', 0),
       'completed', 3, r.id, r.created_at, r.created_at, 1
FROM nasiko_queue_workflow_steps AS s JOIN nasiko_queue_workflow_runs AS r ON r.id = s.run_id
"""
INDEXES = {
    "nasiko_queue_workflow_runs_started":
        "CREATE INDEX nasiko_queue_workflow_runs_started "
        "ON nasiko_queue_workflow_runs (created_at, id)",
    "nasiko_queue_jobs_workflow_run":
        "CREATE INDEX nasiko_queue_jobs_workflow_run ON nasiko_queue_jobs (workflow_run) "
        "WHERE workflow_run IS NOT NULL",
}


def cases(run_id: Any) -> list[tuple[str, str, Sequence[Any]]]:
    return [
        ("runs: first page", Q.workflow_runs_list, (None, None, None, None, 50)),
        ("runs: failed, first page", Q.workflow_runs_list, (None, "failed", None, None, 50)),
        ("runs: wf1 running, first page", Q.workflow_runs_list,
         ("wf1", "running", None, None, 50)),
        ("run: workflow_run_jobs", Q.workflow_run_jobs, (run_id,)),
        ("run: workflow_get_steps", Q.workflow_get_steps, (run_id,)),
        ("metrics: metrics_workflow_runs (exact, scans)", Q.metrics_workflow_runs, ()),
    ]


async def report(db: Database, run_id: Any) -> None:
    for name, sql, args in cases(run_id):
        ms, plan = await timed(db, sql, args)
        print(f"{ms:9.1f} ms  {name}  [{plan}]")
    took = []
    for _ in range(5):
        started = time.perf_counter()
        await run_detail(db, run_id)
        took.append(time.perf_counter() - started)
    print(f"{statistics.median(took) * 1000:9.1f} ms  run_detail (every statement of a run's view)")


async def main(dsn: str, runs: int) -> None:
    async with open_database(dsn) as db:
        await migrate(db)
        if await db.fetchval("SELECT count(*) FROM nasiko_queue_workflow_runs") == 0:
            started = time.perf_counter()
            for sql in (RUNS, STEPS, JOBS):
                await db.execute(sql, *((runs,) if sql is RUNS else ()))
            print(f"filled {runs} runs in {time.perf_counter() - started:.1f} s")
        for table in ("nasiko_queue_workflow_runs", "nasiko_queue_workflow_steps",
                      "nasiko_queue_jobs"):
            await db.execute(f"VACUUM ANALYZE {table}")
        run_id = await db.fetchval("SELECT id FROM nasiko_queue_workflow_runs "
                                   "ORDER BY created_at DESC OFFSET 1000 LIMIT 1")
        print(f"nasiko_queue_workflow_runs: "
              f"{await db.fetchval('SELECT count(*) FROM nasiko_queue_workflow_runs')} rows")
        await report(db, run_id)
        print("generic plans (plan_cache_mode = force_generic_plan):")
        async with db.transaction() as tx:
            await tx.execute("SET LOCAL plan_cache_mode = force_generic_plan")
            for name, sql, args in cases(run_id)[:4]:
                ms, plan = await timed(tx, sql, args)
                print(f"{ms:9.1f} ms  {name}  [{plan}]")
        print("without migration 0021's indexes:")
        for name in INDEXES:
            await db.execute(f"DROP INDEX {name}")
        try:
            await report(db, run_id)
        finally:
            for sql in INDEXES.values():
                await db.execute(sql)


if __name__ == "__main__":
    trio.run(main, sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 200_000)
