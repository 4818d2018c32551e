"""
Smoke test of the benchmark runner (`nasiko-queue bench`): tiny sizes on the
test database. It checks that every workload ran and produced positive
figures; it never asserts a speed (benchmarks/README.md says why).
"""

from __future__ import annotations

import json
import statistics
import uuid
from pathlib import Path

import pytest
import trio
from rich.table import Table

from benchmarks import job_costs, runner, workloads
from benchmarks.plain import BenchPadded, BenchPing
from nasiko_queue import open_database
from nasiko_queue.builds.payloads import PayloadCodec

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
    # -- ceiling L (issue #25): measured in the run, each wake across processes a ratio to it
    assert data["latency"]["ceiling_L"]["n"] == runner.TINY.latency_jobs
    assert all(data["latency"][w]["vs_L"]["p50"] > 0 for w in runner.L_RUNS)
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

    # -- workflows (issue #22) --
    wf = data["workflows"]
    assert (wf["runs"], wf["steps_per_run"]) == (runner.TINY.workflow_runs, 5)
    assert wf["plain_jobs_per_s"] > 0
    assert wf["runs_per_s"] > 0
    assert wf["steps_per_s"] == pytest.approx(wf["runs_per_s"] * 5)
    assert wf["steps_vs_plain"] == wf["steps_per_s"] / wf["plain_jobs_per_s"]
    # Every transition of every run measured, from the jobs' timestamps.
    assert wf["transition_loaded"]["n"] == runner.TINY.workflow_runs * 4
    assert wf["transition_idle"]["n"] == runner.TINY.workflow_serial_runs * 4
    for key in ("transition_loaded", "transition_idle"):
        assert 0 < wf[key]["p50_ms"] <= wf[key]["p99_ms"] <= wf[key]["max_ms"]

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


# -- look-ahead and job costs (issue #25) ---------------------------------------------


async def test_the_look_ahead_drains_and_the_job_costs_run_and_are_shown(dsn: str) -> None:
    """The block of issue #25: the plain drain with prefetch 0 and with the default
    ("auto") in each round, their ratio, and what a plain and a build job cost the
    server (WAL, backends' CPU, bytes per relation). Only that each figure is there
    and sane; the speed is the bench's to report."""
    sizes = runner.TINY
    raw = {}
    for name, step in runner.look_ahead_steps(sizes, dsn):
        raw[name] = await trio.to_thread.run_sync(step)
    result = runner.look_ahead_result(raw, sizes)
    assert [d["concurrency"] for d in result["drain"]] == list(runner.LOOK_AHEAD_CONCURRENCY)
    for d in result["drain"]:
        assert d["ratio"] > 0
        assert all(x["look_ahead"] is None for x in d["p0"])  # prefetch 0: no look-ahead
        assert all(x["look_ahead"] is not None for x in d["auto"])
        assert all(x["returned"] == 0 for x in d["p0"] + d["auto"])
    for kind, cost in result["job_cost"].items():
        assert cost["wal_bytes_per_job"] > 0, kind
        assert cost["per_job"]["n_tup_ins"] >= 1, cost  # every job inserted
        assert cost["per_job"]["n_tup_upd"] >= 2, cost  # claimed, then finished
        table = job_costs.TABLES[kind]
        assert cost["bytes_per_job"][table] > 0, cost
        assert len(cost["bytes_per_job"]) > 1, cost  # the heap and its indexes
        cpu = cost["server_cpu_us_per_job"]
        assert cpu is None or cpu >= 0
    assert all(isinstance(cost["checkpoint"], bool) for cost in result["job_cost"].values())
    assert set(result["build_wal_vs"]) == {"plain", "plain_padded"}
    assert all(r > 0 for r in result["build_wal_vs"].values())
    table = Table()
    runner.look_ahead_rows(table, {"look_ahead": result})
    assert table.row_count == len(runner.LOOK_AHEAD_CONCURRENCY) + len(runner.COST_KINDS)
    notes = [str(cell) for cell in table.columns[-1].cells]
    assert sum("x plain_padded" in note for note in notes) == 1, notes  # on the build row


async def test_the_build_and_plain_drains_take_turns_and_are_shown_as_a_ratio(
        dsn: str) -> None:
    """Issue #25's build-vs-plain target in the bench's own output: the three drains
    (build, plain, plain padded to the build payload's length) turn which goes first,
    each round gives a ratio to each plain kind, and the worker's CPU per job of each
    kind is beside them. Only that each figure is there and sane."""
    sizes = runner.TINY
    steps = runner.build_vs_plain_steps(sizes, dsn)
    kinds = len(runner.BUILD_VS_PLAIN_KINDS)
    assert len(steps) == kinds * runner.BUILD_VS_PLAIN_ROUNDS
    firsts = [name.split()[0] for name, _ in steps[::kinds]]
    assert firsts == ["build", "plain", "plain_padded"][:runner.BUILD_VS_PLAIN_ROUNDS]
    raw = {}
    for name, step in steps:
        raw[name] = await trio.to_thread.run_sync(step)
    result = runner.build_vs_plain_result(raw, sizes)
    for plain_kind, ratios_key, median_key in (("plain", "ratios", "ratio"),
                                               ("plain_padded", "padded_ratios",
                                                "padded_ratio")):
        ratios = result[ratios_key]
        assert len(ratios) == runner.BUILD_VS_PLAIN_ROUNDS
        for b, p, r in zip(result["build_jobs_per_s"], result[f"{plain_kind}_jobs_per_s"],
                           ratios, strict=True):
            assert r == pytest.approx(b / p)
        assert result[median_key] == statistics.median(ratios)
    assert set(result["cpu_us_per_job"]) == set(runner.BUILD_VS_PLAIN_KINDS)
    assert all(v > 0 for v in result["cpu_us_per_job"].values())
    table = Table()
    runner.build_vs_plain_rows(table, {"build_vs_plain": result})
    assert table.row_count == 1
    note = str(next(iter(table.columns[-1].cells)))
    assert "x plain (rounds: " in note, note
    assert "x padded (rounds: " in note, note


