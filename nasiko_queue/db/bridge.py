"""
trio-asyncio, brought in only when a trio run of ours needs it.

asyncpg speaks asyncio, so the database layer runs an asyncio loop inside trio
(trio-asyncio). Importing trio-asyncio changes asyncio for the whole process: it
installs its own event loop policy and replaces ``asyncio.new_event_loop``, so
that afterwards ``asyncio.run()`` in a FastAPI app, pytest-asyncio or any library
builds a trio-asyncio loop instead of the one it asked for.

An embedded library must not do that to its host. So nothing imports trio-asyncio
at module level; `trio_asyncio()` imports it on first use (inside a trio run the
library starts), and then points its "outside trio" fallback at the policy the
process had before: trio-asyncio keeps, per thread, the policy a caller set, and
uses it for every asyncio call made outside a trio run. Its class-level default is
the one every thread without a policy of its own falls back to; with it set,
``asyncio.new_event_loop()``, ``asyncio.get_event_loop_policy()`` and
``asyncio.run()`` outside trio behave exactly as before the import, while inside
trio runs trio-asyncio's loop works as it always did.

A process that imported trio-asyncio itself, before us, chose its behaviour; we
leave it as it is.
"""

from __future__ import annotations

import asyncio
import sys
from types import ModuleType

_module: ModuleType | None = None


def trio_asyncio() -> ModuleType:
    """The `trio_asyncio` module, imported (and made harmless outside trio) once."""
    global _module
    if _module is not None:
        return _module
    ours = "trio_asyncio" not in sys.modules
    before = asyncio.get_event_loop_policy() if ours else None
    import trio_asyncio

    module: ModuleType = trio_asyncio

    if ours:
        faked = getattr(getattr(module, "_loop", None), "_FakedPolicy", None)
        if faked is None:  # pragma: no cover - a trio-asyncio without the hook
            raise RuntimeError(
                "this trio-asyncio has no per-thread policy fallback "
                "(trio_asyncio._loop._FakedPolicy); nasiko-queue needs >= 0.15")
        faked.policy = before
    _module = module
    return module
