"""
Health and metrics over HTTP (issue #12): the real hypercorn server on an
ephemeral port, a real worker, a real PostgreSQL (cut by a TCP proxy for the
outage), an HTTP client (httpx on trio). No mocks of the database, no sleeps to
wait: every wait is on a condition, under a deadline.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, ClassVar

import attrs
import httpx
import pytest
import trio
from click.testing import CliRunner
from prometheus_client.parser import text_string_to_metric_families
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from nasiko_queue import (
    Executors,
    JobArgs,
    JobOptions,
    PlainJobContext,
    Queue,
    Worker,
    open_database,
)
from nasiko_queue.cli import main
from nasiko_queue.db.embedded import EmbeddedPostgres
from nasiko_queue.testing import enqueue_with_target
from nasiko_queue.web.bind import parse_bind
from nasiko_queue.web.server import HttpService, build_app

from .conftest import FAST, MASTER_KEY
from .helpers import TEST_DEADLINE
from .netproxy import Proxy
from .test_cli import _start_worker, worker_log  # noqa: F401  (a fixture)
from .test_outages import own_dsn, own_server  # noqa: F401  (fixtures)

#: How soon /health/ready must turn 503 once the database is cut off: the
#: check's own bound (1 s) plus the client's round trip, with margin.
OUTAGE_NOTICED_WITHIN = 5.0


@attrs.frozen(kw_only=True)
class Tick(JobArgs):
    kind: ClassVar[str] = "tick"
    options: ClassVar[JobOptions] = JobOptions(queue="ticks", max_attempts=1)
    n: int
    crash: bool = False


def no_backoff(_attempt: int) -> float:
    return 0.0


def metrics(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of an exposition, by (name, sorted labels)."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str,
          **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


async def db_states(queue: Queue) -> dict[tuple[str, str, str], int]:
    """The database's own count, as the gauge should show it."""
    rows = await queue.db.fetch(
        "SELECT queue, kind, state, count(*) AS n FROM nasiko_queue_jobs "
        "GROUP BY queue, kind, state "
        "UNION ALL SELECT 'builds', payload ->> 'kind', status, count(*) FROM build_jobs "
        "GROUP BY status, payload ->> 'kind'")
    return {(r["queue"], r["kind"], r["state"]): r["n"] for r in rows}


def gauge_states(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float]
                 ) -> dict[tuple[str, str, str], int]:
    out = {}
    for (name, labels), v in samples.items():
        if name == "nasiko_queue_jobs":
            d = dict(labels)
            out[(d["queue"], d["kind"], d["state"])] = int(v)
    return out


@asynccontextmanager
async def serving(queue: Queue, worker: Worker | None) -> AsyncIterator[
        tuple[HttpService, httpx.AsyncClient]]:
    service = HttpService(queue, worker, port=0)
    async with trio.open_nursery() as nursery:
        await nursery.start(service.run)
        async with httpx.AsyncClient(base_url=service.url, timeout=10.0) as client:
            yield service, client
        nursery.cancel_scope.cancel()


async def until(check: Callable[[], Any], what: str, deadline: float = TEST_DEADLINE) -> None:
    """Poll an HTTP check until it holds, at most `deadline` seconds (fails the test)."""
    with trio.move_on_after(deadline):
        # Another server's answer (over HTTP) is the condition: no event to wait on.
        while not await check():  # noqa: ASYNC110
            await trio.sleep(0.05)
        return
    pytest.fail(f"timed out after {deadline}s waiting for {what}")


# -- metrics ------------------------------------------------------------------------


