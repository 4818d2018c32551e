"""
Smoke test of the benchmark runner (`nasiko-queue bench`): tiny sizes on the
test database. It checks that every workload ran and produced positive
figures; it never asserts a speed (benchmarks/README.md says why).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest
import trio
from rich.table import Table

from benchmarks import runner

pytestmark = pytest.mark.slow


async def test_bench_runs_every_workload_with_tiny_sizes(dsn: str, tmp_path: Path) -> None:
    result = await trio.to_thread.run_sync(runner.run_benchmarks, dsn, runner.TINY)
    out = tmp_path / "results.json"
    runner.write_json(result, out)
    data = json.loads(out.read_text())

    assert set(data) >= {"meta", "ceilings", "drain", "enqueue", "latency", "history",
                         "replicas"}
    ceilings = data["ceilings"]
    assert ceilings["a_1conn_jobs_per_s"] > 0
    assert ceilings["a_8conn_jobs_per_s"] > 0
    # One ceiling b per drain setting, with the batching that drain reached.
    assert [b["drain"] for b in ceilings["b"]] == [d["setting"] for d in data["drain"]]
    assert all(b["jobs_per_s"] > 0 and b["k"] >= 1 for b in ceilings["b"])
    assert [(d["concurrency"], d["prefetch"]) for d in data["drain"]] == list(
        runner.TINY.drain_settings)
    assert all(d["jobs_per_s"] > 0 and d["ratios"]["vs_a8"] > 0 for d in data["drain"])
    assert all(d["cpu_us_per_job"] > 0 for d in data["drain"])
    # Ceiling a is measured first and again after every drain; the ratios use
    # the median of those samples.
    for key in ("a_1conn", "a_8conn"):
        samples = ceilings[f"{key}_samples"]
        assert len(samples) == 1 + len(runner.TINY.drain_settings)
        assert ceilings[f"{key}_jobs_per_s"] == statistics.median(samples)
        assert [d["ceiling_a"][f"{key}_jobs_per_s"] for d in data["drain"]] == samples[1:]
    for d in data["drain"]:
        assert d["ratios"]["vs_a8"] == d["jobs_per_s"] / ceilings["a_8conn_jobs_per_s"]
        assert d["ratios"]["vs_a1"] == d["jobs_per_s"] / ceilings["a_1conn_jobs_per_s"]
    assert data["enqueue"]["single_jobs_per_s"] > 0
    assert data["enqueue"]["batch_jobs_per_s"] > 0
    in_process = data["latency"]["in_process"]
    assert in_process["n"] == runner.TINY.latency_jobs
    assert 0 < in_process["p50_ms"] <= in_process["max_ms"]
    other = data["latency"]["other_process"]
    assert isinstance(other, str) or other["n"] == runner.TINY.latency_jobs
    assert [h["history_rows"] for h in data["history"]] == list(runner.TINY.history_rows)
    for h in data["history"]:
        assert h["p50_ms"] > 0
        assert h["plan_node"]
    assert [r["processes"] for r in data["replicas"]] == list(runner.TINY.replica_processes)
    assert all(r["jobs_per_s"] > 0 for r in data["replicas"])
    # -- latency / claim flat / replicas (issue #13) --
    for where in ("in_process", "other_process", "plain_other_process"):
        assert data["latency"][where]["after_commit"]["n"] == runner.TINY.latency_jobs
    assert [(c["lane"], c["loaded"]["p50_ms"] > 0, c["empty"]["buffers"] > 0)
            for c in data["claim_flat"]["cases"]] == [
        ("all kinds", True, True), ("some kinds", True, True), ("plain", True, True),
        ("plain", True, True)]
    assert all(c["loaded"]["plan_node"].count("Index") for c in data["claim_flat"]["cases"])
    assert len(data["replicas_2_vs_1"]) == runner.TINY.replica_rounds
    assert all(r["worker_us_per_job"] > 0 for r in data["replicas"])

    # -- enqueue (issue #13) --
    vs_bare = data["enqueue_vs_bare"]
    for kind in ("build", "plain"):
        for what in ("one_per_call", "many"):
            pair = vs_bare[kind][what]
            assert len(pair["ratios"]) == runner.TINY.enqueue_rounds
            assert all(v > 0 for v in pair["bare_jobs_per_s"] + pair["engine_jobs_per_s"])
            assert pair["ratio"] > 0
        assert all(v > 0 for v in vs_bare[kind]["many"]["bare_copy_jobs_per_s"])

    table = runner.table(data)
    assert table.row_count > 10
    png = tmp_path / "bench.png"
    if runner.plot(data, png):
        assert png.stat().st_size > 0


# -- folded build-row writes (issue #13) --------------------------------------------


async def test_the_build_row_drains_run_and_are_shown_beside_the_no_op_drain(dsn: str) -> None:
    """The block of "drain, executor writes its build row": every mode drains its
    jobs (each checks that every build row ends 'success'), and each figure comes
    with its ratio to the no-op drain of the same block."""
    sizes = runner.TINY
    raw = {}
    for name, step in runner.build_row_steps(sizes, dsn):
        raw[name] = await trio.to_thread.run_sync(step)
    result = runner.build_row_result(raw, sizes)
    assert set(result["modes"]) == {"noop", "folded", "direct", "noop_10ms", "folded_10ms"}
    for mode in result["modes"].values():
        assert mode["jobs_per_s"] > 0
        assert mode["vs_noop"] > 0
    assert result["modes"]["noop"]["vs_noop"] == result["modes"]["noop_10ms"]["vs_noop"] == 1.0
    assert result["modes"]["noop"]["start_writes_sent"] == 0
    # With 10 ms of work the start writes usually go out before their reports, but
    # whether one does is timing (a loaded machine answers the report first, and
    # then none is sent): only the bounds are certain. Every mode that marks its
    # builds counts them; tests/test_folded_writes.py proves what is written.
    for mode in result["modes"].values():
        assert 0 <= mode["start_writes_sent"] <= mode["jobs"] * len(mode["runs"])
    table = Table()
    runner.build_row_rows(table, {"build_row": result})
    assert table.row_count == 5
