"""
Run every workload in one go, then render: JSON, a rich table, a PNG plot.

`run_benchmarks` is what `nasiko-queue bench` and tests/test_bench.py call.
"""

from __future__ import annotations

import functools
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from nasiko_queue.queue import ENQUEUE_MANY_CHUNK  # -- enqueue (issue #13)

from . import ceilings, job_costs, workflows, workloads


@attrs.frozen(kw_only=True)
class Sizes:
    drain_jobs: int = 3000
    #: (concurrency, prefetch) settings of the drain workload; prefetch 0 is the default.
    drain_settings: tuple[tuple[int, int], ...] = ((1, 0), (10, 0), (1, 32), (10, 100))
    enqueue_jobs: int = 1000
    latency_jobs: int = 200
    latency_rate: float = 100.0
    history_rows: tuple[int, ...] = (0, 100_000)
    history_claims: int = 300
    replica_jobs: int = 3000
    replica_processes: tuple[int, ...] = (1, 2, 4)
    replica_concurrency: int = 10
    ceiling_jobs: int = 3000
    # -- enqueue (issue #13) --
    #: Jobs of one `enqueue_many` call (and of ceiling e2).
    enqueue_many_jobs: int = 20_000
    #: Each enqueue-vs-bare pair is measured this many times, interleaved.
    enqueue_rounds: int = 3
    #: One per call: the engine and ceiling e1 take turns, this many blocks each.
    enqueue_blocks: int = 20
    # -- claim flat (issue #13) --
    #: Finished jobs beside the claimable ones, and jobs the claim must leave
    #: alone (another kind's, another queue's, scheduled for later).
    flat_history_rows: int = 100_000
    flat_other_rows: int = 100_000
    flat_claims: int = 300
    # -- replicas (issue #13) --
    #: Rounds of the 1- and 2-process replicas runs, interleaved (1, 2, 4, then
    #: 1, 2 again): the 2-vs-1 ratio is reported per round.
    replica_rounds: int = 2
    # -- workflows (issue #22) --
    #: Runs of the five-step chain started up front (the plain drain beside
    #: them has as many jobs as they have steps), and runs started one after
    #: another on an idle worker for the transition latency.
    workflow_runs: int = 300
    workflow_serial_runs: int = 50
    # -- look-ahead and job costs (issue #25) --
    #: Jobs of each `job_costs.job_cost` run (enqueued and run together).
    cost_jobs: int = 3000


DEFAULT = Sizes()
FULL = Sizes(drain_jobs=10_000,
             drain_settings=((1, 0), (2, 0), (5, 0), (10, 0), (20, 0), (50, 0),
                             (1, 8), (1, 32), (1, 128), (10, 20), (10, 100), (50, 200)),
             enqueue_jobs=3000,
             latency_jobs=1000, history_rows=(0, 100_000, 1_000_000), history_claims=1000,
             replica_jobs=10_000, ceiling_jobs=10_000, enqueue_many_jobs=50_000,
             enqueue_rounds=5, flat_history_rows=1_000_000, flat_claims=1000,
             workflow_runs=1000, workflow_serial_runs=200)
TINY = Sizes(drain_jobs=30, drain_settings=((1, 0), (2, 0), (1, 4)), enqueue_jobs=20,
             latency_jobs=10, latency_rate=200.0,
             history_rows=(0, 1000), history_claims=10, replica_jobs=30,
             replica_processes=(1, 2), replica_concurrency=2, ceiling_jobs=30,
             enqueue_many_jobs=60, enqueue_rounds=1,
             flat_history_rows=1000, flat_other_rows=1000, flat_claims=10, replica_rounds=1,
             workflow_runs=4, workflow_serial_runs=3, cost_jobs=30)


def _drain_step(concurrency: int, prefetch: int) -> str:
    return f"drain c={concurrency}" + (f" p={prefetch}" if prefetch else "")


def _b_shape(drain: dict[str, Any]) -> tuple[int, int]:
    """(K, statements in flight) of the engine's batching in a drain, for ceiling b."""
    k = max(1, round(drain["jobs"] / max(1, drain["statements"])))
    return k, 1 if drain["concurrency"] == 1 else 2


