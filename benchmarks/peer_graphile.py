"""
The engine beside its peer, graphile-worker (Node), in one run (issue #25).

    python -m benchmarks.peer_graphile [--dsn URL] [--jobs 5000] [--rounds 2] [--out f.json]

Issue #25 sets the engine's targets as ratios to graphile-worker measured in the
same run, not in milliseconds: on a shared 2-core machine absolute figures move
by ±25% between runs, and a ratio of two figures taken a few seconds apart moves
much less. Each row is measured for both, back to back (which goes first
alternates by round), each on a fresh database of its own; the ratio
nasiko-queue / graphile-worker is taken within a round, the row's figure is the
median of the rounds'.

graphile-worker is installed by npm, pinned (`GRAPHILE_WORKER_VERSION`), into a
cache outside the repository (`cache_dir()`); its side runs as
`node benchmarks/peer/graphile_bench.mjs`. When node or npm is missing or the
install fails, its side is skipped with the reason, and no ratio is given.

Without `--dsn` it starts a private PostgreSQL with fsync on (as `nasiko-queue
bench` does), and the WAL and server-CPU figures are the run's alone; on a
shared server other sessions' writes count into the WAL figure.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import trio

from nasiko_queue import Executors, PlainJobContext, Queue, open_database
from nasiko_queue.db.embedded import EmbeddedPostgres, with_database
from nasiko_queue.db.migrate import migrate
from nasiko_queue.engine.worker import Worker

from . import ceilings, job_costs, workloads
from .connect import connect
from .plain import BenchPing
from .workloads import ROOT, _bench_config, _child_env, _enqueue_times, plain_asyncio

#: The peer's version: the one issue #25 measured. Its package.json asks for
#: node >= 22.18; it runs on node 20 here (the bench's modes load and pass).
GRAPHILE_WORKER_VERSION = "0.18.0"
SCRIPT = Path(__file__).resolve().parent / "peer" / "graphile_bench.mjs"
#: The engine's best setting as issue #25 names it: concurrency 10, prefetch 100;
#: graphile-worker's: a local queue of 100 and batched completion (in the script).
TUNED_CONCURRENCY, TUNED_PREFETCH = 10, 100
#: The wake workload's pace (as `nasiko-queue bench`'s latency workload).
WAKE_RATE = 100.0
#: The job-cost rows: concurrency, and jobs per batch enqueue while the worker runs.
COST_CONCURRENCY, COST_CHUNK = 10, job_costs.CHUNK

#: Issue #25's targets: (row, "≥" or "≤", ratio nasiko-queue / graphile-worker).
TARGETS: dict[str, tuple[str, float]] = {
    "drain c=1, defaults": ("≥", 1.2),
    "drain c=10, defaults": ("≥", 1.5),
    "drain, best settings": ("≥", 1.3),
    "enqueue, 1 per call": ("≥", 1.5),
    "enqueue, 1 batch": ("≥", 1.2),
    "wake p50": ("≤", 0.8),
    "wake p99": ("≤", 0.8),
    "WAL bytes/job, c=10": ("≤", 1.0),
    "server CPU/job, c=10": ("≤", 1.0),
}
#: Wake p50 and p99 over ceiling L's.
L_TARGET = 1.5
NODE_TIMEOUT = 600


# -- the peer's installation ----------------------------------------------------------


def cache_dir() -> Path:
    """Where graphile-worker is installed: $NASIKO_QUEUE_BENCH_CACHE, else
    ~/.cache/nasiko-queue-bench, one folder per version."""
    base = os.environ.get("NASIKO_QUEUE_BENCH_CACHE") or Path.home() / ".cache" / \
        "nasiko-queue-bench"
    return Path(base) / f"graphile-worker-{GRAPHILE_WORKER_VERSION}"


def install() -> tuple[Path | None, str]:
    """(the install folder, "") or (None, why not): node and npm found, the pinned
    version installed (once; later runs find it in the cache)."""
    for tool in ("node", "npm"):
        if shutil.which(tool) is None:
            return None, f"{tool} is not installed"
    where = cache_dir()
    package = where / "node_modules" / "graphile-worker" / "package.json"
    if package.exists() and json.loads(package.read_text()).get(
            "version") == GRAPHILE_WORKER_VERSION:
        return where, ""
    where.mkdir(parents=True, exist_ok=True)
    try:
        done = subprocess.run(
            ["npm", "install", "--prefix", str(where), "--no-audit", "--no-fund",
             "--loglevel=error", f"graphile-worker@{GRAPHILE_WORKER_VERSION}"],
            capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, f"npm install failed: {exc}"
    if done.returncode != 0 or not package.exists():
        last = (done.stderr.strip().splitlines() or ["no message"])[-1]
        return None, f"npm install graphile-worker@{GRAPHILE_WORKER_VERSION} failed: {last}"
    return where, ""


def _node_env(where: Path) -> dict[str, str]:
    return {**os.environ, "GRAPHILE_WORKER_DIR": str(where)}


def _node(where: Path, **args: Any) -> dict[str, Any]:
    """One mode of the script, to its end; its last line of output."""
    done = subprocess.run(["node", str(SCRIPT), json.dumps(args)], capture_output=True,
                          text=True, env=_node_env(where), timeout=NODE_TIMEOUT)
    if done.returncode != 0:
        raise RuntimeError(f"graphile_bench.mjs {args['mode']} failed: {done.stderr[-2000:]}")
    out: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return out


# -- fresh databases --------------------------------------------------------------------


class Databases:
    """A migrated template per side; each measurement gets a fresh copy of one."""

    def __init__(self, admin_dsn: str, peer: Path | None) -> None:
        self.admin = admin_dsn
        self.prefix = f"nasiko_peer_{os.getpid()}"
        self.made: list[str] = []
        self.templates: dict[str, str] = {}
        self._counter = 0
        engine = self._create(f"{self.prefix}_tpl_nq")

        async def do_migrate() -> None:
            async with open_database(engine) as db:
                await migrate(db)

        trio.run(do_migrate)
        self.templates["nq"] = engine
        if peer is not None:
            gw = self._create(f"{self.prefix}_tpl_gw")
            _node(peer, mode="migrate", dsn=gw)
            self.templates["gw"] = gw

    def _admin(self, *statements: str) -> None:
        workloads._sql(self.admin, *statements)

    def _create(self, name: str, template: str | None = None) -> str:
        self._admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)',
                    f'CREATE DATABASE "{name}"'
                    + (f' TEMPLATE "{_name(template)}"' if template else ""))
        self.made.append(name)
        return with_database(self.admin, name)

    def fresh(self, side: str) -> str:
        """A new database copied from `side`'s template ("nq" or "gw"); all are
        dropped at the end of the run (`drop_all`)."""
        self._counter += 1
        return self._create(f"{self.prefix}_{side}_{self._counter}", self.templates[side])

    def drop_all(self) -> None:
        for name in reversed(self.made):
            self._admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        self.made.clear()


def _name(dsn: str) -> str:
    return dsn.rsplit("/", 1)[1].split("?", 1)[0]


# -- the engine's side ---------------------------------------------------------------------


def _ping_executors(started: dict[uuid.UUID, float] | None = None) -> Executors:
    ex = Executors()

    @ex.register(BenchPing)
    async def ping(ctx: PlainJobContext[BenchPing]) -> None:
        if started is not None:
            started[ctx.job_id] = time.perf_counter()

    return ex


def nq_drain(dsn: str, n: int, concurrency: int, prefetch: int | None) -> dict[str, Any]:
    """N plain jobs queued up front (not timed), one worker drains them; jobs/s."""

    async def main() -> dict[str, Any]:
        async with open_database(dsn) as db:
            await Queue(db, config=_bench_config()).enqueue_many(
                [BenchPing(n=i) for i in range(n)])
            await db.execute("VACUUM ANALYZE nasiko_queue_jobs")
            config = _bench_config(queues={"bench": concurrency}, builds=False,
                                   prefetch=prefetch)
            worker = Worker(Queue(db, config=config), _ping_executors())
            async with trio.open_nursery() as nursery:
                t0 = time.perf_counter()
                await nursery.start(worker.run)
                await worker.wait_for(lambda s: s.done + s.failed >= n)
                elapsed = time.perf_counter() - t0
                worker.stop()
        if worker.stats.failed:
            raise RuntimeError(f"drain: {worker.stats.failed} jobs failed")
        return {"jobs": n, "jobs_per_s": n / elapsed}

    return trio.run(main)


def nq_enqueue(dsn: str, n: int, batch: bool) -> dict[str, Any]:
    """`Queue.enqueue` once per job (each its own transaction), or one `enqueue_many`."""
    payloads = [BenchPing(n=i) for i in range(n)]

    async def main() -> dict[str, Any]:
        async with open_database(dsn) as db:
            queue = Queue(db, config=_bench_config())
            await db.run_kept(lambda conn: conn.fetchval("SELECT 1"))
            await db.fetchval("SELECT 1")  # connect before the clock starts
            t0 = time.perf_counter()
            if batch:
                await queue.enqueue_many(payloads)
            else:
                for p in payloads:
                    await queue.enqueue(p)
            return {"jobs": n, "jobs_per_s": n / (time.perf_counter() - t0)}

    return trio.run(main)


def nq_wake(dsn: str, n: int, rate: float) -> dict[str, Any]:
    """An idle worker at the defaults but its one plain queue (concurrency 1); another
    process (`benchmarks.enqueuer`) enqueues `n` plain jobs at `rate`/s. Executor start
    minus just before the enqueue call, and minus its return (after its commit)."""
    started: dict[uuid.UUID, float] = {}

    async def main() -> dict[str, Any]:
        async with open_database(dsn) as db:
            worker = Worker(Queue(db, config=_bench_config(queues={"bench": 1}, builds=False)),
                            _ping_executors(started))
            async with trio.open_nursery() as nursery:
                await nursery.start(worker.run)
                await trio.sleep(0.2)
                proc = await trio.run_process(
                    [sys.executable, "-m", "benchmarks.enqueuer", dsn, str(rate), "plain"],
                    stdin=json.dumps([[]] * n).encode(), capture_stdout=True, cwd=ROOT,
                    env=_child_env())
                await worker.wait_for(lambda s: s.done + s.failed >= n)
                worker.stop()
        before, returned = _enqueue_times(proc.stdout)
        return _wake_figures([started[j] - t for j, t in before.items()],
                             [started[j] - t for j, t in returned.items()])

    return trio.run(main)


def nq_cost(dsn: str, n: int) -> dict[str, Any]:
    """`job_costs.job_cost` for plain jobs: WAL and server CPU per job."""
    c = job_costs.job_cost(dsn, "plain", n, COST_CONCURRENCY)
    return {"jobs": n, "jobs_per_s": c["jobs_per_s"], "wal_bytes_per_job": c["wal_bytes_per_job"],
            "server_cpu_us_per_job": c["server_cpu_us_per_job"]}


# -- the peer's side -----------------------------------------------------------------------


def gw_drain(where: Path, dsn: str, n: int, concurrency: int, tuned: bool) -> dict[str, Any]:
    return _node(where, mode="drain", dsn=dsn, jobs=n, concurrency=concurrency, tuned=tuned)


def gw_enqueue(where: Path, dsn: str, n: int, batch: bool) -> dict[str, Any]:
    return _node(where, mode="enqueue", dsn=dsn, jobs=n, batch=batch)


def gw_wake(where: Path, dsn: str, n: int, rate: float) -> dict[str, Any]:
    """An idle graphile-worker runner (concurrency 1, defaults) in one node process,
    `addJob` at `rate`/s in another; the same figures as `nq_wake`."""
    worker = subprocess.Popen(
        ["node", str(SCRIPT), json.dumps({"mode": "wake_worker", "dsn": dsn, "jobs": n})],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_node_env(where))
    try:
        assert worker.stdout is not None
        ready = worker.stdout.readline()
        if not ready.strip():
            raise RuntimeError(f"graphile wake worker did not start: {worker.stderr}")
        times = _node(where, mode="wake_enqueue", dsn=dsn, jobs=n, rate=rate)["times"]
        out, err = worker.communicate(timeout=NODE_TIMEOUT)
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()
    if worker.returncode != 0:
        raise RuntimeError(f"graphile wake worker failed: {err[-2000:]}")
    starts = json.loads(out.strip().splitlines()[-1])["starts"]
    return _wake_figures([starts[str(i)] - t[0] for i, t in enumerate(times)],
                         [starts[str(i)] - t[1] for i, t in enumerate(times)])


async def _server_mark(dsn: str) -> tuple[float, dict[int, float] | None]:
    """The WAL position, and the CPU of every client backend of `dsn`'s database."""
    conn = await connect(dsn)
    try:
        pids = [r["pid"] for r in await conn.fetch(job_costs.BACKENDS)
                if r["pid"] != conn.get_server_pid()]
        lsn = await conn.fetchval("SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0')")
        return float(lsn), job_costs._backend_cpu(pids)
    finally:
        await conn.close()


