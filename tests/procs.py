"""
Helpers for the tests that run real `nasiko-queue worker` processes.

The workers are separate processes, so a test cannot wait on their events; it
waits on what they write to the database (or to their log file), polling with a
short pause and a bounded deadline that fails the test with a message saying
what never happened.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid
from collections import Counter, defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any
from uuid import UUID

import asyncpg
import attrs
import pytest
import trio

from nasiko_queue import Database, Queue
from nasiko_queue.testing import Sql, make_payload

from .proc_executors import EXECUTIONS_DDL, GATE

REPO = Path(__file__).resolve().parent.parent
#: The longest a test waits for another process to do something. Generous: a test
#: only waits it out when something is broken.
DEADLINE = 60.0
#: Errors of a database that is restarting or has just dropped our connection.
OUTAGE_ERRORS = (OSError, asyncpg.PostgresError, asyncpg.InterfaceError)


# -- worker processes --------------------------------------------------------------


@attrs.define
class WorkerProcess:
    """A `nasiko-queue worker` subprocess with its log (stdout and stderr) in a file."""

    name: str
    proc: trio.Process
    log: Path

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def replica(self) -> str:
        """How `executions.replica` names this process."""
        return f"pid{self.proc.pid}"

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def signal(self, signum: int) -> None:
        self.proc.send_signal(signum)

    async def wait_exit(self) -> int:
        with trio.move_on_after(DEADLINE):
            return await self.proc.wait()
        self.proc.kill()
        pytest.fail(f"worker {self.name} did not exit within {DEADLINE}s")

    async def kill(self) -> int:
        """SIGKILL: the process dies wherever it is, without any cleanup."""
        self.proc.send_signal(signal.SIGKILL)
        return await self.wait_exit()


class Workers:
    """Starts worker processes; kills whatever still runs when the test ends."""

    def __init__(self, dsn: str, log_dir: Path) -> None:
        self.dsn = dsn
        self.log_dir = log_dir
        self.started: list[WorkerProcess] = []

    async def start(
        self,
        name: str,
        *options: str,
        executors: str = "tests.proc_executors:executors",
        dsn: str | None = None,
    ) -> WorkerProcess:
        log = self.log_dir / f"worker-{name}.log"
        env = {k: v for k, v in os.environ.items()
               if k not in ("DATABASE_URL", "NASIKO_QUEUE_MASTER_KEY")}
        args = [sys.executable, "-m", "nasiko_queue", "worker", "--dsn", dsn or self.dsn,
                "--executors", executors, "--poll-interval", "0.1", *options]
        with log.open("wb") as out:
            proc = await trio.lowlevel.open_process(
                args, cwd=REPO, stdin=subprocess.DEVNULL, stdout=out, stderr=out, env=env)
        worker = WorkerProcess(name=name, proc=proc, log=log)
        self.started.append(worker)
        return worker

    async def start_all(self, n: int, *options: str, prefix: str = "w") -> list[WorkerProcess]:
        workers = [await self.start(f"{prefix}{i}", *options) for i in range(n)]
        for w in workers:
            await wait_for_log(w, "worker started")
        return workers

    def kill_all(self) -> None:
        for w in self.started:
            if w.proc.returncode is None:
                w.proc.kill()

    def dump_logs(self, lines: int = 40) -> None:
        for w in self.started:
            if w.log.exists():
                tail = w.log_text().splitlines()[-lines:]
                sys.stderr.write(f"---- worker {w.name} (pid {w.pid}), last lines:\n")
                sys.stderr.write("\n".join(tail) + "\n")


@asynccontextmanager
async def worker_processes(dsn: str, log_dir: Path) -> AsyncIterator[Workers]:
    workers = Workers(dsn, log_dir)
    try:
        yield workers
    except BaseException:
        workers.dump_logs()
        raise
    finally:
        workers.kill_all()
        with trio.CancelScope(shield=True), trio.move_on_after(10):
            for w in workers.started:
                await w.proc.wait()


# -- waiting on another process ----------------------------------------------------------


async def wait_until(
    what: str,
    check: Callable[[], Awaitable[bool]],
    *,
    alive: Sequence[WorkerProcess] = (),
    deadline: float = DEADLINE,
    during_outage: bool = False,
    explain: Callable[[], Awaitable[str]] | None = None,
) -> None:
    """
    Poll `check` (a cheap read) until it holds; fail after `deadline` seconds.

    Fails at once if a process in `alive` exits meanwhile. With `during_outage`,
    database errors count as "not yet" (the server may be restarting). `explain`
    says what the state was when the deadline passed.
    """
    with trio.move_on_after(deadline):
        while True:
            try:
                if await check():
                    return
            except OUTAGE_ERRORS:
                if not during_outage:
                    raise
            for w in alive:
                if w.proc.returncode is not None:
                    pytest.fail(f"worker {w.name} exited with {w.proc.returncode} "
                                f"while waiting for {what}")
            await trio.sleep(0.05)
    state = f"; {await explain()}" if explain is not None else ""
    pytest.fail(f"timed out after {deadline}s waiting for {what}{state}")


async def wait_for_log(worker: WorkerProcess, text: str, *, count: int = 1) -> None:
    async def logged() -> bool:
        return worker.log_text().count(text) >= count

    await wait_until(f"{worker.name} to log {text!r}", logged, alive=[worker])


# -- jobs and their runs ---------------------------------------------------------------------


KINDS = ("Upload", "Update", "Rollback", "StandaloneBuild", "Clone", "GithubClone",
         "McpServerUpload")


@attrs.frozen
class Target:
    """A target row, its build row and the owner, made ready for one job."""

    kind: str
    label: str
    owner_id: UUID
    target_id: UUID
    build_id: UUID

    @property
    def connector(self) -> bool:
        return self.kind == "McpServerUpload"


async def create_executions_table(db: Database) -> None:
    await db.execute(EXECUTIONS_DDL)


async def create_targets(
    db: Sql, labels: Sequence[str], kinds: Sequence[str] = ("Upload",),
    *, prior_success: bool = False,
) -> list[Target]:
    """
    One target per label (an agent, or a connector for McpServerUpload) with its queued
    build row, in bulk; kinds are used in turn. With `prior_success`, each target also
    has an earlier successful build (so terminalizing it marks it failed, not deleted).
    """
    targets = [
        Target(kind=kinds[i % len(kinds)], label=label, owner_id=uuid.uuid4(),
               target_id=uuid.uuid4(), build_id=uuid.uuid4())
        for i, label in enumerate(labels)
    ]
    agents = [t for t in targets if not t.connector]
    conns = [t for t in targets if t.connector]
    await db.execute(
        "INSERT INTO agents (id, owner_id, name, status) "
        "SELECT * , 'deploying' FROM unnest($1::uuid[], $2::uuid[], $3::text[])",
        [t.target_id for t in agents], [t.owner_id for t in agents], [t.label for t in agents])
    await db.execute(
        "INSERT INTO agent_builds (id, agent_id, version_tag, image_reference, status) "
        "SELECT b, a, 'v1', 'v1-image', 'queued' FROM unnest($1::uuid[], $2::uuid[]) AS t(b, a)",
        [t.build_id for t in agents], [t.target_id for t in agents])
    if prior_success:
        await db.execute(
            "INSERT INTO agent_builds (agent_id, version_tag, image_reference, status) "
            "SELECT a, 'v0', 'v0-image', 'success' FROM unnest($1::uuid[]) AS t(a)",
            [t.target_id for t in agents])
    await db.execute(
        "INSERT INTO mcp_connectors (id, owner_id, name, build_status, is_active) "
        "SELECT *, 'pending', false FROM unnest($1::uuid[], $2::uuid[], $3::text[])",
        [t.target_id for t in conns], [t.owner_id for t in conns], [t.label for t in conns])
    await db.execute(
        "INSERT INTO mcp_connector_builds (id, connector_id, owner_id, version_tag, status) "
        "SELECT b, c, o, 'v1', 'pending' "
        "FROM unnest($1::uuid[], $2::uuid[], $3::uuid[]) AS t(b, c, o)",
        [t.build_id for t in conns], [t.target_id for t in conns], [t.owner_id for t in conns])
    if prior_success:
        await db.execute(
            "INSERT INTO mcp_connector_builds (connector_id, owner_id, version_tag, status) "
            "SELECT c, o, 'v0', 'success' FROM unnest($1::uuid[], $2::uuid[]) AS t(c, o)",
            [t.target_id for t in conns], [t.owner_id for t in conns])
    return targets


def serde_json(t: Target) -> str:
    """
    The payload as the original's serde_json writes it: compact, `kind` first, fields
    in declaration order, absent optionals as null. What a Rust replica inserts.
    """
    b, a, o, n = str(t.build_id), str(t.target_id), str(t.owner_id), t.label
    fields: dict[str, Any]
    if t.kind == "Upload":
        fields = {"build_id": b, "agent_id": a, "owner_id": o, "upload_id": f"up-{b[:8]}",
                  "name": n, "zip_path": f"/data/uploads/{b}.zip",
                  "image_tag": f"registry.local/{b[:8]}:v1", "ports": [8000],
                  "env": {"LOG_LEVEL": "info"}, "writable": False, "writable_path": None}
    elif t.kind == "Update":
        fields = {"build_id": b, "agent_id": a, "owner_id": o, "agent_owner_id": o,
                  "name": n, "zip_path": None, "image_tag": f"registry.local/{b[:8]}:v2",
                  "new_version": "v2", "prev_version": "v1", "prev_image": None,
                  "changelog": None, "writable": False, "writable_path": None}
    elif t.kind == "Rollback":
        fields = {"rollback_build_id": b, "agent_id": a, "caller_id": o, "agent_owner_id": o,
                  "agent_name": n, "target_version": "v1",
                  "target_image_tag": f"registry.local/{b[:8]}:v1", "reason": None,
                  "writable": True, "writable_path": "/data"}
    elif t.kind == "StandaloneBuild":
        fields = {"build_id": b, "agent_id": a, "agent_name": n, "github_url": None,
                  "source_key": f"sources/{a[:8]}/v1.zip", "version_tag": "v1"}
    elif t.kind == "Clone":
        fields = {"build_id": b, "agent_id": a, "owner_id": o, "upload_id": f"up-{b[:8]}",
                  "name": n, "tar_gz_path": f"/data/{b}.tar.gz",
                  "image_tag": f"registry.local/{b[:8]}:v1", "ports": [], "env": {}}
    elif t.kind == "GithubClone":
        fields = {"build_id": b, "agent_id": a, "owner_id": o, "upload_id": f"gh-{b[:8]}",
                  "name": n, "repo_full_name": "acme/crawler", "branch": "main",
                  "image_tag": f"registry.local/{b[:8]}:v1", "ports": [8080],
                  "env": {"A": "1"}, "version_override": None, "prior_version": None,
                  "prior_image": None, "prior_status": None}
    elif t.kind == "McpServerUpload":
        fields = {"build_id": b, "connector_id": a, "owner_id": o, "name": n,
                  "source": {"Github": {"url": "https://github.com/acme/mcp"}},
                  "image_tag": f"registry.local/mcp-{b[:8]}:v1", "env": {}}
    else:
        raise ValueError(t.kind)
    return json.dumps({"kind": t.kind, **fields}, separators=(",", ":"))


async def insert_serde_jobs(db: Sql, targets: Sequence[Target]) -> list[UUID]:
    """Insert the jobs by plain SQL, in the original's JSON, as a Rust replica would."""
    ids = [uuid.uuid4() for _ in targets]
    await db.execute(
        "INSERT INTO build_jobs (id, agent_id, connector_id, owner_id, payload) "
        "SELECT i, CASE WHEN c THEN NULL ELSE t END, CASE WHEN c THEN t END, o, p::jsonb "
        "FROM unnest($1::uuid[], $2::uuid[], $3::boolean[], $4::uuid[], $5::text[]) "
        "AS x(i, t, c, o, p)",
        ids, [t.target_id for t in targets], [t.connector for t in targets],
        [t.owner_id for t in targets], [serde_json(t) for t in targets])
    return ids


