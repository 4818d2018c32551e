--! no-transaction
-- nasiko-queue 0007: find finished jobs by completion time, for retention.
--
-- `prune` (and `QueueConfig.retention`) deletes done/failed jobs completed before
-- a cut-off, a batch at a time; without an index each batch scanned the whole
-- history. This partial index holds only finished rows, in completion order.
--
-- Built CONCURRENTLY, outside a transaction (the migrator's `--! no-transaction`):
-- workers keep claiming and finishing jobs while it builds, however long the
-- history. Should the build fail half-way, PostgreSQL leaves an invalid index
-- behind and this file is not recorded; the next `migrate` drops it and builds
-- it again.

DROP INDEX CONCURRENTLY IF EXISTS build_jobs_finished_completed_at;

CREATE INDEX CONCURRENTLY build_jobs_finished_completed_at
    ON build_jobs (completed_at)
    WHERE status IN ('done', 'failed');