def gw_cost(where: Path, dsn: str, n: int) -> dict[str, Any]:
    """A graphile-worker runner at the defaults (but concurrency) runs `n` jobs while
    they are enqueued `COST_CHUNK` at a time (`addJobs`), as `job_costs.job_cost` does
    for the engine: WAL and the backends' CPU per job, read around the run through the
    script's stdin/stdout handshake."""
    proc = subprocess.Popen(
        ["node", str(SCRIPT), json.dumps({"mode": "cost", "dsn": dsn, "jobs": n,
                                          "concurrency": COST_CONCURRENCY,
                                          "chunk": COST_CHUNK})],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=_node_env(where))
    assert proc.stdin is not None
    assert proc.stdout is not None
    try:
        if not proc.stdout.readline().strip():
            raise RuntimeError("graphile cost runner did not start")
        lsn0, cpu0 = plain_asyncio(_server_mark(dsn))
        proc.stdin.write("go\n")
        proc.stdin.flush()
        done = json.loads(proc.stdout.readline())
        lsn1, cpu1 = plain_asyncio(_server_mark(dsn))
        proc.stdin.write("stop\n")
        proc.stdin.flush()
        _, err = proc.communicate(timeout=NODE_TIMEOUT)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if proc.returncode != 0:
        raise RuntimeError(f"graphile cost runner failed: {err[-2000:]}")
    cpu = None
    if cpu0 is not None and cpu1 is not None:
        cpu = sum(c - cpu0.get(pid, 0.0) for pid, c in cpu1.items()) / n * 1e6
    return {"jobs": n, "jobs_per_s": done["jobs_per_s"], "wal_bytes_per_job": (lsn1 - lsn0) / n,
            "server_cpu_us_per_job": cpu}