async def test_metrics_follow_a_worker_draining_jobs(queue: Queue) -> None:
    n_ok, n_crash, n_later = 12, 5, 3
    gate = trio.Event()
    executors = Executors()

    @executors.register(Tick, backoff=no_backoff)
    async def tick(ctx: PlainJobContext[Tick]) -> None:
        await gate.wait()
        if ctx.payload.crash:
            raise RuntimeError("this tick crashes")

    await queue.enqueue_many([Tick(n=i, crash=i >= n_ok) for i in range(n_ok + n_crash)])
    for i in range(n_later):  # available, not due: no claim, no age
        await queue.enqueue(Tick(n=100 + i), delay=3600)
    # Two build jobs nobody runs here (this worker runs no builds): queue "builds".
    for _ in range(2):
        await enqueue_with_target(queue, "Upload")
    config = attrs.evolve(FAST, queues=(("ticks", 4),), builds=False)
    worker = Worker(Queue(queue.db, config=config, secrets=MASTER_KEY), executors)
    with trio.fail_after(TEST_DEADLINE):
        async with trio.open_nursery() as nursery:
            await nursery.start(worker.run)
            async with serving(queue, worker) as (_service, client):
                # Mid-drain: four jobs held by their executors, the rest waiting.
                await worker.wait_for(lambda s: s.running == 4)
                response = await client.get("/metrics")
                assert response.status_code == 200
                assert response.headers["content-type"].startswith("text/plain")
                mid = metrics(response.text)
                assert gauge_states(mid) == await db_states(queue)
                assert gauge_states(mid)[("ticks", "tick", "running")] == 4
                assert value(mid, "nasiko_queue_jobs_claimed_total") == 4
                assert value(mid, "nasiko_queue_database_up") == 1
                # The 13 due jobs wait; the scheduled ones are not claimable yet.
                assert value(mid, "nasiko_queue_oldest_available_job_age_seconds",
                             queue="ticks") > 0
                assert value(mid, "nasiko_queue_oldest_available_job_age_seconds",
                             queue="builds") > 0

                gate.set()
                total = n_ok + n_crash
                await worker.wait_for(lambda s: s.done + s.failed >= total)
                await worker.drain_once()
                started = time.perf_counter()
                response = await client.get("/metrics")
                scrape = time.perf_counter() - started
                after = metrics(response.text)
                states = await db_states(queue)
                assert gauge_states(after) == states
                assert states[("ticks", "tick", "completed")] == n_ok
                assert states[("ticks", "tick", "discarded")] == n_crash
                assert states[("ticks", "tick", "available")] == n_later
                assert states[("builds", "Upload", "pending")] == 2
                stats = worker.stats
                for name, expected in [("claimed", total), ("done", n_ok),
                                       ("failed", n_crash), ("crashed", n_crash),
                                       ("retried", 0), ("rescued", 0)]:
                    assert value(after, f"nasiko_queue_jobs_{name}_total") == expected, name
                assert stats.claimed == total
                assert stats.panicked == n_crash
                # Every run and every claim observed once.
                assert value(after, "nasiko_queue_job_run_seconds_count") == total
                assert value(after, "nasiko_queue_job_claim_latency_seconds_count") == total
                assert value(after, "nasiko_queue_job_run_seconds_bucket", le="+Inf") == total
                assert value(after, "nasiko_queue_job_claim_latency_seconds_sum") > 0
                # No due plain job waits any more; the builds still do.
                assert value(after, "nasiko_queue_oldest_available_job_age_seconds",
                             queue="ticks") == 0
                name = after_worker_label(after)
                assert value(after, "nasiko_queue_worker_heartbeats_total",
                             worker=name) == stats.heartbeats >= 1
                assert value(after, "nasiko_queue_worker_leader", worker=name) == 1
                print(f"scrape with {total + n_later + 2} jobs: {scrape * 1000:.1f} ms "
                      f"(statement {value(after, 'nasiko_queue_scrape_query_seconds'):.4f}s)")
            worker.stop()


def after_worker_label(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float]) -> str:
    [label] = [dict(labels)["worker"] for name, labels in samples
               if name == "nasiko_queue_worker_leader"]
    return label


async def test_metrics_scrape_stays_one_cheap_statement_with_many_jobs(queue: Queue) -> None:
    """A figure for the report and a bound: 20 000 jobs, scraped in well under a second."""
    await queue.db.execute(
        "INSERT INTO nasiko_queue_jobs (id, queue, kind, payload, state, max_attempts) "
        "SELECT gen_random_uuid(), 'q' || (i % 4), 'k' || (i % 3), '{}', "
        "(ARRAY['available','running','completed','discarded'])[1 + i % 4], 1 "
        "FROM generate_series(1, 20000) AS i")
    async with serving(queue, None) as (_service, client):
        await client.get("/metrics")  # a warm connection and plan
        started = time.perf_counter()
        response = await client.get("/metrics")
        took = time.perf_counter() - started
    samples = metrics(response.text)
    assert gauge_states(samples) == await db_states(queue)
    assert sum(gauge_states(samples).values()) == 20000
    print(f"scrape with 20000 jobs: {took * 1000:.1f} ms "
          f"(statement {value(samples, 'nasiko_queue_scrape_query_seconds') * 1000:.1f} ms)")
    assert took < 2.0


