-- nasiko-queue 0014: the queues a worker serves, and paused schedules (issue #21).
--
-- `queues` maps each queue the worker runs to its concurrency there, e.g.
-- {"builds": 4, "emails": 2} ("builds" for the build jobs' lane). The dashboard,
-- `status` and `/metrics` use it to warn about a queue that holds waiting jobs
-- but that no live worker serves (a job enqueued there would wait for ever).
-- NULL for a row registered by an older version, which did not say: such a
-- worker is assumed to serve every queue (no false alarm during an upgrade).
--
-- Safe on a live database: a nullable column with no default (a catalog change;
-- no rewrite, no scan).

ALTER TABLE nasiko_queue_workers ADD COLUMN IF NOT EXISTS queues jsonb;

-- A paused cron schedule (the dashboard's pause): its ticks are moved over as
-- usual but enqueue nothing until it is resumed (paused_at NULL).
ALTER TABLE nasiko_queue_schedules ADD COLUMN IF NOT EXISTS paused_at timestamptz;
