"""
Smoke test of benchmarks/peer_graphile.py (issue #25): with tiny sizes every row
ran for the engine, and for graphile-worker when node, npm and its install are
there (else it is skipped with the reason, and no ratio is given); the ratios are
nasiko-queue / graphile-worker per round, and the wakes are also given over
ceiling L. No speed is asserted (benchmarks/README.md says why). It makes and
drops scratch databases of its own on the test server.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks import peer_graphile

pytestmark = pytest.mark.slow

ROWS = {"drain c=1, defaults", "drain c=10, defaults", "drain, best settings",
        "enqueue, 1 per call", "enqueue, 1 batch", "wake p50", "wake p99",
        "WAL bytes/job, c=10", "server CPU/job, c=10"}


def test_every_row_runs_for_both_sides_or_the_peer_says_why_not(admin_dsn: str) -> None:
    result = peer_graphile.run(admin_dsn, jobs=30, rounds=1)
    rows = result["rows"]
    assert set(rows) == ROWS == set(peer_graphile.TARGETS)
    skipped = result["meta"]["skipped"]
    for name, row in rows.items():
        assert len(row["nq"]) == 1, name
        if name != "server CPU/job, c=10":
            assert all(v > 0 for v in row["nq"]), name
        if skipped:
            assert (row["gw"], row["ratio"], row["skipped"]) == ([], None, skipped)
            continue
        assert len(row["gw"]) == 1, name
        if row["ratio"] is not None:  # server CPU: None when the server is elsewhere
            assert row["ratios"] == [row["nq"][0] / row["gw"][0]], name
            assert row["met"] in (True, False)
    [ceiling_l] = result["ceiling_L"]
    assert 0 < ceiling_l["p50_ms"] <= ceiling_l["p99_ms"]
    sides = ("nq",) if skipped else ("nq", "gw")
    assert set(result["wake_vs_L"]) == {f"{s} {p}" for s in sides for p in ("p50", "p99")}
    nq_p50 = result["wake_vs_L"]["nq p50"]
    assert nq_p50["ratios"] == [rows["wake p50"]["nq"][0] / ceiling_l["p50_ms"]]
    table = peer_graphile.markdown(result)
    assert table.count("\n") == 1 + len(ROWS) + 1 + len(result["wake_vs_L"])


def test_without_node_the_peer_is_skipped_with_the_reason(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # neither node nor npm on it
    assert peer_graphile.install() == (None, "node is not installed")
    # And a run without the peer's figures gives no ratio, only the reason.
    nq = {"jobs_per_s": 100.0}
    result = peer_graphile.assemble({"drain c=1, defaults": {"nq": [nq], "gw": []}}, [],
                                    jobs=1, rounds=1, skipped="node is not installed")
    row = result["rows"]["drain c=1, defaults"]
    assert (row["ratio"], row["skipped"], row["nq"]) == (None, "node is not installed", [100.0])
    assert "skipped: node is not installed" in peer_graphile.markdown(result)


def test_a_peer_figure_of_zero_gives_no_ratio_but_says_why() -> None:
    # CI's run with 30 jobs counted no server CPU ticks for the peer and divided by zero.
    cost = {"nq": [{"wal_bytes_per_job": 900.0, "server_cpu_us_per_job": 12.0}],
            "gw": [{"wal_bytes_per_job": 600.0, "server_cpu_us_per_job": 0.0}]}
    result = peer_graphile.assemble({"cost, c=10": cost}, [], jobs=30, rounds=1, skipped="")
    row = result["rows"]["server CPU/job, c=10"]
    assert row["ratio"] is None
    assert "below the clock's resolution" in row["skipped"]
    assert result["rows"]["WAL bytes/job, c=10"]["ratio"] == 1.5
    table = peer_graphile.markdown(result)
    assert "| 12.00 µs | 0.00 µs | no ratio: the peer's figure is 0" in table