def _steps(sizes: Sizes, dsn: str, raw: dict[str, Any]) -> list[tuple[str, Callable[[], Any]]]:
    s = sizes
    steps: list[tuple[str, Callable[[], Any]]] = []

    def ceiling(fn: Callable[[], float]) -> Callable[[], Any]:
        def go() -> float:
            workloads.ceiling_prepare(dsn, s.ceiling_jobs)
            return fn()
        return go

    def ceiling_b(drain_step: str) -> Callable[[], Any]:
        def go() -> dict[str, Any]:
            k, streams = _b_shape(raw[drain_step])
            workloads.ceiling_prepare(dsn, s.ceiling_jobs)
            return {"k": k, "streams": streams,
                    "jobs_per_s": ceilings.same_sql(dsn, s.ceiling_jobs, k, streams)}
        return go

    def ceiling_a(suffix: str = "") -> list[tuple[str, Callable[[], Any]]]:
        return [(f"ceiling a, {n} conn{'s' if n > 1 else ''}{suffix}",
                 ceiling(lambda n=n: ceilings.one_per_transaction(dsn, s.ceiling_jobs, n)))
                for n in (1, 8)]

    steps += ceiling_a()
    for c, p in s.drain_settings:
        name = _drain_step(c, p)
        steps.append((name, lambda c=c, p=p: workloads.drain(dsn, s.drain_jobs, c, p)))
        # Ceiling b right after, with the batching this drain reached; and
        # ceiling a again: the run's ceiling a is the median of these samples
        # spread over the run (one sample at the start gave a8 1,649-3,097 jobs/s
        # in three runs of one hour, while the drains moved a third as much).
        steps.append((f"ceiling b, {name}", ceiling_b(name)))
        steps += ceiling_a(f", {name}")
    steps.append(("enqueue", lambda: workloads.enqueue(dsn, s.enqueue_jobs)))
    steps += latency_steps(s, dsn)  # the latency workload beside ceiling L (issue #25)
    for h in s.history_rows:
        steps.append((f"history {h:,}",
                      lambda h=h: workloads.history(dsn, h, s.history_claims)))
    steps.append(("claim flat", lambda: workloads.claim_flat(  # -- claim flat (issue #13) --
        dsn, s.flat_history_rows, s.flat_other_rows, s.flat_claims)))
    for p in s.replica_processes:
        steps.append((f"replicas {p}", lambda p=p: workloads.replicas(
            dsn, s.replica_jobs, p, s.replica_concurrency)))
    steps += _enqueue_steps(s, dsn)  # -- enqueue (issue #13)
    for r in range(2, s.replica_rounds + 1):  # -- replicas (issue #13) --
        for p in (1, 2):
            steps.append((f"replicas {p} #{r}", lambda p=p: workloads.replicas(
                dsn, s.replica_jobs, p, s.replica_concurrency)))
    steps += build_row_steps(s, dsn)  # folded build-row writes (issue #13)
    steps.append(("workflows", functools.partial(  # -- workflows (issue #22)
        workflows.workflow_drain, dsn, s.workflow_runs, WORKFLOW_CONCURRENCY,
        s.workflow_serial_runs)))
    steps += look_ahead_steps(s, dsn)  # look-ahead and job costs (issue #25)
    steps += build_vs_plain_steps(s, dsn)  # build jobs beside plain jobs (issue #25)
    return steps


def run_benchmarks(dsn: str, sizes: Sizes = DEFAULT, *, console: Console | None = None,
                   database: str = "given DSN") -> dict[str, Any]:
    """Run every workload on `dsn` (a migrated database whose rows are deleted)."""
    raw: dict[str, Any] = {}
    steps = _steps(sizes, dsn, raw)
    t_start = time.perf_counter()
    with Progress(TextColumn("{task.description:<24}"), BarColumn(),
                  TextColumn("{task.completed}/{task.total}"), TimeElapsedColumn(),
                  console=console, transient=False, disable=console is None) as progress:
        task = progress.add_task("starting", total=len(steps))
        for name, fn in steps:
            progress.update(task, description=name)
            raw[name] = fn()
            progress.advance(task)
        progress.update(task, description="done")
    workloads.reset(dsn)
    return _assemble(raw, sizes, database, time.perf_counter() - t_start)


def _a_samples(raw: dict[str, Any], s: Sizes, connections: str) -> list[float]:
    """Every measurement of one ceiling a in the run: first, then one after each drain."""
    names = [f"ceiling a, {connections}"] + [
        f"ceiling a, {connections}, {_drain_step(c, p)}" for c, p in s.drain_settings]
    return [raw[n] for n in names if n in raw]


def _assemble(raw: dict[str, Any], s: Sizes, database: str, seconds: float) -> dict[str, Any]:
    a1_samples, a8_samples = _a_samples(raw, s, "1 conn"), _a_samples(raw, s, "8 conns")
    # The run's ceilings a: the median of their samples. Not the sample beside
    # each drain: a single 3,000-job sample moves by 2x within a minute here
    # (1,296-2,731 jobs/s in one run), more than the median of five does
    # between runs.
    a1, a8 = workloads.median(a1_samples), workloads.median(a8_samples)

    def ratios(value: float, b: dict[str, Any]) -> dict[str, Any]:
        return {"vs_a1": value / a1, "vs_a8": value / a8, "vs_b": value / b["jobs_per_s"],
                "b_k": b["k"], "b_streams": b["streams"]}

    drain = []
    b_of: dict[tuple[int, int], dict[str, Any]] = {}
    for c, p in s.drain_settings:
        name = _drain_step(c, p)
        d = raw[name]
        b = raw[f"ceiling b, {name}"]
        b_of[c, p] = b
        d["setting"] = name
        d["jobs_per_statement"] = d["jobs"] / max(1, d["statements"])
        d["ceiling_b"] = b
        # The samples of ceiling a taken right after this drain, for the record.
        d["ceiling_a"] = {"a_1conn_jobs_per_s": raw.get(f"ceiling a, 1 conn, {name}"),
                          "a_8conn_jobs_per_s": raw.get(f"ceiling a, 8 conns, {name}")}
        d["ratios"] = ratios(d["jobs_per_s"], b)
        drain.append(d)
    # Enqueue against the one-job b; the replicas against the b of a drain at
    # their concurrency without prefetch (the setting they run), if measured.
    b_single = b_of.get((1, 0), drain[0]["ceiling_b"])
    b_replicas = b_of.get((s.replica_concurrency, 0), drain[-1]["ceiling_b"])
    enq = raw["enqueue"]
    enq["ratios_single"] = ratios(enq["single_jobs_per_s"], b_single)
    enq["ratios_batch"] = ratios(enq["batch_jobs_per_s"], b_single)
    reps = []
    for p in s.replica_processes:
        r = raw[f"replicas {p}"]
        r["ratios"] = ratios(r["jobs_per_s"], b_replicas)
        reps.append(r)
    ceil = {"a_1conn_jobs_per_s": a1, "a_8conn_jobs_per_s": a8,
            "a_1conn_samples": a1_samples, "a_8conn_samples": a8_samples,
            "b": [{"drain": _drain_step(c, p), **b_of[c, p]} for c, p in s.drain_settings]}
    hist = [raw[f"history {h:,}"] for h in s.history_rows]
    base = hist[0]["p50_ms"]
    for h in hist:
        h["p50_vs_empty"] = h["p50_ms"] / base if base else 0.0
    return {
        "meta": {"when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                 "machine": platform.platform(), "cpus": os.cpu_count(),
                 "python": platform.python_version(), "database": database,
                 "seconds": round(seconds, 1), "sizes": attrs.asdict(s)},
        "ceilings": ceil,
        "drain": drain,
        "enqueue": enq,
        "latency": latency_result(raw),  # with its ratios to ceiling L (issue #25)
        "history": hist,
        "claim_flat": raw.get("claim flat"),
        "replicas": reps,
        "enqueue_vs_bare": _enqueue_assemble(raw, s),  # -- enqueue (issue #13)
        "replicas_2_vs_1": _two_vs_one(raw, s),
        "build_row": build_row_result(raw, s),  # folded build-row writes (issue #13)
        "workflows": raw.get("workflows"),  # -- workflows (issue #22)
        "look_ahead": look_ahead_result(raw, s),  # look-ahead and job costs (issue #25)
        "build_vs_plain": build_vs_plain_result(raw, s),  # (issue #25)
    }


