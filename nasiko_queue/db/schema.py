"""
The PostgreSQL schema the queue lives in (issue #46).

Every table, index, function, type and trigger of the queue sits in one schema,
``nasiko_queue`` unless ``NASIKO_QUEUE_SCHEMA`` names another, never in the
application's ``public``. Why a schema and not only the ``nasiko_queue_`` prefix
the objects already carry: an application keeps its own tables (an ``agents``
table of its own, say) whatever names the queue uses, a ``\\dt`` of its schema
shows only its own, and a ``DROP SCHEMA nasiko_queue CASCADE`` removes the queue
and nothing else.

How names are found, and why this way round:

* The queue's own connections (its pools, the engine's connections, LISTEN) put
  the schema **last** on the session's ``search_path`` (`append_schema`), after
  whatever the DSN or the server set. The queue's names all begin with
  ``nasiko_queue_``, so nothing of the application's shadows them, and an
  executor's statements on ``ctx.db`` still see the application's tables first,
  exactly as on a connection of its own.
* Statements that run on the application's own connections (`nasiko_queue.aio`,
  `nasiko_queue.sync`) name the schema (``nasiko_queue.nasiko_queue_enqueue``),
  and the functions they call carry ``SET search_path`` (migration 0038), so
  they work on a connection whose search path knows nothing of the queue.
* Migrations run with the schema **first** (`nasiko_queue.db.migrate`), so what
  a file creates lands in it.

The schema is read once, when the package loads: every process that shares a
database must name the same one.
"""

from __future__ import annotations

import os
import re

from ..errors import ConfigurationError

#: The environment variable naming the schema.
SCHEMA_ENV = "NASIKO_QUEUE_SCHEMA"
#: The schema when the variable is not set.
DEFAULT_SCHEMA = "nasiko_queue"

_IDENTIFIER = re.compile(r"^[a-z_][a-z0-9_]{0,62}$")
#: A schema-qualified reference to one of the queue's objects, as queries.sql
#: writes it (``nasiko_queue.nasiko_queue_enqueue``).
_QUALIFIED = re.compile(r"(?<![\w.'\"])nasiko_queue(?=\.nasiko_queue_)")


def schema_name(value: str | None = None) -> str:
    """
    The schema named by `value`, else by the environment, else the default.

    Raises:
        ConfigurationError: not a lower-case SQL identifier (the name is spliced
            into statements, so only plain identifiers are taken).
    """
    name = value if value is not None else os.environ.get(SCHEMA_ENV) or DEFAULT_SCHEMA
    if not _IDENTIFIER.match(name):
        raise ConfigurationError(
            f"{SCHEMA_ENV}={name!r}: the queue's schema must be a plain lower-case SQL "
            "identifier (letters, digits and _, not starting with a digit, at most 63)")
    return name


#: The queue's schema in this process.
SCHEMA = schema_name()


def qualify(sql: str, schema: str = SCHEMA) -> str:
    """`sql` with its ``nasiko_queue.nasiko_queue_*`` references in `schema`."""
    if schema == DEFAULT_SCHEMA:
        return sql
    return _QUALIFIED.sub(schema, sql)
