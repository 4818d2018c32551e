-- nasiko-queue 0009: every crashed attempt keeps its error.
--
-- build_jobs.error_msg keeps SPEC's fixed messages ('job panicked during
-- execution', ...), which the original's code and dashboards read. What the
-- executor actually raised goes here, one row per crashed or timed-out attempt:
-- when, which worker, the exception's type and message, and a bounded
-- traceback, with the payload's secret values masked.
--
-- No foreign key to build_jobs: a job that fails for good on a never-built
-- target is deleted with it (SPEC's terminalization), and its errors are what is
-- left to inspect. Retention deletes them with the finished jobs' age.

CREATE TABLE IF NOT EXISTS nasiko_queue_job_errors (
    id          bigserial PRIMARY KEY,
    job_id      uuid NOT NULL,
    attempt     integer NOT NULL,
    at          timestamptz NOT NULL DEFAULT now(),
    worker_id   uuid,
    -- 'crash' (the executor raised) or 'timeout' (it ran past its limit).
    reason      text NOT NULL,
    error_type  text NOT NULL,
    message     text NOT NULL,
    traceback   text NOT NULL
);

CREATE INDEX IF NOT EXISTS nasiko_queue_job_errors_job
    ON nasiko_queue_job_errors (job_id, attempt);
CREATE INDEX IF NOT EXISTS nasiko_queue_job_errors_at
    ON nasiko_queue_job_errors (at);
