"""
The benchmark's plain job type (`nasiko_queue_jobs`), for the latency and
claim-flat workloads of issue #13: one small field, queue "bench", an executor
that does nothing but note when it started.
"""

from __future__ import annotations

from typing import ClassVar

import attrs

from nasiko_queue import JobArgs, JobOptions

#: The queue the benchmark's plain jobs go to.
BENCH_QUEUE = "bench"


@attrs.frozen(kw_only=True)
class BenchPing(JobArgs):
    """A plain job with one field, so that its payload is as small as a real one."""

    kind: ClassVar[str] = "bench_ping"
    options: ClassVar[JobOptions] = JobOptions(queue=BENCH_QUEUE)
    n: int = 0


@attrs.frozen(kw_only=True)
class BenchPadded(JobArgs):
    """
    A plain job whose payload is padded (`pad`) to a build job's size: what a
    build job costs beyond its larger payload is the difference between the two.
    """

    kind: ClassVar[str] = "bench_padded"
    options: ClassVar[JobOptions] = JobOptions(queue=BENCH_QUEUE)
    n: int = 0
    pad: str = ""
