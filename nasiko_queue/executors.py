"""
Executors: the application's code for each kind of job, and what it is given.

The worker loop knows nothing of any kind. An application registers one
executor per payload type; a replica runs (and claims) only the kinds it has
executors for. A build job's executor reports its outcome the way the
original's do, by writing the job's build row ('success' or 'failed'), or
through its context (`ctx.report_success()`, `ctx.report_failure()`,
`ctx.mark_building()`), which costs no round trip: the worker writes the build
row in the statement that finishes the job (issue #13). Returning means "look
at the build row"; raising means the run crashed (a "panic") and is retried
while attempts are left, and whatever it reported is dropped. A plain job's executor
(`JobArgs` types) returns for done and raises for a retry after its backoff.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator
from typing import Any, Generic, TypeVar, overload
from uuid import UUID

import attrs

from .builds.payloads import Payload, Target
from .db.database import Database
from .engine.contracts import BuildReport
from .plain.args import Backoff, BackoffFn, JobArgs
from .threaded import in_thread, is_async_callable

P = TypeVar("P", bound=Payload)
A = TypeVar("A", bound=JobArgs)


@attrs.define(eq=False)
class RunReport:
    """
    What one run reported through its context: the one mutable part of a frozen
    `JobContext`, shared with the worker's slot, which reads it once the executor
    returns (and drops it when the run crashed).
    """

    #: The last `report_success()` / `report_failure()`; None: nothing reported.
    outcome: BuildReport | None = None
    #: `mark_building()` was called in this run.
    building: bool = False
    #: Queues the start write for the worker's next statement; None for a context
    #: built outside a worker (a unit test of an executor), which only records it.
    on_building: Callable[[], None] | None = None


@attrs.frozen(kw_only=True)
class JobContext(Generic[P]):
    """
    Everything an executor gets for one run of one job.

    An executor reports on its build row (docs/rules.md §5: 'success' makes the job
    done, anything else failed) either by writing the row itself through `db`, as
    the original's executors do, or through this context, which is cheaper: the
    worker writes the row in the statement that records the job's outcome
    (`report_success`, `report_failure`) or in its next statement
    (`mark_building`), so neither costs a round trip of its own. The two ways mix:
    a build row already 'success' or 'failed' when the report is written is left
    as it is, and decides.
    """

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
    _run: RunReport = attrs.field(factory=RunReport, alias="_run", repr=False, eq=False)

    def report_success(self) -> None:
        """
        The build worked: once this run returns, its build row becomes 'success' and
        the job done, in one statement (atomic: both or neither).

        Nothing is written now; the worker's next statement writes it together with
        the job's outcome (a connector build gets `completed_at` too), so it costs
        no round trip. If the run then raises (or times out, or its worker is
        stopped or fenced), nothing reported is written: the crash rules apply. A
        build row that is already 'success' or 'failed' when the statement runs
        (written by the executor itself or by someone else) is left as it is and
        decides the job's outcome; a missing one fails the job. The last report of
        a run wins. The target's own row (the agent's or connector's status, a url)
        is still the executor's to write.
        """
        self._run.outcome = BuildReport.SUCCESS

    def report_failure(self) -> None:
        """
        The build failed in the ordinary way: once this run returns, its build row
        becomes 'failed' and the job failed (`build or deploy step failed …`), in
        one statement, not retried. As for any ordinary failure, the worker does not
        terminalize the target: undoing the agent or connector stays the
        executor's part (docs/rules.md §5, §6). Otherwise as `report_success`.
        """
        self._run.outcome = BuildReport.FAILED

    @property
    def reported(self) -> BuildReport | None:
        """What this run has reported so far (None: nothing)."""
        return self._run.outcome

    def mark_building(self) -> None:
        """
        Ask for the build row to say 'building' (the original executors' first
        write), without waiting for it.

        The write costs no round trip: it rides on the worker's next statement
        once `START_WRITE_DELAY` (5 ms) has passed, batched with the other slots'
        start writes and finishes (alone only when no statement is in flight). So
        it is visible within a few milliseconds, not necessarily before this
        call's next line; a run that reports within the delay never sends it (its
        row goes from 'queued' to the outcome in one write). It changes only a row
        that is still 'queued' ('pending' for a connector build), so it never
        overwrites 'success' or 'failed', however late it lands; it is written
        even if the run then crashes, as the original's first write was. When the
        row must say 'building' before the executor goes on (something else waits
        for it), write it through `db` instead: one round trip. Calling it again
        in a run does nothing.
        """
        run = self._run
        if run.building:
            return
        run.building = True
        if run.on_building is not None:
            run.on_building()


#: A build job's executor: an ``async def``, or a ``def`` (run in a worker thread).
Executor = Callable[[JobContext[P]], Awaitable[None] | None]
#: How the worker calls one: always on the loop.
AsyncExecutor = Callable[[JobContext[P]], Awaitable[None]]


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


#: A plain job's executor, an ``async def`` or a ``def`` (run in a worker thread);
#: what it returns (JSON-ready, or None) is the job's result.
PlainExecutor = Callable[[PlainJobContext[A]], Any]
#: How the worker calls one: always on the loop.
AsyncPlainExecutor = Callable[[PlainJobContext[A]], Awaitable[Any]]
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
        self._entries: dict[str, tuple[type[Payload], AsyncExecutor[Payload]]] = {}
        self._plain: dict[str, tuple[type[JobArgs], AsyncPlainExecutor[JobArgs]]] = {}
        self._timeouts: dict[str, float] = {}
        self._backoffs: dict[str, BackoffFn] = {}
        #: The workflows registered (`register_workflow`), by name: the cron
        #: start's executor starts them by name.
        self.workflows: dict[str, Any] = {}
        #: Large step results their steps' executors share (`workflows.executor.ResultCache`).
        self.workflow_results: Any = None

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
        self, payload_type: type[Any], executor: Callable[[Any], Any] | None = None,
        *, timeout: float | None = None, backoff: BackoffFn | None = None,
    ) -> Any:
        """
        Register `executor` for `payload_type` (a build `Payload` or a plain
        `JobArgs`); usable as a decorator. An ``async def`` runs on the worker's
        loop; a plain ``def`` (blocking code: an ORM, ``requests``) runs in a
        worker thread of its own (`nasiko_queue.threaded`).

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

        def add(fn: Callable[[Any], Any]) -> Callable[[Any], Any]:
            kind = payload_type.kind
            if kind in self._entries or kind in self._plain:
                raise ValueError(f"an executor for kind {kind!r} is already registered")
            call = fn if is_async_callable(fn) else in_thread(fn, f"kind {kind}")
            if plain:
                self._plain[kind] = (payload_type, call)
                self._backoffs[kind] = backoff or DEFAULT_BACKOFF
            else:
                self._entries[kind] = (payload_type, call)
            if timeout is not None:
                self._timeouts[kind] = timeout
            return fn

        return add if executor is None else add(executor)

    def register_workflow(self, workflow: Any) -> None:
        """
        Register the executors that run `workflow`'s steps (and its child
        workflows'), the signal timer's and the cron start's
        (`workflows.executor.register_workflow`).
        """
        from .workflows.executor import register_workflow

        register_workflow(self, workflow)

    def executor_for(self, kind: str) -> AsyncExecutor[Payload] | None:
        entry = self._entries.get(kind)
        return None if entry is None else entry[1]

    def timeout_for(self, kind: str) -> float | None:
        """The run-time limit registered for `kind`, if any."""
        return self._timeouts.get(kind)

    def plain_executor_for(self, kind: str) -> AsyncPlainExecutor[JobArgs] | None:
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
