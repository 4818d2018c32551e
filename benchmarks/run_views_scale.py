"""
How the run views' statements scale with the number of workflow runs (issue #22)
and with the size of one run (issue #45).

    python -m benchmarks.run_views_scale postgresql://.../scratch_db [RUNS [ITEMS]]

Migrates the (scratch!) database, fills it with RUNS runs (default 200,000: 5
workflows, 1% failed, 2% running, the rest completed, one a second) of two
steps each, with a completed step job per step, and one run whose mapped step
fanned out to ITEMS items (default 20,000), each item's job with two kept
errors; ANALYZEs, then times each statement the runs listing, a run's view
and `/metrics` send (median of 5 after a warm-up, as
`benchmarks.dashboard_scale` does), for a two-step run and for the fan-out
(its first page and a page deep into it), then the whole view (`run_detail`)
and the dashboard's `/runs/<id>` page of the fan-out (time and size), then
the same statements as generic plans, then without migration 0021's indexes
(dropped, then built again), to show what they are for.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

import httpx
import trio

from nasiko_queue.admin.runs import run_detail
from nasiko_queue.db.database import Database, open_database
from nasiko_queue.db.migrate import migrate
from nasiko_queue.db.statements import Q
from nasiko_queue.web.dashboard import dashboard_app


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
FANOUT = """
WITH run AS (
    INSERT INTO nasiko_queue_workflow_runs (id, workflow, definition, state, created_at,
                                            finished_at)
    VALUES (gen_random_uuid(), 'fan',
            '{"steps": [{"name": "plan", "kind": "job", "after": []},
                        {"name": "each", "kind": "job", "after": ["plan"],
                         "map_over": "plan"}]}',
            'completed', now(), now())
    RETURNING id
), jobs AS (
    INSERT INTO nasiko_queue_jobs (id, queue, kind, payload, state, max_attempts, workflow_run,
                                   attempted_at, finished_at, attempt, result)
    SELECT gen_random_uuid(), 'workflows', 'fan.' || CASE WHEN g < 0 THEN 'plan' ELSE 'each' END,
           jsonb_build_object('kind', 'fan', 'run', run.id::text,
                              'step', CASE WHEN g < 0 THEN 'plan' ELSE 'each' END,
                              'idx', greatest(g, 0)),
           'completed', 3, run.id, now(), now(), 3,
           CASE WHEN g < 0 THEN to_jsonb($1::int) ELSE jsonb_build_object('item', g) END
    FROM run, generate_series(-1, $1 - 1) AS g
    RETURNING id, workflow_run, payload, result
), steps AS (
    INSERT INTO nasiko_queue_workflow_steps (run_id, step, idx, state, job_id, result)
    SELECT workflow_run, payload ->> 'step', (payload ->> 'idx')::int, 'completed', id, result
    FROM jobs
    UNION ALL
    SELECT run.id, 'each', -1, 'completed', NULL,
           (SELECT jsonb_agg(jsonb_build_object('item', g)) FROM generate_series(0, $1 - 1) g)
    FROM run
)
INSERT INTO nasiko_queue_job_errors (job_id, attempt, reason, error_type, message, traceback)
SELECT jobs.id, a, 'crash', 'builtins.RuntimeError', 'rate limited (attempt ' || a || ')',
       repeat('Traceback line' || chr(10), 10)
