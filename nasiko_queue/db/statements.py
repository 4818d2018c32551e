"""
Loads `db/queries.sql` once into a typed record of named statements.

Why a record and not a dict: a typo in a statement name is then a type error
(mypy) and an import-time error (the loader refuses a file whose names differ
from the fields below), never a KeyError in the middle of a drain.
"""

from __future__ import annotations

import re
from functools import partial
from importlib import resources

import attrs

from .schema import qualify

_NAME = re.compile(r"^-- name: (\w+)\s*$", re.MULTILINE)


@attrs.frozen
class Queries:
    """The statements of `db/queries.sql`, one field per `-- name:` block."""

    job_insert: str
    job_claim: str
    job_claim_kinds: str
    job_fail: str
    agent_lock: str
    connector_lock: str
    recovery_lock_wait: str
    search_statement_timeout: str
    job_reset_to_pending: str
    jobs_stuck_exhausted: str
    jobs_reset_stuck: str
    agent_builds_fail_unfinished: str
    agent_build_fail_own: str
    agent_has_success: str
    agent_mark_failed: str
    agent_delete: str
    connector_builds_fail_unfinished: str
    connector_has_success: str
    connector_mark_failed: str
    connector_delete: str
    jobs_count_by_status: str
    jobs_in_progress_summary: str
    jobs_oldest_pending_age: str
    migrations_lock: str
    migrations_unlock: str
    session_schema_append: str
    migrations_search_path: str
    migrations_set_search_path: str
    migrations_set_schema: str
    migrations_schema_create: str
    migrations_legacy_schema: str
    migrations_functions_unpathed: str
    build_tables_schemas: str
    migrations_create_table: str
    migrations_applied: str
    migrations_record: str
    migrations_updated_at_function: str
    migrations_tables_present: str
    migrations_table_columns: str
    migrations_types_present: str
    demo_plain_unfinished: str
    agent_insert: str
    agent_build_insert: str
    connector_insert: str
    connector_build_insert: str
    agent_build_set_status: str
    connector_build_set_status: str
    agent_set_status: str
    connector_set_build_status: str
    agent_soft_delete: str
    job_get: str
    job_set_attempt: str
    jobs_count_unfinished: str
    agent_get: str
    agent_build_get_status: str
    connector_get: str
    connector_build_get_status: str
    snapshot_build_world: str
    testing_empty_build_jobs: str
    testing_empty_tables: str
    testing_worker_expire: str
    testing_leader_expire: str
    job_age_in_progress: str
    jobs_age_in_progress: str
    job_insert_notify: str
    jobs_insert_many: str
    jobs_insert_many_notify: str
    jobs_prune: str
    jobs_finish_many_and_claim: str
    jobs_finish_many_and_claim_kinds: str
    jobs_finish_reported_and_claim: str
    jobs_finish_reported_and_claim_kinds: str
    jobs_unclaim: str
    jobs_unclaim_lost: str
    backend_end: str
    job_error_insert: str
    job_errors_of: str
    job_show: str
    job_errors_prune: str
    backend_alive: str
    queue_notify: str
    queue_notify_due: str
    worker_register: str
    worker_heartbeat: str
    worker_keep_alive: str
    workers_live_kinds: str
    worker_deregister: str
    worker_retire: str
    workers_expired: str
    worker_declare_dead: str
    jobs_held_by_dead_exhausted: str
    jobs_rescue: str
    workers_prune_dead: str
    workers_list: str
    plain_queue_counts: str
    plain_insert: str
    plain_insert_notify: str
    plain_unique_holder: str
    plain_insert_many: str
    plain_insert_many_notify: str
    plain_insert_many_unique: str
    plain_insert_many_unique_notify: str
    plain_claim: str
    plain_finish_many_and_claim: str
    plain_retry: str
    plain_end: str
    plain_reset: str
    plain_unclaim: str
    plain_defer: str
    plain_unclaim_lost: str
    plain_next_due: str
    plain_cancel: str
    plain_cancels_held: str
    plain_rescue: str
    plain_sweep_stuck: str
    plain_prune: str
    plain_get: str
    # -- results (issue #22)
    plain_result: str
    result_wait_and_read: str
    result_wait_remove: str
    deleted_build_jobs_prune: str
    # -- dead-letter queue and job listings
    jobs_list: str
    jobs_count: str
    plain_lock: str
    plain_requeue: str
    plain_delete_finished: str
    build_job_peek: str
    build_job_lock: str
    build_job_requeue: str
    agent_soft_deleted: str
    agent_build_requeue: str
    agent_redeploy: str
    connector_build_requeue: str
    connector_redeploy: str
    build_job_delete_finished: str
    deleted_build_job_get: str
    deleted_build_job_delete: str
    job_errors_delete: str
    # -- cron schedules
    schedule_advance: str
    schedule_first_sight: str
    schedule_list: str
    # -- health and metrics
    health_ping: str
    metrics_jobs: str
    # -- dashboard
    queue_pause: str
    queue_resume: str
    queues_paused: str
    throughput_buckets: str
    build_queue_counts: str
    queue_throughput: str
    queues_unserved: str
    jobs_running: str
    jobs_scheduled: str
    plain_run_now: str
    job_event_insert: str
    job_events_prune: str
    job_events_of: str
    jobs_search: str
    schedule_pause: str
    schedule_resume: str
    table_estimates: str
    plain_queue_live_counts: str
    plain_queue_finished_counts: str
    plain_queue_finished_estimates: str
    build_queue_live_counts: str
    build_finished_counts: str
    build_finished_estimates: str
    enqueue_function: str
    enqueue_function_many: str
    enqueue_function_many_text: str
    workflow_start: str
    workflow_cancel: str
    workflow_retry: str
    workflow_signal: str
    workflow_signal_timeout: str
    workflow_await_run_end: str
    workflow_apply_due: str
    workflow_step_inputs: str
    workflow_get: str
    workflow_get_steps: str
    workflow_result: str
    workflow_result_wait_and_read: str
    workflow_stuck_runs: str
    workflow_runs_list: str
    workflow_show: str
    workflow_step_heads: str
    workflow_run_counts: str
    workflow_run_jobs_page: str
    job_errors_last_of_many: str
    metrics_workflow_runs: str
    limit_set: str
    limit_clear: str
    limits_list: str


