"""The Hypothesis state machine on workflows (issue #22): the engine against
`WorkflowModel`. The mutants it must find are in test_workflow_mutants.py."""

from __future__ import annotations

from nasiko_queue.testing.workflow_machine import run_workflow_state_machine


async def test_workflow_runs_match_the_model(dsn: str) -> None:
    await run_workflow_state_machine(dsn)
