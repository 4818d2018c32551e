"""
Health checks: `/health/live` (the trio loop answers) and `/health/ready`.

Readiness is a handful of checks, each reported by name in the JSON body: the
database answers within `timeout` seconds; every migration this release ships
is applied, unchanged; and, with a worker, its LISTEN connection is up (when it
listens) and its last heartbeat landed within its lease. All pass: 200; any
fails: 503. Nothing here is cached, and nothing blocks the worker: the database
checks run on the queue's pool, bounded (`Database.run_bounded`).
"""

from __future__ import annotations

from typing import Any

import attrs
import trio
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse

from ..db.migrate import Migration, load_migrations
from ..db.statements import Q
from ..engine.retry import one_line
from ..engine.worker import Worker
from ..queue import Queue


@attrs.frozen
class Check:
    """One readiness check's verdict."""

    name: str
    ok: bool
    detail: str


class Health:
    """
    The two health endpoints of one queue (and, optionally, its worker).

    Args:
        queue: the queue whose database is checked.
        worker: the worker whose LISTEN connection and heartbeat are checked;
            None for a process that serves without running jobs.
        timeout: seconds each database check may take.
    """

    def __init__(self, queue: Queue, worker: Worker | None = None, *,
                 timeout: float = 1.0) -> None:
        self.queue = queue
        self.worker = worker
        self.timeout = timeout
        self._migrations: list[Migration] = load_migrations()

    async def live(self, _request: Request) -> PlainTextResponse:
        """200 whenever the loop runs this handler: nothing else is looked at."""
        return PlainTextResponse("ok\n")

    async def ready(self, _request: Request) -> JSONResponse:
        checks = await self.checks()
        ok = all(check.ok for check in checks)
        body: dict[str, Any] = {
            "status": "ready" if ok else "unavailable",
            "checks": {c.name: {"ok": c.ok, "detail": c.detail} for c in checks},
        }
        return JSONResponse(body, status_code=200 if ok else 503)

    async def checks(self) -> list[Check]:
        """Every readiness check, in order: database, migrations, listen, heartbeat."""
        checks = list(await self._database())
        worker = self.worker
        if worker is not None:
            checks.append(self._listen(worker))
            checks.append(self._heartbeat(worker))
        return checks

    async def _database(self) -> tuple[Check, Check]:
        timeout = self.timeout

        async def op(conn: Any) -> list[Any]:
            await conn.fetchval(Q.health_ping, timeout=timeout)
            try:
                rows: list[Any] = await conn.fetch(Q.migrations_applied, timeout=timeout)
            except Exception as exc:  # no table: never migrated
                return [exc]
            return rows

        sent = trio.current_time()
        try:
            rows = await self.queue.db.run_bounded(op, bound=timeout)
        except Exception as exc:
            why = f"no answer: {one_line(exc)}"
            return Check("database", False, why), Check("migrations", False, "unknown: " + why)
        database = Check("database", True, f"answered in {trio.current_time() - sent:.3f}s")
        if rows and isinstance(rows[0], Exception):
            return database, Check("migrations", False, f"not migrated: {one_line(rows[0])}")
        applied = {row["version"]: row["checksum"] for row in rows}
        pending = [f"{m.version}_{m.name}" for m in self._migrations if m.version not in applied]
        changed = [f"{m.version}_{m.name}" for m in self._migrations
                   if m.version in applied and applied[m.version] != m.checksum]
        if pending or changed:
            detail = "; ".join(part for part in (
                f"pending: {', '.join(pending)}" if pending else "",
                f"changed since applied: {', '.join(changed)}" if changed else "") if part)
            return database, Check("migrations", False, detail)
        latest = self._migrations[-1].version if self._migrations else "-"
        return database, Check("migrations", True, f"current ({latest})")

    @staticmethod
    def _listen(worker: Worker) -> Check:
        config = worker.config
        if not config.listen or config.notify_channel is None:
            return Check("listen", True, "off (the worker polls)")
        if worker.state.listening:
            return Check("listen", True, f"LISTEN {config.notify_channel}")
        return Check("listen", False, "the LISTEN connection is down")

    @staticmethod
    def _heartbeat(worker: Worker) -> Check:
        landed = worker.heartbeat.landed_at
        lease = worker.config.lease
        if landed is None:
            return Check("heartbeat", False, "the worker has not registered yet")
        age = trio.current_time() - landed
        if worker.state.fenced:
            return Check("heartbeat", False, f"fenced (last heartbeat {age:.1f}s ago)")
        if age > lease:
            return Check("heartbeat", False, f"last heartbeat {age:.1f}s ago, past the "
                                             f"{lease:g}s lease")
        return Check("heartbeat", True, f"last heartbeat {age:.1f}s ago")
