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
import subprocess
import sys
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
from nasiko_queue.web.auth import HostCheck, LoginThrottle, Sessions
from nasiko_queue.web.dashboard import MAX_PAGE, dashboard_app

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


def _field(page: str, name: str) -> str:
    marker = f'name="{name}" value="'
    assert marker in page, name
    return page.split(marker, 1)[1].split('"', 1)[0]


async def _login_csrf(client: httpx.AsyncClient) -> str:
    """The login form's own CSRF value (its cookie is kept by the client)."""
    return _field((await client.get("/login")).text, "login_csrf")


async def _login(client: httpx.AsyncClient) -> str:
    """Log in; returns the session's CSRF token (read off a page, as a browser would)."""
    r = await client.post("/login", data={"token": TOKEN, "next": "/",
                                          "login_csrf": await _login_csrf(client)})
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


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def _dead_jobs(work_queue: Queue, n: int, queue_name: str = "work") -> list[Any]:
    behaviour = Behaviour()
    ids = [await work_queue.enqueue(Work(note=f"dead {i}"),
                                    options=JobOptions(queue=queue_name, max_attempts=1))
           for i in range(n)]
    async with running(work_queue, behaviour.executors()) as worker:
        await worker.wait_for(lambda s: s.failed >= n)
    return ids


async def test_sessions_expire_idle_and_absolute_and_their_store_is_bounded(
    work_queue: Queue,
) -> None:
    clock = FakeClock()
    sessions = Sessions(idle=60, lifetime=300, max_sessions=2, clock=clock)
    app = dashboard_app(work_queue.db, token=TOKEN, sessions=sessions)

    async def logged_in(client: httpx.AsyncClient) -> bool:
        return "/logout" in (await client.get("/")).text

    async with await _client(app) as client:
        await _login(client)
        assert await logged_in(client)
        # Idle: used every 50 s it lives on...
        for _ in range(4):
            clock.now += 50
            assert await logged_in(client)
        # ...until 300 s after the login, however busy (absolute).
        clock.now += 100
        assert not await logged_in(client)
        await _login(client)
        clock.now += 61  # idle for longer than 60 s
        assert not await logged_in(client)
        assert len(sessions) == 0
    # At most 2 sessions: a third login evicts the least recently used.
    clients = [await _client(app) for _ in range(3)]
    try:
        for c in clients[:2]:
            await _login(c)
        assert await logged_in(clients[0])  # now the second is the least recent
        await _login(clients[2])
        assert len(sessions) == 2
        assert [await logged_in(c) for c in clients] == [True, False, True]
    finally:
        for c in clients:
            await c.aclose()


async def test_a_pages_own_refresh_does_not_keep_its_session_alive(work_queue: Queue) -> None:
    """
    The pages reload themselves every few seconds; each reload counted as use,
    so an unattended tab kept its session alive until its 12-hour lifetime
    (found by a bug hunt). A reload without user activation (a navigation with
    no Sec-Fetch-User, as a meta refresh is) does not count now; a click does.
    """
    clock = FakeClock()
    sessions = Sessions(idle=60, lifetime=3600, clock=clock)
    app = dashboard_app(work_queue.db, token=TOKEN, sessions=sessions)
    refresh = {"sec-fetch-mode": "navigate", "sec-fetch-dest": "document"}
    click = {**refresh, "sec-fetch-user": "?1"}
    async with await _client(app) as client:
        await _login(client)
        for _ in range(2):
            clock.now += 50
            assert "/logout" in (await client.get("/", headers=click)).text
        clock.now += 50
        assert "/logout" in (await client.get("/", headers=refresh)).text
        clock.now += 50  # 100 s since the last click: the refreshes did not count
        assert "/logout" not in (await client.get("/", headers=refresh)).text


