"""
pytest fixtures for testing an application's executors on a real PostgreSQL:
`nasiko_queue_dsn`, a migrated database of the test's own.

Load it from your ``conftest.py``::

    pytest_plugins = ["nasiko_queue.testing.pytest_plugin"]

The server is the one named by ``NASIKO_QUEUE_TEST_DSN`` (a server you may
create and drop databases on); without it, a private embedded PostgreSQL is
started for the session (the system's binaries, or pgserver's from the
``embedded`` extra). The schema is migrated once into a template database, and
each test gets a copy of it (``CREATE DATABASE … TEMPLATE``, tens of
milliseconds), dropped after: a test never sees another's rows, and nothing is
written to any database you already have. ``DATABASE_URL`` is not read here:
the state machines empty the tables of the database they are given.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import asyncpg
import pytest
import trio

from ..db.database import open_database
from ..db.embedded import EmbeddedPostgres, with_database
from ..db.migrate import migrate

__all__ = ["nasiko_queue_dsn", "nasiko_queue_server", "nasiko_queue_template"]

_counter = itertools.count()


@contextmanager
def server(env: str = "NASIKO_QUEUE_TEST_DSN", *also: str) -> Iterator[str]:
    """The DSN of the server named by `env` (or the first of `also` set), else of
    a private embedded PostgreSQL, for as long as the block runs."""
    dsn = next((os.environ[name] for name in (env, *also) if os.environ.get(name)), None)
    if dsn:
        yield dsn
        return
    with EmbeddedPostgres() as embedded:
        yield embedded.dsn


def admin(dsn: str, *statements: str) -> None:
    """Run statements on the server outside any transaction (CREATE DATABASE)."""
    async def run() -> None:
        conn = await asyncpg.connect(dsn)
        try:
            for statement in statements:
                await conn.execute(statement)
        finally:
            await conn.close()

    asyncio.run(run())


@contextmanager
def template(admin_dsn: str) -> Iterator[str]:
    """A migrated database to copy test databases from; its name."""
    name = f"nqt_tpl_{os.getpid()}_{uuid.uuid4().hex[:6]}"
    admin(admin_dsn, f'CREATE DATABASE "{name}"')

    async def do_migrate() -> None:
        async with open_database(with_database(admin_dsn, name)) as db:
            await migrate(db)

    try:
        trio.run(do_migrate)
        yield name
    finally:
        admin(admin_dsn, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@contextmanager
def database(admin_dsn: str, template_name: str | None = None,
             prefix: str = "nqt") -> Iterator[str]:
    """A database of its own (a copy of `template_name`, or empty), dropped after;
    its DSN."""
    name = f"{prefix}_{os.getpid()}_{next(_counter)}"
    copy = f' TEMPLATE "{template_name}"' if template_name else ""
    admin(admin_dsn, f'CREATE DATABASE "{name}"{copy}')
    try:
        yield with_database(admin_dsn, name)
    finally:
        admin(admin_dsn, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture(scope="session")
def nasiko_queue_server() -> Iterator[str]:
    """The server's DSN (``NASIKO_QUEUE_TEST_DSN``, or an embedded PostgreSQL)."""
    with server() as dsn:
        yield dsn


@pytest.fixture(scope="session")
def nasiko_queue_template(nasiko_queue_server: str) -> Iterator[str]:
    """The migrated template database's name."""
    with template(nasiko_queue_server) as name:
        yield name


@pytest.fixture
def nasiko_queue_dsn(nasiko_queue_server: str, nasiko_queue_template: str) -> Iterator[str]:
    """A migrated database of this test's own; its DSN."""
    with database(nasiko_queue_server, nasiko_queue_template) as dsn:
        yield dsn