# -- health -------------------------------------------------------------------------


async def test_ready_turns_503_when_the_database_goes_away_and_200_when_it_is_back(
    dsn: str,
) -> None:
    proxy = Proxy(dsn)
    executors = Executors()

    @executors.register(Tick)
    async def tick(ctx: PlainJobContext[Tick]) -> None:
        return None

    with trio.fail_after(TEST_DEADLINE):
        async with trio.open_nursery() as outer:
            await outer.start(proxy.run)
            async with open_database(proxy.dsn()) as db:
                queue = Queue(db, config=FAST, secrets=MASTER_KEY)
                worker = Worker(queue, executors)
                async with trio.open_nursery() as nursery:
                    await nursery.start(worker.run)
                    async with serving(queue, worker) as (_service, client):

                        async def ready_is(code: int) -> bool:
                            return (await client.get("/health/ready")).status_code == code

                        await until(lambda: ready_is(200), "ready")
                        body = (await client.get("/health/ready")).json()
                        assert body["status"] == "ready"
                        assert set(body["checks"]) == {"database", "migrations", "listen",
                                                       "heartbeat"}
                        assert all(c["ok"] for c in body["checks"].values()), body

                        proxy.partition()
                        cut = trio.current_time()
                        await until(lambda: ready_is(503), "503", OUTAGE_NOTICED_WITHIN)
                        noticed = trio.current_time() - cut
                        down = await client.get("/health/ready")
                        assert down.status_code == 503
                        assert down.json()["checks"]["database"]["ok"] is False
                        # The loop still answers.
                        live = await client.get("/health/live")
                        assert live.status_code == 200
                        # And so does /metrics, with the worker's side only.
                        scraped = metrics((await client.get("/metrics")).text)
                        assert value(scraped, "nasiko_queue_database_up") == 0
                        assert ("nasiko_queue_jobs_claimed_total", ()) in scraped

                        proxy.restore()
                        back = trio.current_time()
                        await until(lambda: ready_is(200), "ready again")
                        print(f"503 after {noticed:.2f}s of outage; "
                              f"200 again {trio.current_time() - back:.2f}s after it ended")
                    worker.stop()
            outer.cancel_scope.cancel()


async def test_ready_reports_a_stale_heartbeat_and_a_lost_listen_connection(
    dsn: str,
) -> None:
    """Short timers, so that the worker fences and its LISTEN check fails within
    a second of the cut: both checks fail by name, and pass again after."""
    proxy = Proxy(dsn)
    executors = Executors()

    @executors.register(Tick)
    async def tick(ctx: PlainJobContext[Tick]) -> None:
        return None

    config = attrs.evolve(FAST, heartbeat_interval=0.2, lease=0.8,
                          listen_check_interval=0.2, cleanup_timeout=0.3)
    with trio.fail_after(TEST_DEADLINE):
        async with trio.open_nursery() as outer:
            await outer.start(proxy.run)
            async with open_database(proxy.dsn()) as db:
                worker = Worker(Queue(db, config=config, secrets=MASTER_KEY), executors)
                async with trio.open_nursery() as nursery:
                    await nursery.start(worker.run)
                    async with serving(Queue(db, config=config), worker) as (_s, client):

                        async def checks_ok() -> dict[str, bool]:
                            body = (await client.get("/health/ready")).json()
                            return {name: c["ok"] for name, c in body["checks"].items()}

                        async def all_ok() -> bool:
                            return all((await checks_ok()).values())

                        async def worker_side_failed() -> bool:
                            ok = await checks_ok()
                            return not ok["heartbeat"] and not ok["listen"]

                        await until(all_ok, "ready")
                        proxy.partition()
                        await until(worker_side_failed, "heartbeat and listen to fail", 10.0)
                        assert worker.state.fenced
                        proxy.restore()
                        await until(all_ok, "ready again")
                    worker.stop()
            outer.cancel_scope.cancel()