def _wake_figures(before: list[float], after: list[float]) -> dict[str, Any]:
    out = ceilings._ms_percentiles(before)
    out["after_commit"] = ceilings._ms_percentiles(after)
    return out


# -- the run ------------------------------------------------------------------------------


def _pairs(jobs: int) -> dict[str, tuple[Callable[[str], dict[str, Any]],
                                         Callable[[Path, str], dict[str, Any]]]]:
    """Each row's two measurements: the engine's (on a fresh database) and the peer's."""
    one = max(1, jobs // 5)  # one per call is slow on both sides: a fifth of the jobs
    return {
        "drain c=1, defaults": (lambda d: nq_drain(d, jobs, 1, None),
                                lambda w, d: gw_drain(w, d, jobs, 1, False)),
        "drain c=10, defaults": (lambda d: nq_drain(d, jobs, 10, None),
                                 lambda w, d: gw_drain(w, d, jobs, 10, False)),
        "drain, best settings": (
            lambda d: nq_drain(d, jobs, TUNED_CONCURRENCY, TUNED_PREFETCH),
            lambda w, d: gw_drain(w, d, jobs, TUNED_CONCURRENCY, True)),
        "enqueue, 1 per call": (lambda d: nq_enqueue(d, one, False),
                                lambda w, d: gw_enqueue(w, d, one, False)),
        "enqueue, 1 batch": (lambda d: nq_enqueue(d, jobs, True),
                             lambda w, d: gw_enqueue(w, d, jobs, True)),
        "wake": (lambda d: nq_wake(d, min(jobs, 200), WAKE_RATE),
                 lambda w, d: gw_wake(w, d, min(jobs, 200), WAKE_RATE)),
        "cost, c=10": (lambda d: nq_cost(d, jobs), lambda w, d: gw_cost(w, d, jobs)),
    }


#: Each row's figures (key in the measurement, how it is named, higher is better?).
FIGURES: dict[str, list[tuple[str, str, bool]]] = {
    "wake": [("p50_ms", "wake p50", False), ("p99_ms", "wake p99", False)],
    "cost, c=10": [("wal_bytes_per_job", "WAL bytes/job, c=10", False),
                   ("server_cpu_us_per_job", "server CPU/job, c=10", False)],
}


def run(admin_dsn: str, jobs: int = 5000, rounds: int = 2, *,
        progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Every row for both sides, `rounds` times (which side goes first alternates), and
    ceiling L; the figures, their ratios per round and the medians, against the targets."""
    peer, skipped = install()
    dbs = Databases(admin_dsn, peer)
    raw: dict[str, dict[str, list[dict[str, Any]]]] = {}
    ceiling_l: list[dict[str, Any]] = []
    try:
        for r in range(rounds):
            for row, (nq, gw) in _pairs(jobs).items():
                sides = ("nq", "gw") if r % 2 == 0 else ("gw", "nq")
                for side in sides:
                    if side == "gw" and peer is None:
                        continue
                    if progress:
                        progress(f"round {r + 1}: {row}: {side}")
                    dsn = dbs.fresh(side)
                    raw.setdefault(row, {"nq": [], "gw": []})[side].append(
                        nq(dsn) if side == "nq" else gw(peer, dsn))  # type: ignore[arg-type]
                if row == "wake":  # ceiling L right after the two wakes, on a fresh database
                    ceiling_l.append(ceilings.listen_ping_pong(dbs.fresh("nq"),
                                                               min(jobs, 200), WAKE_RATE))
    finally:
        dbs.drop_all()
    return assemble(raw, ceiling_l, jobs=jobs, rounds=rounds, skipped=skipped)


def assemble(raw: dict[str, dict[str, list[dict[str, Any]]]], ceiling_l: list[dict[str, Any]],
             *, jobs: int, rounds: int, skipped: str) -> dict[str, Any]:
    rows: dict[str, dict[str, Any]] = {}
    for row, sides in raw.items():
        for key, name, _higher in FIGURES.get(row, [("jobs_per_s", row, True)]):
            nq = [x[key] for x in sides["nq"]]
            gw = [x[key] for x in sides["gw"]]
            out: dict[str, Any] = {"nq": nq, "gw": gw, "unit": _unit(key)}
            measured = bool(gw) and all(v is not None for v in nq + gw)
            if measured and 0 in gw:
                # Server CPU is read in clock ticks (10 ms): a small run can count none
                # on the peer's side, and a ratio over zero means nothing.
                out["ratio"] = None
                out["skipped"] = ("the peer's figure is 0 (below the clock's resolution "
                                  "at this size)")
            elif measured:
                ratios = [a / b for a, b in zip(nq, gw, strict=True)]
                out["ratios"] = ratios
                out["ratio"] = statistics.median(ratios)
                how, target = TARGETS[name]
                out["target"] = f"{how} {target}"
                out["met"] = out["ratio"] >= target if how == "≥" else out["ratio"] <= target
            else:
                out["ratio"] = None
                out["skipped"] = skipped or "a figure is missing (server CPU: not on this machine)"
            rows[name] = out
    vs_l: dict[str, Any] = {}
    if ceiling_l and "wake" in raw:
        for side in ("nq", "gw"):
            runs = raw["wake"][side]
            if not runs:
                continue
            for pct in ("p50", "p99"):
                ratios = [w[f"{pct}_ms"] / c[f"{pct}_ms"]
                          for w, c in zip(runs, ceiling_l, strict=True)]
                after = [w["after_commit"][f"{pct}_ms"] / c[f"{pct}_ms"]
                         for w, c in zip(runs, ceiling_l, strict=True)]
                ratio = statistics.median(ratios)
                vs_l[f"{side} {pct}"] = {"ratios": ratios, "ratio": ratio,
                                         "after_commit_ratio": statistics.median(after),
                                         "target": f"≤ {L_TARGET}", "met": ratio <= L_TARGET}
    return {"meta": {"when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                     "graphile_worker": GRAPHILE_WORKER_VERSION, "jobs": jobs, "rounds": rounds,
                     "skipped": skipped or None, "cpus": os.cpu_count()},
            "rows": rows, "ceiling_L": ceiling_l, "wake_vs_L": vs_l}


def _unit(key: str) -> str:
    return {"jobs_per_s": "jobs/s", "p50_ms": "ms", "p99_ms": "ms",
            "wal_bytes_per_job": "B", "server_cpu_us_per_job": "µs"}[key]


def verdict(ratio: float, how: str, target: float) -> str:
    """Met or missed, and by how much: the ratio over the target (a floor: ≥ 1 meets
    it; a bound: ≤ 1 meets it)."""
    share = ratio / target
    if how == "≥":
        return f"met ({share:.2f}× the target)" if share >= 1 else \
            f"missed by {1 - share:.0%} ({share:.2f}× the target)"
    return f"met ({share:.2f}× the bound)" if share <= 1 else \
        f"missed: {share:.2f}× the bound"


def markdown(result: dict[str, Any]) -> str:
    """The result as the table of benchmarks/README.md."""

    def figs(values: list[float]) -> str:
        return " · ".join(f"{v:,.0f}" if v >= 100 else f"{v:.2f}" for v in values)

    lines = ["| row | nasiko-queue | graphile-worker | ratio nq/gw (rounds) | target | |",
             "|---|---|---|---|---|---|"]
    for name, r in result["rows"].items():
        if r["ratio"] is None and not r["gw"]:
            lines.append(f"| {name} | {figs(r['nq'])} {r['unit']} | skipped: {r['skipped']} "
                         "| – | – | – |")
            continue
        if r["ratio"] is None:  # both measured, but no ratio means anything
            lines.append(f"| {name} | {figs(r['nq'])} {r['unit']} | {figs(r['gw'])} {r['unit']}"
                         f" | no ratio: {r['skipped']} | – | – |")
            continue
        rounds = ", ".join(f"{x:.2f}" for x in r["ratios"])
        lines.append(f"| {name} | {figs(r['nq'])} {r['unit']} | {figs(r['gw'])} {r['unit']} | "
                     f"**{r['ratio']:.2f}×** ({rounds}) | {r['target']} | "
                     f"{verdict(r['ratio'], *TARGETS[name])} |")
    for c in result["ceiling_L"]:
        lines.append(f"| ceiling L (ping-pong) | p50 {c['p50_ms']:.2f} · p99 "
                     f"{c['p99_ms']:.2f} ms | | | | |")
    for name, v in result["wake_vs_L"].items():
        side, pct = name.split()
        who = "nasiko-queue" if side == "nq" else "graphile-worker"
        lines.append(f"| wake {pct} ÷ L, {who} | | | **{v['ratio']:.2f}×** ("
                     + ", ".join(f"{x:.2f}" for x in v["ratios"])
                     + f"; after commit {v['after_commit_ratio']:.2f}×) | {v['target']} | "
                     + verdict(v["ratio"], "≤", L_TARGET) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dsn", default=None, help="a server where scratch databases may be "
                        "created (needs CREATEDB); default: a private PostgreSQL, fsync on")
    parser.add_argument("--jobs", type=int, default=5000)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", default=None, help="write the figures as JSON here")
    args = parser.parse_args()
    server = None
    if args.dsn is None:
        server = EmbeddedPostgres(fsync=True)
        server.start()
    try:
        t0 = time.perf_counter()
        result = run(args.dsn or server.dsn, args.jobs,  # type: ignore[union-attr]
                     args.rounds, progress=lambda s: print(s, file=sys.stderr, flush=True))
        result["meta"]["seconds"] = round(time.perf_counter() - t0, 1)
        result["meta"]["database"] = "given DSN" if args.dsn else "private PostgreSQL, fsync on"
    finally:
        if server is not None:
            server.cleanup()
    if result["meta"]["skipped"]:
        print(f"graphile-worker skipped: {result['meta']['skipped']}")
    print(markdown(result))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
