"""Running the asyncio side of a test on a plain asyncio loop (issue #26)."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def run_asyncio(coro: Coroutine[Any, Any, T]) -> T:
    """
    Run `coro` on a plain asyncio loop, as an asyncio application's server does.

    The loop is named rather than left to `asyncio.run`'s policy: the library
    leaves asyncio's policy alone (tests/test_import_effects.py), but a test of the
    asyncio client on any other kind of loop would not test it on asyncio, so the
    check below holds whatever a test before this one did to the policy.
    """
    async def checked() -> T:
        assert type(asyncio.get_running_loop()).__module__.startswith("asyncio"), (
            "the asyncio client must be tested on a plain asyncio loop")
        return await coro

    with asyncio.Runner(loop_factory=asyncio.SelectorEventLoop) as runner:
        return runner.run(checked())


#: Options of Starlette's TestClient for a plain asyncio loop (see `run_asyncio`).
PLAIN_ASYNCIO = {"loop_factory": asyncio.SelectorEventLoop}
