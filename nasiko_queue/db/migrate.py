"""
The migrator: plain SQL files, applied in order, each in one transaction.

Files are named ``NNNN_name.sql``. Each applied file is recorded with a checksum
in ``nasiko_queue_migrations``; running `migrate` again changes nothing, and a
released file that was edited afterwards is refused rather than silently
skipped. A session advisory lock serialises migrators, so any number of
replicas may start at once.

A file whose first line is ``--! no-transaction`` runs outside a transaction,
one statement at a time (split at each ``;`` that ends a line; such a file may
not use dollar quoting), and is recorded once every statement has run. This is
for ``CREATE INDEX CONCURRENTLY``, which PostgreSQL refuses inside a
transaction and which, unlike a plain ``CREATE INDEX``, does not block writes
to a big table while it builds. Its statements must be safe to run again: a
file that failed half-way is not recorded and runs again from the top.

The files live in the repository's top-level ``migrations/`` folder; wheels
carry a copy inside the package (``nasiko_queue/migrations``), which is where
an installed package finds them.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import re
from importlib import resources
from importlib.abc import Traversable
from pathlib import Path

import asyncpg
import attrs

from ..errors import MigrationError
from .adopt import ADOPTABLE, adopts
from .database import Database
from .schema import SCHEMA, SCHEMA_ENV
from .statements import Q

log = logging.getLogger("nasiko_queue.migrate")

_FILE = re.compile(r"^(\d{4})_(\w+)\.sql$")
#: The client's bound on one migration statement. Not the pool's
#: `command_timeout` (60 s): building an index on a big table, or waiting for a
#: long transaction to end before CONCURRENTLY can, takes longer, and a
#: migration cut off half-way leaves work to redo (an INVALID index).
STATEMENT_TIMEOUT = 7 * 86_400.0
#: Seconds a migrator waits for another's lock before it says so.
LOCK_WAIT_NOTICE = 5.0
#: First line of a migration that must run outside a transaction.
NO_TRANSACTION = "--! no-transaction"


@attrs.frozen
class Migration:
    version: str
    name: str
    sql: str = attrs.field(repr=False)

    @property
    def checksum(self) -> str:
        return hashlib.sha256(self.sql.encode("utf-8")).hexdigest()

    @property
    def in_transaction(self) -> bool:
        """False for a file that starts with ``--! no-transaction``."""
        return not self.sql.lstrip().startswith(NO_TRANSACTION)

    def statements(self) -> list[str]:
        """The statements of a no-transaction file, one by one."""
        if "$$" in self.sql:
            raise MigrationError(f"migration {self.version}_{self.name}: a no-transaction "
                                 "file is split at each ';' that ends a line, so it may "
                                 "not use dollar quoting")
        parts = re.split(r";[ \t]*(?:\n|$)", self.sql)
        return [part.strip() for part in parts if _has_sql(part)]


def _has_sql(text: str) -> bool:
    """Whether `text` holds more than comments and blank lines."""
    return any(line.strip() and not line.strip().startswith("--")
               for line in text.splitlines())


def migrations_dir() -> Traversable:
    """The packaged copy when installed from a wheel, else the repository's folder."""
    packaged = resources.files("nasiko_queue").joinpath("migrations")
    if packaged.is_dir():
        return packaged
    source = Path(__file__).resolve().parents[2] / "migrations"
    if source.is_dir():
        return source
    raise MigrationError("no migrations folder found (neither packaged nor in the source tree)")


def load_migrations(folder: Traversable | None = None) -> list[Migration]:
    folder = folder or migrations_dir()
    found = []
    misnamed = []
    for entry in folder.iterdir():
        match = _FILE.match(entry.name)
        if match:
            found.append(Migration(match[1], match[2], entry.read_text("utf-8")))
        elif entry.name.endswith(".sql"):
            misnamed.append(entry.name)
    if misnamed:
        # Skipped, it would never run, and `migrate` would say all is up to date.
        raise MigrationError(f"migration files must be named NNNN_name.sql (letters, digits "
                             f"and _ in the name); not: {sorted(misnamed)}")
    found.sort(key=lambda m: m.version)
    versions = [m.version for m in found]
    if len(set(versions)) != len(versions):
        raise MigrationError(f"two migration files share a version: {versions}")
    return found


async def _lock(conn: asyncpg.Connection) -> None:
    """
    Take the migrators' session lock, trying again after a pause while another
    replica holds it (see `migrations_lock` for why it is not waited for inside
    the server). Runs on the asyncio side, hence asyncio's sleep.
    """
    pause, waited, told = 0.05, 0.0, False
    while not await conn.fetchval(Q.migrations_lock):
        if waited >= LOCK_WAIT_NOTICE and not told:
            log.warning("waiting for another migrator to finish (it holds the migrations "
                        "lock; `SELECT pid FROM pg_locks WHERE locktype = 'advisory'` names "
                        "its backend)")
            told = True
        await asyncio.sleep(pause)
        waited += pause
        pause = min(pause * 2, 1.0)


async def _apply(conn: asyncpg.Connection, m: Migration, statements: list[str]) -> None:
    for statement in statements:
        try:
            await conn.execute(statement, timeout=STATEMENT_TIMEOUT)
        except asyncpg.PostgresError as exc:
            raise MigrationError(f"migration {m.version}_{m.name} failed: {exc}") from exc