async def enqueue_jobs(queue: Queue, targets: Sequence[Target]) -> list[UUID]:
    """Enqueue the jobs through the Python API, one `Queue.enqueue` each."""
    ids = []
    for t in targets:
        payload = make_payload(t.kind, target_id=t.target_id, build_id=t.build_id,
                               owner_id=t.owner_id, name=t.label)
        ids.append(await queue.enqueue(payload, owner_id=t.owner_id))
    return ids


@attrs.frozen
class Run:
    seq: int
    attempt: int
    replica: str
    finished: bool


async def runs_by_job(db: Database) -> dict[UUID, list[Run]]:
    """Every recorded run, per job, in the order they started."""
    rows = await db.fetch(
        "SELECT seq, job_id, attempt, replica, finished_at IS NOT NULL AS finished "
        "FROM executions ORDER BY seq")
    runs: dict[UUID, list[Run]] = defaultdict(list)
    for r in rows:
        runs[r["job_id"]].append(Run(seq=r["seq"], attempt=r["attempt"], replica=r["replica"],
                                     finished=r["finished"]))
    return runs


def one_run_per_attempt(runs: dict[UUID, list[Run]]) -> bool:
    """No attempt number of a job ran twice: each claim (attempt + 1) is exclusive."""
    return all(len({r.attempt for r in rs}) == len(rs) for rs in runs.values())


