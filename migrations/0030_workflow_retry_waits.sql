-- nasiko-queue 0030: a retry never runs a step twice at once, and it resumes
-- a run's child runs instead of starting them anew.
--
-- Before, `nasiko_queue_workflow_retry` put every unfinished step back and
-- enqueued new jobs at once. Right after a cancel (or a failure that asked
-- the run's other steps to stop), the old step's function was still running
-- until its worker's next heartbeat (longer, if it ignored cancellation):
-- the retried step ran beside it. A retry is now refused while any step job
-- of the run, or of its child runs however deep, is still running: it
-- answers 'still stopping: <steps>' and changes nothing; the caller retries
-- once they have ended (a few seconds after a cancel).
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
-- signature; the rules of running runs are unchanged.

CREATE OR REPLACE FUNCTION nasiko_queue_workflow_retry(run uuid) RETURNS text
LANGUAGE plpgsql AS $$
DECLARE
    locked text;
    busy   text;
    s      record;
    child  record;
BEGIN
    SELECT state INTO locked FROM nasiko_queue_workflow_runs WHERE id = run FOR UPDATE;
    IF NOT FOUND THEN
        RETURN NULL;
    ELSIF locked NOT IN ('failed', 'cancelled') THEN
        RETURN 'not failed: ' || locked;
    END IF;
    WITH RECURSIVE tree AS (
        SELECT run AS id
        UNION ALL
        SELECT c.id FROM nasiko_queue_workflow_runs AS c JOIN tree AS t ON c.parent_run = t.id
    )
    SELECT string_agg(DISTINCT j.payload ->> 'step', ', ' ORDER BY j.payload ->> 'step')
    INTO busy
    FROM tree AS t JOIN nasiko_queue_jobs AS j ON j.workflow_run = t.id
    WHERE j.state = 'running';
    IF busy IS NOT NULL THEN
        RETURN 'still stopping: ' || busy;
    END IF;
    UPDATE nasiko_queue_workflow_runs
    SET state = 'running', failed_step = NULL, error = NULL, finished_at = NULL
    WHERE id = run;
    UPDATE nasiko_queue_workflow_steps SET state = 'blocked', job_id = NULL, error = NULL
    WHERE run_id = run AND state <> 'completed';
    -- The child steps whose child run goes on: waited for again (the step row
    -- first, so that a child that completes at once completes it).
    FOR s IN
        SELECT step, child_run FROM nasiko_queue_workflow_steps
        WHERE run_id = run AND state = 'blocked' AND child_run IS NOT NULL
    LOOP
        SELECT state, result INTO child FROM nasiko_queue_workflow_runs
        WHERE id = s.child_run FOR UPDATE;
        IF child.state = 'completed' THEN
            UPDATE nasiko_queue_workflow_steps SET state = 'completed', result = child.result
            WHERE run_id = run AND step = s.step AND idx = 0;
        ELSE
            UPDATE nasiko_queue_workflow_steps SET state = 'waiting'
            WHERE run_id = run AND step = s.step AND idx = 0;
            IF child.state IN ('failed', 'cancelled') THEN
                PERFORM nasiko_queue_workflow_retry(s.child_run);
            END IF;
        END IF;
    END LOOP;
    PERFORM nasiko_queue_wf_advance(run);
    RETURN 'retried';
END;
$$;
