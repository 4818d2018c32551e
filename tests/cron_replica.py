"""
One replica for the cron process test: ``python -m tests.cron_replica DSN``.

A worker with the every-second schedule `BEAT` and an executor for its jobs,
run until killed. Each tick it enqueued is logged ("enqueued as job"), so the
test can count ticks per replica.
"""

from __future__ import annotations

import logging
import sys
from typing import ClassVar

import attrs
import trio

from nasiko_queue import (
    Executors,
    JobArgs,
    JobOptions,
    PlainJobContext,
    Queue,
    QueueConfig,
    Schedule,
    Worker,
    open_database,
)


@attrs.frozen
class Beat(JobArgs):
    kind: ClassVar[str] = "cron_beat"
    options: ClassVar[JobOptions] = JobOptions(queue="beats")


#: The fastest schedule cron expressions allow: every second.
BEAT = Schedule("beat", "* * * * * *", Beat())

executors = Executors()


@executors.register(Beat)
async def beat(ctx: PlainJobContext[Beat]) -> None:
    pass


async def main(dsn: str) -> None:
    async with open_database(dsn) as db:
        queue = Queue(db, config=QueueConfig(poll_interval=0.5))
        await Worker(queue, executors, schedules=[BEAT]).run()


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("nasiko_queue.schedules").setLevel(logging.DEBUG)
    trio.run(main, sys.argv[1])
