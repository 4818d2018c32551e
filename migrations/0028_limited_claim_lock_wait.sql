-- nasiko-queue 0028: a limited queue's claim waits for its lock 250 ms at most.
--
-- The claims of one limited queue take a transaction-level advisory lock of
-- that queue (0020), held by each claim for its short transaction. A claim
-- that found it held waited for as long as it was held, on one of the worker's
-- engine connections, which every lane of the worker shares (two by default).
-- A replica whose claim stalled while holding the lock (a slow commit, a
-- network stall) thus made the other replicas' limited lanes hold all their
-- engine connections, and their other queues' claims found none: a job of an
-- unlimited queue waited for seconds, until the blocked claims were abandoned
-- at the statement's bound (and their connections closed).
--
-- The wait is now bounded here: a claim that cannot have the lock within 250
-- ms claims nothing and gives its connection back; its lane claims again at
-- once (its queue still has due jobs), behind the other lanes' statements.
-- Claims normally hold the lock for a few milliseconds, so only a stalled
-- holder makes a claim give up. The bound is the function's, written once;
-- the caller's own lock_timeout is restored after the lock is taken.
--
-- Safe on a live database: CREATE OR REPLACE of 0026's function, same
-- signature; the three-argument form (workers of 0025 and before) keeps
-- waiting as it did.

CREATE OR REPLACE FUNCTION nasiko_queue_limited_pick(q text, asked integer, finishing uuid[],
                                                     attempts integer[])
RETURNS uuid[] LANGUAGE plpgsql AS $$
DECLARE
    ending uuid[] := '{}';
    caller_timeout text := current_setting('lock_timeout');
BEGIN
    IF asked <= 0 THEN
        RETURN '{}';
    END IF;
    BEGIN
        PERFORM set_config('lock_timeout', '250ms', true);
        PERFORM pg_advisory_xact_lock(hashtext('nasiko_queue.limits'), hashtext(q));
    EXCEPTION WHEN lock_not_available THEN
        RETURN '{}';  -- held by a stalled claim: claim nothing now (the setting rolled back)
    END;
    PERFORM set_config('lock_timeout', caller_timeout, true);
    IF coalesce(cardinality(finishing), 0) > 0 THEN
        SELECT coalesce(array_agg(j.id), '{}') INTO ending
        FROM unnest(finishing, attempts) AS f(id, attempt)
             JOIN nasiko_queue_jobs AS j ON j.id = f.id
        WHERE j.attempt = f.attempt AND j.state = 'running';
    END IF;
    RETURN nasiko_queue_limited_pick(q, asked, ending);
END;
$$;
