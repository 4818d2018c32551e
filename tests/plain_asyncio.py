"""Running the asyncio side of a test on a plain asyncio loop (issue #26)."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def run_asyncio(coro: Coroutine[Any, Any, T]) -> T:
    """
    Run `coro` on a plain asyncio loop, as an asyncio application's server does.

    Not `asyncio.run`: importing nasiko_queue imports trio_asyncio, which makes
    `asyncio.new_event_loop()` (and so `asyncio.run`) build trio-asyncio's own
    synchronous loop in any thread that set no event loop policy. A test of the
    asyncio client on that loop would not test it on asyncio; servers that pass a
    loop factory (uvicorn, `asyncio.Runner(loop_factory=...)`) get a plain one.
    """
    async def checked() -> T:
        assert type(asyncio.get_running_loop()).__module__.startswith("asyncio"), (
            "the asyncio client must be tested on a plain asyncio loop")
        return await coro

    with asyncio.Runner(loop_factory=asyncio.SelectorEventLoop) as runner:
        return runner.run(checked())


#: Options of Starlette's TestClient for a plain asyncio loop (see `run_asyncio`).
PLAIN_ASYNCIO = {"loop_factory": asyncio.SelectorEventLoop}
