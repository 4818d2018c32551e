"""
Smoke test of benchmarks/burst_end.py (issue #45): with a few rounds every row
is measured, from a worker process and an asyncio program; no speed is asserted
(benchmarks/README.md says why), nor how many waited for the poll (a timed
figure: the regression tests of tests/test_due_wakes.py gate the engine instead).
"""

from __future__ import annotations

import pytest

from benchmarks import burst_end

pytestmark = pytest.mark.slow


def test_every_row_is_measured(dsn: str) -> None:
    result = burst_end.run(dsn, rounds=4, poll=5.0)
    assert result["poll_s"] == 5.0
    for row, rounds in (("result", 4), ("fire", 4), ("retry", 1)):
        assert result[row]["rounds"] == rounds
        assert result[row]["p50_ms"] > 0
        assert 0 <= result[row]["waited_for_poll"] <= rounds
