"""
Seeing and steering workflow runs (issue #22): the read model (`admin.runs`),
the CLI (`run`, `runs list|cancel|retry`), the dashboard's Runs pages and the
`/metrics` gauge. Real PostgreSQL, runs driven by a real worker; no sleeps: a
test waits on the worker's counters.
"""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path
from typing import Any
from uuid import UUID

import attrs
import httpx
import pytest
import trio
from click.testing import CliRunner
from prometheus_client.parser import text_string_to_metric_families

from nasiko_queue import Database, Queue, StepContext, Workflow
from nasiko_queue.admin.runs import (
    RunFilter,
    RunNotFound,
    RunRefused,
    cancel_run,
    list_runs,
    retry_run,
    run_detail,
)
from nasiko_queue.cli.runs import run_lines
from nasiko_queue.db.statements import Q
from nasiko_queue.job_errors import MASK
from nasiko_queue.web.dashboard import dashboard_app
from nasiko_queue.web.metrics import Metrics

from .conftest import FAST, MASTER_KEY
from .helpers import TEST_DEADLINE, running
from .test_cli import invoke, runner, with_db  # noqa: F401  (runner: a fixture)
from .test_dashboard import (  # noqa: F401  (shots: a fixture)
    ESCAPED,
    HOSTILE,
    TOKEN,
    _Browser,
    _client,
    _login,
    _login_in,
    needs_chromium,
    serving,
    shots,
)
from .test_workflows import executors_for

CONFIG = attrs.evolve(FAST, concurrency=4, heartbeat_interval=0.2)
#: What a step returns among its result: a sealed credential, shown masked only.
SECRET = "sk-run-secret-99"
SEALED = MASTER_KEY.seal(UUID(int=7), "KEY", SECRET)


@attrs.define
class Digest:
    """A workflow whose `summarise` step crashes (twice: its two attempts) while
    `failing`: fetch → check (once per item of fetch) → summarise → publish."""

    failing: bool = True

    def workflow(self) -> Workflow:
        wf = Workflow("digest", max_attempts=1)

        @wf.step()
        async def fetch(ctx: StepContext) -> list[str]:
            return ["a", "b"]

        @wf.step(map_over=fetch)
        async def check(ctx: StepContext) -> dict[str, Any]:
            return {"part": ctx.item, "key": SEALED}

        @wf.step(after=[check], max_attempts=2, backoff=lambda _attempt: 0.0)
        async def summarise(ctx: StepContext) -> str:
            if self.failing:
                raise RuntimeError(f"rate limited {HOSTILE}")
            return "summary"

        @wf.step(after=[summarise])
        async def publish(ctx: StepContext) -> dict[str, Any]:
            return {"published": ctx.results["summarise"], "key": SEALED}

        return wf


def other_workflow() -> Workflow:
    wf = Workflow("other")

    @wf.step()
    async def only(ctx: StepContext) -> None:
        return None

    return wf


async def failed_run(db: Database) -> tuple[UUID, Digest]:
    """A run of `digest` that failed at `summarise` (fetch and check completed)."""
    queue = Queue(db, config=CONFIG)
    digest = Digest()
    wf = digest.workflow()
    run_id = await queue.start(wf)
    async with running(queue, executors_for(wf)) as worker:
        await worker.wait_for(lambda s: s.failed >= 1)
    return run_id, digest


async def finish_retried(db: Database, digest: Digest) -> None:
    """Run what a retry of the failed run enqueued: summarise, then publish."""
    digest.failing = False
    queue = Queue(db, config=CONFIG)
    async with running(queue, executors_for(digest.workflow())) as worker:
        await worker.wait_for(lambda s: s.done >= 2)


# -- the read model ---------------------------------------------------------------