async def test_parallel_logins_cannot_pass_the_limit(work_queue: Queue) -> None:
    """
    The login checked the limit, then waited for the request's body, then
    counted a failure: every request already waiting had passed the check, so
    as many guesses went through as connections could be held open (found by a
    bug hunt). Eight wrong logins whose bodies arrive together: three are
    refused as wrong, the rest as throttled; then the right token is throttled
    too. (Which of the eight runs first is the scheduler's: all are wrong.)
    """
    throttle = LoginThrottle(max_failures=3, window=60, clock=FakeClock())
    app = dashboard_app(work_queue.db, token=TOKEN, throttle=throttle)
    count, every_one_waits, bodies = 8, trio.Event(), trio.Event()
    waiting: list[int] = []
    statuses: list[int] = []

    async def login(n: int) -> None:
        body = f"token=guess{n}&login_csrf=c".encode()
        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
                 "method": "POST", "scheme": "http", "path": "/login", "raw_path": b"/login",
                 "root_path": "", "query_string": b"", "server": ("test", 80),
                 "client": ("10.0.0.9", 1000 + n),
                 "headers": [(b"host", b"test"), (b"cookie", b"nq_login=c"),
                             (b"content-type", b"application/x-www-form-urlencoded"),
                             (b"content-length", str(len(body)).encode())]}

        async def receive() -> dict[str, Any]:
            waiting.append(n)
            if len(waiting) == count:
                every_one_waits.set()
            await bodies.wait()
            return {"type": "http.request", "body": body, "more_body": False}

        async def send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                statuses.append(message["status"])

        await app(scope, receive, send)

    with trio.fail_after(TEST_DEADLINE):
        async with trio.open_nursery() as nursery:
            for n in range(count):
                nursery.start_soon(login, n)
            await every_one_waits.wait()
            bodies.set()
    assert sorted(statuses) == [403] * 3 + [429] * 5
    same_address = httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app, client=("10.0.0.9", 2000)),
        base_url="http://test")
    async with same_address as client:
        r = await client.post("/login", data={"token": TOKEN,
                                              "login_csrf": await _login_csrf(client)})
        assert r.status_code == 429


async def test_another_sites_page_cannot_spend_the_login_limit(work_queue: Queue) -> None:
    """An <img> on any site pointing at /login?token=x counted as a failed login,
    and six of them locked the operator out for a minute (found by a bug hunt)."""
    throttle = LoginThrottle(max_failures=3, window=60, clock=FakeClock())
    app = dashboard_app(work_queue.db, token=TOKEN, throttle=throttle)
    async with await _client(app) as client:
        for _ in range(6):
            r = await client.get("/login?token=x", headers={"sec-fetch-site": "cross-site"})
            assert r.status_code == 200  # the login form, nothing counted
        r = await client.get(f"/login?token={TOKEN}")
        assert r.status_code == 303


@pytest.mark.parametrize("target", ["/\t/evil.example/phish", "/\n/evil.example",
                                    "/\r\n/evil.example", "/ /evil.example",
                                    "//evil.example", "/\\evil.example", "https://evil.example"])
async def test_a_back_link_never_leaves_the_site(work_queue: Queue, target: str) -> None:
    """`/\t/evil.example` passed the local-path check, and browsers drop the tab:
    the confirmation page's Back link went to another site (found by a bug hunt)."""
    from nasiko_queue.web.auth import local_path

    assert local_path(target) == "/"
    assert local_path("/jobs?state=discarded&queue=work") == "/jobs?state=discarded&queue=work"
    app = dashboard_app(work_queue.db, token=TOKEN)
    async with await _client(app) as client:
        await _login(client)
        r = await client.get("/confirm/discard-matching", params={"next": target})
        assert "evil.example" not in r.text


async def test_a_search_nested_too_deeply_is_refused_not_a_crash(work_queue: Queue) -> None:
    app = dashboard_app(work_queue.db, token=None)
    async with await _client(app) as client:
        r = await client.get("/search", params={"args": '{"a":' + "[" * 1000 + "]" * 1000 + "}"})
    assert (r.status_code, "arguments: nested too deeply" in r.text) == (400, True)