# -- enqueue (issue #13) -------------------------------------------------------
#
# Each engine enqueue figure beside its bare ceiling, measured back to back, the
# pair repeated `enqueue_rounds` times: one per call against e1 (in interleaved
# blocks), enqueue_many against e2 (which goes first alternates by round), for
# build and plain jobs. A ratio is taken within its pair; the summary is the
# median of the rounds'.

_KINDS = ("build", "plain")


def _enqueue_steps(s: Sizes, dsn: str) -> list[tuple[str, Callable[[], Any]]]:
    steps: list[tuple[str, Callable[[], Any]]] = []
    blocks = max(1, min(s.enqueue_blocks, s.enqueue_jobs))
    for r in range(s.enqueue_rounds):
        for kind in _KINDS:
            steps.append((f"enqueue 1/call {kind} #{r + 1}",
                          lambda kind=kind: workloads.enqueue_one_per_call(
                              dsn, kind, s.enqueue_jobs, blocks)))
        for kind in _KINDS:
            steps.append((f"enqueue_many {kind} #{r + 1}",
                          lambda kind=kind, r=r: workloads.enqueue_many_pair(
                              dsn, kind, s.enqueue_many_jobs, engine_first=r % 2 == 1)))
    return steps


def _enqueue_assemble(raw: dict[str, Any], s: Sizes) -> dict[str, Any]:
    out: dict[str, Any] = {"jobs_one_per_call": s.enqueue_jobs,
                           "blocks_one_per_call": max(1, min(s.enqueue_blocks, s.enqueue_jobs)),
                           "jobs_enqueue_many": s.enqueue_many_jobs,
                           "chunk_enqueue_many": ENQUEUE_MANY_CHUNK,
                           "rounds": s.enqueue_rounds}
    for kind in _KINDS:
        rounds = range(1, s.enqueue_rounds + 1)
        single = [raw[f"enqueue 1/call {kind} #{r}"] for r in rounds]
        e2 = [raw[f"enqueue_many {kind} #{r}"]["bare"] for r in rounds]
        many = [raw[f"enqueue_many {kind} #{r}"]["engine_jobs_per_s"] for r in rounds]
        out[kind] = {}
        for what, bare, eng, paired in (
                ("one_per_call", [x["bare_jobs_per_s"] for x in single],
                 [x["engine_jobs_per_s"] for x in single], [x["ratio"] for x in single]),
                ("many", [x["jobs_per_s"] for x in e2], many, None)):
            # One per call: each round's median over its blocks (see the workload).
            ratios = paired or [e / b for e, b in zip(eng, bare, strict=True)]
            out[kind][what] = {"bare_jobs_per_s": bare, "engine_jobs_per_s": eng,
                               "ratios": ratios, "ratio": statistics.median(ratios)}
        m = out[kind]["many"]
        m["bare_insert_jobs_per_s"] = [x["insert_jobs_per_s"] for x in e2]
        m["bare_copy_jobs_per_s"] = [x["copy_jobs_per_s"] for x in e2]
        m["ratios_vs_insert"] = [e / x["insert_jobs_per_s"] for e, x in zip(many, e2,
                                                                           strict=True)]
        m["ratio_vs_insert"] = statistics.median(m["ratios_vs_insert"])
    return out


