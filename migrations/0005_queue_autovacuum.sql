-- nasiko-queue 0005: vacuum the queue table by absolute churn, not by its size.
--
-- Every job is an INSERT and two or three UPDATEs (claim, finish; a reset or a
-- recovery adds more), and each UPDATE leaves a dead row version behind, plus a
-- dead entry in the partial index build_jobs_work_queue that every claim walks
-- from its head. The default trigger (vacuum once 20% of the table is dead) is
-- proportional to the history the table holds: with a million done rows,
-- autovacuum waits for 200,000 dead versions, and meanwhile claims read more and
-- more dead index entries (measured: 80 buffers per claim after ~60k claim/reset
-- cycles, against 3 after a clean-up). So trigger on a fixed count instead.

ALTER TABLE build_jobs SET (
    -- Vacuum after 1,000 dead rows whatever the table's size: the dead rows that
    -- hurt are the queue's recent churn, and their number does not grow with
    -- history. A vacuum of a table whose visibility map is mostly all-visible
    -- (the done/failed history) is cheap, so running it often costs little.
    autovacuum_vacuum_scale_factor = 0.0,
    autovacuum_vacuum_threshold = 1000,
    -- The same for inserts (PostgreSQL 13+): freeze and mark all-visible the
    -- freshly enqueued rows of an insert-heavy burst, without waiting for 20%.
    autovacuum_vacuum_insert_scale_factor = 0.0,
    autovacuum_vacuum_insert_threshold = 1000,
    -- Keep the planner's statistics current: the share of pending rows swings
    -- from none to all within minutes, and a stale estimate could steer the claim
    -- away from the partial index. Analyze is cheap (a sample).
    autovacuum_analyze_scale_factor = 0.0,
    autovacuum_analyze_threshold = 1000,
    -- No cost-based sleeping for this table: a vacuum that naps between pages
    -- lets the dead entries it is removing pile up again behind it.
    autovacuum_vacuum_cost_delay = 0,
    -- Leave 10% of each page free, so that a claim or finish can write the new
    -- row version on the same page (cheaper, and the old one is pruned on the
    -- page without a vacuum). Updates of `status` are never HOT, since the
    -- partial index covers it, but same-page updates still avoid extending the
    -- table and touching a second heap page per update.
    fillfactor = 90
);