async def migrate(db: Database, migrations: list[Migration] | None = None) -> list[str]:
    """Apply every migration not yet applied; return the versions applied now."""
    todo = migrations if migrations is not None else load_migrations()

    async def op(conn: asyncpg.Connection) -> list[str]:
        await _lock(conn)
        # The session's own path, without the schema the pool's set-up appended:
        # where the application's tables are (for adoption), and what the
        # queue's functions search after the queue's schema.
        session_path = await conn.fetchval(Q.migrations_search_path)
        try:
            await conn.execute(Q.migrations_set_schema, SCHEMA)
            await conn.execute(Q.migrations_schema_create)
            function_path = _path(SCHEMA, _without(session_path, SCHEMA))
            await _enter(conn, session_path)
            await conn.execute(Q.migrations_create_table)
            applied = {r["version"]: r for r in await conn.fetch(Q.migrations_applied)}
            done: list[str] = []
            for m in todo:
                row = applied.get(m.version)
                if row is not None:
                    if row["checksum"] != m.checksum:
                        raise MigrationError(
                            f"migration {m.version}_{m.name} changed after it was applied; "
                            "released migrations are never edited: add a new numbered file"
                        )
                    continue
                await _enter(conn, session_path)
                if await adopts(conn, m.version, m.name):
                    # The application's own migrations made these tables: recorded,
                    # not run, but for what of the file is the queue's own
                    # (`nasiko_queue.db.adopt`).
                    async with conn.transaction():
                        for name in ADOPTABLE[m.version].own:
                            await conn.execute(getattr(Q, name))
                        await _path_functions(conn, function_path)
                        await conn.execute(Q.migrations_record, m.version, m.name, m.checksum)
                    log.info("adopted the application's tables for migration %s_%s",
                             m.version, m.name)
                    done.append(m.version)
                    continue
                if m.in_transaction:
                    async with conn.transaction():
                        await _apply(conn, m, [m.sql])
                        await _path_functions(conn, function_path)
                        await conn.execute(Q.migrations_record, m.version, m.name, m.checksum)
                else:
                    await _apply(conn, m, m.statements())
                    await _path_functions(conn, function_path)
                    await conn.execute(Q.migrations_record, m.version, m.name, m.checksum)
                log.info("applied migration %s_%s", m.version, m.name)
                done.append(m.version)
            return done
        finally:
            try:
                await conn.execute(Q.migrations_set_search_path, session_path)
            finally:
                await conn.execute(Q.migrations_unlock)

    return await db.run(op)


async def _enter(conn: asyncpg.Connection, session_path: str) -> None:
    """
    Set the search path a migration file runs with: the queue's schema first,
    so that what the file creates lands there; but in a database migrated
    before the queue had a schema of its own (up to 0037), the schema that
    holds its tables first, so that a file up to 0037 changes them where they
    are, until migration 0038 moves them (`nasiko_queue.db.schema`).
    """
    others = await conn.fetch(Q.migrations_legacy_schema, SCHEMA)
    moved = [r["schema"] for r in others if r["moved"]]
    if moved:
        raise MigrationError(
            f"the queue already lives in schema {moved[0]!r} of this database, but this "
            f"process names schema {SCHEMA!r} ({SCHEMA_ENV}): every process that shares "
            f"the database must name the same one; set {SCHEMA_ENV}={moved[0]}")
    legacy = [r["schema"] for r in others]
    if len(legacy) > 1:
        raise MigrationError(f"the queue's tables of 0.1 are in several schemas of this "
                             f"database ({', '.join(legacy)}): keep one, drop the others")
    rest = _without(session_path, SCHEMA)
    path = _path(legacy[0], rest, SCHEMA) if legacy else _path(SCHEMA, rest)
    await conn.execute(Q.migrations_set_search_path, path)


def _path(first: str, rest: str, *last: str) -> str:
    """A search path: schema `first`, then the path `rest`, then schemas `last`."""
    return ", ".join(part for part in (_ident(first), rest, *map(_ident, last)) if part)


async def _path_functions(conn: asyncpg.Connection, function_path: str) -> None:
    """Give the queue's functions that lack one their search path (see
    `migrations_functions_unpathed` for which and why)."""
    for row in await conn.fetch(Q.migrations_functions_unpathed, SCHEMA, function_path):
        await conn.execute(row[0])


def _ident(name: str) -> str:
    """`name` as an identifier in a search path (a schema name is checked to be a
    plain identifier, `nasiko_queue.db.schema`; a legacy one may be anything)."""
    return '"' + name.replace('"', '""') + '"' if not re.fullmatch(r"[a-z_][a-z0-9_]*", name) \
        else name


def _without(path: str, schema: str) -> str:
    """The search path `path` without `schema` (which the pool's set-up appends)."""
    parts = [part.strip() for part in path.split(",")]
    # An empty path ('' or '""', as the hardening advice of CVE-2018-1058 sets
    # it) has no part to keep: a zero-length name is refused in a path.
    return ", ".join(part for part in parts
                     if part not in ("", '""', schema, f'"{schema}"'))
