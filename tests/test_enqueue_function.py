"""
The SQL enqueue function (issue #26, migration 0019): from asyncpg and from
psycopg inside the caller's transaction, from a trigger, its unique and batch
forms, its errors, and the NOTIFY that wakes a worker.

asyncpg runs on a plain asyncio loop (no trio: an application's own driver), psycopg
synchronously, each on connections of its own, as an application's would be.
"""

from __future__ import annotations

import asyncio
import json
import re
import textwrap
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, ClassVar, TypeVar
from uuid import UUID

import asyncpg
import attrs
import psycopg
import psycopg.errors
import pytest
import trio

from nasiko_queue import Executors, JobArgs, JobOptions, PlainJobContext, Queue
from nasiko_queue.db.database import Database

from .conftest import FAST
from .helpers import TEST_DEADLINE, running
from .plain_asyncio import run_asyncio

T = TypeVar("T")

CHANNEL = "nasiko_queue_jobs"


def on_asyncpg(dsn: str, fn: Callable[[asyncpg.Connection], Awaitable[T]]) -> T:
    """Run `fn(conn)` on an asyncpg connection of its own, in asyncio."""
    async def main() -> T:
        conn = await asyncpg.connect(dsn)
        try:
            return await fn(conn)
        finally:
            await conn.close()

    return run_asyncio(main())


def jobs(dsn: str) -> list[dict[str, Any]]:
    """Every plain job, in the order they would be claimed within a queue."""
    with psycopg.connect(dsn) as conn:
        cur = conn.execute(
            "SELECT id, queue, kind, payload, state, priority, max_attempts, run_at > now() "
            "AS later, unique_key, unique_states FROM nasiko_queue.nasiko_queue_jobs "
            "ORDER BY priority, run_at, id")
        names = [c.name for c in cur.description or ()]
        return [dict(zip(names, row, strict=True)) for row in cur.fetchall()]


def test_from_asyncpg_in_the_callers_transaction(dsn: str) -> None:
    """Committed: the job is there with Queue.enqueue's defaults; rolled back: nothing."""
    async def enqueue(conn: asyncpg.Connection) -> tuple[UUID, UUID]:
        async with conn.transaction():
            kept = await conn.fetchval(
                "SELECT nasiko_queue.nasiko_queue_enqueue('send_email', "
                "$1::jsonb)", '{"to": "a@x"}')
        tx = conn.transaction()
        await tx.start()
        lost = await conn.fetchval("SELECT nasiko_queue.nasiko_queue_enqueue('send_email', '{}')")
        # Seen inside the transaction that made it ...
        assert await conn.fetchval("SELECT count(*) FROM nasiko_queue.nasiko_queue_jobs") == 2
        await tx.rollback()
        return kept, lost

    kept, lost = on_asyncpg(dsn, enqueue)
    assert kept != lost
    [job] = jobs(dsn)
    assert job == {"id": kept, "queue": "default", "kind": "send_email",
                   "payload": {"kind": "send_email", "to": "a@x"}, "state": "available",
                   "priority": 0, "max_attempts": 20, "later": False, "unique_key": None,
                   "unique_states": None}


def test_from_psycopg_in_the_callers_transaction(dsn: str) -> None:
    with psycopg.connect(dsn) as conn:
        with conn.transaction():
            conn.execute("CREATE TABLE orders (id int PRIMARY KEY)")
        with conn.transaction():
            conn.execute("INSERT INTO orders VALUES (1)")
            kept = conn.execute(
                "SELECT nasiko_queue.nasiko_queue_enqueue(%s, %s::jsonb, queue => %s, priority "
                "=> %s, "
                "max_attempts => %s, delay => %s)",
                ("ship", json.dumps({"order": 1}), "shipping", -5, 3, 60)).fetchone()

        def failing_view() -> None:
            with conn.transaction():
                conn.execute("INSERT INTO orders VALUES (2)")
                conn.execute("SELECT nasiko_queue.nasiko_queue_enqueue('ship', '{\"order\": 2}')")
                raise ZeroDivisionError  # the view fails: its rows and its job go

        with pytest.raises(ZeroDivisionError):
            failing_view()
        orders = conn.execute("SELECT id FROM orders").fetchall()
    assert orders == [(1,)]
    [job] = jobs(dsn)
    assert kept == (job["id"],)
    assert (job["queue"], job["priority"], job["max_attempts"], job["later"]) == (
        "shipping", -5, 3, True)


