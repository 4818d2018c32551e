-- nasiko-queue 0010: plain jobs, in named queues, with priorities, schedules,
-- retries with backoff, unique keys and cancellation; and cron schedules.
--
-- A table of their own, not new rows in build_jobs: the original worker's claim
-- takes every pending build_jobs row, oldest first, whatever its kind and
-- whatever any column of ours says. A job scheduled for tomorrow, or of a kind
-- it has no code for, would be taken and failed by its replica. Here it never
-- sees them, and build_jobs keeps exactly the original's rules.
--
-- States:
--   available   waiting; claimable once run_at has come (before: "scheduled")
--   running     claimed by worker claimed_by, attempt counted
--   completed   its executor returned
--   discarded   failed for good (out of attempts, or its payload is not one):
--               the dead-letter queue; errors in nasiko_queue_job_errors
--   cancelled   cancelled while waiting, or stopped at the cancel's request
--
-- Safe on a live database: new tables only.

CREATE TABLE IF NOT EXISTS nasiko_queue_jobs (
    id               uuid PRIMARY KEY,
    queue            text NOT NULL CHECK (queue <> '' AND length(queue) <= 128),
    kind             text NOT NULL,
    payload          jsonb NOT NULL,
    state            text NOT NULL DEFAULT 'available'
                     CHECK (state IN ('available', 'running', 'completed', 'discarded',
                                      'cancelled')),
    -- Lower runs first; ties by run_at, then id.
    priority         smallint NOT NULL DEFAULT 0,
    attempt          integer NOT NULL DEFAULT 0,
    max_attempts     integer NOT NULL CHECK (max_attempts >= 1),
    run_at           timestamptz NOT NULL DEFAULT now(),
    created_at       timestamptz NOT NULL DEFAULT now(),
    attempted_at     timestamptz,
    finished_at      timestamptz,
    -- The worker that holds it while running, and the claim that took it (as in
    -- build_jobs: a lost claim is found and undone by its token).
    claimed_by       uuid,
    claim_token      uuid,
    -- Asked to stop while running; the worker that holds it sees the flag at its
    -- next heartbeat, cancels the executor and ends the job `cancelled`.
    cancel_requested boolean NOT NULL DEFAULT false,
    -- The last attempt's error, one line ('max attempts exceeded', the
    -- exception's type and message); every attempt's is in nasiko_queue_job_errors.
    error_msg        text,
    -- At most one job per key among the rows whose state is one of their own
    -- unique_states: a second enqueue is a no-op that returns the first's id.
    unique_key       text,
    unique_states    text[]
);

-- The claim: one index scan per queue, in priority order, however many jobs of
-- other queues are waiting and however long the history.
CREATE INDEX IF NOT EXISTS nasiko_queue_jobs_claim
    ON nasiko_queue_jobs (queue, priority, run_at, id) WHERE state = 'available';
-- When the next scheduled job of a queue is due (the worker wakes for it).
CREATE INDEX IF NOT EXISTS nasiko_queue_jobs_due
    ON nasiko_queue_jobs (queue, run_at) WHERE state = 'available';
-- A dead worker's jobs, and the cancels a worker must act on.
CREATE INDEX IF NOT EXISTS nasiko_queue_jobs_running
    ON nasiko_queue_jobs (claimed_by) WHERE state = 'running';
-- Retention and the dead-letter queue's listing, by when they ended.
CREATE INDEX IF NOT EXISTS nasiko_queue_jobs_finished
    ON nasiko_queue_jobs (finished_at) WHERE state IN ('completed', 'discarded', 'cancelled');
CREATE UNIQUE INDEX IF NOT EXISTS nasiko_queue_jobs_unique
    ON nasiko_queue_jobs (unique_key)
    WHERE unique_key IS NOT NULL AND state = ANY (unique_states);

ALTER TABLE nasiko_queue_jobs SET (
    autovacuum_vacuum_scale_factor = 0.01,
    autovacuum_analyze_scale_factor = 0.02
);

-- Build jobs that failed for good and were then deleted with their target (SPEC's
-- terminalization deletes a never-built agent, and the cascade takes its jobs):
-- a copy that nothing cascades to, so that the dead-letter queue can still show
-- them. Written by a trigger, so that deletes by the original's SQL are kept too;
-- retention's own deletes set nasiko_queue.pruning and are not copied.
CREATE TABLE IF NOT EXISTS nasiko_queue_deleted_build_jobs (
    id           uuid PRIMARY KEY,
    agent_id     uuid,
    connector_id uuid,
    owner_id     uuid NOT NULL,
    payload      jsonb NOT NULL,
    attempt      integer NOT NULL,
    error_msg    text,
    created_at   timestamptz NOT NULL,
    picked_at    timestamptz,
    completed_at timestamptz,
    deleted_at   timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX IF NOT EXISTS nasiko_queue_deleted_build_jobs_at
    ON nasiko_queue_deleted_build_jobs (deleted_at);

CREATE OR REPLACE FUNCTION nasiko_queue_keep_failed_build_job() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF coalesce(current_setting('nasiko_queue.pruning', true), '') <> 'on' THEN
        INSERT INTO nasiko_queue_deleted_build_jobs
            (id, agent_id, connector_id, owner_id, payload, attempt, error_msg,
             created_at, picked_at, completed_at)
        VALUES (OLD.id, OLD.agent_id, OLD.connector_id, OLD.owner_id, OLD.payload,
                OLD.attempt, OLD.error_msg, OLD.created_at, OLD.picked_at, OLD.completed_at)
        ON CONFLICT (id) DO NOTHING;
    END IF;
    RETURN OLD;
END;
$$;

DROP TRIGGER IF EXISTS nasiko_queue_keep_failed_build_job ON build_jobs;
CREATE TRIGGER nasiko_queue_keep_failed_build_job BEFORE DELETE ON build_jobs FOR EACH ROW
    WHEN (OLD.status = 'failed')
    EXECUTE FUNCTION nasiko_queue_keep_failed_build_job();

-- Cron schedules: the last tick each schedule enqueued. A tick is enqueued by
-- the one transaction that moves last_tick forward to it, so each tick is
-- enqueued once however many replicas run the scheduler.
CREATE TABLE IF NOT EXISTS nasiko_queue_schedules (
    name        text PRIMARY KEY,
    last_tick   timestamptz NOT NULL,
    updated_at  timestamptz NOT NULL DEFAULT now()
);
