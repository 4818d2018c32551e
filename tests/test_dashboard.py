"""
The web dashboard (issue #12): pages, actions, the safety model, and pausing a
queue, against a real PostgreSQL and a real worker. The browser tests drive the
system's headless Chromium with Playwright's sync API on one thread of its own
(`_Browser`): Playwright's objects belong to the thread that made them, and a
one-thread executor keeps every call there while the trio test, the server and
the worker go on in the main thread. No wall-clock waits: the worker's counters
and Playwright's auto-waiting `expect` are the signals.
"""

from __future__ import annotations

import asyncio
import os
import shutil
from collections.abc import AsyncIterator, Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import attrs
import httpx
import pytest
import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve

from nasiko_queue import Executors, JobArgs, JobOptions, PlainJobContext, Queue, Secret
from nasiko_queue.admin.jobs import JobRefused, pause_queue, paused_queues, resume_queue
from nasiko_queue.web.dashboard import dashboard_app

from .conftest import FAST
from .helpers import TEST_DEADLINE, running

HOSTILE = "<script>alert(1)</script>"
ESCAPED = "&lt;script&gt;alert(1)&lt;/script&gt;"
TOKEN = "dash-token-1234"
T = TypeVar("T")
CHROMIUM = shutil.which("chromium")
needs_chromium = pytest.mark.skipif(
    CHROMIUM is None, reason="no `chromium` on PATH (apt-get install chromium; .ci/run does)")


@attrs.frozen(kw_only=True)
class Work(JobArgs):
    kind: ClassVar[str] = "work"
    options: ClassVar[JobOptions] = JobOptions(queue="work", max_attempts=1)
    note: str = ""
    credentials: Mapping[str, Secret] = attrs.field(factory=dict, hash=False,
                                                  metadata={"sealed": True})


@attrs.define
class Behaviour:
    """What the executor does: fail with a hostile message while `failing`."""

    failing: bool = True
    runs: int = 0
    gate: trio.Event | None = None

    def executors(self) -> Executors:
        executors = Executors()

        @executors.register(Work, backoff=lambda _attempt: 0.0)
        async def work(ctx: PlainJobContext[Work]) -> None:
            self.runs += 1
            if self.gate is not None:
                await self.gate.wait()
            if self.failing:
                raise RuntimeError(f"{HOSTILE} while doing {ctx.payload.note}")

        return executors


@pytest.fixture
def work_queue(queue: Queue) -> Queue:
    return Queue(queue.db, config=attrs.evolve(FAST, queues={"work": 1}, builds=False),
                 secrets=queue.secrets)


async def _client(app: Any) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test",
                             follow_redirects=False)


async def _login(client: httpx.AsyncClient) -> str:
    """Log in; returns the session's CSRF token (read off a page, as a browser would)."""
    r = await client.post("/login", data={"token": TOKEN, "next": "/"})
    assert r.status_code == 303
    assert "httponly" in r.headers["set-cookie"].lower()
    assert "samesite=strict" in r.headers["set-cookie"].lower()
    page = (await client.get("/")).text
    marker = 'name="csrf" value="'
    assert marker in page
    return page.split(marker, 1)[1].split('"', 1)[0]


async def _dead_job(work_queue: Queue, note: str = "x", **kw: Any) -> Any:
    behaviour = Behaviour()
    job_id = await work_queue.enqueue(Work(note=note, **kw))
    async with running(work_queue, behaviour.executors()) as worker:
        await worker.wait_for(lambda s: s.failed >= 1)
    return job_id


async def _state(queue: Queue, job_id: Any) -> str:
    return str(await queue.db.fetchval("SELECT state FROM nasiko_queue_jobs WHERE id = $1",
                                       job_id))


# -- without a browser ------------------------------------------------------------


