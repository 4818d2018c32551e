"""
What a limit across replicas costs the claim (issue #23), as a ratio to the
unlimited claim of the same run, at 1 and 4 claiming processes.

    python -m benchmarks.limits --dsn postgresql://root@127.0.0.1:5432/postgres

It creates a scratch database on that server (needs CREATEDB), migrates it, runs
and drops it. Each claiming process is a plain asyncio process with one asyncpg
connection that sends the worker's hot statement, `plain_finish_many_and_claim`
(the previous job's finish and a claim of one), back to back for `--seconds`.
The limits are set far above what the run reaches (concurrency 10,000; a rate of
10,000,000 per second) so that the figures are the mechanism's cost (the
advisory lock, the count of running jobs, the starts ledger), not a limit
holding jobs back. A variant "unlimited, before #23" sends the statement
without the limits probe, to show what the probe costs unlimited queues.

The figures: statements per second over all processes, and the p50/p99 of one
statement, each the median of `--rounds` rounds (every variant in turn in each
round), as a ratio to the unlimited claim measured in the same rounds.
Speed is measured here, never asserted by a test.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import re
import statistics
import sys
import time
import uuid
from typing import Any

import trio

from nasiko_queue import Queue, Rate, migrate, open_database
from nasiko_queue.config import QueueConfig
from nasiko_queue.db.statements import Q

from .connect import connect

QUEUE = "bench_limits"
#: Jobs waiting at the start of each measurement: more than any run claims.
BACKLOG = 60_000
#: The probe a claim of an unlimited queue pays since issue #23, cut out of the
#: statement for the "before #23" variant.
_PROBE = re.compile(r"CASE WHEN EXISTS \(SELECT 1 FROM nasiko_queue_limits WHERE queue = \$3\)"
                    r"\s+THEN \(SELECT nasiko_queue_limited_pick\(.*?\)\)\s+ELSE ARRAY\(",
                    re.DOTALL)


def _before_23(sql: str) -> str:
    """The finish-and-claim statement as it was before issue #23 (no limits probe)."""
    cut, n = _PROBE.subn("ARRAY(", sql)
    if n != 1 or cut.count("LIMIT $4) END)") != 1 or cut.count("$10::text[]") != 1:
        raise RuntimeError("the claim's limits probe moved: update benchmarks/limits.py")
    # Its results were $8 then (the finishing ids and attempts came in with #23
    # and migration 0026; claim tokens in their place with issue #45).
    return cut.replace("LIMIT $4) END)", "LIMIT $4))").replace("$10::text[]", "$8::text[]")


def _claimer(dsn: str, sql: str, old: bool, seconds: float, start_at: float, out: Any
             ) -> None:
    """One claiming process: finish the previous job and claim one, back to back."""

    async def run() -> None:
        conn = await connect(dsn)
        bound = QueueConfig().max_payload_bytes
        worker = uuid.uuid4()
        held: list[tuple[uuid.UUID, uuid.UUID]] = []  # (job, its claim's token)
        latencies: list[float] = []
        await asyncio.sleep(max(0.0, start_at - time.time()))  # the others connect meanwhile
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            ids, tokens = [h[0] for h in held], [h[1] for h in held]
            began = time.perf_counter()
            finishing = () if old else (ids, tokens)
            token = uuid.uuid4()
            rows = await conn.fetch(sql, ids, tokens, QUEUE, 1, token, worker, bound,
                                    *finishing, [None] * len(ids))
            latencies.append(time.perf_counter() - began)
            held = [(r["id"], token) for r in rows if r["id"] is not None]
        await conn.close()
        out.put(latencies)

    # A plain asyncio loop: trio_asyncio's policy (imported with nasiko_queue) would
    # otherwise drive asyncio.run, and its overhead is not the claim's.
    with asyncio.Runner(loop_factory=asyncio.SelectorEventLoop) as runner:
        runner.run(run())


