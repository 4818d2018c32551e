"""
Plain jobs: a payload type with no target, and how its jobs are enqueued.

A build job (`builds.payloads.Payload`) drives an agent or connector and its build row
decides its outcome (docs/rules.md). A plain job is anything else an
application runs in the background: send an email, call a tool, run a workflow
step. Its executor's return means done, an exception means a retry after a
backoff, and after `max_attempts` runs it is discarded (the dead-letter queue).
Plain jobs live in `nasiko_queue_jobs`, apart from build_jobs, which the
original worker's claim shares.

>>> @attrs.frozen(kw_only=True)
... class SendEmail(JobArgs):
...     kind: ClassVar[str] = "send_email"
...     options: ClassVar[JobOptions] = JobOptions(queue="email", max_attempts=5)
...     to: str
...     subject: str
"""

from __future__ import annotations

import abc
import math
import numbers
import random
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any, ClassVar, Final
from uuid import UUID

import attrs

__all__ = [
    "DEFAULT_QUEUE",
    "JOB_STATES",
    "Backoff",
    "Job",
    "JobArgs",
    "JobOptions",
    "Unique",
]

#: The queue a plain job goes to unless its options name another.
DEFAULT_QUEUE: Final = "default"
#: Every state of a plain job (`nasiko_queue_jobs.state`).
JOB_STATES: Final = frozenset({"available", "running", "completed", "discarded", "cancelled"})
#: Whose key seals a plain job's secret fields: plain jobs have no owner, so one
#: key of the master key's, distinct from every user's (no user has the nil id).
PLAIN_SECRET_OWNER: Final = UUID(int=0)


def _states(value: Any) -> frozenset[str]:
    states = frozenset(value)
    unknown = states - JOB_STATES
    if unknown:
        raise ValueError(f"unknown job state(s) {sorted(unknown)}; the states are "
                         f"{sorted(JOB_STATES)}")
    if not {"available", "running"} <= states:
        # A job moves between these two on its own (a claim, a crash's retry, a
        # rescue): were one left out, a second job could take the key meanwhile,
        # and the first could then never be written back.
        raise ValueError(f"a unique job's states must include 'available' and 'running', "
                         f"got {sorted(states)}")
    return states


def _unique_key(_inst: object, _attr: attrs.Attribute[str], value: object) -> None:
    # No NUL: PostgreSQL text cannot hold one, and the server would refuse the
    # statement ("invalid byte sequence"), naming neither the field nor the job.
    if not isinstance(value, str) or not value or "\x00" in value:
        raise ValueError(f"a unique key is a non-empty string with no NUL character, "
                         f"got {value!r}")


def _int_in(low: int, high: int) -> Callable[[object, attrs.Attribute[int], object], None]:
    """An attrs validator: an int (not a bool, not a float) from `low` to `high`."""

    def check(_inst: object, attr: attrs.Attribute[int], value: object) -> None:
        # An int subclass (an IntEnum of priorities) is one; a bool is not.
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise ValueError(f"{attr.name} is a whole number from {low} to {high}, "
                             f"got {value!r}")

    return check


#: The longest `delay` (and workflow wait): 100 years, well inside what a
#: PostgreSQL timestamp holds.
MAX_DELAY_SECONDS: Final = 100 * 365.25 * 86400


def delay_seconds(delay: float | timedelta | None) -> float | None:
    """`delay` in seconds, checked: a finite number from 0 to 100 years."""
    if delay is None:
        return None
    if isinstance(delay, timedelta):
        seconds = delay.total_seconds()
    elif isinstance(delay, bool | str) or not isinstance(delay, numbers.Number):
        raise TypeError(f"delay is a number of seconds or a timedelta, got {delay!r}")
    else:
        try:
            seconds = float(delay)  # a Decimal or a Fraction too
        except (TypeError, ValueError, OverflowError):
            raise TypeError(f"delay is a number of seconds or a timedelta, got {delay!r}") \
                from None
    if not 0 <= seconds <= MAX_DELAY_SECONDS:  # NaN fails both
        raise ValueError(f"delay is 0 to {MAX_DELAY_SECONDS:.0f} seconds (100 years), "
                         f"got {delay!r}")
    return float(seconds)


def check_run_at(run_at: datetime | None) -> None:
    """
    Refuse a run_at that is naive, or more than 100 years from now: asyncpg
    writes `datetime.min`/`max` as -infinity/infinity, which PostgreSQL's
    date arithmetic refuses (a worker reading when the next job is due, the
    status counts).
    """
    if run_at is None:
        return
    if run_at.tzinfo is None:
        raise ValueError("run_at must be an aware datetime (with a tzinfo), e.g. "
                         "datetime.now(timezone.utc) + timedelta(minutes=5)")
    try:
        off = abs((run_at - datetime.now(UTC)).total_seconds())
    except OverflowError:
        off = math.inf
    if off > MAX_DELAY_SECONDS:
        raise ValueError(f"run_at must be within 100 years of now, got {run_at.isoformat()}")


@attrs.frozen
class Unique:
    """
    At most one job with `key` among the jobs in one of `states`.

    A second enqueue while one is there inserts nothing and returns the first
    job's id; safe under concurrent enqueues (a unique index decides). The
    default, waiting or running, lets the same key run again once the first has
    ended; add "completed" to run a key once ever (until retention deletes it).
    The states always include "available" and "running", between which a job
    moves by itself.
    """

    key: str = attrs.field(validator=_unique_key)
    states: frozenset[str] = attrs.field(default=frozenset({"available", "running"}),
                                         converter=_states)


