"""
Executors for the CLI tests: `nasiko-queue worker --executors tests.cli_executors:executors`.

A module of its own because the worker runs in a subprocess, which imports it by name.
"""

from __future__ import annotations

from typing import ClassVar

import attrs
import trio

from nasiko_queue import (
    Executors,
    JobArgs,
    JobContext,
    JobOptions,
    PlainJobContext,
    Rollback,
    Update,
    Upload,
)
from nasiko_queue.plain.schedules import Schedule
from nasiko_queue.testing import set_build_status

executors = Executors()


@attrs.frozen(kw_only=True)
class Ping(JobArgs):
    """A plain job of queue "pings"."""

    kind: ClassVar[str] = "ping"
    options: ClassVar[JobOptions] = JobOptions(queue="pings")
    n: int = 0


@executors.register(Ping)
async def ping(ctx: PlainJobContext[Ping]) -> None:
    return None


@attrs.frozen(kw_only=True)
class Digest(JobArgs):
    """A plain job unique per day (its type's key)."""

    kind: ClassVar[str] = "digest"
    options: ClassVar[JobOptions] = JobOptions(queue="pings")
    day: str

    def unique_key(self) -> str | None:
        return f"digest:{self.day}"


@executors.register(Digest)
async def digest(ctx: PlainJobContext[Digest]) -> None:
    return None


@executors.register(Upload)
async def build_upload(ctx: JobContext[Upload]) -> None:
    """A build that always works: it only reports success on its build row."""
    await set_build_status(ctx.db, ctx.payload, "success")


@executors.register(Update)
async def build_update_forever(ctx: JobContext[Update]) -> None:
    """A build that never ends by itself, for the hard-stop test."""
    await set_build_status(ctx.db, ctx.payload, "building")
    await trio.sleep_forever()


@executors.register(Rollback)
async def build_rollback_crashes(ctx: JobContext[Rollback]) -> None:
    """A build that always raises, for the attempt-cap test."""
    raise RuntimeError("this executor always crashes")


#: For `worker --schedules tests.cli_executors:schedules`.
schedules = [Schedule("ping-every-minute", "* * * * *", Ping())]


def make_executors() -> Executors:
    """The factory form `--executors` also accepts."""
    return executors


#: Not an Executors, for the error-message test.
not_executors = ("Upload",)