async def test_actions_need_the_token_and_the_csrf_token(work_queue: Queue) -> None:
    job_id = await _dead_job(work_queue)
    app = dashboard_app(work_queue.db, token=TOKEN, config=work_queue.config)
    async with await _client(app) as client:
        # Not logged in: the pages show no action, and a POST is refused.
        page = (await client.get("/jobs?state=discarded")).text
        assert "/actions/retry" not in page
        assert "Log in for actions" in page
        r = await client.post("/actions/retry", data={"id": str(job_id)})
        assert r.status_code == 401
        # A wrong token logs nobody in.
        r = await client.post("/login", data={"token": "wrong"})
        assert r.status_code == 403
        assert "nq_session" not in r.headers.get("set-cookie", "")
        csrf = await _login(client)
        # Logged in, but without (or with a wrong) CSRF token: refused, nothing changes.
        for data in ({"id": str(job_id)}, {"id": str(job_id), "csrf": "forged"}):
            r = await client.post("/actions/retry", data=data)
            assert r.status_code == 403, r.text
            assert await _state(work_queue, job_id) == "discarded"
        r = await client.post("/actions/retry", data={"id": str(job_id), "csrf": csrf,
                                                      "next": "//evil.example/"})
        assert r.status_code == 303
        assert r.headers["location"].startswith("/?msg=")  # no open redirect
        assert await _state(work_queue, job_id) == "available"
    # The header, without a session (a script's way): accepted; a wrong one is not.
    async with await _client(app) as client:
        r = await client.post("/actions/cancel", data={"id": str(job_id)},
                              headers={"Authorization": "Bearer nope"})
        assert r.status_code == 401
        r = await client.post("/actions/cancel", data={"id": str(job_id)},
                              headers={"Authorization": f"Bearer {TOKEN}"})
        assert r.status_code == 303
        assert await _state(work_queue, job_id) == "cancelled"


async def test_read_only_shows_and_accepts_no_action(work_queue: Queue) -> None:
    job_id = await _dead_job(work_queue)
    for app in (dashboard_app(work_queue.db, token=TOKEN, read_only=True),
                dashboard_app(work_queue.db, token=None)):
        async with await _client(app) as client:
            for url in ("/", "/jobs?state=discarded", f"/jobs/{job_id}"):
                page = (await client.get(url)).text
                assert "/actions/" not in page
                assert "read-only" in page
            assert (await client.post("/login", data={"token": TOKEN})).status_code == 403
            for action in ("retry", "discard", "cancel"):
                r = await client.post(f"/actions/{action}", data={"id": str(job_id)},
                                      headers={"Authorization": f"Bearer {TOKEN}"})
                assert r.status_code == 403
            r = await client.post("/actions/pause", data={"queue": "work"},
                                  headers={"Authorization": f"Bearer {TOKEN}"})
            assert r.status_code == 403
    assert await _state(work_queue, job_id) == "discarded"
    assert await paused_queues(work_queue.db) == {}


async def test_hostile_names_and_messages_are_escaped_and_secrets_not_shown(
    work_queue: Queue,
) -> None:
    secret = "sk-live-very-secret-42"
    job_id = await _dead_job(work_queue, note=HOSTILE, credentials={"KEY": Secret(secret)})
    await work_queue.enqueue(Work(note="y"), options=JobOptions(queue=HOSTILE))
    await pause_queue(work_queue.db, HOSTILE)
    app = dashboard_app(work_queue.db, token=TOKEN, config=work_queue.config)
    async with await _client(app) as client:
        await _login(client)
        stored = await work_queue.db.fetchval(
            "SELECT payload::text FROM nasiko_queue_jobs WHERE id = $1", job_id)
        for url in ("/", "/jobs?state=any", "/jobs?state=discarded", f"/jobs/{job_id}",
                    "/jobs?" + httpx.QueryParams({"queue": HOSTILE, "state": "any"}).__str__(),
                    "/?" + httpx.QueryParams({"msg": HOSTILE, "error": HOSTILE}).__str__()):
            r = await client.get(url)
            assert r.status_code == 200, url
            assert HOSTILE not in r.text, url
            assert secret not in r.text
            assert stored.split('"KEY": "')[1][:20] not in r.text
            assert "default-src 'none'" in r.headers["content-security-policy"]
        page = (await client.get(f"/jobs/{job_id}")).text
        assert ESCAPED in page  # the error message, shown, escaped
        assert "********" in page  # the sealed credential, masked


