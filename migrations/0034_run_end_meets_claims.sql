-- nasiko-queue 0034: a run's end reaches a step job whose claim is in flight
-- (issue #45, bug 3).
--
-- A run that ends (cancelled, or failed by a step) stops its unfinished steps
-- (nasiko_queue_wf_stop_steps): a waiting step job is cancelled, a running one
-- asked to stop. A job whose row another transaction holds is skipped, and
-- must stay skipped: the holders of a step job's row wait for its run's row
-- (the completer's finish, which claims in the same statement, and a job's
-- cancel both run the step-finish trigger, which locks the run), and this
-- function runs under that lock; waiting here would be a deadlock. The job
-- skipped was left to "the executor checks its run when it starts", and that
-- check lost the stop of a job whose claim was in flight: the cancel skipped
-- the row, the claim committed, the executor read its run before the cancel
-- committed (an application's transaction still open, say), found it running
-- and ran the whole step; it ended `completed`, never asked to stop.
--
-- So the decision on a job a run's end skipped is taken after its holder
-- commits, by its executor, and that executor now waits for the run's end:
-- the ending transaction takes a transaction-level advisory lock of its run
-- (exclusive) before it skips anything, and a step's executor takes the same
-- lock shared (nasiko_queue_wf_await_run_end, its own statement) before it reads
-- its run. Once the claim has committed, the executor's wait starts; if the end
-- is still in flight it waits for it to commit (or roll back), and its read, a
-- statement after the wait, sees the outcome. Lock, then decide, as a plain
-- job's cancel (0013) does, on the side that can wait: the executor holds no
-- lock while it waits. A step whose run has ended does not run: its executor
-- asks its own job to stop (nasiko_queue_cancel) and it ends `cancelled` at its
-- worker's next heartbeat, as any running step asked to stop.
--
-- The lock is taken only where runs end, never by a transition that goes on:
-- an executor never waits behind a fan-out's transitions, only behind an end of
-- its own run in flight (or of a run whose id hashes alike, one pair in 2^32),
-- for as long as that end's transaction lasts. Uncontended otherwise, the
-- shared lock writes nothing: the executor's cost is one round trip.
--
-- Safe on a live database: CREATE OR REPLACE of 0018's function, same
-- signature, and a new function. A step executor of the code before this one
-- does not wait (the window stays open for it until it is upgraded).

CREATE OR REPLACE FUNCTION nasiko_queue_wf_stop_steps(run uuid) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    s record;
BEGIN
    -- Before any job is skipped: an executor whose claim commits after the
    -- skip below finds this end in flight and waits for it.
    PERFORM pg_advisory_xact_lock(hashtext('nasiko_queue.run_end'), hashtext(run::text));
    FOR s IN
        UPDATE nasiko_queue_workflow_steps SET state = 'cancelled'
        WHERE run_id = run AND state IN ('blocked', 'enqueued', 'waiting')
        RETURNING job_id, child_run
    LOOP
        IF s.job_id IS NOT NULL THEN
            -- Held by another transaction (a claim, an end, a cancel of the job):
            -- not waited for (see above). Whatever it leaves is decided after it
            -- commits: an end finds the run ended and changes nothing, a job
            -- running or available again meets the executor's wait.
            PERFORM 1 FROM nasiko_queue_jobs WHERE id = s.job_id FOR UPDATE SKIP LOCKED;
            IF FOUND THEN
                PERFORM nasiko_queue_cancel(s.job_id);
            END IF;
        END IF;
        IF s.child_run IS NOT NULL THEN
            PERFORM nasiko_queue_workflow_cancel(s.child_run);
        END IF;
    END LOOP;
END;
$$;

-- Return once no end of run `run` is in flight (nasiko_queue_wf_stop_steps's
-- lock, taken shared and released when the caller's statement ends). A step's
-- executor calls it, in a statement of its own, before it reads its run: the
-- read's snapshot, taken after, sees the end that was in flight.
CREATE OR REPLACE FUNCTION nasiko_queue_wf_await_run_end(run uuid) RETURNS void
LANGUAGE sql VOLATILE AS $$
    SELECT pg_advisory_xact_lock_shared(hashtext('nasiko_queue.run_end'), hashtext(run::text))
$$;
