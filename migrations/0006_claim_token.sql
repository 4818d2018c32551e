-- nasiko-queue 0006: every claim marks its rows with a token of its own.
--
-- A claim whose answer never reaches the worker (a slow network, a loaded
-- server, a connection that breaks after the server committed) used to leave its
-- jobs `in_progress` with an attempt counted and nobody running them, until the
-- 60-minute sweep. With the token the worker finds exactly the rows that claim
-- took and gives them back (attempt restored), once the server process that
-- received it has ended.
--
-- Safe on a live table: a nullable column with no default is a catalog change
-- only (no rewrite, no scan); the lock it takes is held for milliseconds. No
-- index: the lookup reads the in-progress rows through build_jobs_work_queue.
-- The original worker's SQL names its columns and never reads or writes this one.

ALTER TABLE build_jobs ADD COLUMN IF NOT EXISTS claim_token uuid;