def _enqueue_table(t: Table, result: dict[str, Any]) -> None:
    e = result.get("enqueue_vs_bare")
    if not e:
        return

    def figures(values: list[float]) -> str:
        return " · ".join(f"{v:,.0f}" for v in values) + " jobs/s"

    for kind in _KINDS:
        one, many = e[kind]["one_per_call"], e[kind]["many"]
        what = "Upload, sealed env" if kind == "build" else "JobArgs"
        t.add_row("ceiling e1", f"bare INSERT+NOTIFY loop, 1 conn ({kind}; "
                  f"{e['blocks_one_per_call']} blocks, turn about)",
                  figures(one["bare_jobs_per_s"]), "")
        t.add_row("enqueue", f"1 per call, {kind} ({what})",
                  figures(one["engine_jobs_per_s"]),
                  f"{one['ratio']:.2f}x e1 (" + " · ".join(f"{r:.2f}" for r in one["ratios"])
                  + ")")
        t.add_row("ceiling e2", f"bare {e['jobs_enqueue_many']:,} rows, 1 INSERT | COPY ({kind})",
                  " · ".join(f"{i:,.0f} | {c:,.0f}" for i, c in zip(
                      many["bare_insert_jobs_per_s"], many["bare_copy_jobs_per_s"],
                      strict=True)) + " jobs/s", "")
        t.add_row("enqueue_many", f"{e['jobs_enqueue_many']:,} {kind} jobs in 1 call",
                  figures(many["engine_jobs_per_s"]),
                  f"{many['ratio']:.2f}x e2 (" + " · ".join(
                      f"{r:.2f}" for r in many["ratios"]) + f"); "
                  f"{many['ratio_vs_insert']:.2f}x its INSERT")


def _two_vs_one(raw: dict[str, Any], s: Sizes) -> list[float]:
    """-- replicas (issue #13) -- 2 processes over 1, per round of the same run."""
    out = []
    for r in range(1, s.replica_rounds + 1):
        tag = "" if r == 1 else f" #{r}"
        one, two = raw.get(f"replicas 1{tag}"), raw.get(f"replicas 2{tag}")
        if one and two:
            out.append(two["jobs_per_s"] / one["jobs_per_s"])
    return out


# -- rendering ----------------------------------------------------------------


def _r(ratios: dict[str, Any]) -> str:
    return (f"{ratios['vs_a1']:.2f}x a1 · {ratios['vs_a8']:.2f}x a8 · "
            f"{ratios['vs_b']:.2f}x b(K={ratios['b_k']}×{ratios['b_streams']})")


def table(result: dict[str, Any]) -> Table:
    c = result["ceilings"]
    t = Table(title="nasiko-queue bench")
    t.add_column("workload")
    t.add_column("setting")
    t.add_column("figure", justify="right")
    t.add_column("ratio to ceilings (a: 1 job/tx at 1|8 conns; b: engine SQL)")
    for conns, key in (("1 connection", "a_1conn"), ("8 connections", "a_8conn")):
        samples = c.get(f"{key}_samples") or [c[f"{key}_jobs_per_s"]]
        t.add_row("ceiling a", conns, f"{c[f'{key}_jobs_per_s']:,.0f} jobs/s",
                  f"median of {len(samples)} samples over the run, "
                  f"{min(samples):,.0f}–{max(samples):,.0f}")
    for b in c["b"]:
        t.add_row("ceiling b", f"K={b['k']} × {b['streams']} in flight (as {b['drain']})",
                  f"{b['jobs_per_s']:,.0f} jobs/s", "")
    for d in result["drain"]:
        setting = f"concurrency {d['concurrency']}"
        if d.get("prefetch"):
            setting += f", prefetch {d['prefetch']}"
        t.add_row("drain", setting, f"{d['jobs_per_s']:,.0f} jobs/s "
                  f"({d['jobs_per_statement']:.1f} jobs/statement, "
                  f"{d['cpu_us_per_job']:.0f} µs CPU/job)", _r(d["ratios"]))
    e = result["enqueue"]
    t.add_row("enqueue", "1 job per call", f"{e['single_jobs_per_s']:,.0f} jobs/s",
              _r(e["ratios_single"]))
    t.add_row("enqueue", f"{e['jobs']} in 1 tx", f"{e['batch_jobs_per_s']:,.0f} jobs/s",
              _r(e["ratios_batch"]))
    _enqueue_table(t, result)  # -- enqueue (issue #13)
    lat = result["latency"]
    for where in ("in_process", "other_process", "plain_other_process"):
        v = lat.get(where)
        if v is None:
            continue
        if isinstance(v, dict):
            t.add_row("latency", where.replace("_", " ") + " (from before the call)",
                      f"p50 {v['p50_ms']:.2f} · p95 {v['p95_ms']:.2f} · p99 {v['p99_ms']:.2f} "
                      f"· max {v['max_ms']:.2f} ms",
                      f"enqueue call alone: p50 {v['enqueue_call_p50_ms']:.2f} ms"
                      if "enqueue_call_p50_ms" in v else "")
            # -- latency (issue #13) --
            if "after_commit" in v:
                a = v["after_commit"]
                t.add_row("latency", where.replace("_", " ") + " (after its commit)",
                          f"p50 {a['p50_ms']:.2f} · p95 {a['p95_ms']:.2f} · "
                          f"p99 {a['p99_ms']:.2f} · max {a['max_ms']:.2f} ms",
                          "target: p50 ≤ 1 ms, p99 ≤ 3 ms")
        else:
            t.add_row("latency", where.replace("_", " "), str(v), "")
    ceiling_l_rows(t, result)  # -- ceiling L (issue #25)
    for h in result["history"]:
        t.add_row("history", f"{h['history_rows']:,} done/failed rows",
                  f"claim p50 {h['p50_ms']:.3f} · p99 {h['p99_ms']:.3f} ms",
                  f"{h['p50_vs_empty']:.2f}x empty; plan: {h['plan_node']}")
    # -- claim flat (issue #13) --
    for c in (result.get("claim_flat") or {}).get("cases", ()):
        e, x = c["empty"], c["loaded"]
        t.add_row("claim flat", f"{c['lane']}: {c['table']}",
                  f"p50 {x['p50_ms']:.3f} · p99 {x['p99_ms']:.3f} ms "
                  f"(empty {e['p50_ms']:.3f} · {e['p99_ms']:.3f})",
                  f"{c['p50_vs_empty']:.2f}x / {c['p99_vs_empty']:.2f}x empty; "
                  f"{x['buffers']} pages ({e['buffers']} empty); {x['plan_node']}")
    rounds = result.get("replicas_2_vs_1") or []
    if rounds:
        t.add_row("replicas", "2 processes over 1, per round", " · ".join(
            f"{x:.2f}x" for x in rounds), "target ≥ 1.3x")
    one = next((r for r in result["replicas"] if r["processes"] == 1), None)
    for r in result["replicas"]:
        # -- replicas (issue #13): the ratio to one process, and where the CPU went --
        vs_one = f" ({r['jobs_per_s'] / one['jobs_per_s']:.2f}x one)" if one else ""
        cpu = ""
        if "worker_us_per_job" in r:
            cpu = (f"; CPU/job: workers {r['worker_us_per_job']:.0f} µs "
                   f"({r['worker_cores']:.2f} cores)")
            if "server_us_per_job" in r:
                cpu += (f", server {r['server_us_per_job']:.0f} µs "
                        f"({r['server_cores']:.2f} cores)")
        t.add_row("replicas", f"{r['processes']} process(es) × c={r['concurrency']}",
                  f"{r['jobs_per_s']:,.0f} jobs/s{vs_one}", _r(r["ratios"]) + cpu)
    build_row_rows(t, result)  # folded build-row writes (issue #13)
    workflow_rows(t, result)  # -- workflows (issue #22)
    look_ahead_rows(t, result)  # look-ahead and job costs (issue #25)
    build_vs_plain_rows(t, result)  # build jobs beside plain jobs (issue #25)
    return t


