"""
The web dashboard (`nasiko-queue dashboard`): queues, jobs, dead letters,
workers, schedules and workflow runs, server-rendered (Starlette and Jinja2, autoescaped; no
JavaScript needed), with retry, cancel, discard and pause/resume as POSTed
forms.

Safety model:

- a request whose `Host` is not the address it arrived on nor a name in
  `allowed_hosts` is refused (421; DNS rebinding, see `.auth.HostCheck`);
- every page is readable by whoever reaches the bind address (127.0.0.1 by
  default); payload secrets are masked (`admin.view.mask_payload`) before a
  template sees them; a listing shows at most `MAX_PAGE` rows;
- an action needs the token: a session from the login form or the login URL
  (``/login?token=...``; an HttpOnly, SameSite=Strict cookie, Secure over https,
  naming a random server-side session that expires, `.auth.Sessions`) or an
  ``Authorization: Bearer`` header, and, for a session, the session's CSRF token
  in the form's hidden field. The login form has a CSRF token of its own (a
  cookie and a hidden field that must match); failed logins are throttled per
  client address (429, `.auth.LoginThrottle`);
- discarding every dead job of a filter, or several selected jobs, and
  cancelling a workflow run take a confirmation page that says how many jobs
  it touches; the POST that does it is refused without that page's `confirm`
  field;
- `read_only` (and a dashboard started without a token) shows no actions and
  refuses every POST but the login.

Needs the [http] extra; importing it without raises an ImportError naming it.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Awaitable, Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlencode
from uuid import UUID

try:
    import jinja2
    from starlette.applications import Starlette
    from starlette.middleware import Middleware
    from starlette.requests import Request
    from starlette.responses import PlainTextResponse, RedirectResponse, Response
    from starlette.routing import Mount, Route
    from starlette.staticfiles import StaticFiles
    from starlette.templating import Jinja2Templates
except ImportError as exc:  # pragma: no cover - exercised without the extra only
    raise ImportError(
        "the dashboard needs the [http] extra: pip install 'nasiko-queue[http]' "
        f"({exc})") from exc

import asyncpg
import attrs

from ..admin import jobs as job_admin
from ..admin.jobs import JobFilter, JobNotFound, JobRefused
from ..admin.operator import job_events, queue_overview
from ..admin.runs import RunNotFound, RunRefused
from ..admin.status import list_workers
from ..admin.view import job_view
from ..config import QueueConfig
from ..db.database import Database
from ..db.statements import Q
from ..plain.schedules import Schedule
from .auth import HostCheck, LoginThrottle, Session, Sessions, local_path, same_secret
from .limits_page import limits_routes
from .pages import operator_routes, queue_health, refresh_context
from .run_pages import run_routes

_HERE = Path(__file__).resolve().parent
SESSION_COOKIE = "nq_session"
#: The login form's CSRF cookie (its value is also the form's hidden field).
LOGIN_COOKIE = "nq_login"
#: The most rows a listing shows on one page, whatever `?limit=` asks.
MAX_PAGE = 500
#: The longest a listing's text filter (queue, kind) may be.
MAX_FILTER_CHARS = 200
#: Throughput chart: 12 bars of 5 minutes.
BUCKETS = 12
_Handler = Callable[[Request], Awaitable[Response]]


@attrs.define
class _Dashboard:
    db: Database
    token: str | None
    read_only: bool
    config: QueueConfig
    schedules: Sequence[Schedule]
    templates: Jinja2Templates
    sessions: Sessions
    throttle: LoginThrottle

    @property
    def actions(self) -> bool:
        """Whether actions exist at all (a token is set and not read-only)."""
        return not self.read_only and self.token is not None

    def session(self, request: Request, *, touch: bool = True) -> Session | None:
        return self.sessions.get(request.cookies.get(SESSION_COOKIE), touch=touch)

    def token_ok(self, given: str) -> bool:
        return self.token is not None and same_secret(given, self.token)

    def bearer(self, request: Request) -> str | None:
        """The ``Authorization: Bearer`` token, if the request sends one."""
        scheme, _, value = request.headers.get("authorization", "").partition(" ")
        return value.strip() if scheme.lower() == "bearer" else None

    def render(self, request: Request, name: str, status: int = 200,
               **context: Any) -> Response:
        session = self.session(request, touch=not _self_refresh(request))
        context.update(
            actions=self.actions and session is not None,
            can_login=self.actions and session is None,
            read_only=self.read_only, no_token=self.token is None,
            csrf=session.csrf if session else "",
            msg=request.query_params.get("msg"),
            error=request.query_params.get("error"),
            path=request.url.path, query=str(request.url.query))
        response = self.templates.TemplateResponse(request, name, context, status_code=status)
        response.headers["Content-Security-Policy"] = (
            "default-src 'none'; style-src 'self'; img-src 'self' data:; "
            "form-action 'self'; frame-ancestors 'none'; base-uri 'none'")
        response.headers["X-Content-Type-Options"] = "nosniff"
        response.headers["Referrer-Policy"] = "same-origin"
        return response


class Unconfirmed(ValueError):
    """A destructive bulk action POSTed without its confirmation page's field."""


