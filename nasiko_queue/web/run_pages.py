"""
The dashboard's workflow run pages (issue #22): the runs (filtered by workflow
and state, paged newest started first), one run (its steps in dependency
order with their exact counts, and a page of their jobs' attempts, durations,
masked results and last errors: a fan-out of 20,000 items is paged as the
listings are), and its cancel and retry.

A retry is one button, as a job's is. A cancel goes through a confirmation
page, as a bulk discard does: it stops every running step of the run and its
child runs, which no retry gives back as they were (a retry runs them again).
The POST that cancels is refused without that page's `confirm` field.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any
from urllib.parse import urlencode
from uuid import UUID

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from ..admin import runs as run_admin
from ..admin.runs import RunFilter

if TYPE_CHECKING:
    from .dashboard import _Dashboard

_Action = Callable[[Callable[[Request, Any], Awaitable[str]]], Callable[[Request],
                                                                         Awaitable[Response]]]


def _pretty(value: Any) -> str:
    return json.dumps(value, indent=2, sort_keys=True, default=str)


def _run_id(form: Any) -> UUID:
    try:
        return UUID(str(form.get("id") or ""))
    except ValueError:
        raise ValueError("not a run id") from None


def run_routes(dash: _Dashboard, action: _Action) -> list[Route]:
    """The routes of the run pages and their actions, for `dashboard_app`."""
    from .dashboard import MAX_PAGE, _back, _confirmed, _text_filter, page_limit

    db = dash.db

    async def runs(request: Request) -> Response:
        params = request.query_params
        state = params.get("state", "any")
        try:
            asked = page_limit(params.get("limit"))
            where = RunFilter(workflow=_text_filter(params, "workflow"),
                              state=None if state in ("any", "") else state,
                              limit=min(asked, MAX_PAGE))
            page = await run_admin.list_runs(db, where, after=params.get("after") or None)
        except ValueError as exc:
            return dash.render(request, "error.html", status=400, message=str(exc))
        nxt = None
        if len(page) == where.limit:
            nxt = urlencode({**{k: v for k, v in params.items() if k != "after"},
                             "after": page[-1].cursor})
        return dash.render(request, "runs.html", runs=page, where=where, state=state,
                           states=run_admin.STATES, next_query=nxt,
                           capped=MAX_PAGE if asked > MAX_PAGE else None)

    async def run(request: Request) -> Response:
        try:
            run_id = UUID(request.path_params["run_id"])
        except ValueError:
            return dash.render(request, "error.html", status=404, message="no such run")
        params = request.query_params
        try:
            asked = page_limit(params.get("limit"), run_admin.JOBS_PER_PAGE)
            limit = min(asked, MAX_PAGE)
            view = await run_admin.run_detail(db, run_id, limit=limit,
                                              after=params.get("after") or None)
        except ValueError as exc:
            return dash.render(request, "error.html", status=400, message=str(exc))
        if view is None:
            return dash.render(request, "error.html", status=404, message=f"no run {run_id}")
        nxt = None
        if view.next_cursor is not None:
            nxt = urlencode({**{k: v for k, v in params.items() if k != "after"},
                             "after": view.next_cursor})
        return dash.render(
            request, "run.html", run=view, input=_pretty(view.input),
            result=_pretty(view.result) if view.state == "completed" else None,
            results={s.name: _pretty(s.result) for s in view.steps
                     if s.state == "completed" and not s.map_over},
            item_results={s.name: _pretty({str(i.index): i.result for i in s.items
                                           if i.state == "completed"})
                          for s in view.steps if s.map_over and s.items},
            paged=bool(params.get("after")), next_query=nxt,
            capped=MAX_PAGE if asked > MAX_PAGE else None)

    async def confirm_cancel(request: Request) -> Response:
        """What "Cancel run" would stop, counted, and the button that does it."""
        try:
            run_id = _run_id(request.query_params)
        except ValueError as exc:
            return dash.render(request, "error.html", status=400, message=str(exc))
        view = await run_admin.run_detail(db, run_id, limit=1)  # its counts: no page needed
        if view is None:
            return dash.render(request, "error.html", status=404, message=f"no run {run_id}")
        waiting = [s for s in view.steps if s.state in ("blocked", "enqueued", "waiting")]
        children = [s.child_run for s in view.steps
                    if s.child_run is not None and s.state == "waiting"]
        back = _back({"next": request.query_params.get("next")}, f"/runs/{run_id}")
        return dash.render(request, "run_confirm.html", run=view, running=view.running_jobs,
                           waiting=len(waiting), children=children, back=back)

    async def do_cancel(_request: Request, form: Any) -> str:
        _confirmed(form, "cancelling a run")
        run_id = _run_id(form)
        await run_admin.cancel_run(db, run_id, actor="dashboard")
        return f"run {run_id} cancelled"

    async def do_retry(_request: Request, form: Any) -> str:
        run_id = _run_id(form)
        await run_admin.retry_run(db, run_id, actor="dashboard")
        return f"run {run_id} retried"

    return [
        Route("/runs", runs),
        Route("/runs/{run_id}", run),
        Route("/confirm/run-cancel", confirm_cancel, methods=["GET"]),
        Route("/actions/run-cancel", action(do_cancel), methods=["POST"]),
        Route("/actions/run-retry", action(do_retry), methods=["POST"]),
    ]