def test_notify_at_commit_and_not_on_rollback(dsn: str) -> None:
    """The wake is sent once at commit, never for a rolled-back enqueue. A sentinel
    NOTIFY sent afterwards bounds the wait: everything before it has arrived."""
    async def main() -> list[list[str]]:
        heard: list[str] = []
        sentinel = asyncio.Event()

        def on_notify(_c: object, _pid: int, channel: str, payload: str) -> None:
            heard.append(f"{channel}:{payload}")
            if payload == "sentinel":
                sentinel.set()

        listener = await asyncpg.connect(dsn)
        caller = await asyncpg.connect(dsn)
        rounds = []
        try:
            await listener.add_listener(CHANNEL, on_notify)
            for commit in (False, True):
                heard.clear()
                sentinel.clear()
                tx = caller.transaction()
                await tx.start()
                for n in range(3):  # one NOTIFY per transaction, however many jobs
                    await caller.execute("SELECT nasiko_queue.nasiko_queue_enqueue('k', $1::jsonb)",
                                         json.dumps({"n": n}))
                await (tx.commit() if commit else tx.rollback())
                await caller.execute(f"NOTIFY {CHANNEL}, 'sentinel'")
                await asyncio.wait_for(sentinel.wait(), TEST_DEADLINE)
                rounds.append(list(heard))
        finally:
            await listener.close()
            await caller.close()
        return rounds

    rolled_back, committed = run_asyncio(main())
    assert rolled_back == [f"{CHANNEL}:sentinel"]
    assert committed == [f"{CHANNEL}:", f"{CHANNEL}:sentinel"]


def readme_trigger() -> str:
    """The docs' trigger example (its ```sql block marked ``-- readme: trigger``, in
    docs/guides/clients.md)."""
    text = (Path(__file__).resolve().parent.parent / "docs" / "guides" / "clients.md").read_text()
    [block] = re.findall(r"```sql\n\s*-- readme: trigger\n(.*?)```", text, flags=re.DOTALL)
    return textwrap.dedent(block)


def test_from_a_trigger(dsn: str) -> None:
    """A row inserted enqueues a job in the same transaction (the README's example)."""
    with psycopg.connect(dsn) as conn:
        conn.execute(readme_trigger())
        conn.commit()
        conn.execute("INSERT INTO signups (email) VALUES ('a@x'), ('b@x')")
        conn.commit()
        conn.execute("INSERT INTO signups (email) VALUES ('c@x')")
        conn.rollback()
        # A second signup of a@x while its welcome waits: the key holds it to one.
        conn.execute("INSERT INTO signups (email) VALUES ('a@x')")
        conn.commit()
    found = [(j["queue"], j["payload"], j["unique_key"]) for j in jobs(dsn)]
    assert found == [
        ("email", {"kind": "send_welcome", "email": "a@x"}, "welcome:a@x"),
        ("email", {"kind": "send_welcome", "email": "b@x"}, "welcome:b@x"),
    ]


def test_unique_keys(dsn: str) -> None:
    """A held key returns the holder's id; a key whose job ended is free again,
    unless its states say otherwise."""
    def enqueue(conn: psycopg.Connection[Any], key: str, states: list[str] | None = None
                ) -> UUID:
        row = conn.execute("SELECT nasiko_queue.nasiko_queue_enqueue('k', '{}', unique_key => %s, "
                           "unique_states => %s)", (key, states)).fetchone()
        assert row is not None
        job_id: UUID = row[0]
        return job_id

    with psycopg.connect(dsn, autocommit=True) as conn:
        first = enqueue(conn, "a")
        assert enqueue(conn, "a") == first
        conn.execute("UPDATE nasiko_queue.nasiko_queue_jobs SET state = 'completed', finished_at "
                     "= now() "
                     "WHERE id = %s", (first,))
        again = enqueue(conn, "a")
        assert again != first
        once = enqueue(conn, "b", ["available", "running", "completed"])
        conn.execute("UPDATE nasiko_queue.nasiko_queue_jobs SET state = 'completed', finished_at "
                     "= now() "
                     "WHERE id = %s", (once,))
        assert enqueue(conn, "b", ["available", "running", "completed"]) == once
    assert len(jobs(dsn)) == 3


