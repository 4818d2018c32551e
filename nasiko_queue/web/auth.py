"""
The dashboard's front door: who may act (sessions, the login form's CSRF token,
throttled failed logins) and which `Host` it answers (DNS rebinding).

- `Sessions`: a bounded, expiring server-side store. A session ends after
  `idle` seconds unused or `lifetime` seconds after the login, whichever comes
  first; at most `max_sessions` live at once, the least recently used evicted
  to make room for a new one.
- `LoginThrottle`: failed logins (and wrong ``Authorization: Bearer`` tokens)
  per client address, in a fixed window: after `max_failures` in `window`
  seconds, every attempt from that address is refused (429) until the window
  ends, a right token too, so guessing gains nothing from the refusal.
- `HostCheck`: an ASGI middleware refusing (421) a request whose `Host` header
  is neither the address it arrived on (host:port, `localhost` too on a
  loopback address) nor a configured name. A DNS-rebinding page reaches the
  dashboard under its own name, which is never either.

Every secret comparison is `hmac.compare_digest`.

No JavaScript and no extra dependency; the clock is injectable for tests.
"""

from __future__ import annotations

import hmac
import ipaddress
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable

import attrs

try:
    from starlette.datastructures import Headers
    from starlette.responses import PlainTextResponse
    from starlette.types import ASGIApp, Receive, Scope, Send
except ImportError as exc:  # pragma: no cover - exercised without the extra only
    raise ImportError(
        "the dashboard needs the [http] extra: pip install 'nasiko-queue[http]' "
        f"({exc})") from exc

__all__ = [
    "DEFAULT_IDLE",
    "DEFAULT_LIFETIME",
    "DEFAULT_MAX_SESSIONS",
    "HostCheck",
    "LoginThrottle",
    "Session",
    "Sessions",
    "same_secret",
]

#: A session unused for this long (seconds) is gone: 30 minutes.
DEFAULT_IDLE = 30 * 60.0
#: A session ends this long (seconds) after its login, used or not: 12 hours.
DEFAULT_LIFETIME = 12 * 3600.0
#: Sessions held at once; a login beyond it evicts the least recently used.
DEFAULT_MAX_SESSIONS = 1000
#: Failed logins per address and window before the address is refused (429).
DEFAULT_MAX_FAILURES = 5
#: The throttle's window, seconds.
DEFAULT_WINDOW = 60.0
#: Client addresses the throttle remembers; the oldest window is forgotten first.
DEFAULT_MAX_ADDRESSES = 10_000

Clock = Callable[[], float]


def same_secret(given: str, expected: str) -> bool:
    """`given == expected`, in time that does not depend on where they differ."""
    return hmac.compare_digest(given.encode(), expected.encode())


@attrs.define
class Session:
    csrf: str
    created: float
    used: float


@attrs.define
class Sessions:
    """Server-side sessions by random id; expiring and bounded (see the module)."""

    idle: float = DEFAULT_IDLE
    lifetime: float = DEFAULT_LIFETIME
    max_sessions: int = DEFAULT_MAX_SESSIONS
    clock: Clock = time.monotonic
    _by_id: OrderedDict[str, Session] = attrs.field(init=False, factory=OrderedDict)

    def __attrs_post_init__(self) -> None:
        if self.idle <= 0 or self.lifetime <= 0 or self.max_sessions < 1:
            raise ValueError("session idle and lifetime must be positive, "
                             "max_sessions at least 1")

    def __len__(self) -> int:
        return len(self._by_id)

    def new(self) -> tuple[str, Session]:
        """A new session; its id goes in the cookie."""
        now = self.clock()
        self._expire(now)
        while len(self._by_id) >= self.max_sessions:
            self._by_id.popitem(last=False)
        sid = secrets.token_urlsafe(32)
        session = Session(csrf=secrets.token_urlsafe(32), created=now, used=now)
        self._by_id[sid] = session
        return sid, session

    def get(self, sid: str | None, *, touch: bool = True) -> Session | None:
        """The live session `sid` names, or None. `touch`: it is being used now (an
        action, a page asked for); not when a page merely shows who is logged in,
        as its own refresh does every few seconds, or an unattended tab would
        keep its session alive until its lifetime ends."""
        if not sid:
            return None
        session = self._by_id.get(sid)
        if session is None:
            return None
        now = self.clock()
        if self._expired(session, now):
            del self._by_id[sid]
            return None
        if touch:
            session.used = now
            self._by_id.move_to_end(sid)
        return session

    def end(self, sid: str | None) -> None:
        if sid:
            self._by_id.pop(sid, None)

    def _expired(self, session: Session, now: float) -> bool:
        return now - session.used >= self.idle or now - session.created >= self.lifetime

    def _expire(self, now: float) -> None:
        # Least recently used first: stop at the first one still fresh by use.
        while self._by_id:
            sid, session = next(iter(self._by_id.items()))
            if not self._expired(session, now):
                # A later one may have outlived `lifetime` though used recently;
                # `get` drops those when they are next presented.
                return
            del self._by_id[sid]


