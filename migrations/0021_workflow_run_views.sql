--! no-transaction
-- nasiko-queue 0021: what the run views read (issue #22, "see and steer runs").
--
-- The runs listing (`workflow_runs_list`: the dashboard's Runs page and
-- `nasiko-queue runs list`) pages newest first by (created_at, id); without an
-- index on that order every first page read and sorted every run ever started.
-- A run's view reads its step jobs (every job of every retry of its steps) by
-- `nasiko_queue_jobs.workflow_run`, which migration 0018 added without an index:
-- each view would have read the whole jobs table. The index is partial (step
-- jobs only), so plain jobs' writes do not maintain it.
--
-- Built CONCURRENTLY, outside a transaction: workers keep claiming and finishing
-- while they build. An interrupted build leaves an invalid index and this file
-- unrecorded; the next `migrate` drops it and builds it again.

DROP INDEX CONCURRENTLY IF EXISTS nasiko_queue_workflow_runs_started;

CREATE INDEX CONCURRENTLY nasiko_queue_workflow_runs_started
    ON nasiko_queue_workflow_runs (created_at, id);

DROP INDEX CONCURRENTLY IF EXISTS nasiko_queue_jobs_workflow_run;

CREATE INDEX CONCURRENTLY nasiko_queue_jobs_workflow_run
    ON nasiko_queue_jobs (workflow_run) WHERE workflow_run IS NOT NULL;
