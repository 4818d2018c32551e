"""
The state machine the way a user points it at their own code: their own
payload type and their own executor, written against a fake outside world.
"""

from __future__ import annotations

from typing import Any, ClassVar
from uuid import UUID

import attrs
from hypothesis import settings

from nasiko_queue import Executors, JobContext, Payload, Target
from nasiko_queue.testing import Outcome
from nasiko_queue.testing.machine import (
    QueueStateMachine,
    ScriptedWorld,
    SimulatedCrash,
    run_queue_state_machine,
)
from nasiko_queue.testing.runner import profile


@attrs.frozen(kw_only=True)
class CanaryDeploy(Payload):
    """A user's own job type: roll an agent out to a canary slice."""

    kind: ClassVar[str] = "CanaryDeploy"
    build_id: UUID
    agent_id: UUID
    owner_id: UUID
    name: str
    percent: int = 5

    def label(self) -> str:
        return self.name

    def target(self) -> Target:
        return Target(agent_id=self.agent_id)

    def job_owner(self) -> UUID | None:
        return self.owner_id


class FakeCluster:
    """The user's stand-in for a real cluster: it does what the world scripts."""

    def __init__(self, outcome: Outcome, world: ScriptedWorld) -> None:
        self.outcome = outcome
        self.world = world

    async def roll_out(self) -> bool:
        if self.outcome is Outcome.RAISE:
            raise SimulatedCrash("cluster API unreachable")
        if self.outcome is Outcome.HANG:
            await self.world.hang()
        return self.outcome is not Outcome.FAIL


class CanaryMachine(QueueStateMachine):
    kinds: ClassVar[tuple[str, ...]] = ("Upload",)

    def make_payload(self, kind: str, *, target_id: UUID, build_id: UUID, owner_id: UUID,
                     name: str) -> Payload:
        return CanaryDeploy(build_id=build_id, agent_id=target_id, owner_id=owner_id,
                            name=name)

    def make_executors(self, world: ScriptedWorld) -> Executors:
        executors = Executors()

        @executors.register(CanaryDeploy)
        async def deploy(ctx: JobContext[CanaryDeploy]) -> None:
            outcome = world.begin(ctx)
            if outcome is Outcome.DELETE_TARGET or outcome is Outcome.SOFT_DELETE:
                # Someone else acts on the agent meanwhile; the world does it.
                await scripted_side_effect(ctx, outcome)
                if outcome is Outcome.DELETE_TARGET:
                    return
            await world.report(ctx, "building")
            ok = await FakeCluster(outcome, world).roll_out()
            await world.report(ctx, "success" if ok else "failed",
                               "running" if ok else "failed")

        return executors


async def scripted_side_effect(ctx: JobContext[Any], outcome: Outcome) -> None:
    if outcome is Outcome.DELETE_TARGET:
        await ctx.db.execute("DELETE FROM agents WHERE id = $1", ctx.target.agent_id)
    else:
        await ctx.db.execute("UPDATE agents SET deleted_at = now() WHERE id = $1",
                             ctx.target.agent_id)


async def test_a_users_own_payload_and_executor(dsn: str) -> None:
    # The engine's paths are the base machine's (tests/test_statemachine.py); this
    # one shows a user's own payload type and executor go through them. Its share
    # of the machines' budget (issue #24): 20 examples, not the profile's 50.
    await run_queue_state_machine(dsn, CanaryMachine,
                                  settings=settings(profile(), max_examples=20))
