-- nasiko-queue 0037: a run's end stops its steps a piece at a time (issue #45).
--
-- A run that fails (a step out of attempts) or is cancelled stops every step it
-- has not finished: each step row and its job. 0033 made a fan-out go out in
-- pieces, but the stop of a run with 100,000 items still ran whole, inside the
-- statement that ended the failing step (a worker's finish, on a connection
-- the lanes need), where `cleanup_timeout` cut it and rolled it back on every
-- try: the same shape as the fan-out itself before 0033. A run's end now marks
-- the run ended and stops up to `nasiko_queue_wf_piece()` of its steps at once
-- (100 in a finish; the transition service's piece, 1,000, in its own
-- transaction), and leaves the rest due: the service stops a piece per
-- transaction until none is left. Nothing runs meanwhile: a job of a step not
-- yet stopped that a worker claims finds its run ended (its executor reads the
-- run's state after any end in flight) and ends `cancelled` without running.
--
-- A child run's failure or cancel ended its parent's waiting step with the
-- parent's row taken FOR UPDATE: inside a worker's finish (the child's step
-- discarded), that waited for whoever held the parent (the transition service
-- applying a piece of the parent's fan-out, an application's transaction that
-- cancels the parent and then locks the child: a deadlock). As a child's
-- completion does since 0033, it now takes the parent's row only if it is
-- free, and otherwise leaves the parent due: the service fails or cancels the
-- parent's step that waits for a failed or cancelled child.
--
-- Safe on a live database: CREATE OR REPLACE of 0034's, 0033's and 0027's
-- functions, same signatures.

CREATE OR REPLACE FUNCTION nasiko_queue_wf_stop_steps(run uuid) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    s record;
BEGIN
    -- Before any job is skipped: an executor whose claim commits after the
    -- skip below finds this end in flight and waits for it (0034).
    PERFORM pg_advisory_xact_lock(hashtext('nasiko_queue.run_end'), hashtext(run::text));
    FOR s IN
        UPDATE nasiko_queue_workflow_steps AS st SET state = 'cancelled'
        WHERE (st.run_id, st.step, st.idx) IN (
            SELECT p.run_id, p.step, p.idx FROM nasiko_queue_workflow_steps AS p
            WHERE p.run_id = run AND p.state IN ('blocked', 'enqueued', 'waiting')
            LIMIT nasiko_queue_wf_piece())
        RETURNING st.job_id, st.child_run
    LOOP
        IF s.job_id IS NOT NULL THEN
            -- Held by another transaction (a claim, an end, a cancel of the job):
            -- not waited for. Whatever it leaves is decided after it commits: an
            -- end finds the run ended and changes nothing, a job running or
            -- available again meets the executor's wait (0034).
            PERFORM 1 FROM nasiko_queue_jobs WHERE id = s.job_id FOR UPDATE SKIP LOCKED;
            IF FOUND THEN
                PERFORM nasiko_queue_cancel(s.job_id);
            END IF;
        END IF;
        IF s.child_run IS NOT NULL THEN
            PERFORM nasiko_queue_workflow_cancel(s.child_run);
        END IF;
    END LOOP;
    IF EXISTS (SELECT 1 FROM nasiko_queue_workflow_steps
               WHERE run_id = run AND state IN ('blocked', 'enqueued', 'waiting')) THEN
        PERFORM nasiko_queue_wf_defer(run, NULL);  -- the rest: the service's
    END IF;
END;
$$;

CREATE OR REPLACE FUNCTION nasiko_queue_wf_apply_due(piece integer) RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
    cand uuid;
    chosen uuid;
    rstate text;
    taken integer := 0;
    got boolean;
    d record;
    j record;
    r record;
    h record;
    c record;
BEGIN
    PERFORM set_config('nasiko_queue.wf_piece', greatest(piece, 1)::text, true);
    FOR cand IN
        SELECT run_id FROM nasiko_queue_workflow_due GROUP BY run_id ORDER BY min(id) LIMIT 32
    LOOP
        SELECT state INTO rstate FROM nasiko_queue_workflow_runs WHERE id = cand
        FOR UPDATE SKIP LOCKED;
        IF FOUND THEN
            chosen := cand;
            EXIT;
        ELSIF NOT EXISTS (SELECT 1 FROM nasiko_queue_workflow_runs WHERE id = cand) THEN
            DELETE FROM nasiko_queue_workflow_due WHERE run_id = cand;
            GET DIAGNOSTICS taken = ROW_COUNT;
            RETURN taken;
        END IF;
    END LOOP;
    IF chosen IS NULL THEN
        -- Every due run's row is held: by the finishes of its steps, mostly
        -- (a fan-out's items end side by side, each taking its transition at
        -- once when the row is free). Skipped, the service would wait for its
        -- next poll while they keep it busy; it waits for the oldest instead,
        -- on its own connection (no lane needs it), for a while at most.
        cand := (SELECT run_id FROM nasiko_queue_workflow_due ORDER BY id LIMIT 1);
        IF cand IS NULL THEN
            RETURN 0;
        END IF;
        BEGIN
            PERFORM set_config('lock_timeout', '2s', true);
            SELECT state INTO rstate FROM nasiko_queue_workflow_runs WHERE id = cand
            FOR UPDATE;
            got := FOUND;
            PERFORM set_config('lock_timeout', '0', true);
        EXCEPTION WHEN lock_not_available THEN
            RETURN 0;
        END;
        IF NOT got THEN
            DELETE FROM nasiko_queue_workflow_due WHERE run_id = cand;
            GET DIAGNOSTICS taken = ROW_COUNT;
            RETURN taken;
        END IF;
        chosen := cand;
    END IF;
    IF rstate <> 'running' THEN
        -- An ended run takes no transition (0018's rule); what was due goes,
        -- and the next piece of its steps still to stop is stopped (0037: a
        -- run's end stops a piece at once and leaves the rest due).
        DELETE FROM nasiko_queue_workflow_due WHERE run_id = chosen;
        GET DIAGNOSTICS taken = ROW_COUNT;
        PERFORM nasiko_queue_wf_stop_steps(chosen);
        RETURN taken;
    END IF;
    -- In the order they were recorded (a DELETE ... RETURNING returns its rows
    -- in no promised order: a run's failure applied before the completion that
    -- came first would cancel that step instead of completing it).
    FOR d IN
        SELECT id, job_id FROM nasiko_queue_workflow_due WHERE run_id = chosen
        ORDER BY id LIMIT piece
    LOOP
        DELETE FROM nasiko_queue_workflow_due WHERE id = d.id;
        taken := taken + 1;
        CONTINUE WHEN d.job_id IS NULL;
        SELECT state INTO rstate FROM nasiko_queue_workflow_runs WHERE id = chosen;
        CONTINUE WHEN rstate <> 'running';
        SELECT state, payload ->> 'step' AS step, (payload ->> 'idx')::integer AS idx,
               result, error_msg
        INTO j FROM nasiko_queue_jobs WHERE id = d.job_id AND workflow_run = chosen;
        CONTINUE WHEN NOT FOUND OR j.state NOT IN ('completed', 'discarded', 'cancelled');
        PERFORM nasiko_queue_wf_job_ended(chosen, d.job_id, j.step, j.idx, j.state, j.result,
                                          j.error_msg);
    END LOOP;
    SELECT * INTO r FROM nasiko_queue_workflow_runs WHERE id = chosen;
    IF r.state <> 'running' THEN
        RETURN taken;
    END IF;
    -- Fan-outs under way (one piece each) and joins due.
    FOR h IN
        SELECT s.step FROM nasiko_queue_workflow_steps AS s
        WHERE s.run_id = chosen AND s.idx = -1 AND s.state = 'enqueued'
          AND s.items IS NOT NULL
          AND (s.enqueued_to < s.items OR s.done_items >= s.items)
        ORDER BY s.step
    LOOP
        IF nasiko_queue_wf_fan_out(chosen, r.definition,
                                   nasiko_queue_wf_step_def(r.definition, h.step)) THEN
            PERFORM nasiko_queue_wf_advance(chosen);
        END IF;
        SELECT * INTO r FROM nasiko_queue_workflow_runs WHERE id = chosen;
        IF r.state <> 'running' THEN
            RETURN taken;
        END IF;
    END LOOP;
    -- Child runs that ended while this run's row was held: a completed one
    -- completes its step; a failed one fails it (and so the run), a cancelled
    -- one cancels the run, as they do when the row is free (0037).
    FOR c IN
        SELECT s.step, k.id, k.state, k.result, k.failed_step, k.error
        FROM nasiko_queue_workflow_steps AS s
        JOIN nasiko_queue_workflow_runs AS k ON k.id = s.child_run
        WHERE s.run_id = chosen AND s.idx = 0 AND s.state = 'waiting'
          AND k.state IN ('completed', 'failed', 'cancelled')
        ORDER BY s.step
    LOOP
        CONTINUE WHEN NOT nasiko_queue_wf_waits_for(chosen, c.step, c.id);
        IF c.state = 'completed' THEN
            PERFORM nasiko_queue_wf_complete(chosen, c.step, 0, c.result);
        ELSIF c.state = 'failed' THEN
            PERFORM nasiko_queue_wf_fail(chosen, c.step, 0,
                                         'child run ' || c.id || ' failed at step '
                                         || coalesce(c.failed_step, '?') || ': '
                                         || coalesce(c.error, ''));
        ELSE
            PERFORM nasiko_queue_workflow_cancel(chosen);
        END IF;
        SELECT * INTO r FROM nasiko_queue_workflow_runs WHERE id = chosen;
        EXIT WHEN r.state <> 'running';
    END LOOP;
    RETURN taken;
END;
$$;

CREATE OR REPLACE FUNCTION nasiko_queue_wf_fail(run uuid, sname text, i integer, err text)
RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    r record;
BEGIN
    UPDATE nasiko_queue_workflow_steps SET state = 'failed', error = err
    WHERE run_id = run AND step = sname AND idx = i;
    -- A mapped item fails its step's head with it.
    UPDATE nasiko_queue_workflow_steps SET state = 'failed', error = err
    WHERE run_id = run AND step = sname AND idx = -1 AND i >= 0;
    UPDATE nasiko_queue_workflow_runs
    SET state = 'failed', failed_step = sname, error = err, finished_at = now()
    WHERE id = run AND state = 'running'
    RETURNING parent_run, parent_step INTO r;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    PERFORM nasiko_queue_wf_stop_steps(run);
    IF r.parent_run IS NOT NULL THEN
        -- The parent's row only if free (a row this transaction holds is free
        -- to it); held, the parent is left due and the service fails its step.
        PERFORM 1 FROM nasiko_queue_workflow_runs WHERE id = r.parent_run
        FOR UPDATE SKIP LOCKED;
        IF NOT FOUND THEN
            PERFORM nasiko_queue_wf_defer(r.parent_run, NULL);
        ELSIF nasiko_queue_wf_waits_for(r.parent_run, r.parent_step, run) THEN
            PERFORM nasiko_queue_wf_fail(r.parent_run, r.parent_step, 0,
                                         'child run ' || run || ' failed at step ' || sname
                                         || ': ' || coalesce(err, ''));
        END IF;
    END IF;
END;
$$;

CREATE OR REPLACE FUNCTION nasiko_queue_workflow_cancel(run uuid) RETURNS text
LANGUAGE plpgsql AS $$
DECLARE
    locked text;
    r record;
BEGIN
    SELECT state INTO locked FROM nasiko_queue_workflow_runs WHERE id = run FOR UPDATE;
    IF NOT FOUND THEN
        RETURN NULL;
    ELSIF locked <> 'running' THEN
        RETURN 'already ' || locked;
    END IF;
    UPDATE nasiko_queue_workflow_runs SET state = 'cancelled', finished_at = now(),
                                          error = 'cancelled'
    WHERE id = run RETURNING parent_run, parent_step INTO r;
    PERFORM nasiko_queue_wf_stop_steps(run);
    -- A child cancelled on its own cancels its parent's run, if that still
    -- waits for it (a parent that cancels its steps has marked this one
    -- cancelled already: it waits no more). The parent's row only if free, as
    -- in nasiko_queue_wf_fail; held, the service cancels it.
    IF r.parent_run IS NOT NULL THEN
        PERFORM 1 FROM nasiko_queue_workflow_runs WHERE id = r.parent_run
        FOR UPDATE SKIP LOCKED;
        IF NOT FOUND THEN
            PERFORM nasiko_queue_wf_defer(r.parent_run, NULL);
        ELSIF nasiko_queue_wf_waits_for(r.parent_run, r.parent_step, run) THEN
            PERFORM nasiko_queue_workflow_cancel(r.parent_run);
        END IF;
    END IF;
    RETURN 'cancelled';
END;
$$;
