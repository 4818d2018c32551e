"""
The migrator: plain SQL files, applied in order, each in one transaction.

Files are named ``NNNN_name.sql``. Each applied file is recorded with a checksum
in ``nasiko_queue_migrations``; running `migrate` again changes nothing, and a
released file that was edited afterwards is refused rather than silently
skipped. A session advisory lock serialises migrators, so any number of
replicas may start at once.

The files live in the repository's top-level ``migrations/`` folder; wheels
carry a copy inside the package (``nasiko_queue/migrations``), which is where
an installed package finds them.
"""

from __future__ import annotations

import hashlib
import logging
import re
from importlib import resources
from importlib.abc import Traversable
from pathlib import Path

import asyncpg
import attrs

from ._sql import Q
from .database import Database
from .errors import MigrationError

log = logging.getLogger("nasiko_queue.migrate")

_FILE = re.compile(r"^(\d{4})_(\w+)\.sql$")


@attrs.frozen
class Migration:
    version: str
    name: str
    sql: str = attrs.field(repr=False)

    @property
    def checksum(self) -> str:
        return hashlib.sha256(self.sql.encode("utf-8")).hexdigest()


def migrations_dir() -> Traversable:
    """The packaged copy when installed from a wheel, else the repository's folder."""
    packaged = resources.files(__package__).joinpath("migrations")
    if packaged.is_dir():
        return packaged
    source = Path(__file__).resolve().parent.parent / "migrations"
    if source.is_dir():
        return source
    raise MigrationError("no migrations folder found (neither packaged nor in the source tree)")


def load_migrations(folder: Traversable | None = None) -> list[Migration]:
    folder = folder or migrations_dir()
    found = []
    for entry in folder.iterdir():
        match = _FILE.match(entry.name)
        if match:
            found.append(Migration(match[1], match[2], entry.read_text("utf-8")))
    found.sort(key=lambda m: m.version)
    versions = [m.version for m in found]
    if len(set(versions)) != len(versions):
        raise MigrationError(f"two migration files share a version: {versions}")
    return found


async def migrate(db: Database, migrations: list[Migration] | None = None) -> list[str]:
    """Apply every migration not yet applied; return the versions applied now."""
    todo = migrations if migrations is not None else load_migrations()

    async def op(conn: asyncpg.Connection) -> list[str]:
        await conn.execute(Q.migrations_lock)
        try:
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
                async with conn.transaction():
                    try:
                        await conn.execute(m.sql)
                    except asyncpg.PostgresError as exc:
                        raise MigrationError(
                            f"migration {m.version}_{m.name} failed: {exc}"
                        ) from exc
                    await conn.execute(Q.migrations_record, m.version, m.name, m.checksum)
                log.info("applied migration %s_%s", m.version, m.name)
                done.append(m.version)
            return done
        finally:
            await conn.execute(Q.migrations_unlock)

    return await db.run(op)
