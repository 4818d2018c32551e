-- nasiko-queue 0027: a child run ends its parent's step only while that step
-- still waits for it.
--
-- A parent's child step starts a child run and waits for it; the child's end
-- ends the step. A completed child checked that the step still waited for it
-- (0018, nasiko_queue_wf_advance); a failed or cancelled one did not. So a child
-- the parent no longer waited for (the parent was cancelled, which cancels the
-- child, then retried, which starts a new one) could end the parent anyway when
-- retried on its own and failed or cancelled again: the parent's newer attempt
-- failed (or was cancelled), and its step, completed by the new child, was
-- rewritten.
--
-- Both functions are replaced with the same check the completion makes: the
-- parent is running, and its step waits for this very child. Everything else is
-- as in 0018. Safe on a live database: CREATE OR REPLACE of two functions, the
-- same signatures, taking the same locks.

CREATE OR REPLACE FUNCTION nasiko_queue_wf_waits_for(parent uuid, pstep text, child uuid)
RETURNS boolean
LANGUAGE sql STABLE AS $$
    SELECT EXISTS (SELECT 1 FROM nasiko_queue_workflow_runs AS p
                   JOIN nasiko_queue_workflow_steps AS s
                     ON s.run_id = p.id AND s.step = pstep AND s.idx = 0
                   WHERE p.id = parent AND p.state = 'running'
                     AND s.state = 'waiting' AND s.child_run = child)
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
        PERFORM 1 FROM nasiko_queue_workflow_runs WHERE id = r.parent_run FOR UPDATE;
        IF nasiko_queue_wf_waits_for(r.parent_run, r.parent_step, run) THEN
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
    -- cancelled already: it waits no more).
    IF r.parent_run IS NOT NULL THEN
        PERFORM 1 FROM nasiko_queue_workflow_runs WHERE id = r.parent_run FOR UPDATE;
        IF nasiko_queue_wf_waits_for(r.parent_run, r.parent_step, run) THEN
            PERFORM nasiko_queue_workflow_cancel(r.parent_run);
        END IF;
    END IF;
    RETURN 'cancelled';
END;
$$;
