--! no-transaction
-- nasiko-queue 0024: drop nasiko_queue_jobs_due (issue #25); 0023 says why, and
-- what reads the claim's index instead.
--
-- Dropped CONCURRENTLY, outside a transaction: workers keep enqueueing, claiming
-- and finishing meanwhile. Run again after an interruption, it does nothing.

DROP INDEX CONCURRENTLY IF EXISTS nasiko_queue_jobs_due;