def write_json(result: dict[str, Any], path: Path) -> None:
    path.write_text(json.dumps(result, indent=2) + "\n")


def plot(result: dict[str, Any], path: Path) -> bool:
    """Write the PNG; False when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    c = result["ceilings"]
    labels = ["ceil a 1c", "ceil a 8c"] + [f"ceil b K{b['k']}×{b['streams']}" for b in c["b"]]
    values = [c["a_1conn_jobs_per_s"], c["a_8conn_jobs_per_s"]] + [
        b["jobs_per_s"] for b in c["b"]]
    colors = ["grey"] * len(values)
    for d in result["drain"]:
        labels.append(f"drain c{d['concurrency']}"
                      + (f" p{d['prefetch']}" if d.get("prefetch") else ""))
        values.append(d["jobs_per_s"])
        colors.append("tab:blue")
    for r in result["replicas"]:
        labels.append(f"{r['processes']} proc")
        values.append(r["jobs_per_s"])
        colors.append("tab:green")
    e = result["enqueue"]
    labels += ["enq 1/call", "enq 1 tx"]
    values += [e["single_jobs_per_s"], e["batch_jobs_per_s"]]
    colors += ["tab:orange"] * 2
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(14, 5))
    ax1.bar(labels, values, color=colors)
    ax1.set_ylabel("jobs/s")
    ax1.set_title("throughput per setting")
    ax1.tick_params(axis="x", rotation=60)
    lat = result["latency"]
    for where in ("in_process", "other_process"):
        v = lat[where]
        if isinstance(v, dict) and v.get("samples_ms"):
            xs = sorted(v["samples_ms"])
            ys = [(i + 1) / len(xs) for i in range(len(xs))]
            ax2.plot(xs, ys, label=where.replace("_", " "))
    ax2.set_xlabel("enqueue → executor start (ms)")
    ax2.set_ylabel("fraction of jobs")
    ax2.set_title("latency distribution (CDF)")
    if ax2.get_legend_handles_labels()[0]:
        ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


# -- folded build-row writes (issue #13) ------------------------------------------
#
# "drain, executor writes its build row": concurrency 10, default settings, the
# executor writing 'building' then 'success' through its context (folded into the
# worker's statements) or the old way (two `ctx.db.execute` of its own), each shown
# as a ratio to the no-op drain at the same setting. The no-op and folded drains
# alternate, three of each, so that the ratio compares runs a second or two apart,
# not the start and the end of a noisy run; the old way runs once, on half the jobs.

#: The order of the block's drains; then one of each with 10 ms of work per job,
#: where the start writes go out (on a sixth of the jobs: 100 jobs/s per slot).
BUILD_ROW_ORDER = ("noop", "folded", "direct", "noop", "folded", "noop", "folded",
                   "noop_10ms", "folded_10ms")
#: Their concurrency: the issue's target setting.
BUILD_ROW_CONCURRENCY = 10


def _build_row_jobs(s: Sizes, mode: str) -> int:
    """The drain's jobs; half of them the old way, which runs at a third of the speed,
    and a sixth with 10 ms of work."""
    if mode.endswith("_10ms"):
        return max(10, s.drain_jobs // 6)
    return s.drain_jobs // 2 if mode == "direct" else s.drain_jobs


def build_row_steps(s: Sizes, dsn: str) -> list[tuple[str, Callable[[], Any]]]:
    return [(f"build row {i} {mode}",
             functools.partial(workloads.drain_build_row, dsn, _build_row_jobs(s, mode),
                               BUILD_ROW_CONCURRENCY, mode))
            for i, mode in enumerate(BUILD_ROW_ORDER)]


def build_row_result(raw: dict[str, Any], s: Sizes) -> dict[str, Any]:
    """Each mode's mean jobs/s and its ratio to the no-op drain of the same block."""
    runs: dict[str, list[dict[str, Any]]] = {}
    for i, mode in enumerate(BUILD_ROW_ORDER):
        runs.setdefault(mode, []).append(raw[f"build row {i} {mode}"])
    mean = {mode: sum(r["jobs_per_s"] for r in rs) / len(rs) for mode, rs in runs.items()}
    base = {mode: mean["noop_10ms" if mode.endswith("_10ms") else "noop"] for mode in mean}
    plain = raw.get(_drain_step(BUILD_ROW_CONCURRENCY, 0))
    return {
        "concurrency": BUILD_ROW_CONCURRENCY,
        "modes": {
            mode: {"jobs_per_s": mean[mode], "vs_noop": mean[mode] / base[mode],
                   "jobs": _build_row_jobs(s, mode),
                   "runs": [r["jobs_per_s"] for r in rs],
                   "jobs_per_statement": sum(r["jobs"] for r in rs)
                   / max(1, sum(r["statements"] for r in rs)),
                   "start_writes_sent": sum(r["start_writes"] for r in rs)}
            for mode, rs in runs.items()},
        # The drain workload's own no-op figure at this setting, when it ran.
        "drain_c10_jobs_per_s": plain["jobs_per_s"] if plain else None,
    }


