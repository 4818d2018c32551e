"""
The web dashboard (`nasiko-queue dashboard`): queues, jobs, dead letters,
workers and schedules, server-rendered (Starlette and Jinja2, autoescaped; no
JavaScript needed), with retry, cancel, discard and pause/resume as POSTed
forms.

Safety model:

- every page is readable by whoever reaches the bind address (127.0.0.1 by
  default); payload secrets are masked (`admin.view.mask_payload`) before a
  template sees them;
- an action needs the token: a session from the login form (an HttpOnly,
  SameSite=Strict cookie naming a random server-side session) or an
  ``Authorization: Bearer`` header, and, for a session, the session's CSRF token
  in the form's hidden field;
- `read_only` (and a dashboard started without a token) shows no actions and
  refuses every POST but the login.

Needs the [http] extra; importing it without raises an ImportError naming it.
"""

from __future__ import annotations

import hmac
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
    from starlette.requests import Request
    from starlette.responses import PlainTextResponse, RedirectResponse, Response
    from starlette.routing import Mount, Route
    from starlette.staticfiles import StaticFiles
    from starlette.templating import Jinja2Templates
except ImportError as exc:  # pragma: no cover - exercised without the extra only
    raise ImportError(
        "the dashboard needs the [http] extra: pip install 'nasiko-queue[http]' "
        f"({exc})") from exc

import attrs

from ..admin import jobs as job_admin
from ..admin.jobs import JobFilter, JobNotFound, JobRefused
from ..admin.operator import job_events, queue_overview
from ..admin.status import list_workers
from ..admin.view import job_view
from ..config import QueueConfig
from ..db.database import Database
from ..db.statements import Q
from ..plain.schedules import Schedule
from .pages import operator_routes, queue_health, refresh_context

_HERE = Path(__file__).resolve().parent
SESSION_COOKIE = "nq_session"
#: Throughput chart: 12 bars of 5 minutes.
BUCKETS = 12
_Handler = Callable[[Request], Awaitable[Response]]


@attrs.define
class _Session:
    csrf: str


@attrs.define
class _Dashboard:
    db: Database
    token: str | None
    read_only: bool
    config: QueueConfig
    schedules: Sequence[Schedule]
    templates: Jinja2Templates
    sessions: dict[str, _Session] = attrs.Factory(dict)

    @property
    def actions(self) -> bool:
        """Whether actions exist at all (a token is set and not read-only)."""
        return not self.read_only and self.token is not None

    def session(self, request: Request) -> _Session | None:
        sid = request.cookies.get(SESSION_COOKIE)
        return self.sessions.get(sid) if sid else None

    def header_token_ok(self, request: Request) -> bool:
        given = request.headers.get("authorization", "")
        scheme, _, value = given.partition(" ")
        return (self.token is not None and scheme.lower() == "bearer"
                and hmac.compare_digest(value.encode(), self.token.encode()))

    def render(self, request: Request, name: str, status: int = 200,
               **context: Any) -> Response:
        session = self.session(request)
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


def _back(form: Any, default: str = "/") -> str:
    """The page to go back to after an action: a local path only (no open redirect)."""
    target = str(form.get("next") or default)
    if not target.startswith("/") or target.startswith("//") or "\\" in target:
        return default
    return target


def _redirect(target: str, **params: str) -> RedirectResponse:
    sep = "&" if "?" in target else "?"
    return RedirectResponse(target + (sep + urlencode(params) if params else ""), 303)


