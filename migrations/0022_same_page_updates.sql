-- nasiko-queue 0022: room on each page for a job's later row versions (issue #25).
--
-- Every job is one INSERT and at least two UPDATEs (the claim, the end). None
-- of the updates can be HOT: each changes `state` (or `status`), which the
-- partial indexes' predicates read. But where the new version goes still
-- matters, and PostgreSQL writes it on the old version's page whenever it fits:
--
--   * On the same page, the WAL record of an update leaves out the part of the
--     row that did not change at either end (here: everything up to `state`,
--     the payload included), and the update needs no lock record of its own.
--   * On another page, the record carries the whole new row, payload and all,
--     and PostgreSQL first logs a lock of the old version while it finds room.
--
-- With pages filled to the brim by the inserts (fillfactor 100; 90 for
-- build_jobs, from 0005), most claims and ends moved to another page. Inserts
-- now stop at half a page, so the two later versions fit beside the first, and
-- the dead ones are pruned on the page as the next update reads it. Measured
-- (benchmarks/README.md, issue #25), jobs enqueued and run together at
-- concurrency 10: 1,645 -> 1,511 WAL bytes per plain job with a 10-byte payload,
-- 4,766 -> 2,572 with a 1 kB one, 2,672 -> 2,197 per build job; the heap's size
-- per job about the same (the room is taken by the later versions), or smaller
-- with big payloads (4,036 -> 2,941 B).
--
-- A storage setting only: the tables, their columns and the original's SQL on
-- build_jobs are unchanged. It applies to pages filled from now on; rows already
-- written stay where they are. ALTER TABLE ... SET (fillfactor) takes a SHARE
-- UPDATE EXCLUSIVE lock for a moment: claims, finishes and enqueues go on.

ALTER TABLE nasiko_queue_jobs SET (fillfactor = 50);
ALTER TABLE build_jobs SET (fillfactor = 50);
