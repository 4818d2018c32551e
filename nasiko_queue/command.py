"""
The ``nasiko-queue`` console script: the CLI, or one line saying which extra it needs.

The command line's toolkits (click, rich) are the ``cli`` extra, not the core: an
application that embeds the queue needs neither. The script is installed with the
package all the same, so this entry point imports the CLI inside a guard and turns
a missing toolkit into the pip line that brings it, and a Ctrl-C while Python is
still importing into a quiet exit, rather than a traceback.
"""

from __future__ import annotations

import sys

#: The modules of the ``cli`` extra.
_CLI_EXTRA = frozenset({"click", "rich"})

#: Exit status of a process ended by SIGINT, as shells report it.
_INTERRUPTED = 130


def main() -> None:
    """Run the ``nasiko-queue`` command."""
    try:
        from .cli import main as cli
    except ModuleNotFoundError as exc:
        if (exc.name or "").partition(".")[0] not in _CLI_EXTRA:
            raise
        sys.exit(f"nasiko-queue: the command line needs the 'cli' extra ({exc.name} is "
                 "not installed): pip install 'nasiko-queue[cli]'")
    except KeyboardInterrupt:
        sys.exit(_INTERRUPTED)
    cli(prog_name="nasiko-queue")