def dashboard_app(db: Database, *, token: str | None, read_only: bool = False,
                  config: QueueConfig | None = None,
                  schedules: Sequence[Schedule] = ()) -> Starlette:
    """
    The dashboard as an ASGI application on `db` (an open `Database`).

    Args:
        token: what the login form and the ``Authorization: Bearer`` header must
            give for an action; None makes the dashboard read-only.
        read_only: show no actions and refuse every one.
        config: whose `notify_channel` wakes workers after a retry or resume.
        schedules: the application's `Schedule` list, to show each one's cron
            expression and next run (without it, only their last ticks).
    """
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(_HERE / "templates"),
        autoescape=True, undefined=jinja2.StrictUndefined)
    env.filters["ago"] = _ago
    env.filters["ts"] = _ts
    dash = _Dashboard(db=db, token=token, read_only=read_only,
                      config=config or QueueConfig(), schedules=tuple(schedules),
                      templates=Jinja2Templates(env=env))

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
                           chart=await _throughput(db), **refresh_context(request))

    async def jobs(request: Request) -> Response:
        params = request.query_params
        state = params.get("state", "discarded")
        try:
            where = JobFilter(queue=params.get("queue") or None,
                              kind=params.get("kind") or None,
                              state=None if state == "any" else state or None,
                              limit=int(params.get("limit", job_admin.DEFAULT_LIMIT)))
            page = await job_admin.list_jobs(db, where, after=params.get("after") or None)
        except ValueError as exc:
            return dash.render(request, "error.html", status=400, message=str(exc))
        nxt = None
        if len(page) == where.limit:
            nxt = urlencode({**{k: v for k, v in params.items() if k != "after"},
                             "after": page[-1].cursor})
        return dash.render(request, "jobs.html", jobs=page, where=where,
                           state=state, next_query=nxt, states=job_admin.STATES,
                           dead=where.state == "discarded")

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
                                              default=str))

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

    async def login_form(request: Request) -> Response:
        return dash.render(request, "login.html")

    async def login(request: Request) -> Response:
        form = await request.form()
        given = str(form.get("token") or "")
        if not dash.actions or dash.token is None:
            return PlainTextResponse("this dashboard is read-only", 403)
        if not hmac.compare_digest(given.encode(), dash.token.encode()):
            return dash.render(request, "login.html", status=403,
                               failed="wrong token")
        sid = secrets.token_urlsafe(32)
        dash.sessions[sid] = _Session(csrf=secrets.token_urlsafe(32))
        response = _redirect(_back(form))
        response.set_cookie(SESSION_COOKIE, sid, httponly=True, samesite="strict",
                            secure=request.url.scheme == "https", path="/")
        return response

    async def logout(request: Request) -> Response:
        form = await request.form()
        session = dash.session(request)
        if session is not None and hmac.compare_digest(
                str(form.get("csrf") or "").encode(), session.csrf.encode()):
            dash.sessions.pop(request.cookies.get(SESSION_COOKIE, ""), None)
        response = _redirect("/")
        response.delete_cookie(SESSION_COOKIE, path="/")
        return response

    def action(fn: Callable[[Request, Any], Awaitable[str]]) -> _Handler:
        """A POSTed action: allowed, authenticated, CSRF-checked, then `fn` (a message)."""
        async def handler(request: Request) -> Response:
            if not dash.actions:
                return PlainTextResponse("this dashboard is read-only", 403)
            form = await request.form()
            if not dash.header_token_ok(request):
                session = dash.session(request)
                if session is None:
                    return PlainTextResponse("log in first (or send the token as an "
                                             "Authorization: Bearer header)", 401)
                if not hmac.compare_digest(str(form.get("csrf") or "").encode(),
                                           session.csrf.encode()):
                    return PlainTextResponse("CSRF check failed: reload the page", 403)
            try:
                message = await fn(request, form)
            except (JobRefused, JobNotFound, ValueError) as exc:
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
        return await _bulk(_ids(form), lambda i: job_admin.discard(db, i, actor="dashboard"),
                           "discarded")

    def _matching(form: Any) -> JobFilter:
        return JobFilter(queue=str(form.get("queue") or "") or None,
                         kind=str(form.get("kind") or "") or None, state="discarded")

    async def do_retry_matching(_request: Request, form: Any) -> str:
        result = await job_admin.retry_matching(db, _matching(form), dash.config,
                                               actor="dashboard")
        return _summary("retried", len(result.done), result.refused)

    async def do_discard_matching(_request: Request, form: Any) -> str:
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

    routes = [
        Route("/", overview),
        Route("/jobs", jobs),
        Route("/jobs/{job_id}", job),
        Route("/workers", workers),
        Route("/schedules", schedules_page),
        Route("/login", login_form, methods=["GET"]),
        Route("/login", login, methods=["POST"]),
        Route("/logout", logout, methods=["POST"]),
        Route("/actions/retry", action(do_retry), methods=["POST"]),
        Route("/actions/cancel", action(do_cancel), methods=["POST"]),
        Route("/actions/discard", action(do_discard), methods=["POST"]),
        Route("/actions/retry-matching", action(do_retry_matching), methods=["POST"]),
        Route("/actions/discard-matching", action(do_discard_matching), methods=["POST"]),
        Route("/actions/pause", action(do_pause), methods=["POST"]),
        Route("/actions/resume", action(do_resume), methods=["POST"]),
        *operator_routes(dash, action),
        Mount("/static", StaticFiles(directory=_HERE / "static"), name="static"),
    ]
    return Starlette(routes=routes)


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
