"""
Smoke test of benchmarks/limits.py (issue #23): with tiny sizes every variant
claimed, from one process and from two, and each figure is a ratio to the
unlimited claim of the same run; no speed is asserted (benchmarks/README.md says
why). It makes and drops a scratch database of its own on the test server.
"""

from __future__ import annotations

import pytest

from benchmarks import limits

pytestmark = pytest.mark.slow


def test_every_variant_claims(admin_dsn: str) -> None:
    result = limits.run(admin_dsn, seconds=0.3, counts=(1, 2), rounds=1)
    assert set(result) == {"1 process(es)", "2 process(es)"}
    for row in result.values():
        assert set(row) == {"unlimited", "unlimited, before #23", "global concurrency",
                            "rate limit"}
        assert all(r["statements_per_s"] > 0 and r["p50_ms"] > 0 for r in row.values())
        assert row["unlimited"]["throughput_ratio"] == 1.0