def test_batch_form(dsn: str) -> None:
    """Ids in the order given, claimed in that order, a held key's holder in its
    place; a bad element names its index and nothing of the batch is kept."""
    batch = [
        {"kind": "a", "args": {"n": 0}},
        {"kind": "a", "args": {"n": 1}, "unique_key": "u"},
        {"kind": "b", "queue": "other", "priority": 3, "max_attempts": 2, "delay": 30},
        {"kind": "a", "args": {"n": 3}, "unique_key": "u"},
        {"kind": "a", "run_at": "2030-01-01T00:00:00+00:00"},
    ]
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT nasiko_queue.nasiko_queue_enqueue_many(%s::jsonb)",
                           (json.dumps(batch),)).fetchone()
        assert row is not None
        ids: list[UUID] = row[0]
        with pytest.raises(psycopg.errors.InvalidParameterValue,
                           match=r"jobs\[1\]: unknown key\(s\) \{prio\}"):
            conn.execute("SELECT nasiko_queue.nasiko_queue_enqueue_many(%s::jsonb)",
                         (json.dumps([{"kind": "c"}, {"kind": "c", "prio": 1}]),))
        with pytest.raises(psycopg.errors.InvalidParameterValue,
                           match=r"jobs\[0\]: wrong JSON type for \{max_attempts\}"):
            conn.execute("SELECT nasiko_queue.nasiko_queue_enqueue_many(%s::jsonb)",
                         (json.dumps([{"kind": "c", "max_attempts": "3"}]),))
        with pytest.raises(psycopg.errors.InvalidParameterValue,
                           match=r"jobs\[1\]: Upload is a build job's kind"):
            conn.execute("SELECT nasiko_queue.nasiko_queue_enqueue_many(%s::jsonb)",
                         (json.dumps([{"kind": "c"}, {"kind": "Upload"}]),))
        with pytest.raises(psycopg.errors.InvalidParameterValue, match="a JSON array"):
            conn.execute("SELECT nasiko_queue.nasiko_queue_enqueue_many('{}')")
        # Values of the right JSON type that a cast refused with its bare message,
        # naming neither the job nor the key (found by a bug hunt).
        for bad, message in [
            ({"priority": 1.5}, r"jobs\[1\]: values of \{priority\} must be whole"),
            ({"max_attempts": 1e12}, r"jobs\[1\]: values of \{max_attempts\} must be whole"),
            ({"delay": 1e300}, r"jobs\[1\]: delay is 0 to 3155760000 seconds"),
            ({"run_at": "tomorrow-ish"}, r"jobs\[1\]: run_at needs a UTC offset"),
            ({"run_at": "2030-13-45T00:00:00+00:00"}, r"jobs\[1\]: run_at is not a time"),
            ({"run_at": "2030-01-01T00:00:00"}, r"jobs\[1\]: run_at needs a UTC offset"),
            ({"run_at": "-infinity"}, r"jobs\[1\]: run_at needs a UTC offset"),
            ({"run_at": "2030-01-01"}, r"jobs\[1\]: run_at needs a UTC offset"),
        ]:
            with pytest.raises(psycopg.errors.InvalidParameterValue, match=message):
                conn.execute("SELECT nasiko_queue.nasiko_queue_enqueue_many(%s::jsonb)",
                             (json.dumps([{"kind": "c"}, {"kind": "c", **bad}]),))
        # A whole number written as a float (Python's json.dumps(3.0)) is that number.
        whole = conn.execute("SELECT nasiko_queue.nasiko_queue_enqueue_many(%s::jsonb)",
                             (json.dumps([{"kind": "d", "priority": 3.0,
                                           "max_attempts": 2.0}]),)).fetchone()
        assert whole is not None
        assert conn.execute("SELECT priority, max_attempts FROM nasiko_queue.nasiko_queue_jobs "
                            "WHERE id = %s", (whole[0][0],)).fetchone() == (3, 2)
        conn.execute("DELETE FROM nasiko_queue.nasiko_queue_jobs WHERE id = %s", (whole[0][0],))
    assert len(ids) == 5
    assert ids[3] == ids[1]
    found = {j["id"]: j for j in jobs(dsn)}
    assert set(found) == set(ids)
    assert [found[i]["payload"] for i in (ids[0], ids[1])] == [
        {"kind": "a", "n": 0}, {"kind": "a", "n": 1}]
    other = found[ids[2]]
    assert (other["queue"], other["priority"], other["max_attempts"], other["later"]) == (
        "other", 3, 2, True)
    assert found[ids[4]]["later"]
    # Claim order within "default": as given (clock_timestamp per job).
    default = [j["id"] for j in jobs(dsn) if j["queue"] == "default" and not j["later"]]
    assert default == [ids[0], ids[1]]


