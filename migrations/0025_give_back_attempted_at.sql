-- nasiko-queue 0025: a plain claim given back restores attempted_at (issue #25).
--
-- A claim that never reached an executor is given back: look-ahead past its TTL
-- or at a stop, a claim whose answer was lost. The give-back restores the
-- attempt the claim counted, so the job reads as if the claim never happened;
-- attempted_at ("when its last attempt was claimed") must read so too. The
-- claim overwrote it, and nothing kept the value it replaced: a fresh job given
-- back showed an attempt time at attempt 0, and a retried one the time of a
-- claim that never ran instead of its crashed attempt's, so that its row said
-- its backoff was over before it was claimed.
--
-- The claim now keeps the value it replaces in previous_attempted_at (read only
-- while the job is running; the row is written by the claim anyway, and the
-- column adds 8 bytes to it), and each give-back puts it back. Build jobs need
-- nothing: their give-back clears picked_at, as the original's pending rows have
-- it. Adding a nullable column with no default rewrites nothing; the ALTER takes
-- its lock for a moment.

ALTER TABLE nasiko_queue_jobs ADD COLUMN IF NOT EXISTS previous_attempted_at timestamptz;