def _confirmed(form: Any, what: str) -> None:
    if form.get("confirm") != "yes":
        raise Unconfirmed(f"{what} needs its confirmation (the form field confirm=yes, "
                          "which the confirmation page sends, after showing the count)")


def _back(form: Any, default: str = "/") -> str:
    """The page to go back to after an action: a local path only (no open redirect)."""
    return local_path(str(form.get("next") or "") or None, default)


def _redirect(target: str, **params: str) -> RedirectResponse:
    sep = "&" if "?" in target else "?"
    return RedirectResponse(target + (sep + urlencode(params) if params else ""), 303)


def _self_refresh(request: Request) -> bool:
    """
    Whether a browser loads this page by itself, not for its user: a navigation
    without user activation (no ``Sec-Fetch-User``), as the pages' own refresh
    every few seconds is. That is not use of the session: an unattended tab
    would keep its session alive until its lifetime ends.
    """
    headers = request.headers
    return (request.method == "GET" and headers.get("sec-fetch-mode") == "navigate"
            and "sec-fetch-user" not in headers)


def cross_site(request: Request) -> bool:
    """Whether a browser says another site's page sent this request."""
    return request.headers.get("sec-fetch-site") == "cross-site"


def _client(request: Request) -> str:
    return request.client.host if request.client else "unknown"