async def test_a_runs_view_has_its_steps_in_dag_order_with_every_jobs_attempts(
    db: Database,
) -> None:
    run_id, digest = await failed_run(db)
    run = await run_detail(db, run_id)
    assert run is not None
    assert (run.workflow, run.state, run.failed_step) == ("digest", "failed", "summarise")
    assert run.error == f"RuntimeError: rate limited {HOSTILE}"
    assert [(s.name, s.after, s.depth, s.state) for s in run.steps] == [
        ("fetch", (), 0, "completed"), ("check", ("fetch",), 1, "completed"),
        ("summarise", ("check",), 2, "failed"), ("publish", ("summarise",), 3, "cancelled")]
    assert run.failed is run.step("summarise")
    # The mapped step: its items, each with its own job.
    check = run.step("check")
    assert check.map_over == "fetch"
    assert [(i.index, i.state) for i in check.items] == [(0, "completed"), (1, "completed")]
    assert sorted(j.index for j in check.jobs) == [0, 1]
    # The failed step's one job: two attempts, both errors kept, in order.
    (job,) = run.step("summarise").jobs
    assert (job.state, job.attempt, job.max_attempts, job.live) == ("discarded", 2, 2, True)
    assert [(e.attempt, e.reason, e.error_type) for e in job.errors] == [
        (1, "crash", "builtins.RuntimeError"), (2, "crash", "builtins.RuntimeError")]
    assert job.seconds is not None
    assert job.seconds >= 0
    assert run.step("publish").jobs == ()
    # Results as job results are shown: the sealed credential masked. A mapped
    # step's result (every item's, as large as the fan-out) is not read: its
    # items on the page carry theirs.
    assert check.result is None
    assert [i.result for i in check.items] == [{"part": "a", "key": MASK},
                                               {"part": "b", "key": MASK}]
    assert (check.item_states, check.job_states) == ({"completed": 2}, {"completed": 2})
    assert run.step("summarise").job_states == {"discarded": 1}
    assert run.next_cursor is None  # 4 jobs: one page
    assert SECRET not in json.dumps(run.to_json())
    assert SEALED not in json.dumps(run.to_json())

    # A retry keeps the failed job (its attempts are why the run failed) and
    # gives the step a new one; completed steps keep their results and jobs.
    assert await retry_run(db, run_id, actor="cli") == "retried"
    await finish_retried(db, digest)
    run = await run_detail(db, run_id)
    assert run is not None
    assert (run.state, run.result, run.failed_step, run.error) == (
        "completed", {"published": "summary", "key": MASK}, None, None)
    old, new = run.step("summarise").jobs
    assert (old.id, old.state, old.live, len(old.errors)) == (job.id, "discarded", False, 2)
    assert (new.state, new.attempt, new.live, new.result) == ("completed", 1, True, "summary")
    assert len(run.step("fetch").jobs) == 1
    assert run.step("summarise").attempts == 3
    assert [(e.action, e.actor) for e in run.events] == [("retried", "cli")]

    with pytest.raises(RunRefused, match="completed: only failed or cancelled"):
        await retry_run(db, run_id)
    with pytest.raises(RunRefused, match="already ended"):
        await cancel_run(db, run_id)
    with pytest.raises(RunNotFound):
        await cancel_run(db, uuid.uuid4())
    with pytest.raises(RunNotFound):
        await retry_run(db, uuid.uuid4())
    assert await run_detail(db, uuid.uuid4()) is None


