--! no-transaction
-- nasiko-queue 0035: a run's view is read a page at a time (issue #45).
--
-- A run's view (the dashboard's /runs/<id>, `nasiko-queue run`) sent every
-- step job the run ever had, with every kept error: a 20,000-item fan-out with
-- two errors per item was 20,001 rows and 40,000 error lines (10.9 MB, about
-- 4 s) for one GET. It now reads one page of the run's jobs, oldest first and a
-- fan-out's in item order, by (created_at, item, id). 0021's index on
-- (workflow_run) alone made each page read and sort every job of the run; this
-- one, on the page's order, stops after a page. It replaces 0021's: its
-- leading column serves every lookup of a run's jobs that one did (a run's
-- cancel, its stuck check), and step jobs keep paying for one index, not two.
-- The item is the payload's `idx` (0 for a step that is not mapped), written
-- exactly as the statement `workflow_run_jobs_page` reads it.
--
-- Built CONCURRENTLY, outside a transaction: workers keep claiming and finishing
-- while it builds. An interrupted build leaves an invalid index and this file
-- unrecorded; the next `migrate` drops it and builds it again.

DROP INDEX CONCURRENTLY IF EXISTS nasiko_queue_jobs_workflow_run_page;

CREATE INDEX CONCURRENTLY nasiko_queue_jobs_workflow_run_page
    ON nasiko_queue_jobs (workflow_run, created_at,
                          (coalesce((payload ->> 'idx')::integer, 0)), id)
    WHERE workflow_run IS NOT NULL;

DROP INDEX CONCURRENTLY IF EXISTS nasiko_queue_jobs_workflow_run;
