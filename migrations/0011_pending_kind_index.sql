--! no-transaction
-- nasiko-queue 0011: find pending build jobs by kind.
--
-- A replica that runs only some of the build kinds (its executors) claimed by
-- scanning every pending row in age order and skipping the kinds it does not run:
-- 100,000 pending jobs of another kind made each of its claims take 68 ms instead
-- of 2. With this index its claim (`job_claim_kinds`) reads the oldest pending
-- rows of each kind it runs, and finds the kinds no payload type knows (which it
-- claims to fail as invalid) with one probe per kind present (a payload with
-- no kind counts as the kind '').
--
-- The kind is indexed by its first 100 characters: an index entry must stay
-- under PostgreSQL's 8 kB, and a row another writer stores with an enormous
-- "kind" (which fails as invalid) must still be insertable. A payload type's
-- kind is at most 100 characters (refused at registration), so the truncation
-- only ever merges unknown kinds.
--
-- Built CONCURRENTLY, outside a transaction, like 0007: workers keep claiming
-- while it builds; a failed build leaves an invalid index that the next
-- `migrate` drops and builds again. The original worker's SQL neither needs nor
-- notices it.

DROP INDEX CONCURRENTLY IF EXISTS build_jobs_pending_kind;

CREATE INDEX CONCURRENTLY build_jobs_pending_kind
    ON build_jobs ((left(coalesce(payload ->> 'kind', ''), 100)), created_at)
    WHERE status = 'pending';