async def test_a_runs_view_shows_a_child_run_and_a_waiting_signal(db: Database) -> None:
    kid = Workflow("kid")

    @kid.step()
    async def look(ctx: StepContext) -> str:
        return f"looked at {ctx.input}"

    parent = Workflow("parent")

    @parent.step()
    async def first(ctx: StepContext) -> str:
        return "x"

    sub = parent.child("sub", kid, after=[first])
    approval = parent.signal("go", after=[sub])

    @parent.step(after=[approval])
    async def last(ctx: StepContext) -> None:
        return None

    queue = Queue(db, config=CONFIG)
    run_id = await queue.start(parent)
    async with running(queue, executors_for(parent)) as worker:
        await worker.wait_for(lambda s: s.done >= 2)
    run = await run_detail(db, run_id)
    assert run is not None
    assert [(s.name, s.kind, s.state, s.depth) for s in run.steps] == [
        ("first", "job", "completed", 0), ("sub", "child", "completed", 1),
        ("go", "signal", "waiting", 2), ("last", "job", "blocked", 3)]
    child_id = run.step("sub").child_run
    assert child_id is not None
    assert run.step("sub").result == "looked at x"
    assert (run.step("go").jobs, run.step("go").finished_at) == ((), None)
    child = await run_detail(db, child_id)
    assert child is not None
    assert (child.state, child.parent_run, child.parent_step) == ("completed", run_id, "sub")
    listed = {r.id: r for r in await list_runs(db)}
    assert (listed[child_id].parent_run, listed[child_id].parent_step) == (run_id, "sub")
    assert (listed[run_id].steps, listed[run_id].completed) == (4, 2)
    lines = run_lines(run)
    assert "    sub ← first  [completed] (child step)" in lines
    assert f"        child run {child_id}" in lines
    assert "      go ← sub  [waiting] (signal step)" in lines
    # Cancelling the parent is recorded in its timeline; the signal is refused after.
    assert await cancel_run(db, run_id, actor="api") == "cancelled"
    run = await run_detail(db, run_id)
    assert run is not None
    assert [(e.action, e.actor, e.detail) for e in run.events] == [("cancelled", "api", "run")]
    assert run.step("go").state == "cancelled"


async def _started_runs(db: Database) -> list[UUID]:
    """Five runs started one after another (none run: no worker); the second cancelled."""
    queue = Queue(db, config=CONFIG)
    digest, other = Digest().workflow(), other_workflow()
    ids = [await queue.start(wf) for wf in (digest, digest, other, digest, other)]
    assert await cancel_run(db, ids[1], actor="dashboard") == "cancelled"
    return ids


async def test_runs_are_listed_newest_first_filtered_and_paged_by_position(
    db: Database,
) -> None:
    ids = await _started_runs(db)
    newest_first = ids[::-1]
    assert [r.id for r in await list_runs(db)] == newest_first
    assert [r.id for r in await list_runs(db, RunFilter(workflow="other"))] == [ids[4], ids[2]]
    cancelled = await list_runs(db, RunFilter(state="cancelled"))
    assert [(r.id, r.state, r.error) for r in cancelled] == [(ids[1], "cancelled", "cancelled")]
    assert [r.id for r in await list_runs(db, RunFilter(workflow="digest", state="running"))] \
        == [ids[3], ids[0]]
    first = await list_runs(db)
    assert (first[0].steps, first[0].completed) == (1, 0)
    assert (first[1].steps, first[1].completed) == (4, 0)
    # Pages by position: a run that ends meanwhile keeps its place.
    paged: list[UUID] = []
    after = None
    while page := await list_runs(db, RunFilter(limit=2), after=after):
        paged += [r.id for r in page]
        if after is None:  # the oldest run ends while paging: none skipped or repeated
            await cancel_run(db, ids[0])
        after = page[-1].cursor
    assert paged == newest_first
    with pytest.raises(ValueError, match="not a listing cursor"):
        await list_runs(db, after="nonsense")
    with pytest.raises(ValueError, match="state must be one of"):
        RunFilter(state="discarded")


async def test_the_listing_and_a_runs_view_read_by_index(db: Database) -> None:
    # The plans of the listing's first page and a run's step jobs (migration
    # 0021), checked with sequential scans priced out as on a big table.
    async with db.transaction() as tx:
        await tx.execute("SET LOCAL enable_seqscan = off")
        plan = "\n".join(r[0] for r in await tx.fetch(
            "EXPLAIN " + Q.workflow_runs_list, None, None, None, None, 50))
        assert "nasiko_queue_workflow_runs_started" in plan
        assert "Sort" not in plan.split("Nested Loop")[0]
        plan = "\n".join(r[0] for r in await tx.fetch("EXPLAIN " + Q.workflow_run_jobs_page,
                                                      uuid.uuid4(), None, None, None, 50))
        assert "nasiko_queue_jobs_workflow_run" in plan


