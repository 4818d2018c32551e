"""
A job's claim and end write their row versions on the job's own page
(migration 0022, issue #25).

None of a job's updates can be HOT (each changes `state`, which the partial
indexes read), but an update whose new version fits on the old one's page
writes a WAL record without the row's unchanged ends (the payload among them)
and no lock record of its own. With pages filled by the inserts, the claim and
the end moved to other pages and logged the whole row each time. Checked by
where the versions land (`ctid`), not by a WAL figure: a page number does not
move with the machine's load.
"""

from __future__ import annotations

from typing import ClassVar
from uuid import UUID

import attrs

from nasiko_queue import JobArgs, JobOptions, JobStatus, Queue
from nasiko_queue.db.database import Database
from nasiko_queue.plain.store import PlainJobStore

from .conftest import FAST

#: A payload of about 1.5 kB: five such rows fill a page; the server compresses
#: or moves out of line only rows over about 2 kB, so this one stays as it is.
WIDE = 1_500


@attrs.frozen(kw_only=True)
class Wide(JobArgs):
    kind: ClassVar[str] = "wide"
    options: ClassVar[JobOptions] = JobOptions(queue="wide")
    n: int
    text: str


async def _pages(db: Database, ids: list[UUID]) -> dict[UUID, int]:
    """The heap page of each job's current row version."""
    rows = await db.fetch("SELECT id, (ctid::text::point)[0]::int AS page "
                          "FROM nasiko_queue_jobs WHERE id = ANY ($1::uuid[])", ids)
    return {r["id"]: r["page"] for r in rows}


async def test_a_jobs_claim_and_end_stay_on_its_page(queue: Queue, db: Database) -> None:
    ids = await queue.enqueue_many([Wide(n=i, text="x" * WIDE) for i in range(4)])
    inserted = await _pages(db, ids)
    # Inserts stop at half a page: two of these rows a page, not five.
    assert sorted(inserted.values()) == [0, 0, 1, 1], inserted

    store = PlainJobStore(db, FAST, "wide", lambda: None)
    claimed = await store.claim(4)
    assert {job.id for job in claimed} == set(ids)
    # Filled to the brim, the first claim on a page fits and the rest move.
    assert await _pages(db, ids) == inserted

    statuses, _ = await store.finish_many_and_claim([(job, None, None) for job in claimed], 0)
    assert set(statuses.values()) == {JobStatus.DONE}, statuses
    assert set(statuses) == set(ids)
    # The third version of each row fits too: the first, dead since its claim
    # committed, is pruned from the page as the end reads it.
    assert await _pages(db, ids) == inserted