async def test_the_padded_plain_drain_carries_a_payload_as_long_as_the_build_drains(
        dsn: str) -> None:
    """The padded plain jobs the build-vs-plain block drains are exactly as long, in
    the compact JSON enqueued, as the build jobs `workloads.drain` prepares: the ratio
    to them leaves the payload's size out of the comparison."""
    length = workloads.drain_payload_bytes()
    assert length > 300  # an Upload with three ids, paths, a name: not a stub
    result = await trio.to_thread.run_sync(
        lambda: job_costs.plain_drain(dsn, 3, 1, "p0", "plain_padded"))
    assert result["jobs"] == 3
    async with open_database(dsn) as db:
        stored = await db.fetch("SELECT payload::text AS p FROM nasiko_queue_jobs")
    codec = PayloadCodec()
    compact = [len(codec.dumps(BenchPadded(**{k: v for k, v in json.loads(row["p"]).items()
                                               if k != "kind"})))
               for row in stored]
    assert compact == [length] * 3
    with pytest.raises(ValueError, match="plain_padded"):
        job_costs.plain_drain("postgresql://unused", 1, 1, "p0", "build")


async def test_a_job_cost_run_starts_from_a_checkpoint_when_the_role_may_take_one(
        dsn: str) -> None:
    """`job_cost` takes a CHECKPOINT first (else one falling between its preparation
    and its run logs whole pages it then counts), and says whether it could."""
    async with open_database(dsn) as db:
        may = await db.fetchval(
            "SELECT rolsuper OR pg_has_role(current_user, 'pg_checkpoint', 'MEMBER') "
            "FROM pg_roles WHERE rolname = current_user")
        redo = "SELECT redo_lsn FROM pg_control_checkpoint()"
        before = await db.fetchval(redo) if may else None
        await db.execute("CREATE TABLE after_the_last_checkpoint AS SELECT 1 AS x")
        took = await trio.to_thread.run_sync(job_costs._checkpoint, dsn)
        after = await db.fetchval(redo) if may else None
    assert took is may
    if took:
        assert after > before  # a new checkpoint: its redo point is past the table's WAL


def test_the_padded_plain_job_is_stored_as_long_as_a_build_job() -> None:
    """The job-cost bench's `plain_padded` jobs: JSON as long as the build jobs' (an
    `Upload` with a sealed secret, as the queue writes it), whatever their number."""
    codec = PayloadCodec(secrets=workloads.BENCH_SECRETS)
    build = len(codec.dumps(workloads.bench_upload(uuid.uuid4(), uuid.uuid4(), uuid.uuid4())))
    padded = job_costs.padded_payloads(1200)
    assert {len(codec.dumps(p)) for p in padded} == {build}
    assert len(codec.dumps(BenchPing(n=0))) < build / 10  # what the plain row stores


# -- ceiling L (issue #25) --------------------------------------------------------------


async def test_ceiling_l_is_measured_beside_the_wake_and_each_wake_is_a_ratio_to_it(
        dsn: str) -> None:
    """Ceiling L (a bare LISTEN/NOTIFY ping-pong) runs in the latency block, and each
    wake from another process is given as a ratio to it; only the shape is checked."""
    sizes = runner.TINY
    raw = {}
    steps = runner.latency_steps(sizes, dsn)
    assert [name for name, _ in steps] == ["ceiling L", "latency"]
    for name, step in steps:
        raw[name] = await trio.to_thread.run_sync(step)
    lat = runner.latency_result(raw)
    ceiling_l = lat["ceiling_L"]
    assert ceiling_l["n"] == sizes.latency_jobs
    assert 0 < ceiling_l["p50_ms"] <= ceiling_l["p99_ms"] <= ceiling_l["max_ms"]
    for where in runner.L_RUNS:
        wake, ratios = lat[where], lat[where]["vs_L"]
        assert ratios["p50"] == wake["p50_ms"] / ceiling_l["p50_ms"]
        assert ratios["p99"] == wake["p99_ms"] / ceiling_l["p99_ms"]
        assert ratios["after_commit_p50"] == (wake["after_commit"]["p50_ms"]
                                              / ceiling_l["p50_ms"])
    assert "vs_L" not in lat["in_process"]  # an in-process wake needs no NOTIFY
    table = Table()
    runner.ceiling_l_rows(table, {"latency": lat})
    assert table.row_count == 1 + len(runner.L_RUNS)