def fan_workflow(items: int) -> Workflow:
    """plan → each (once per item of plan's list of `items`)."""
    wf = Workflow("fan")

    @wf.step()
    async def plan(ctx: StepContext) -> list[int]:
        return list(range(items))

    @wf.step(map_over=plan)
    async def each(ctx: StepContext) -> dict[str, Any]:
        return {"item": ctx.item, "key": SEALED}

    return wf


async def fanned_run(db: Database, items: int = 7) -> UUID:
    """A completed run of `fan_workflow(items)`: 1 + `items` step jobs; item 0's
    job with 5 kept errors (written in SQL: the view reads what is kept)."""
    queue = Queue(db, config=CONFIG)
    wf = fan_workflow(items)
    run_id = await queue.start(wf)
    async with running(queue, executors_for(wf)):
        # The run's end, not its jobs' (an item's end that found the run's row
        # busy is applied by the transition service, migration 0033).
        with trio.fail_after(TEST_DEADLINE):
            await queue.run_result(run_id)
    await db.execute(
        "INSERT INTO nasiko_queue_job_errors (job_id, attempt, reason, error_type, message, "
        "traceback) SELECT s.job_id, a, 'crash', 'builtins.OSError', 'try ' || a, '' "
        "FROM nasiko_queue_workflow_steps AS s, generate_series(1, 5) AS a "
        "WHERE s.run_id = $1 AND s.step = 'each' AND s.idx = 0", run_id)
    return run_id


async def test_a_runs_view_is_paged_and_its_counts_are_exact(db: Database) -> None:
    """A run's view sent every job the run ever had with every kept error: a
    20,000-item fan-out was 20,001 jobs and 40,000 errors in one answer. It is
    read a page at a time, each job with its last errors; the counts are the
    run's, on every page."""
    run_id = await fanned_run(db)
    seen: list[tuple[str, int]] = []
    after = None
    pages = 0
    while True:
        run = await run_detail(db, run_id, limit=3, after=after)
        assert run is not None
        pages += 1
        page = [(s.name, j.index) for s in run.steps for j in s.jobs]
        assert len(page) <= 3
        seen += page
        each = run.step("each")
        assert (each.item_count, each.item_states, each.job_states) == (
            7, {"completed": 7}, {"completed": 7})
        assert (run.step("plan").job_states, each.attempts) == ({"completed": 1}, 7)
        assert each.started_at is not None
        assert each.finished_at is not None
        assert [i.index for i in each.items] == [j.index for j in each.jobs]
        assert all(i.result == {"item": i.index, "key": MASK} for i in each.items)
        if run.next_cursor is None:
            break
        after = run.next_cursor
    # Every job once, oldest first, a fan-out's in item order.
    assert (pages, seen) == (3, [("plan", 0)] + [("each", i) for i in range(7)])
    first = await run_detail(db, run_id, limit=2)
    assert first is not None
    (item0,) = [j for j in first.step("each").jobs if j.index == 0]
    assert ([e.message for e in item0.errors], item0.more_errors) == (
        ["try 3", "try 4", "try 5"], True)
    with pytest.raises(ValueError, match="not a cursor of a run's jobs"):
        await run_detail(db, run_id, after="nonsense")
    with pytest.raises(ValueError, match="limit must be"):
        await run_detail(db, run_id, limit=0)


