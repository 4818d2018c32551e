"""
Smoke test of benchmarks/any_app.py (issue #26): with tiny sizes on the test
database every way of enqueueing ran and wrote its jobs; no speed is asserted
(benchmarks/README.md says why).
"""

from __future__ import annotations

import psycopg
import pytest

from benchmarks import any_app

pytestmark = pytest.mark.slow


def test_every_way_enqueues_its_jobs(dsn: str) -> None:
    result = any_app.run(dsn, jobs=20, rounds=2)
    assert set(result["jobs_per_s"]) == {"queue", "sql", "aio", "sync"}
    assert all(len(s) == 2 and min(s) > 0 for s in result["samples"].values())
    assert result["vs_queue"]["queue"] == 1.0
    with psycopg.connect(dsn) as conn:
        row = conn.execute("SELECT count(*), count(DISTINCT payload) "
                           "FROM nasiko_queue.nasiko_queue_jobs "
                           "WHERE kind = 'bench_note' AND queue = 'bench_any_app'").fetchone()
    # 20 jobs per way per round, and the trio queue's one warm-up enqueue per round;
    # the payloads repeat across ways and rounds (n = 0..19, and -1).
    assert row == (2 * (4 * 20 + 1), 21)
