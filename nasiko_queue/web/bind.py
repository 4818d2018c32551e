"""
Where the HTTP service listens: `--http HOST:PORT`, parsed without the [http] extra
(the CLI refuses a bad value before it imports anything of it); and the
dashboard's login URL printed at start-up.
"""

from __future__ import annotations

import errno
import secrets
from collections.abc import Iterator
from contextlib import contextmanager

from ..errors import CannotListen, leaves

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 9181
#: Where the dashboard's token comes from (never the command line: `ps` shows that).
DASHBOARD_TOKEN_ENV = "NASIKO_QUEUE_DASHBOARD_TOKEN"  # noqa: S105 (a variable's name)


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
        for leaf in leaves(exc):
            if isinstance(leaf, OSError) and leaf.errno in _BIND_ERRORS:
                raise CannotListen(
                    f"cannot listen on {where}: {_BIND_ERRORS[leaf.errno]}") from None
        raise


def new_token() -> str:
    """A dashboard token for this run, when none is given (128+ random bits)."""
    return secrets.token_urlsafe(24)


def login_url(host: str, port: int, token: str) -> str:
    """
    The one-time login URL printed at start-up (as Jupyter does): opening it logs
    the browser in, and the dashboard redirects to drop the token from the
    address bar. A wildcard bind is reached on the loopback address.
    """
    if host in ("", "0.0.0.0"):  # noqa: S104 (reading a bind, not binding)
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{port}/login?token={token}"


def login_message(url: str) -> str:
    """What the CLI prints (once, on stderr; the token is never logged) for `url`."""
    return (f"log in at {url}\n"
            f"  (a token made for this run, shown only here; set {DASHBOARD_TOKEN_ENV} "
            "to choose your own)")