BAD_CALLS = [
    ("SELECT nasiko_queue.nasiko_queue_enqueue('', '{}')", "a job kind is a non-empty string"),
    ("SELECT nasiko_queue.nasiko_queue_enqueue(NULL, '{}')", "a job kind is a non-empty string"),
    ("SELECT nasiko_queue.nasiko_queue_enqueue(repeat('k', 101), '{}')", "at most 100 characters"),
    ("SELECT nasiko_queue.nasiko_queue_enqueue(E'a\\nb', '{}')", "no control characters"),
    ("SELECT nasiko_queue.nasiko_queue_enqueue('GithubClone', "
     "'{}')", "GithubClone is a build job's kind"),
    ("SELECT nasiko_queue.nasiko_queue_enqueue('k', '[1, 2]')",
     "the arguments of a k job must be a JSON object, not array"),
    ("SELECT nasiko_queue.nasiko_queue_enqueue('k', "
     "'\"text\"')", "must be a JSON object, not string"),
    ("SELECT nasiko_queue.nasiko_queue_enqueue('k', '{\"kind\": \"other\"}')",
     "the arguments name kind \"other\", not 'k'"),
    ("SELECT nasiko_queue.nasiko_queue_enqueue('k', '{}', queue => "
     "'')", "a queue name is 1 to 128"),
    ("SELECT nasiko_queue.nasiko_queue_enqueue('k', '{}', queue => repeat('q', 129))",
     "a queue name is 1 to 128"),
    ("SELECT nasiko_queue.nasiko_queue_enqueue('k', '{}', queue => 'builds')",
     "'builds' is the name build jobs go by"),
    ("SELECT nasiko_queue.nasiko_queue_enqueue('k', '{}', priority => "
     "40000)", "a priority is between"),
    ("SELECT nasiko_queue.nasiko_queue_enqueue('k', '{}', max_attempts => "
     "0)", "max_attempts is at least 1"),
    ("SELECT nasiko_queue.nasiko_queue_enqueue('k', '{}', delay => -1)", "not negative"),
    ("SELECT nasiko_queue.nasiko_queue_enqueue('k', '{}', delay => 1, run_at => now())",
     "give run_at or delay, not both"),
    ("SELECT nasiko_queue.nasiko_queue_enqueue('k', '{}', unique_key => "
     "'')", "a unique key is a non-empty"),
    ("SELECT nasiko_queue.nasiko_queue_enqueue('k', '{}', unique_states => '{available,running}')",
     "unique_states without a unique_key"),
    ("SELECT nasiko_queue.nasiko_queue_enqueue('k', '{}', unique_key => 'u', "
     "unique_states => '{available}')", "must include available and running"),
    ("SELECT nasiko_queue.nasiko_queue_enqueue('k', '{}', unique_key => 'u', "
     "unique_states => '{available,running,done}')", "unknown job state"),
]


@pytest.mark.parametrize(("sql", "message"), BAD_CALLS)
def test_bad_input_raises_a_clear_error(dsn: str, sql: str, message: str) -> None:
    """SQLSTATE 22023 with a message that says what is wrong; nothing is written."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        with pytest.raises(psycopg.errors.InvalidParameterValue) as caught:
            conn.execute(sql)
        assert message in str(caught.value)
    assert jobs(dsn) == []


def test_malformed_args_and_size_limit(dsn: str) -> None:
    """Text that is not JSON is refused by the jsonb cast (22P02, the position
    named); a payload over the limit by the function (54000, the sizes named)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        with pytest.raises(psycopg.errors.InvalidTextRepresentation, match="json"):
            conn.execute("SELECT nasiko_queue.nasiko_queue_enqueue('k', %s::jsonb)", ("{to: 1",))
        conn.execute("SET nasiko_queue.max_payload_bytes = 100")
        with pytest.raises(psycopg.errors.ProgramLimitExceeded,
                           match=r"k payload is \d+ bytes; the limit is 100"):
            conn.execute("SELECT nasiko_queue.nasiko_queue_enqueue('k', %s::jsonb)",
                         (json.dumps({"x": "y" * 200}),))
    assert jobs(dsn) == []


@attrs.frozen(kw_only=True)
class Ping(JobArgs):
    kind: ClassVar[str] = "ping"
    options: ClassVar[JobOptions] = JobOptions(queue="pings")
    n: int


async def test_notify_wakes_a_worker(db: Database, dsn: str) -> None:
    """A job enqueued by the SQL function from another driver wakes a LISTENing
    worker: its poll is an hour, so only the NOTIFY can have woken it. The
    payload the function wrote is the one the worker decodes."""
    seen: list[int] = []
    executors = Executors()

    @executors.register(Ping)
    async def ping(ctx: PlainJobContext[Ping]) -> None:
        seen.append(ctx.payload.n)

    queue = Queue(db, config=attrs.evolve(FAST, poll_interval=3600.0))
    async with running(queue, executors) as worker:
        def enqueue() -> None:
            with psycopg.connect(dsn, autocommit=True) as conn:
                conn.execute("SELECT nasiko_queue.nasiko_queue_enqueue('ping', '{\"n\": 7}', "
                             "queue => 'pings')")

        await trio.to_thread.run_sync(enqueue)
        with trio.fail_after(TEST_DEADLINE):
            await worker.wait_for(lambda s: s.done >= 1)
    assert seen == [7]
