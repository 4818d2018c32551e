-- nasiko-queue 0018: durable workflows (issue #22, part 2).
--
-- A workflow run is a row with its definition (written by Python at start, as
-- JSON, so that no rule below needs Python), its input, its state and result;
-- each step is a row (a mapped step: a head row at idx -1 and one row per
-- item, idx 0..n-1; any other step: one row at idx 0). A step of kind 'job'
-- runs as a plain job whose row carries `workflow_run`; a 'signal' step waits
-- for a named signal; a 'child' step waits for a child run.
--
-- THE transition is the trigger nasiko_queue_workflow_step_ended, AFTER UPDATE
-- OF state on nasiko_queue_jobs, for step jobs whose state changed: it runs in
-- the transaction of whichever path ended the job (the completer's batched
-- finish, a retry that discards, the rescue, a cancel, an operator's discard),
-- so a step's result and the steps it unblocks commit together or not at all,
-- and no poller is needed. Every transition of a run first locks the run's row
-- (FOR UPDATE): two steps of one run ending at once (the items of a fan-out)
-- take turns, and the second sees the first's rows (each statement of a
-- plpgsql function takes a fresh snapshot under READ COMMITTED).
--
-- Safe on a live database: new tables, a nullable column without a default on
-- nasiko_queue_jobs (a catalogue change only), functions and a trigger.

CREATE TABLE IF NOT EXISTS nasiko_queue_workflow_runs (
    id           uuid PRIMARY KEY,
    workflow     text NOT NULL,
    -- {"steps": [{name, after, map_over, kind, job_kind, queue, priority,
    --  max_attempts, delay, timeout, child}], "children": {name: definition},
    --  "channel": the NOTIFY channel of step inserts (or null)}
    definition   jsonb NOT NULL,
    input        jsonb,
    state        text NOT NULL DEFAULT 'running'
                 CHECK (state IN ('running', 'completed', 'failed', 'cancelled')),
    result       jsonb,
    failed_step  text,
    error        text,
    -- One run per key ever (not only among running runs): a cron tick's job
    -- that is retried after its run ended must not start a second run.
    unique_key   text,
    parent_run   uuid REFERENCES nasiko_queue_workflow_runs (id) ON DELETE CASCADE,
    parent_step  text,
    created_at   timestamptz NOT NULL DEFAULT now(),
    finished_at  timestamptz
);
CREATE UNIQUE INDEX IF NOT EXISTS nasiko_queue_workflow_runs_unique
    ON nasiko_queue_workflow_runs (unique_key) WHERE unique_key IS NOT NULL;
CREATE INDEX IF NOT EXISTS nasiko_queue_workflow_runs_parent
    ON nasiko_queue_workflow_runs (parent_run) WHERE parent_run IS NOT NULL;
CREATE INDEX IF NOT EXISTS nasiko_queue_workflow_runs_listing
    ON nasiko_queue_workflow_runs (workflow, state, created_at);

CREATE TABLE IF NOT EXISTS nasiko_queue_workflow_steps (
    run_id  uuid NOT NULL REFERENCES nasiko_queue_workflow_runs (id) ON DELETE CASCADE,
    step    text NOT NULL,
    idx     integer NOT NULL,
    state   text NOT NULL DEFAULT 'blocked'
            CHECK (state IN ('blocked', 'enqueued', 'waiting', 'completed', 'failed',
                             'cancelled')),
    job_id  uuid,
    -- A 'child' step's run.
    child_run uuid,
    result  jsonb,
    error   text,
    PRIMARY KEY (run_id, step, idx)
);

-- Signals sent to a run: kept until their step waits (then consumed), and
-- kept after that, so a second signal of the same name is refused.
CREATE TABLE IF NOT EXISTS nasiko_queue_workflow_signals (
    run_id   uuid NOT NULL REFERENCES nasiko_queue_workflow_runs (id) ON DELETE CASCADE,
    name     text NOT NULL,
    payload  jsonb,
    consumed boolean NOT NULL DEFAULT false,
    sent_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (run_id, name)
);

ALTER TABLE nasiko_queue_jobs ADD COLUMN IF NOT EXISTS workflow_run uuid;

-- The definition of step `step_name` in run definition `def`.
CREATE OR REPLACE FUNCTION nasiko_queue_wf_step_def(def jsonb, step_name text) RETURNS jsonb
LANGUAGE sql IMMUTABLE AS $$
    SELECT s FROM jsonb_array_elements($1 -> 'steps') AS s WHERE s ->> 'name' = $2
$$;

-- A step's result as its dependants read it: the head row's (a mapped step's
-- head holds its items' results in item order).
CREATE OR REPLACE FUNCTION nasiko_queue_wf_step_result(run uuid, step_name text) RETURNS jsonb
LANGUAGE sql STABLE AS $$
    SELECT result FROM nasiko_queue_workflow_steps
    WHERE run_id = $1 AND step = $2 ORDER BY idx LIMIT 1
$$;

-- Enqueue the plain job of step (run, sname, idx) of kind 'job': its payload
-- names nothing but the step; the executor reads its inputs from the tables.
CREATE OR REPLACE FUNCTION nasiko_queue_wf_enqueue_job(run uuid, def jsonb, sdef jsonb,
                                                       i integer) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    new_id uuid := gen_random_uuid();
BEGIN
    INSERT INTO nasiko_queue_jobs (id, queue, kind, payload, priority, max_attempts, run_at,
                                   workflow_run)
    VALUES (new_id, sdef ->> 'queue', sdef ->> 'job_kind',
            jsonb_build_object('kind', sdef ->> 'job_kind', 'run', run::text,
                               'step', sdef ->> 'name', 'idx', i),
            (sdef ->> 'priority')::smallint, (sdef ->> 'max_attempts')::integer,
            now() + make_interval(secs => coalesce((sdef ->> 'delay')::double precision, 0)),
            run);
    UPDATE nasiko_queue_workflow_steps SET state = 'enqueued', job_id = new_id,
                                           error = NULL
    WHERE run_id = run AND step = sdef ->> 'name' AND idx = i;
    IF def ->> 'channel' IS NOT NULL THEN
        PERFORM pg_notify(def ->> 'channel', '');
    END IF;
END;
$$;

-- Cancel what is unfinished of a run that just ended (failed or cancelled):
-- its step rows, their jobs (nasiko_queue_cancel: a running one is asked to
-- stop) and its child runs. The jobs' own ends then find the run ended and
-- change nothing.
--
-- A job whose row another transaction holds is skipped, not waited for: that
-- transaction may be ending it (the completer's finish, which then waits for
-- this run's row in the trigger: waiting here would deadlock) or claiming it.
-- Either way nothing is lost: a job that ends finds the run ended, and a step
-- job claimed after its run ended returns without running its step.
CREATE OR REPLACE FUNCTION nasiko_queue_wf_stop_steps(run uuid) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    s record;
BEGIN
    FOR s IN
        UPDATE nasiko_queue_workflow_steps SET state = 'cancelled'
        WHERE run_id = run AND state IN ('blocked', 'enqueued', 'waiting')
        RETURNING job_id, child_run
    LOOP
        IF s.job_id IS NOT NULL THEN
            PERFORM 1 FROM nasiko_queue_jobs WHERE id = s.job_id FOR UPDATE SKIP LOCKED;
            IF FOUND THEN
                PERFORM nasiko_queue_cancel(s.job_id);
            END IF;
        END IF;
        IF s.child_run IS NOT NULL THEN
            PERFORM nasiko_queue_workflow_cancel(s.child_run);
        END IF;
    END LOOP;
END;
$$;

-- Step (run, sname, idx) failed with `err`: the run fails (its failed step and
-- error kept), nothing else of it runs, and its parent's step fails too.
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
        IF EXISTS (SELECT 1 FROM nasiko_queue_workflow_runs
                   WHERE id = r.parent_run AND state = 'running') THEN
            PERFORM nasiko_queue_wf_fail(r.parent_run, r.parent_step, 0,
                                         'child run ' || run || ' failed at step ' || sname
                                         || ': ' || coalesce(err, ''));
        END IF;
    END IF;
END;
$$;

-- A step's row reached 'completed' with `res`: record it, close a mapped
-- step's head once its last item completed, and advance the run.
CREATE OR REPLACE FUNCTION nasiko_queue_wf_complete(run uuid, sname text, i integer, res jsonb)
RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    UPDATE nasiko_queue_workflow_steps SET state = 'completed', result = res, error = NULL
    WHERE run_id = run AND step = sname AND idx = i;
    IF i >= 0 AND EXISTS (SELECT 1 FROM nasiko_queue_workflow_steps
                          WHERE run_id = run AND step = sname AND idx = -1)
       AND NOT EXISTS (SELECT 1 FROM nasiko_queue_workflow_steps
                       WHERE run_id = run AND step = sname AND idx >= 0
                         AND state <> 'completed') THEN
        UPDATE nasiko_queue_workflow_steps
        SET state = 'completed',
            result = (SELECT coalesce(jsonb_agg(result ORDER BY idx), '[]'::jsonb)
                      FROM nasiko_queue_workflow_steps
                      WHERE run_id = run AND step = sname AND idx >= 0)
        WHERE run_id = run AND step = sname AND idx = -1;
    END IF;
    PERFORM nasiko_queue_wf_advance(run);
END;
$$;

-- Start every blocked step whose dependencies have all completed (repeated
-- until none: a step may complete at once, as an empty fan-out or a signal
-- sent early), then complete the run once every step has.
CREATE OR REPLACE FUNCTION nasiko_queue_wf_advance(run uuid) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    r record;
    sdef jsonb;
    sname text;
    items jsonb;
    n integer;
    sig record;
    progressed boolean := true;
    res jsonb;
    child uuid;
    child_input jsonb;
    deps text[];
    timer uuid;
BEGIN
    SELECT * INTO r FROM nasiko_queue_workflow_runs WHERE id = run;
    IF r.state <> 'running' THEN
        RETURN;
    END IF;
    WHILE progressed LOOP
        progressed := false;
        -- The steps ready now, in one query: blocked (their head row), and
        -- every dependency completed (all its rows).
        FOR sdef IN
            SELECT d.s
            FROM jsonb_array_elements(r.definition -> 'steps') WITH ORDINALITY AS d(s, n)
            JOIN nasiko_queue_workflow_steps AS h
              ON h.run_id = run AND h.step = d.s ->> 'name' AND h.state = 'blocked'
             AND h.idx = CASE WHEN d.s ->> 'map_over' IS NULL THEN 0 ELSE -1 END
            WHERE NOT EXISTS (
                SELECT 1 FROM jsonb_array_elements_text(d.s -> 'after') AS a(dep)
                JOIN nasiko_queue_workflow_steps AS x
                  ON x.run_id = run AND x.step = a.dep AND x.state <> 'completed')
            ORDER BY d.n
        LOOP
            sname := sdef ->> 'name';
            -- Still blocked: a transition nested in this loop (a child run that
            -- ended at once) may have started it meanwhile.
            CONTINUE WHEN NOT EXISTS (
                SELECT 1 FROM nasiko_queue_workflow_steps
                WHERE run_id = run AND step = sname AND state = 'blocked'
                  AND idx = CASE WHEN sdef ->> 'map_over' IS NULL THEN 0 ELSE -1 END);
            IF sdef ->> 'map_over' IS NOT NULL THEN
                items := nasiko_queue_wf_step_result(run, sdef ->> 'map_over');
                IF items IS NULL OR jsonb_typeof(items) <> 'array' THEN
                    PERFORM nasiko_queue_wf_fail(run, sname, -1,
                        'map_over: step ' || (sdef ->> 'map_over') || ' returned '
                        || coalesce(jsonb_typeof(items), 'nothing') || ', not a list');
                    RETURN;
                END IF;
                n := jsonb_array_length(items);
                IF n = 0 THEN
                    UPDATE nasiko_queue_workflow_steps SET state = 'completed',
                                                           result = '[]'::jsonb
                    WHERE run_id = run AND step = sname AND idx = -1;
                    progressed := true;
                    CONTINUE;
                END IF;
                UPDATE nasiko_queue_workflow_steps SET state = 'enqueued'
                WHERE run_id = run AND step = sname AND idx = -1;
                -- Items completed before a retry keep their results.
                INSERT INTO nasiko_queue_workflow_steps (run_id, step, idx)
                SELECT run, sname, g FROM generate_series(0, n - 1) AS g
                ON CONFLICT DO NOTHING;
                FOR i IN 0 .. n - 1 LOOP
                    IF EXISTS (SELECT 1 FROM nasiko_queue_workflow_steps
                               WHERE run_id = run AND step = sname AND idx = i
                                 AND state <> 'completed') THEN
                        PERFORM nasiko_queue_wf_enqueue_job(run, r.definition, sdef, i);
                    END IF;
                END LOOP;
                IF NOT EXISTS (SELECT 1 FROM nasiko_queue_workflow_steps
                               WHERE run_id = run AND step = sname AND idx >= 0
                                 AND state <> 'completed') THEN
                    PERFORM nasiko_queue_wf_complete(run, sname, 0,
                                                     nasiko_queue_wf_step_result(run, sname));
                    RETURN;
                END IF;
            ELSIF sdef ->> 'kind' = 'job' THEN
                PERFORM nasiko_queue_wf_enqueue_job(run, r.definition, sdef, 0);
            ELSIF sdef ->> 'kind' = 'signal' THEN
                SELECT * INTO sig FROM nasiko_queue_workflow_signals AS g
                WHERE g.run_id = run AND g.name = sname AND NOT g.consumed;
                IF FOUND THEN
                    UPDATE nasiko_queue_workflow_signals AS g SET consumed = true
                    WHERE g.run_id = run AND g.name = sname;
                    UPDATE nasiko_queue_workflow_steps SET state = 'completed',
                                                           result = sig.payload
                    WHERE run_id = run AND step = sname AND idx = 0;
                    progressed := true;
                    CONTINUE;
                END IF;
                timer := NULL;
                IF sdef ->> 'timeout' IS NOT NULL THEN
                    -- A durable timer: a plain job due at the deadline that fails
                    -- the step if it still waits then (no slot held meanwhile).
                    -- Not a step job (no workflow_run): its own end changes
                    -- nothing; its id in the step row tells a stale timer (from
                    -- before a retry) from the live one.
                    timer := gen_random_uuid();
                    INSERT INTO nasiko_queue_jobs (id, queue, kind, payload, max_attempts,
                                                   run_at)
                    VALUES (timer, sdef ->> 'queue', 'nasiko_queue.signal_timeout',
                            jsonb_build_object('kind', 'nasiko_queue.signal_timeout',
                                               'run', run::text, 'step', sname),
                            20,
                            now() + make_interval(secs => (sdef ->> 'timeout')::double precision));
                END IF;
                UPDATE nasiko_queue_workflow_steps SET state = 'waiting', job_id = timer
                WHERE run_id = run AND step = sname AND idx = 0;
            ELSIF sdef ->> 'kind' = 'child' THEN
                -- A child's input: its one dependency's result, an object of its
                -- dependencies' results by name, or (none) the run's input.
                SELECT array_agg(d) INTO deps FROM jsonb_array_elements_text(sdef -> 'after') d;
                IF deps IS NULL THEN
                    child_input := r.input;
                ELSIF cardinality(deps) = 1 THEN
                    child_input := nasiko_queue_wf_step_result(run, deps[1]);
                ELSE
                    SELECT jsonb_object_agg(d, nasiko_queue_wf_step_result(run, d))
                    INTO child_input FROM unnest(deps) AS d;
                END IF;
                child := gen_random_uuid();
                UPDATE nasiko_queue_workflow_steps SET state = 'waiting', child_run = child
                WHERE run_id = run AND step = sname AND idx = 0;
                PERFORM nasiko_queue_workflow_start(
                    child, sdef ->> 'child',
                    (r.definition -> 'children' -> (sdef ->> 'child'))
                        || jsonb_build_object('children', r.definition -> 'children',
                                              'channel', r.definition -> 'channel'),
                    child_input, NULL, run, sname);
                -- A child that ended at once (no steps) has ended its parent's step.
                SELECT * INTO r FROM nasiko_queue_workflow_runs WHERE id = run;
                IF r.state <> 'running' THEN
                    RETURN;
                END IF;
                progressed := true;
            END IF;
        END LOOP;
    END LOOP;
    IF NOT EXISTS (SELECT 1 FROM nasiko_queue_workflow_steps
                   WHERE run_id = run AND state <> 'completed') THEN
        -- The result: the sinks' (the steps nothing depends on): one sink's
        -- result as it is; several: an object by step name.
        SELECT CASE WHEN count(*) = 1 THEN (array_agg(nasiko_queue_wf_step_result(run, s)))[1]
                    ELSE jsonb_object_agg(s, nasiko_queue_wf_step_result(run, s)) END
        INTO res
        FROM (SELECT x ->> 'name' AS s FROM jsonb_array_elements(r.definition -> 'steps') x
              WHERE NOT EXISTS (SELECT 1 FROM jsonb_array_elements(r.definition -> 'steps') y
                                WHERE (y -> 'after') ? (x ->> 'name'))) AS sinks;
        UPDATE nasiko_queue_workflow_runs
        SET state = 'completed', result = res, finished_at = now()
        WHERE id = run;
        IF r.parent_run IS NOT NULL THEN
            PERFORM 1 FROM nasiko_queue_workflow_runs WHERE id = r.parent_run FOR UPDATE;
            IF EXISTS (SELECT 1 FROM nasiko_queue_workflow_runs AS p
                       JOIN nasiko_queue_workflow_steps AS s
                         ON s.run_id = p.id AND s.step = r.parent_step AND s.idx = 0
                       WHERE p.id = r.parent_run AND p.state = 'running'
                         AND s.state = 'waiting' AND s.child_run = run) THEN
                PERFORM nasiko_queue_wf_complete(r.parent_run, r.parent_step, 0, res);
            END IF;
        END IF;
    END IF;
END;
$$;

-- Start a run: its row, a row per step (blocked), then the steps with no
-- dependencies. A run whose unique key is held already: nothing inserted, the
-- holder's id returned.
CREATE OR REPLACE FUNCTION nasiko_queue_workflow_start(
    run uuid, workflow_name text, def jsonb, run_input jsonb, key text,
    parent uuid, parent_step_name text) RETURNS uuid
LANGUAGE plpgsql AS $$
DECLARE
    held uuid;
BEGIN
    INSERT INTO nasiko_queue_workflow_runs (id, workflow, definition, input, unique_key,
                                            parent_run, parent_step)
    VALUES (run, workflow_name, def, run_input, key, parent, parent_step_name)
    ON CONFLICT (unique_key) WHERE unique_key IS NOT NULL DO NOTHING;
    IF NOT FOUND THEN
        SELECT id INTO held FROM nasiko_queue_workflow_runs WHERE unique_key = key;
        RETURN held;
    END IF;
    PERFORM 1 FROM nasiko_queue_workflow_runs WHERE id = run FOR UPDATE;
    INSERT INTO nasiko_queue_workflow_steps (run_id, step, idx)
    SELECT run, s ->> 'name', CASE WHEN s ->> 'map_over' IS NULL THEN 0 ELSE -1 END
    FROM jsonb_array_elements(def -> 'steps') AS s;
    PERFORM nasiko_queue_wf_advance(run);
    RETURN run;
END;
$$;

-- Cancel a run: it ends 'cancelled', its unfinished steps are cancelled (a
-- running step's job is asked to stop), none starts. Returns 'cancelled',
-- 'already <state>', or NULL for no such run.
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
    -- A child cancelled on its own cancels its parent's run.
    IF r.parent_run IS NOT NULL THEN
        PERFORM nasiko_queue_workflow_cancel(r.parent_run);
    END IF;
    RETURN 'cancelled';
END;
$$;

-- Retry a failed (or cancelled) run: its failed, cancelled and never-started
-- steps go back to blocked, completed ones keep their results, and those whose
-- dependencies completed start. Returns 'retried', 'not failed: <state>', or
-- NULL for no such run.
CREATE OR REPLACE FUNCTION nasiko_queue_workflow_retry(run uuid) RETURNS text
LANGUAGE plpgsql AS $$
DECLARE
    locked text;
BEGIN
    SELECT state INTO locked FROM nasiko_queue_workflow_runs WHERE id = run FOR UPDATE;
    IF NOT FOUND THEN
        RETURN NULL;
    ELSIF locked NOT IN ('failed', 'cancelled') THEN
        RETURN 'not failed: ' || locked;
    END IF;
    UPDATE nasiko_queue_workflow_runs
    SET state = 'running', failed_step = NULL, error = NULL, finished_at = NULL
    WHERE id = run;
    UPDATE nasiko_queue_workflow_steps
    SET state = 'blocked', job_id = NULL, child_run = NULL, error = NULL
    WHERE run_id = run AND state <> 'completed';
    PERFORM nasiko_queue_wf_advance(run);
    RETURN 'retried';
END;
$$;

-- Send signal `sig` to a run: delivered once (the run's row lock orders
-- concurrent sends; the first wins). Returns 'delivered' (its step
-- was waiting and completes with the payload), 'kept' (its step does not wait
-- yet: consumed when it does), 'already sent' (a signal of that name came
-- before: refused), 'run <state>' (the run has ended: refused), 'no such
-- signal' (the run's workflow has no signal step of that name), or NULL (no
-- such run).
CREATE OR REPLACE FUNCTION nasiko_queue_workflow_signal(run uuid, sig text, body jsonb)
RETURNS text
LANGUAGE plpgsql AS $$
DECLARE
    locked text;
BEGIN
    SELECT state INTO locked FROM nasiko_queue_workflow_runs WHERE id = run FOR UPDATE;
    IF NOT FOUND THEN
        RETURN NULL;
    ELSIF EXISTS (SELECT 1 FROM nasiko_queue_workflow_signals AS g
                  WHERE g.run_id = run AND g.name = sig) THEN
        RETURN 'already sent';
    ELSIF locked <> 'running' THEN
        RETURN 'run ' || locked;
    ELSIF NOT EXISTS (
        SELECT 1 FROM nasiko_queue_workflow_runs AS r,
                      jsonb_array_elements(r.definition -> 'steps') AS s
        WHERE r.id = run AND s ->> 'name' = sig AND s ->> 'kind' = 'signal') THEN
        RETURN 'no such signal';
    END IF;
    INSERT INTO nasiko_queue_workflow_signals (run_id, name, payload)
    VALUES (run, sig, body);
    IF EXISTS (SELECT 1 FROM nasiko_queue_workflow_steps
               WHERE run_id = run AND step = sig AND idx = 0 AND state = 'waiting'
                 AND child_run IS NULL) THEN
        UPDATE nasiko_queue_workflow_signals SET consumed = true
        WHERE run_id = run AND name = sig;
        PERFORM nasiko_queue_wf_complete(run, sig, 0, body);
        RETURN 'delivered';
    END IF;
    RETURN 'kept';
END;
$$;

-- A signal step's deadline came (the timer job's executor calls this): the
-- step fails, and the run with it, if it still waits for this timer (`timer`,
-- the timer job's id). Returns 'timed out' or 'nothing to do'.
CREATE OR REPLACE FUNCTION nasiko_queue_workflow_signal_timeout(run uuid, sname text,
                                                                 timer uuid)
RETURNS text
LANGUAGE plpgsql AS $$
DECLARE
    sdef jsonb;
BEGIN
    PERFORM 1 FROM nasiko_queue_workflow_runs WHERE id = run AND state = 'running'
    FOR UPDATE;
    IF NOT FOUND OR NOT EXISTS (
        SELECT 1 FROM nasiko_queue_workflow_steps
        WHERE run_id = run AND step = sname AND idx = 0 AND state = 'waiting'
          AND job_id = timer) THEN
        RETURN 'nothing to do';
    END IF;
    SELECT nasiko_queue_wf_step_def(definition, sname) INTO sdef
    FROM nasiko_queue_workflow_runs WHERE id = run;
    PERFORM nasiko_queue_wf_fail(run, sname, 0,
                                 'signal ' || sname || ' timed out after '
                                 || (sdef ->> 'timeout') || ' s');
    RETURN 'timed out';
END;
$$;

-- THE transition: a step job's state changed.
CREATE OR REPLACE FUNCTION nasiko_queue_workflow_step_ended() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    sname text := NEW.payload ->> 'step';
    i integer := (NEW.payload ->> 'idx')::integer;
BEGIN
    IF NEW.state NOT IN ('completed', 'discarded', 'cancelled') THEN
        RETURN NULL;
    END IF;
    PERFORM 1 FROM nasiko_queue_workflow_runs
    WHERE id = NEW.workflow_run AND state = 'running' FOR UPDATE;
    -- Its run has ended (the run's own failure or cancel, or before a retry):
    -- a step job ending now changes nothing; nor does a job a retry replaced.
    IF NOT FOUND OR NOT EXISTS (
        SELECT 1 FROM nasiko_queue_workflow_steps
        WHERE run_id = NEW.workflow_run AND step = sname AND idx = i AND job_id = NEW.id
          AND state = 'enqueued') THEN
        RETURN NULL;
    END IF;
    IF NEW.state = 'completed' THEN
        PERFORM nasiko_queue_wf_complete(NEW.workflow_run, sname, i,
                                         coalesce(NEW.result, 'null'::jsonb));
    ELSIF NEW.state = 'discarded' THEN
        PERFORM nasiko_queue_wf_fail(NEW.workflow_run, sname, i, NEW.error_msg);
    ELSE
        UPDATE nasiko_queue_workflow_steps SET state = 'cancelled', error = NEW.error_msg
        WHERE run_id = NEW.workflow_run AND step = sname AND idx = i;
        PERFORM nasiko_queue_workflow_cancel(NEW.workflow_run);
    END IF;
    RETURN NULL;
END;
$$;

DROP TRIGGER IF EXISTS nasiko_queue_workflow_step_ended ON nasiko_queue_jobs;
CREATE TRIGGER nasiko_queue_workflow_step_ended AFTER UPDATE OF state ON nasiko_queue_jobs
    FOR EACH ROW
    WHEN (NEW.workflow_run IS NOT NULL AND OLD.state IS DISTINCT FROM NEW.state)
    EXECUTE FUNCTION nasiko_queue_workflow_step_ended();

-- A run's end wakes whoever waits for its result (`Queue.run_result`), as a
-- job's end does (migration 0017): its waits are kept in the same table, by the
-- run's id, and deleted here, with one NOTIFY; a run nobody waits for sends
-- nothing.
CREATE OR REPLACE FUNCTION nasiko_queue_workflow_run_ended() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    DELETE FROM nasiko_queue_result_waits WHERE job_id = NEW.id;
    IF FOUND THEN
        PERFORM pg_notify('nasiko_queue_results', NEW.id::text);
    END IF;
    RETURN NULL;
END;
$$;

DROP TRIGGER IF EXISTS nasiko_queue_workflow_run_ended ON nasiko_queue_workflow_runs;
CREATE TRIGGER nasiko_queue_workflow_run_ended AFTER UPDATE OF state
    ON nasiko_queue_workflow_runs
    FOR EACH ROW
    WHEN (NEW.state <> 'running' AND OLD.state IS DISTINCT FROM NEW.state)
    EXECUTE FUNCTION nasiko_queue_workflow_run_ended();
