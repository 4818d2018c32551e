"""
The dashboard's operator pages (issue #21): running jobs, scheduled jobs with
"run now", search by kind and by argument, schedules' pause/resume/run now,
the per-queue health of the overview (oldest due job, throughput, queues no
live worker serves), and the pages' self-refresh.

Self-refresh needs no script (the Content-Security-Policy allows none): the
pages that watch the queue (overview, running, scheduled, workers, schedules)
carry ``<meta http-equiv="refresh">`` every `REFRESH_SECS` seconds, to their own
URL without a flash message. "Pause refresh" sets a cookie (`REFRESH_COOKIE`)
that leaves the tag out until "Resume refresh" clears it; pages with a form to
fill or boxes to tick (jobs, search, a job) never refresh.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any
from urllib.parse import urlencode
from uuid import UUID

from starlette.requests import Request
from starlette.responses import PlainTextResponse, RedirectResponse, Response
from starlette.routing import Route

from ..admin import operator
from ..admin.jobs import STATES, JobRefused
from ..admin.status import queue_throughput, unserved_queues
from ..db.database import Database
from ..queue import Queue
from .auth import local_path

if TYPE_CHECKING:
    from .dashboard import _Dashboard

#: Seconds between two refreshes of a watching page.
REFRESH_SECS = 5
#: The cookie that pauses the refresh ("off"); absent: refreshing.
REFRESH_COOKIE = "nq_refresh"
_Action = Callable[[Callable[[Request, Any], Awaitable[str]]], Callable[[Request],
                                                                         Awaitable[Response]]]


def refresh_context(request: Request) -> dict[str, Any]:
    """What a watching page's templates need: the refresh tag's URL, or None when paused."""
    paused = request.cookies.get(REFRESH_COOKIE) == "off"
    kept = {k: v for k, v in request.query_params.items() if k not in ("msg", "error")}
    here = request.url.path + ("?" + urlencode(kept) if kept else "")
    return {"refresh": None if paused else {"secs": REFRESH_SECS, "url": here},
            "refresh_paused": paused, "here": here}




async def queue_health(db: Database) -> dict[str, Any]:
    """The overview's per-queue extras: throughput and unserved queues, by name."""
    unserved = await unserved_queues(db)
    return {"throughput": await queue_throughput(db),
            "unserved": {u.queue: u for u in unserved if u.kind is None},
            "unserved_kinds": [u for u in unserved if u.kind is not None]}


def operator_routes(dash: _Dashboard, action: _Action) -> list[Route]:
    """The routes of the operator pages and their actions, for `dashboard_app`."""
    db = dash.db

    async def toggle_refresh(request: Request) -> Response:
        response = RedirectResponse(local_path(request.query_params.get("next")), 303)
        if request.query_params.get("pause") == "1":
            response.set_cookie(REFRESH_COOKIE, "off", httponly=True, samesite="strict",
                                path="/")
        else:
            response.delete_cookie(REFRESH_COOKIE, path="/")
        return response

    async def running(request: Request) -> Response:
        now = datetime.now(UTC)
        jobs = await operator.running_jobs(db)
        return dash.render(request, "running.html", jobs=jobs, now=now,
                           limit=operator.MAX_PAGE, **refresh_context(request))

    async def scheduled(request: Request) -> Response:
        queue = request.query_params.get("queue") or None
        try:
            jobs = await operator.scheduled_jobs(db, queue)
        except ValueError as exc:
            return PlainTextResponse(str(exc), 400)
        return dash.render(request, "scheduled.html", jobs=jobs, queue=queue,
                           now=datetime.now(UTC), limit=operator.MAX_PAGE,
                           **refresh_context(request))

    async def search(request: Request) -> Response:
        params = request.query_params
        form = {"kind": params.get("kind", ""), "args": params.get("args", ""),
                "state": params.get("state", ""), "queue": params.get("queue", "")}
        found: Sequence[operator.FoundJob] = ()
        problem = None
        asked = any(form.values())
        nxt = None
        if asked:
            try:
                found = await operator.search_jobs(
                    db, kind=form["kind"] or None, args=form["args"] or None,
                    state=form["state"] or None, queue=form["queue"] or None,
                    after=params.get("after") or None)
            except ValueError as exc:
                problem = str(exc)
            if len(found) == 50:
                nxt = urlencode({**{k: v for k, v in params.items() if k != "after"},
                                 "after": found[-1].cursor})
        return dash.render(request, "search.html", status=400 if problem else 200,
                           form=form, jobs=found, problem=problem, asked=asked,
                           states=STATES, next_query=nxt)

    def _ids(form: Any) -> list[UUID]:
        return [UUID(str(v)) for v in form.getlist("id")]

    async def do_run_now(_request: Request, form: Any) -> str:
        ids = _ids(form)
        if not ids:
            raise ValueError("no job selected")
        for job_id in ids:
            await operator.run_now(db, job_id, dash.config, actor="dashboard")
        return f"{len(ids)} job(s) due now"

    def _schedule_name(form: Any) -> str:
        name = str(form.get("schedule") or "")
        if not name:
            raise ValueError("no schedule named")
        return name

    async def do_schedule_pause(_request: Request, form: Any) -> str:
        name = _schedule_name(form)
        await operator.pause_schedule(db, name)
        return f"schedule {name} paused"

    async def do_schedule_resume(_request: Request, form: Any) -> str:
        name = _schedule_name(form)
        resumed = await operator.resume_schedule(db, name)
        return f"schedule {name} resumed" if resumed else f"schedule {name} was not paused"

    async def do_schedule_run(_request: Request, form: Any) -> str:
        name = _schedule_name(form)
        schedule = next((s for s in dash.schedules if s.name == name), None)
        if schedule is None:
            raise JobRefused(f"schedule {name!r} is not among the dashboard's --schedules: "
                             "its job is not known here")
        job_id = await operator.run_schedule_now(Queue(db, config=dash.config), schedule,
                                                 actor="dashboard")
        return f"schedule {name}: job {job_id} enqueued"

    return [
        Route("/refresh", toggle_refresh, methods=["GET"]),
        Route("/running", running),
        Route("/scheduled", scheduled),
        Route("/search", search),
        Route("/actions/run-now", action(do_run_now), methods=["POST"]),
        Route("/actions/schedule-pause", action(do_schedule_pause), methods=["POST"]),
        Route("/actions/schedule-resume", action(do_schedule_resume), methods=["POST"]),
        Route("/actions/schedule-run", action(do_schedule_run), methods=["POST"]),
    ]