def test_a_dual_stack_bind_answers_its_ipv4_clients() -> None:
    """Bound to ::, the server reports an IPv4 client's connection as arriving on
    ::ffff:127.0.0.1, which never matched the Host 127.0.0.1: every IPv4 client
    got 421 (found by a bug hunt)."""
    check = HostCheck(app=None, allowed=())  # type: ignore[arg-type]

    def scope(host: str, server: str) -> Any:
        return {"type": "http", "scheme": "http", "server": (server, 9182),
                "headers": [(b"host", host.encode())]}

    assert check.ok(scope("127.0.0.1:9182", "::ffff:127.0.0.1"))
    assert check.ok(scope("localhost:9182", "::ffff:127.0.0.1"))
    assert check.ok(scope("192.0.2.2:9182", "::ffff:192.0.2.2"))
    assert not check.ok(scope("evil.example:9182", "::ffff:127.0.0.1"))
    assert check.ok(scope("[::1]:9182", "::1"))


async def test_the_login_form_has_its_own_csrf_token(work_queue: Queue) -> None:
    app = dashboard_app(work_queue.db, token=TOKEN)
    async with await _client(app) as client, await _client(app) as other:
        # The right token without the form's CSRF value (a forged cross-site form,
        # "login CSRF"), or with another browser's value: refused, no session.
        for data in ({"token": TOKEN}, {"token": TOKEN, "login_csrf": "forged"},
                     {"token": TOKEN, "login_csrf": await _login_csrf(other)}):
            r = await client.post("/login", data=data)
            assert r.status_code == 403, data
            assert "nq_session" not in r.headers.get("set-cookie", "")
            assert "the login form expired" in r.text
        r = await client.get("/login")
        assert "samesite=strict" in r.headers["set-cookie"].lower()
        assert "httponly" in r.headers["set-cookie"].lower()
        await _login(client)


async def test_failed_logins_are_throttled_per_address(work_queue: Queue) -> None:
    clock = FakeClock()
    throttle = LoginThrottle(max_failures=3, window=60, clock=clock)
    app = dashboard_app(work_queue.db, token=TOKEN, throttle=throttle)
    async with await _client(app) as client:
        for _ in range(3):
            r = await client.post("/login", data={"token": "guess",
                                                  "login_csrf": await _login_csrf(client)})
            assert r.status_code == 403
        # Throttled: the right token too, the login URL and the Bearer header.
        r = await client.post("/login", data={"token": TOKEN,
                                              "login_csrf": await _login_csrf(client)})
        assert r.status_code == 429
        assert "too many failed logins" in r.text
        assert int(r.headers["retry-after"]) == 61
        assert (await client.get(f"/login?token={TOKEN}")).status_code == 429
        r = await client.post("/actions/pause", data={"queue": "work"},
                              headers={"Authorization": f"Bearer {TOKEN}"})
        assert r.status_code == 429
        assert await paused_queues(work_queue.db) == {}
        # Another address is not throttled.
        other = httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app, client=("10.0.0.2", 1234)),
            base_url="http://test")
        async with other:
            await _login(other)
        # Once the window is over, the right token logs in.
        clock.now += 61
        await _login(client)
    # Wrong Bearer tokens count as failed logins too.
    clock.now += 61
    async with await _client(app) as client:
        for expected in (401, 401, 401, 429):
            r = await client.post("/actions/pause", data={"queue": "work"},
                                  headers={"Authorization": "Bearer guess"})
            assert r.status_code == expected


