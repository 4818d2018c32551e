-- nasiko-queue 0026: a limited queue's claim frees a slot only for a finish
-- that is still its run's.
--
-- A finish-and-claim statement completes its finishing jobs and claims in one
-- round trip; a limited queue's claim (nasiko_queue_limited_pick, 0020) is told
-- which running jobs the statement ends, since the statement's own updates are
-- not visible to it, and counts them as ended. It was told every finishing id.
-- A finish that came late (its worker was declared dead, the rescue made the
-- job available, another worker claimed it again) is refused by the finish's
-- attempt guard, yet its job was still counted as ended: a second job ran
-- under concurrency 1, or a second of one key in a serial partition, until
-- the fence gave it back.
--
-- This form also takes each finishing job's attempt and, once it holds the
-- queue's claim lock, keeps only the finishing jobs whose rows are still
-- running that attempt (its own snapshot, taken after the lock: any claim of
-- the queue that came first has committed), then picks as the three-argument
-- form does. Taking the same transaction-level advisory lock twice is allowed,
-- and the inner pick's statements see at least what this one saw.
--
-- Safe on a live database: a new function; the three-argument form stays for
-- workers of the previous version until they are replaced.

CREATE OR REPLACE FUNCTION nasiko_queue_limited_pick(q text, asked integer, finishing uuid[],
                                                     attempts integer[])
RETURNS uuid[] LANGUAGE plpgsql AS $$
DECLARE
    ending uuid[] := '{}';
BEGIN
    IF asked > 0 AND coalesce(cardinality(finishing), 0) > 0 THEN
        PERFORM pg_advisory_xact_lock(hashtext('nasiko_queue.limits'), hashtext(q));
        SELECT coalesce(array_agg(j.id), '{}') INTO ending
        FROM unnest(finishing, attempts) AS f(id, attempt)
             JOIN nasiko_queue_jobs AS j ON j.id = f.id
        WHERE j.attempt = f.attempt AND j.state = 'running';
    END IF;
    RETURN nasiko_queue_limited_pick(q, asked, ending);
END;
$$;
