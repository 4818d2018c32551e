-- nasiko-queue 0020: limits that hold across replicas (issue #23).
--
-- A row of nasiko_queue_limits makes its queue of plain jobs LIMITED, for every
-- worker at once, changed by an operator without a deploy:
--   concurrency     at most this many of the queue's jobs running (claimed and
--                   not ended), across every worker; NULL: no such limit
--   rate_limit      at most this many starts (claims) per rate_period, across
--                   every worker; per partition key when partition_by is set
--   partition_by    the job arg (a top-level field of the payload) whose value
--                   is a job's partition key; NULL: one partition
--   partition_mode  'none'; 'round_robin': a claim takes one job per key in
--                   turn (priority orders within a key), so a key's backlog
--                   delays another key's first job by one claim round at most;
--                   'serial': also at most one running job per key
--
-- The claim of a limited queue is nasiko_queue_limited_pick: it takes an
-- advisory lock of the queue for its transaction, so the claims of that one
-- queue run one after the other across replicas, and each reads, in a fresh
-- snapshot taken after the lock, every running row the previous claim
-- committed (READ COMMITTED alone would not see a concurrent claim's rows).
-- The running count is derived from the rows themselves (state 'running'):
-- rescue, cancel, retry, reset, unclaim and the dead-letter path need no
-- counter, and none can leak. Rate windows count the starts ledger below,
-- written by the claim under the same lock with the server's clock; a start
-- stays counted even if its run is given back (conservative: never exceeded).
-- Unlimited queues keep their claim; it costs them one primary-key probe of
-- nasiko_queue_limits, as the paused-queues probe (0012).
--
-- Safe on a live database: new tables and functions only.

CREATE TABLE IF NOT EXISTS nasiko_queue_limits (
    queue          text PRIMARY KEY CHECK (queue <> '' AND length(queue) <= 128
                                           AND queue <> 'builds'),
    concurrency    integer CHECK (concurrency >= 1),
    rate_limit     integer CHECK (rate_limit >= 1),
    rate_period    interval CHECK (rate_period > interval '0'),
    partition_by   text CHECK (partition_by <> ''),
    partition_mode text NOT NULL DEFAULT 'none'
                   CHECK (partition_mode IN ('none', 'round_robin', 'serial')),
    updated_at     timestamptz NOT NULL DEFAULT now(),
    CHECK ((rate_limit IS NULL) = (rate_period IS NULL)),
    CHECK (partition_mode = 'none' OR partition_by IS NOT NULL)
);

-- The starts of rate-limited queues within their current window (older ones
-- are deleted by the next claim of the queue).
CREATE TABLE IF NOT EXISTS nasiko_queue_limit_starts (
    queue      text NOT NULL,
    pkey       text NOT NULL,
    started_at timestamptz NOT NULL
);
CREATE INDEX IF NOT EXISTS nasiko_queue_limit_starts_window
    ON nasiko_queue_limit_starts (queue, started_at);

-- When each key of a partitioned queue last had a job claimed: a round-robin
-- claim serves the keys served longest ago (never: first) before the others,
-- so turns carry over from one claim to the next even when each claim takes
-- one job. Rows of keys not served for an hour are trimmed by the claims.
CREATE TABLE IF NOT EXISTS nasiko_queue_limit_turns (
    queue     text NOT NULL,
    pkey      text NOT NULL,
    served_at timestamptz NOT NULL,
    PRIMARY KEY (queue, pkey)
);

-- The running jobs of one queue (the concurrency count reads only those).
CREATE INDEX IF NOT EXISTS nasiko_queue_jobs_running_queue
    ON nasiko_queue_jobs (queue) WHERE state = 'running';

-- The ids a claim of limited queue q may take (at most `asked`), locked FOR
-- UPDATE by this transaction; the caller marks them running in the same
-- statement. `finishing`: running jobs the same statement completes (they do
-- not count as running).
CREATE OR REPLACE FUNCTION nasiko_queue_limited_pick(q text, asked integer, finishing uuid[])
RETURNS uuid[] LANGUAGE plpgsql AS $$
DECLARE
    lim      nasiko_queue_limits%ROWTYPE;
    room     integer := asked;
    at       timestamptz;
    picked   uuid[] := '{}';
    used     jsonb := '{}';
    c        record;
BEGIN
    IF asked <= 0 OR EXISTS (SELECT 1 FROM nasiko_queue_paused_queues WHERE queue = q) THEN
        RETURN picked;
    END IF;
    PERFORM pg_advisory_xact_lock(hashtext('nasiko_queue.limits'), hashtext(q));
    -- Read after the lock: every statement below sees what the previous claim committed.
    SELECT * INTO lim FROM nasiko_queue_limits AS l WHERE l.queue = q;
    IF NOT FOUND THEN
        RETURN picked;  -- cleared meanwhile: the next claim takes the plain path
    END IF;
    at := clock_timestamp();
    IF lim.concurrency IS NOT NULL THEN
        room := least(room, lim.concurrency - (
            SELECT count(*) FROM nasiko_queue_jobs AS j
            WHERE j.queue = q AND j.state = 'running'
              AND j.id <> ALL (coalesce(finishing, '{}'))))::integer;
    END IF;
    IF lim.rate_limit IS NOT NULL THEN
        DELETE FROM nasiko_queue_limit_starts AS s
        WHERE s.queue = q AND s.started_at <= at - lim.rate_period;
        IF lim.partition_by IS NULL THEN
            room := least(room, lim.rate_limit - (
                SELECT count(*) FROM nasiko_queue_limit_starts AS s WHERE s.queue = q))::integer;
        END IF;
    END IF;
    IF room <= 0 THEN
        RETURN picked;
    END IF;

    IF lim.partition_by IS NULL THEN
        SELECT coalesce(array_agg(d.id), '{}') INTO picked FROM (
            SELECT j.id FROM nasiko_queue_jobs AS j
            WHERE j.state = 'available' AND j.queue = q AND j.run_at <= at
            ORDER BY j.priority, j.run_at, j.id
            LIMIT room
            FOR UPDATE SKIP LOCKED) AS d;
    ELSE
        -- Every due job's key and its rank within its key; a key's allowance:
        -- its rate budget left (rate limits are per key), 1 in 'serial' mode
        -- unless a job of the key runs already (then 0).
        FOR c IN
            WITH due AS (
                SELECT j.id, coalesce(j.payload ->> lim.partition_by, '') AS pkey,
                       row_number() OVER (PARTITION BY coalesce(j.payload ->> lim.partition_by, '')
                                          ORDER BY j.priority, j.run_at, j.id) AS rank,
                       j.priority, j.run_at
                FROM nasiko_queue_jobs AS j
                WHERE j.state = 'available' AND j.queue = q AND j.run_at <= at
            ), allowance AS (
                SELECT k.pkey,
                       least(CASE WHEN lim.rate_limit IS NULL THEN asked
                                  ELSE lim.rate_limit - (SELECT count(*)
                                                        FROM nasiko_queue_limit_starts AS s
                                                        WHERE s.queue = q AND s.pkey = k.pkey)
                             END,
                             CASE WHEN lim.partition_mode <> 'serial' THEN asked
                                  WHEN EXISTS (SELECT 1 FROM nasiko_queue_jobs AS r
                                               WHERE r.queue = q AND r.state = 'running'
                                                 AND coalesce(r.payload ->> lim.partition_by, '')
                                                     = k.pkey
                                                 AND r.id <> ALL (coalesce(finishing, '{}')))
                                  THEN 0 ELSE 1 END) AS n
                FROM (SELECT DISTINCT due.pkey FROM due) AS k
            )
            SELECT due.id, due.pkey, a.n
            FROM due JOIN allowance AS a ON a.pkey = due.pkey
                 LEFT JOIN nasiko_queue_limit_turns AS t ON t.queue = q AND t.pkey = due.pkey
            WHERE due.rank <= a.n
            ORDER BY CASE WHEN lim.partition_mode = 'none' THEN 0 ELSE due.rank END,
                     CASE WHEN lim.partition_mode = 'none' THEN NULL ELSE t.served_at END
                         NULLS FIRST,
                     due.priority, due.run_at, due.id
        LOOP
            -- A job a cancel holds this instant is skipped; the key's turn goes on.
            IF coalesce((used ->> c.pkey)::integer, 0) < c.n AND EXISTS (
                SELECT 1 FROM nasiko_queue_jobs AS j
                WHERE j.id = c.id AND j.state = 'available'
                FOR UPDATE SKIP LOCKED)
            THEN
                picked := picked || c.id;
                used := jsonb_set(used, ARRAY[c.pkey],
                                  to_jsonb(coalesce((used ->> c.pkey)::integer, 0) + 1));
                EXIT WHEN cardinality(picked) >= room;
            END IF;
        END LOOP;
    END IF;

    IF lim.partition_mode <> 'none' AND cardinality(picked) > 0 THEN
        DELETE FROM nasiko_queue_limit_turns AS t
        WHERE t.queue = q AND t.served_at < at - interval '1 hour';
        INSERT INTO nasiko_queue_limit_turns AS t (queue, pkey, served_at)
        SELECT DISTINCT q, k.pkey, at FROM jsonb_object_keys(used) AS k(pkey)
        ON CONFLICT (queue, pkey) DO UPDATE SET served_at = EXCLUDED.served_at;
    END IF;
    IF lim.rate_limit IS NOT NULL AND cardinality(picked) > 0 THEN
        INSERT INTO nasiko_queue_limit_starts (queue, pkey, started_at)
        SELECT q, CASE WHEN lim.partition_by IS NULL THEN ''
                       ELSE coalesce(j.payload ->> lim.partition_by, '') END, at
        FROM nasiko_queue_jobs AS j WHERE j.id = ANY (picked);
    END IF;
    RETURN picked;
END;
$$;

-- Seconds until a claim of limited queue q that took nothing because of its
-- limits could take a job (NULL: not limited, or nothing waits): the end of
-- the oldest start's window when the rate is spent; `recheck` seconds when
-- the concurrency limit is full (a slot is freed by a run's end in whichever
-- worker; that worker's own finish claims again at once).
CREATE OR REPLACE FUNCTION nasiko_queue_limit_wait(q text, recheck double precision)
RETURNS double precision LANGUAGE plpgsql AS $$
DECLARE
    lim  nasiko_queue_limits%ROWTYPE;
    at   timestamptz := clock_timestamp();
    wait double precision;
BEGIN
    SELECT * INTO lim FROM nasiko_queue_limits AS l WHERE l.queue = q;
    IF NOT FOUND OR NOT EXISTS (SELECT 1 FROM nasiko_queue_jobs AS j
                                WHERE j.state = 'available' AND j.queue = q
                                  AND j.run_at <= at) THEN
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
