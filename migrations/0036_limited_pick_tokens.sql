-- nasiko-queue 0036: a limited claim frees a finishing job's slot by its claim
-- token, re-checked under the queue's lock (issue #45).
--
-- 0035's form re-checked the finishing jobs by (id, attempt) once it held the
-- queue's lock. Since an operator's retry starts a job's attempts from 0 again,
-- a new claim of the job can count the same attempt as a stale one: a stale
-- finish read before the rescue, the retry and the new claim could free the
-- live run's slot, and the queue run one over its concurrency. The claim token
-- (set anew by every claim, cleared by every give-back) names the claim
-- itself. This form takes the finishing jobs' tokens instead of their
-- attempts; the claim statement calls it (0035's form stays for workers of
-- that release).

CREATE OR REPLACE FUNCTION nasiko_queue_limited_pick(q text, asked integer, finishing uuid[],
                                                     tokens uuid[], seen pg_snapshot)
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
        -- Those still running the claim that is finishing: a job given back and
        -- claimed again meanwhile holds another token.
        SELECT coalesce(array_agg(j.id), '{}') INTO ending
        FROM unnest(finishing, tokens) AS f(id, token)
             JOIN nasiko_queue_jobs AS j ON j.id = f.id
        WHERE j.claim_token = f.token AND j.state = 'running';
    END IF;
    PERFORM set_config('nasiko_queue.claim_seen', coalesce(seen::text, ''), true);
    picked := nasiko_queue_limited_pick(q, asked, ending);
    PERFORM set_config('nasiko_queue.claim_seen', '', true);
    RETURN picked;
END;
$$;