async def test_a_paused_queue_is_not_claimed_and_its_running_jobs_still_finish(
    work_queue: Queue,
) -> None:
    db = work_queue.db
    with pytest.raises(JobRefused, match="builds"):
        await pause_queue(db, "builds")
    behaviour = Behaviour(failing=False, gate=trio.Event())
    first = await work_queue.enqueue(Work(note="running when paused"))
    async with running(work_queue, behaviour.executors()) as worker:
        await worker.wait_for(lambda s: s.running >= 1)
        await pause_queue(db, "work")
        await pause_queue(db, "work")  # idempotent
        second = await work_queue.enqueue(Work(note="enqueued while paused"))
        assert behaviour.gate is not None
        behaviour.gate.set()
        # The running job's finish (plain_finish_many_and_claim) completes while paused...
        await worker.wait_for(lambda s: s.done >= 1)
        assert await _state(work_queue, first) == "completed"
        # ...and the claims that follow, woken by the enqueue's NOTIFY and by the
        # polls, take nothing.
        drains = worker.stats.drains_completed
        await worker.wait_for(lambda s: s.drains_completed >= drains + 3)
        assert await _state(work_queue, second) == "available"
        assert worker.stats.claimed == 1
        assert await resume_queue(db, "work", work_queue.config)
        assert not await resume_queue(db, "work", work_queue.config)
        await worker.wait_for(lambda s: s.done >= 2)
    assert await _state(work_queue, second) == "completed"


# -- in a browser -----------------------------------------------------------------


class _Browser:
    """Playwright's sync API, every call on one thread of its own."""

    def __init__(self, shots: Path) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="playwright")
        self.shots = shots
        self.dialogs: list[str] = []

    async def do(self, fn: Callable[..., T], *args: Any) -> T:
        future = self._pool.submit(fn, *args)
        return await trio.to_thread.run_sync(future.result)

    def _open(self) -> Any:
        from playwright.sync_api import sync_playwright

        # trio_asyncio makes new_event_loop() build its own kind of loop, unless a
        # policy is set: per thread, so this thread gets plain asyncio.
        asyncio.set_event_loop_policy(asyncio.DefaultEventLoopPolicy())
        self._pw = sync_playwright().start()
        self._browser = self._pw.chromium.launch(executable_path=CHROMIUM, headless=True)
        page = self._browser.new_page(viewport={"width": 1200, "height": 800})
        page.on("dialog", lambda d: (self.dialogs.append(d.message), d.dismiss()))
        page.set_default_timeout(20_000)
        return page

    def _close(self) -> None:
        self._browser.close()
        self._pw.stop()

    @asynccontextmanager
    async def page(self) -> AsyncIterator[Any]:
        page = await self.do(self._open)
        try:
            yield page
        finally:
            await self.do(self._close)
            self._pool.shutdown()

    def shot(self, page: Any, name: str) -> None:
        page.screenshot(path=str(self.shots / f"{name}.png"), full_page=True)


@pytest.fixture
def shots(tmp_path: Path) -> Path:
    where = Path(os.environ.get("NASIKO_QUEUE_SCREENSHOTS") or tmp_path / "screenshots")
    where.mkdir(parents=True, exist_ok=True)
    return where


@asynccontextmanager
async def serving(app: Any) -> AsyncIterator[str]:
    """The app on hypercorn's trio worker, on an ephemeral port; its base URL."""
    config = HypercornConfig()
    config.bind = ["127.0.0.1:0"]
    config.accesslog = None
    config.graceful_timeout = 1.0
    shutdown = trio.Event()
    async with trio.open_nursery() as nursery:
        binds = await nursery.start(partial(serve, app, config,  # type: ignore[arg-type]
                                            shutdown_trigger=shutdown.wait))
        yield str(binds[0])
        shutdown.set()


def _login_in(page: Any, base: str) -> None:
    page.goto(base + "/login")
    page.fill("input[name=token]", TOKEN)
    page.click("button:text('Log in')")
    page.wait_for_url(base + "/")


