"""
The operator's questions (issue #21): per-queue oldest due wait, throughput and
unserved queues (dashboard, `status`, `/metrics`), running and scheduled jobs
with "run now", search by kind and by argument, schedule pause/resume/run now,
operator actions in a job's timeline, and self-refreshing pages. Real
PostgreSQL, a real worker and Debian's chromium; no wall-clock waits (the
worker's counters, rows, and Playwright's auto-waiting `expect` are the signals;
the refresh test waits for a row the page can only show after refreshing).
"""

from __future__ import annotations

import json
import os
import re
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import trio
from click.testing import CliRunner
from prometheus_client.parser import text_string_to_metric_families

from nasiko_queue import Database, JobOptions, Queue
from nasiko_queue.admin import jobs as job_admin
from nasiko_queue.admin import operator
from nasiko_queue.admin.retention import prune
from nasiko_queue.admin.status import queue_status
from nasiko_queue.builds.store import PgJobStore
from nasiko_queue.db.statements import Q
from nasiko_queue.engine.contracts import WorkerIdentity
from nasiko_queue.plain.schedules import Schedule, Scheduler
from nasiko_queue.web import pages as web_pages
from nasiko_queue.web.dashboard import dashboard_app
from nasiko_queue.web.metrics import Metrics

from .conftest import FAST
from .helpers import TEST_DEADLINE, running
from .test_cli import invoke, runner, with_db  # noqa: F401  (runner: a fixture)
from .test_dashboard import (  # noqa: F401  (work_queue, shots: fixtures)
    TOKEN,
    Behaviour,
    Work,
    _Browser,
    _client,
    _dead_job,
    _login,
    _login_in,
    _state,
    needs_chromium,
    serving,
    shots,
    work_queue,
)


async def _register(db: Database, queues: dict[str, int], host: str = "box",
                    kinds: tuple[str, ...] = (Work.kind,)) -> uuid.UUID:
    """A live worker row serving `queues` and running `kinds` (as a worker's heartbeat
    service writes it)."""
    store = PgJobStore(db, FAST, runnable_kinds=frozenset(), known_kinds=frozenset())
    worker_id = uuid.uuid4()
    await store.register_worker(WorkerIdentity(id=worker_id, host=host, pid=7, kinds=kinds,
                                               queues=tuple(queues.items())))
    return worker_id


async def _unserved_rows(db: Database) -> None:
    """Queue "work" served by a live worker; "nobody" and "ghost" served by none
    ("ghost"'s only worker is dead); 2 jobs of "work" completed, one 3 minutes ago;
    one job in "work" of a kind its worker does not run (a typo: issue #46)."""
    queue = Queue(db, config=FAST)
    await _register(db, {"work": 2, "builds": 1})
    ghost = await _register(db, {"ghost": 1}, host="gone")
    await db.execute("UPDATE nasiko_queue_workers SET dead_at = now() WHERE id = $1", ghost)
    await queue.enqueue(Work(note="served"))
    await queue.enqueue(Work(note="lost"), options=JobOptions(queue="nobody"))
    await queue.enqueue(Work(note="later"), options=JobOptions(queue="nobody"), delay=3600)
    await queue.enqueue(Work(note="haunted"), options=JobOptions(queue="ghost"))
    await queue.enqueue_json("wrok", {}, options=JobOptions(queue="work"))
    for minutes in (0, 3):
        done = await queue.enqueue(Work(note=f"done {minutes}"))
        await db.execute(
            "UPDATE nasiko_queue_jobs SET state = 'completed', "
            "finished_at = now() - make_interval(mins => $2) WHERE id = $1", done, minutes)


async def test_status_names_unserved_queues_and_counts_throughput(db: Database) -> None:
    await _unserved_rows(db)
    status = await queue_status(db)
    assert [(u.queue, u.kind, u.waiting) for u in status.unserved] == [
        ("ghost", None, 1), ("nobody", None, 2), ("work", "wrok", 1)]
    work = next(q for q in status.queues if q.queue == "work")
    assert (work.completed_1m, work.completed_5m) == (1, 2)
    assert work.oldest_available_age is not None
    live = [w for w in status.workers if w.alive]
    assert [dict(w.queues or {}) for w in live] == [{"work": 2, "builds": 1}]
    # A live worker of an older version (no queues recorded) may serve anything.
    await db.execute("INSERT INTO nasiko_queue_workers (id, host, pid, kinds, lease_secs) "
                     "VALUES (gen_random_uuid(), 'old', 1, ARRAY[$1], 60)", Work.kind)
    # ... but no worker runs the typo'd kind.
    assert [(u.queue, u.kind) for u in (await queue_status(db)).unserved] == [
        ("work", "wrok")]