def dashboard_app(db: Database, *, token: str | None, read_only: bool = False,
                  config: QueueConfig | None = None,
                  schedules: Sequence[Schedule] = (),
                  allowed_hosts: Sequence[str] = (),
                  sessions: Sessions | None = None,
                  throttle: LoginThrottle | None = None) -> Starlette:
    """
    The dashboard as an ASGI application on `db` (an open `Database`).

    Args:
        token: what the login form and the ``Authorization: Bearer`` header must
            give for an action; None makes the dashboard read-only.
        read_only: show no actions and refuse every one.
        config: whose `notify_channel` wakes workers after a retry or resume.
        schedules: the application's `Schedule` list, to show each one's cron
            expression and next run (without it, only their last ticks).
        allowed_hosts: names (or name:port) the `Host` header may give besides
            the address a request arrives on (a reverse proxy's name).
        sessions: the session store (its timeouts and bound); the defaults of
            `Sessions` if None.
        throttle: failed-login throttle; the defaults of `LoginThrottle` if None.
    """
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(_HERE / "templates"),
        autoescape=True, undefined=jinja2.StrictUndefined)
    env.filters["ago"] = _ago
    env.filters["ts"] = _ts
    dash = _Dashboard(db=db, token=token, read_only=read_only,
                      config=config or QueueConfig(), schedules=tuple(schedules),
                      templates=Jinja2Templates(env=env),
                      sessions=Sessions() if sessions is None else sessions,
                      throttle=LoginThrottle() if throttle is None else throttle)

    async def overview(request: Request) -> Response:
        # Exact counts of unfinished jobs; ended ones estimated on a big table
        # (admin.operator.queue_overview): no scan of the history per view.
        paused = await job_admin.paused_queues(db)
        health = await queue_health(db)
        queues: list[dict[str, Any]] = []
        for q in await queue_overview(db, also=tuple(paused)):
            done_1m, done_5m = health["throughput"].get(q.queue, (0, 0))
            queues.append({
                "name": q.queue, "available": q.available, "scheduled": q.scheduled,
                "running": q.running, "completed": q.completed, "discarded": q.discarded,
                "cancelled": q.cancelled, "paused": paused.get(q.queue),
                "pausable": q.queue != job_admin.BUILDS_QUEUE, "estimated": q.estimated,
                "oldest": q.oldest_available_age, "done_1m": done_1m, "done_5m": done_5m,
                "unserved": health["unserved"].get(q.queue)})
        return dash.render(request, "overview.html", queues=queues,
                           unserved=list(health["unserved"].values()),
                           unserved_kinds=health["unserved_kinds"],
                           chart=await _throughput(db), **refresh_context(request))

    async def jobs(request: Request) -> Response:
        params = request.query_params
        state = params.get("state", "discarded")
        try:
            asked = page_limit(params.get("limit"))
            where = JobFilter(queue=_text_filter(params, "queue"),
                              kind=_text_filter(params, "kind"),
                              state=None if state == "any" else state or None,
                              limit=min(asked, MAX_PAGE))
            page = await job_admin.list_jobs(db, where, after=params.get("after") or None)
        except ValueError as exc:
            return dash.render(request, "error.html", status=400, message=str(exc))
        nxt = None
        if len(page) == where.limit:
            nxt = urlencode({**{k: v for k, v in params.items() if k != "after"},
                             "after": page[-1].cursor})
        return dash.render(request, "jobs.html", jobs=page, where=where,
                           state=state, next_query=nxt, states=job_admin.STATES,
                           dead=where.state == "discarded",
                           capped=MAX_PAGE if asked > MAX_PAGE else None)

    async def job(request: Request) -> Response:
        try:
            job_id = UUID(request.path_params["job_id"])
        except ValueError:
            return dash.render(request, "error.html", status=404, message="no such job")
        view = await job_view(db, job_id)
        if view is None:
            return dash.render(request, "error.html", status=404,
                               message=f"no job {job_id}")
        timeline = [(label, at) for label, at in (
            ("created", view.created_at), ("run at", view.run_at),
            ("attempted", view.picked_at), ("finished", view.completed_at),
            ("target deleted", view.deleted_at)) if at is not None]
        timeline += [(f"attempt {e.attempt} failed ({e.reason})", e.at)
                     for e in view.errors if e.at is not None]
        timeline += [(f"{e.action} by {e.actor}" + (f" ({e.detail})" if e.detail else ""),
                      e.at) for e in await job_events(db, job_id)]
        timeline.sort(key=lambda t: t[1])
        return dash.render(request, "job.html", job=view, timeline=timeline,
                           payload=json.dumps(view.payload, indent=2, sort_keys=True,
                                              default=str),
                           result=None if view.result is None else json.dumps(
                               view.result, indent=2, sort_keys=True, default=str))

    async def workers(request: Request) -> Response:
        return dash.render(request, "workers.html", workers=await list_workers(db),
                           **refresh_context(request))

    async def schedules_page(request: Request) -> Response:
        rows = {r["name"]: r for r in await db.fetch(Q.schedule_list)}
        now = datetime.now(UTC)
        items = []
        for s in dash.schedules:
            row = rows.pop(s.name, None)
            items.append({"name": s.name, "cron": s.cron, "timezone": s.timezone,
                              "last_tick": row["last_tick"] if row else None,
                              "next_run": s.next_tick(now), "recorded": row is not None,
                              "paused": row["paused_at"] if row else None, "runnable": True})
        items += [{"name": name, "cron": None, "timezone": None, "last_tick": r["last_tick"],
                       "next_run": None, "recorded": True, "paused": r["paused_at"],
                       "runnable": False} for name, r in rows.items()]
        return dash.render(request, "schedules.html", schedules=items,
                           known=bool(dash.schedules), **refresh_context(request))

    def throttled(request: Request) -> Response | None:
        wait = dash.throttle.retry_after(_client(request))
        if wait is None:
            return None
        return PlainTextResponse(dash.throttle.message(wait), 429,
                                 headers={"Retry-After": str(int(wait) + 1)})

    def logged_in(request: Request, target: str) -> Response:
        sid, _session = dash.sessions.new()
        response = _redirect(target)
        response.set_cookie(SESSION_COOKIE, sid, httponly=True, samesite="strict",
                            secure=request.url.scheme == "https", path="/")
        response.delete_cookie(LOGIN_COOKIE, path="/login")
        return response

    def form_page(request: Request, status: int = 200, **context: Any) -> Response:
        """The login form, with a fresh CSRF value in its cookie and hidden field."""
        value = secrets.token_urlsafe(32)
        response = dash.render(request, "login.html", status=status, login_csrf=value,
                               next=_back({"next": request.query_params.get("next")}),
                               **context)
        response.set_cookie(LOGIN_COOKIE, value, httponly=True, samesite="strict",
                            secure=request.url.scheme == "https", path="/login")
        return response

    async def login_form(request: Request) -> Response:
        given = request.query_params.get("token")
        if given is None or not dash.actions or cross_site(request):
            # Another site's page (an <img> pointing here) must not spend the
            # address's failed logins and lock the operator out.
            return form_page(request)
        # The login URL printed at start-up: log in, then drop the token from
        # the address bar (and from history) with a redirect.
        refused = throttled(request)
        if refused is not None:
            return refused
        if not dash.token_ok(given):
            dash.throttle.failed(_client(request))
            return form_page(request, status=403, failed="wrong token")
        return logged_in(request, _back({"next": request.query_params.get("next")}))

    async def login(request: Request) -> Response:
        if not dash.actions:
            return PlainTextResponse("this dashboard is read-only", 403)
        # The form first: the limit is checked and a failure counted with no
        # wait between them, else every request waiting for its body has
        # passed the check, and parallel guesses go past the limit.
        form = await request.form()
        refused = throttled(request)
        if refused is not None:
            return refused
        expected = request.cookies.get(LOGIN_COOKIE)
        if not expected or not same_secret(str(form.get("login_csrf") or ""), expected):
            return form_page(request, status=403,
                             failed="the login form expired: log in again")
        if not dash.token_ok(str(form.get("token") or "")):
            dash.throttle.failed(_client(request))
            return form_page(request, status=403, failed="wrong token")
        return logged_in(request, _back(form))

    async def logout(request: Request) -> Response:
        form = await request.form()
        session = dash.session(request)
        if session is not None and same_secret(str(form.get("csrf") or ""), session.csrf):
            dash.sessions.end(request.cookies.get(SESSION_COOKIE))
        response = _redirect("/")
        response.delete_cookie(SESSION_COOKIE, path="/")
        return response

    def action(fn: Callable[[Request, Any], Awaitable[str]]) -> _Handler:
        """A POSTed action: allowed, authenticated, CSRF-checked, then `fn` (a message)."""
        async def handler(request: Request) -> Response:
            if not dash.actions:
                return PlainTextResponse("this dashboard is read-only", 403)
            form = await request.form()
            given = dash.bearer(request)
            if given is not None:
                refused = throttled(request)
                if refused is not None:
                    return refused
                if not dash.token_ok(given):
                    dash.throttle.failed(_client(request))
                    return PlainTextResponse("wrong token in the Authorization header", 401)
            else:
                session = dash.session(request)
                if session is None:
                    return PlainTextResponse("log in first (or send the token as an "
                                             "Authorization: Bearer header)", 401)
                if not same_secret(str(form.get("csrf") or ""), session.csrf):
                    return PlainTextResponse("CSRF check failed: reload the page", 403)
            try:
                message = await fn(request, form)
            except Unconfirmed as exc:
                return PlainTextResponse(str(exc), 400)
            except (JobRefused, JobNotFound, RunRefused, RunNotFound, ValueError) as exc:
                return _redirect(_back(form), error=str(exc))
            return _redirect(_back(form), msg=message)
        return handler

    def _ids(form: Any) -> list[UUID]:
        return [UUID(str(v)) for v in form.getlist("id")]

    async def do_retry(_request: Request, form: Any) -> str:
        return await _bulk(_ids(form), lambda i: job_admin.retry(db, i, dash.config,
                                                                actor="dashboard"),
                           "retried")

    async def do_cancel(_request: Request, form: Any) -> str:
        return await _bulk(_ids(form), lambda i: job_admin.cancel(db, i, actor="dashboard"),
                           "cancelled")

    async def do_discard(_request: Request, form: Any) -> str:
        ids = _ids(form)
        if len(set(ids)) > 1:
            _confirmed(form, "discarding several jobs")
        return await _bulk(ids, lambda i: job_admin.discard(db, i, actor="dashboard"),
                           "discarded")

    def _matching(form: Any) -> JobFilter:
        return JobFilter(queue=str(form.get("queue") or "") or None,
                         kind=str(form.get("kind") or "") or None, state="discarded")

    async def do_retry_matching(_request: Request, form: Any) -> str:
        result = await job_admin.retry_matching(db, _matching(form), dash.config,
                                               actor="dashboard")
        return _summary("retried", len(result.done), result.refused)

    async def do_discard_matching(_request: Request, form: Any) -> str:
        _confirmed(form, "discarding every dead job of a filter")
        result = await job_admin.discard_matching(db, _matching(form), actor="dashboard")
        return _summary("discarded", len(result.done), result.refused)

    async def do_pause(_request: Request, form: Any) -> str:
        name = str(form.get("queue") or "")
        await job_admin.pause_queue(db, name)
        return f"queue {name} paused"

    async def do_resume(_request: Request, form: Any) -> str:
        name = str(form.get("queue") or "")
        resumed = await job_admin.resume_queue(db, name, dash.config)
        return f"queue {name} resumed" if resumed else f"queue {name} was not paused"

    async def confirm_discard_matching(request: Request) -> Response:
        """What "Discard all" would delete, counted, and the button that does it."""
        try:
            where = JobFilter(queue=_text_filter(request.query_params, "queue"),
                              kind=_text_filter(request.query_params, "kind"),
                              state="discarded")
        except ValueError as exc:
            return dash.render(request, "error.html", status=400, message=str(exc))
        count = await job_admin.count_matching(db, where)
        return dash.render(
            request, "confirm.html", action="/actions/discard-matching", count=count,
            what="dead job(s)" + (f" of queue {where.queue}" if where.queue else "")
            + (f" of kind {where.kind}" if where.kind else ""),
            fields={"queue": where.queue or "", "kind": where.kind or ""}, ids=(),
            back=_back({"next": request.query_params.get("next")}, "/jobs?state=discarded"))

    async def confirm_discard(request: Request) -> Response:
        """What "Discard selected" would delete, counted (a POST: the ids are a form's)."""
        form = await request.form()
        try:
            ids = list(dict.fromkeys(_ids(form)))
        except ValueError:
            return dash.render(request, "error.html", status=400, message="not a job id")
        back = _back(form, "/jobs?state=any")
        return dash.render(request, "confirm.html", action="/actions/discard",
                           count=len(ids), what="selected job(s)", fields={}, ids=ids,
                           back=back)

    routes = [
        Route("/", overview),
        Route("/jobs", jobs),
        Route("/jobs/{job_id}", job),
        Route("/workers", workers),
        Route("/schedules", schedules_page),
        Route("/login", login_form, methods=["GET"]),
        Route("/login", login, methods=["POST"]),
        Route("/logout", logout, methods=["POST"]),
        Route("/confirm/discard-matching", confirm_discard_matching, methods=["GET"]),
        Route("/confirm/discard", confirm_discard, methods=["POST"]),
        Route("/actions/retry", action(do_retry), methods=["POST"]),
        Route("/actions/cancel", action(do_cancel), methods=["POST"]),
        Route("/actions/discard", action(do_discard), methods=["POST"]),
        Route("/actions/retry-matching", action(do_retry_matching), methods=["POST"]),
        Route("/actions/discard-matching", action(do_discard_matching), methods=["POST"]),
        Route("/actions/pause", action(do_pause), methods=["POST"]),
        Route("/actions/resume", action(do_resume), methods=["POST"]),
        *operator_routes(dash, action),
        *run_routes(dash, action),
        *limits_routes(dash, action),
        Mount("/static", StaticFiles(directory=_HERE / "static"), name="static"),
    ]
    return Starlette(routes=routes,
                     middleware=[Middleware(HostCheck, allowed=tuple(allowed_hosts))],
                     exception_handlers={asyncpg.DataError: _refused_value})


