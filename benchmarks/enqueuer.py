"""
The latency workload's enqueuer in another process:
``python -m benchmarks.enqueuer DSN RATE [build|plain] < targets.json``.

Reads [[agent_id, build_id, owner_id], ...] on stdin, enqueues one Upload job per
target every 1/RATE s through its own `Queue` (with ``plain``: one `BenchPing`
plain job per target instead), and prints {job_id: [t_call, t_returned]}: the
`time.perf_counter()` just before the enqueue call and just after it returned,
its commit done (CLOCK_MONOTONIC on Linux, the same clock in every process of
the machine).
"""

from __future__ import annotations

import json
import sys
import time
import uuid

import trio

from nasiko_queue import Queue, QueueConfig, open_database
from nasiko_queue.testing import make_payload

from .plain import BenchPing


async def main(dsn: str, rate: float, targets: list[list[str]],
               kind: str = "build") -> dict[str, list[float]]:
    payloads = ([BenchPing(n=i) for i in range(len(targets))] if kind == "plain" else
                [make_payload("Upload", target_id=uuid.UUID(a), build_id=uuid.UUID(b),
                              owner_id=uuid.UUID(o)) for a, b, o in targets])
    times: dict[str, list[float]] = {}
    async with open_database(dsn) as db:
        queue = Queue(db, config=QueueConfig())
        await db.fetchval("SELECT 1")  # connect before the clock starts
        t_next = trio.current_time()
        for p in payloads:
            await trio.sleep_until(t_next)
            t_next += 1 / rate
            t = time.perf_counter()
            job_id = str(await queue.enqueue(p))
            times[job_id] = [t, time.perf_counter()]
    return times


if __name__ == "__main__":
    dsn, rate = sys.argv[1], float(sys.argv[2])
    kind = sys.argv[3] if len(sys.argv) > 3 else "build"
    targets = json.load(sys.stdin)
    print(json.dumps(trio.run(main, dsn, rate, targets, kind)))