def test_status_command_warns_about_unserved_queues(runner: CliRunner,  # noqa: F811
                                                    dsn: str) -> None:
    with_db(dsn, _unserved_rows)
    result = invoke(runner, "status", "--dsn", dsn, "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert [(u["queue"], u["kind"], u["waiting"]) for u in data["unserved"]] == [
        ("ghost", None, 1), ("nobody", None, 2), ("work", "wrok", 1)]
    work = next(q for q in data["queues"] if q["queue"] == "work")
    assert (work["completed_1m"], work["completed_5m"]) == (1, 2)
    table = invoke(runner, "status", "--dsn", dsn)
    assert "WARNING: queue 'nobody' has 2 waiting jobs and no live worker serves it" \
        in table.stdout
    assert "WARNING: queue 'work' has 1 waiting job of kind 'wrok', which no live worker " \
        "runs" in " ".join(table.stdout.split())
    assert "work×2" in table.stdout


async def test_metrics_gauge_unserved_queues(db: Database) -> None:
    await _unserved_rows(db)
    text = (await Metrics(Queue(db, config=FAST)).scrape()).decode()
    samples = {s.labels["queue"]: s.value for f in text_string_to_metric_families(text)
               for s in f.samples if s.name == "nasiko_queue_unserved_queue_jobs"}
    assert samples == {"ghost": 1.0, "nobody": 2.0}
    kinds = {(s.labels["queue"], s.labels["kind"]): s.value
             for f in text_string_to_metric_families(text)
             for s in f.samples if s.name == "nasiko_queue_unserved_kind_jobs"}
    assert kinds == {("work", "wrok"): 1.0}


async def test_a_worker_registers_the_queues_it_serves(work_queue: Queue) -> None:  # noqa: F811
    async with running(work_queue, Behaviour(failing=False).executors()):
        status = await queue_status(work_queue.db)
    assert [dict(w.queues or {}) for w in status.workers if w.alive] == [{"work": 1}]


async def test_operator_actions_are_kept_in_the_timeline(work_queue: Queue) -> None:  # noqa: F811
    db = work_queue.db
    dead = await _dead_job(work_queue)
    await job_admin.retry(db, dead, work_queue.config, actor="cli")
    assert await job_admin.cancel(db, dead, actor="api") == "cancelled"
    later = await work_queue.enqueue(Work(note="later"), delay=3600)
    app = dashboard_app(db, token=TOKEN, config=work_queue.config)
    async with await _client(app) as client:
        csrf = await _login(client)
        r = await client.post("/actions/run-now", data={"id": str(later), "csrf": csrf})
        assert r.status_code == 303
        assert "msg=" in r.headers["location"]
        r = await client.post("/actions/run-now", data={"id": str(dead), "csrf": csrf})
        assert "error=" in r.headers["location"]  # cancelled: refused, said why
        r = await client.post("/actions/discard", data={"id": str(dead), "csrf": csrf})
        assert r.status_code == 303
        page = (await client.get(f"/jobs/{later}")).text
        assert "run now by dashboard" in page
    assert [(e.action, e.actor) for e in await operator.job_events(db, dead)] == [
        ("retried", "cli"), ("cancelled", "api"), ("discarded", "dashboard")]
    row = await db.fetchrow(Q_RUN_AT, later)
    assert row["due"]
    with pytest.raises(job_admin.JobNotFound):
        await operator.run_now(db, uuid.uuid4())


Q_RUN_AT = "SELECT run_at <= now() AS due FROM nasiko_queue_jobs WHERE id = $1"


