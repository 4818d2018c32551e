"""
Sync enqueue over any DB-API connection (issue #26): `nasiko_queue.sync` on a
psycopg 3 connection and cursor, and on Django's `connection` inside
`transaction.atomic()`, one block that commits and one that rolls back.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any, ClassVar
from urllib.parse import urlsplit
from uuid import UUID

import attrs
import psycopg
import psycopg.errors
import pytest

from nasiko_queue import Job, JobArgs, JobOptions, PayloadCodec, Unique
from nasiko_queue import sync as nq_sync


@attrs.frozen(kw_only=True)
class SendEmail(JobArgs):
    kind: ClassVar[str] = "send_email"
    options: ClassVar[JobOptions] = JobOptions(queue="email", max_attempts=5)
    to: str
    subject: str = "hello"


def stored(dsn: str) -> dict[UUID, tuple[str, dict[str, Any], int]]:
    with psycopg.connect(dsn) as conn:
        rows = conn.execute("SELECT id, queue, payload::text, max_attempts "
                            "FROM nasiko_queue.nasiko_queue_jobs").fetchall()
    return {r[0]: (r[1], json.loads(r[2]), r[3]) for r in rows}


def test_psycopg_connection_and_cursor(dsn: str) -> None:
    with psycopg.connect(dsn) as conn:
        kept = nq_sync.enqueue(conn, SendEmail(to="a@x"))
        with conn.cursor() as cur:
            held = nq_sync.enqueue(cur, SendEmail(to="b@x"), unique=Unique("b"))
            assert nq_sync.enqueue(cur, SendEmail(to="b2@x"), unique=Unique("b")) == held
        conn.commit()
        nq_sync.enqueue(conn, SendEmail(to="lost@x"))
        conn.rollback()
        ids = nq_sync.enqueue_many(conn, [SendEmail(to="c@x"),
                                          Job(SendEmail(to="d@x"), delay=5)])
        conn.commit()
        # What the function refuses comes back as the driver's error (here a
        # limit set lower for the session than the client's).
        conn.execute("SET nasiko_queue.max_payload_bytes = 10")
        with pytest.raises(psycopg.errors.ProgramLimitExceeded, match="the limit is 10"):
            nq_sync.enqueue(conn, SendEmail(to="e@x"))
        conn.rollback()
    jobs = stored(dsn)
    assert set(jobs) == {kept, held, *ids}
    assert jobs[kept] == ("email", json.loads(PayloadCodec().dumps(SendEmail(to="a@x"))), 5)


def test_a_driver_that_reads_uuid_arrays_as_text(dsn: str) -> None:
    """
    psycopg2 reads a uuid[] as one string ('{a,b}') unless the application has
    registered its uuid type (Django does): `enqueue_many` then parsed that
    string's characters as ids and raised after the jobs were written, so a
    caller that retried wrote them twice (found by a bug hunt). Here psycopg 3
    is told to read uuid[] as psycopg2 does.
    """
    from psycopg.types.string import TextLoader

    with psycopg.connect(dsn, autocommit=True) as conn:
        uuid_array = psycopg.types.TypeInfo.fetch(conn, "uuid[]")
        assert uuid_array is not None
        conn.adapters.register_loader(uuid_array.oid, TextLoader)
        assert isinstance(conn.execute("SELECT ARRAY[gen_random_uuid()]").fetchone()[0], str)
        ids = nq_sync.enqueue_many(conn, [SendEmail(to="p@x"), SendEmail(to="q@x")])
    assert set(stored(dsn)) == set(ids)
    assert len(ids) == 2


def django_alias(dsn: str) -> Iterator[str]:
    """Django, configured once per process, with a database alias for `dsn`."""
    import django
    from django.conf import settings

    if not settings.configured:
        settings.configure(DATABASES={}, INSTALLED_APPS=[], USE_TZ=True)
        django.setup()
    from django.db import connections

    url = urlsplit(dsn)
    alias = f"t_{url.path.strip('/')}"
    # Django fills in the defaults of a database's settings (its `default` is the
    # dummy backend of a project with no DATABASES).
    connections.settings[alias] = connections.configure_settings({
        "default": {"ENGINE": "django.db.backends.dummy"},
        alias: {"ENGINE": "django.db.backends.postgresql", "NAME": url.path.strip("/"),
                "USER": url.username or "", "PASSWORD": url.password or "",
                "HOST": url.hostname or "", "PORT": str(url.port or "")}})[alias]
    try:
        yield alias
    finally:
        connections[alias].close()
        del connections.settings[alias]


@pytest.fixture
def django_db(dsn: str) -> Iterator[str]:
    yield from django_alias(dsn)


def test_django_transaction_atomic(dsn: str, django_db: str) -> None:
    """A view's job commits with its atomic block, or vanishes with it."""
    from django.db import connections, transaction

    connection = connections[django_db]

    class ViewFailed(Exception):
        pass

    with transaction.atomic(using=django_db):
        kept = nq_sync.enqueue(connection, SendEmail(to="ok@x"))
        with connection.cursor() as cursor:
            also = nq_sync.enqueue(cursor, SendEmail(to="cursor@x"))
    def failing_view() -> None:
        with transaction.atomic(using=django_db):
            nq_sync.enqueue(connection, SendEmail(to="lost@x"))
            raise ViewFailed

    with pytest.raises(ViewFailed):
        failing_view()
    assert set(stored(dsn)) == {kept, also}
