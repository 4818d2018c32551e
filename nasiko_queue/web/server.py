"""
Serving health and metrics on the application's own trio loop.

hypercorn's trio worker serves a small Starlette app in a task of the caller's
nursery (`HttpService.run`), so the endpoints see the worker's state directly
and cost no thread, no process, no second event loop::

    service = HttpService(queue, worker, host="127.0.0.1", port=9181)
    async with trio.open_nursery() as nursery:
        await nursery.start(service.run)      # listening once this returns
        await nursery.start(worker.run)

`build_app` is the app itself, from a list of routes, with a place for the web
dashboard to be mounted at "/" (the health and metrics routes come first).

This module needs the [http] extra; without it, importing it raises an
ImportError that says so.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

try:
    import hypercorn.config
    import hypercorn.trio
    import prometheus_client  # noqa: F401  (checked here, used by .metrics)
    from starlette.applications import Starlette
    from starlette.routing import BaseRoute, Mount, Route
    from starlette.types import ASGIApp
except ImportError as exc:  # pragma: no cover - depends on the installation
    raise ImportError(
        f"nasiko_queue.web needs the [http] extra ({exc.name} is missing): "
        "pip install 'nasiko-queue[http]'") from exc

import attrs
import trio

from ..engine.worker import Worker
from ..queue import Queue
from .bind import DEFAULT_HOST, DEFAULT_PORT, parse_bind, reporting_bind_errors
from .health import Health
from .metrics import Metrics

__all__ = ["DEFAULT_HOST", "DEFAULT_PORT", "HttpService", "build_app", "parse_bind", "serve"]

log = logging.getLogger("nasiko_queue.web")

def build_app(routes: Sequence[BaseRoute], *, dashboard: ASGIApp | None = None) -> Starlette:
    """
    The ASGI app: `routes` first, then `dashboard` (if given) mounted at "/".
    """
    all_routes = list(routes)
    if dashboard is not None:
        all_routes.append(Mount("/", app=dashboard))
    return Starlette(routes=all_routes)


def health_and_metrics_routes(health: Health, metrics: Metrics) -> list[BaseRoute]:
    """`/health/live`, `/health/ready` and `/metrics`."""
    return [
        Route("/health/live", health.live, methods=["GET"]),
        Route("/health/ready", health.ready, methods=["GET"]),
        Route("/metrics", metrics.endpoint, methods=["GET"]),
    ]


async def serve(app: ASGIApp, host: str, port: int, *,
                task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
    """Serve `app` until cancelled; reports the port it listens on (port 0: any free one)."""
    config = hypercorn.config.Config()
    config.bind = [f"[{host}]:{port}" if ":" in host else f"{host}:{port}"]
    config.accesslog = None
    # hypercorn's own messages through the application's logging, not a handler of its own.
    config.errorlog = logging.getLogger("nasiko_queue.web.hypercorn")
    config.graceful_timeout = 1.0

    async with trio.open_nursery() as nursery:
        with reporting_bind_errors(config.bind[0]):
            binds: list[str] = await nursery.start(hypercorn.trio.serve, app, config)
        bound = int(binds[0].rsplit(":", 1)[1])
        log.info("serving health and metrics on %s", binds[0])
        task_status.started(bound)


@attrs.define(eq=False)
class HttpService:
    """
    Health and metrics of one queue (and its worker, if given), served over HTTP.

    Args:
        queue: the queue whose database is checked and whose jobs are counted.
        worker: the worker whose state readiness and metrics report; None for a
            process that runs no jobs.
        host, port: where to listen (127.0.0.1 by default; port 0 takes a free
            one, `port` says which once `run` has started).
        dashboard: an ASGI app mounted at "/" after the health and metrics routes.
        check_timeout: seconds each readiness database check may take.
        scrape_timeout: seconds the scrape's statement may take.
    """

    queue: Queue
    worker: Worker | None = None
    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    dashboard: ASGIApp | None = None
    check_timeout: float = 1.0
    scrape_timeout: float = 2.0
    health: Health = attrs.field(init=False)
    metrics: Metrics = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self.health = Health(self.queue, self.worker, timeout=self.check_timeout)
        self.metrics = Metrics(self.queue, self.worker, timeout=self.scrape_timeout)

    def app(self) -> Starlette:
        return build_app(health_and_metrics_routes(self.health, self.metrics),
                         dashboard=self.dashboard)

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Serve until cancelled; started once listening (`port` is then the real one)."""
        async with trio.open_nursery() as nursery:
            self.port = await nursery.start(serve, self.app(), self.host, self.port)
            task_status.started()
