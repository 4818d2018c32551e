"""
How the dashboard's statements scale with finished history (issue #21).

    python -m benchmarks.dashboard_scale postgresql://.../scratch_db [ROWS]

Migrates the (scratch!) database, fills `nasiko_queue_jobs` with ROWS finished
plain jobs (default 1,000,000: completed, discarded and cancelled over 30 days,
8 queues, 4 kinds) plus 200 waiting, 20 scheduled and 10 running ones, ANALYZEs,
then times each statement a dashboard page sends (median of 5 runs, after one
warm-up) and prints the plan's top node. Nothing else is touched.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import trio

from nasiko_queue.db.database import Database, Transaction, open_database
from nasiko_queue.db.migrate import migrate
from nasiko_queue.db.statements import Q

FILL = """
INSERT INTO nasiko_queue_jobs (id, queue, kind, payload, state, max_attempts, run_at,
                               created_at, attempted_at, finished_at, attempt)
SELECT gen_random_uuid(), 'q' || (i % 8), 'k' || (i % 4),
       jsonb_build_object('user_id', i % 100000, 'note', 'row ' || i),
       (ARRAY['completed', 'completed', 'completed', 'discarded', 'cancelled'])[1 + i % 5],
       3, at, at, at, at + interval '1 second', 1
FROM (SELECT i, now() - make_interval(secs => (i % 2592000)) AS at
      FROM generate_series(1, $1) AS i) AS s
"""
WAITING = """
INSERT INTO nasiko_queue_jobs (id, queue, kind, payload, state, max_attempts, run_at)
SELECT gen_random_uuid(), 'q' || (i % 8), 'k' || (i % 4), jsonb_build_object('user_id', i),
       'available', 3, now() + CASE WHEN i <= 20 THEN interval '1 hour' ELSE interval '0' END
