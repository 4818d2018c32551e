"""
A workflow's definition: its steps and how they depend on each other (a DAG),
declared in Python and written into each run's row as JSON at start.

Why JSON in the run's row: every transition (a step's end enqueuing the steps
it unblocks, a run's end) is a plpgsql rule fired by the step job's own state
change (migration 0018), in the transaction that ended it; the rule needs the
definition without asking Python. A run keeps the definition it started with,
so a deploy that changes the workflow never reshapes a run in flight.

>>> wf = Workflow("release", input_type=ReleaseInput, queue="workflows")
>>> @wf.step()
... async def build(ctx: StepContext) -> list[str]: ...
>>> @wf.step(after=[build], map_over=build)       # once per item of build's list
... async def test(ctx: StepContext) -> dict: ...
>>> approval = wf.signal("approval", after=[test], timeout=3600)
>>> @wf.step(after=[test, approval])
... async def deploy(ctx: StepContext) -> str: ...
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, Final

import attrs

from ..executors import PlainJobContext
from ..plain.args import MAX_DELAY_SECONDS, BackoffFn, JobArgs, JobOptions, _queue_name

__all__ = ["Step", "StepArgs", "StepContext", "Workflow"]

#: The step kinds the SQL rules know.
STEP_KINDS: Final = frozenset({"job", "signal", "child"})
#: A name no workflow may take: the prefix of the queue's own job kinds.
RESERVED_NAME = "nasiko_queue"

#: The queue a workflow's steps go to unless it or the step names another.
DEFAULT_WORKFLOW_QUEUE: Final = "workflows"
#: The longest a step's `delay` or a signal's `timeout` may be: 100 years, well
#: inside what PostgreSQL's timestamps hold (a delay of 1e13 s is not).
MAX_WAIT_SECONDS: Final = MAX_DELAY_SECONDS


@attrs.frozen(kw_only=True)
class StepArgs(JobArgs):
    """
    A step job's payload, as the SQL rule writes it: which step of which run,
    and nothing else. The executor reads the step's inputs from the tables, so
    that a payload never copies a (possibly large) result and a retried step
    reads what its dependencies returned, not a stale copy.
    """

    kind: ClassVar[str] = "nasiko_queue.step"
    run: str
    step: str
    idx: int = 0

    def label(self) -> str:
        return f"{self.kind} {self.run}" + (f"[{self.idx}]" if self.idx else "")


@attrs.frozen(kw_only=True)
class StepContext:
    """What a step's function gets."""

    #: The run's id.
    run_id: Any
    #: The step's name.
    step: str
    #: The run's input, structured as the workflow's `input_type` (parsed JSON
    #: when it has none).
    input: Any
    #: The results of the steps this one runs after, by name (parsed JSON; a
    #: mapped step's result is the list of its items' results, in item order;
    #: a signal step's, the signal's payload; a child step's, the child run's).
    results: dict[str, Any]
    #: A mapped step's item (of the list it maps over) and its index; None else.
    item: Any = None
    index: int | None = None
    #: The plain job running this step (attempt, queue, db).
    job: PlainJobContext[Any]


#: A step's code: an ``async def``, or a ``def`` (run in a worker thread).
StepFn = Callable[[StepContext], Any]


@attrs.frozen(kw_only=True, eq=False)
class Step:
    """One step of a workflow (made by `Workflow.step`, `signal`, `child`)."""

    workflow: str
    name: str
    kind: str
    after: tuple[str, ...] = ()
    map_over: str | None = None
    fn: StepFn | None = None
    queue: str = DEFAULT_WORKFLOW_QUEUE
    priority: int = 0
    max_attempts: int = 3
    delay: float | None = None
    timeout: float | None = None
    backoff: BackoffFn | None = None
    run_timeout: float | None = None
    child: Workflow | None = None

    @property
    def job_kind(self) -> str:
        """The plain job kind its jobs run as: ``<workflow>.<step>``."""
        return f"{self.workflow}.{self.name}"

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "kind": self.kind, "after": list(self.after),
                "map_over": self.map_over, "job_kind": self.job_kind, "queue": self.queue,
                "priority": self.priority, "max_attempts": self.max_attempts,
                "delay": self.delay, "timeout": self.timeout,
                "child": None if self.child is None else self.child.name}

    def args_type(self) -> type[StepArgs]:
        """The `JobArgs` type of its jobs: `StepArgs` with its kind and options."""
        # The class's name must be an ASCII identifier: cattrs generates the
        # structuring code with it (and Python normalizes other identifiers), and a
        # workflow's name may hold '-', a space or any letter.
        name = re.sub(r"[^0-9A-Za-z_]", "_", f"StepArgs_{self.workflow}_{self.name}")
        made = type(name, (StepArgs,), {
            "kind": self.job_kind,
            "options": JobOptions(queue=self.queue, priority=self.priority,
                                  max_attempts=self.max_attempts),
        })
        return attrs.frozen(kw_only=True)(made)


