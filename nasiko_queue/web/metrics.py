"""
Prometheus metrics: `/metrics`, on a registry of the server's own.

Per scrape, one statement (`metrics_jobs`): jobs by queue, kind and state, and
the age of each queue's oldest claimable job; beside it, on the same connection,
the unserved queues and the workflow runs by workflow and state (one grouped
read of the runs' listing index, `metrics_workflow_runs`). Everything else is read from the
worker's memory: its counters (`WorkerStats`, incremented by the worker either
way) and its timings (`WorkerState.run_seconds`, `claim_latency`: fixed-bucket
histograms, a bisect per job). Serving metrics adds nothing per job.

prometheus-client collects synchronously and the statement is async, so the
endpoint runs the statement (bounded) and then renders the registry at once,
with no checkpoint between: the collector renders the rows of this scrape.
When the database does not answer, the scrape still succeeds, with the
worker's metrics and `nasiko_queue_database_up 0`.

Names (docs/operations/health.md has the table):

====================================================  =========  ======================
nasiko_queue_jobs{queue,kind,state}                   gauge      jobs in the tables
nasiko_queue_oldest_available_job_age_seconds{queue}  gauge      oldest claimable job
nasiko_queue_workflow_runs{workflow,state}            gauge      workflow runs
nasiko_queue_database_up                              gauge      the scrape's statement
nasiko_queue_scrape_query_seconds                     gauge      its duration
nasiko_queue_jobs_claimed_total                       counter    this worker's claims
nasiko_queue_jobs_done_total                          counter    ... completed runs
nasiko_queue_jobs_failed_total                        counter    ... failed for good
nasiko_queue_jobs_crashed_total                       counter    executor raised
nasiko_queue_jobs_rescued_total                       counter    dead workers' jobs
nasiko_queue_jobs_retried_total                       counter    plain jobs retried
nasiko_queue_job_run_seconds                          histogram  executor run time
nasiko_queue_job_claim_latency_seconds                histogram  claimable -> claimed
nasiko_queue_worker_heartbeats_total{worker}          counter    heartbeats landed
nasiko_queue_worker_heartbeat_failures_total{worker}  counter    heartbeats failed
nasiko_queue_worker_leader{worker}                    gauge      1 while leading
====================================================  =========  ======================
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Iterator, Sequence
from typing import Any

import trio
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from starlette.requests import Request
from starlette.responses import Response

from ..admin.runs import STATES as RUN_STATES
from ..db.statements import Q
from ..engine.retry import one_line
from ..engine.state import Timings
from ..engine.worker import Worker
from ..queue import Queue

log = logging.getLogger("nasiko_queue.web")

#: The worker's counters exported, as (metric name without `_total`, `WorkerStats`
#: field, help).
COUNTERS: tuple[tuple[str, str, str], ...] = (
    ("nasiko_queue_jobs_claimed", "claimed", "Jobs this worker claimed."),
    ("nasiko_queue_jobs_done", "done", "Jobs this worker ran to completion."),
    ("nasiko_queue_jobs_failed", "failed", "Jobs this worker failed for good."),
    ("nasiko_queue_jobs_crashed", "panicked", "Runs whose executor raised (panicked)."),
    ("nasiko_queue_jobs_rescued", "rescued",
     "Dead workers' jobs this worker gave back or failed, as leader."),
    ("nasiko_queue_jobs_retried", "retried", "Plain jobs whose run crashed, to run again."),
)


def _histogram(name: str, doc: str, timings: Timings) -> HistogramMetricFamily:
    cumulative = 0
    buckets: list[tuple[str, float]] = []
    for bound, n in zip([*map(str, timings.buckets), "+Inf"], timings.counts, strict=True):
        cumulative += n
        buckets.append((bound, cumulative))
    return HistogramMetricFamily(name, doc, buckets=buckets, sum_value=timings.total)


class QueueCollector(Collector):
    """
    Renders one scrape: the rows of `metrics_jobs` (set by the endpoint just
    before), and the worker's counters and timings.
    """

    def __init__(self, worker: Worker | None, worker_name: str) -> None:
        self.worker = worker
        self.worker_name = worker_name
        #: The statement's rows for this scrape; None when it got no answer.
        self.rows: Sequence[Any] | None = None
        #: The queues with waiting jobs that no live worker serves (queues_unserved).
        self.unserved: Sequence[Any] = ()
        #: Workflow runs by workflow and state (metrics_workflow_runs).
        self.runs: Sequence[Any] = ()
        self.query_seconds = 0.0

    def collect(self) -> Iterator[Metric]:
        up = GaugeMetricFamily("nasiko_queue_database_up",
                               "1 when this scrape's statement was answered.")
        up.add_metric([], 0.0 if self.rows is None else 1.0)
        yield up
        took = GaugeMetricFamily("nasiko_queue_scrape_query_seconds",
                                 "Seconds this scrape's statement took.")
        took.add_metric([], self.query_seconds)
        yield took
        if self.rows is not None:
            yield from self._jobs(self.rows)
            unserved = GaugeMetricFamily(
                "nasiko_queue_unserved_queue_jobs",
                "Jobs waiting in a queue that no live worker serves (one series per such "
                "queue; none while every queue with waiting jobs is served).",
                labels=["queue"])
            kinds = GaugeMetricFamily(
                "nasiko_queue_unserved_kind_jobs",
                "Jobs waiting in a served queue whose kind no live worker of that queue "
                "runs (a typo in a kind; one series per such queue and kind).",
                labels=["queue", "kind"])
            for row in self.unserved:
                if row["kind"] is None:
                    unserved.add_metric([row["queue"]], float(row["waiting"]))
                else:
                    kinds.add_metric([row["queue"], row["kind"]], float(row["waiting"]))
            yield unserved
            yield kinds
            yield self._runs(self.runs)
        if self.worker is not None:
            yield from self._worker(self.worker)

    @staticmethod
    def _jobs(rows: Sequence[Any]) -> Iterator[Metric]:
        jobs = GaugeMetricFamily("nasiko_queue_jobs", "Jobs by queue, kind and state.",
                                 labels=["queue", "kind", "state"])
        oldest: dict[str, float] = {}
        for row in rows:
            jobs.add_metric([row["queue"], row["kind"], row["state"]], float(row["n"]))
            oldest.setdefault(row["queue"], 0.0)
            if row["oldest"] is not None:
                oldest[row["queue"]] = max(oldest[row["queue"]], float(row["oldest"]))
        yield jobs
        age = GaugeMetricFamily(
            "nasiko_queue_oldest_available_job_age_seconds",
            "Seconds the oldest claimable job of each queue has waited (0: none waits).",
            labels=["queue"])
        for queue, seconds in sorted(oldest.items()):
            age.add_metric([queue], seconds)
        yield age

    @staticmethod
    def _runs(rows: Sequence[Any]) -> Metric:
        runs = GaugeMetricFamily(
            "nasiko_queue_workflow_runs",
            "Workflow runs by workflow and state (every state of a workflow that has "
            "runs, 0 included).", labels=["workflow", "state"])
        counts = {(row["workflow"], row["state"]): float(row["n"]) for row in rows}
        for workflow in sorted({w for w, _ in counts}):
            for state in RUN_STATES:
                runs.add_metric([workflow, state], counts.get((workflow, state), 0.0))
        return runs

    def _worker(self, worker: Worker) -> Iterator[Metric]:
        stats = worker.stats
        for name, field, doc in COUNTERS:
            counter = CounterMetricFamily(name, doc)
            counter.add_metric([], float(getattr(stats, field)))
            yield counter
        state = worker.state
        yield _histogram("nasiko_queue_job_run_seconds", "Seconds each executor ran.",
                         state.run_seconds)
        yield _histogram("nasiko_queue_job_claim_latency_seconds",
                         "Seconds from a job becoming claimable (created_at, run_at) to "
                         "its claim.", state.claim_latency)
        label = [self.worker_name]
        beats = CounterMetricFamily("nasiko_queue_worker_heartbeats",
                                    "Heartbeats that landed.", labels=["worker"])
        beats.add_metric(label, float(stats.heartbeats))
        yield beats
        failures = CounterMetricFamily("nasiko_queue_worker_heartbeat_failures",
                                       "Heartbeats that failed.", labels=["worker"])
        failures.add_metric(label, float(stats.heartbeat_failures))
        yield failures
        leader = GaugeMetricFamily("nasiko_queue_worker_leader",
                                   "1 while this worker holds the maintenance leadership.",
                                   labels=["worker"])
        leader.add_metric(label, 1.0 if worker.is_leader else 0.0)
        yield leader


class Metrics:
    """
    The `/metrics` endpoint of one queue (and, optionally, its worker).

    Args:
        queue: the queue whose tables are counted.
        worker: the worker whose counters and timings are exported, if any.
        timeout: seconds the scrape's statement may take.
        worker_name: the `worker` label; default host:pid.
    """

    def __init__(self, queue: Queue, worker: Worker | None = None, *, timeout: float = 2.0,
                 worker_name: str | None = None) -> None:
        self.queue = queue
        self.timeout = timeout
        self.registry = CollectorRegistry(auto_describe=False)
        self.collector = QueueCollector(
            worker, worker_name or f"{socket.gethostname()}:{os.getpid()}")
        self.registry.register(self.collector)

    async def scrape(self) -> bytes:
        """Run this scrape's statement, then render the registry (no checkpoint between)."""
        timeout = self.timeout

        async def op(conn: Any) -> tuple[list[Any], list[Any], list[Any]]:
            rows: list[Any] = await conn.fetch(Q.metrics_jobs, timeout=timeout)
            unserved: list[Any] = await conn.fetch(Q.queues_unserved, timeout=timeout)
            runs: list[Any] = await conn.fetch(Q.metrics_workflow_runs, timeout=timeout)
            return rows, unserved, runs

        sent = trio.current_time()
        rows: list[Any] | None
        unserved: list[Any] = []
        runs: list[Any] = []
        try:
            rows, unserved, runs = await self.queue.db.run_bounded(op, bound=timeout)
        except Exception as exc:
            log.warning("metrics: the jobs statement got no answer (%s)", one_line(exc))
            rows = None
        self.collector.rows = rows
        self.collector.unserved = unserved
        self.collector.runs = runs
        self.collector.query_seconds = trio.current_time() - sent
        return generate_latest(self.registry)

    async def endpoint(self, _request: Request) -> Response:
        return Response(await self.scrape(), media_type=CONTENT_TYPE_LATEST)
