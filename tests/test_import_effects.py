"""
Importing nasiko_queue changes nothing in asyncio (issue #46).

trio-asyncio, which the database layer needs, replaces asyncio's event loop
policy and `asyncio.new_event_loop` when it is imported. An application that
merely imports the queue (a FastAPI app, pytest-asyncio, a library calling
`asyncio.run`) must keep the asyncio it had; and after the library has run a trio
run of its own, asyncio outside trio still behaves as before. Each check runs in
a fresh interpreter, since the point is what one import does to a process.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap


def run_python(code: str, **env: str) -> str:
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, **env})
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_import_leaves_asyncio_alone() -> None:
    out = run_python("""
        import asyncio, sys
        loop_type = type(asyncio.new_event_loop())
        policy = asyncio.get_event_loop_policy()
        import nasiko_queue, nasiko_queue.aio, nasiko_queue.sync
        assert type(asyncio.new_event_loop()) is loop_type, type(asyncio.new_event_loop())
        assert asyncio.get_event_loop_policy() is policy
        print("trio_asyncio" in sys.modules)
    """)
    assert out == "False"


def test_asyncio_outside_trio_is_unchanged_after_a_run(dsn: str) -> None:
    """The library's own trio run brings trio-asyncio in; asyncio elsewhere keeps its loops,
    in this thread and in others."""
    out = run_python("""
        import asyncio, os, threading
        loop_type = type(asyncio.new_event_loop())
        policy = asyncio.get_event_loop_policy()
        import trio
        import nasiko_queue as nq

        async def use_the_database() -> int:
            async with nq.open_database(os.environ["DSN"]) as db:
                return await db.fetchval("SELECT 41 + 1")

        assert trio.run(use_the_database) == 42

        async def plain_asyncio() -> str:
            return type(asyncio.get_running_loop()).__name__

        assert type(asyncio.new_event_loop()) is loop_type
        assert asyncio.get_event_loop_policy() is policy
        seen = []
        thread = threading.Thread(target=lambda: seen.append(type(asyncio.new_event_loop())))
        thread.start()
        thread.join()
        assert seen == [loop_type], seen
        print(asyncio.run(plain_asyncio()))
    """, DSN=dsn)
    assert out == "_UnixSelectorEventLoop"