#: A statement written as another that includes a different statement: its first
#: line names the base and the swap; it has no text of its own but its comments.
_DERIVED = re.compile(r"\A-- derived from (\w+): it includes (\w+) for (\w+)\.\n")
#: A line that stands for a whole earlier statement (its comments left out), with
#: its parameters renumbered: ``-- include plain_claim, its $1-$5 as $3-$7``.
_INCLUDE = re.compile(r"^([ \t]*)-- include (\w+), its \$1-\$(\d+) as \$(\d+)-\$(\d+)$",
                      re.MULTILINE)
_PARAMETER = re.compile(r"\$(\d+)")


def parse(text: str) -> dict[str, str]:
    """
    Split a named-query file into {name: statement}, comments kept, ';' dropped.

    A statement whose first line is ``-- derived from BASE: it includes NEW for
    OLD.`` is BASE with its one ``-- include OLD`` line naming NEW instead (its
    own comments first): a finish-and-claim statement and its `_kinds` twin share
    every line but the claim they include.

    A line ``-- include NAME, its $1-$N as $A-$B`` stands for the earlier statement
    NAME, written in at the line's indentation without its leading comments, its
    parameters $1 to $N renumbered $A to $B: the plain finish-and-claim statement
    claims with `plain_claim`'s text.
    """
    parts = _NAME.split(text)
    # parts = [preamble, name1, body1, name2, body2, ...]
    out: dict[str, str] = {}
    written: dict[str, str] = {}  # as written, includes not yet expanded
    for name, body in zip(parts[1::2], parts[2::2], strict=True):
        if name in out:
            raise ValueError(f"queries.sql: statement {name!r} is defined twice")
        body = body.strip().rstrip(";").strip()
        derived = _DERIVED.match(body + "\n")
        if derived:
            body = _derive(name, body, *derived.groups(), written=written)
        written[name] = body
        out[name] = _INCLUDE.sub(partial(_include, name, parsed=out), body)
    return out


def _include(name: str, line: re.Match[str], *, parsed: dict[str, str]) -> str:
    indent, included = line.group(1), line.group(2)
    last, first_as, last_as = (int(line.group(i)) for i in (3, 4, 5))
    text = parsed.get(included)
    if text is None:
        raise ValueError(f"queries.sql: {name!r} includes {included!r}, "
                         "which must come before it")
    lines = text.splitlines()
    while lines and lines[0].startswith("--"):
        lines.pop(0)
    used = {int(n) for n in _PARAMETER.findall("\n".join(lines))}
    if used != set(range(1, last + 1)) or last_as - first_as != last - 1:
        raise ValueError(f"queries.sql: {name!r} includes {included!r} with its $1-${last} "
                         f"as ${first_as}-${last_as}, but it takes "
                         + ", ".join(f"${n}" for n in sorted(used)))
    shift = first_as - 1
    renumbered = _PARAMETER.sub(lambda m: f"${int(m.group(1)) + shift}", "\n".join(lines))
    return "\n".join(indent + row if row else row for row in renumbered.splitlines())


def _derive(name: str, body: str, base_name: str, new: str, old: str, *,
            written: dict[str, str]) -> str:
    base = written.get(base_name)
    if base is None:
        raise ValueError(f"queries.sql: {name!r} is derived from {base_name!r}, "
                         "which must come before it")
    includes = [m for m in _INCLUDE.finditer(base) if m.group(2) == old]
    if len(includes) != 1:
        raise ValueError(f"queries.sql: {base_name!r} has no single include of {old!r}")
    line = includes[0]
    swapped = base[:line.start(2)] + new + base[line.end(2):]
    # Its comments go first (but the line that derives it), the base's text follows.
    comments = [row for row in body.splitlines()[1:] if row.startswith("--")]
    return "\n".join(comments) + "\n" + swapped


def load() -> Queries:
    text = resources.files(__package__).joinpath("queries.sql").read_text("utf-8")
    found = parse(text)
    wanted = {f.name for f in attrs.fields(Queries)}
    if set(found) != wanted:
        raise RuntimeError(
            "queries.sql and _sql.Queries disagree: "
            f"missing {sorted(wanted - set(found))}, unexpected {sorted(set(found) - wanted)}"
        )
    # The queue's schema, where a statement names it (`nasiko_queue.db.schema`).
    return Queries(**{name: qualify(sql) for name, sql in found.items()})


#: The one loaded copy every module uses.
Q = load()