async def _refused_value(_request: Request, exc: Exception) -> Response:
    """
    A value from a query or a form that PostgreSQL refuses to hold (SQLSTATE
    class 22: a NUL character, a number or an interval out of range): the
    caller's input, answered with 400 and the server's reason, not a 500 and a
    traceback in the log. One handler for every page and action, since any
    text field can carry such a value to any statement.
    """
    first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return PlainTextResponse(f"the database refused a value given: {first}", 400)


def page_limit(value: str | None, default: int = job_admin.DEFAULT_LIMIT) -> int:
    """
    A listing's `?limit=` as asked (ValueError unless a positive integer of at
    most 9 digits); the caller shows at most `MAX_PAGE` of it.
    """
    if value is None or value == "":
        return default
    if not value.isdigit() or len(value) > 9 or int(value) < 1:
        raise ValueError(f"limit must be a whole number from 1 to {MAX_PAGE}")
    return int(value)


def _text_filter(params: Any, name: str) -> str | None:
    value = str(params.get(name) or "")
    if len(value) > MAX_FILTER_CHARS:
        raise ValueError(f"{name} is longer than {MAX_FILTER_CHARS} characters")
    return value or None


async def _bulk(ids: list[UUID], act: Callable[[UUID], Awaitable[object]], verb: str) -> str:
    if not ids:
        raise ValueError("no job selected")
    refused: list[tuple[UUID, str]] = []
    done = 0
    for job_id in ids:
        try:
            await act(job_id)
        except (JobRefused, JobNotFound) as exc:
            if len(ids) == 1:
                raise
            refused.append((job_id, str(exc)))
        else:
            done += 1
    return _summary(verb, done, tuple(refused))


