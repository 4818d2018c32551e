-- nasiko-queue 0012: paused queues of plain jobs (issue #12, the dashboard).
--
-- A queue named here is paused: the plain-job claims (`plain_claim`,
-- `plain_finish_many_and_claim`) take nothing from it until its row is deleted
-- (resumed). Finishing jobs already running is not affected. One primary-key
-- probe per claim. Build jobs ("builds") are not pausable: the original's
-- worker claims from build_jobs with its own SQL, which would not look here.
--
-- Safe on a live database: a new table only.

CREATE TABLE IF NOT EXISTS nasiko_queue_paused_queues (
    queue     text PRIMARY KEY,
    paused_at timestamptz NOT NULL DEFAULT now()
);