async def test_a_host_that_is_not_the_bound_address_is_refused(work_queue: Queue) -> None:
    app = dashboard_app(work_queue.db, token=TOKEN, allowed_hosts=["queue.example.com"])
    async with await _client(app) as client:
        assert (await client.get("/")).status_code == 200  # Host: test, as it arrived
        for host in ("evil.example", "evil.example:80", "test:8080", "queue.example.com.evil",
                     "", "[::1"):
            r = await client.get("/", headers={"Host": host})
            assert r.status_code == 421, host
            assert "misdirected request" in r.text
            assert r.headers["content-type"].startswith("text/plain")
        for host in ("queue.example.com", "QUEUE.example.com:8443"):
            assert (await client.get("/", headers={"Host": host})).status_code == 200
        r = await client.post("/login", headers={"Host": "evil.example"},
                              data={"token": TOKEN})
        assert r.status_code == 421


def _asgi_scope(host: str, server: tuple[str, int | None]) -> dict[str, Any]:
    return {"type": "http", "scheme": "http", "server": server,
            "headers": [(b"host", host.encode())]}


def test_host_check_on_loopback_ipv6_and_configured_ports() -> None:
    check = HostCheck(app=None, allowed=("proxy.example:8443",))  # type: ignore[arg-type]
    ok = [("127.0.0.1:9182", ("127.0.0.1", 9182)), ("localhost:9182", ("127.0.0.1", 9182)),
          ("[::1]:9182", ("::1", 9182)), ("localhost:9182", ("::1", 9182)),
          ("10.1.2.3:9182", ("10.1.2.3", 9182)), ("proxy.example:8443", ("10.1.2.3", 9182))]
    bad = [("localhost:9182", ("10.1.2.3", 9182)), ("127.0.0.1:9183", ("127.0.0.1", 9182)),
           ("proxy.example", ("10.1.2.3", 9182)), ("attacker.test:9182", ("127.0.0.1", 9182))]
    for host, server in ok:
        assert check.ok(_asgi_scope(host, server)), (host, server)
    for host, server in bad:
        assert not check.ok(_asgi_scope(host, server)), (host, server)
    with pytest.raises(ValueError, match="not a host name"):
        HostCheck(app=None, allowed=("bad host:x",))  # type: ignore[arg-type]


async def test_a_listing_page_is_bounded(work_queue: Queue) -> None:
    await work_queue.enqueue_many([Work(note=str(i)) for i in range(MAX_PAGE + 20)])
    app = dashboard_app(work_queue.db, token=TOKEN)
    async with await _client(app) as client:
        r = await client.get("/jobs?state=any&limit=100000000")
        assert r.status_code == 200
        assert r.text.count("<tr data-job=") == MAX_PAGE
        assert f"A page shows at most {MAX_PAGE} jobs" in r.text
        nxt = r.text.split('rel="next" href="', 1)[1].split('"', 1)[0].replace("&amp;", "&")
        r = await client.get(nxt)
        assert r.text.count("<tr data-job=") == 20
        r = await client.get("/jobs?state=any&limit=7")
        assert r.text.count("<tr data-job=") == 7
        assert "A page shows at most" not in r.text
        for bad in ("0", "-1", "abc", "1e9", "9" * 40):
            assert (await client.get(f"/jobs?state=any&limit={bad}")).status_code == 400, bad
        r = await client.get("/jobs?" + str(httpx.QueryParams({"queue": "q" * 201})))
        assert r.status_code == 400



async def test_a_value_the_database_refuses_is_a_400_not_a_500(work_queue: Queue) -> None:
    """A NUL character in any text a page or an action sends to the database, a
    number out of its range: PostgreSQL refuses them (SQLSTATE class 22), and
    the error used to leave the app (a 500 from the server, a traceback in the
    log), for anyone who could reach a page. Found by a bug hunt."""
    app = dashboard_app(work_queue.db, token=TOKEN, config=work_queue.config)
    async with await _client(app) as client:
        csrf = await _login(client)
        for url in ("/jobs?queue=%00", "/runs?workflow=%00", "/scheduled?queue=%00",
                    "/search?kind=%00", "/confirm/discard-matching?queue=%00",
                    "/search?args=" + str(httpx.QueryParams({"a": '{"a": "\\u0000"}'}))[2:]):
            r = await client.get(url)
            assert r.status_code == 400, (url, r.status_code)
            assert "the database refused a value" in r.text, url
        for action in ("pause", "limit-clear", "retry-matching"):
            r = await client.post(f"/actions/{action}", data={"csrf": csrf, "queue": "a\x00"})
            assert r.status_code == 400, (action, r.status_code)
        r = await client.get("/jobs?state=any")
        assert r.status_code == 200  # the dashboard goes on

