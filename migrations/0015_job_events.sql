-- nasiko-queue 0015: the operator actions of a job's timeline (issue #21).
--
-- One row per action an operator took on a job (retried, cancelled, discarded,
-- run now), and who took it ("dashboard", "cli", "api"). Written by the admin
-- API (nasiko_queue.admin.jobs) in the action's own transaction, shown on the
-- dashboard's job page among the job's own times. Not a foreign key: a
-- discarded job's row is deleted, its discard is kept (and pruned with the
-- job errors' retention, by `at`).
--
-- Safe on a live database: a new table only.

CREATE TABLE IF NOT EXISTS nasiko_queue_job_events (
    id      bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    job_id  uuid NOT NULL,
    at      timestamptz NOT NULL DEFAULT now(),
    action  text NOT NULL,
    actor   text NOT NULL,
    detail  text
);

CREATE INDEX IF NOT EXISTS nasiko_queue_job_events_job
    ON nasiko_queue_job_events (job_id, at);
-- Retention deletes the oldest first.
CREATE INDEX IF NOT EXISTS nasiko_queue_job_events_at
    ON nasiko_queue_job_events (at);
