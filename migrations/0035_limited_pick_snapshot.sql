-- nasiko-queue 0035: a limited claim takes only jobs its own statement can see.
--
-- The claim is one statement (`plain_claim`): an UPDATE of the ids that
-- nasiko_queue_limited_pick returns. The UPDATE reads the statement's snapshot,
-- taken as the statement began; the pick reads fresh ones after the queue's
-- lock (0020: it must see the running rows the previous claim committed). A job
-- committed in between -- any job enqueued while the claim waited for the
-- lock, which the claims of one queue take in turn across replicas -- was
-- picked, locked, counted against the claim's room, and its start written to
-- the rate ledger (and its key's turn taken), but the UPDATE could not see it:
-- the claim returned without it, and the job waited for the rate window it had
-- spent (an hour, for a rate of one an hour).
--
-- The pick now takes only rows the statement that called it can see: the
-- caller passes its snapshot (`pg_current_snapshot()`, evaluated in the claim
-- statement) and a candidate's row version must be visible in it. A job
-- committed during the wait is left, unpicked and uncounted, for the next
-- claim: the enqueue's wake-up, or the lane's recheck (`plain_next_due` answers
-- LIMIT_RECHECK, 0.5 s, while a limited queue has due jobs). So is a job made
-- available again during the wait (a give-back, a rescue), which the UPDATE
-- would have found: never wrong, at most one recheck late.
--
-- A row's xmin is 32 bits; it is placed in the 64-bit xid space below the
-- fresh snapshot's xmax (`ref`): every committed row the pick reads is within
-- 2^31 transactions of it (a frozen row's raw xmin may land anywhere below, and
-- is then seen as old, hence visible, as it is). One gap, not closed here:
-- `pg_current_snapshot()` lists top-level transactions only, so a job inserted
-- in a savepoint of a transaction in flight at the statement's start may still
-- be picked and missed, as before this migration (under-used, never exceeded).
--
-- The function's body is the 3-argument one of 0020, re-created with the
-- filter, which reads the snapshot from a transaction-local setting that the
-- new 5-argument form (0028's, plus `seen`) sets around its call and clears:
-- the 0020 body stays the one claim rule (the limits machine's mutants replace
-- it), and workers of 0031 and before, which call the 4-argument form, claim
-- as they did (no setting, no filter).
--
-- Safe on a live database: CREATE OR REPLACE of a function with the same
-- signature, and new functions.

-- Whether a row whose version was written by transaction `x` is visible in
-- snapshot `seen` (NULL: no snapshot to test, visible). `ref` is a 64-bit xid
-- above every committed xid the caller reads (its own snapshot's xmax).
CREATE OR REPLACE FUNCTION nasiko_queue_seen_by(
    x xid, seen pg_snapshot, ref xid8 DEFAULT pg_snapshot_xmax(pg_current_snapshot()))
RETURNS boolean LANGUAGE sql STABLE AS $$
    SELECT seen IS NULL OR pg_visible_in_snapshot(
        (ref::text::bigint
         - ((ref::text::bigint - x::text::bigint) % 4294967296 + 4294967296) % 4294967296
        )::text::xid8,
        seen)
$$;

-- 0020's claim rule, with the filter (two candidate scans).
CREATE OR REPLACE FUNCTION nasiko_queue_limited_pick(q text, asked integer, finishing uuid[])
RETURNS uuid[] LANGUAGE plpgsql AS $$
DECLARE
    lim      nasiko_queue_limits%ROWTYPE;
    room     integer := asked;
    at       timestamptz;
    picked   uuid[] := '{}';
    used     jsonb := '{}';
    c        record;
    -- The snapshot of the claim statement that called (0035; NULL: no filter).
    seen     pg_snapshot := nullif(current_setting('nasiko_queue.claim_seen', true),
                                   '')::pg_snapshot;
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
              AND nasiko_queue_seen_by(j.xmin, seen)
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
                  AND nasiko_queue_seen_by(j.xmin, seen)
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

-- 0028's form with the caller's snapshot.
CREATE OR REPLACE FUNCTION nasiko_queue_limited_pick(q text, asked integer, finishing uuid[],
                                                     attempts integer[], seen pg_snapshot)
RETURNS uuid[] LANGUAGE plpgsql AS $$
DECLARE
    ending uuid[] := '{}';
    picked uuid[];
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
    PERFORM set_config('nasiko_queue.claim_seen', coalesce(seen::text, ''), true);
    picked := nasiko_queue_limited_pick(q, asked, ending);
    PERFORM set_config('nasiko_queue.claim_seen', '', true);
    RETURN picked;
END;
$$;
