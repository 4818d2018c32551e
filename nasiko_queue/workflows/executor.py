"""
The plain executors that run workflows: one per step (reads the step's inputs,
calls its function, returns its result as the job's result; the SQL rule does
the rest), the signal timer's, and the cron start's.

A step's executor never writes a transition itself: its return completes its
job (the completer's statement), and the trigger of migration 0018 records the
result and enqueues what it unblocks in that same transaction.
"""

from __future__ import annotations

import json
import logging
from typing import Any, ClassVar
from uuid import UUID

import attrs
import trio

from ..builds.payloads import converter
from ..config import NOTIFY_CHANNEL
from ..db.statements import Q
from ..executors import Executors, PlainJobContext
from ..plain.args import JobArgs, JobOptions
from ..threaded import in_thread, is_async_callable
from .definition import DEFAULT_WORKFLOW_QUEUE, Step, StepArgs, StepContext, Workflow

log = logging.getLogger("nasiko_queue.workflows")

#: The kind of a signal step's timer job (the SQL rule enqueues it).
SIGNAL_TIMEOUT_KIND = "nasiko_queue.signal_timeout"
#: The kind of the job that starts a run (a `Schedule`'s job, for cron).
START_KIND = "nasiko_queue.start_workflow"


@attrs.frozen(kw_only=True)
class SignalTimeout(JobArgs):
    """A signal step's deadline: fails the step if it still waits for this timer."""

    kind: ClassVar[str] = SIGNAL_TIMEOUT_KIND
    options: ClassVar[JobOptions] = JobOptions(queue=DEFAULT_WORKFLOW_QUEUE)
    run: str
    step: str


@attrs.frozen(kw_only=True)
class StartWorkflow(JobArgs):
    """
    Start a run of `workflow` with `input`: the job a cron `Schedule` enqueues
    (``Schedule("nightly", "0 3 * * *", StartWorkflow(workflow="release",
    input={...}))``). The run's unique key is this job's id, so each tick starts
    one run, however many replicas run the scheduler and however often the job
    is retried.
    """

    kind: ClassVar[str] = START_KIND
    options: ClassVar[JobOptions] = JobOptions(queue=DEFAULT_WORKFLOW_QUEUE)
    workflow: str
    input: Any = None


def _loads(text: str | None) -> Any:
    return None if text is None else json.loads(text)


async def _stop_unrun(ctx: PlainJobContext[StepArgs]) -> None:
    """
    A step job that will not run its step ends `cancelled`, not `completed` (it
    completed nothing): it asks its own job to stop, the plain jobs' cancel
    (migration 0013), and waits; its worker's next heartbeat sees the request
    and ends it `cancelled`, as any running step a run's end asked to stop. A
    job that is no longer running (its claim superseded) returns at once.
    """
    answer = await ctx.db.fetchval(Q.plain_cancel, ctx.job_id)
    if answer == "cancelling":
        await trio.sleep_forever()


#: A dependency's result this large (JSON text, in characters) is parsed once per
#: worker and run, and shared by the steps that read it (`ResultCache`).
SHARED_RESULT_CHARS = 16 * 1024


class ResultCache:
    """
    Large dependency results, parsed, by run and step: a fan-out's items each
    read the list they map over (`ctx.results`), and reading and parsing 100,000
    items' list once per item cost 70 ms an item (benchmarks/README.md, issue
    #45). A completed step's result never changes (a retry keeps it), so the
    worker reads it once per run and the items share the parsed value: treat
    `ctx.results` as read-only. The few most recent runs are kept.
    """

    def __init__(self, runs: int = 4) -> None:
        self._runs = runs
        self._by_run: dict[UUID, dict[str, Any]] = {}

    def held(self, run_id: UUID) -> dict[str, Any]:
        """The results held for `run_id` (empty: none)."""
        held = self._by_run.pop(run_id, None)
        if held is None:
            return {}
        self._by_run[run_id] = held  # the most recent last
        return held

    def keep(self, run_id: UUID, texts: dict[str, str], parsed: dict[str, Any]) -> None:
        """Keep those of `parsed` whose text (`texts`) is large."""
        large = {name: parsed[name] for name, text in texts.items()
                 if len(text) >= SHARED_RESULT_CHARS}
        if not large:
            return
        self._by_run.setdefault(run_id, {}).update(large)
        self._by_run[run_id] = self._by_run.pop(run_id)
        while len(self._by_run) > self._runs:
            del self._by_run[next(iter(self._by_run))]