async def test_the_dashboards_run_page_is_paged_with_a_next_link(db: Database) -> None:
    run_id = await fanned_run(db)
    app = dashboard_app(db, token=TOKEN, config=CONFIG)
    async with await _client(app) as client:
        r = await client.get(f"/runs/{run_id}?limit=3")
        assert r.status_code == 200
        view = r.text
        assert view.count('class="step-job') == 3
        assert "7 item(s): 7 completed; 7 job(s): 7 completed (2 on this page)" in view
        assert "attempt 5 crash" in view
        assert "attempt 2 crash" not in view  # item 0's earlier errors: on its own page
        assert f'<a href="/jobs/{await _job_of(db, run_id, 0)}">earlier errors</a>' in view
        assert SEALED not in view
        pages = [view]
        while 'rel="next"' in view:
            link = view.split('<a rel="next" href="')[1].split('"')[0].replace("&amp;", "&")
            assert link.startswith(f"/runs/{run_id}?")
            view = (await client.get(link)).text
            assert "7 item(s): 7 completed; 7 job(s): 7 completed" in view
            pages.append(view)
        assert [p.count('class="step-job') for p in pages] == [3, 3, 2]
        assert "First page" in pages[-1]
        # The default page holds all 8; a page asked bigger than the cap is capped.
        whole = (await client.get(f"/runs/{run_id}")).text
        assert whole.count('class="step-job') == 8
        assert 'rel="next"' not in whole
        assert "A page shows at most" in (await client.get(f"/runs/{run_id}?limit=999")).text
        assert (await client.get(f"/runs/{run_id}?after=bogus")).status_code == 400
        assert (await client.get(f"/runs/{run_id}?limit=0")).status_code == 400


async def _job_of(db: Database, run_id: UUID, idx: int) -> UUID:
    job: UUID = await db.fetchval("SELECT job_id FROM nasiko_queue_workflow_steps "
                                  "WHERE run_id = $1 AND step = 'each' AND idx = $2",
                                  run_id, idx)
    return job


def test_the_clis_run_is_paged_too(runner: CliRunner, dsn: str) -> None:  # noqa: F811
    run_id = with_db(dsn, fanned_run)
    shown = invoke(runner, "run", str(run_id), "--dsn", dsn, "--limit", "3")
    assert shown.exit_code == 0, shown.output
    lines = shown.stdout.splitlines()
    assert "    each ← plan  [completed] once per item of plan: 7 item(s)" in lines
    assert "        items: 7 completed" in lines
    assert "        jobs: 7 completed (2 on this page)" in lines
    assert sum(" item " in line and line.strip().startswith("job ") for line in lines) == 2
    (more,) = [line for line in lines if line.startswith("more jobs: --after ")]
    cursor = more.removeprefix("more jobs: --after ")
    page = json.loads(invoke(runner, "run", str(run_id), "--dsn", dsn, "--limit", "3",
                             "--after", cursor, "--json").stdout)
    assert [j["index"] for j in page["steps"][1]["jobs"]] == [2, 3, 4]
    assert page["steps"][1]["job_states"] == {"completed": 7}
    assert page["next"] is not None
    bad = invoke(runner, "run", str(run_id), "--dsn", dsn, "--after", "x")
    assert bad.exit_code == 2
    assert "not a cursor" in bad.stderr


# -- /metrics ---------------------------------------------------------------------


async def test_metrics_count_runs_by_workflow_and_state(db: Database) -> None:
    await _started_runs(db)
    text = (await Metrics(Queue(db, config=CONFIG)).scrape()).decode()
    runs = {(s.labels["workflow"], s.labels["state"]): s.value
            for f in text_string_to_metric_families(text)
            if f.name == "nasiko_queue_workflow_runs" for s in f.samples}
    # Every state of every workflow seen, zeros included (an alert on failed
    # runs has a series to read before the first failure).
    assert runs == {("digest", "running"): 2.0, ("digest", "cancelled"): 1.0,
                    ("digest", "completed"): 0.0, ("digest", "failed"): 0.0,
                    ("other", "running"): 2.0, ("other", "cancelled"): 0.0,
                    ("other", "completed"): 0.0, ("other", "failed"): 0.0}