FROM jobs, generate_series(1, 2) AS a
WHERE jobs.payload ->> 'step' = 'each'
"""
INDEXES = {
    "nasiko_queue_workflow_runs_started":
        "CREATE INDEX nasiko_queue_workflow_runs_started "
        "ON nasiko_queue_workflow_runs (created_at, id)",
    "nasiko_queue_jobs_workflow_run":
        "CREATE INDEX nasiko_queue_jobs_workflow_run ON nasiko_queue_jobs (workflow_run) "
        "WHERE workflow_run IS NOT NULL",
}


def cases(run_id: Any, fan: Any, deep: Any) -> list[tuple[str, str, Sequence[Any]]]:
    return [
        ("runs: first page", Q.workflow_runs_list, (None, None, None, None, 50)),
        ("runs: failed, first page", Q.workflow_runs_list, (None, "failed", None, None, 50)),
        ("runs: wf1 running, first page", Q.workflow_runs_list,
         ("wf1", "running", None, None, 50)),
        ("run: workflow_run_jobs_page", Q.workflow_run_jobs_page,
         (run_id, None, None, None, 50)),
        ("fan-out: workflow_run_jobs_page, first", Q.workflow_run_jobs_page,
         (fan, None, None, None, 50)),
        ("fan-out: workflow_run_jobs_page, deep", Q.workflow_run_jobs_page, (fan, *deep, 50)),
        ("run: workflow_step_heads", Q.workflow_step_heads, (run_id,)),
        ("fan-out: workflow_step_heads", Q.workflow_step_heads, (fan,)),
        ("run: workflow_run_counts", Q.workflow_run_counts, (run_id,)),
        ("fan-out: workflow_run_counts (exact, all its rows)", Q.workflow_run_counts, (fan,)),
        ("metrics: metrics_workflow_runs (exact, scans)", Q.metrics_workflow_runs, ()),
    ]


async def report(db: Database, run_id: Any, fan: Any, deep: Any) -> None:
    for name, sql, args in cases(run_id, fan, deep):
        ms, plan = await timed(db, sql, args)
        print(f"{ms:9.1f} ms  {name}  [{plan}]")
    for name, rid in (("a two-step run", run_id), ("the fan-out", fan)):
        took = []
        for _ in range(5):
            started = time.perf_counter()
            await run_detail(db, rid)
            took.append(time.perf_counter() - started)
        print(f"{statistics.median(took) * 1000:9.1f} ms  run_detail of {name} "
              "(every statement of a run's view, first page)")
    app = dashboard_app(db, token=None)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://bench") as client:
        took, size = [], 0
        for _ in range(5):
            started = time.perf_counter()
            page = await client.get(f"/runs/{fan}")
            took.append(time.perf_counter() - started)
            size = len(page.content)
        rows = page.text.count('class="step-job')
        print(f"{statistics.median(took) * 1000:9.1f} ms  GET /runs/<fan-out> "
              f"({size / 1000:.1f} kB, {rows} job rows)")


async def main(dsn: str, runs: int, items: int) -> None:
    async with open_database(dsn) as db:
        await migrate(db)
        if await db.fetchval("SELECT count(*) FROM nasiko_queue_workflow_runs") == 0:
            started = time.perf_counter()
            for sql in (RUNS, STEPS, JOBS):
                await db.execute(sql, *((runs,) if sql is RUNS else ()))
            await db.execute(FANOUT, items)
            print(f"filled {runs} runs and a fan-out of {items} items "
                  f"in {time.perf_counter() - started:.1f} s")
        for table in ("nasiko_queue_workflow_runs", "nasiko_queue_workflow_steps",
                      "nasiko_queue_jobs", "nasiko_queue_job_errors"):
            await db.execute(f"VACUUM ANALYZE {table}")
        run_id = await db.fetchval("SELECT id FROM nasiko_queue_workflow_runs "
                                   "WHERE workflow <> 'fan' "
                                   "ORDER BY created_at DESC OFFSET 1000 LIMIT 1")
        fan = await db.fetchval("SELECT id FROM nasiko_queue_workflow_runs "
                                "WHERE workflow = 'fan'")
        deep_row = await db.fetchrow(
            "SELECT created_at, (payload ->> 'idx')::int AS idx, id FROM nasiko_queue_jobs "
            "WHERE workflow_run = $1 AND payload ->> 'step' = 'each' "
            "ORDER BY (payload ->> 'idx')::int DESC OFFSET 100 LIMIT 1", fan)
        deep = (deep_row["created_at"], deep_row["idx"], deep_row["id"])
        n_runs = await db.fetchval("SELECT count(*) FROM nasiko_queue_workflow_runs")
        n_fan = await db.fetchval("SELECT count(*) FROM nasiko_queue_jobs "
                                  "WHERE workflow_run = $1", fan)
        print(f"nasiko_queue_workflow_runs: {n_runs} rows; the fan-out: {n_fan} jobs")
        await report(db, run_id, fan, deep)
        print("generic plans (plan_cache_mode = force_generic_plan):")
        async with db.transaction() as tx:
            await tx.execute("SET LOCAL plan_cache_mode = force_generic_plan")
            for name, sql, args in cases(run_id, fan, deep)[:6]:
                ms, plan = await timed(tx, sql, args)
                print(f"{ms:9.1f} ms  {name}  [{plan}]")
        print("without migration 0021's indexes:")
        for name in INDEXES:
            await db.execute(f"DROP INDEX {name}")
        try:
            await report(db, run_id, fan, deep)
        finally:
            for sql in INDEXES.values():
                await db.execute(sql)


if __name__ == "__main__":
    trio.run(main, sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 200_000,
             int(sys.argv[3]) if len(sys.argv) > 3 else 20_000)