AfterSpec = Sequence["Step | str"]


class Workflow:
    """
    A named DAG of steps. Each step runs as a plain job (its own queue, priority,
    attempts, backoff and run-time limit), after every step it names in `after`
    has completed, and receives their results.

    Args:
        name: identifies the workflow (its runs' `workflow`; its steps' job
            kinds are ``<name>.<step>``).
        input_type: what `StepContext.input` is structured as (an attrs class,
            say); None: parsed JSON.
        queue, priority, max_attempts: the defaults of its steps.
    """

    def __init__(self, name: str, *, input_type: type[Any] | None = None,
                 queue: str = DEFAULT_WORKFLOW_QUEUE, priority: int = 0,
                 max_attempts: int = 3) -> None:
        if not isinstance(name, str) or not name or "." in name or len(name) > 100:
            raise ValueError(f"a workflow's name is 1 to 100 characters without '.', "
                             f"got {name!r}")
        if name == RESERVED_NAME:
            # Its steps' kinds would be the queue's own (`nasiko_queue.signal_timeout`,
            # `nasiko_queue.start_workflow`): a step could take over the signal timers.
            raise ValueError(f"the workflow name {RESERVED_NAME!r} is the queue's own")
        _queue_name(None, None, queue)  # type: ignore[arg-type]
        self.name = name
        self.input_type = input_type
        self.queue = queue
        self.priority = priority
        self.max_attempts = max_attempts
        self.steps: dict[str, Step] = {}

    def __repr__(self) -> str:
        return f"Workflow({self.name!r}, steps={list(self.steps)})"

    def step(self, *, name: str | None = None, after: AfterSpec = (),
             map_over: Step | str | None = None, queue: str | None = None,
             priority: int | None = None, max_attempts: int | None = None,
             delay: float | None = None, backoff: BackoffFn | None = None,
             timeout: float | None = None) -> Callable[[StepFn], Step]:
        """
        Declare a step: decorates its async function, which returns its result
        (JSON-ready); returns the `Step` (name it in later steps' `after`).

        Args:
            after: the steps it runs after (all must complete first).
            map_over: a step (added to `after`) whose list result it runs once
                per item of (`ctx.item`); a step after it gets the list of
                their results, in item order. An empty list completes it at
                once with [].
            delay: seconds to wait, once its dependencies completed, before it
                may run: a durable sleep (the job is scheduled; no slot waits).
            timeout: the run-time limit of one attempt, in seconds.
            queue, priority, max_attempts, backoff: its jobs' (defaults: the
                workflow's; the plain jobs' backoff).
        """
        def add(fn: StepFn) -> Step:
            return self._add(Step(
                workflow=self.name, name=name or fn.__name__, kind="job",
                after=self._after(after, map_over),
                map_over=None if map_over is None else self._name_of(map_over), fn=fn,
                queue=queue or self.queue,
                priority=self.priority if priority is None else priority,
                max_attempts=self.max_attempts if max_attempts is None else max_attempts,
                delay=delay, backoff=backoff, run_timeout=timeout))
        return add

    def signal(self, name: str, *, after: AfterSpec = (),
               timeout: float | None = None) -> Step:
        """
        A step that waits for the signal `name` (`Queue.signal(run_id, name,
        payload)`) once its dependencies have completed, holding no worker slot;
        its result is the signal's payload. A signal sent before it waits is
        kept and consumed when it does; a second signal of the name is refused.
        With `timeout` (seconds from when it starts waiting), the step and its
        run fail if no signal came by then.
        """
        if timeout is not None and not timeout > 0:
            raise ValueError(f"a signal's timeout is > 0 seconds, got {timeout!r}")
        # Its timer job goes to the queue of the timer's type (`SignalTimeout`),
        # which every worker that registered a workflow serves, whichever queues
        # this workflow's own steps use.
        return self._add(Step(workflow=self.name, name=name, kind="signal",
                              after=self._after(after, None), queue=DEFAULT_WORKFLOW_QUEUE,
                              timeout=timeout))

    def child(self, name: str, workflow: Workflow, *, after: AfterSpec = ()) -> Step:
        """
        A step that starts a run of `workflow` (a child run) once its
        dependencies have completed, and completes with the child's result; a
        failed child fails it. The child's input: its one dependency's result,
        an object of its dependencies' results by name, or (none) this run's
        input. Cancelling either run cancels the other.
        """
        if workflow is self:
            raise ValueError("a workflow cannot be its own child")
        return self._add(Step(workflow=self.name, name=name, kind="child",
                              after=self._after(after, None), queue=self.queue,
                              child=workflow))

    def _name_of(self, step: Step | str) -> str:
        name = step.name if isinstance(step, Step) else step
        if isinstance(step, Step) and step.workflow != self.name:
            raise ValueError(f"step {step.name!r} is a step of {step.workflow!r}, "
                             f"not of {self.name!r}")
        if name not in self.steps:
            raise ValueError(f"{self.name}: no step {name!r} declared before this one "
                             f"(steps: {list(self.steps)})")
        return name

    def _after(self, after: AfterSpec, map_over: Step | str | None) -> tuple[str, ...]:
        if isinstance(after, (str, Step)):
            raise TypeError("after is a list of steps: after=[build]")
        names = [self._name_of(s) for s in after]
        if map_over is not None and self._name_of(map_over) not in names:
            names.append(self._name_of(map_over))
        return tuple(dict.fromkeys(names))

    def _add(self, step: Step) -> Step:
        if not step.name or "." in step.name or len(step.name) > 100:
            raise ValueError(f"a step's name is 1 to 100 characters without '.', "
                             f"got {step.name!r}")
        if step.name in self.steps:
            raise ValueError(f"{self.name}: a step named {step.name!r} exists already")
        # Checked here, not when a run reaches the step: the timestamp its job or
        # timer gets is written by the transition that ends the step before, and
        # one out of PostgreSQL's range would fail that step's completion.
        for what, seconds, least in (("delay", step.delay, 0.0), ("timeout", step.timeout, 0.0)):
            if seconds is not None and not least <= seconds <= MAX_WAIT_SECONDS:
                raise ValueError(f"{self.name}.{step.name}: a {what} is 0 to "
                                 f"{MAX_WAIT_SECONDS:.0f} seconds (100 years), got {seconds!r}")
        if step.kind == "job":
            from ..queue import check_plain_kind

            check_plain_kind(step.job_kind)
        self.steps[step.name] = step
        return step

    def children(self) -> dict[str, Workflow]:
        """
        Every workflow its child steps start, and theirs, by name.

        Raises:
            ValueError: two different workflows of one name among them (or one
                named as this one): a run keeps one definition a name, so one of
                them would run the other's steps.
        """
        found: dict[str, Workflow] = {}
        todo = [s.child for s in self.steps.values() if s.child is not None]
        while todo:
            wf = todo.pop()
            seen = self if wf.name == self.name else found.get(wf.name)
            if seen is wf:
                continue
            if seen is not None:
                raise ValueError(f"{self.name}: two different workflows named {wf.name!r} "
                                 "among it and its child workflows; give each its own name")
            found[wf.name] = wf
            todo.extend(s.child for s in wf.steps.values() if s.child is not None)
        return found

    def definition(self, channel: str | None) -> dict[str, Any]:
        """What a run's row keeps (`definition`): read by the SQL rules only."""
        if not self.steps:
            raise ValueError(f"workflow {self.name!r} has no steps")
        return {"steps": [s.to_json() for s in self.steps.values()],
                "children": {name: {"steps": [s.to_json() for s in wf.steps.values()]}
                             for name, wf in self.children().items()},
                "channel": channel}
