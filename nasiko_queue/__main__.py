"""``python -m nasiko_queue``: the same command as ``nasiko-queue``."""

from .command import main

main()