#: The name build jobs go by in listings (`job_admin`), so no plain queue has it.
BUILDS_QUEUE: Final = "builds"


def _queue_name(_inst: object, _attr: attrs.Attribute[str], value: str) -> None:
    if not isinstance(value, str) or not 0 < len(value) <= 128 or "\x00" in value:
        raise ValueError(f"a queue name is 1 to 128 characters, no NUL, got {value!r}")
    if value == BUILDS_QUEUE:
        raise ValueError(f"{BUILDS_QUEUE!r} is the name build jobs go by; give plain jobs "
                         "another queue")


@attrs.frozen(kw_only=True)
class JobOptions:
    """How jobs of a type are enqueued; a type's `options`, overridden per enqueue."""

    #: The queue it goes to; a worker runs the queues it is given.
    queue: str = attrs.field(default=DEFAULT_QUEUE, validator=_queue_name)
    #: Lower runs first within a queue; ties go to the job due first.
    priority: int = attrs.field(default=0, validator=_int_in(-32768, 32767))
    #: Runs before the job is discarded (attempts are counted at claim time).
    max_attempts: int = attrs.field(default=20, validator=_int_in(1, 2**31 - 1))
    #: Enqueue at most one such job at a time (see `Unique`).
    unique: Unique | None = None


@attrs.frozen
class Backoff:
    """
    The delay before a failed plain job runs again: ``base + attempt ** exponent``
    seconds, capped, spread by ±`jitter` (a fraction) so that jobs that failed
    together do not all come back at once. The defaults wait 16 s, 31 s, 96 s,
    271 s, 640 s, ... and at most a day (Oban's curve).
    """

    base: float = attrs.field(default=15.0, validator=attrs.validators.ge(0))
    exponent: float = attrs.field(default=4.0, validator=attrs.validators.ge(0))
    cap: float = attrs.field(default=86_400.0, validator=attrs.validators.gt(0))
    jitter: float = attrs.field(default=0.1, validator=[attrs.validators.ge(0),
                                                        attrs.validators.le(1)])

    def __call__(self, attempt: int) -> float:
        delay = min(self.cap, self.base + float(float(attempt) ** self.exponent))
        # Jitter spreads retries; it guards nothing, so no cryptographic source.
        return max(0.0, delay * (1 + random.uniform(-self.jitter, self.jitter)))  # noqa: S311


#: The type of a backoff: the attempt that just failed (1-based) to seconds.
BackoffFn = Callable[[int], float]


class JobArgs(abc.ABC):
    """
    Base class of plain job types: a frozen attrs class with a `kind` tag.

    Its attrs fields are its JSON fields (after ``"kind"``), as for build
    payloads; a field typed ``Mapping[str, Secret]`` declared with
    ``attrs.field(metadata={"sealed": True})`` is sealed at rest.

    - ``kind: ClassVar[str]``: the tag, unique among the types a worker knows.
    - ``options: ClassVar[JobOptions]``: the queue, priority, attempts and
      uniqueness of its jobs unless an enqueue says otherwise.
    - ``label() -> str``: a human name for logs (default: the kind).
    - ``unique_key() -> str | None``: a unique key derived from the fields
      (default: none); `options.unique` or an enqueue's `unique=` wins.
    """

    __slots__ = ()

    kind: ClassVar[str]
    options: ClassVar[JobOptions] = JobOptions()

    if TYPE_CHECKING:
        __attrs_attrs__: ClassVar[tuple[attrs.Attribute[Any], ...]]

    def label(self) -> str:
        """A human name for the job, for logs."""
        return self.kind

    def unique_key(self) -> str | None:
        """A key for unique enqueues derived from the job's fields, or None."""
        return None

    def secret_owner(self) -> UUID | None:
        """Whose key seals the secret fields: one key for every plain job."""
        return PLAIN_SECRET_OWNER


def _job_args(_inst: object, _attr: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, JobArgs):
        raise TypeError(
            f"Job wraps a plain job's JobArgs, got {type(value).__name__}: build payloads "
            "take no options, run_at, delay or unique key; give them to enqueue_many bare")


@attrs.frozen
class Job:
    """
    One plain job of `Queue.enqueue_many` with what `Queue.enqueue` would take
    beside it: ``enqueue_many([Job(SendEmail(...), options=JobOptions(queue="qa"),
    delay=60), SendEmail(...)])``. Bare `JobArgs` in the same list take their
    type's options, as before.

    Args:
        args: the job.
        options: instead of the type's `options` (its queue, priority, attempts,
            uniqueness).
        run_at, delay: not claimable before this aware datetime, or before this
            many seconds from now (one of the two).
        unique: enqueue only if no job holds this key (see `Unique`); else the
            holder's id is returned in this job's place.
    """

    args: JobArgs = attrs.field(validator=_job_args)
    options: JobOptions | None = attrs.field(default=None, kw_only=True)
    run_at: datetime | None = attrs.field(default=None, kw_only=True)
    delay: float | timedelta | None = attrs.field(default=None, kw_only=True)
    unique: Unique | None = attrs.field(default=None, kw_only=True)
