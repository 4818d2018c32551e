"""
Where the HTTP service listens: `--http HOST:PORT`, parsed without the [http] extra
(the CLI refuses a bad value before it imports anything of it).
"""

from __future__ import annotations

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
