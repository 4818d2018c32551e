"""
The ``nasiko-queue`` console script's first line of code, outside the package.

A Ctrl-C while Python is still importing the command (the first few tenths of a
second of ``nasiko-queue worker``) raised KeyboardInterrupt from deep inside some
import and printed its traceback. Importing the package runs its imports before
any code of the package could catch that, so the script starts here: SIGINT ends
the process quietly (status 130, as a shell reports an interrupt) until the
command is imported, then the usual handling is back (trio's, then the worker's
own: the first signal stops gracefully, a second at once).
"""

from __future__ import annotations

import os
import signal
from types import FrameType

#: Exit status of a process ended by SIGINT, as shells report it.
_INTERRUPTED = 130


def _quietly(_signum: int, _frame: FrameType | None) -> None:
    os._exit(_INTERRUPTED)  # nothing is open yet: no cleanup to skip


def main() -> None:
    """Run the ``nasiko-queue`` command."""
    before = signal.signal(signal.SIGINT, _quietly)
    try:
        from nasiko_queue.command import main as command
    finally:
        signal.signal(signal.SIGINT, before)
    command()
