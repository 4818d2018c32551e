-- nasiko-queue 0008: workers are rows; claims name their worker; one leader.
--
-- Each worker process registers a row and heartbeats it every few seconds. A job
-- claimed by a worker whose heartbeat is older than that worker's lease is
-- rescued by the leader (back to pending, or failed when out of attempts) in
-- seconds, instead of waiting for the 60-minute sweep, which stays for rows
-- claimed by replicas that do not heartbeat (the original worker's SQL never
-- sets `claimed_by`).
--
-- Safe on a live table: two new tables, a nullable column with no default on
-- build_jobs (a catalog change; no rewrite, no scan) and a trigger (a brief lock
-- while it is created). No index on claimed_by:
-- a dead worker's jobs are found among the in-progress rows, through
-- build_jobs_work_queue.

CREATE TABLE IF NOT EXISTS nasiko_queue_workers (
    id           uuid PRIMARY KEY,
    host         text NOT NULL,
    pid          integer NOT NULL,
    -- The payload kinds it claims (later: queues).
    kinds        text[] NOT NULL,
    started_at   timestamptz NOT NULL DEFAULT now(),
    heartbeat_at timestamptz NOT NULL DEFAULT now(),
    -- Its own lease, in seconds: a rescuer judges each worker by the lease that
    -- worker was configured with, so replicas with different settings coexist.
    lease_secs   double precision NOT NULL CHECK (lease_secs > 0),
    -- Set when a rescuer declared it dead and gave its jobs back; a dead row is
    -- kept for a while for `status`, then deleted.
    dead_at      timestamptz
);

-- One row per role that exactly one worker may hold at a time (the maintenance
-- leader: rescue, the stuck sweep, pruning). Held while renewed before expiry.
CREATE TABLE IF NOT EXISTS nasiko_queue_leaders (
    role        text PRIMARY KEY,
    worker_id   uuid NOT NULL,
    elected_at  timestamptz NOT NULL DEFAULT now(),
    expires_at  timestamptz NOT NULL
);

ALTER TABLE build_jobs ADD COLUMN IF NOT EXISTS claimed_by uuid;

-- A row that goes back to pending is held by nobody. Our own statements clear
-- claimed_by as they give a job back; the original worker's sweep
-- (status = 'pending', picked_at = NULL) knows no such column, so without this a
-- row it handed on, and its replica claimed again, would still name our worker:
-- that worker's death would have the leader rescue the job from under the
-- original's replica, and while that worker lived no sweep would free the row.
-- The WHEN clause keeps it off every other update: the function only runs for
-- the original's statements.
CREATE OR REPLACE FUNCTION nasiko_queue_unclaim() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    NEW.claimed_by := NULL;
    RETURN NEW;
END;
$$;

DROP TRIGGER IF EXISTS nasiko_queue_unclaim ON build_jobs;
CREATE TRIGGER nasiko_queue_unclaim BEFORE UPDATE ON build_jobs FOR EACH ROW
    WHEN (NEW.status = 'pending' AND NEW.claimed_by IS NOT NULL)
    EXECUTE FUNCTION nasiko_queue_unclaim();
