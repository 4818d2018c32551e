"""
Jobs enqueued at a burst's end (issue #45, bug 7): the share that waited for the poll.

    python -m benchmarks.burst_end postgresql://.../scratch_db [ROUNDS] [POLL]

Migrates the (scratch!) database and empties its plain jobs, starts one worker
process as a user would (``python -m nasiko_queue worker``, its defaults: one
slot, look-ahead "auto"; ``--poll-interval POLL``, default 5), and from a plain
asyncio program (`nasiko_queue.aio`, on an asyncpg pool) runs ROUNDS rounds
(default 40) of: 10 short jobs (10 ms each), a pause of 0 to 120 ms, one probe.
Each job returns the instant it started (``time.perf_counter()``: the same
clock in every process of the machine), and a probe's start lag is that minus
the instant its enqueue returned. A probe whose lag is over half the poll
waited for the poll: with every wake delivered, none should.

Two ways of waiting, one row each:

* ``result``: the program awaits each probe's result (`aio.result`) right
  after enqueueing it, as a request that needs the answer does;
* ``fire``: it does not, and reads the results once every round is over.

And a third row, ``retry`` (issue #45, bug 6): ROUNDS / 4 jobs, one after
another, that fail once and are retried after a backoff of 0.2 s; the lag is
the second attempt's start after the first's, less the backoff.

Prints one JSON object: per row, the rounds, those that waited for the poll,
and the start lags (p50, p95, max, in ms).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, ClassVar

import attrs
import trio

from nasiko_queue import Executors, JobArgs, JobOptions, PlainJobContext, aio

from .connect import create_pool

#: The queue of the benchmark's jobs.
QUEUE = "burst_end"
#: Jobs per burst, and how long each runs.
BURST = 10
BURST_JOB_SECONDS = 0.01
#: The pause between a burst's last enqueue and the probe's: up to this.
MAX_PAUSE = 0.12
ROOT = Path(__file__).resolve().parent.parent


@attrs.frozen(kw_only=True)
class BurstJob(JobArgs):
    """A burst's job (`seconds` of work) or a probe (none)."""

    kind: ClassVar[str] = "bench_burst_end"
    options: ClassVar[JobOptions] = JobOptions(queue=QUEUE)
    seconds: float = 0.0


executors = Executors()


@executors.register(BurstJob)
async def burst_job(ctx: PlainJobContext[BurstJob]) -> float:
    """Returns when it started, then works for `seconds`."""
    started = time.perf_counter()
    if ctx.payload.seconds:
        await trio.sleep(ctx.payload.seconds)
    return started


@attrs.frozen(kw_only=True)
class FailsOnce(JobArgs):
    """Raises on its first attempt; retried after `RETRY_BACKOFF`."""

    kind: ClassVar[str] = "bench_burst_end_retry"
    options: ClassVar[JobOptions] = JobOptions(queue=QUEUE)


#: The backoff of `FailsOnce`'s retry, in seconds.
RETRY_BACKOFF = 0.2
#: When each `FailsOnce` job's first attempt started (in the worker's process).
_first_attempts: dict[Any, float] = {}


async def fails_once(ctx: PlainJobContext[FailsOnce]) -> float:
    """The second attempt returns how long after the first it started."""
    if ctx.attempt == 1:
        _first_attempts[ctx.job_id] = time.perf_counter()
        raise RuntimeError("the first attempt fails")
    return time.perf_counter() - _first_attempts.pop(ctx.job_id)


executors.register(FailsOnce, fails_once, backoff=lambda _attempt: RETRY_BACKOFF)


async def _retries(pool: Any, rounds: int, poll: float) -> dict[str, Any]:
    """Jobs that fail once, one after another: the second attempt's start after
    the first's, less the backoff."""
    lags = []
    for _ in range(rounds):
        job_id = await aio.enqueue(pool, FailsOnce())
        lags.append(await aio.result(pool, job_id, timeout=4 * poll + 10) - RETRY_BACKOFF)
    waited = [round(lag, 2) for lag in lags if lag > poll / 2]
    return {"rounds": rounds, "backoff_s": RETRY_BACKOFF, "waited_for_poll": len(waited),
            "waited_s": waited, **_percentiles(lags)}


