"""
A TCP proxy in front of PostgreSQL, for tests of a network that misbehaves.

The proxy is the executor's "outside world" of the database layer: the server
and the driver stay real, only the wire between them is slowed or stopped, as a
slow network, a loaded server or a connection that hangs without a reset would.

* `freeze()` stops forwarding on every connection open at that moment, in both
  directions, without closing anything (a hung connection: no RST, no FIN);
  connections opened afterwards flow normally. `partition()` freezes the new
  ones too (a network cut: nothing gets through, nothing is refused).
* `delay_replies(seconds)` holds every chunk the server sends, on every
  connection, for that long before passing it on (a late answer). The client's
  own bytes still go straight through, so the server does the work and commits.
* `cut_on(marker)` closes the first connection that sends a chunk holding
  `marker` (say, a statement's text on its way to the server), instead of
  passing that chunk on: a connection lost between two statements, the server
  having answered the first and never seen the second.
* `refuse()` closes every connection and each new one as soon as it comes (a
  server restarting: refused, not hung).
* `restore()` undoes the freezes, the delay and the refusal.
"""

from __future__ import annotations

from urllib.parse import urlsplit, urlunsplit

import attrs
import trio


@attrs.define(eq=False)
class _Link:
    frozen: bool = False
    thawed: trio.Event = attrs.Factory(trio.Event)
    #: The link's pumps: cancelled to close both ways (`refuse`).
    scope: trio.CancelScope | None = None


class Proxy:
    """Forwards 127.0.0.1:`port` to the server named by `dsn`; see the module docstring."""

    def __init__(self, dsn: str) -> None:
        parts = urlsplit(dsn)
        self._target = (parts.hostname or "127.0.0.1", parts.port or 5432)
        self._dsn = dsn
        self._links: set[_Link] = set()
        self._reply_delay = 0.0
        self._partitioned = False
        self._refusing = False
        self._cut_marker: bytes | None = None
        #: Set when `cut_on` has closed a connection.
        self.cut = trio.Event()
        self.port = 0
        #: Connections accepted so far.
        self.accepted = 0

    def dsn(self) -> str:
        """The same DSN, through the proxy."""
        parts = urlsplit(self._dsn)
        netloc = parts.netloc.rsplit("@", 1)
        auth = netloc[0] + "@" if len(netloc) == 2 else ""
        return urlunsplit(parts._replace(netloc=f"{auth}127.0.0.1:{self.port}"))

    def freeze(self) -> None:
        for link in self._links:
            link.frozen = True

    def partition(self) -> None:
        self._partitioned = True
        self.freeze()

    def refuse(self) -> None:
        """The server is down (a restart): every link closes, and a new
        connection is closed as soon as it is accepted, until `restore`."""
        self._refusing = True
        for link in self._links:
            if link.scope is not None:
                link.scope.cancel()

    def delay_replies(self, seconds: float) -> None:
        self._reply_delay = seconds

    def cut_on(self, marker: bytes) -> None:
        self._cut_marker = marker

    def restore(self) -> None:
        self._reply_delay = 0.0
        self._partitioned = False
        self._refusing = False
        for link in self._links:
            link.frozen = False
            link.thawed.set()
            link.thawed = trio.Event()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        self.port = listeners[0].socket.getsockname()[1]
        async with trio.open_nursery() as nursery:
            task_status.started()
            await trio.serve_listeners(self._serve, listeners, handler_nursery=nursery)

    async def _serve(self, client: trio.SocketStream) -> None:
        self.accepted += 1
        if self._refusing:
            await client.aclose()
            return
        link = _Link(frozen=self._partitioned)
        self._links.add(link)
        try:
            server = await trio.open_tcp_stream(*self._target)
        except OSError:
            await client.aclose()
            return
        try:
            async with client, server, trio.open_nursery() as nursery:
                link.scope = nursery.cancel_scope
                nursery.start_soon(self._pump, client, server, link, False, nursery.cancel_scope)
                nursery.start_soon(self._pump, server, client, link, True, nursery.cancel_scope)
        finally:
            self._links.discard(link)

    async def _pump(self, src: trio.SocketStream, dst: trio.SocketStream, link: _Link,
                    reply: bool, scope: trio.CancelScope) -> None:
        try:
            while True:
                data = await src.receive_some(65536)
                if not data:
                    break
                while link.frozen:
                    await link.thawed.wait()
                if not reply and self._cut_marker is not None and self._cut_marker in data:
                    self._cut_marker = None  # one connection, once
                    self.cut.set()
                    break  # close both ways: the chunk never reaches the server
                if reply and self._reply_delay:
                    await trio.sleep(self._reply_delay)  # the slow network itself
                await dst.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        scope.cancel()
