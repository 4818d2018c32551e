"""
Test fixtures: a real PostgreSQL, one fresh database per test.

The server is the one named by NASIKO_QUEUE_TEST_DSN (or DATABASE_URL); with
neither set, a private embedded PostgreSQL (pgserver) is started for the
session, so a plain `pip install` and `pytest` pass on any machine. The schema
is migrated once into a template database; each test gets a copy of it
(CREATE DATABASE … TEMPLATE, about 25 ms) and never sees another test's rows.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import pytest

from nasiko_queue import Database, Queue, QueueConfig, SecretBox, open_database
from nasiko_queue.testing.pytest_plugin import database, server, template


@pytest.fixture(scope="session")
def admin_dsn() -> Iterator[str]:
    with server("NASIKO_QUEUE_TEST_DSN", "DATABASE_URL") as dsn:
        yield dsn


@pytest.fixture(scope="session")
def template_db(admin_dsn: str) -> Iterator[str]:
    """A migrated database that every test database is copied from."""
    with template(admin_dsn) as name:
        yield name


@pytest.fixture
def dsn(admin_dsn: str, template_db: str) -> Iterator[str]:
    """A DSN for a database of this test's own, already migrated."""
    with database(admin_dsn, template_db) as test_dsn:
        yield test_dsn


@pytest.fixture
def empty_dsn(admin_dsn: str) -> Iterator[str]:
    """A DSN for an empty, unmigrated database of this test's own."""
    with database(admin_dsn, prefix="nqt_empty") as test_dsn:
        yield test_dsn


#: Seconds-scale timers so that tests with a real database never wait long; the
#: 5 s poll and 10 min sweep are tested on trio's mock clock with a fake store.
FAST = QueueConfig(
    poll_interval=0.2,
    recovery_interval=3600.0,
    retry_initial_delay=0.01,
    retry_max_delay=0.05,
)

MASTER_KEY = SecretBox(b"k" * 32)


@pytest.fixture
async def db(dsn: str) -> AsyncIterator[Database]:
    async with open_database(dsn) as database:
        yield database


@pytest.fixture
async def queue(db: Database) -> Queue:
    return Queue(db, config=FAST, secrets=MASTER_KEY)
