-- nasiko-queue 0023: "is a job of this limited queue due?" read priority by
-- priority from nasiko_queue_jobs_claim (issue #25), ahead of 0024, which drops
-- nasiko_queue_jobs_due.
--
-- nasiko_queue_jobs_due, (queue, run_at) of the available jobs, answered two
-- questions: when a queue's next scheduled job is due, and whether one is due
-- now. Every enqueue paid an entry in it: 72 WAL bytes of about 1,500 a job, and
-- about a tenth of an enqueue's time (5,000 jobs in one batch: 51 against 57 ms;
-- 300 enqueues one by one: 152 against 172 ms). The claim's index, (queue,
-- priority, run_at, id) of the same rows, answers both as the claim reads it: the
-- priorities present, by a loose scan (one probe each), and for each the
-- earliest run_at in the range asked, one more probe. A queue holds a handful
-- of priorities; its backlog, due or scheduled, is never walked through.
--
-- Only this function's check changes (the rest is 0020's): the queries of the
-- engine and of the dashboard read the claim's index the same way
-- (`plain_next_due`, `jobs_scheduled`).

CREATE OR REPLACE FUNCTION nasiko_queue_limit_wait(q text, recheck double precision)
RETURNS double precision LANGUAGE plpgsql AS $$
DECLARE
    lim  nasiko_queue_limits%ROWTYPE;
    at   timestamptz := clock_timestamp();
    wait double precision;
BEGIN
    SELECT * INTO lim FROM nasiko_queue_limits AS l WHERE l.queue = q;
    IF NOT FOUND OR NOT EXISTS (
        WITH RECURSIVE priorities AS (
            (SELECT j.priority FROM nasiko_queue_jobs AS j
             WHERE j.state = 'available' AND j.queue = q
             ORDER BY j.priority LIMIT 1)
            UNION ALL
            SELECT (SELECT n.priority FROM nasiko_queue_jobs AS n
                    WHERE n.state = 'available' AND n.queue = q AND n.priority > p.priority
                    ORDER BY n.priority LIMIT 1)
            FROM priorities AS p WHERE p.priority IS NOT NULL
        )
        SELECT 1 FROM priorities AS p
        WHERE p.priority IS NOT NULL
          AND EXISTS (SELECT 1 FROM nasiko_queue_jobs AS j
                      WHERE j.state = 'available' AND j.queue = q
                        AND j.priority = p.priority AND j.run_at <= at)) THEN
        RETURN NULL;
    END IF;
    IF lim.concurrency IS NOT NULL AND (SELECT count(*) FROM nasiko_queue_jobs AS j
                                        WHERE j.queue = q AND j.state = 'running')
                                       >= lim.concurrency THEN
        wait := recheck;
    END IF;
    IF lim.rate_limit IS NOT NULL THEN
        wait := least(wait, (SELECT extract(epoch FROM min(s.started_at) + lim.rate_period - at)
                             FROM nasiko_queue_limit_starts AS s
                             WHERE s.queue = q AND s.started_at > at - lim.rate_period));
    END IF;
    RETURN greatest(coalesce(wait, recheck), 0.0);
END;
$$;
