--! no-transaction
-- nasiko-queue 0016: the job listing's order, as indexes (issue #21).
--
-- The dashboard's and `nasiko-queue jobs list`'s listing (`jobs_list`, and the
-- search, `jobs_search`) pages newest first by (coalesce(end, created), id)
-- across the job tables. Without an index on that expression every first page
-- read and sorted the whole history (measured with 1,000,000 finished plain
-- jobs: 355 ms); with them each table is read in order and the first page stops
-- after its 50 rows (a Merge Append of index scans).
--
-- Built CONCURRENTLY, outside a transaction: workers keep claiming and finishing
-- while it builds. An interrupted build leaves an invalid index and this file
-- unrecorded; the next `migrate` drops it and builds it again.

DROP INDEX CONCURRENTLY IF EXISTS nasiko_queue_jobs_listing;

CREATE INDEX CONCURRENTLY nasiko_queue_jobs_listing
    ON nasiko_queue_jobs ((coalesce(finished_at, created_at)), id);

DROP INDEX CONCURRENTLY IF EXISTS build_jobs_listing;

CREATE INDEX CONCURRENTLY build_jobs_listing
    ON build_jobs ((coalesce(completed_at, created_at)), id);

DROP INDEX CONCURRENTLY IF EXISTS nasiko_queue_deleted_build_jobs_listing;

CREATE INDEX CONCURRENTLY nasiko_queue_deleted_build_jobs_listing
    ON nasiko_queue_deleted_build_jobs ((coalesce(completed_at, deleted_at)), id);