# -- the CLI ----------------------------------------------------------------------


def test_the_cli_shows_lists_retries_and_cancels_runs(runner: CliRunner,  # noqa: F811
                                                      dsn: str) -> None:
    run_id, _digest = with_db(dsn, failed_run)

    shown = invoke(runner, "run", str(run_id), "--dsn", dsn)
    assert shown.exit_code == 0, shown.output
    text = shown.stdout
    assert f"run {run_id}  workflow digest  [failed]" in text
    assert f"failed at step summarise: RuntimeError: rate limited {HOSTILE}" in text
    lines = text.splitlines()
    # The graph: each step indented under its dependencies, named after ←.
    assert "  fetch  [completed]" in lines
    assert "    check ← fetch  [completed] once per item of fetch: 2 item(s)" in lines
    assert "      summarise ← check  [failed]" in lines
    assert "        publish ← summarise  [cancelled]" in lines
    assert f'        [0] completed: {{"key":"{MASK}","part":"a"}}' in lines
    assert any(line.startswith("        job ") and " item 0: completed, attempt 1/1, " in line
               for line in lines)
    assert any("attempt 1 crash at" in line and "builtins.RuntimeError: rate limited" in line
               for line in lines)
    assert any("attempt 2 crash at" in line for line in lines)
    assert SECRET not in text
    assert SEALED not in text

    as_json = json.loads(invoke(runner, "run", str(run_id), "--dsn", dsn, "--json").stdout)
    assert as_json["state"] == "failed"
    assert [s["name"] for s in as_json["steps"]] == ["fetch", "check", "summarise", "publish"]
    assert [len(j["errors"]) for j in as_json["steps"][2]["jobs"]] == [2]
    job_id = as_json["steps"][2]["jobs"][0]["id"]
    job = json.loads(invoke(runner, "job", job_id, "--dsn", dsn, "--json").stdout)
    assert job["workflow_run"] == str(run_id)

    listed = json.loads(invoke(runner, "runs", "list", "--dsn", dsn, "--json",
                               "--state", "failed").stdout)
    assert [(r["id"], r["workflow"], r["failed_step"], r["steps"], r["completed"])
            for r in listed["runs"]] == [(str(run_id), "digest", "summarise", 4, 2)]
    assert listed["next"] is None
    assert json.loads(invoke(runner, "runs", "list", "--dsn", dsn, "--json", "--workflow",
                             "other").stdout)["runs"] == []
    table = invoke(runner, "runs", "list", "--dsn", dsn)
    assert table.exit_code == 0, table.output
    assert str(run_id) in table.stdout
    assert "2/4" in table.stdout

    retried = invoke(runner, "runs", "retry", str(run_id), "--dsn", dsn)
    assert retried.exit_code == 0, retried.output
    assert retried.stdout.strip() == f"retried run {run_id}"
    again = invoke(runner, "runs", "retry", str(run_id), "--dsn", dsn)
    assert again.exit_code == 1
    assert "is running: only failed or cancelled runs can be retried" in again.stderr
    cancelled = invoke(runner, "runs", "cancel", str(run_id), "--dsn", dsn)
    assert cancelled.exit_code == 0, cancelled.output
    assert cancelled.stdout.strip() == f"cancelled run {run_id}"
    missing = uuid.uuid4()
    both = invoke(runner, "runs", "cancel", str(run_id), str(missing), "--dsn", dsn)
    assert both.exit_code == 1
    assert both.stderr.splitlines() == [f"run {run_id} has already ended (cancelled)",
                                        f"no run {missing}"]
    assert "retried by cli" in invoke(runner, "run", str(run_id), "--dsn", dsn).stdout
    gone = invoke(runner, "run", str(missing), "--dsn", dsn)
    assert gone.exit_code == 1
    assert f"no run {missing}" in gone.stderr
    bad = invoke(runner, "runs", "list", "--dsn", dsn, "--after", "x")
    assert bad.exit_code == 2
    assert "not a listing cursor" in bad.stderr