def _summary(verb: str, done: int, refused: Sequence[tuple[UUID, str]]) -> str:
    text = f"{done} job(s) {verb}"
    if refused:
        text += f"; {len(refused)} refused: " + "; ".join(r for _, r in refused[:3])
    return text


async def _throughput(db: Database) -> dict[str, Any]:
    """The last hour's finished jobs, as 12 bars of 5 minutes (completed, failed)."""
    completed = [0] * BUCKETS
    failed = [0] * BUCKETS
    for row in await db.fetch(Q.throughput_buckets):
        target = completed if row["outcome"] == "completed" else failed
        target[row["bucket"]] += row["n"]
    top = max([c + f for c, f in zip(completed, failed, strict=True)] + [1])
    height, width = 100, 24
    bars = []
    for n, (c, f) in enumerate(zip(completed, failed, strict=True)):
        hc, hf = c * height / top, f * height / top
        bars.append({"x": n * (width + 4), "width": width, "completed": c, "failed": f,
                         "yc": height - hc, "hc": hc, "yf": height - hc - hf, "hf": hf,
                         "label": f"{(BUCKETS - n) * 5}–{(BUCKETS - n - 1) * 5} min ago"})
    return {"bars": bars, "top": top, "height": height, "width": BUCKETS * (width + 4),
                "total_completed": sum(completed), "total_failed": sum(failed)}


def _ts(at: datetime | None) -> str:
    return at.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC") if at else "—"


def _ago(seconds: float | None) -> str:
    if seconds is None:
        return "—"
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"