@attrs.define
class _Window:
    start: float
    failures: int = 0


@attrs.define
class LoginThrottle:
    """Failed logins per client address, in fixed windows (see the module)."""

    max_failures: int = DEFAULT_MAX_FAILURES
    window: float = DEFAULT_WINDOW
    max_addresses: int = DEFAULT_MAX_ADDRESSES
    clock: Clock = time.monotonic
    _by_address: OrderedDict[str, _Window] = attrs.field(init=False, factory=OrderedDict)

    def retry_after(self, address: str) -> float | None:
        """Seconds until `address` may try again, or None if it may now."""
        entry = self._by_address.get(address)
        if entry is None:
            return None
        left = entry.start + self.window - self.clock()
        if left <= 0:
            del self._by_address[address]
            return None
        return left if entry.failures >= self.max_failures else None

    def failed(self, address: str) -> None:
        now = self.clock()
        entry = self._by_address.get(address)
        if entry is None or now - entry.start >= self.window:
            self._by_address.pop(address, None)
            while len(self._by_address) >= self.max_addresses:
                self._by_address.popitem(last=False)
            entry = self._by_address[address] = _Window(start=now)
        entry.failures += 1

    def message(self, retry_after: float) -> str:
        return (f"too many failed logins from this address ({self.max_failures} in "
                f"{self.window:.0f} s): try again in {retry_after:.0f} s")


def _split_host(value: str) -> tuple[str, int | None] | None:
    """A `Host` header's (host, port); None when it is not one."""
    value = value.strip().lower()
    if value.startswith("["):
        end = value.find("]")
        if end < 0:
            return None
        host, rest = value[1:end], value[end + 1:]
        if rest and not rest.startswith(":"):
            return None
        port_text = rest[1:] if rest else ""
    else:
        host, _, port_text = value.partition(":")
    if port_text and not port_text.isdigit():
        return None
    return host.rstrip("."), int(port_text) if port_text else None


def local_path(target: str | None, default: str = "/") -> str:
    """
    `target` if it is a path of this site, else `default` (no open redirect):
    it starts with one "/", and holds no backslash, no whitespace and no control
    character, which browsers drop or read as "/" ("/\t/evil.example" is
    "//evil.example" to them: another site).
    """
    target = target or default
    if (not target.startswith("/") or target.startswith("//") or "\\" in target
            or any(c.isspace() or not c.isprintable() for c in target)):
        return default
    return target


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _unmapped(host: str) -> str:
    """An IPv4 address as itself where a dual-stack socket reports it IPv4-mapped
    (``::ffff:127.0.0.1`` for a client of 127.0.0.1 on a server bound to ``::``)."""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return host
    mapped = getattr(address, "ipv4_mapped", None)
    return str(mapped) if mapped is not None else host


@attrs.define
class HostCheck:
    """
    ASGI middleware: only requests whose `Host` is the address they arrived on
    (`localhost` too, when that is a loopback address) or one of `allowed`
    reach `app`; the rest get a plain 421.

    An entry of `allowed` is a name ("queue.example.com", any port) or a name
    with a port ("queue.example.com:8443", only that port).
    """

    app: ASGIApp
    allowed: Iterable[str] = ()
    _names: set[str] = attrs.field(init=False, factory=set)
    _with_port: set[tuple[str, int]] = attrs.field(init=False, factory=set)

    def __attrs_post_init__(self) -> None:
        for entry in self.allowed:
            parsed = _split_host(entry)
            if parsed is None or not parsed[0]:
                raise ValueError(f"{entry!r} is not a host name (or name:port)")
            name, port = parsed
            if port is None:
                self._names.add(name)
            else:
                self._with_port.add((name, port))

    def ok(self, scope: Scope) -> bool:
        parsed = _split_host(Headers(scope=scope).get("host", ""))
        if parsed is None or not parsed[0]:
            return False
        host, port = parsed
        default_port = 443 if scope.get("scheme") in ("https", "wss") else 80
        port = default_port if port is None else port
        if host in self._names or (host, port) in self._with_port:
            return True
        server = scope.get("server")
        if not server:
            return False
        server_host = _unmapped(str(server[0]).lower())
        server_port = default_port if server[1] is None else int(server[1])
        if port != server_port:
            return False
        return host == server_host or (host == "localhost" and _is_loopback(server_host))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and not self.ok(scope):
            response = PlainTextResponse(
                "misdirected request: this dashboard answers only to the address it "
                "listens on or a name given with --allowed-host", 421)
            await response(scope, receive, send)
            return
        if scope["type"] == "websocket" and not self.ok(scope):
            await send({"type": "websocket.close", "code": 1008})
            return
        await self.app(scope, receive, send)