# -- the dashboard ----------------------------------------------------------------


async def test_the_dashboard_lists_runs_and_shows_a_runs_steps_masked_and_escaped(
    db: Database,
) -> None:
    run_id, _digest = await failed_run(db)
    other = await Queue(db, config=CONFIG).start(other_workflow())
    app = dashboard_app(db, token=TOKEN, config=CONFIG)
    async with await _client(app) as client:
        page = (await client.get("/")).text
        assert '<a href="/runs">Runs</a>' in page
        listing = (await client.get("/runs")).text
        assert f'data-run="{run_id}"' in listing
        assert f'data-run="{other}"' in listing
        assert listing.index(f'data-run="{other}"') < listing.index(f'data-run="{run_id}"')
        assert "2/4" in listing
        assert f"summarise: RuntimeError: rate limited {ESCAPED}" in listing
        failed = (await client.get("/runs?" + str(httpx.QueryParams(
            {"state": "failed", "workflow": "digest"})))).text
        assert f'data-run="{run_id}"' in failed
        assert f'data-run="{other}"' not in failed
        assert f'data-run="{other}"' in (await client.get("/runs?workflow=other")).text
        paged = await client.get("/runs?limit=1")
        assert 'rel="next"' in paged.text
        assert (await client.get("/runs?state=bogus")).status_code == 400
        assert (await client.get("/runs?after=bogus")).status_code == 400

        r = await client.get(f"/runs/{run_id}")
        assert r.status_code == 200
        view = r.text
        assert HOSTILE not in view
        assert ESCAPED in view
        assert SECRET not in view
        assert SEALED not in view
        assert MASK in view  # check's results, masked
        # Steps in dependency order, each with its jobs and their attempts' errors.
        positions = [view.index(f'data-step="{name}"')
                     for name in ("fetch", "check", "summarise", "publish")]
        assert positions == sorted(positions)
        assert 'class="step failed-step" data-step="summarise"' in view
        assert "attempt 1 crash: <code>builtins.RuntimeError</code>" in view
        assert "attempt 2 crash: <code>builtins.RuntimeError</code>" in view
        assert "item 1" in view
        assert "depth-3" in view  # publish, three dependencies deep
        # Not logged in: no action shown.
        assert "/actions/run-retry" not in view
        # A step's job links back to its run.
        job_id = await db.fetchval("SELECT job_id FROM nasiko_queue_workflow_steps "
                                   "WHERE run_id = $1 AND step = 'summarise'", run_id)
        assert f'<a href="/runs/{run_id}">' in (await client.get(f"/jobs/{job_id}")).text
        assert (await client.get(f"/runs/{uuid.uuid4()}")).status_code == 404
        assert (await client.get("/runs/not-an-id")).status_code == 404


