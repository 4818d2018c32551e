from __future__ import annotations

import trio

from nasiko_queue import Executors, JobContext, Queue, Upload, Worker
from nasiko_queue.testing import enqueue_with_target, set_build_status


async def test_upload_runs_and_ends_done(queue: Queue) -> None:
    executors = Executors()
    seen: list[int] = []

    @executors.register(Upload)
    async def build(ctx: JobContext[Upload]) -> None:
        seen.append(ctx.attempt)
        await set_build_status(ctx.db, ctx.payload, "success")

    job = await enqueue_with_target(queue, "Upload")
    worker = Worker(queue, executors)
    async with trio.open_nursery() as nursery:
        await nursery.start(worker.run)
        await worker.drain_once()
        worker.stop()
    row = await queue.db.fetchrow("SELECT status, attempt, error_msg FROM build_jobs WHERE id=$1",
                                  job.job_id)
    assert (row["status"], row["attempt"], row["error_msg"]) == ("done", 1, None)
    assert seen == [1]