async def test_ready_is_503_on_an_unmigrated_database(empty_dsn: str) -> None:
    async with open_database(empty_dsn) as db:
        queue = Queue(db, config=FAST)
        with trio.fail_after(TEST_DEADLINE):
            async with serving(queue, None) as (_service, client):
                response = await client.get("/health/ready")
                assert (await client.get("/health/live")).status_code == 200
    assert response.status_code == 503
    checks = response.json()["checks"]
    assert checks["database"]["ok"] is True
    assert checks["migrations"]["ok"] is False
    assert "not migrated" in checks["migrations"]["detail"]


async def test_ready_says_which_migration_is_pending(queue: Queue) -> None:
    await queue.db.execute(
        "DELETE FROM nasiko_queue_migrations WHERE version = "
        "(SELECT max(version) FROM nasiko_queue_migrations)")
    with trio.fail_after(TEST_DEADLINE):
        async with serving(queue, None) as (_service, client):
            response = await client.get("/health/ready")
    assert response.status_code == 503
    assert "pending: " in response.json()["checks"]["migrations"]["detail"]


# -- the app --------------------------------------------------------------------------


async def test_a_dashboard_mounts_at_the_root_after_the_health_routes(queue: Queue) -> None:
    async def home(_request: Any) -> PlainTextResponse:
        return PlainTextResponse("dashboard")

    dashboard = build_app([Route("/", home), Route("/health/live", home)])
    service = HttpService(queue, None, port=0, dashboard=dashboard)
    with trio.fail_after(TEST_DEADLINE):
        async with trio.open_nursery() as nursery:
            await nursery.start(service.run)
            async with httpx.AsyncClient(base_url=service.url) as client:
                assert (await client.get("/")).text == "dashboard"
                assert (await client.get("/health/live")).text == "ok\n"
            nursery.cancel_scope.cancel()


@pytest.mark.parametrize(("spec", "bind"), [
    ("127.0.0.1:9181", ("127.0.0.1", 9181)),
    (":9000", ("127.0.0.1", 9000)),
    ("0.0.0.0:0", ("0.0.0.0", 0)),  # noqa: S104
    ("[::1]:9181", ("::1", 9181)),
    ("localhost:80", ("localhost", 80)),
])
def test_parse_bind(spec: str, bind: tuple[str, int]) -> None:
    assert parse_bind(spec) == bind


@pytest.mark.parametrize("spec", ["9181", "host:", "host:port", "host:70000", "::1:9181",
                                  "a b:1", ""])
def test_parse_bind_refuses(spec: str) -> None:
    with pytest.raises(ValueError, match=r"HOST:PORT|port|IPv6|spaces"):
        parse_bind(spec)


# -- the command ----------------------------------------------------------------------


#: Never connected to: the option is refused before anything runs.
UNUSED_DSN = "postgresql://nobody@127.0.0.1:1/none"


@pytest.mark.parametrize("bad", ["9181", "localhost:http", "127.0.0.1:99999"])
def test_worker_http_refuses_a_bad_address(bad: str) -> None:
    result = CliRunner().invoke(main, ["worker", "--dsn", UNUSED_DSN, "--executors",
                                       "tests.cli_executors:executors", "--http", bad])
    assert result.exit_code == 2, result.output
    assert "--http" in result.output
    assert "Usage:" in result.output


def test_worker_dashboard_needs_http() -> None:
    result = CliRunner().invoke(main, ["worker", "--dsn", UNUSED_DSN, "--executors",
                                       "tests.cli_executors:executors", "--dashboard"])
    assert result.exit_code == 2, result.output
    assert "--dashboard is served on --http" in result.output


def test_worker_http_without_the_extra_names_it(monkeypatch: pytest.MonkeyPatch) -> None:
    # As on an installation without hypercorn: the module is imported afresh and fails.
    monkeypatch.delitem(sys.modules, "nasiko_queue.web.server")
    monkeypatch.setitem(sys.modules, "hypercorn.trio", None)
    result = CliRunner().invoke(main, ["worker", "--dsn", UNUSED_DSN, "--executors",
                                       "tests.cli_executors:executors", "--http",
                                       "127.0.0.1:9181"])
    assert result.exit_code == 2, result.output
    assert "pip install 'nasiko-queue[http]'" in result.output
    assert "hypercorn.trio" in result.output