FROM generate_series(1, 220) AS i
"""
RUNNING = """
INSERT INTO nasiko_queue_jobs (id, queue, kind, payload, state, max_attempts, attempted_at)
SELECT gen_random_uuid(), 'q1', 'k1', '{}', 'running', 3, now() FROM generate_series(1, 10)
"""


def cases() -> list[tuple[str, str, Sequence[Any]]]:
    return [
        ("status: plain_queue_counts (exact, scans)", Q.plain_queue_counts, ()),
        ("overview: plain_queue_live_counts", Q.plain_queue_live_counts, ()),
        ("overview: plain_queue_finished_estimates", Q.plain_queue_finished_estimates, ([],)),
        ("overview: plain_queue_finished_counts (small tables)",
         Q.plain_queue_finished_counts, ()),
        ("overview: build_queue_live_counts", Q.build_queue_live_counts, ()),
        ("overview: build_finished_estimates", Q.build_finished_estimates, ()),
        ("overview: queue_throughput", Q.queue_throughput, ()),
        ("overview: queues_unserved", Q.queues_unserved, ()),
        ("overview: throughput_buckets", Q.throughput_buckets, ()),
        ("overview: table_estimates", Q.table_estimates, ()),
        ("metrics: metrics_jobs (exact, scans)", Q.metrics_jobs, ()),
        ("jobs: jobs_list any state, first page", Q.jobs_list,
         (None, None, None, None, None, None, 50)),
        ("jobs: jobs_list dead letters, first page", Q.jobs_list,
         (None, None, "discarded", None, None, None, 50)),
        ("jobs: jobs_list queue q3, first page", Q.jobs_list,
         ("q3", None, None, None, None, None, 50)),
        ("search: kind k1 + args {user_id: 4242}", Q.jobs_search,
         ("k1", json.dumps({"user_id": 4242}), None, None, None, None, 50)),
        ("search: kind k1 only", Q.jobs_search, ("k1", None, None, None, None, None, 50)),
        ("running: jobs_running", Q.jobs_running, (500,)),
        ("scheduled: jobs_scheduled", Q.jobs_scheduled, (None, 500)),
        ("workers: workers_list", Q.workers_list, ()),
    ]


async def timed(db: Database | Transaction, sql: str,
                args: Sequence[Any]) -> tuple[float, str]:
    await db.fetch(sql, *args)
    runs = []
    for _ in range(5):
        started = time.perf_counter()
        await db.fetch(sql, *args)
        runs.append(time.perf_counter() - started)
    plan = await db.fetchval("EXPLAIN (FORMAT JSON)\n" + sql, *args)
    top = (json.loads(plan) if isinstance(plan, str) else plan)[0]["Plan"]
    return statistics.median(runs) * 1000, _describe(top)


def _describe(node: dict[str, Any]) -> str:
    scans = []

    def walk(n: dict[str, Any]) -> None:
        if "Scan" in n["Node Type"] and n.get("Relation Name") in (
                "nasiko_queue_jobs", "build_jobs"):
            scans.append(n["Node Type"] + (f" {n['Index Name']}" if n.get("Index Name")
                                           else f" {n['Relation Name']}"))
        for child in n.get("Plans", ()):
            walk(child)

    walk(node)
    return "; ".join(dict.fromkeys(scans)) or node["Node Type"]


async def deep_cases(db: Database) -> list[tuple[str, str, Sequence[Any]]]:
    """Page 201 of the listing (after 10,000 jobs), by its keyset cursor."""
    row = await db.fetchrow("SELECT coalesce(finished_at, created_at) AS at, id "
                            "FROM nasiko_queue_jobs ORDER BY 1 DESC, 2 DESC OFFSET 9999 LIMIT 1")
    return [
        ("jobs: jobs_list any state, page 201", Q.jobs_list,
         (None, None, None, None, row["at"], row["id"], 50)),
        ("jobs: jobs_list older than 7 days", Q.jobs_list,
         (None, None, None, timedelta(days=7), None, None, 50)),
        ("search: kind k1, page 201", Q.jobs_search,
         ("k1", None, None, None, row["at"], row["id"], 50)),
    ]


PAGES = ("/", "/jobs?state=any", "/jobs?state=discarded", "/jobs?state=any&queue=q3",
         "/running", "/scheduled", "/workers", "/search?kind=k1",
         "/search?kind=k1&args=%7B%22user_id%22%3A+4242%7D")


async def pages(db: Database) -> None:
    """Each page served whole (the ASGI app, no network): median of 5 after a warm-up."""
    import httpx

    from nasiko_queue.web.dashboard import dashboard_app

    app = dashboard_app(db, token=None)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://bench") as client:
        for url in PAGES:
            assert (await client.get(url)).status_code == 200, url
            runs = []
            for _ in range(5):
                started = time.perf_counter()
                await client.get(url)
                runs.append(time.perf_counter() - started)
            print(f"{statistics.median(runs) * 1000:9.1f} ms  GET {url}")


async def main(dsn: str, rows: int) -> None:
    async with open_database(dsn) as db:
        await migrate(db)
        have = await db.fetchval("SELECT count(*) FROM nasiko_queue_jobs")
        if have < rows:
            started = time.perf_counter()
            await db.execute(FILL, rows - have)
            await db.execute(WAITING)
            await db.execute(RUNNING)
            print(f"filled {rows - have} rows in {time.perf_counter() - started:.1f} s")
        await db.execute("ANALYZE nasiko_queue_jobs")
        total = await db.fetchval("SELECT count(*) FROM nasiko_queue_jobs")
        print(f"nasiko_queue_jobs: {total} rows")
        for name, sql, args in cases() + await deep_cases(db):
            ms, plan = await timed(db, sql, args)
            print(f"{ms:9.1f} ms  {name}  [{plan}]")
        # The same, as the generic plans a long-lived connection may switch to.
        print("pages:")
        await pages(db)
        print("generic plans (plan_cache_mode = force_generic_plan):")
        deep = await deep_cases(db)
        async with db.transaction() as tx:
            await tx.execute("SET LOCAL plan_cache_mode = force_generic_plan")
            for name, sql, args in cases() + deep:
                if name.startswith(("jobs:", "search:")):
                    ms, plan = await timed(tx, sql, args)
                    print(f"{ms:9.1f} ms  {name}  [{plan}]")


if __name__ == "__main__":
    trio.run(main, sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 1_000_000)
