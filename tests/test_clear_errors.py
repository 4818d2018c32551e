"""
Clear errors at the point of the mistake (issue #46): a wrong field type is refused
at enqueue naming the field (the worker's own decoding, not its claim, says so),
something that is not a job says what enqueue expects, a server that refuses the
connection is named, and an unmigrated database says to run migrate. The types
stay what they were (a ConnectionRefusedError, an UndefinedTableError), so retries
and handlers are unchanged.
"""

from __future__ import annotations

import socket
from typing import Any, ClassVar

import asyncpg
import attrs
import pytest

import nasiko_queue as nq
from nasiko_queue.db.database import Database
from nasiko_queue.errors import CannotConnect, NotMigrated, is_transient
from nasiko_queue.plain.enqueue_call import enqueue_call, make_codec


@attrs.frozen(kw_only=True)
class Mail(nq.JobArgs):
    kind: ClassVar[str] = "mail"
    to: str
    attempts_left: int = 3
    tags: list[str] = attrs.Factory(list)


async def test_a_wrong_field_type_is_refused_at_enqueue_naming_the_field(db: Database) -> None:
    queue = nq.Queue(db)
    bad: list[Any] = [Mail(to=5), Mail(to="a", attempts_left="3"), Mail(to="a", tags=[1])]
    says = ["field 'to': expected a string", "field 'attempts_left': expected an integer",
            "field 'tags[0]': expected a string"]
    for mail, message in zip(bad, says, strict=True):
        with pytest.raises(nq.InvalidPayload, match=message.replace("[", r"\[")):
            await queue.enqueue(mail)
        with pytest.raises(nq.InvalidPayload, match=r"payload 0 of the 1"):
            await queue.enqueue_many([mail])
        with pytest.raises(nq.InvalidPayload):  # the asyncio and sync clients' path
            enqueue_call(make_codec(None), mail)
    assert await db.fetchval("SELECT count(*) FROM nasiko_queue_jobs") == 0
    assert await queue.enqueue(Mail(to="ok"))


async def test_enqueue_of_something_that_is_no_job_says_what_it_expects(db: Database) -> None:
    queue = nq.Queue(db)
    with pytest.raises(TypeError, match=r"expects a JobArgs instance .* not dict: .*"
                                         r"enqueue_json"):
        await queue.enqueue({"to": "x"})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="not str"):
        await queue.enqueue("mail")  # type: ignore[arg-type]


async def test_a_server_that_refuses_the_connection_is_named() -> None:
    with socket.socket() as probe:  # a port with nothing listening on it
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    async with nq.open_database(nq.DatabaseConfig(
            dsn=f"postgresql://root:hunter2@127.0.0.1:{port}/x", connect_timeout=5)) as db:
        with pytest.raises(CannotConnect) as refused:
            await nq.Queue(db).enqueue(Mail(to="a"))
    message = str(refused.value)
    assert message.startswith(f"cannot connect to PostgreSQL at 127.0.0.1:{port}: "
                              "connection refused")
    assert "hunter2" not in message
    assert isinstance(refused.value, ConnectionRefusedError)
    assert is_transient(refused.value)  # a worker still waits for the server


async def test_an_unmigrated_database_says_to_run_migrate(empty_dsn: str) -> None:
    async with nq.open_database(empty_dsn) as db:
        with pytest.raises(NotMigrated) as missing:
            await nq.Queue(db).enqueue(Mail(to="a"))
        # Another table that is not the queue's is the application's business.
        with pytest.raises(asyncpg.UndefinedTableError) as theirs:
            await db.fetchval("SELECT 1 FROM no_such_table_of_the_app")
    assert "run `nasiko-queue migrate" in str(missing.value)
    assert isinstance(missing.value, asyncpg.UndefinedTableError)
    assert missing.value.sqlstate == "42P01"
    assert not isinstance(theirs.value, NotMigrated)
