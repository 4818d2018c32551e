"""``python -m nasiko_queue``: the same command as ``nasiko-queue``."""

from .cli import main

main(prog_name="nasiko-queue")