async def test_bulk_discard_needs_its_confirmation_which_gives_the_count(
    work_queue: Queue,
) -> None:
    ids = await _dead_jobs(work_queue, 3)
    app = dashboard_app(work_queue.db, token=TOKEN, config=work_queue.config)
    async with await _client(app) as client:
        csrf = await _login(client)
        page = (await client.get("/jobs?state=discarded")).text
        assert "/actions/discard-matching" not in page  # no one-click "Discard all"
        assert 'action="/confirm/discard-matching"' in page
        # Without the confirmation field: refused, nothing deleted.
        r = await client.post("/actions/discard-matching", data={"csrf": csrf})
        assert r.status_code == 400
        assert "needs its confirmation" in r.text
        r = await client.post("/actions/discard",
                              data={"csrf": csrf, "id": [str(i) for i in ids[:2]]})
        assert r.status_code == 400
        assert [await _state(work_queue, i) for i in ids] == ["discarded"] * 3
        # The confirmation pages say how many.
        r = await client.get("/confirm/discard-matching?queue=work")
        assert "Discard 3 dead job(s) of queue work?" in r.text
        assert _field(r.text, "confirm") == "yes"
        r = await client.post("/confirm/discard",
                              data={"csrf": csrf, "id": [str(i) for i in ids[:2]]})
        assert "Discard 2 selected job(s)?" in r.text
        # Confirmed: done.
        r = await client.post("/actions/discard", data={
            "csrf": csrf, "id": [str(i) for i in ids[:2]], "confirm": "yes"})
        assert r.status_code == 303
        assert "2+job%28s%29+discarded" in r.headers["location"]
        r = await client.post("/actions/discard-matching",
                              data={"csrf": csrf, "queue": "work", "confirm": "yes"})
        assert "1+job%28s%29+discarded" in r.headers["location"]
        # One job's own Discard button stays one click.
        assert (await client.get("/confirm/discard-matching")).text.count("Discard 0") == 1


REPO = Path(__file__).resolve().parent.parent


def _read(path: Path) -> str:
    return path.read_text()


async def _dashboard_process(dsn: str, out: Path, env: dict[str, str],
                             *flags: str) -> tuple[trio.Process, str]:
    """`nasiko-queue dashboard` on a free port; the process and what it printed first."""
    with out.open("wb") as sink:
        proc = await trio.lowlevel.open_process(
            [sys.executable, "-m", "nasiko_queue", "dashboard", "--dsn", dsn,
             "--bind", "127.0.0.1:0", *flags],
            cwd=REPO, stdin=subprocess.DEVNULL,
            stdout=sink, stderr=sink, env={**os.environ, **env})
    with trio.move_on_after(TEST_DEADLINE):
        while "dashboard on http://" not in _read(out):
            assert proc.returncode is None, _read(out)
            await trio.sleep(0.05)
        await trio.sleep(0.2)  # the login line follows the first at once
        return proc, _read(out)
    proc.kill()
    pytest.fail(f"the dashboard did not start: {_read(out)}")


async def _stop(proc: trio.Process) -> None:
    proc.terminate()
    with trio.move_on_after(10):
        await proc.wait()
    if proc.returncode is None:
        proc.kill()


