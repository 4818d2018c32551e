-- nasiko-queue 0019: enqueue from any application (issue #26).
--
-- nasiko_queue_enqueue(kind, args, ...): add a plain job from SQL, so that any
-- language, any driver and any ORM enqueues inside the transaction it already
-- holds (the job commits or vanishes with the caller's rows), and a trigger can
-- enqueue when a row changes. It is the rule of `Queue.enqueue` for plain jobs,
-- written once for every caller that is not the trio API: the same defaults
-- (queue 'default', priority 0, 20 attempts, due now, unique within
-- available/running), the same checks (a kind `check_plain_kind` would refuse,
-- a queue name of 0 or over 128 characters or 'builds', args that are not a JSON
-- object or name another kind, a payload over the size limit), and the same
-- NOTIFY, sent at commit and not at all on a rollback. It returns the job's id,
-- or, when a job already holds the unique key, that job's id.
--
-- Plain jobs only: a build job needs its target (an agent or connector row and
-- its build row, written by the application in the same transaction, with the
-- owner's checks the application makes) and its credentials sealed with a key
-- derived from the master key, which the database never holds. So the seven
-- build kinds are refused here, by name, as `Queue.enqueue_json` refuses them.
--
-- Two settings, read per call, let an operator match a QueueConfig that is not
-- the default (ALTER DATABASE ... SET, or SET in a session):
--   nasiko_queue.notify_channel     the channel workers LISTEN on
--                                   (QueueConfig.notify_channel; '' = default)
--   nasiko_queue.max_payload_bytes  QueueConfig.max_payload_bytes
-- The payload's size is counted as the claim counts it: octet_length(payload::text).
--
-- nasiko_queue_enqueue_many(jobs jsonb): the batch form, a JSON array of
-- objects {"kind", "args", "queue", "priority", "run_at", "delay",
-- "max_attempts", "unique_key", "unique_states"} (all but "kind" optional;
-- "delay" in seconds), returning the ids in the order given. A bad element
-- raises an error naming its index (jobs[3]: ...), and the statement, like any
-- failed statement, leaves nothing behind.
--
-- Errors are SQLSTATE 22023 (invalid_parameter_value) with a message that says
-- what is wrong; drivers raise them as their own error types.
--
-- Safe on a live database: new functions only.

CREATE OR REPLACE FUNCTION nasiko_queue_enqueue_checked(
    context text,
    kind text,
    args jsonb,
    queue text,
    priority integer,
    run_at timestamptz,
    max_attempts integer,
    unique_key text,
    unique_states text[],
    delay double precision
) RETURNS uuid
LANGUAGE plpgsql VOLATILE AS $$
-- A name that is a column of nasiko_queue_jobs means the column (ON CONFLICT's
-- index predicate); the parameters are named in full where they are meant.
#variable_conflict use_column
DECLARE
    -- `Queue.enqueue`'s defaults (JobOptions, Unique, config.py).
    the_queue    text := coalesce(queue, 'default');
    the_priority integer := coalesce(priority, 0);
    the_attempts integer := coalesce(max_attempts, 20);
    the_states   text[];
    payload      jsonb;
    size_limit   bigint := coalesce(
        nullif(current_setting('nasiko_queue.max_payload_bytes', true), '')::bigint, 1048576);
    channel      text := coalesce(
        nullif(current_setting('nasiko_queue.notify_channel', true), ''), 'nasiko_queue_jobs');
    new_id       uuid := gen_random_uuid();
    inserted     uuid;
    holder       uuid;
BEGIN
    -- The kind: as check_plain_kind (queue.py) and the JobArgs registry check it.
    IF kind IS NULL OR btrim(kind) = '' THEN
        RAISE EXCEPTION '%a job kind is a non-empty string, got %', context,
            coalesce(quote_literal(kind), 'NULL')
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF length(kind) > 100 THEN
        RAISE EXCEPTION '%a job kind has at most 100 characters; this one has %', context,
            length(kind) USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF kind ~ '[[:cntrl:]]' THEN
        RAISE EXCEPTION '%a job kind has no control characters, got %', context,
            quote_literal(kind) USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF kind IN ('Upload', 'Update', 'Rollback', 'StandaloneBuild', 'Clone', 'GithubClone',
                'McpServerUpload') THEN
        RAISE EXCEPTION '% is a build job''s kind: build jobs are enqueued with their target '
                        'by the application (Queue.enqueue), not by nasiko_queue_enqueue',
            context || kind
            USING ERRCODE = 'invalid_parameter_value',
                  HINT = 'the SQL function adds plain jobs only (migration 0019 says why)';
    END IF;
    -- The arguments: a JSON object, its "kind" (if any) the job's.
    args := coalesce(args, '{}'::jsonb);
    IF jsonb_typeof(args) <> 'object' THEN
        RAISE EXCEPTION '%the arguments of a % job must be a JSON object, not %', context,
            kind, jsonb_typeof(args) USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF args ? 'kind' AND args->'kind' IS DISTINCT FROM to_jsonb(kind) THEN
        RAISE EXCEPTION '%the arguments name kind %, not %', context, args->'kind',
            quote_literal(kind) USING ERRCODE = 'invalid_parameter_value';
    END IF;
    payload := args || jsonb_build_object('kind', kind);
    IF octet_length(payload::text) > size_limit THEN
        RAISE EXCEPTION '% payload is % bytes; the limit is % (nasiko_queue.max_payload_bytes)',
            context || kind, octet_length(payload::text), size_limit
            USING ERRCODE = 'program_limit_exceeded';
    END IF;
    -- The options: as JobOptions validates them.
    IF length(the_queue) NOT BETWEEN 1 AND 128 THEN
        RAISE EXCEPTION '%a queue name is 1 to 128 characters, got %', context,
            quote_literal(the_queue) USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF the_queue = 'builds' THEN
        RAISE EXCEPTION '%''builds'' is the name build jobs go by; give plain jobs another queue',
            context USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF the_priority NOT BETWEEN -32768 AND 32767 THEN
        RAISE EXCEPTION '%a priority is between -32768 and 32767, got %', context, the_priority
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF the_attempts < 1 THEN
        RAISE EXCEPTION '%max_attempts is at least 1, got %', context, the_attempts
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF run_at IS NOT NULL AND delay IS NOT NULL THEN
        RAISE EXCEPTION '%give run_at or delay, not both', context
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF delay < 0 OR delay = 'NaN'::double precision OR delay = 'Infinity'::double precision THEN
        RAISE EXCEPTION '%delay is a number of seconds, not negative, got %', context, delay
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF unique_key IS NOT NULL THEN
        IF unique_key = '' THEN
            RAISE EXCEPTION '%a unique key is a non-empty string', context
                USING ERRCODE = 'invalid_parameter_value';
        END IF;
        the_states := ARRAY(SELECT DISTINCT s FROM unnest(coalesce(
            unique_states, ARRAY['available', 'running'])) AS s ORDER BY s);
        IF NOT the_states <@ ARRAY['available', 'running', 'completed', 'discarded',
                                   'cancelled'] THEN
            RAISE EXCEPTION '%unknown job state(s) in %; the states are available, running, '
                            'completed, discarded, cancelled', context, the_states
                USING ERRCODE = 'invalid_parameter_value';
        END IF;
        IF NOT ARRAY['available', 'running'] <@ the_states THEN
            RAISE EXCEPTION '%a unique job''s states must include available and running, got %',
                context, the_states USING ERRCODE = 'invalid_parameter_value';
        END IF;
    ELSIF unique_states IS NOT NULL THEN
        RAISE EXCEPTION '%unique_states without a unique_key', context
            USING ERRCODE = 'invalid_parameter_value';
    END IF;

    -- The insert, as plain_insert (queries.sql); a unique job that meets its key
    -- returns the holder's id. The holder may end between the two statements,
    -- freeing the key: then insert again (as Queue.enqueue does, UNIQUE_TRIES).
    -- clock_timestamp(), not now(): jobs enqueued one after another in one
    -- transaction (a batch, a trigger on many rows) are claimed in that order.
    FOR tries IN 1..5 LOOP
        INSERT INTO nasiko_queue_jobs AS j (id, queue, kind, payload, priority, max_attempts,
                                            run_at, unique_key, unique_states)
        VALUES (new_id, the_queue, kind, payload, the_priority, the_attempts,
                coalesce(run_at, clock_timestamp()
                                 + make_interval(secs => coalesce(delay, 0))),
                unique_key, the_states)
        ON CONFLICT (unique_key) WHERE unique_key IS NOT NULL AND state = ANY (unique_states)
        DO NOTHING
        RETURNING j.id INTO inserted;
        IF inserted IS NOT NULL THEN
            -- Sent at commit, once per transaction (PostgreSQL folds a
            -- transaction's identical notifications); never on a rollback.
            PERFORM pg_notify(channel, '');
            RETURN inserted;
        END IF;
        SELECT j.id INTO holder FROM nasiko_queue_jobs AS j
        WHERE j.unique_key = nasiko_queue_enqueue_checked.unique_key
          AND j.state = ANY (j.unique_states)
        LIMIT 1;
        IF holder IS NOT NULL THEN
            RETURN holder;
        END IF;
    END LOOP;
    RAISE EXCEPTION '%unique key %: the job holding it kept changing; tried 5 times', context,
        quote_literal(unique_key) USING ERRCODE = 'serialization_failure';
END;
$$;

CREATE OR REPLACE FUNCTION nasiko_queue_enqueue(
    kind text,
    args jsonb DEFAULT '{}',
    queue text DEFAULT NULL,
    priority integer DEFAULT NULL,
    run_at timestamptz DEFAULT NULL,
    max_attempts integer DEFAULT NULL,
    unique_key text DEFAULT NULL,
    unique_states text[] DEFAULT NULL,
    delay double precision DEFAULT NULL
) RETURNS uuid
LANGUAGE sql VOLATILE AS $$
    SELECT nasiko_queue_enqueue_checked('', kind, args, queue, priority, run_at, max_attempts,
                                        unique_key, unique_states, delay)
$$;

CREATE OR REPLACE FUNCTION nasiko_queue_enqueue_many(jobs jsonb) RETURNS uuid[]
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    job   jsonb;
    n     bigint;
    extra text[];
    ids   uuid[] := '{}';
    what  text;
BEGIN
    IF jsonb_typeof(jobs) IS DISTINCT FROM 'array' THEN
        RAISE EXCEPTION 'nasiko_queue_enqueue_many takes a JSON array of jobs, not %',
            coalesce(jsonb_typeof(jobs), 'NULL') USING ERRCODE = 'invalid_parameter_value';
    END IF;
    FOR job, n IN SELECT value, ordinality - 1 FROM jsonb_array_elements(jobs) WITH ORDINALITY
    LOOP
        what := format('jobs[%s]: ', n);
        IF jsonb_typeof(job) <> 'object' THEN
            RAISE EXCEPTION '%a job is a JSON object, not %', what, jsonb_typeof(job)
                USING ERRCODE = 'invalid_parameter_value';
        END IF;
        -- A misspelt option would otherwise be dropped without a word.
        extra := ARRAY(SELECT k FROM jsonb_object_keys(job) AS k
                       WHERE k NOT IN ('kind', 'args', 'queue', 'priority', 'run_at', 'delay',
                                       'max_attempts', 'unique_key', 'unique_states')
                       ORDER BY k);
        IF cardinality(extra) > 0 THEN
            RAISE EXCEPTION '%unknown key(s) %; a job has kind, args, queue, priority, run_at, '
                            'delay, max_attempts, unique_key, unique_states', what, extra
                USING ERRCODE = 'invalid_parameter_value';
        END IF;
        -- The options' JSON types, checked so that a wrong one is named with
        -- its index rather than failing a cast with a bare message.
        extra := ARRAY(SELECT k FROM (VALUES ('kind', 'string'), ('args', 'object'),
                                             ('queue', 'string'), ('priority', 'number'),
                                             ('run_at', 'string'), ('delay', 'number'),
                                             ('max_attempts', 'number'),
                                             ('unique_key', 'string'),
                                             ('unique_states', 'array')) AS t(k, want)
                       WHERE jsonb_typeof(job->k) NOT IN (want, 'null') ORDER BY k);
        IF cardinality(extra) > 0 THEN
            RAISE EXCEPTION '%wrong JSON type for %: kind, queue, run_at (ISO 8601) and '
                            'unique_key are strings, args an object, priority, delay and '
                            'max_attempts numbers, unique_states an array', what, extra
                USING ERRCODE = 'invalid_parameter_value';
        END IF;
        ids := ids || nasiko_queue_enqueue_checked(
                what,
                job->>'kind',
                job->'args',
                job->>'queue',
                (job->>'priority')::integer,
                (job->>'run_at')::timestamptz,
                (job->>'max_attempts')::integer,
                job->>'unique_key',
                CASE WHEN jsonb_typeof(job->'unique_states') = 'array'
                     THEN ARRAY(SELECT jsonb_array_elements_text(job->'unique_states')) END,
                (job->>'delay')::double precision);
    END LOOP;
    RETURN ids;
END;
$$;
