"""
Executors: the application's code for each kind of job, and what it is given.

The worker loop knows nothing of any kind. An application registers one
executor per payload type; a replica runs (and claims) only the kinds it has
executors for. An executor reports its outcome the way the original's do: by
writing the job's build row ('success' or 'failed'). Returning means "look at
the build row"; raising means the run crashed (a "panic") and is retried while
attempts are left.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator
from typing import Generic, TypeVar, overload
from uuid import UUID

import attrs

from .database import Database
from .payloads import Payload, Target

P = TypeVar("P", bound=Payload)


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
        self._timeouts: dict[str, float] = {}

    @overload
    def register(self, payload_type: type[P], *, timeout: float | None = None
                 ) -> Callable[[Executor[P]], Executor[P]]: ...

    @overload
    def register(self, payload_type: type[P], executor: Executor[P], *,
                 timeout: float | None = None) -> Executor[P]: ...

    def register(
        self, payload_type: type[P], executor: Executor[P] | None = None, *,
        timeout: float | None = None,
    ) -> Executor[P] | Callable[[Executor[P]], Executor[P]]:
        """
        Register `executor` for `payload_type`; usable as a decorator.

        Args:
            timeout: run-time limit of one run, in seconds (default:
                `QueueConfig.job_timeout`, none unless set). A run past it is
                cancelled and counts as a crash: retried at once while attempts
                remain, else failed `job panicked during execution`.
        """
        if timeout is not None and timeout <= 0:
            raise ValueError(f"timeout must be > 0, got {timeout!r}")

        def add(fn: Executor[P]) -> Executor[P]:
            kind = payload_type.kind
            if kind in self._entries:
                raise ValueError(f"an executor for kind {kind!r} is already registered")
            self._entries[kind] = (payload_type, fn)  # type: ignore[assignment]
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

    @property
    def kinds(self) -> frozenset[str]:
        """The kinds a worker with this registry claims and runs."""
        return frozenset(self._entries)

    @property
    def payload_types(self) -> tuple[type[Payload], ...]:
        return tuple(t for t, _ in self._entries.values())

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)
