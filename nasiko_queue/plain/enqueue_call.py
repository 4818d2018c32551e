"""
One plain job as the SQL function `nasiko_queue_enqueue` takes it (migration 0019).

The asyncio client (`nasiko_queue.aio`) and the DB-API one (`nasiko_queue.sync`)
both build their calls here, so that they encode a job with the very codec
`Queue.enqueue` uses (`PayloadCodec.dumps`: the same bytes, secret fields sealed
the same way) and resolve its options the same way (the enqueue's, else its
type's; a unique key from the enqueue, the options or the type). The defaults and
the checks the database can make are the function's, written once for every
caller; what only Python knows (a naive datetime, a sealed field without a key)
is refused here, before anything is sent.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import Any

import attrs

from ..builds.payloads import PayloadCodec
from ..config import MAX_PAYLOAD_BYTES
from ..errors import PayloadTooLarge, SecretsNotConfigured
from ..payload_size import stored_size
from ..secrets import SecretBox
from .args import Job, JobArgs, JobOptions, Unique, check_run_at, delay_seconds


@attrs.frozen
class EnqueueCall:
    """The arguments of one `nasiko_queue_enqueue` call, in its parameters' order."""

    kind: str
    payload: str
    queue: str
    priority: int
    run_at: datetime | None
    max_attempts: int
    unique_key: str | None
    unique_states: list[str] | None
    delay: float | None

    def params(self) -> tuple[object, ...]:
        """The nine parameters of `Q.enqueue_function`."""
        return (self.kind, self.payload, self.queue, self.priority, self.run_at,
                self.max_attempts, self.unique_key, self.unique_states, self.delay)

    def batch_element(self) -> str:
        """This job as an element of `nasiko_queue_enqueue_many`'s array (JSON text);
        the payload goes in as encoded, not parsed and dumped again."""
        options: dict[str, Any] = {
            "kind": self.kind, "queue": self.queue, "priority": self.priority,
            "max_attempts": self.max_attempts}
        if self.run_at is not None:
            options["run_at"] = self.run_at.isoformat()
        if self.delay is not None:
            options["delay"] = self.delay
        if self.unique_key is not None:
            options["unique_key"] = self.unique_key
            options["unique_states"] = self.unique_states
        head = json.dumps(options, separators=(",", ":"), ensure_ascii=False)
        return f'{head[:-1]},"args":{self.payload}}}'


def make_codec(secrets: SecretBox | None) -> PayloadCodec:
    """The codec `Queue` makes: sealed fields need `secrets` (the master key's box)."""
    return PayloadCodec(secrets=secrets)


def enqueue_call(
    codec: PayloadCodec,
    args: JobArgs,
    *,
    run_at: datetime | None = None,
    delay: float | timedelta | None = None,
    options: JobOptions | None = None,
    unique: Unique | None = None,
    max_payload_bytes: int = MAX_PAYLOAD_BYTES,
) -> EnqueueCall:
    """
    The call that enqueues `args` as `Queue.enqueue(args, ...)` would.

    Raises:
        TypeError: `args` is not a plain job (build jobs are the trio API's only).
        InvalidPayload, SecretsNotConfigured: as the codec raises them.
        PayloadTooLarge: over `max_payload_bytes` encoded.
        ValueError: run_at and delay both given, a naive run_at, a negative delay.
    """
    if not isinstance(args, JobArgs):
        raise TypeError(f"only plain jobs (JobArgs) are enqueued this way, not "
                        f"{type(args).__name__}: a build job is enqueued with its target "
                        "by Queue.enqueue")
    if run_at is not None and delay is not None:
        raise ValueError("give run_at or delay, not both")
    check_run_at(run_at)
    seconds = delay_seconds(delay)
    opts = options or type(args).options
    if unique is None:
        unique = opts.unique
    if unique is None:
        key = args.unique_key()
        unique = Unique(key) if key else None
    text = codec.dumps(args)
    size = stored_size(text, limit=max_payload_bytes)  # as the function counts it
    if size > max_payload_bytes:
        raise PayloadTooLarge(f"{args.kind} payload is {size} bytes; the limit is "
                              f"{max_payload_bytes} (QueueConfig.max_payload_bytes)")
    return EnqueueCall(
        kind=args.kind, payload=text, queue=opts.queue, priority=opts.priority,
        run_at=run_at, max_attempts=opts.max_attempts,
        unique_key=None if unique is None else unique.key,
        unique_states=None if unique is None else sorted(unique.states),
        delay=seconds)


def enqueue_calls(codec: PayloadCodec, jobs: Sequence[JobArgs | Job], *,
                  max_payload_bytes: int = MAX_PAYLOAD_BYTES) -> list[EnqueueCall]:
    """`enqueue_call` for each of a batch (a bare `JobArgs` or a `Job` with its options)."""
    calls = []
    for index, job in enumerate(jobs):
        try:
            if isinstance(job, Job):
                calls.append(enqueue_call(codec, job.args, run_at=job.run_at, delay=job.delay,
                                          options=job.options, unique=job.unique,
                                          max_payload_bytes=max_payload_bytes))
            else:
                calls.append(enqueue_call(codec, job, max_payload_bytes=max_payload_bytes))
        except (ValueError, TypeError, SecretsNotConfigured) as exc:
            # Which one of the batch: its index, as Queue.enqueue_many says it.
            raise _indexed(exc, index) from exc
    return calls


def _indexed(exc: Exception, index: int) -> Exception:
    """`exc` again, its message led by the job's index in the batch. A type that
    cannot be made from one message (UnicodeError takes five arguments) becomes
    the plain ValueError or TypeError it derives from."""
    text = f"jobs[{index}]: {exc}"
    try:
        return type(exc)(text)
    except Exception:
        return TypeError(text) if isinstance(exc, TypeError) else ValueError(text)


def batch_json(calls: Sequence[EnqueueCall]) -> str:
    """The JSON array `nasiko_queue_enqueue_many` takes."""
    return "[" + ",".join(call.batch_element() for call in calls) + "]"
