-- nasiko-queue 0029: a cron schedule remembers the expression and time zone
-- its last tick belongs to.
--
-- A schedule whose expression (or zone) was changed by a deploy used to read
-- the stored last tick, a tick of the old expression, as its last enqueued
-- one: the new expression's latest tick before now was newer, so it counted
-- as missed and `catch_up` enqueued it at once, a run nobody scheduled (a
-- daily 03:00 job changed to every five minutes at 10:02 ran at 10:02 for the
-- 10:00 tick). Catch-up now replays only ticks missed under the same
-- expression: a late tick of a changed expression is recorded, as a new
-- schedule's first tick is, and enqueues nothing; an on-time one is enqueued.
--
-- NULL for rows written before this migration: treated as unchanged (as
-- before), then filled by the next tick.
--
-- Safe on a live database: nullable columns with no default (catalog
-- changes; no rewrite, no scan).

ALTER TABLE nasiko_queue_schedules ADD COLUMN IF NOT EXISTS cron text;
ALTER TABLE nasiko_queue_schedules ADD COLUMN IF NOT EXISTS timezone text;
