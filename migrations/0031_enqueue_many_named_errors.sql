-- nasiko-queue 0031: nasiko_queue_enqueue_many names the job and the key of a
-- value it cannot take.
--
-- A value of the right JSON type but out of its column's range (a priority of
-- 1.5, 1e12 attempts, a delay of 1e300 seconds) or a run_at that is no time
-- ("tomorrow-ish") failed a cast in the loop with the cast's bare message
-- ("invalid input syntax for type integer"), naming neither the job nor the
-- key, though 0019 promises "jobs[3]: ...". They are checked before the casts
-- now (numbers: whole, and in range, 3.0 taken as 3 as JSON writers may write
-- it; delay: at most 100 years, as the Python API); a run_at is read by `nasiko_queue_enqueue_time`, which names the job,
-- wants a UTC offset (a naive time would be read in the session's TimeZone,
-- which the Python API refuses) and a finite time (-infinity made a row that
-- broke the date arithmetic of the views).
--
-- Safe on a live database: a new function and CREATE OR REPLACE of 0019's
-- batch function, same signature.

-- `v` (a run_at as JSON text gives it) as a time, or an error naming the job.
CREATE OR REPLACE FUNCTION nasiko_queue_enqueue_time(context text, v text)
RETURNS timestamptz
LANGUAGE plpgsql STABLE AS $$
DECLARE
    t timestamptz;
BEGIN
    IF v IS NULL THEN
        RETURN NULL;
    END IF;
    -- A time of day, then its offset: a date alone ("2030-01-01") ends in what
    -- looks like an offset ("-01") but has none.
    IF v !~ '[0-9]{2}:[0-9]{2}(:[0-9]{2}(\.[0-9]+)?)?\s*(Z|z|[+-][0-9]{2}(:?[0-9]{2})?)$' THEN
        RAISE EXCEPTION '%run_at needs a UTC offset (ISO 8601, e.g. '
                        '2030-01-01T09:00:00+00:00), got %', context, quote_literal(v)
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    BEGIN
        t := v::timestamptz;
    EXCEPTION WHEN data_exception THEN
        RAISE EXCEPTION '%run_at is not a time: % (%)', context, quote_literal(v), SQLERRM
            USING ERRCODE = 'invalid_parameter_value';
    END;
    IF NOT isfinite(t) THEN
        RAISE EXCEPTION '%run_at is a finite time, got %', context, quote_literal(v)
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    RETURN t;
END;
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
        -- The values' ranges, checked before their casts for the same reason:
        -- a cast that fails says neither which job nor which key.
        extra := ARRAY(SELECT k FROM (VALUES ('priority'), ('max_attempts')) AS t(k)
                       WHERE jsonb_typeof(job->k) = 'number'
                         AND ((job->>k)::numeric <> trunc((job->>k)::numeric)
                              OR (job->>k)::numeric NOT BETWEEN -2147483648 AND 2147483647)
                       ORDER BY k);
        IF cardinality(extra) > 0 THEN
            RAISE EXCEPTION '%values of % must be whole numbers (priority -32768 to '
                            '32767, max_attempts 1 to 2147483647)', what, extra
                USING ERRCODE = 'invalid_parameter_value';
        END IF;
        IF jsonb_typeof(job->'delay') = 'number'
           AND (job->>'delay')::numeric > 3155760000 THEN
            RAISE EXCEPTION '%delay is 0 to 3155760000 seconds (100 years), got %', what,
                job->>'delay' USING ERRCODE = 'invalid_parameter_value';
        END IF;
        ids := ids || nasiko_queue_enqueue_checked(
                what,
                job->>'kind',
                job->'args',
                job->>'queue',
                (job->>'priority')::numeric::integer,
                nasiko_queue_enqueue_time(what, job->>'run_at'),
                (job->>'max_attempts')::numeric::integer,
                job->>'unique_key',
                CASE WHEN jsonb_typeof(job->'unique_states') = 'array'
                     THEN ARRAY(SELECT jsonb_array_elements_text(job->'unique_states')) END,
                (job->>'delay')::double precision);
    END LOOP;
    RETURN ids;
END;
$$;