async def test_search_by_kind_and_arguments(work_queue: Queue) -> None:  # noqa: F811
    needle = await work_queue.enqueue(Work(note="needle"))
    await work_queue.enqueue(Work(note="hay"))
    found = await operator.search_jobs(work_queue.db, kind="work", args='{"note": "needle"}')
    assert [j.id for j in found] == [needle]
    assert await operator.search_jobs(work_queue.db, kind="other") == []
    app = dashboard_app(work_queue.db, token=None)
    async with await _client(app) as client:
        r = await client.get("/search", params={"kind": "work", "args": '{"note": "hay"}'})
        assert r.status_code == 200
        assert r.text.count("data-job=") == 1
        r = await client.get("/search", params={"args": "{note: hay"})
        assert r.status_code == 400
        assert "arguments: not valid JSON" in r.text
        r = await client.get("/search", params={"args": "[1]"})
        assert r.status_code == 400
        assert "give a JSON object" in r.text


async def test_a_search_is_bounded_in_length_and_in_time(
    work_queue: Queue, monkeypatch: pytest.MonkeyPatch  # noqa: F811
) -> None:
    """
    Anyone who may read the dashboard may search, and a search by arguments
    alone tests every job's payload: the filters had no length cap and the
    statement no time bound (found by review). A search that runs past its bound
    is stopped and says so; here it waits on a lock past a bound of 0.2 s.
    """
    app = dashboard_app(work_queue.db, token=None)
    async with await _client(app) as client:
        r = await client.get("/search", params={"args": json.dumps({"note": "x" * 5000})})
        assert (r.status_code, "arguments: at most 4096 characters" in r.text) == (400, True)
        r = await client.get("/search", params={"kind": "k" * 101})
        assert (r.status_code, "kind: at most 100 characters" in r.text) == (400, True)
        r = await client.get("/scheduled", params={"queue": "q" * 129})
        assert (r.status_code, r.text) == (400, "queue: at most 128 characters, got 129")
    monkeypatch.setattr(operator, "SEARCH_TIMEOUT", 0.2)
    with trio.fail_after(TEST_DEADLINE):
        async with work_queue.db.transaction() as other:
            await other.execute("LOCK TABLE nasiko_queue_jobs IN ACCESS EXCLUSIVE MODE")
            with pytest.raises(ValueError, match=r"the search ran past 0\.2 s"):
                await operator.search_jobs(work_queue.db, args='{"note": "x"}')


async def test_a_paused_schedule_enqueues_nothing_until_resumed(work_queue: Queue) -> None:  # noqa: F811
    db = work_queue.db
    schedule = Schedule("every-minute", "* * * * *", Work(note="tick"))
    scheduler = Scheduler(work_queue, [schedule])
    t0 = datetime(2030, 1, 1, 12, 0, tzinfo=UTC)
    with pytest.raises(job_admin.JobRefused, match="not known yet"):
        await operator.pause_schedule(db, schedule.name)
    assert (await scheduler.run_once(t0)).recorded == ("every-minute",)
    await operator.pause_schedule(db, schedule.name)
    paused = await scheduler.run_once(t0 + timedelta(minutes=1))
    assert (paused.enqueued, paused.skipped) == ((), ("every-minute",))
    assert await operator.resume_schedule(db, schedule.name)
    assert not await operator.resume_schedule(db, schedule.name)
    resumed = await scheduler.run_once(t0 + timedelta(minutes=2))
    assert [t.at for t in resumed.enqueued] == [t0 + timedelta(minutes=2)]


# -- in a browser -----------------------------------------------------------------