async def status_counts(db: Database, job_ids: Sequence[UUID] | None = None) -> Counter[str]:
    if job_ids is None:
        rows = await db.fetch("SELECT status, count(*) AS n FROM build_jobs GROUP BY status")
    else:
        rows = await db.fetch(
            "SELECT status, count(*) AS n FROM build_jobs WHERE id = ANY($1::uuid[]) "
            "GROUP BY status", list(job_ids))
    return Counter({r["status"]: r["n"] for r in rows})


@attrs.frozen
class RunAudit:
    """What the `executions` table says about a set of jobs."""

    jobs: int
    runs: int
    #: Jobs that never ran to the end (no finished run).
    never_finished: list[UUID]
    #: Jobs that finished more than once, or ran again after finishing: never allowed.
    rerun_after_finish: list[UUID]
    #: Runs that were cut off (crash, kill, outage) and retried: at-least-once case (a)/(b).
    interrupted_runs: int


def audit_runs(runs: dict[UUID, list[Run]], job_ids: Sequence[UUID]) -> RunAudit:
    never, again = [], []
    interrupted = 0
    for job in job_ids:
        rs = runs.get(job, [])
        finished = [i for i, r in enumerate(rs) if r.finished]
        if not finished:
            never.append(job)
        elif len(finished) > 1 or finished[0] != len(rs) - 1:
            again.append(job)
        interrupted += sum(1 for r in rs if not r.finished)
    return RunAudit(jobs=len(job_ids), runs=sum(len(runs.get(j, [])) for j in job_ids),
                    never_finished=never, rerun_after_finish=again,
                    interrupted_runs=interrupted)


