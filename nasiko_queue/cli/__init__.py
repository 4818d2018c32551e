"""
The ``nasiko-queue`` command: migrate, run a worker, inspect or prune the queue, make a key, demo.

Thin on purpose: each command parses its options, calls the public API inside one
`trio.run`, and renders the result. Everything worth testing without a terminal
lives elsewhere (`admin.status.queue_status`, `cli.demo.run_demo`).

Errors are for operators, not for developers: a database that cannot be reached,
a wrong DSN or a schema that is not migrated ends the command with one line on
stderr and exit code 1 (2 for a usage error such as a missing ``--dsn``), never
with a traceback. The DSN's password never appears in any message. The one
exception is `worker` facing a server that is down or starting: it logs one line
per try and waits for it (docs/rules.md §5), as it does for an outage once running.

The commands live by group, each module registering its own on `main`:
`common` (the `main` group, the operator's errors, the shared options),
`worker`, `jobs` (`job`, `jobs list|retry|cancel|discard`, `enqueue`), `runs` (`run`,
`runs list|cancel|retry`: workflow runs), `web` (`dashboard`),
`operations` (`migrate`, `status`, `prune`, `keygen`), `limits` (`limits`,
`limit set|clear`) and `tools` (`demo`, `bench`).
"""

from __future__ import annotations

from . import jobs, limits, operations, runs, tools, web, worker
from .common import main
from .worker import load_executors, load_schedules, parse_queues

__all__ = ["jobs", "limits", "load_executors", "load_schedules", "main", "operations",
           "parse_queues", "runs", "tools", "web", "worker"]
