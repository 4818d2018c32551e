"""
A private PostgreSQL server for the demo and for tests run without a DSN.

It needs nothing beyond `pip install nasiko-queue`: the server binaries come
from the `pgserver` wheel when the machine has no PostgreSQL of its own (a
system installation, found through PATH or /usr/lib/postgresql, is preferred).
The server listens on 127.0.0.1 on a free port and on a socket in its own data
folder, runs with fsync off (it is for throw-away data), and is removed on exit.

PostgreSQL refuses to run as root; when we are root, the server runs as the
system user `postgres` if there is one, else as `nobody` (a user `nasiko-pg` is
created only where neither exists).
"""

from __future__ import annotations

import logging
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import TracebackType
from urllib.parse import urlsplit, urlunsplit

from ..errors import NasikoQueueError

log = logging.getLogger("nasiko_queue.embedded")


class EmbeddedPostgresError(NasikoQueueError):
    """The embedded PostgreSQL server could not be started."""


def find_bindir() -> Path:
    """Where initdb, pg_ctl and postgres live: env, system, then the pgserver wheel."""
    candidates: list[Path] = []
    if env := os.environ.get("NASIKO_QUEUE_PG_BIN"):
        candidates.append(Path(env))
    if found := shutil.which("pg_ctl"):
        candidates.append(Path(found).resolve().parent)
    system = sorted(
        Path("/usr/lib/postgresql").glob("*/bin"),
        key=lambda p: int(p.parent.name) if p.parent.name.isdigit() else 0,
        reverse=True,
    )
    candidates.extend(system)
    for c in candidates:
        if _has_server(c):
            return c
    # Imported only when needed: importing pgserver has side effects (a runtime
    # folder, a warning when XDG_RUNTIME_DIR is unset).
    try:
        import pgserver._commands as pgs
    except ImportError:
        pass
    else:
        wheel = Path(pgs.POSTGRES_BIN_PATH)
        if _has_server(wheel):
            return wheel
    raise EmbeddedPostgresError(
        "no PostgreSQL binaries found: install the 'embedded' extra "
        "(pip install 'nasiko-queue[embedded]', which brings pgserver's) or PostgreSQL "
        "itself, or set NASIKO_QUEUE_PG_BIN"
    )


def _has_server(bindir: Path) -> bool:
    return all((bindir / exe).exists() for exe in ("initdb", "pg_ctl", "postgres"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _server_user() -> str | None:
    if os.geteuid() != 0:
        return None
    # Prefer an account that exists: PostgreSQL's own, or `nobody`; create one
    # only on a machine that has neither.
    for name in ("postgres", "nobody", "nasiko-pg"):
        try:
            pwd.getpwnam(name)
            return name
        except KeyError:
            continue
    subprocess.run(["useradd", "--system", "--no-create-home", "nasiko-pg"],  # noqa: S607
                   check=True, capture_output=True)
    return "nasiko-pg"


def with_database(dsn: str, database: str) -> str:
    """The same DSN naming another database."""
    parts = urlsplit(dsn)
    return urlunsplit(parts._replace(path="/" + database))


class EmbeddedPostgres:
    """
    Start a throw-away PostgreSQL server; `stop()`/`start()` restart it in place.

    >>> with EmbeddedPostgres() as server:
    ...     print(server.dsn)     # postgresql://postgres@127.0.0.1:PORT/postgres
    """

    def __init__(self, *, port: int | None = None, fsync: bool = False) -> None:
        self.bindir = find_bindir()
        self.port = port or _free_port()
        self._fsync = fsync
        self._user = _server_user()
        self.datadir = Path(tempfile.mkdtemp(prefix="nasiko-pg-"))
        self._running = False
        self._initdb()

    @property
    def dsn(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def _run(self, *args: str) -> subprocess.CompletedProcess[str]:
        try:
            return subprocess.run(  # noqa: S603 (our own binaries, arguments we built)
                [str(self.bindir / args[0]), *args[1:]],
                check=True,
                capture_output=True,
                text=True,
                user=self._user,
                cwd=self.datadir,
                timeout=120,
            )
        except subprocess.CalledProcessError as exc:
            log = self.datadir / "data" / "server.log"
            tail = log.read_text()[-2000:] if log.exists() else ""
            raise EmbeddedPostgresError(
                f"{args[0]} failed: {exc.stderr.strip() or exc.stdout.strip()}\n{tail}"
            ) from exc

    def _initdb(self) -> None:
        if self._user is not None:
            entry = pwd.getpwnam(self._user)
            os.chown(self.datadir, entry.pw_uid, entry.pw_gid)
        self._run("initdb", "-D", str(self.datadir / "data"), "-U", "postgres",
                  "--auth=trust", "-E", "UTF8", "--no-sync", "--locale=C")

    def start(self) -> None:
        """Start (or start again after `stop()`) on the same port and data."""
        options = (
            f"-h 127.0.0.1 -p {self.port} -k {self.datadir} "
            f"-c fsync={'on' if self._fsync else 'off'} -c max_connections=200"
        )
        self._run("pg_ctl", "-D", str(self.datadir / "data"), "-o", options,
                  "-l", str(self.datadir / "data" / "server.log"), "-w", "start")
        self._running = True

    def stop(self, mode: str = "fast") -> None:
        """Stop the server: 'fast' (disconnect clients) or 'immediate' (crash-like)."""
        if self._running:
            self._run("pg_ctl", "-D", str(self.datadir / "data"), "-m", mode, "-w", "stop")
            self._running = False

    def cleanup(self) -> None:
        try:
            self.stop("immediate")
        finally:
            shutil.rmtree(self.datadir, ignore_errors=True)

    def __enter__(self) -> EmbeddedPostgres:
        try:
            self.start()
        except BaseException:
            shutil.rmtree(self.datadir, ignore_errors=True)
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.cleanup()


@contextmanager
def local_database(env: str = "DATABASE_URL") -> Iterator[str]:
    """
    A DSN for an example or a tool: the environment variable `env` when it is set,
    else a throw-away PostgreSQL started for the block and removed after it.

    >>> with local_database() as dsn:
    ...     trio.run(main, dsn)

    The throw-away server is `EmbeddedPostgres` (the machine's PostgreSQL binaries,
    else the `pgserver` wheel's): its data is gone when the block ends.
    """
    if dsn := os.environ.get(env):
        yield dsn
        return
    log.info("%s is not set: starting a throw-away PostgreSQL", env)
    with EmbeddedPostgres() as server:
        yield server.dsn
