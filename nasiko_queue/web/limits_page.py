"""
The dashboard's Limits page (issue #23): every queue's limits across replicas,
what they hold now (running jobs, starts in the rate window), and, behind the
token, a form that sets a queue's limits and a button that clears them: an
operator's change without a deploy, applied by every worker at its next claim.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from ..plain.limits import PartitionMode, Rate
from ..queue import Queue
from .pages import refresh_context

if TYPE_CHECKING:
    from .dashboard import _Dashboard

_Action = Callable[[Callable[[Request, Any], Awaitable[str]]], Callable[[Request],
                                                                         Awaitable[Response]]]


def _number(form: Any, name: str, kind: type[int] | type[float]) -> Any:
    text = str(form.get(name) or "").strip()
    if not text:
        return None
    try:
        return kind(text)
    except ValueError:
        raise ValueError(f"{name} must be a number, got {text!r}") from None


def limits_routes(dash: _Dashboard, action: _Action) -> list[Route]:
    """The Limits page and its two actions, for `dashboard_app`."""
    queue = Queue(dash.db, config=dash.config)

    async def limits_page(request: Request) -> Response:
        return dash.render(request, "limits.html", limits=await queue.limits(),
                           modes=[m.value for m in PartitionMode], **refresh_context(request))

    async def do_limit_set(_request: Request, form: Any) -> str:
        name = str(form.get("queue") or "").strip()
        rate, per = _number(form, "rate", int), _number(form, "per", float)
        if (rate is None) != (per is None):
            raise ValueError("a rate needs its period (and a period its rate)")
        limit = await queue.set_limit(
            name, concurrency=_number(form, "concurrency", int),
            rate=None if rate is None else Rate(rate, per=per),
            partition_by=str(form.get("partition_by") or "").strip() or None,
            partition_mode=str(form.get("partition_mode") or PartitionMode.NONE))
        return f"limits of queue {limit.queue} set"

    async def do_limit_clear(_request: Request, form: Any) -> str:
        name = str(form.get("queue") or "")
        cleared = await queue.clear_limit(name)
        return f"limits of queue {name} cleared" if cleared else f"queue {name} had no limits"

    return [
        Route("/limits", limits_page),
        Route("/actions/limit-set", action(do_limit_set), methods=["POST"]),
        Route("/actions/limit-clear", action(do_limit_clear), methods=["POST"]),
    ]
