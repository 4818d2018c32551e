--! no-transaction
-- nasiko-queue 0011: find pending build jobs by kind.
--
-- A replica that runs only some of the build kinds (its executors) claimed by
-- scanning every pending row in age order and skipping the kinds it does not run:
-- 100,000 pending jobs of another kind made each of its claims take 68 ms instead
-- of 2. With this index its claim (`job_claim_kinds`) reads the oldest pending
-- rows of each kind it runs, and finds the kinds no payload type knows (which it
-- claims to fail as invalid) with one probe per kind present (a payload with no kind counts as the kind '').
--
-- Built CONCURRENTLY, outside a transaction, like 0007: workers keep claiming
-- while it builds; a failed build leaves an invalid index that the next
-- `migrate` drops and builds again. The original worker's SQL neither needs nor
-- notices it.

DROP INDEX CONCURRENTLY IF EXISTS build_jobs_pending_kind;

CREATE INDEX CONCURRENTLY build_jobs_pending_kind
    ON build_jobs ((coalesce(payload ->> 'kind', '')), created_at)
    WHERE status = 'pending';
