"""
Adopting the Nasiko application's tables where its own migrations made them.

Migrations 0001 and 0003 create the build jobs' tables (`agents`,
`agent_builds`, `build_jobs`, `mcp_connectors`, `mcp_connector_builds`) as the
original Rust control plane's migrations of the same numbers do. Those tables
belong to that application: in a database the original created, they exist
already, with many columns of its own, and a Rust replica works on them. There
the migrator *adopts* the two files instead of running them: it checks that
each table is there with every column the queue reads or writes (docs/rules.md
§1), records the file as applied, and goes on with 0004 and later, which add
only the queue's own columns, indexes and triggers. It never creates nor drops
one of the application's tables in such a database.

A file is run as usual where none of its tables exists (a new database: the
demo's, the tests', an application that wants build jobs from scratch), and
refused where a column is missing. Where only some of them exist, they are
the application's own tables that happen to share a name (an ``agents`` table
of its own): nothing is adopted, and the file creates the build tables in the
queue's schema beside them (`nasiko_queue.db.schema`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import asyncpg
import attrs

from ..errors import MigrationError
from .statements import Q

log = logging.getLogger("nasiko_queue.migrate")


@attrs.frozen
class Adoptable:
    """What a migration creates that an application may have created already."""

    #: Each table the file creates, with the columns the queue needs of it.
    creates: Mapping[str, tuple[str, ...]]
    #: Columns the file adds to a table an earlier file created.
    adds: Mapping[str, tuple[str, ...]] = attrs.field(factory=dict)
    #: Types the file creates, needed as they are.
    types: tuple[str, ...] = ()
    #: What of the file is the queue's own and runs all the same: named
    #: statements of queries.sql (a later file may use what they make).
    own: tuple[str, ...] = ()

    def needs(self) -> dict[str, tuple[str, ...]]:
        """Every table's columns the queue needs once the file is applied."""
        needed = dict(self.creates)
        for table, columns in self.adds.items():
            needed[table] = needed.get(table, ()) + columns
        return needed


#: The migrations that create the application's tables, by version.
ADOPTABLE: Mapping[str, Adoptable] = {
    "0001": Adoptable(
        creates={
            "agents": ("id", "owner_id", "name", "status", "version", "image", "url",
                       "writable", "writable_path", "deleted_at", "created_at",
                       "updated_at"),
            "agent_builds": ("id", "agent_id", "version_tag", "image_reference", "status",
                             "triggered_by", "created_at", "updated_at"),
            "build_jobs": ("id", "agent_id", "owner_id", "payload", "status", "attempt",
                           "error_msg", "created_at", "picked_at", "completed_at"),
        },
        types=("build_status",),
        # 0003 and later give their tables triggers of this function.
        own=("migrations_updated_at_function",),
    ),
    "0003": Adoptable(
        creates={
            "mcp_connectors": ("id", "owner_id", "name", "build_status", "url", "is_active",
                               "container_image_tag", "created_at", "updated_at"),
            "mcp_connector_builds": ("id", "connector_id", "owner_id", "version_tag",
                                     "status", "error_msg", "image_tag", "completed_at",
                                     "created_at", "updated_at"),
        },
        adds={"build_jobs": ("connector_id",)},
    ),
}


async def adopts(conn: asyncpg.Connection, version: str, name: str) -> bool:
    """
    Whether migration `version` is to be adopted rather than run: True when the
    application made every table it creates (each checked for the queue's
    columns), False when it made none or only some of them.

    Raises:
        MigrationError: its tables all exist, but one lacks a column the queue
            needs, or a type it needs is missing; or the application has a
            build_jobs table of its own.
    """
    adoptable = ADOPTABLE.get(version)
    if adoptable is None:
        return False
    created = list(adoptable.creates)
    present = {r["table_name"] for r in await conn.fetch(Q.migrations_tables_present, created)}
    if not present:
        return False
    where = f"migration {version}_{name}"
    if len(present) != len(created):
        if "build_jobs" in present:
            # Every worker reads build_jobs (the rescue, `status`), whether or not
            # it runs build jobs, and finds the first on the search path: the
            # application's, not one in the queue's schema.
            raise MigrationError(
                f"{where}: this database has a table build_jobs of its own (without "
                f"{sorted(set(created) - present)}, so not the Nasiko control plane's); "
                "the queue's workers read a table of that name, and would read yours. "
                "Rename it, or give the queue a database of its own")
        # Not the original's tables: the application has a table of one of these
        # names of its own. The file runs, and its tables go into the queue's
        # schema (migrations run with it first), beside the application's.
        log.warning(
            "%s: this database has tables named %s, but not %s, so they are not the "
            "Nasiko control plane's: its build tables are created in the queue's schema "
            "instead, and yours are left alone. `nasiko-queue worker` with build "
            "executors refuses to start in this database: their statements would find "
            "your %s first on the search path",
            where, sorted(present), sorted(set(created) - present), sorted(present))
        return False
    columns: dict[str, set[str]] = {}
    needs = adoptable.needs()
    for row in await conn.fetch(Q.migrations_table_columns, list(needs)):
        columns.setdefault(row["table_name"], set()).add(row["column_name"])
    lacking = [f"{table}.{column}" for table, needed in needs.items()
               for column in needed if column not in columns.get(table, set())]
    types = {r["type_name"] for r in await conn.fetch(Q.migrations_types_present,
                                                        list(adoptable.types))}
    lacking += [f"type {t}" for t in adoptable.types if t not in types]
    if lacking:
        raise MigrationError(
            f"{where}: the application's tables are here, but without what the queue "
            f"reads and writes: {', '.join(lacking)}")
    return True