@needs_chromium
async def test_browser_running_scheduled_run_now_and_refresh(
    work_queue: Queue, shots: Path, monkeypatch: pytest.MonkeyPatch,  # noqa: F811
) -> None:
    from playwright.sync_api import expect

    monkeypatch.setattr(web_pages, "REFRESH_SECS", 1)
    db = work_queue.db
    await work_queue.enqueue(Work(note="lost"), options=JobOptions(queue="nobody"))
    await work_queue.enqueue_json("wrok", {}, options=JobOptions(queue="work"))  # a typo
    later = await work_queue.enqueue(Work(note="for later"), delay=3600)
    app = dashboard_app(db, token=TOKEN, config=work_queue.config)
    browser = _Browser(shots)
    behaviour = Behaviour(failing=False, gate=trio.Event())
    with trio.fail_after(TEST_DEADLINE * 2):
        async with serving(app) as base, browser.page() as page, \
                running(work_queue, behaviour.executors()) as worker:

            def empty_running_page() -> None:
                _login_in(page, base)
                page.goto(base + "/running")
                expect(page.locator("tr[data-job]")).to_have_count(0)
                expect(page.locator("meta[http-equiv=refresh]")).to_have_count(1)

            await browser.do(empty_running_page)
            # A job starts after the page was loaded: only a refresh shows it.
            busy = await work_queue.enqueue(Work(note="busy"))
            await worker.wait_for(lambda s: s.running >= 1)

            def pages() -> None:
                row = page.locator(f"tr[data-job='{busy}']")
                # The page refreshed itself (every second here): waits for the row.
                expect(row).to_be_visible(timeout=TEST_DEADLINE * 1000)
                expect(row.locator("td.worker")).to_contain_text(f":{os.getpid()}")
                browser.shot(page, "running")
                page.goto(base + "/")
                expect(page.locator("p.unserved[data-unserved=nobody]")).to_contain_text(
                    "no live worker serves it")
                expect(page.locator("p.unserved[data-unserved-kind=wrok]")).to_contain_text(
                    "which no live worker of that queue runs")
                expect(page.locator("tr[data-queue=nobody] td.qstate")).to_contain_text(
                    "no worker")
                expect(page.locator("tr[data-queue=nobody] td.oldest")).to_have_text(
                    re.compile(r"\d+ s"))
                browser.shot(page, "overview-health")
                # Pause the refresh: the tag goes, and stays gone page after page.
                page.click("#refresh-toggle")
                expect(page.locator("#refresh-toggle")).to_have_text("Resume refresh")
                expect(page.locator("meta[http-equiv=refresh]")).to_have_count(0)
                page.click("nav >> text=Workers")
                expect(page.locator("meta[http-equiv=refresh]")).to_have_count(0)
                expect(page.locator("tr[data-worker] td.queues")).to_have_text("work × 1")
                browser.shot(page, "workers-queues")
                page.click("#refresh-toggle")
                expect(page.locator("meta[http-equiv=refresh]")).to_have_count(1)
                page.click("nav >> text=Scheduled")
                row = page.locator(f"tr[data-job='{later}']")
                expect(row.locator("td.run-at")).to_contain_text("UTC")
                browser.shot(page, "scheduled")
                row.locator("button:text('Run now')").click()
                expect(page.locator("p.flash.ok")).to_have_text("1 job(s) due now")
                expect(page.locator(f"tr[data-job='{later}']")).to_have_count(0)

            await browser.do(pages)
            assert behaviour.gate is not None
            behaviour.gate.set()
            await worker.wait_for(lambda s: s.done >= 2)

            def timeline() -> None:
                page.goto(f"{base}/jobs/{later}")
                expect(page.locator("dd.state .badge")).to_have_text("completed")
                expect(page.locator(".timeline")).to_contain_text("run now by dashboard")

            await browser.do(timeline)
    assert await _state(work_queue, later) == "completed"
    assert browser.dialogs == []