async def test_run_retry_and_cancel_need_the_token_the_csrf_token_and_a_confirmation(
    db: Database,
) -> None:
    run_id, _digest = await failed_run(db)
    app = dashboard_app(db, token=TOKEN, config=CONFIG)
    async with await _client(app) as client:
        r = await client.post("/actions/run-retry", data={"id": str(run_id)})
        assert r.status_code == 401
        csrf = await _login(client)
        r = await client.post("/actions/run-retry", data={"id": str(run_id), "csrf": "bad"})
        assert r.status_code == 403
        assert await db.fetchval("SELECT state FROM nasiko_queue_workflow_runs "
                                 "WHERE id = $1", run_id) == "failed"
        view = (await client.get(f"/runs/{run_id}")).text
        assert "/actions/run-retry" in view
        assert "/confirm/run-cancel" not in view  # it is not running
        r = await client.post("/actions/run-retry", data={
            "id": str(run_id), "csrf": csrf, "next": f"/runs/{run_id}"})
        assert r.status_code == 303
        assert r.headers["location"].startswith(f"/runs/{run_id}?msg=run+")
        # Running again: a retry is refused with a message, cancel is offered.
        r = await client.post("/actions/run-retry", data={
            "id": str(run_id), "csrf": csrf, "next": f"/runs/{run_id}"})
        assert "error=" in r.headers["location"]
        view = (await client.get(f"/runs/{run_id}")).text
        assert "/confirm/run-cancel" in view
        assert "retried by dashboard" in view
        # The cancel's confirmation page counts what it stops; without it, refused.
        r = await client.post("/actions/run-cancel", data={"id": str(run_id), "csrf": csrf})
        assert r.status_code == 400
        confirm = (await client.get(f"/confirm/run-cancel?id={run_id}")).text
        assert "cancels <strong>2</strong> unfinished step(s)" in confirm
        assert 'name="confirm" value="yes"' in confirm
        r = await client.post("/actions/run-cancel", data={
            "id": str(run_id), "csrf": csrf, "confirm": "yes", "next": f"/runs/{run_id}"})
        assert r.status_code == 303
        assert "msg=" in r.headers["location"]
        assert await db.fetchval("SELECT state FROM nasiko_queue_workflow_runs "
                                 "WHERE id = $1", run_id) == "cancelled"
        r = await client.post("/actions/run-cancel", data={
            "id": str(uuid.uuid4()), "csrf": csrf, "confirm": "yes"})
        assert "error=no+run" in r.headers["location"]
    # Read-only: no action shown, every one refused.
    app = dashboard_app(db, token=TOKEN, read_only=True, config=CONFIG)
    async with await _client(app) as client:
        assert "/actions/run-retry" not in (await client.get(f"/runs/{run_id}")).text
        r = await client.post("/actions/run-retry", data={"id": str(run_id)},
                              headers={"Authorization": f"Bearer {TOKEN}"})
        assert r.status_code == 403


@needs_chromium
async def test_browser_runs_page_run_page_and_retry(db: Database,
                                                    shots: Path) -> None:  # noqa: F811
    from playwright.sync_api import expect

    run_id, digest = await failed_run(db)
    digest.failing = False
    queue = Queue(db, config=CONFIG)
    app = dashboard_app(db, token=TOKEN, config=CONFIG)
    browser = _Browser(shots)
    with trio.fail_after(TEST_DEADLINE * 2):
        async with serving(app) as base, browser.page() as page, \
                running(queue, executors_for(digest.workflow())) as worker:

            def pages() -> None:
                _login_in(page, base)
                page.click("nav >> text=Runs")
                row = page.locator(f"tr[data-run='{run_id}']")
                expect(row.locator(".badge")).to_have_text("failed")
                expect(row.locator("td.error")).to_contain_text(HOSTILE)  # escaped text
                browser.shot(page, "runs")
                row.locator("a").first.click()
                expect(page.locator("h1")).to_contain_text(str(run_id))
                expect(page.locator("tr.step")).to_have_count(4)
                expect(page.locator("tr.failed-step")).to_have_attribute(
                    "data-step", "summarise")
                expect(page.locator("tr.failed-step .badge")).to_have_text("failed")
                browser.shot(page, "run")
                page.click("button:text('Retry run')")
                expect(page.locator("p.flash.ok")).to_have_text(f"run {run_id} retried")

            await browser.do(pages)
            await worker.wait_for(lambda s: s.done >= 2)

            def after() -> None:
                page.goto(f"{base}/runs/{run_id}")
                expect(page.locator("dd.state .badge")).to_have_text("completed")
                expect(page.locator("tr.step-job.replaced")).to_have_count(1)
                browser.shot(page, "run-retried")

            await browser.do(after)
    assert browser.dialogs == []
    assert set(await trio.to_thread.run_sync(os.listdir, shots)) >= {
        "runs.png", "run.png", "run-retried.png"}
