"""
Ctrl-C and SIGTERM for a worker run from `trio.run`, handled as the CLI handles them.

The first SIGINT or SIGTERM stops gracefully (`Worker.stop`: nothing more is claimed,
the running jobs finish); a second stops at once (the running jobs are cancelled and
go back to pending, docs/rules.md §8). `run_worker` returns 0 after a graceful stop
and `EXIT_HARD_STOP` (130, as a shell reports Ctrl-C) after a hard one, so that
``sys.exit(trio.run(main))`` exits the way `nasiko-queue worker` does, with one
line on stderr and no traceback.
"""

from __future__ import annotations

import logging
import signal
from collections.abc import AsyncIterator, Callable

import attrs
import trio

from ..plain.schedules import Scheduler
from .state import WorkerStats
from .worker import Worker

log = logging.getLogger("nasiko_queue.signals")

#: Exit code of a process stopped by a second signal (128 + SIGINT, as shells
#: report Ctrl-C), so that scripts can tell a hard stop from a clean one.
EXIT_HARD_STOP = 130


@attrs.define
class Shutdown:
    """What the signals asked for so far (the first stops gently, the second at once)."""

    graceful: bool = False
    hard: bool = False
    #: Set by the first signal (wakes a worker still waiting for its database).
    requested: trio.Event = attrs.Factory(trio.Event)


async def watch_signals(signals: AsyncIterator[int], stop: Callable[[], None] | None,
                        scope: trio.CancelScope, shutdown: Shutdown, *,
                        logger: logging.Logger = log, level: int = logging.WARNING) -> None:
    """First signal: `stop()` (graceful; with no `stop`, cancel `scope`: nothing runs
    that could finish). Second: cancel `scope`, a hard stop."""
    async for signum in signals:
        name = signal.Signals(signum).name
        if not shutdown.graceful:
            shutdown.graceful = True
            shutdown.requested.set()
            if stop is None:
                logger.log(level, "%s: stopping", name)
                scope.cancel()
                return
            logger.log(level, "%s: stopping once the running jobs finish "
                       "(send it again to stop now)", name)
            stop()
        else:
            shutdown.hard = True
            logger.warning("%s again: stopping now; running jobs go back to pending", name)
            scope.cancel()
            return


async def run_worker(runner: Worker | Scheduler, *,
                     until: Callable[[WorkerStats], bool] | None = None,
                     task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> int:
    """
    Run a `Worker` (or a lone `Scheduler`) until it stops, with SIGINT and SIGTERM handled.

    It stops when `worker.stop()` is called, when `until(worker.stats)` holds (a
    graceful stop; e.g. ``until=lambda stats: stats.done >= 3``), or on a signal:
    the first stops gracefully, the second at once. Returns 0, or 130 after a hard
    stop. With `nursery.start` it is started once the worker is (and the signals
    are handled from then on). A `Scheduler` has nothing to finish: the first
    signal stops it. Must run in the main thread (signals are delivered there).
    """
    if until is not None and not isinstance(runner, Worker):
        raise TypeError("until= needs a Worker (it reads worker.stats)")
    shutdown = Shutdown()
    stop = runner.stop if isinstance(runner, Worker) else None
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch_signals, signals, stop, nursery.cancel_scope, shutdown)

            async def run(*, task_status: trio.TaskStatus[None]) -> None:
                await runner.run(task_status=task_status)
                nursery.cancel_scope.cancel()  # stopped: the watchers too

            await nursery.start(run)
            if until is not None and isinstance(runner, Worker):
                worker = runner

                async def stop_when_until_holds() -> None:
                    await worker.wait_for(until)
                    worker.stop()

                nursery.start_soon(stop_when_until_holds)
            log.info("running until stopped: Ctrl-C or SIGTERM once lets the running jobs "
                     "finish, twice stops at once")
            task_status.started()
    return EXIT_HARD_STOP if shutdown.hard else 0