@needs_chromium
async def test_browser_schedule_pause_run_now_and_search(
    work_queue: Queue, shots: Path,  # noqa: F811
) -> None:
    from playwright.sync_api import expect

    db = work_queue.db
    schedule = Schedule("nightly", "0 3 * * *", Work(note="nightly run"))
    await Scheduler(work_queue, [schedule]).run_once()  # recorded, nothing enqueued
    needle = await work_queue.enqueue(Work(note="needle"))
    await work_queue.enqueue(Work(note="hay"))
    app = dashboard_app(db, token=TOKEN, config=work_queue.config, schedules=[schedule])
    browser = _Browser(shots)
    with trio.fail_after(TEST_DEADLINE * 2):
        async with serving(app) as base, browser.page() as page:

            def act() -> None:
                _login_in(page, base)
                page.click("nav >> text=Schedules")
                row = page.locator("tr[data-schedule=nightly]")
                expect(row.locator("td.sstate")).to_have_text("active")
                row.locator("button:text('Pause')").click()
                expect(page.locator("p.flash.ok")).to_have_text("schedule nightly paused")
                expect(row.locator("td.sstate")).to_contain_text("paused")
                browser.shot(page, "schedules-paused")
                row.locator("button:text('Run now')").click()
                expect(page.locator("p.flash.ok")).to_contain_text("schedule nightly: job")
                page.click("nav >> text=Search")
                page.fill("input[name=kind]", "work")
                page.fill("input[name=args]", '{"note": "needle"}')
                page.click("button:text('Search')")
                expect(page.locator("tr[data-job]")).to_have_count(1)
                expect(page.locator(f"tr[data-job='{needle}']")).to_be_visible()
                browser.shot(page, "search")
                page.fill("input[name=args]", '{"note": ')
                page.click("button:text('Search')")
                expect(page.locator("#search-error")).to_contain_text("not valid JSON")
                page.click("nav >> text=Schedules")
                row.locator("button:text('Resume')").click()
                expect(page.locator("p.flash.ok")).to_have_text("schedule nightly resumed")

            await browser.do(act)
    paused = await db.fetchval("SELECT paused_at FROM nasiko_queue_schedules "
                               "WHERE name = 'nightly'")
    assert paused is None
    ran = await operator.search_jobs(db, kind="work", args='{"note": "nightly run"}')
    assert len(ran) == 1
    assert [(e.action, e.actor, e.detail) for e in await operator.job_events(db, ran[0].id)] \
        == [("run now", "dashboard", "schedule nightly")]


# -- at scale ---------------------------------------------------------------------


async def _plan_nodes(db: Database, sql: str, *args: Any) -> list[str]:
    plan = await db.fetchval("EXPLAIN (FORMAT JSON)\n" + sql, *args)
    found: list[str] = []

    def walk(node: dict[str, Any]) -> None:
        found.append(f"{node['Node Type']} {node.get('Index Name', '')}".strip())
        for child in node.get("Plans", ()):
            walk(child)

    walk((json.loads(plan) if isinstance(plan, str) else plan)[0]["Plan"])
    return found


async def test_listing_and_search_read_the_listing_index_page_by_page(db: Database) -> None:
    """20,000 finished jobs, analyzed: a page reads the listing index from the
    cursor on (no sort of the history), and every page follows the last in order."""
    await db.execute(
        "INSERT INTO nasiko_queue_jobs (id, queue, kind, payload, state, max_attempts, "
        "created_at, finished_at) "
        "SELECT gen_random_uuid(), 'q' || (i % 4), 'k' || (i % 3), "
        "jsonb_build_object('n', i % 100), "
        "(ARRAY['completed','discarded','cancelled'])[1 + i % 3], 1, "
        "now() - make_interval(secs => i), now() - make_interval(secs => i % 5000) "
        "FROM generate_series(1, 20000) AS i")
    await db.execute("ANALYZE nasiko_queue_jobs")
    first = (None, None, None, None, None, None, 50)
    for sql, args in ((Q.jobs_list, first),
                      (Q.jobs_search, ("k1", None, None, None, None, None, 50))):
        nodes = await _plan_nodes(db, sql, *args)
        assert "Index Scan nasiko_queue_jobs_listing" in nodes, nodes
        assert not any(n.startswith("Seq Scan") and "nasiko_queue_jobs" in n for n in nodes)
    # Paging through one queue by cursor meets every job once, newest first.
    seen: list[Any] = []
    after = None
    while True:
        page = await job_admin.list_jobs(
            db, job_admin.JobFilter(queue="q1", state=None, limit=500), after=after)
        seen += [(j.at, j.id) for j in page]
        if len(page) < 500:
            break
        after = page[-1].cursor
    assert len(seen) == 5000 == len(set(seen))
    assert seen == sorted(seen, reverse=True)
    found = await operator.search_jobs(db, kind="k1", args='{"n": 7}', limit=500)
    assert len(found) == len({f.id for f in found}) == await db.fetchval(
        "SELECT count(*) FROM nasiko_queue_jobs WHERE kind = 'k1' AND payload @> '{\"n\": 7}'")


