"""
Migrations: moved to `nasiko_queue.db.migrate` (issue #20, the package's
layout). This module keeps the documented path `nasiko_queue.migrate` working.
"""

from .db.migrate import (
    NO_TRANSACTION,
    Migration,
    load_migrations,
    migrate,
    migrations_dir,
)

__all__ = [
    "NO_TRANSACTION",
    "Migration",
    "load_migrations",
    "migrate",
    "migrations_dir",
]