@needs_chromium
async def test_browser_pages_filter_retry_and_cancel(work_queue: Queue, shots: Path) -> None:
    from playwright.sync_api import expect

    dead = await _dead_job(work_queue, note="the dead one")
    later = await work_queue.enqueue(Work(note="for later"), delay=3600)
    app = dashboard_app(work_queue.db, token=TOKEN, config=work_queue.config)
    browser = _Browser(shots)
    behaviour = Behaviour(failing=False)
    with trio.fail_after(TEST_DEADLINE * 2):
        async with serving(app) as base, browser.page() as page, \
                running(work_queue, behaviour.executors()) as worker:

            def pages() -> None:
                _login_in(page, base)
                row = page.locator("tr[data-queue=work]")
                expect(row.locator("td").nth(5)).to_have_text("1")  # one dead
                expect(page.locator("svg.chart rect.failed")).to_have_count(12)
                browser.shot(page, "overview")
                page.click("nav >> text=Dead letters")
                expect(page.locator(f"tr[data-job='{dead}'] td.error")).to_contain_text(
                    HOSTILE)  # shown as text: escaped
                browser.shot(page, "dead-letters")
                page.click(f"tr[data-job='{dead}'] a")
                expect(page.locator("h1")).to_contain_text(str(dead))
                expect(page.locator(".attempt")).to_have_count(1)
                # created, run at, attempted, the crash, finished.
                expect(page.locator(".timeline li")).to_have_count(5)
                expect(page.locator(".timeline")).to_contain_text("attempt 1 failed (crash)")
                browser.shot(page, "job")
                page.click("nav >> text=Workers")
                expect(page.locator("tr[data-worker]")).to_have_count(1)
                expect(page.locator("tr[data-worker]")).to_contain_text("alive")
                browser.shot(page, "workers")
                page.click("nav >> text=Schedules")
                expect(page.locator("h1")).to_have_text("Schedules")
                browser.shot(page, "schedules")
                # Filter: all jobs of queue "work" in any state, then only available.
                page.goto(base + "/jobs?state=any")
                page.fill("input[name=queue]", "work")
                page.click("button:text('Filter')")
                expect(page.locator("tr[data-job]")).to_have_count(2)
                page.select_option("select[name=state]", "available")
                page.click("button:text('Filter')")
                expect(page.locator("tr[data-job]")).to_have_count(1)
                expect(page.locator(f"tr[data-job='{later}']")).to_be_visible()
                browser.shot(page, "jobs")
                # Cancel the scheduled one.
                page.click(f"tr[data-job='{later}'] button:text('Cancel')")
                expect(page.locator("p.flash.ok")).to_have_text("1 job(s) cancelled")
                # Retry the dead one from its page.
                page.goto(f"{base}/jobs/{dead}")
                page.click("button:text('Retry')")
                expect(page.locator("p.flash.ok")).to_have_text("1 job(s) retried")

            await browser.do(pages)
            await worker.wait_for(lambda s: s.done >= 1)

            def after() -> None:
                page.goto(f"{base}/jobs/{dead}")
                expect(page.locator("dd.state .badge")).to_have_text("completed")

            await browser.do(after)
    assert await _state(work_queue, dead) == "completed"
    assert await _state(work_queue, later) == "cancelled"
    assert behaviour.runs == 1
    assert browser.dialogs == []  # no script of a job's ever ran
    assert set(await trio.to_thread.run_sync(os.listdir, shots)) >= {
        "overview.png", "dead-letters.png", "job.png", "workers.png", "schedules.png",
        "jobs.png"}


@needs_chromium
async def test_browser_pause_stops_claims_and_resume_runs_them(
    work_queue: Queue, shots: Path,
) -> None:
    from playwright.sync_api import expect

    app = dashboard_app(work_queue.db, token=TOKEN, config=work_queue.config)
    browser = _Browser(shots)
    behaviour = Behaviour(failing=False)
    await work_queue.enqueue(Work(note="first"))
    with trio.fail_after(TEST_DEADLINE * 2):
        async with serving(app) as base, browser.page() as page, \
                running(work_queue, behaviour.executors()) as worker:
            await worker.wait_for(lambda s: s.done >= 1)

            def pause() -> None:
                _login_in(page, base)
                page.click("tr[data-queue=work] button:text('Pause')")
                expect(page.locator("tr[data-queue=work] td.qstate")).to_contain_text("paused")
                expect(page.locator("tr[data-queue=builds] td.qstate")).to_have_text(
                    "not pausable")
                browser.shot(page, "paused")

            await browser.do(pause)
            job_id = await work_queue.enqueue(Work(note="while paused"))
            drains = worker.stats.drains_completed
            await worker.wait_for(lambda s: s.drains_completed >= drains + 3)
            assert await _state(work_queue, job_id) == "available"
            assert behaviour.runs == 1

            def resume() -> None:
                page.reload()
                expect(page.locator("tr[data-queue=work] td").nth(1)).to_have_text("1")
                page.click("tr[data-queue=work] button:text('Resume')")
                expect(page.locator("p.flash.ok")).to_have_text("queue work resumed")

            await browser.do(resume)
            await worker.wait_for(lambda s: s.done >= 2)
    assert await _state(work_queue, job_id) == "completed"
    assert behaviour.runs == 2