async def test_overview_estimates_ended_jobs_on_a_big_table(db: Database) -> None:
    """Above the threshold the overview shows the planner's estimates of ended
    jobs (marked ≈), within a few percent here (queue and state independent, as
    the planner assumes); unfinished ones stay exact."""
    await db.execute(
        "INSERT INTO nasiko_queue_jobs (id, queue, kind, payload, state, max_attempts, "
        "finished_at) "
        "SELECT gen_random_uuid(), 'q' || (i / 4 % 2), 'k', '{}', "
        "(ARRAY['completed','completed','discarded','cancelled'])[1 + i % 4], 1, now() "
        "FROM generate_series(1, 20000) AS i")
    queue = Queue(db, config=FAST)
    await queue.enqueue(Work(note="due"), options=JobOptions(queue="q1"))
    await queue.enqueue(Work(note="fresh"), options=JobOptions(queue="fresh"))
    exact = {q.queue: q for q in await operator.queue_overview(db)}
    assert not exact["q0"].estimated
    assert (exact["q0"].completed, exact["q0"].discarded, exact["q0"].cancelled) == (
        5000, 2500, 2500)
    await db.execute("ANALYZE nasiko_queue_jobs")
    rough = {q.queue: q for q in await operator.queue_overview(db, exact_below=1000)}
    assert rough["q1"].estimated
    assert (rough["q1"].available, rough["fresh"].available) == (1, 1)  # exact
    for name, state in (("q0", "completed"), ("q1", "completed"), ("q1", "cancelled")):
        want = getattr(exact[name], state)
        assert abs(getattr(rough[name], state) - want) <= want * 0.1, (name, state)
    assert "builds" not in rough  # no build job: no row of zeros (issue #46)
    app = dashboard_app(db, token=None)
    async with await _client(app) as client:
        page = (await client.get("/")).text
    assert 'id="estimated"' not in page  # the page uses the default threshold: exact


def test_cli_actions_are_kept_in_the_timeline_as_cli(runner: CliRunner,  # noqa: F811
                                                     dsn: str) -> None:
    async def dead(db: Database) -> Any:
        queue = Queue(db, config=FAST)
        job_id = await queue.enqueue(Work(note="x"))
        assert await queue.cancel(job_id) == "cancelled"
        return job_id

    job_id = with_db(dsn, dead)
    assert invoke(runner, "jobs", "retry", str(job_id), "--dsn", dsn).exit_code == 0
    assert invoke(runner, "jobs", "cancel", str(job_id), "--dsn", dsn).exit_code == 0
    assert invoke(runner, "jobs", "discard", str(job_id), "--dsn", dsn).exit_code == 0

    async def events(db: Database) -> list[tuple[str, str]]:
        return [(e.action, e.actor) for e in await operator.job_events(db, job_id)]

    assert with_db(dsn, events) == [("retried", "cli"), ("cancelled", "cli"),
                                    ("discarded", "cli")]


async def test_retention_prunes_old_operator_actions(db: Database) -> None:
    old, recent = uuid.uuid4(), uuid.uuid4()
    async with db.transaction() as tx:
        await job_admin.record(tx, old, "retried", "cli")
        await job_admin.record(tx, recent, "retried", "cli")
    await db.execute("UPDATE nasiko_queue_job_events SET at = now() - interval '40 days' "
                     "WHERE job_id = $1", old)
    await prune(db, timedelta(days=30))
    assert await operator.job_events(db, old) == []
    assert len(await operator.job_events(db, recent)) == 1


async def test_the_overview_lists_builds_last_and_only_when_build_jobs_exist(
    db: Database, queue: Queue,
) -> None:
    from nasiko_queue.testing import enqueue_with_target

    await queue.enqueue(Work(note="plain"))
    assert [q.queue for q in await operator.queue_overview(db)] == ["work"]
    await enqueue_with_target(queue, "Upload")
    overview = await operator.queue_overview(db)
    assert [q.queue for q in overview] == ["work", "builds"]
    assert (overview[-1].available, overview[-1].oldest_available_age is not None) == (1, True)
    async with await _client(dashboard_app(db, token=None)) as client:
        page = (await client.get("/")).text
    assert 'data-queue="builds"' in page
    assert "not pausable" in page