def build_row_rows(t: Table, result: dict[str, Any]) -> None:
    b = result.get("build_row")
    if not b:
        return
    labels = {"noop": "no build-row writes (rows prepared 'success')",
              "folded": "start + end through ctx (folded)",
              "direct": "start + end by ctx.db.execute (the old way)",
              "noop_10ms": "10 ms of work, no build-row writes",
              "folded_10ms": "10 ms of work, start + end through ctx"}
    for mode, label in labels.items():
        m = b["modes"][mode]
        t.add_row("drain, executor writes its build row",
                  f"c={b['concurrency']}: {label}",
                  f"{m['jobs_per_s']:,.0f} jobs/s ({m['jobs_per_statement']:.1f} jobs/statement"
                  f", {m['start_writes_sent']} start writes sent)",
                  f"{m['vs_noop']:.2f}x no-op (runs: "
                  + ", ".join(f"{x:,.0f}" for x in m["runs"]) + ")")


# -- workflows (issue #22) -----------------------------------------------------
#
# Runs of a five-step chain against a plain drain of as many jobs, measured
# right before them in the same step, at the same concurrency
# (`benchmarks/workflows.py`).

#: The workflow drain's concurrency, as the plain drain's at the same setting.
WORKFLOW_CONCURRENCY = 10


def workflow_rows(t: Table, result: dict[str, Any]) -> None:
    w = result.get("workflows")
    if not w:
        return
    t.add_row("plain drain", f"{w['runs'] * w['steps_per_run']:,} BenchPing jobs, "
              f"c={w['concurrency']}", f"{w['plain_jobs_per_s']:,.0f} jobs/s",
              "the base of the next row")
    t.add_row("workflows", f"{w['runs']:,} runs of {w['steps_per_run']} chained steps, "
              f"c={w['concurrency']}",
              f"{w['runs_per_s']:,.1f} runs/s ({w['steps_per_s']:,.0f} steps/s)",
              f"{w['steps_vs_plain']:.2f}x the plain drain (steps/s ÷ jobs/s)")
    for key, label in (("transition_loaded", "in that drain"),
                       ("transition_idle", f"{w['serial_runs']} runs one by one, idle")):
        v = w[key]
        t.add_row("transition", f"step end → next step's start, {label}",
                  f"p50 {v['p50_ms']:.2f} · p99 {v['p99_ms']:.2f} · max {v['max_ms']:.2f} ms",
                  f"{v['n']} transitions")


# -- look-ahead and job costs (issue #25) ----------------------------------------
#
# The plain drain at concurrency 1 and 10 with prefetch 0 (the former default)
# and with the default ("auto"), in turn, `LOOK_AHEAD_ROUNDS` rounds (which goes
# first alternates): the ratio auto / 0 is taken within each round, the summary
# is their median. Then what one job costs the server, plain and build, enqueued
# and run together (`job_costs.job_cost`).

LOOK_AHEAD_CONCURRENCY = (1, 10)
LOOK_AHEAD_ROUNDS = 2
#: The concurrency of the job-cost runs.
COST_CONCURRENCY = 10
COST_KINDS = ("plain", "plain_padded", "build")


def look_ahead_steps(s: Sizes, dsn: str) -> list[tuple[str, Callable[[], Any]]]:
    steps: list[tuple[str, Callable[[], Any]]] = []
    for r in range(1, LOOK_AHEAD_ROUNDS + 1):
        for c in LOOK_AHEAD_CONCURRENCY:
            order = ("p0", "auto") if r % 2 else ("auto", "p0")
            steps += [(f"plain drain c={c} {setting} #{r}",
                       functools.partial(job_costs.plain_drain, dsn, s.drain_jobs, c, setting))
                      for setting in order]
    steps += [(f"job cost {kind}", functools.partial(job_costs.job_cost, dsn, kind,
                                                     s.cost_jobs, COST_CONCURRENCY))
              for kind in COST_KINDS]
    return steps