def _measure(dsn: str, sql: str, old: bool, processes: int, seconds: float
             ) -> dict[str, float]:
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    start_at = time.time() + 1.5  # every process connected and waiting
    procs = [ctx.Process(target=_claimer, args=(dsn, sql, old, seconds, start_at, out))
             for _ in range(processes)]
    for p in procs:
        p.start()
    latencies = [x for _ in procs for x in out.get(timeout=seconds + 60)]
    for p in procs:
        p.join()
    latencies.sort()
    return {"statements_per_s": len(latencies) / seconds,
            "p50_ms": 1000 * statistics.median(latencies),
            "p99_ms": 1000 * latencies[int(0.99 * (len(latencies) - 1))]}


async def _reset(dsn: str, mode: str) -> None:
    async with open_database(dsn) as db:
        await db.execute("TRUNCATE nasiko_queue_jobs, nasiko_queue_limits, "
                         "nasiko_queue_limit_starts")
        await db.execute(
            "INSERT INTO nasiko_queue_jobs (id, queue, kind, payload, max_attempts) "
            "SELECT gen_random_uuid(), $1, 'bench_ping', '{\"n\": 0}', 5 "
            "FROM generate_series(1, $2)", QUEUE, BACKLOG)
        await db.execute("VACUUM ANALYZE nasiko_queue_jobs")
        queue = Queue(db)
        if mode == "global concurrency":
            await queue.set_limit(QUEUE, concurrency=10_000)
        elif mode == "rate limit":
            await queue.set_limit(QUEUE, rate=Rate(10_000_000, per=1.0))


async def _scratch(admin_dsn: str, name: str, create: bool) -> str:
    async with open_database(admin_dsn) as db:
        if create:
            await db.execute(f'CREATE DATABASE "{name}"')
        else:
            await db.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    base, _, _ = admin_dsn.rpartition("/")
    return f"{base}/{name}"


async def _migrate(dsn: str) -> None:
    async with open_database(dsn) as db:
        await migrate(db)


def run(admin_dsn: str, seconds: float, counts: tuple[int, ...], rounds: int = 3
        ) -> dict[str, Any]:
    name = f"nasiko_bench_limits_{os.getpid()}"
    dsn = trio.run(_scratch, admin_dsn, name, True)
    try:
        trio.run(_migrate, dsn)
        current = Q.plain_finish_many_and_claim
        variants = {"unlimited": current, "unlimited, before #23": _before_23(current),
                    "global concurrency": current, "rate limit": current}
        results: dict[str, Any] = {}
        for processes in counts:
            # Rounds of every variant in turn, the medians kept: on a shared machine
            # the load drifts within a minute, and a variant measured only first (or
            # last) would carry the drift as its cost.
            samples: dict[str, list[dict[str, float]]] = {mode: [] for mode in variants}
            for _round in range(rounds):
                for mode, sql in variants.items():
                    trio.run(_reset, dsn, mode)
                    samples[mode].append(_measure(dsn, sql, mode.endswith("before #23"),
                                                  processes, seconds))
            row = {mode: {key: statistics.median(s[key] for s in runs) for key in runs[0]}
                   for mode, runs in samples.items()}
            base = row["unlimited"]
            for mode in variants:
                row[mode]["throughput_ratio"] = (row[mode]["statements_per_s"]
                                                 / base["statements_per_s"])
                row[mode]["p50_ratio"] = row[mode]["p50_ms"] / base["p50_ms"]
            results[f"{processes} process(es)"] = row
        return results
    finally:
        trio.run(_scratch, admin_dsn, name, False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dsn", required=True, help="a server where a scratch database "
                                                     "may be created")
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--processes", default="1,4")
    parser.add_argument("--out", default=None, help="write the figures as JSON here")
    args = parser.parse_args()
    counts = tuple(int(n) for n in args.processes.split(","))
    results = run(args.dsn, args.seconds, counts, args.rounds)
    for processes, row in results.items():
        print(f"{processes}:")
        for mode, r in row.items():
            print(f"  {mode:24} {r['statements_per_s']:8.0f} stmt/s  "
                  f"p50 {r['p50_ms']:6.2f} ms  p99 {r['p99_ms']:6.2f} ms  "
                  f"x{r['throughput_ratio']:.2f} throughput  x{r['p50_ratio']:.2f} p50")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