def _split_results(text: str) -> tuple[dict[str, Any], dict[str, str]]:
    """The results object (JSON text): parsed, and each value's own text length
    (re-serialised only when the whole is large enough for one to be)."""
    parsed: dict[str, Any] = json.loads(text)
    if len(text) < SHARED_RESULT_CHARS:
        return parsed, {}
    return parsed, {name: json.dumps(value) for name, value in parsed.items()}


def step_executor(wf: Workflow, step: Step, cache: ResultCache | None = None) -> Any:
    """The plain executor of `step`'s jobs; `cache`: large results it shares
    with the other steps of the registry (one of its own if None)."""
    cache = ResultCache() if cache is None else cache
    assert step.fn is not None
    fn = step.fn if is_async_callable(step.fn) else in_thread(
        step.fn, f"workflow {wf.name} step {step.name}")

    async def run_step(ctx: PlainJobContext[StepArgs]) -> Any:
        args = ctx.payload
        run_id = UUID(args.run)
        # An end of the run in flight (a cancel in an application's open
        # transaction, say) may have skipped this job while its claim held the
        # row: wait for it to commit, then read (migration 0034), so that the
        # read sees it.
        await ctx.db.execute(Q.workflow_await_run_end, run_id)
        held = cache.held(run_id)
        row = await ctx.db.fetchrow(Q.workflow_step_inputs, run_id, args.step, args.idx,
                                    ctx.job_id, list(held) or None)
        if row is None or row["state"] != "running" or not row["live"]:
            # Its run ended (failed, cancelled) or a retry replaced this job: a
            # step never runs after its run ended. Its end changes nothing.
            log.info("workflow %s step %s[%d]: not run (run %s)", run_id, args.step, args.idx,
                     "gone" if row is None else row["state"])
            await _stop_unrun(ctx)
            return None
        raw_input = _loads(row["input"])
        value = (raw_input if wf.input_type is None or raw_input is None
                 else converter.structure(raw_input, wf.input_type))
        mapped = bool(row["mapped"])  # the run's definition, not this deploy's
        results, texts = _split_results(row["results"] or "{}")
        cache.keep(run_id, texts, results)
        if held:
            # The worker may hold large results of other steps of the run too:
            # a step is given its own dependencies' only.
            deps = set(json.loads(row["after"]))
            results = {**results, **{name: v for name, v in held.items() if name in deps}}
        sctx = StepContext(run_id=run_id, step=args.step, input=value,
                           results=results,
                           item=_loads(row["item"]) if mapped else None,
                           index=args.idx if mapped else None, job=ctx)
        return await fn(sctx)

    return run_step


def register_workflow(executors: Executors, wf: Workflow,
                      notify_channel: str | None = NOTIFY_CHANNEL) -> None:
    """
    Register the plain executors that run `wf` (and the workflows its child
    steps start): one per step of kind job, the signal timer's, and the cron
    start's (which starts any workflow registered here by name). A worker with
    this registry serves the steps' queues. `notify_channel`: the channel the
    cron start's runs wake workers on (`QueueConfig.notify_channel`).
    """
    registry: dict[str, Workflow] = executors.workflows
    if executors.workflow_results is None:
        executors.workflow_results = ResultCache()
    cache: ResultCache = executors.workflow_results
    for each in (wf, *wf.children().values()):
        known = registry.get(each.name)
        if known is each:
            continue
        if known is not None:
            raise ValueError(f"another workflow named {each.name!r} is registered already")
        registry[each.name] = each
        for step in each.steps.values():
            if step.kind == "job":
                executors.register(step.args_type(), step_executor(each, step, cache),
                                   timeout=step.run_timeout, backoff=step.backoff)
    plain = executors.plain_kinds
    if SIGNAL_TIMEOUT_KIND not in plain:
        async def signal_timeout(ctx: PlainJobContext[SignalTimeout]) -> str:
            answer: str = await ctx.db.fetchval(
                Q.workflow_signal_timeout, UUID(ctx.payload.run), ctx.payload.step,
                ctx.job_id)
            return answer

        executors.register(SignalTimeout, signal_timeout)
    if START_KIND not in plain:
        async def start(ctx: PlainJobContext[StartWorkflow]) -> str:
            from .runs import start_run

            target = registry.get(ctx.payload.workflow)
            if target is None:
                raise LookupError(f"no workflow {ctx.payload.workflow!r} is registered in "
                                  "this worker")
            run_id = await start_run(ctx.db, target, ctx.payload.input,
                                     unique=f"nasiko_queue.start:{ctx.job_id}",
                                     channel=notify_channel, encoded=True)
            return str(run_id)

        executors.register(StartWorkflow, start)