async def test_the_dashboard_command_prints_a_one_time_login_url(
    dsn: str, tmp_path: Path,
) -> None:
    env = {"NASIKO_QUEUE_DASHBOARD_TOKEN": ""}
    proc, printed = await _dashboard_process(dsn, tmp_path / "out.log", env)
    try:
        url = printed.split("log in at ", 1)[1].split()[0]
        assert url.startswith("http://127.0.0.1:")
        assert "/login?token=" in url
        token = url.split("token=", 1)[1]
        assert len(token) >= 32
        assert printed.count(token) == 1  # shown once, nowhere else
        cmdline = _read(Path(f"/proc/{proc.pid}/cmdline"))
        assert token not in cmdline  # not in `ps`
        base = url.split("/login", 1)[0]
        async with httpx.AsyncClient(base_url=base, timeout=10) as client:
            assert "/logout" not in (await client.get("/")).text
            r = await client.get(url)
            assert r.status_code == 303
            assert r.headers["location"] == "/"  # the token gone from the address bar
            cookie = r.headers["set-cookie"].lower()
            assert "httponly" in cookie
            assert "samesite=strict" in cookie
            assert "secure" not in cookie  # plain http here
            assert "/logout" in (await client.get("/")).text
    finally:
        await _stop(proc)
    # A token from the environment: no URL, the token printed nowhere.
    chosen = "chosen-token-5678"
    proc, printed = await _dashboard_process(
        dsn, tmp_path / "out2.log", {"NASIKO_QUEUE_DASHBOARD_TOKEN": chosen})
    try:
        assert "log in at" not in printed
        assert chosen not in printed
        base = printed.split("dashboard on ", 1)[1].split()[0].rstrip("/")
        async with httpx.AsyncClient(base_url=base, timeout=10) as client:
            r = await client.get(f"/login?token={chosen}")
            assert r.status_code == 303
            # The Host check on the real server: another name for the same address.
            r = await client.get("/", headers={"Host": "rebound.example:80"})
            assert r.status_code == 421
    finally:
        await _stop(proc)
    assert chosen not in _read(tmp_path / "out2.log")


# -- in a browser -----------------------------------------------------------------


class _Browser:
    """Playwright's sync API, every call on one thread of its own."""

    def __init__(self, shots: Path, args: tuple[str, ...] = ()) -> None:
        self.args = list(args)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="playwright")
        self.shots = shots
        self.dialogs: list[str] = []

    async def do(self, fn: Callable[..., T], *args: Any) -> T:
        future = self._pool.submit(fn, *args)
        return await trio.to_thread.run_sync(future.result)

    def _open(self) -> Any:
        from playwright.sync_api import sync_playwright

        # Playwright's sync API runs a plain asyncio loop in this thread: named by
        # the policy, whatever an earlier test in the process set.
        asyncio.set_event_loop_policy(asyncio.DefaultEventLoopPolicy())
        self._pw = sync_playwright().start()
        self._browser = self._pw.chromium.launch(executable_path=CHROMIUM, headless=True,
                                                 args=self.args)
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
                # No build job exists: no "builds" row (issue #46).
                expect(page.locator("tr[data-queue=builds]")).to_have_count(0)
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