def _percentiles(lags: list[float]) -> dict[str, float]:
    s = sorted(lags)

    def pct(p: float) -> float:
        return s[min(len(s) - 1, round(p / 100 * (len(s) - 1)))] * 1e3

    return {"p50_ms": round(pct(50), 2), "p95_ms": round(pct(95), 2),
            "max_ms": round(pct(100), 2)}


async def _rounds(pool: Any, rounds: int, poll: float, *, await_result: bool,
                  rng: random.Random) -> dict[str, Any]:
    probes: list[tuple[Any, float]] = []
    for _ in range(rounds):
        for _ in range(BURST):
            await aio.enqueue(pool, BurstJob(seconds=BURST_JOB_SECONDS))
        await asyncio.sleep(rng.uniform(0, MAX_PAUSE))
        job_id = await aio.enqueue(pool, BurstJob())
        probes.append((job_id, time.perf_counter()))
        if await_result:
            await aio.result(pool, job_id, timeout=4 * poll + 10)
        else:
            await asyncio.sleep(0.3)
    lags = [await aio.result(pool, job_id, timeout=4 * poll + 10) - enqueued
            for job_id, enqueued in probes]
    waited = [round(lag, 2) for lag in lags if lag > poll / 2]
    return {"rounds": rounds, "waited_for_poll": len(waited), "waited_s": waited,
            **_percentiles(lags)}


async def _prepare(dsn: str) -> None:
    from nasiko_queue import open_database
    from nasiko_queue.db.migrate import migrate

    async with open_database(dsn) as db:
        await migrate(db)
        await db.execute("DELETE FROM nasiko_queue_jobs WHERE queue = $1", QUEUE)


async def _measure(dsn: str, rounds: int, poll: float) -> dict[str, Any]:
    pool = await create_pool(dsn, min_size=2, max_size=4)
    try:
        # The worker is up once it has run a job.
        await aio.result(pool, await aio.enqueue(pool, BurstJob()), timeout=60)
        rng = random.Random(45)  # noqa: S311 (pauses, not secrets)
        out: dict[str, Any] = {"poll_s": poll}
        out["result"] = await _rounds(pool, rounds, poll, await_result=True, rng=rng)
        out["fire"] = await _rounds(pool, rounds, poll, await_result=False, rng=rng)
        out["retry"] = await _retries(pool, max(1, rounds // 4), poll)
        return out
    finally:
        await pool.close()


def run(dsn: str, rounds: int = 40, poll: float = 5.0) -> dict[str, Any]:
    """The three rows on database `dsn` (migrated, its queue emptied first)."""
    trio.run(_prepare, dsn)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    worker = subprocess.Popen(
        [sys.executable, "-m", "nasiko_queue", "worker", "--dsn", dsn,
         "--executors", "benchmarks.burst_end:executors", "--queues", QUEUE,
         "--poll-interval", str(poll), "--no-maintenance"],
        cwd=ROOT, env=env, stderr=subprocess.DEVNULL)
    try:
        # A plain asyncio loop: importing nasiko_queue makes asyncio.run use
        # trio-asyncio's.
        with asyncio.Runner(loop_factory=asyncio.SelectorEventLoop) as runner:
            return runner.run(_measure(dsn, rounds, poll))
    finally:
        worker.send_signal(signal.SIGTERM)
        worker.wait(timeout=60)


def main(argv: list[str]) -> None:
    rounds = int(argv[2]) if len(argv) > 2 else 40
    poll = float(argv[3]) if len(argv) > 3 else 5.0
    print(json.dumps(run(argv[1], rounds, poll), indent=1))


if __name__ == "__main__":
    main(sys.argv)