def look_ahead_result(raw: dict[str, Any], s: Sizes) -> dict[str, Any]:
    drains = []
    for c in LOOK_AHEAD_CONCURRENCY:
        rounds = range(1, LOOK_AHEAD_ROUNDS + 1)
        p0 = [raw[f"plain drain c={c} p0 #{r}"] for r in rounds]
        auto = [raw[f"plain drain c={c} auto #{r}"] for r in rounds]
        ratios = [a["jobs_per_s"] / b["jobs_per_s"] for a, b in zip(auto, p0, strict=True)]
        drains.append({"concurrency": c, "jobs": s.drain_jobs,
                       "p0": p0, "auto": auto, "ratios": ratios,
                       "ratio": statistics.median(ratios)})
    costs = {kind: raw[f"job cost {kind}"] for kind in COST_KINDS}
    # Issue #25 sets a build job at <= 1.5x a plain job's WAL; beside the small plain job,
    # one whose payload is as large as the build job's, to tell the payload from the rest.
    build_wal = {kind: costs["build"]["wal_bytes_per_job"] / costs[kind]["wal_bytes_per_job"]
                 for kind in ("plain", "plain_padded")}
    return {"drain": drains, "job_cost": costs, "build_wal_vs": build_wal}


def look_ahead_rows(t: Table, result: dict[str, Any]) -> None:
    la = result.get("look_ahead")
    if not la:
        return
    for d in la["drain"]:
        def line(runs: list[dict[str, Any]]) -> str:
            return " · ".join(f"{x['jobs_per_s']:,.0f}" for x in runs) + " jobs/s"

        look = ", ".join(str(x["look_ahead"]) for x in d["auto"])
        t.add_row("plain drain, prefetch 0 | auto", f"c={d['concurrency']}",
                  f"{line(d['p0'])} | {line(d['auto'])}",
                  f"auto {d['ratio']:.2f}x prefetch 0 (rounds: "
                  + ", ".join(f"{r:.2f}" for r in d["ratios"]) + f"); look-ahead {look}")
    for kind, c in la["job_cost"].items():
        cpu = c["server_cpu_us_per_job"]
        where = ", ".join(f"{name} {b:,.0f}" for name, b in c["bytes_per_job"].items())
        vs = la.get("build_wal_vs") if kind == "build" else None
        ratio = (f"WAL {vs['plain']:.2f}x plain, {vs['plain_padded']:.2f}x plain_padded; "
                 if vs else "")
        t.add_row("job cost (enqueue + run)", f"{kind}, c={c['concurrency']}",
                  f"{c['wal_bytes_per_job']:,.0f} B WAL/job · "
                  + (f"{cpu:,.0f} µs server CPU/job" if cpu is not None else "server CPU n/a"),
                  f"{ratio}HOT {c['hot_share'] or 0:.0%} of updates, fillfactor "
                  f"{c['fillfactor']}; bytes/job: {where}")


# -- build jobs beside plain jobs (issue #25) -------------------------------------
#
# Issue #25 sets the build drain at concurrency 10 at >= 0.9x the plain drain. Each
# round drains `drain_jobs` no-op jobs of three kinds at the build lane's settings
# (prefetch 0): build jobs, plain jobs with an 8-byte payload, and plain jobs whose
# payload is as long as the build jobs' (`workloads.drain_payload_bytes`), so that
# what a build job costs beyond carrying its payload shows on its own. Which kind goes
# first turns with each round, for `BUILD_VS_PLAIN_ROUNDS` rounds: the ratios are
# taken within each round and the summary is their median, since one drain of each
# kind minutes apart moved 0.69-0.89x on the same commit. The worker's CPU per job
# beside them says how much of a gap is the worker's own pipeline.

BUILD_VS_PLAIN_ROUNDS = 3
BUILD_VS_PLAIN_CONCURRENCY = 10
#: The drains of a round, in the first round's order; each later round starts one on.
BUILD_VS_PLAIN_KINDS = ("build", "plain", "plain_padded")


def _beside(kind: str, c: int, r: int) -> str:
    """A build-vs-plain step's name: the plain kinds beside build, build beside plain."""
    return f"{kind} beside {'plain' if kind == 'build' else 'build'} c={c} #{r}"


def build_vs_plain_steps(s: Sizes, dsn: str) -> list[tuple[str, Callable[[], Any]]]:
    c = BUILD_VS_PLAIN_CONCURRENCY
    drains = {"build": functools.partial(workloads.drain, dsn, s.drain_jobs, c)} | {
        kind: functools.partial(job_costs.plain_drain, dsn, s.drain_jobs, c, "p0", kind)
        for kind in BUILD_VS_PLAIN_KINDS[1:]}
    steps: list[tuple[str, Callable[[], Any]]] = []
    for r in range(1, BUILD_VS_PLAIN_ROUNDS + 1):
        shift = (r - 1) % len(BUILD_VS_PLAIN_KINDS)
        order = BUILD_VS_PLAIN_KINDS[shift:] + BUILD_VS_PLAIN_KINDS[:shift]
        steps += [(_beside(kind, c, r), drains[kind]) for kind in order]
    return steps