@needs_chromium
async def test_browser_login_url_host_check_and_page_bound(
    work_queue: Queue, shots: Path,
) -> None:
    from playwright.sync_api import expect

    await work_queue.enqueue_many([Work(note=str(i)) for i in range(MAX_PAGE + 20)])
    app = dashboard_app(work_queue.db, token=TOKEN, config=work_queue.config)
    # A DNS-rebinding attacker's name that resolves to the dashboard's address.
    browser = _Browser(shots, args=("--host-resolver-rules=MAP rebound.test 127.0.0.1",))
    with trio.fail_after(TEST_DEADLINE * 2):
        async with serving(app) as base, browser.page() as page:
            port = base.rsplit(":", 1)[1]

            def flow() -> None:
                page.goto(base + "/")
                expect(page.locator("header .session")).to_contain_text("Log in for actions")
                # The login URL logs in and drops the token from the address bar.
                page.goto(f"{base}/login?token={TOKEN}")
                page.wait_for_url(base + "/")
                assert TOKEN not in page.url
                expect(page.locator("header button:text('Log out')")).to_be_visible()
                cookie, = (c for c in page.context.cookies() if c["name"] == "nq_session")
                assert cookie["httpOnly"]
                assert cookie["sameSite"] == "Strict"
                assert not cookie["secure"]  # plain http here
                # Whatever ?limit= asks, a page shows at most MAX_PAGE rows.
                page.goto(base + "/jobs?state=any&limit=100000000")
                expect(page.locator("tr[data-job]")).to_have_count(MAX_PAGE)
                expect(page.locator("p.capped")).to_contain_text(
                    f"A page shows at most {MAX_PAGE} jobs")
                page.click("a[rel=next]")
                expect(page.locator("tr[data-job]")).to_have_count(20)
                # The same server under another name: refused.
                response = page.goto(f"http://rebound.test:{port}/jobs?state=any")
                assert response is not None
                assert response.status == 421
                expect(page.locator("body")).to_contain_text("misdirected request")
                browser.shot(page, "host-refused")

            await browser.do(flow)


@needs_chromium
async def test_browser_failed_logins_are_throttled(work_queue: Queue, shots: Path) -> None:
    from playwright.sync_api import expect

    clock = FakeClock()
    app = dashboard_app(work_queue.db, token=TOKEN, config=work_queue.config,
                        throttle=LoginThrottle(max_failures=3, window=60, clock=clock))
    browser = _Browser(shots)
    with trio.fail_after(TEST_DEADLINE * 2):
        async with serving(app) as base, browser.page() as page:

            def guesses() -> None:
                page.goto(base + "/login")
                for _ in range(3):
                    page.fill("input[name=token]", "a guess")
                    page.click("button:text('Log in')")
                    expect(page.locator("p.flash.bad")).to_have_text("wrong token")
                page.fill("input[name=token]", TOKEN)  # right, but too late
                page.click("button:text('Log in')")
                expect(page.locator("body")).to_contain_text(
                    "too many failed logins from this address (3 in 60 s): try again in 60 s")
                browser.shot(page, "login-throttled")

            await browser.do(guesses)
            clock.now += 61
            await browser.do(_login_in, page, base)


@needs_chromium
async def test_browser_confirm_then_discard(work_queue: Queue, shots: Path) -> None:
    from playwright.sync_api import expect

    ids = await _dead_jobs(work_queue, 3)
    app = dashboard_app(work_queue.db, token=TOKEN, config=work_queue.config)
    browser = _Browser(shots)
    with trio.fail_after(TEST_DEADLINE * 2):
        async with serving(app) as base, browser.page() as page:

            def selected_then_cancelled() -> None:
                _login_in(page, base)
                page.goto(base + "/jobs?state=discarded")
                for job_id in ids[:2]:
                    page.check(f"tr[data-job='{job_id}'] input[type=checkbox]")
                page.click("button:text('Discard selected…')")
                expect(page.locator("h1")).to_have_text("Discard 2 selected job(s)?")
                page.click("form.confirm a:text('Cancel')")
                expect(page.locator("tr[data-job]")).to_have_count(3)

            await browser.do(selected_then_cancelled)
            assert [await _state(work_queue, i) for i in ids] == ["discarded"] * 3

            def discard_all() -> None:
                page.click("button:text('Discard all…')")
                expect(page.locator("h1")).to_have_text("Discard 3 dead job(s)?")
                expect(page.locator(".confirm-count")).to_contain_text("deletes 3 dead job(s)")
                browser.shot(page, "confirm-discard")
                page.click("button:text('Discard 3')")
                expect(page.locator("p.flash.ok")).to_have_text("3 job(s) discarded")
                expect(page.locator("tr[data-job]")).to_have_count(0)

            await browser.do(discard_all)
    assert await work_queue.db.fetchval(
        "SELECT count(*) FROM nasiko_queue_jobs WHERE id = ANY($1::uuid[])", ids) == 0
