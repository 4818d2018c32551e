-- nasiko-queue 0030: a retry never runs a step twice at once, and it resumes
-- a run's child runs instead of starting them anew.
--
-- Before, `nasiko_queue_workflow_retry` put every unfinished step back and
-- enqueued new jobs at once. Right after a cancel (or a failure that asked
-- the run's other steps to stop), the old step's function was still running
-- until its worker's next heartbeat (longer, if it ignored cancellation):
-- the retried step ran beside it. A retry is now refused while any step job
-- of the run, or of its ended child runs however deep, is still running: it
-- answers 'still stopping: <steps>' and changes nothing; the caller retries
-- once they have ended (a few seconds after a cancel). The steps of a child
-- run that runs (retried on its own) are not stopping: they are waited for.
--
-- A child step whose child run failed or was cancelled used to start a whole
-- new child run: the child's completed steps ran again, and a child retried
-- on its own was left running with no parent waiting for it (a later cancel
-- of the parent did not reach it). The parent's retry now retries that child
-- run (its completed steps keep their results, as the parent's do), waits
-- again for a child that is running (retried on its own), and takes the
-- result of one that completed meanwhile.
--
-- Safe on a live database: CREATE OR REPLACE of 0018's function, same
-- signature, and a new function (`nasiko_queue_wf_retry_tree`); the rules of
-- running runs are unchanged.

CREATE OR REPLACE FUNCTION nasiko_queue_workflow_retry(run uuid) RETURNS text
LANGUAGE plpgsql AS $$
DECLARE
    locked text;
    answer text;
BEGIN
    SELECT state INTO locked FROM nasiko_queue_workflow_runs WHERE id = run FOR UPDATE;
    IF NOT FOUND THEN
        RETURN NULL;
    ELSIF locked NOT IN ('failed', 'cancelled') THEN
        RETURN 'not failed: ' || locked;
    END IF;
    -- All of it or nothing: a child run's retry, below, checks its own tree
    -- again (a job claimed since may run now), and its refusal undoes this
    -- run's changes too.
    BEGIN
        answer := nasiko_queue_wf_retry_tree(run);
        IF answer <> 'retried' THEN
            RAISE EXCEPTION USING ERRCODE = 'NQR01', MESSAGE = answer;
        END IF;
    EXCEPTION WHEN SQLSTATE 'NQR01' THEN
        RETURN SQLERRM;
    END;
    RETURN 'retried';
END;
$$;

-- The retry of failed or cancelled run `run` (locked by the caller), and of
-- its ended child runs: 'retried', or 'still stopping: <steps>' (the caller
-- rolls back whatever was changed).
CREATE OR REPLACE FUNCTION nasiko_queue_wf_retry_tree(run uuid) RETURNS text
LANGUAGE plpgsql AS $$
DECLARE
    busy   text;
    s      record;
    answer text;
    cstate text;
BEGIN
    -- Step functions asked to stop that still run: this run's, and those of
    -- its ended child runs however deep (a running child's steps are not
    -- stopping: that run goes on, and is waited for).
    WITH RECURSIVE tree AS (
        SELECT id FROM nasiko_queue_workflow_runs WHERE id = run
        UNION ALL
        SELECT c.id FROM nasiko_queue_workflow_runs AS c JOIN tree AS t ON c.parent_run = t.id
        WHERE c.state <> 'running'
    )
    SELECT string_agg(DISTINCT (j.payload ->> 'step') COLLATE "C", ', '
                      ORDER BY (j.payload ->> 'step') COLLATE "C")
    INTO busy
    FROM tree AS t JOIN nasiko_queue_jobs AS j ON j.workflow_run = t.id
    WHERE j.state = 'running';
    IF busy IS NOT NULL THEN
        RETURN 'still stopping: ' || busy;
    END IF;
    UPDATE nasiko_queue_workflow_runs
    SET state = 'running', failed_step = NULL, error = NULL, finished_at = NULL
    WHERE id = run;
    -- Every unfinished step back to blocked, but a child step whose child run
    -- exists: completed with its result if that run completed, else waiting
    -- for it; in one statement, before any child is retried, so that a child
    -- that completes at once (and advances this run) finds no child step of
    -- it blocked, which would start a second child run.
    UPDATE nasiko_queue_workflow_steps AS st
    SET state = CASE WHEN c.state IS NULL THEN 'blocked'
                     WHEN c.state = 'completed' THEN 'completed'
                     ELSE 'waiting' END,
        result = CASE WHEN c.state = 'completed' THEN c.result ELSE st.result END,
        job_id = NULL, error = NULL
    FROM nasiko_queue_workflow_steps AS me
    LEFT JOIN nasiko_queue_workflow_runs AS c ON c.id = me.child_run
    WHERE st.run_id = run AND st.state <> 'completed'
      AND me.run_id = st.run_id AND me.step = st.step AND me.idx = st.idx;
    FOR s IN
        SELECT c.id FROM nasiko_queue_workflow_steps AS st
        JOIN nasiko_queue_workflow_runs AS c ON c.id = st.child_run
        WHERE st.run_id = run AND st.state = 'waiting' AND c.state IN ('failed', 'cancelled')
        ORDER BY st.step
    LOOP
        SELECT state INTO cstate FROM nasiko_queue_workflow_runs WHERE id = s.id FOR UPDATE;
        -- Retried on its own meanwhile: it runs, and is waited for.
        CONTINUE WHEN cstate NOT IN ('failed', 'cancelled');
        answer := nasiko_queue_wf_retry_tree(s.id);
        IF answer <> 'retried' THEN
            RETURN answer;
        END IF;
    END LOOP;
    PERFORM nasiko_queue_wf_advance(run);
    RETURN 'retried';
END;
$$;
