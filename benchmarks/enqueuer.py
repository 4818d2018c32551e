"""
The latency workload's enqueuer in another process:
``python -m benchmarks.enqueuer DSN RATE < targets.json``.

Reads [[agent_id, build_id, owner_id], ...] on stdin, enqueues one Upload job per
target every 1/RATE s through its own `Queue`, and prints {job_id: t} where t is
`time.perf_counter()` just before the enqueue call (CLOCK_MONOTONIC on Linux,
the same clock in every process of the machine).
"""

from __future__ import annotations

import json
import sys
import time
import uuid

import trio

from nasiko_queue import Queue, QueueConfig, open_database
from nasiko_queue.testing import make_payload


async def main(dsn: str, rate: float, targets: list[list[str]]) -> dict[str, float]:
    payloads = [make_payload("Upload", target_id=uuid.UUID(a), build_id=uuid.UUID(b),
                             owner_id=uuid.UUID(o)) for a, b, o in targets]
    before: dict[str, float] = {}
    async with open_database(dsn) as db:
        queue = Queue(db, config=QueueConfig())
        await db.fetchval("SELECT 1")  # connect before the clock starts
        t_next = trio.current_time()
        for p in payloads:
            await trio.sleep_until(t_next)
            t_next += 1 / rate
            t = time.perf_counter()
            before[str(await queue.enqueue(p))] = t
    return before


if __name__ == "__main__":
    dsn, rate = sys.argv[1], float(sys.argv[2])
    targets = json.load(sys.stdin)
    print(json.dumps(trio.run(main, dsn, rate, targets)))
