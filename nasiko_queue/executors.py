"""
Executors: the application's code for each kind of job, and what it is given.

The worker loop knows nothing of any kind. An application registers one
executor per payload type; a replica runs (and claims) only the kinds it has
executors for. A build job's executor reports its outcome the way the
original's do: by writing the job's build row ('success' or 'failed').
Returning means "look at the build row"; raising means the run crashed (a
"panic") and is retried while attempts are left. A plain job's executor
(`JobArgs` types) returns for done and raises for a retry after its backoff.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator
from typing import Any, Generic, TypeVar, overload
from uuid import UUID

import attrs

from .database import Database
from .job_args import Backoff, BackoffFn, JobArgs
from .payloads import Payload, Target

P = TypeVar("P", bound=Payload)
A = TypeVar("A", bound=JobArgs)


@attrs.frozen(kw_only=True)
class JobContext(Generic[P]):
    """Everything an executor gets for one run of one job."""

    #: `build_jobs.id`.
    job_id: UUID
    #: Which run this is, 1-based (the row's attempt after the claim).
    attempt: int
    #: The parsed payload; sealed fields (the `env` of Upload, Clone, GithubClone and
    #: McpServerUpload) are decrypted: `ctx.payload.env["KEY"].reveal()`.
    payload: P
    #: `build_jobs.owner_id`: the user who caused the job.
    owner_id: UUID
    #: The agent or connector the job builds.
    target: Target
    #: The queue's database, for the executor's own writes (its build row).
    db: Database


Executor = Callable[[JobContext[P]], Awaitable[None]]


@attrs.frozen(kw_only=True)
class PlainJobContext(Generic[A]):
    """Everything a plain job's executor gets for one run."""

    #: `nasiko_queue_jobs.id`.
    job_id: UUID
    #: Which run this is, 1-based, and how many it may have.
    attempt: int
    max_attempts: int
    #: The queue it was claimed from.
    queue: str
    #: The parsed arguments, sealed fields opened.
    payload: A
    #: The queue's database, for the executor's own writes.
    db: Database


PlainExecutor = Callable[[PlainJobContext[A]], Awaitable[None]]
#: The backoff of plain jobs whose registration names none.
DEFAULT_BACKOFF: BackoffFn = Backoff()


class Executors:
    """
    The registry of executors, one per payload kind.

    >>> executors = Executors()
    >>> @executors.register(Upload)
    ... async def build_upload(ctx: JobContext[Upload]) -> None: ...

    Registering a user-defined `Payload` subclass also teaches the worker to
    parse it (docs/rules.md §2: an application may add job kinds of its own).
    """

    def __init__(self) -> None:
        self._entries: dict[str, tuple[type[Payload], Executor[Payload]]] = {}
        self._plain: dict[str, tuple[type[JobArgs], PlainExecutor[JobArgs]]] = {}
        self._timeouts: dict[str, float] = {}
        self._backoffs: dict[str, BackoffFn] = {}

    @overload
    def register(self, payload_type: type[P], *, timeout: float | None = None
                 ) -> Callable[[Executor[P]], Executor[P]]: ...

    @overload
    def register(self, payload_type: type[P], executor: Executor[P], *,
                 timeout: float | None = None) -> Executor[P]: ...

    @overload
    def register(self, payload_type: type[A], *, timeout: float | None = None,
                 backoff: BackoffFn | None = None
                 ) -> Callable[[PlainExecutor[A]], PlainExecutor[A]]: ...

    @overload
    def register(self, payload_type: type[A], executor: PlainExecutor[A], *,
                 timeout: float | None = None,
                 backoff: BackoffFn | None = None) -> PlainExecutor[A]: ...

    def register(
        self, payload_type: type[Any], executor: Callable[[Any], Awaitable[None]] | None = None,
        *, timeout: float | None = None, backoff: BackoffFn | None = None,
    ) -> Any:
        """
        Register `executor` for `payload_type` (a build `Payload` or a plain
        `JobArgs`); usable as a decorator.

        Args:
            timeout: run-time limit of one run, in seconds (default:
                `QueueConfig.job_timeout`, none unless set). A run past it is
                cancelled and counts as a crash: a build job is retried at once
                while attempts remain, else failed `job panicked during
                execution`; a plain job is retried after its backoff.
            backoff: plain jobs only: seconds to wait before the run after a
                crashed one, from the attempt that crashed (default:
                `Backoff()`, 16 s, 31 s, 96 s, ... with ±10 % jitter).
        """
        if timeout is not None and timeout <= 0:
            raise ValueError(f"timeout must be > 0, got {timeout!r}")
        plain = isinstance(payload_type, type) and issubclass(payload_type, JobArgs)
        if backoff is not None and not plain:
            raise ValueError(f"{payload_type.__name__} is a build payload: its retries follow "
                             "the build rule (at once, max_attempts runs); backoff is for "
                             "plain jobs")

        def add(fn: Callable[[Any], Awaitable[None]]) -> Callable[[Any], Awaitable[None]]:
            kind = payload_type.kind
            if kind in self._entries or kind in self._plain:
                raise ValueError(f"an executor for kind {kind!r} is already registered")
            if plain:
                self._plain[kind] = (payload_type, fn)
                self._backoffs[kind] = backoff or DEFAULT_BACKOFF
            else:
                self._entries[kind] = (payload_type, fn)
            if timeout is not None:
                self._timeouts[kind] = timeout
            return fn

        return add if executor is None else add(executor)

    def executor_for(self, kind: str) -> Executor[Payload] | None:
        entry = self._entries.get(kind)
        return None if entry is None else entry[1]

    def timeout_for(self, kind: str) -> float | None:
        """The run-time limit registered for `kind`, if any."""
        return self._timeouts.get(kind)

    def plain_executor_for(self, kind: str) -> PlainExecutor[JobArgs] | None:
        entry = self._plain.get(kind)
        return None if entry is None else entry[1]

    def backoff_for(self, kind: str) -> BackoffFn:
        """The backoff registered for plain kind `kind` (the default if none)."""
        return self._backoffs.get(kind, DEFAULT_BACKOFF)

    @property
    def kinds(self) -> frozenset[str]:
        """The build kinds a worker with this registry claims from build_jobs and runs."""
        return frozenset(self._entries)

    @property
    def plain_kinds(self) -> frozenset[str]:
        """The plain job kinds it runs."""
        return frozenset(self._plain)

    @property
    def payload_types(self) -> tuple[type[Payload], ...]:
        return tuple(t for t, _ in self._entries.values())

    @property
    def plain_types(self) -> tuple[type[JobArgs], ...]:
        return tuple(t for t, _ in self._plain.values())

    def __len__(self) -> int:
        return len(self._entries) + len(self._plain)

    def __iter__(self) -> Iterator[str]:
        yield from self._entries
        yield from self._plain
