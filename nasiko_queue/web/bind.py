"""
Where the HTTP service listens: `--http HOST:PORT`, parsed without the [http] extra
(the CLI refuses a bad value before it imports anything of it).
"""

from __future__ import annotations

import errno
from collections.abc import Iterator
from contextlib import contextmanager

from ..errors import CannotListen

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 9181


def parse_bind(spec: str) -> tuple[str, int]:
    """
    "HOST:PORT" to (host, port); ValueError for anything else. An IPv6 host goes
    in brackets ("[::1]:9181"); an empty host (":9181") is 127.0.0.1; port 0 is
    any free port.
    """
    host, sep, port_text = spec.strip().rpartition(":")
    if not sep or not port_text.isdigit():
        raise ValueError(f"{spec!r} is not HOST:PORT (e.g. 127.0.0.1:9181)")
    port = int(port_text)
    if port > 65535:
        raise ValueError(f"{spec!r}: the port must be between 0 and 65535")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        raise ValueError(f"{spec!r}: put an IPv6 address in brackets, e.g. [::1]:9181")
    if any(c.isspace() for c in host):
        raise ValueError(f"{spec!r}: the host has spaces in it")
    return host or DEFAULT_HOST, port


#: The errors of a bind the operator can fix, as they are reported.
_BIND_ERRORS = {
    errno.EADDRINUSE: "address already in use",
    errno.EADDRNOTAVAIL: "no such address on this machine",
    errno.EACCES: "permission denied (a port under 1024 needs privileges)",
}


def _leaves(exc: BaseException) -> Iterator[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            yield from _leaves(inner)
    else:
        yield exc


@contextmanager
def reporting_bind_errors(where: str) -> Iterator[None]:
    """
    Turn a failed bind inside the block (hypercorn's, through any nursery) into
    `CannotListen` naming `where`: "cannot listen on 127.0.0.1:9182: address
    already in use", not an OSError that reads like a database failure.
    """
    try:
        yield
    except BaseException as exc:
        for leaf in _leaves(exc):
            if isinstance(leaf, OSError) and leaf.errno in _BIND_ERRORS:
                raise CannotListen(
                    f"cannot listen on {where}: {_BIND_ERRORS[leaf.errno]}") from None
        raise