def test_the_core_and_the_cli_import_nothing_of_the_extra() -> None:
    code = ("import sys, nasiko_queue, nasiko_queue.cli, nasiko_queue.web.bind; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & "
            "{'hypercorn', 'starlette', 'prometheus_client', 'jinja2'}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "[]"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@pytest.mark.slow
async def test_worker_process_serves_health_and_metrics(
    dsn: str, queue: Queue, worker_log: Path  # noqa: F811
) -> None:
    port = _free_port()
    proc = await _start_worker(dsn, worker_log, "--http", f"127.0.0.1:{port}", "--dashboard")
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}",
                                     timeout=5.0) as client:

            async def ready() -> bool:
                if proc.returncode is not None:
                    pytest.fail(f"the worker exited with {proc.returncode}")
                try:
                    return (await client.get("/health/ready")).status_code == 200
                except httpx.TransportError:  # not listening yet
                    return False

            await until(ready, "the worker process to be ready", 30.0)
            job = await enqueue_with_target(queue, "Upload")

            async def done() -> bool:
                text = (await client.get("/metrics")).text
                return "nasiko_queue_jobs_done_total 1.0" in text

            await until(done, "the job to show in /metrics", 30.0)
            text = (await client.get("/metrics")).text
            assert 'nasiko_queue_jobs{kind="Upload",queue="builds",state="done"} 1.0' in text
            assert await queue.db.fetchval(
                "SELECT status FROM build_jobs WHERE id = $1", job.job_id) == "done"
            # The dashboard on the same port; no token set: one made for the run,
            # its login URL printed once.
            page = await client.get("/")
            assert page.status_code == 200
            assert "builds" in page.text
            assert (await client.post("/login", data={"token": "x"})).status_code in (
                401, 403)
            printed = worker_log.read_text()  # noqa: ASYNC240 (a small local file)
            url = printed.split("log in at ", 1)[1].split()[0]
            assert url.startswith(f"http://127.0.0.1:{port}/login?token=")
            r = await client.get(url)
            assert r.status_code == 303
            assert "/logout" in (await client.get("/")).text
    finally:
        proc.terminate()
        with trio.move_on_after(20):
            await proc.wait()
        if proc.returncode is None:
            proc.kill()
    assert proc.returncode == 0


@pytest.mark.slow
async def test_ready_turns_503_when_its_own_server_stops_and_200_when_it_starts_again(
    own_server: EmbeddedPostgres, own_dsn: str,  # noqa: F811 (fixtures)
) -> None:
    """The issue's proof with a PostgreSQL server this test starts and stops itself
    (the shared one is never stopped): a fast shutdown, then a start."""
    executors = Executors()

    @executors.register(Tick)
    async def tick(ctx: PlainJobContext[Tick]) -> None:
        return None

    with trio.fail_after(TEST_DEADLINE * 2):
        async with open_database(own_dsn) as db:
            queue = Queue(db, config=FAST, secrets=MASTER_KEY)
            worker = Worker(queue, executors)
            async with trio.open_nursery() as nursery:
                await nursery.start(worker.run)
                async with serving(queue, worker) as (_service, client):

                    async def ready_is(code: int) -> bool:
                        return (await client.get("/health/ready")).status_code == code

                    await until(lambda: ready_is(200), "ready")
                    await trio.to_thread.run_sync(own_server.stop)
                    stopped = trio.current_time()
                    await until(lambda: ready_is(503), "503", OUTAGE_NOTICED_WITHIN)
                    noticed = trio.current_time() - stopped
                    assert (await client.get("/health/live")).status_code == 200
                    await trio.to_thread.run_sync(own_server.start)
                    started = trio.current_time()
                    await until(lambda: ready_is(200), "ready again")
                    print(f"503 {noticed:.2f}s after the server stopped; 200 again "
                          f"{trio.current_time() - started:.2f}s after it started")
                worker.stop()
