"""
The queue's constants, named once, and the configuration that overrides them.

The defaults are the original build worker's (docs/rules.md §3). Tests and operators
override them through `QueueConfig`; nothing else in the package hard-codes a
number that docs/rules.md names.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Iterable, Mapping
from datetime import timedelta
from typing import Any, Literal

import attrs

from .errors import ConfigurationError

#: A build job runs at most this many times (attempts are counted at claim
#: time): `QueueConfig.build_max_attempts`. Plain jobs have their own cap,
#: `JobOptions.max_attempts`.
MAX_ATTEMPTS = 3
#: A job `in_progress` for longer than this is recovered by the sweep. It must
#: exceed the longest build (30 minutes in the original), hence twice that.
STUCK_JOB_MINS = 60
#: Buffered wake-ups; a full channel already guarantees a drain, so more are dropped.
WAKE_CAPACITY = 64
#: Fallback poll, in seconds, re-armed after every drain.
POLL_INTERVAL = 5.0
#: Recovery sweep period in seconds; the first tick comes one period after start.
RECOVERY_INTERVAL = 600.0
#: Refuse payloads larger than this at enqueue (bytes of encoded JSON).
MAX_PAYLOAD_BYTES = 1024 * 1024
#: The default of `QueueConfig.max_result_bytes`.
MAX_RESULT_BYTES = 1024 * 1024
#: The NOTIFY channel enqueue signals and workers LISTEN on.
NOTIFY_CHANNEL = "nasiko_queue_jobs"
#: Seconds between a worker's heartbeats. One small UPDATE on a connection of
#: its own: a third of a statement a second per worker.
HEARTBEAT_INTERVAL = 3.0
#: Seconds without a heartbeat after which a worker is presumed dead and its jobs
#: are rescued: five missed heartbeats, so that a pause of a few seconds (a
#: garbage collection, a network blip, a fail-over) is not taken for a death,
#: while a job whose worker died runs again within about 20 s.
LEASE = 15.0
#: `QueueConfig.prefetch_auto_wait`: the expected wait, in seconds, of the last
#: job an adaptive lane claims ahead of its free slots.
PREFETCH_AUTO_WAIT = 0.05
#: `QueueConfig.prefetch_auto_ttl`: seconds a job claimed ahead by an adaptive
#: lane may wait for a slot before it goes back.
PREFETCH_AUTO_TTL = 1.0

#: What `QueueConfig.prefetch` may say: a number of jobs, or "auto".
Prefetch = int | Literal["auto"]


def _positive(_inst: object, attribute: attrs.Attribute[float], value: float) -> None:
    if value <= 0:
        raise ConfigurationError(f"{attribute.name} must be > 0, got {value!r}")


def _channel(_inst: object, attribute: attrs.Attribute[Any], value: str | None) -> None:
    # PostgreSQL truncates identifiers to 63 bytes; a longer name would LISTEN on
    # a channel other than the one pg_notify() signals.
    if value is not None and not 0 < len(value.encode("utf-8")) <= 63:
        raise ConfigurationError(f"{attribute.name} must be 1 to 63 bytes, got {value!r}")


def _retention(
    _inst: object, attribute: attrs.Attribute[timedelta | None], value: timedelta | None
) -> None:
    if value is not None and value <= timedelta(0):
        raise ConfigurationError(f"{attribute.name} must be a positive timedelta, got {value!r}")


def _at_least_one(_inst: object, attribute: attrs.Attribute[int], value: int) -> None:
    if value < 1:
        raise ConfigurationError(f"{attribute.name} must be >= 1, got {value!r}")


def _prefetch(_inst: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if value is None or value == "auto":
        return
    if type(value) is not int or value < 0:
        raise ConfigurationError(f"{attribute.name} must be 'auto', an integer >= 0 or None "
                                 f"(the default), got {value!r}")


def _queues(
    value: Mapping[str, int] | Iterable[tuple[str, int]] | None,
) -> tuple[tuple[str, int], ...] | None:
    """{"email": 5, ...} (or pairs) as sorted pairs, checked; None stays None."""
    if value is None:
        return None
    pairs = list(value.items()) if isinstance(value, Mapping) else list(value)
    seen: set[str] = set()
    for name, limit in pairs:
        if not isinstance(name, str) or not 0 < len(name) <= 128:
            raise ConfigurationError(f"queues: a queue name is 1 to 128 characters, got "
                                     f"{name!r}")
        if name == "builds":
            raise ConfigurationError("queues: 'builds' is the name build jobs go by (they "
                                     "run when QueueConfig.builds is on); name plain "
                                     "queues otherwise")
        if name in seen:
            raise ConfigurationError(f"queues: {name!r} is given twice")
        seen.add(name)
        if type(limit) is not int or limit < 1:
            raise ConfigurationError(f"queues: the concurrency of {name!r} must be an "
                                     f"integer >= 1, got {limit!r}")
    return tuple(sorted(pairs))


@attrs.frozen(kw_only=True)
class QueueConfig:
    """
    Every knob of one queue: the worker's timers, its limits and its retries.

    All times are seconds except `stuck_job_mins`, which is bound into SQL as
    `make_interval(mins => $n)` exactly as the original does.
    """

    #: Runs per build job before it is failed for good (docs/rules.md §5 cap, §7
    #: sweep: MAX_ATTEMPTS). Plain jobs are capped by their `JobOptions.max_attempts`
    #: (20 by default) instead. Formerly `max_attempts`, a name that still works
    #: (deprecated).
    build_max_attempts: int = attrs.field(default=MAX_ATTEMPTS, validator=_at_least_one)
    #: Age of `picked_at` after which an `in_progress` job counts as stuck.
    stuck_job_mins: int = attrs.field(default=STUCK_JOB_MINS, validator=_at_least_one)
    #: Capacity of the in-process wake channel.
    wake_capacity: int = attrs.field(default=WAKE_CAPACITY, validator=_at_least_one)
    #: Seconds of quiet after a drain before the worker looks again by itself.
    poll_interval: float = attrs.field(default=POLL_INTERVAL, validator=_positive)
    #: Seconds between recovery sweeps (first one this long after start).
    recovery_interval: float = attrs.field(default=RECOVERY_INTERVAL, validator=_positive)
    #: Build jobs one worker runs at once. 1 is the original's behaviour. Also
    #: the concurrency of each queue of plain jobs when `queues` is None.
    concurrency: int = attrs.field(default=1, validator=_at_least_one)
    #: The queues of plain jobs this worker runs, and how many jobs of each at
    #: once: ``{"default": 10, "email": 2}``. None: every queue that the
    #: registered plain job types name in their `options`, `concurrency` each.
    queues: tuple[tuple[str, int], ...] | None = attrs.field(default=None, converter=_queues)
    #: Whether this worker runs build jobs (when build executors are
    #: registered): off for a process that only runs plain queues.
    builds: bool = True
    #: Jobs a lane may claim ahead of its free slots, into a local buffer, so
    #: that a slot whose job ends starts the next at once while the fetcher
    #: records the finish and claims more in one statement. A prefetched job
    #: counts as claimed (attempt, picked_at) until it starts or is given back.
    #: "auto": as many as the lane's recent run times say will start within
    #: `prefetch_auto_wait` (none while its jobs run that long or longer), each
    #: given back after `prefetch_auto_ttl` unstarted (`engine.lookahead`). A
    #: number: that many, given back after `prefetch_ttl`. None (the default):
    #: "auto" for each queue of plain jobs, 0 for the build jobs (the
    #: original's behaviour: its jobs run for minutes).
    prefetch: Prefetch | None = attrs.field(default=None, validator=_prefetch)
    #: Seconds a job prefetched by a fixed `prefetch` may wait in the buffer
    #: before it goes back to pending (attempt restored) for an idle replica to
    #: take; after that the lane prefetches again only once a slot of its own
    #: runs dry. Must stay well under `stuck_job_mins`, or a sweep elsewhere
    #: would run it twice.
    prefetch_ttl: float = attrs.field(default=60.0, validator=_positive)
    #: With "auto": the expected wait, in seconds, of the last job claimed ahead.
    prefetch_auto_wait: float = attrs.field(default=PREFETCH_AUTO_WAIT, validator=_positive)
    #: With "auto": seconds a job claimed ahead may wait for a slot before it
    #: goes back (attempt restored) for another slot or replica: the most a
    #: short job waits behind a run that turned long unexpectedly.
    prefetch_auto_ttl: float = attrs.field(default=PREFETCH_AUTO_TTL, validator=_positive)
    #: Largest encoded payload `enqueue` accepts.
    max_payload_bytes: int = attrs.field(default=MAX_PAYLOAD_BYTES, validator=_at_least_one)
    #: Largest encoded result a plain job's executor may return (issue #22): a
    #: larger one is refused at completion (the job is discarded with the sizes
    #: in its error), never truncated.
    max_result_bytes: int = attrs.field(default=MAX_RESULT_BYTES, validator=_at_least_one)
    #: First delay when a final update or a startup sweep fails; doubles up to the cap.
    retry_initial_delay: float = attrs.field(default=0.1, validator=_positive)
    #: Longest delay between two retries of a final update.
    retry_max_delay: float = attrs.field(default=10.0, validator=_positive)
    #: How long a shielded cleanup (release on hard stop, rollback, pool release) may take;
    #: also the bound on one attempt at a final update, which is shielded from hard stops.
    cleanup_timeout: float = attrs.field(default=5.0, validator=_positive)
    #: Tries of a job's failed mark *with* its target's terminalization when the
    #: database rejects it on its merits (say, a trigger of the application's that
    #: forbids the delete). After that the job is marked failed alone and the
    #: error logged, so that one undeletable target cannot wedge the worker.
    #: Outages are retried for as long as they last and do not count.
    terminalize_tries: int = attrs.field(default=5, validator=_at_least_one)
    #: Kinds that other replicas run and this one does not know: this worker
    #: leaves them pending instead of failing them as invalid (docs/rules.md §5 claims
    #: every unknown kind). Use it during rolling deploys that add a job type.
    other_kinds: frozenset[str] = attrs.field(default=frozenset(), converter=frozenset)
    #: NOTIFY channel: `enqueue` signals it in the inserting transaction (once per
    #: transaction) and workers LISTEN on it, so a job enqueued by any process
    #: wakes every replica at once. None sends no notifications (and listens to none).
    notify_channel: str | None = attrs.field(default=NOTIFY_CHANNEL, validator=_channel)
    #: Whether a worker LISTENs (on a dedicated connection, outside the pool). Off,
    #: it wakes only on in-process enqueues, its sweeps, and the poll.
    listen: bool = True
    #: Whether a claim sent on its own (a wake's, a poll's: not one that rides
    #: with finishes) waits for its commit to reach the disk before the job
    #: starts. On, as PostgreSQL does by default. Off, the claim commits with
    #: `synchronous_commit = off` for its own transaction only (about 0.1 ms
    #: less from wake to start here, and none of the flush's jitter); the cost
    #: is that a server crash can forget the claims of its last moments (at
    #: most 3 x `wal_writer_delay`, 0.6 s by default) while their jobs already
    #: run: those jobs are pending again after the restart and run a second
    #: time. Every other write keeps the server's setting.
    claim_synchronous_commit: bool = True
    #: Seconds between checks that the LISTEN connection still answers (a query
    #: bounded by `cleanup_timeout`); one that does not is replaced. A connection
    #: whose peer vanished without a reset otherwise looks open for hours, while
    #: its notifications go nowhere. 30 s plus the bound is how long such a hang
    #: can go unnoticed; the poll keeps jobs moving meanwhile.
    listen_check_interval: float = attrs.field(default=30.0, validator=_positive)
    #: When set, the worker's recovery tick also deletes done/failed jobs whose
    #: `completed_at` is older than this (`nasiko_queue.retention.prune`).
    retention: timedelta | None = attrs.field(default=None, validator=_retention)
    #: Seconds between heartbeats of the worker's row (on a connection of its
    #: own, never starved by the work).
    heartbeat_interval: float = attrs.field(default=HEARTBEAT_INTERVAL, validator=_positive)
    #: Seconds without a heartbeat after which the worker is presumed dead: the
    #: leader rescues its jobs (back to pending, or failed when out of
    #: attempts). A worker that cannot heartbeat for `lease - heartbeat_interval`
    #: stops its own jobs first. Also how long the maintenance leadership lasts
    #: unrenewed. At least three heartbeats.
    lease: float = attrs.field(default=LEASE, validator=_positive)
    #: Seconds between the leader's rescues of dead workers' jobs.
    rescue_interval: float = attrs.field(default=HEARTBEAT_INTERVAL, validator=_positive)
    #: Whether this worker stands for the maintenance leadership (rescue, the
    #: stuck sweep, retention); exactly one worker at a time holds it.
    maintenance: bool = True
    #: Run-time limit of every job, in seconds (None: none); an executor past it
    #: is cancelled and the run counts as a crash. `Executors.register(...,
    #: timeout=)` sets one per payload type.
    job_timeout: float | None = attrs.field(default=None, validator=attrs.validators.optional(
        _positive))
    #: Seconds a dead worker's row is kept (for `status`) once its jobs are rescued.
    dead_worker_retention: float = attrs.field(default=3600.0, validator=_positive)
    #: Whether `enqueue` seals the `env` values of Upload, Clone and GithubClone (docs/rules.md §2
    #:; McpServerUpload's are always sealed). Turn it off only while replicas
    #: running the original worker's code share the table: they read those values as
    #: plaintext and would hand a sealed token to the build as the value. Off, the values
    #: sit in the table in plaintext and no master key is needed for them. Either way,
    #: workers read both plaintext and sealed values.
    seal_agent_env: bool = True
    #: Whether this worker runs the scheduler of the cron schedules it is given
    #: (`Worker(..., schedules=)`). Every replica may: the database decides which
    #: one enqueues each tick. Off for a process that should only run jobs.
    scheduler: bool = True
    #: Seconds after its time within which a cron tick counts as on time; a tick
    #: first reached later was missed (every replica or the database was down)
    #: and is enqueued only if its schedule has `catch_up` (the latest one, once).
    schedule_grace: float = attrs.field(default=60.0, validator=_positive)

    @property
    def max_attempts(self) -> int:
        """Deprecated: `build_max_attempts` (the name said nothing of build jobs,
        while plain jobs have `JobOptions.max_attempts`)."""
        warnings.warn(_RENAMED, DeprecationWarning, stacklevel=2)
        return self.build_max_attempts

    def __attrs_post_init__(self) -> None:
        if self.lease < 3 * self.heartbeat_interval:
            raise ConfigurationError(
                f"lease ({self.lease}s) must be at least three heartbeat intervals "
                f"({self.heartbeat_interval}s): a worker stops its own jobs one interval "
                "before its lease ends, and one missed heartbeat must not be a death")
        # The TTL a lane may hold a prefetched job for: a fixed number's, or
        # "auto"'s (None: plain lanes are "auto").
        ttls: dict[str, float] = {}
        if type(self.prefetch) is int and self.prefetch:
            ttls["prefetch_ttl"] = self.prefetch_ttl
        elif self.prefetch in (None, "auto"):
            ttls["prefetch_auto_ttl"] = self.prefetch_auto_ttl
        for name, ttl in ttls.items():
            if ttl >= self.stuck_job_mins * 60 / 2:
                raise ConfigurationError(
                    f"{name} ({ttl}s) must be under half of stuck_job_mins "
                    f"({self.stuck_job_mins} min): a prefetched job counts as in_progress, "
                    "and one held near the stuck threshold could be recovered and run "
                    "elsewhere too")

    def lane_prefetch(self, *, builds: bool) -> Prefetch:
        """What `prefetch` means for one lane: the default (None) is "auto" for a
        queue of plain jobs, 0 for the build jobs."""
        if self.prefetch is None:
            return 0 if builds else "auto"
        return self.prefetch

    def lane_ttl(self) -> float:
        """The give-back TTL of a lane whose `prefetch` is resolved (`lane_prefetch`)."""
        return self.prefetch_auto_ttl if self.prefetch == "auto" else self.prefetch_ttl


_RENAMED = ("QueueConfig.max_attempts is now build_max_attempts (it caps build jobs only; "
            "a plain job's cap is its JobOptions.max_attempts)")
_attrs_init = QueueConfig.__init__


@functools.wraps(_attrs_init)
def _init(self: QueueConfig, *args: Any, **kwargs: Any) -> None:
    # The former name, kept working: `QueueConfig(max_attempts=5)` and
    # `attrs.evolve(config, max_attempts=5)` set `build_max_attempts`, with a warning.
    if "max_attempts" in kwargs:
        warnings.warn(_RENAMED, DeprecationWarning, stacklevel=2)
        kwargs["build_max_attempts"] = kwargs.pop("max_attempts")
    _attrs_init(self, *args, **kwargs)


QueueConfig.__init__ = _init  # type: ignore[method-assign]