def build_vs_plain_result(raw: dict[str, Any], s: Sizes) -> dict[str, Any]:
    c = BUILD_VS_PLAIN_CONCURRENCY
    rounds = range(1, BUILD_VS_PLAIN_ROUNDS + 1)
    runs = {kind: [raw[_beside(kind, c, r)] for r in rounds] for kind in BUILD_VS_PLAIN_KINDS}
    ratios = {kind: [b["jobs_per_s"] / p["jobs_per_s"]
                     for b, p in zip(runs["build"], runs[kind], strict=True)]
              for kind in BUILD_VS_PLAIN_KINDS[1:]}
    return {"concurrency": c, "jobs": s.drain_jobs,
            "build_jobs_per_s": [b["jobs_per_s"] for b in runs["build"]],
            "plain_jobs_per_s": [p["jobs_per_s"] for p in runs["plain"]],
            "plain_padded_jobs_per_s": [p["jobs_per_s"] for p in runs["plain_padded"]],
            "ratios": ratios["plain"], "ratio": statistics.median(ratios["plain"]),
            "padded_ratios": ratios["plain_padded"],
            "padded_ratio": statistics.median(ratios["plain_padded"]),
            "cpu_us_per_job": {kind: statistics.median(x["cpu_us_per_job"] for x in runs[kind])
                               for kind in BUILD_VS_PLAIN_KINDS}}


def build_vs_plain_rows(t: Table, result: dict[str, Any]) -> None:
    b = result.get("build_vs_plain")
    if not b:
        return

    def line(values: list[float]) -> str:
        return " · ".join(f"{v:,.0f}" for v in values)

    def ratio(name: str, median: float, ratios: list[float]) -> str:
        return (f"build {median:.2f}x {name} (rounds: "
                + ", ".join(f"{r:.2f}" for r in ratios) + ")")

    cpu = b["cpu_us_per_job"]
    t.add_row("build drain | plain | plain, padded",
              f"c={b['concurrency']}, no-op, prefetch 0, turn about",
              f"{line(b['build_jobs_per_s'])} | {line(b['plain_jobs_per_s'])} | "
              f"{line(b['plain_padded_jobs_per_s'])} jobs/s",
              f"{ratio('plain', b['ratio'], b['ratios'])}; "
              f"{ratio('padded', b['padded_ratio'], b['padded_ratios'])}; worker CPU/job "
              f"{cpu['build']:.0f} | {cpu['plain']:.0f} | {cpu['plain_padded']:.0f} µs")


# -- ceiling L (issue #25) ---------------------------------------------------------
#
# Wake latency as a ratio to a bare asyncpg LISTEN/NOTIFY ping-pong between two
# connections (`ceilings.listen_ping_pong`), measured right before the latency
# workload at its pace: issue #25 sets no millisecond target, only this ratio
# (wake p50 and p99 ≤ 1.5x L) and one to the peer (benchmarks/peer_graphile.py).

#: The wake figures given as ratios to L: the runs from another process, where only
#: LISTEN/NOTIFY can wake the worker.
L_RUNS = ("other_process", "plain_other_process")


def latency_steps(s: Sizes, dsn: str) -> list[tuple[str, Callable[[], Any]]]:
    return [("ceiling L", functools.partial(ceilings.listen_ping_pong, dsn, s.latency_jobs,
                                            s.latency_rate)),
            ("latency", functools.partial(workloads.latency, dsn, s.latency_jobs,
                                          s.latency_rate))]


def vs_ceiling_l(wake: dict[str, Any], ceiling_l: dict[str, Any]) -> dict[str, float]:
    """p50 and p99 of a wake (from before the enqueue call, and after its commit) over L's."""
    out = {"p50": wake["p50_ms"] / ceiling_l["p50_ms"],
           "p99": wake["p99_ms"] / ceiling_l["p99_ms"]}
    if "after_commit" in wake:
        a = wake["after_commit"]
        out["after_commit_p50"] = a["p50_ms"] / ceiling_l["p50_ms"]
        out["after_commit_p99"] = a["p99_ms"] / ceiling_l["p99_ms"]
    return out


def latency_result(raw: dict[str, Any]) -> dict[str, Any]:
    """The latency workload's figures, ceiling L beside them and each wake's ratio to it."""
    lat = dict(raw["latency"])
    ceiling_l = raw.get("ceiling L")
    if ceiling_l is not None:
        lat["ceiling_L"] = ceiling_l
        for where in L_RUNS:
            if isinstance(lat.get(where), dict):
                lat[where] = {**lat[where], "vs_L": vs_ceiling_l(lat[where], ceiling_l)}
    return lat


def ceiling_l_rows(t: Table, result: dict[str, Any]) -> None:
    lat = result.get("latency") or {}
    ceiling_l = lat.get("ceiling_L")
    if ceiling_l is None:
        return
    t.add_row("ceiling L", f"bare LISTEN/NOTIFY ping-pong, 2 conns ({ceiling_l['n']} round trips)",
              f"p50 {ceiling_l['p50_ms']:.2f} · p95 {ceiling_l['p95_ms']:.2f} · "
              f"p99 {ceiling_l['p99_ms']:.2f} · max {ceiling_l['max_ms']:.2f} ms", "")
    for where in L_RUNS:
        v = lat.get(where)
        if not isinstance(v, dict) or "vs_L" not in v:
            continue
        r = v["vs_L"]
        after = (f"; after its commit p50 {r['after_commit_p50']:.2f}x, "
                 f"p99 {r['after_commit_p99']:.2f}x" if "after_commit_p50" in r else "")
        t.add_row("latency ÷ ceiling L", where.replace("_", " ") + " (from before the call)",
                  f"p50 {r['p50']:.2f}x · p99 {r['p99']:.2f}x L",
                  "target: p50 and p99 ≤ 1.5x L" + after)
