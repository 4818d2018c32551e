-- nasiko-queue 0017: results a caller can await (issue #22).
--
-- A plain job's executor may return a JSON value: the worker writes it to
-- `result` in the statement that completes the job (the completer's batched
-- finish), so a completed job and its result commit together. It is kept as
-- long as the row (retention).
--
-- Waiting for a result: `Queue.result` LISTENs on the channel below, records
-- that it waits in nasiko_queue_result_waits, then reads the row; the trigger
-- sends one NOTIFY (the job's id) when a job somebody waits for ends, whichever
-- path ends it (the completer, a retry that discards, the rescue, a cancel, an
-- operator). Jobs nobody waits for cost one probe of an empty (or small) index
-- at their end and send nothing: NOTIFY serialises committing transactions on
-- one lock, so the engine does not pay for it per job when nobody listens.
--
-- Safe on a live database: a nullable column without a default (a catalogue
-- change only, however big the table), a new table, a function and a trigger.

ALTER TABLE nasiko_queue_jobs ADD COLUMN IF NOT EXISTS result jsonb;

CREATE TABLE IF NOT EXISTS nasiko_queue_result_waits (
    job_id  uuid NOT NULL,
    -- One row per waiting call: several callers may wait for one job.
    waiter  uuid NOT NULL,
    since   timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (job_id, waiter)
);

CREATE OR REPLACE FUNCTION nasiko_queue_result_ready() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    -- The waits end with the job: deleted here, the NOTIFY sent once per job.
    DELETE FROM nasiko_queue_result_waits WHERE job_id = NEW.id;
    IF FOUND THEN
        PERFORM pg_notify('nasiko_queue_results', NEW.id::text);
    END IF;
    RETURN NULL;
END;
$$;

DROP TRIGGER IF EXISTS nasiko_queue_result_ready ON nasiko_queue_jobs;
CREATE TRIGGER nasiko_queue_result_ready AFTER UPDATE OF state ON nasiko_queue_jobs
    FOR EACH ROW
    WHEN (NEW.state IN ('completed', 'discarded', 'cancelled')
          AND OLD.state IS DISTINCT FROM NEW.state)
    EXECUTE FUNCTION nasiko_queue_result_ready();

-- A job deleted while somebody waits for it (retention, an operator's delete):
-- its waiters are woken too, and find no job. Once per statement, not per row:
-- retention deletes many rows at a time.
CREATE OR REPLACE FUNCTION nasiko_queue_result_gone() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    waited uuid;
BEGIN
    FOR waited IN
        WITH d AS (DELETE FROM nasiko_queue_result_waits AS r USING gone
                   WHERE r.job_id = gone.id RETURNING r.job_id)
        SELECT DISTINCT job_id FROM d
    LOOP
        PERFORM pg_notify('nasiko_queue_results', waited::text);
    END LOOP;
    RETURN NULL;
END;
$$;

DROP TRIGGER IF EXISTS nasiko_queue_result_gone ON nasiko_queue_jobs;
CREATE TRIGGER nasiko_queue_result_gone AFTER DELETE ON nasiko_queue_jobs
    REFERENCING OLD TABLE AS gone
    FOR EACH STATEMENT EXECUTE FUNCTION nasiko_queue_result_gone();
