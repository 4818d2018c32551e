-- nasiko-queue 0013: the cancel rule of plain jobs, written once (issue #20).
--
-- nasiko_queue_run_end: where a run that ends without completing leaves its
-- job. A cancel asked for while it ran wins (cancelled); else its last attempt
-- is discarded (when the caller counts it: a crash or a dead worker's claim);
-- else it is available again. Used by the crash's retry (plain_retry), the hard
-- stop's reset (plain_reset) and the rescue of a dead worker's jobs
-- (plain_rescue), each on the row version it updates (an UPDATE computes its SET
-- from the row it locked, re-read if a cancel changed it meanwhile), so a
-- cancel that committed first is always seen. IMMUTABLE SQL: the planner
-- inlines it.
--
-- nasiko_queue_cancel: the cancel, a locked read and then a decision. The
-- SELECT ... FOR UPDATE waits for any transaction that holds the row (a claim
-- making it running, a crash's retry making it available again, a run's end)
-- and returns the row as that transaction left it; the decision is taken on
-- that state, which nothing can change until the cancel commits: available ->
-- cancelled now; running -> cancel_requested, 'cancelling'; ended -> 'already
-- <state>', nothing changed. NULL only when no plain job has this id. A plpgsql
-- function, not one statement: the parts of one statement share its snapshot,
-- and the statement this replaces lost the cancel when a claim held the row (the
-- part that waited found it running, the others had seen it available). The
-- UPDATE inside runs after the lock is ours, on a snapshot of its own.
--
-- Safe on a live database: new functions only; the statements that call them
-- ship with the code that applies this migration.

CREATE OR REPLACE FUNCTION nasiko_queue_run_end(cancel_requested boolean,
                                                last_attempt boolean)
RETURNS text
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT CASE WHEN cancel_requested THEN 'cancelled'
                WHEN last_attempt THEN 'discarded'
                ELSE 'available' END
$$;

CREATE OR REPLACE FUNCTION nasiko_queue_cancel(job_id uuid) RETURNS text
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    locked text;
BEGIN
    SELECT state INTO locked FROM nasiko_queue_jobs WHERE id = job_id FOR UPDATE;
    IF NOT FOUND THEN
        RETURN NULL;
    ELSIF locked = 'available' THEN
        UPDATE nasiko_queue_jobs
        SET state = 'cancelled', finished_at = now(), error_msg = 'cancelled'
        WHERE id = job_id;
        RETURN 'cancelled';
    ELSIF locked = 'running' THEN
        UPDATE nasiko_queue_jobs SET cancel_requested = true WHERE id = job_id;
        RETURN 'cancelling';
    END IF;
    RETURN 'already ' || locked;
END;
$$;
