-- nasiko-queue 0033: a workflow transition is bounded, and never waits inside a
-- worker's finish (issue #45, bugs 2 and 4; the signal timer's wake of bug 6).
--
-- Until now a step's transition ran whole in the trigger of migration 0018,
-- inside the statement that ended its job: the completer's finish, on one of
-- the engine's shared connections (two by default). Two things grew there
-- without bound. A fan-out enqueued every item in that one statement (100,000
-- items: 18-20 s), which `cleanup_timeout` cut on every try, so that it never
-- landed; and the trigger waited for the run's row lock, so a run whose items
-- ended together, or a long transition, held both connections while every
-- other queue's claim waited behind it.
--
-- Now:
--
-- * The trigger takes the run's row only if it is free (SKIP LOCKED). Free, it
--   applies the transition at once, as before, but a bounded one (below). Held
--   (another transition of the run, a cancel, a signal), it records that the
--   transition is due (`nasiko_queue_workflow_due`, a row naming the job) and
--   NOTIFYs; the finish returns without waiting. A worker's `TransitionService`
--   applies what is due on a pooled connection of its own (never the lanes'),
--   `nasiko_queue_wf_apply_due`, a piece per transaction.
-- * A fan-out is enqueued in pieces: the transition that starts a mapped step
--   enqueues its first piece (100 items; at once claimable) and records a
--   cursor on the step's head row (`enqueued_to` of `items`) and a due row; each
--   piece after that is a transaction of the service (1,000 items by default)
--   that moves the cursor. A crash, a fence or a stop between pieces loses
--   nothing: the cursor and the due row are committed with each piece, and any
--   worker's service goes on from there. A piece cut mid-way rolls back whole.
-- * A fan-in counts its completed items on the head row (`done_items`) instead
--   of reading every item at every item's end (which grew as n² over a
--   fan-out). The join (the head's result: every item's result, in order) runs
--   at once for a fan-out of up to 100 items; a larger one's is a transaction
--   of the service (one read of the items' results).
-- * A mapped item's row keeps its own element of the list (`item`), so that its
--   step reads that, not the whole list it maps over.
-- * A child run's end completes its parent's waiting step only if the parent's
--   row is free; else the parent's due row carries it.
-- * A signal step's timer job NOTIFYs its queue, as an enqueue does: a lane
--   learns of its due time at once (it used to fire at the next poll).
--
-- The rules themselves are 0018's: a step job that ends after its run ended
-- changes nothing, nor does one a retry replaced; a run's transitions take
-- turns on its row. What changes is when a contended one is applied: after the
-- finish committed, by the service, instead of inside it.
--
-- Safe on a live database: a new table, nullable columns without defaults (a
-- catalogue change only) and CREATE OR REPLACE of functions with their
-- signatures. A fan-out started before this migration (its head without a
-- cursor) ends by the old check, once per item's end.

CREATE TABLE IF NOT EXISTS nasiko_queue_workflow_due (
    id      bigserial PRIMARY KEY,
    -- No foreign key: inserting a row that references the run would take a
    -- KEY SHARE lock on the run's row, which is exactly the wait this table is
    -- here to avoid. A due row whose run is gone is deleted by the service.
    run_id  uuid NOT NULL,
    -- The step job whose end is due; NULL: the run's fan-outs, joins and
    -- ended child runs are to be continued.
    job_id  uuid,
    due_at  timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX IF NOT EXISTS nasiko_queue_workflow_due_run
    ON nasiko_queue_workflow_due (run_id, id);

-- A mapped step's head: how many items its list has, how many have rows and
-- jobs (the cursor of the fan-out), how many completed. An item: its element.
ALTER TABLE nasiko_queue_workflow_steps ADD COLUMN IF NOT EXISTS items integer;
ALTER TABLE nasiko_queue_workflow_steps ADD COLUMN IF NOT EXISTS enqueued_to integer;
ALTER TABLE nasiko_queue_workflow_steps ADD COLUMN IF NOT EXISTS done_items integer;
ALTER TABLE nasiko_queue_workflow_steps ADD COLUMN IF NOT EXISTS item jsonb;

-- How many items a transition enqueues now: the piece the service set for its
-- own transaction (`nasiko_queue.wf_piece`), else 100, the most a worker's
-- finish or an API call takes on inside its statement (about what a claim of
-- 100 jobs writes).
CREATE OR REPLACE FUNCTION nasiko_queue_wf_piece() RETURNS integer
LANGUAGE sql STABLE AS $$
    SELECT coalesce(nullif(current_setting('nasiko_queue.wf_piece', true), '')::integer, 100)
$$;

-- Whether this transaction is the service's (it may join a fan-out of any size).
CREATE OR REPLACE FUNCTION nasiko_queue_wf_in_service() RETURNS boolean
LANGUAGE sql STABLE AS $$
    SELECT coalesce(current_setting('nasiko_queue.wf_piece', true), '') <> ''
$$;

-- Record that run `run` has a transition due (the end of job `job`; NULL: its
-- fan-outs and joins to continue), and wake the services: a NOTIFY on the
-- run's channel with the payload the worker's listener hands to its
-- `TransitionService` (not to its lanes). Takes no lock on the run.
CREATE OR REPLACE FUNCTION nasiko_queue_wf_defer(run uuid, job uuid) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    channel text;
BEGIN
    INSERT INTO nasiko_queue_workflow_due (run_id, job_id) VALUES (run, job);
    SELECT definition ->> 'channel' INTO channel FROM nasiko_queue_workflow_runs
    WHERE id = run;
    IF channel IS NOT NULL THEN
        PERFORM pg_notify(channel, 'nasiko_queue.transition');
    END IF;
END;
$$;

-- A step's result as its dependants read it: the head row's (a mapped step's
-- head holds its items' results in item order). Unchanged from 0018, kept here
-- for the index it reads (the primary key's first row).
CREATE OR REPLACE FUNCTION nasiko_queue_wf_step_result(run uuid, step_name text) RETURNS jsonb
LANGUAGE sql STABLE AS $$
    SELECT result FROM nasiko_queue_workflow_steps
    WHERE run_id = $1 AND step = $2 ORDER BY idx LIMIT 1
$$;

-- The step's definition in a run's definition. Unchanged from 0018.
CREATE OR REPLACE FUNCTION nasiko_queue_wf_step_def(def jsonb, step_name text) RETURNS jsonb
LANGUAGE sql IMMUTABLE AS $$
    SELECT s FROM jsonb_array_elements($1 -> 'steps') AS s WHERE s ->> 'name' = $2
$$;

-- The plain job of one step (run, sdef, i): unchanged from 0018 but for the
-- set-based form below, which the fan-outs use.
CREATE OR REPLACE FUNCTION nasiko_queue_wf_enqueue_job(run uuid, def jsonb, sdef jsonb,
                                                       i integer) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM nasiko_queue_wf_enqueue_jobs(run, def, sdef, i, i);
END;
$$;

-- The jobs of a step's rows idx lo..hi that have not completed, in one
-- statement, and one NOTIFY: a piece of a fan-out (one row per item was a
-- function call and an INSERT each).
CREATE OR REPLACE FUNCTION nasiko_queue_wf_enqueue_jobs(run uuid, def jsonb, sdef jsonb,
                                                        lo integer, hi integer)
RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    sname text := sdef ->> 'name';
BEGIN
    -- The step rows first, each with its new job's id, then the jobs from
    -- what they returned: no join of the piece with itself (a nested loop of
    -- a piece's rows by a piece's rows, as the planner chose for a join).
    WITH rows AS (
        UPDATE nasiko_queue_workflow_steps
        SET state = 'enqueued', job_id = gen_random_uuid(), error = NULL
        WHERE run_id = run AND step = sname AND idx BETWEEN lo AND hi
          AND state <> 'completed'
        RETURNING idx, job_id
    )
    INSERT INTO nasiko_queue_jobs (id, queue, kind, payload, priority, max_attempts,
                                   run_at, workflow_run)
    SELECT t.job_id, sdef ->> 'queue', sdef ->> 'job_kind',
           jsonb_build_object('kind', sdef ->> 'job_kind', 'run', run::text,
                              'step', sname, 'idx', t.idx),
           (sdef ->> 'priority')::smallint, (sdef ->> 'max_attempts')::integer,
           now() + make_interval(secs => coalesce((sdef ->> 'delay')::double precision, 0)),
           run
    FROM rows AS t
    ORDER BY t.idx;
    IF FOUND AND def ->> 'channel' IS NOT NULL THEN
        PERFORM pg_notify(def ->> 'channel', '');
    END IF;
END;
$$;

-- The next piece of mapped step `sdef`'s fan-out (its head 'enqueued', its
-- cursor short of its items): rows and jobs for up to nasiko_queue_wf_piece()
-- items, the cursor moved. Then, if items remain, a due row for the next
-- piece; if every item has completed already (a retry keeps completed items'
-- results), the join. Returns whether the step completed (joined).
CREATE OR REPLACE FUNCTION nasiko_queue_wf_fan_out(run uuid, def jsonb, sdef jsonb)
RETURNS boolean
LANGUAGE plpgsql AS $$
DECLARE
    sname text := sdef ->> 'name';
    h record;
    list jsonb;
    hi integer;
BEGIN
    SELECT items, enqueued_to, done_items INTO h FROM nasiko_queue_workflow_steps
    WHERE run_id = run AND step = sname AND idx = -1 AND state = 'enqueued';
    IF NOT FOUND OR h.items IS NULL THEN
        RETURN false;
    END IF;
    IF h.enqueued_to < h.items THEN
        hi := least(h.enqueued_to + nasiko_queue_wf_piece(), h.items) - 1;
        list := nasiko_queue_wf_step_result(run, sdef ->> 'map_over');
        -- Items completed before a retry keep their rows and results.
        INSERT INTO nasiko_queue_workflow_steps (run_id, step, idx, item)
        SELECT run, sname, g, list -> g FROM generate_series(h.enqueued_to, hi) AS g
        ON CONFLICT DO NOTHING;
        PERFORM nasiko_queue_wf_enqueue_jobs(run, def, sdef, h.enqueued_to, hi);
        UPDATE nasiko_queue_workflow_steps SET enqueued_to = hi + 1
        WHERE run_id = run AND step = sname AND idx = -1;
        IF hi + 1 < h.items THEN
            PERFORM nasiko_queue_wf_defer(run, NULL);
            RETURN false;
        END IF;
    END IF;
    IF h.done_items >= h.items THEN
        RETURN nasiko_queue_wf_join(run, sname, h.items);
    END IF;
    RETURN false;
END;
$$;

-- Every item of mapped step `sname` (of `n`) has completed: the head completes
-- with their results in item order. A fan-out of more than 100 items is
-- joined by the service (its one read of every item's result is the only part
-- of a transition whose cost grows with the fan-out): elsewhere a due row is
-- left for it. Returns whether the head completed.
CREATE OR REPLACE FUNCTION nasiko_queue_wf_join(run uuid, sname text, n integer)
RETURNS boolean
LANGUAGE plpgsql AS $$
BEGIN
    IF n > 100 AND NOT nasiko_queue_wf_in_service() THEN
        PERFORM nasiko_queue_wf_defer(run, NULL);
        RETURN false;
    END IF;
    UPDATE nasiko_queue_workflow_steps
    SET state = 'completed',
        result = (SELECT coalesce(jsonb_agg(result ORDER BY idx), '[]'::jsonb)
                  FROM nasiko_queue_workflow_steps
                  WHERE run_id = run AND step = sname AND idx >= 0)
    WHERE run_id = run AND step = sname AND idx = -1 AND state = 'enqueued';
    RETURN FOUND;
END;
$$;

-- A step's row reached 'completed' with `res`: record it, count a mapped
-- item on its head (joining the step once its last item completed), and
-- advance the run. The run's row is locked by the caller.
CREATE OR REPLACE FUNCTION nasiko_queue_wf_complete(run uuid, sname text, i integer, res jsonb)
RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    was text;
    h record;
BEGIN
    SELECT state INTO was FROM nasiko_queue_workflow_steps
    WHERE run_id = run AND step = sname AND idx = i;
    UPDATE nasiko_queue_workflow_steps SET state = 'completed', result = res, error = NULL
    WHERE run_id = run AND step = sname AND idx = i;
    IF i >= 0 THEN
        SELECT items, enqueued_to, done_items INTO h FROM nasiko_queue_workflow_steps
        WHERE run_id = run AND step = sname AND idx = -1 AND state = 'enqueued';
        IF FOUND AND h.items IS NOT NULL THEN
            IF was IS DISTINCT FROM 'completed' THEN
                UPDATE nasiko_queue_workflow_steps SET done_items = done_items + 1
                WHERE run_id = run AND step = sname AND idx = -1
                RETURNING done_items INTO h.done_items;
            END IF;
            -- An item whose step does not complete with it changes nothing
            -- else (its dependants read the head): no advance, whose reads
            -- would be a fan-out's cost at every one of its items.
            IF h.done_items < h.items OR h.enqueued_to < h.items
               OR NOT nasiko_queue_wf_join(run, sname, h.items) THEN
                RETURN;
            END IF;
        ELSIF FOUND AND NOT EXISTS (SELECT 1 FROM nasiko_queue_workflow_steps
                                    WHERE run_id = run AND step = sname AND idx >= 0
                                      AND state <> 'completed') THEN
            -- A fan-out started before migration 0033 (no cursor): 0018's check.
            UPDATE nasiko_queue_workflow_steps
            SET state = 'completed',
                result = (SELECT coalesce(jsonb_agg(result ORDER BY idx), '[]'::jsonb)
                          FROM nasiko_queue_workflow_steps
                          WHERE run_id = run AND step = sname AND idx >= 0)
            WHERE run_id = run AND step = sname AND idx = -1;
        END IF;
    END IF;
    PERFORM nasiko_queue_wf_advance(run);
END;
$$;

-- Whether a step has completed, by its first row alone: a mapped step's head
-- completes with its last item (0033's count), so its items need not be read.
-- 0018 read every row of a dependency (and of the run, for its end) at every
-- advance: at each of a fan-out's item ends, that grew as n² over the fan-out.
CREATE OR REPLACE FUNCTION nasiko_queue_wf_step_state(run uuid, step_name text) RETURNS text
LANGUAGE sql STABLE AS $$
    SELECT state FROM nasiko_queue_workflow_steps
    WHERE run_id = $1 AND step = $2 ORDER BY idx LIMIT 1
$$;

-- Start every blocked step whose dependencies have all completed (repeated
-- until none: a step may complete at once, as an empty fan-out or a signal
-- sent early), then complete the run once every step has. As 0018's, but a
-- mapped step starts its fan-out (the first piece, nasiko_queue_wf_fan_out),
-- a signal's timer NOTIFYs, a step's dependencies and the run's end are read
-- from each step's first row, and a run's end completes its parent's step
-- only when the parent's row is free (else the parent's due row does).
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
        FOR sdef IN
            SELECT d.s
            FROM jsonb_array_elements(r.definition -> 'steps') WITH ORDINALITY AS d(s, n)
            JOIN nasiko_queue_workflow_steps AS h
              ON h.run_id = run AND h.step = d.s ->> 'name' AND h.state = 'blocked'
             AND h.idx = CASE WHEN d.s ->> 'map_over' IS NULL THEN 0 ELSE -1 END
            WHERE NOT EXISTS (
                SELECT 1 FROM jsonb_array_elements_text(d.s -> 'after') AS a(dep)
                WHERE nasiko_queue_wf_step_state(run, a.dep) IS DISTINCT FROM 'completed')
            ORDER BY d.n
        LOOP
            sname := sdef ->> 'name';
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
                -- The fan-out's cursor at 0; items completed before a retry are
                -- counted (and keep their results: no job for them).
                UPDATE nasiko_queue_workflow_steps
                SET state = 'enqueued', items = n, enqueued_to = 0,
                    done_items = (SELECT count(*) FROM nasiko_queue_workflow_steps
                                  WHERE run_id = run AND step = sname AND idx BETWEEN 0 AND n - 1
                                    AND state = 'completed')
                WHERE run_id = run AND step = sname AND idx = -1;
                -- Its first piece now; a list whose items all completed before
                -- is joined (0018 completed its item 0 with the head's stale
                -- result instead).
                IF nasiko_queue_wf_fan_out(run, r.definition, sdef) THEN
                    progressed := true;
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
                    -- A durable timer (0018), and now a wake: the NOTIFY an
                    -- enqueue sends, so that a lane learns of its due time at
                    -- once instead of at its next poll.
                    timer := gen_random_uuid();
                    INSERT INTO nasiko_queue_jobs (id, queue, kind, payload, max_attempts,
                                                   run_at)
                    VALUES (timer, sdef ->> 'queue', 'nasiko_queue.signal_timeout',
                            jsonb_build_object('kind', 'nasiko_queue.signal_timeout',
                                               'run', run::text, 'step', sname),
                            20,
                            now() + make_interval(secs => (sdef ->> 'timeout')::double precision));
                    IF r.definition ->> 'channel' IS NOT NULL THEN
                        PERFORM pg_notify(r.definition ->> 'channel', '');
                    END IF;
                END IF;
                UPDATE nasiko_queue_workflow_steps SET state = 'waiting', job_id = timer
                WHERE run_id = run AND step = sname AND idx = 0;
            ELSIF sdef ->> 'kind' = 'child' THEN
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
                SELECT * INTO r FROM nasiko_queue_workflow_runs WHERE id = run;
                IF r.state <> 'running' THEN
                    RETURN;
                END IF;
                progressed := true;
            END IF;
        END LOOP;
    END LOOP;
    IF NOT EXISTS (SELECT 1 FROM jsonb_array_elements(r.definition -> 'steps') AS x
                   WHERE nasiko_queue_wf_step_state(run, x ->> 'name')
                         IS DISTINCT FROM 'completed') THEN
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
            -- The parent's row, if free (or ours already: a child that ended
            -- at once); held, the parent's due row completes its step later.
            PERFORM 1 FROM nasiko_queue_workflow_runs WHERE id = r.parent_run
            FOR UPDATE SKIP LOCKED;
            IF NOT FOUND THEN
                PERFORM nasiko_queue_wf_defer(r.parent_run, NULL);
            ELSIF nasiko_queue_wf_waits_for(r.parent_run, r.parent_step, run) THEN
                PERFORM nasiko_queue_wf_complete(r.parent_run, r.parent_step, 0, res);
            END IF;
        END IF;
    END IF;
END;
$$;

-- Start a run. Unchanged from 0018 (re-created: it calls the advance above).
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

-- The end of step job `job` (state `jstate`, its result and error), applied to
-- run `run`, whose row the caller holds and which runs: 0018's trigger body.
-- A job that is no longer its step's live job (a retry replaced it) changes
-- nothing.
CREATE OR REPLACE FUNCTION nasiko_queue_wf_job_ended(run uuid, job uuid, sname text,
                                                     i integer, jstate text, res jsonb,
                                                     err text)
RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    IF NOT EXISTS (
        SELECT 1 FROM nasiko_queue_workflow_steps
        WHERE run_id = run AND step = sname AND idx = i AND job_id = job
          AND state = 'enqueued') THEN
        RETURN;
    END IF;
    IF jstate = 'completed' THEN
        PERFORM nasiko_queue_wf_complete(run, sname, i, coalesce(res, 'null'::jsonb));
    ELSIF jstate = 'discarded' THEN
        PERFORM nasiko_queue_wf_fail(run, sname, i, err);
    ELSE
        UPDATE nasiko_queue_workflow_steps SET state = 'cancelled', error = err
        WHERE run_id = run AND step = sname AND idx = i;
        PERFORM nasiko_queue_workflow_cancel(run);
    END IF;
END;
$$;

-- THE transition, now bounded: a step job's state changed. The run's row is
-- taken only if it is free; held by another transaction, the transition is
-- recorded as due and the finish goes on (the service applies it).
CREATE OR REPLACE FUNCTION nasiko_queue_workflow_step_ended() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    rstate text;
BEGIN
    IF NEW.state NOT IN ('completed', 'discarded', 'cancelled') THEN
        RETURN NULL;
    END IF;
    SELECT state INTO rstate FROM nasiko_queue_workflow_runs
    WHERE id = NEW.workflow_run FOR UPDATE SKIP LOCKED;
    IF NOT FOUND THEN
        -- Held (or gone). A run that ended, as its last commit says, takes no
        -- transition; one that runs, or is being ended or retried right now,
        -- gets a due row, which the service reads again under the lock.
        IF EXISTS (SELECT 1 FROM nasiko_queue_workflow_runs
                   WHERE id = NEW.workflow_run AND state = 'running') THEN
            PERFORM nasiko_queue_wf_defer(NEW.workflow_run, NEW.id);
        END IF;
        RETURN NULL;
    END IF;
    IF rstate = 'running' THEN
        PERFORM nasiko_queue_wf_job_ended(NEW.workflow_run, NEW.id, NEW.payload ->> 'step',
                                          (NEW.payload ->> 'idx')::integer, NEW.state,
                                          NEW.result, NEW.error_msg);
    END IF;
    RETURN NULL;
END;
$$;

-- One piece of the transitions that are due (the `TransitionService`'s
-- statement, one transaction): the oldest due run whose row is free is locked;
-- up to `piece` of its due job ends are applied (each as the trigger would
-- have), then its fan-outs go on by up to `piece` items, its joins are made,
-- and its waiting child steps whose child runs completed complete. Due rows of
-- runs that ended or are gone are deleted. Returns how many due rows it took
-- (0: nothing due that it could take).
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
        -- An ended run takes no transition (0018's rule); what was due goes.
        DELETE FROM nasiko_queue_workflow_due WHERE run_id = chosen;
        GET DIAGNOSTICS taken = ROW_COUNT;
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
    -- Child runs that completed while this run's row was held.
    FOR c IN
        SELECT s.step, k.id, k.result FROM nasiko_queue_workflow_steps AS s
        JOIN nasiko_queue_workflow_runs AS k ON k.id = s.child_run
        WHERE s.run_id = chosen AND s.idx = 0 AND s.state = 'waiting'
          AND k.state = 'completed'
        ORDER BY s.step
    LOOP
        IF nasiko_queue_wf_waits_for(chosen, c.step, c.id) THEN
            PERFORM nasiko_queue_wf_complete(chosen, c.step, 0, c.result);
        END IF;
    END LOOP;
    RETURN taken;
END;
$$;