async def unfinished_jobs(db: Database, job_ids: Sequence[UUID]) -> str:
    """The jobs of `job_ids` that are not done, for a failure message."""
    rows = await db.fetch(
        "SELECT id, status, attempt, picked_at, error_msg FROM build_jobs "
        "WHERE id = ANY($1::uuid[]) AND status <> 'done' ORDER BY created_at LIMIT 20",
        list(job_ids))
    return "not done: " + "; ".join(
        f"{r['id']} {r['status']} attempt={r['attempt']} picked_at={r['picked_at']} "
        f"error={r['error_msg']}" for r in rows)


# -- what the tests record and hold --------------------------------------------------------

#: The sweep's threshold is 60 minutes; a row claimed this long ago is stuck.
AGE_PAST_THRESHOLD = "2 hours"

#: Every status change of a job, logged by a trigger.
TRANSITIONS_DDL = """
CREATE TABLE transitions (
    seq     bigserial PRIMARY KEY,
    job_id  uuid NOT NULL,
    old     text NOT NULL,
    new     text NOT NULL,
    attempt integer NOT NULL,
    error   text
);
CREATE FUNCTION log_transition() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO transitions (job_id, old, new, attempt, error)
    VALUES (NEW.id, OLD.status, NEW.status, NEW.attempt, NEW.error_msg);
    RETURN NULL;
END;
$$;
CREATE TRIGGER log_transition AFTER UPDATE OF status ON build_jobs
    FOR EACH ROW WHEN (OLD.status IS DISTINCT FROM NEW.status)
    EXECUTE FUNCTION log_transition();

"""


@asynccontextmanager
async def gate_closed(db: Database) -> AsyncIterator[None]:
    """Hold the advisory lock `GATE`: every ``gate`` run waits inside PostgreSQL until exit."""
    async with db.transaction() as tx:
        await tx.execute("SELECT pg_advisory_xact_lock($1)", GATE)
        yield
