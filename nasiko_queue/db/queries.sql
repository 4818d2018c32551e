-- Every statement nasiko-queue sends, in one place.
--
-- Each block starts with `-- name: <table>_<verb>` and a line saying what it is
-- for. `statements.py` loads this file once and checks that it holds exactly the names
-- the code uses. Constants (MAX_ATTEMPTS, STUCK_JOB_MINS, the fixed error strings)
-- are bound as parameters from config.py/builds/store.py, never spelled out here.

-- name: job_insert
-- Enqueue: a pending job with attempt 0; everything else keeps its default.
INSERT INTO build_jobs (agent_id, connector_id, owner_id, payload)
VALUES ($1, $2, $3, $4::jsonb)
RETURNING id;

-- name: job_claim
-- Take up to $1 of the oldest pending jobs whose kind this worker runs ($2), or
-- whose kind no payload type knows ($3 = every known kind; those fail as
-- invalid), and mark them with this claim's token ($5), so that a claim whose
-- answer is lost can be found and undone (`jobs_unclaim_lost`), and with the
-- worker that holds them ($6; NULL for a tool that heartbeats no worker row), so
-- that a dead worker's jobs are rescued in seconds (`jobs_rescue`). Returns the
-- attempt from before the increment, and whether the target agent is
-- soft-deleted, so that no second round trip is needed. A payload larger than
-- $4 bytes (written by another writer: enqueue refuses them) comes back NULL,
-- to fail as invalid without being sent or parsed.
UPDATE build_jobs AS j
SET status = 'in_progress', picked_at = now(), attempt = j.attempt + 1, claim_token = $5,
    claimed_by = $6
-- The ids as an array, not a join: every plan of this statement, generic ones
-- included (where the planner guesses LIMIT $1 at a tenth of the table), then
-- fetches the claimed rows by primary key instead of hashing a scan of the table.
WHERE j.id = ANY (ARRAY(
    SELECT id
    FROM build_jobs
    WHERE status = 'pending'
      AND (payload ->> 'kind' = ANY ($2::text[])
           OR NOT coalesce(payload ->> 'kind' = ANY ($3::text[]), false))
    ORDER BY created_at
    LIMIT $1
    FOR UPDATE SKIP LOCKED))
RETURNING j.id, j.agent_id, j.connector_id, j.owner_id,
          CASE WHEN octet_length(j.payload::text) <= $4 THEN j.payload::text END AS payload,
          j.attempt - 1 AS old_attempt, j.created_at,
          -- A scalar subquery, so one primary-key probe per claimed row: the
          -- EXISTS form was planned as a hashed subplan scanning every agent.
          coalesce((SELECT a.deleted_at IS NOT NULL FROM agents AS a WHERE a.id = j.agent_id),
                   false) AS target_soft_deleted;

-- name: job_claim_kinds
-- `job_claim` for a replica that runs only some of the known kinds (the same
-- arguments, the same result): through build_jobs_pending_kind (0011), the
-- oldest pending rows of each kind it runs ($2) and of each kind present that no
-- payload type knows (not in $3, found by a loose index scan: one probe per kind
-- present; a payload with no kind counts as the unknown kind '', and a kind is
-- its first 100 characters, which keeps the index's entries small), each taken with
-- SKIP LOCKED, then the oldest $1 of those (the others are unlocked as the
-- statement ends). Its cost follows the kinds this replica runs, not the backlog
-- of the kinds it leaves to others. A replica that runs every known kind uses
-- `job_claim`, whose one ordered scan is cheapest when every row is its own.
UPDATE build_jobs AS j
SET status = 'in_progress', picked_at = now(), attempt = j.attempt + 1, claim_token = $5,
    claimed_by = $6
WHERE j.id = ANY (ARRAY(
    WITH RECURSIVE present AS (
        (SELECT left(coalesce(payload ->> 'kind', ''), 100) AS kind FROM build_jobs
         WHERE status = 'pending'
         ORDER BY left(coalesce(payload ->> 'kind', ''), 100) LIMIT 1)
        UNION ALL
        SELECT (SELECT left(coalesce(b.payload ->> 'kind', ''), 100) FROM build_jobs AS b
                WHERE b.status = 'pending' AND left(coalesce(b.payload ->> 'kind', ''), 100) > present.kind
                ORDER BY left(coalesce(b.payload ->> 'kind', ''), 100) LIMIT 1)
        FROM present WHERE present.kind IS NOT NULL
    ), wanted AS (
        SELECT k.kind FROM unnest($2::text[]) AS k(kind)
        UNION
        SELECT kind FROM present WHERE kind IS NOT NULL AND NOT kind = ANY ($3::text[])
    )
    SELECT p.id
    FROM wanted CROSS JOIN LATERAL (
        SELECT id, created_at FROM build_jobs
        WHERE status = 'pending' AND left(coalesce(payload ->> 'kind', ''), 100) = wanted.kind
        ORDER BY created_at LIMIT $1
        FOR UPDATE SKIP LOCKED) AS p
    ORDER BY p.created_at
    LIMIT $1))
RETURNING j.id, j.agent_id, j.connector_id, j.owner_id,
          CASE WHEN octet_length(j.payload::text) <= $4 THEN j.payload::text END AS payload,
          j.attempt - 1 AS old_attempt, j.created_at,
          coalesce((SELECT a.deleted_at IS NOT NULL FROM agents AS a WHERE a.id = j.agent_id),
                   false) AS target_soft_deleted;

-- name: job_fail
-- Fail a claimed job with a fixed message (completed_at = now(), picked_at keeps
-- the claim time). Only the claim that is still current is touched ($1 id, $2
-- attempt, $6 the claim's token: the worker's own, or the one the sweep or the
-- rescue read with the row, NULL for a claim of the original's SQL that found
-- none; see jobs_finish_many_and_claim for why both); the sweep passes $4, the
-- stuck threshold in minutes, and the rescue $5, the dead worker, so that a job
-- finished or handed on since it was chosen is left alone. Returns the target
-- and, for the job's own build row, the payload's build ids as text: read by
-- PostgreSQL, so a payload Python cannot parse still names its build.
UPDATE build_jobs
SET status = 'failed', error_msg = $3, completed_at = now()
WHERE id = $1 AND status = 'in_progress' AND attempt = $2
  AND claim_token IS NOT DISTINCT FROM $6::uuid
  AND ($4::int IS NULL OR picked_at < now() - make_interval(mins => $4))
  AND ($5::uuid IS NULL OR claimed_by = $5)
RETURNING agent_id, connector_id, payload ->> 'kind' AS kind,
          payload ->> 'build_id' AS build_id, payload ->> 'rollback_build_id' AS rollback_build_id;

-- name: agent_lock
-- Lock order, step 1 of every transaction that may terminalize a target: the
-- target first, then the job row, then its builds. Two replicas failing two jobs
-- of one agent then queue on the agent instead of deadlocking (the agent's delete
-- cascades to the other job's row). No row: the agent, and so the job, is gone.
SELECT id FROM agents WHERE id = $1 FOR UPDATE;

-- name: connector_lock
-- As `agent_lock`, for a connector.
SELECT id FROM mcp_connectors WHERE id = $1 FOR UPDATE;

-- name: recovery_lock_wait
-- For the rest of a recovery's transaction (the sweep's or the rescue's failing
-- of one exhausted job): wait $1 (an interval's text) at most for a lock. An
-- application transaction holding the job's target row makes that one job
-- wait for the next round (lock_not_available is transient), instead of the
-- round waiting out the statement's time-out and ending before its other
-- steps.
SELECT set_config('lock_timeout', $1, true);

-- name: search_statement_timeout
-- For the rest of a dashboard search's transaction: each statement runs $1 (an
-- interval's text) at most. A search by arguments alone tests every job's
-- payload, and anyone who may read the dashboard may ask for one.
SELECT set_config('statement_timeout', $1, true);

-- name: job_reset_to_pending
-- Put a claimed job back at the front of the queue: after a panic with attempts
-- left, or when a hard stop or the fence cancels its executor. The attempt stays
-- counted. Only the claim ($1 id, $2 attempt, $4 token) that is still current
-- (see jobs_finish_many_and_claim). NOTIFYs channel $3 (when not NULL) if the
-- job went back, so that another replica takes it at once instead of at its
-- next poll.
WITH reset AS (
    UPDATE build_jobs
    SET status = 'pending', picked_at = NULL, claim_token = NULL, claimed_by = NULL
    WHERE id = $1 AND status = 'in_progress' AND attempt = $2 AND claim_token = $4
    RETURNING id
)
SELECT id, CASE WHEN $3::text IS NOT NULL THEN pg_notify($3, '') END AS notified FROM reset;

-- name: jobs_stuck_exhausted
-- Recovery 1, the choice: up to $4 jobs stuck past the threshold ($1 minutes)
-- with no attempts left ($2 = MAX_ATTEMPTS), leaving out $3 (jobs this sweep
-- already tried). Each is then failed in a transaction of its own (`job_fail`
-- with the threshold), so one job's target can never hold back the others'.
-- The 60-minute rule is for rows no live worker holds: those of replicas that
-- do not heartbeat (the original's SQL sets no `claimed_by`); a heartbeating
-- worker's jobs run as long as it lives, and are rescued when it dies.
SELECT id, attempt, claim_token, agent_id, connector_id
FROM build_jobs AS j
WHERE status = 'in_progress'
  AND picked_at < now() - make_interval(mins => $1)
  AND attempt >= $2
  AND NOT (id = ANY ($3::uuid[]))
  AND NOT EXISTS (SELECT 1 FROM nasiko_queue_workers AS w
                  WHERE w.id = j.claimed_by AND w.dead_at IS NULL)
ORDER BY picked_at, id
LIMIT $4;

-- name: jobs_reset_stuck
-- Recovery 2: stuck past the threshold with attempts left: back to pending, and
-- a NOTIFY on $3 (when not NULL) if any went back. Rows another session holds
-- (a worker finishing the job) are skipped.
WITH stuck AS (
    SELECT id
    FROM build_jobs AS b
    WHERE status = 'in_progress'
      AND picked_at < now() - make_interval(mins => $1)
      AND attempt < $2
      AND NOT EXISTS (SELECT 1 FROM nasiko_queue_workers AS w  -- as in jobs_stuck_exhausted
                      WHERE w.id = b.claimed_by AND w.dead_at IS NULL)
    ORDER BY id
    FOR UPDATE SKIP LOCKED
), reset AS (
    UPDATE build_jobs AS j
    SET status = 'pending', picked_at = NULL, claim_token = NULL, claimed_by = NULL
    FROM stuck
    WHERE j.id = stuck.id
    RETURNING j.id
)
SELECT count(*) AS reset,
       CASE WHEN count(*) > 0 AND $3::text IS NOT NULL THEN pg_notify($3, '') END AS notified
FROM reset;

-- name: agent_builds_fail_unfinished
-- Terminalize an agent, step 1: its builds in 'building', and this job's own
-- build ($2, may be NULL) if it is still 'queued', become 'failed'.
UPDATE agent_builds
SET status = 'failed'
WHERE agent_id = $1 AND (status = 'building' OR (id = $2 AND status = 'queued'));

-- name: agent_build_fail_own
-- A job that will never run (its agent is soft-deleted): its own build row ends.
UPDATE agent_builds
SET status = 'failed'
WHERE id = $1 AND status IN ('queued', 'building');

-- name: agent_has_success
-- Terminalize an agent, step 2: has it ever been built successfully?
SELECT EXISTS (SELECT 1 FROM agent_builds WHERE agent_id = $1 AND status = 'success');

-- name: agent_mark_failed
-- Terminalize an agent that has a working build: only a deploying agent fails.
UPDATE agents SET status = 'failed' WHERE id = $1 AND status = 'deploying';

-- name: agent_delete
-- Terminalize an agent that never built: delete it (cascades to builds and jobs).
DELETE FROM agents WHERE id = $1;

-- name: connector_builds_fail_unfinished
-- Terminalize a connector, step 1: its pending and building builds fail.
UPDATE mcp_connector_builds
SET status = 'failed', completed_at = now()
WHERE connector_id = $1 AND status IN ('pending', 'building');

-- name: connector_has_success
-- Terminalize a connector, step 2: has it ever been built successfully?
SELECT EXISTS (SELECT 1 FROM mcp_connector_builds WHERE connector_id = $1 AND status = 'success');

-- name: connector_mark_failed
-- Terminalize a connector that has a working build: only if still pending/building.
UPDATE mcp_connectors SET build_status = 'failed'
WHERE id = $1 AND build_status IN ('pending', 'building');

-- name: connector_delete
-- Terminalize a connector that never built: delete it (cascades to builds and jobs).
DELETE FROM mcp_connectors WHERE id = $1;

-- name: jobs_count_by_status
-- `status`: how many jobs are in each state.
SELECT status, count(*) AS n FROM build_jobs GROUP BY status ORDER BY status;

-- name: jobs_in_progress_summary
-- `status`: jobs held right now, the oldest claim, and how many are past the
-- stuck threshold ($1 minutes), i.e. waiting for the sweep.
SELECT count(*) AS held,
       min(picked_at) AS oldest_picked_at,
       count(*) FILTER (WHERE picked_at < now() - make_interval(mins => $1)) AS stuck
FROM build_jobs
WHERE status = 'in_progress';

-- name: jobs_oldest_pending_age
-- `status`: seconds the oldest pending job has waited (NULL when none waits).
SELECT extract(epoch FROM now() - min(created_at))::float8 FROM build_jobs WHERE status = 'pending';

-- name: migrations_lock
-- Serialize migrators across replicas for the whole run (session lock). Tried,
-- not waited for: a migrator waiting inside pg_advisory_lock holds a snapshot,
-- and the holder's CREATE INDEX CONCURRENTLY waits for every older snapshot to
-- go, so the two would deadlock. The caller retries with a pause in between.
SELECT pg_try_advisory_lock(hashtext('nasiko_queue.migrate'));

-- name: migrations_unlock
SELECT pg_advisory_unlock(hashtext('nasiko_queue.migrate'));

-- name: session_schema_append
-- Every connection of the queue's own: its schema $1 goes last on the session's
-- search path, after what the DSN or the server set (`nasiko_queue.db.schema`).
SELECT set_config('search_path',
                  CASE WHEN current_setting('search_path') IN ('', '""') THEN quote_ident($1)
                       ELSE current_setting('search_path') || ', ' || quote_ident($1) END,
                  false);

-- name: migrations_search_path
-- The migrator's session search path, to run each file with and to restore.
SELECT current_setting('search_path');

-- name: migrations_set_search_path
SELECT set_config('search_path', $1, false);

-- name: migrations_set_schema
-- Names the queue's schema $1 for this session: migration 0038 and
-- `migrations_schema_create` read it (a DO block takes no parameters).
SELECT set_config('nasiko_queue.schema', $1, false);

-- name: migrations_schema_create
DO $$
BEGIN
    EXECUTE format('CREATE SCHEMA IF NOT EXISTS %I', current_setting('nasiko_queue.schema'));
END
$$;

-- name: migrations_legacy_schema
-- Another schema than $1 (the queue's) that holds a bookkeeping table of the
-- queue: where a database migrated before the queue had a schema of its own
-- keeps the queue's tables, or (moved: it records 0038) where the queue lives
-- under another name. Each with whether it records 0038, read by dynamic SQL
-- (query_to_xml) since the schema is a value here. No row: none.
SELECT n.nspname::text AS schema,
       (xpath('/row/n/text()', query_to_xml(format(
           'SELECT count(*) AS n FROM %I.nasiko_queue_migrations WHERE version = %L',
           n.nspname, '0038'), false, true, '')))[1]::text::int > 0 AS moved
FROM pg_class AS c
JOIN pg_namespace AS n ON n.oid = c.relnamespace
WHERE c.relname = 'nasiko_queue_migrations' AND c.relkind = 'r' AND n.nspname <> $1
ORDER BY n.nspname;

-- name: migrations_functions_unpathed
-- ALTER statements that give each function of schema $1 the search path $2,
-- where it has none: run after every file, so a function that a migration
-- (re)created finds the queue's tables from any session: an application's
-- connection calling nasiko_queue_enqueue, the original's Rust worker deleting
-- a build job (a trigger). Not the SQL helpers declared STABLE or IMMUTABLE:
-- they are called only by the queue's own statements and by functions that
-- carry the path, and a SET clause would stop PostgreSQL inlining those it can
-- inline (and cost a setting's switch on each call).
SELECT format('ALTER FUNCTION %s SET search_path = %s', p.oid::regprocedure, $2::text)
FROM pg_proc AS p
JOIN pg_namespace AS n ON n.oid = p.pronamespace
JOIN pg_language AS l ON l.oid = p.prolang
WHERE n.nspname = $1 AND p.prokind = 'f'
  AND NOT (l.lanname = 'sql' AND p.provolatile IN ('i', 's'))
  AND NOT EXISTS (SELECT 1 FROM unnest(p.proconfig) AS c(setting)
                  WHERE c.setting LIKE 'search\_path=%')
ORDER BY p.oid;

-- name: build_tables_schemas
-- The schemas the search path finds the build port's tables in: a worker of
-- build jobs needs them all in one (`nasiko_queue.db.adopt`).
SELECT t.name AS table_name, n.nspname::text AS schema
FROM unnest(ARRAY['agents', 'agent_builds', 'build_jobs', 'mcp_connectors',
                  'mcp_connector_builds']) AS t(name)
JOIN pg_class AS c ON c.oid = to_regclass(quote_ident(t.name))
JOIN pg_namespace AS n ON n.oid = c.relnamespace
ORDER BY t.name;

-- name: migrations_create_table
CREATE TABLE IF NOT EXISTS nasiko_queue_migrations (
    version    text PRIMARY KEY,
    name       text NOT NULL,
    checksum   text NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now()
);

-- name: migrations_applied
SELECT version, name, checksum FROM nasiko_queue_migrations ORDER BY version;

-- name: migrations_record
INSERT INTO nasiko_queue_migrations (version, name, checksum) VALUES ($1, $2, $3);

-- name: migrations_updated_at_function
-- The trigger function of migration 0001, made also where 0001 is adopted (the
-- application's tables are there): 0003 and later files use it.
CREATE OR REPLACE FUNCTION nasiko_set_updated_at() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    NEW.updated_at := now();
    RETURN NEW;
END;
$$;

-- name: migrations_tables_present
-- Which of the tables $1 exist, as the session's search path resolves them
-- (`nasiko_queue.db.adopt`: the application's tables a migration may adopt).
SELECT t.name AS table_name
FROM unnest($1::text[]) AS t(name)
WHERE to_regclass(quote_ident(t.name)) IS NOT NULL;

-- name: migrations_table_columns
-- The live columns of each existing table of $1.
SELECT t.name AS table_name, a.attname::text AS column_name
FROM unnest($1::text[]) AS t(name)
JOIN pg_attribute AS a
  ON a.attrelid = to_regclass(quote_ident(t.name)) AND a.attnum > 0 AND NOT a.attisdropped;

-- name: migrations_types_present
-- Which of the types $1 exist, as the search path resolves them.
SELECT t.name AS type_name
FROM unnest($1::text[]) AS t(name)
WHERE to_regtype(quote_ident(t.name)) IS NOT NULL;

-- The statements below are what the application around the queue writes (the
-- original's HTTP handlers and executors). The library uses them only in
-- `nasiko_queue.testing` and the demo, which play the application's part.

-- name: demo_plain_unfinished
-- The demo's refusal of a busy database: plain jobs waiting or running in the
-- queues ($1) its own worker would run.
SELECT count(*) FROM nasiko_queue_jobs
WHERE state IN ('available', 'running') AND queue = ANY($1::text[]);

-- name: agent_insert
-- An agent as the upload enqueue point creates it ($4: status, 'deploying').
INSERT INTO agents (owner_id, name, status, deleted_at)
VALUES ($1, $2, $3, CASE WHEN $4::boolean THEN now() END)
RETURNING id;

-- name: agent_build_insert
-- A build row for an agent ($3: status, 'queued' for a new one).
INSERT INTO agent_builds (agent_id, version_tag, image_reference, status)
VALUES ($1, $2, $2 || '-image', $3::build_status)
RETURNING id;

-- name: connector_insert
-- An uploaded MCP connector waiting for its first build.
INSERT INTO mcp_connectors (owner_id, name, build_status, is_active)
VALUES ($1, $2, 'pending', false)
RETURNING id;

-- name: connector_build_insert
INSERT INTO mcp_connector_builds (connector_id, owner_id, version_tag, status)
VALUES ($1, $2, $3, $4)
RETURNING id;

-- name: agent_build_set_status
-- An executor reports on its agent build.
UPDATE agent_builds SET status = $2::build_status WHERE id = $1;

-- name: connector_build_set_status
-- An executor reports on its connector build.
UPDATE mcp_connector_builds
SET status = $2, completed_at = CASE WHEN $2 IN ('success', 'failed') THEN now() END
WHERE id = $1;

-- name: agent_set_status
UPDATE agents SET status = $2 WHERE id = $1;

-- name: connector_set_build_status
-- 'running' needs a url (chk_connectors_running_has_url); $3 may be NULL otherwise.
UPDATE mcp_connectors SET build_status = $2, url = coalesce($3, url), is_active = ($2 = 'running')
WHERE id = $1;

-- name: agent_soft_delete
UPDATE agents SET deleted_at = now() WHERE id = $1;

-- The statements below read back what happened, for `nasiko_queue.demo` (its
-- report) and for tests; `job_set_attempt` stages a job that has already run.

-- name: job_get
-- One job as a person debugging it wants to see it (NULL when the row is gone).
SELECT status, attempt, error_msg, payload::text AS payload FROM build_jobs WHERE id = $1;

-- name: job_set_attempt
-- Stage a job that has already run $2 times (the demo's attempt-cap scenario).
UPDATE build_jobs SET attempt = $2 WHERE id = $1;

-- name: jobs_count_unfinished
-- How many of the given jobs ($1) are still pending or in progress; a job whose
-- row is gone (its target was deleted) counts as finished.
SELECT count(*) FROM build_jobs
WHERE id = ANY ($1::uuid[]) AND status IN ('pending', 'in_progress');

-- name: agent_get
SELECT status, deleted_at IS NOT NULL AS soft_deleted FROM agents WHERE id = $1;

-- name: agent_build_get_status
SELECT status::text FROM agent_builds WHERE id = $1;

-- name: connector_get
SELECT build_status, url FROM mcp_connectors WHERE id = $1;

-- name: connector_build_get_status
SELECT status FROM mcp_connector_builds WHERE id = $1;

-- The statements below serve `nasiko_queue.testing`: the state machine reads
-- the whole queue after every step and compares it with its model.

-- name: snapshot_build_world
-- Every row a build machine compares with its model, in one statement (one
-- snapshot, one round trip: the machines read it after every step, and six
-- statements took a tenth of their time). `part` says which table a row is of;
-- the other columns are those that part uses, NULL elsewhere.
SELECT 'job' AS part, id, status::text AS status, attempt, error_msg,
       picked_at IS NOT NULL AS picked, completed_at IS NOT NULL AS completed,
       claimed_by, NULL::uuid AS target_id, NULL::boolean AS soft_deleted
FROM build_jobs
UNION ALL
SELECT 'agent', id, status::text, NULL, NULL, NULL, NULL, NULL, NULL,
       deleted_at IS NOT NULL
FROM agents
UNION ALL
SELECT 'connector', id, coalesce(build_status::text, 'null'), NULL, NULL, NULL, NULL,
       NULL, NULL, false
FROM mcp_connectors
UNION ALL
SELECT 'agent_build', id, status::text, NULL, NULL, NULL, NULL, NULL, agent_id, NULL
FROM agent_builds
UNION ALL
SELECT 'connector_build', id, status::text, NULL, NULL, NULL, NULL, NULL, connector_id,
       NULL
FROM mcp_connector_builds;

-- name: testing_empty_build_jobs
-- Start a state-machine example from an empty queue, part 1: the build jobs,
-- alone, since their delete trigger keeps copies of the failed ones, which part 2
-- (`testing_empty_tables`) then deletes (a statement does not see what its own
-- triggers wrote). DELETE, not TRUNCATE: an example leaves a few rows, and
-- TRUNCATE of these tables took 110 ms against DELETE's 1-5 ms (a new file per
-- table), a tenth of the machines' time.
DELETE FROM build_jobs;

-- name: testing_empty_tables
-- Part 2: every other table a machine writes. The references between them are
-- checked at the end of the statement, when the rows on both sides are gone.
WITH agent_builds AS (DELETE FROM agent_builds),
     connector_builds AS (DELETE FROM mcp_connector_builds),
     agents AS (DELETE FROM agents),
     connectors AS (DELETE FROM mcp_connectors),
     kept AS (DELETE FROM nasiko_queue_deleted_build_jobs),
     workers AS (DELETE FROM nasiko_queue_workers),
     leaders AS (DELETE FROM nasiko_queue_leaders),
     jobs AS (DELETE FROM nasiko_queue_jobs),
     job_errors AS (DELETE FROM nasiko_queue_job_errors),
     schedules AS (DELETE FROM nasiko_queue_schedules),
     limits AS (DELETE FROM nasiko_queue_limits),
     limit_starts AS (DELETE FROM nasiko_queue_limit_starts)
DELETE FROM nasiko_queue_limit_turns;

-- name: testing_worker_expire
-- A worker ($1) stops heartbeating for a minute (longer than any test lease): its
-- heartbeat and the claims it holds move a minute back, as if a minute passed.
WITH claims AS (
    UPDATE build_jobs SET picked_at = picked_at - interval '1 minute'
    WHERE claimed_by = $1 AND status = 'in_progress'
), plain_claims AS (
    UPDATE nasiko_queue_jobs SET attempted_at = attempted_at - interval '1 minute'
    WHERE claimed_by = $1 AND state = 'running'
)
UPDATE nasiko_queue_workers SET heartbeat_at = heartbeat_at - interval '1 minute'
WHERE id = $1;

-- name: testing_leader_expire
-- The leader ($1) died: its hold on the role has run out.
UPDATE nasiko_queue_leaders SET expires_at = now() - interval '1 second' WHERE worker_id = $1;

-- name: job_age_in_progress
-- Pretend one in_progress job ($1) was claimed $2 minutes ago.
UPDATE build_jobs SET picked_at = now() - make_interval(mins => $2)
WHERE id = $1 AND status = 'in_progress';

-- name: jobs_age_in_progress
-- Pretend every in_progress job was claimed $1 minutes ago (no waiting an hour).
UPDATE build_jobs SET picked_at = now() - make_interval(mins => $1)
WHERE status = 'in_progress';

-- The statements below serve LISTEN/NOTIFY and retention.

-- name: job_insert_notify
-- Enqueue outside a caller's transaction, or the first enqueue inside one: the
-- job and a NOTIFY on channel $5 in the same statement, so they commit together.
-- Later enqueues of the same transaction use `job_insert` (one NOTIFY per
-- transaction, not per row).
INSERT INTO build_jobs (agent_id, connector_id, owner_id, payload)
SELECT $1::uuid, $2::uuid, $3::uuid, $4::jsonb
FROM (SELECT pg_notify($5::text, '')) AS notify
RETURNING id;

-- name: jobs_insert_many
-- Enqueue a batch in one statement: $1 ids (made by the caller, so that the ids
-- come back in the caller's order whatever order RETURNING has), $2 agent ids,
-- $3 connector ids, $4 owners, $5 payloads. created_at is the clock per row, so
-- that the batch is claimed in the order given (now() is the same for every row
-- of a statement: the claim's ORDER BY created_at would leave their order open).
INSERT INTO build_jobs (id, agent_id, connector_id, owner_id, payload, created_at)
SELECT i, a, c, o, p::jsonb, clock_timestamp()
FROM unnest($1::uuid[], $2::uuid[], $3::uuid[], $4::uuid[], $5::text[])
     WITH ORDINALITY AS b(i, a, c, o, p, n)
ORDER BY n;

-- name: jobs_insert_many_notify
-- `jobs_insert_many` and a NOTIFY on channel $6, in one statement (as
-- `job_insert_notify`: once per transaction).
INSERT INTO build_jobs (id, agent_id, connector_id, owner_id, payload, created_at)
SELECT i, a, c, o, p::jsonb, clock_timestamp()
FROM unnest($1::uuid[], $2::uuid[], $3::uuid[], $4::uuid[], $5::text[])
     WITH ORDINALITY AS b(i, a, c, o, p, n),
     (SELECT pg_notify($6::text, '')) AS notify
ORDER BY n;

-- name: jobs_prune
-- Retention: delete up to $2 done/failed jobs completed more than $1 (an
-- interval) ago, by the database's clock. Pending and in_progress rows are
-- never touched. The old rows are found through the partial index of finished
-- jobs by completion time (0007), and deleted by primary key (an id array, as
-- in job_claim: a join back to the table was planned as a scan of all of it).
-- Small batches keep each transaction (and its locks and WAL burst) short; the
-- caller loops until a batch comes back short. The flag set first (local to the
-- statement's transaction) tells the trigger of 0010 that these deletes are
-- retention's, not a target's cascade: failed rows are not copied aside.
DELETE FROM build_jobs
WHERE id = ANY (ARRAY(
    SELECT id
    FROM build_jobs
    WHERE status IN ('done', 'failed') AND completed_at < now() - $1::interval
    LIMIT $2
    FOR UPDATE SKIP LOCKED))
  AND (SELECT set_config('nasiko_queue.pruning', 'on', true)) = 'on';

-- name: deleted_build_jobs_prune
-- Retention of the copies of failed build jobs deleted with their target: up to
-- $2 copied more than $1 (an interval) ago.
DELETE FROM nasiko_queue_deleted_build_jobs
WHERE id = ANY (ARRAY(
    SELECT id FROM nasiko_queue_deleted_build_jobs
    WHERE deleted_at < now() - $1::interval
    LIMIT $2));

-- name: jobs_finish_many_and_claim
-- Finish jobs and claim what their slots (and the prefetch buffer) have room
-- for, in one round trip: the worker's fetcher sends it with every finish queued
-- since its previous statement. Finish every job of the batch
-- ($1 ids, $2 attempts, $12 claim tokens, $3 connector?, $4 build ids; $5 the
-- failure message): done when its build row says 'success', else failed. Claim
-- up to $6 next jobs ($7, $8, $9, $10, $11 as $2-$6 of job_claim). Rows with
-- finished_id set report a finish (finished_status: what the row holds for that
-- claim now, NULL when gone or no longer ours; a retried batch thus reports what
-- its first try wrote); rows with id set are claimed jobs.
--
-- A claim is named by its token AND its attempt, in every write a worker makes
-- to its claimed build job (job_fail, job_reset_to_pending, jobs_unclaim too).
-- The attempt alone is not enough: the dead-letter retry (build_job_requeue)
-- starts the attempts from 0 again, so that a frozen worker's run (id, 1) and
-- the run after an operator's retry (id, 1) share an attempt. The token alone is
-- not either: build_jobs is shared with the original's SQL, whose claim, reset
-- and sweep never write claim_token (0006), so a token of ours stays on a row
-- the original claims after its sweep reset ours. Together they name one claim:
-- each of our claims sets a token of its own; the original's claim raises the
-- attempt and no statement of the original lowers it; the statements that lower
-- it (our give-backs, our dead-letter retry) clear the token, as our rescue and
-- sweep do. What the shared table cannot give: the original's own writes are
-- guarded by the id alone, so a stale run of the original's worker can still
-- overwrite a row (docs/rules.md).
-- This is the statement for a batch in which no executor reported through its
-- context; `jobs_finish_reported_and_claim` writes the reports too. Kept apart
-- because the server sets up every part of a statement's plan on every run,
-- used or not: the build-row locks and writes, unused here, made a batch of five
-- no-op jobs cost the server's backend 14 us of CPU a job more (issue #25).
WITH input AS (
    SELECT * FROM unnest($1::uuid[], $2::int[], $3::boolean[], $4::uuid[], $12::uuid[])
        AS i(id, attempt, is_connector, build_id, token)
), outcome AS (
    -- What decides each finish: the build row as it stands.
    SELECT i.id, i.attempt, i.token, i.build_id,
           CASE WHEN i.is_connector
                THEN (SELECT b.status FROM mcp_connector_builds AS b WHERE b.id = i.build_id)
                ELSE (SELECT b.status::text FROM agent_builds AS b WHERE b.id = i.build_id)
           END AS build_status
    FROM input AS i
), finished AS (
    UPDATE build_jobs AS j
    SET status = CASE WHEN o.build_status = 'success' THEN 'done' ELSE 'failed' END,
        error_msg = CASE WHEN o.build_status = 'success' THEN NULL ELSE $5 END,
        completed_at = now()
    FROM outcome AS o
    -- A primary-key probe per finished job: the status test is written so that no
    -- index on status matches it, or the plan (generic ones most of all, which
    -- take in_progress for rare) reads every in_progress row of every worker.
    WHERE j.id = ANY ($1::uuid[]) AND j.id = o.id
      AND coalesce(j.status, '') = 'in_progress' AND j.attempt = o.attempt
      AND j.claim_token = o.token
    RETURNING j.id, j.status
), claimed AS (
    -- include job_claim, its $1-$6 as $6-$11
)
SELECT i.id AS finished_id,
       coalesce(f.status, (SELECT c.status FROM build_jobs AS c
                           WHERE c.id = i.id AND c.attempt = i.attempt
                             AND c.claim_token = i.token
                             AND c.status IN ('done', 'failed'))) AS finished_status,
       NULL::uuid AS id, NULL::uuid AS agent_id, NULL::uuid AS connector_id,
       NULL::uuid AS owner_id, NULL::text AS payload, NULL::int AS old_attempt,
       NULL::timestamptz AS created_at, NULL::boolean AS target_soft_deleted
FROM input AS i LEFT JOIN finished AS f ON f.id = i.id
UNION ALL
SELECT NULL, NULL, c.id, c.agent_id, c.connector_id, c.owner_id, c.payload, c.old_attempt,
       c.created_at, c.target_soft_deleted
FROM claimed AS c;

-- name: jobs_finish_many_and_claim_kinds
-- derived from jobs_finish_many_and_claim: it includes job_claim_kinds for job_claim.
-- `jobs_finish_many_and_claim` for a replica that runs only some of the known
-- kinds: its claim is `job_claim_kinds`'s (the same arguments, the same result).

-- name: jobs_finish_reported_and_claim
-- `jobs_finish_many_and_claim` for a batch in which an executor reported through
-- its context (issue #13: its build-row writes folded into this statement), or
-- one that carries start writes: the same arguments and result (the claim
-- tokens as $13), and $12, one per row of $1, what was reported: NULL, nothing (the build row decides as it
-- stands); 'success' or 'failed', a finish that also writes the build row,
-- atomically with the job's done or failed (a connector build's completed_at
-- too), unless that row is already 'success' or 'failed' (then it stays, and
-- decides); 'building', no finish at all but a start write
-- (`JobContext.mark_building`): the build row goes from 'queued' ('pending' for a
-- connector) to 'building', and from nothing else.
WITH input AS (
    SELECT * FROM unnest($1::uuid[], $2::int[], $3::boolean[], $4::uuid[], $12::text[],
                         $13::uuid[])
        AS i(id, attempt, is_connector, build_id, reported, token)
), report AS (
    -- The folded writes, one per build row: two runs reporting on one row in one
    -- statement (two jobs of one build) agree on one status, the failure.
    SELECT build_id, is_connector, min(reported) AS reported
    FROM input WHERE reported IN ('success', 'failed')
    GROUP BY build_id, is_connector
), agent_locked AS MATERIALIZED (
    -- Every build row this statement writes (folded reports, start writes), locked
    -- in id order before any job row: a terminalization locks the builds before its
    -- agent's delete cascades to the jobs, so the other order could deadlock with it.
    SELECT b.id, false AS is_connector, b.status::text AS status
    FROM agent_builds AS b
    WHERE b.id = ANY (ARRAY(SELECT build_id FROM input
                            WHERE reported IS NOT NULL AND NOT is_connector))
    ORDER BY b.id
    FOR UPDATE
), connector_locked AS MATERIALIZED (
    SELECT b.id, true AS is_connector, b.status
    FROM mcp_connector_builds AS b
    WHERE b.id = ANY (ARRAY(SELECT build_id FROM input WHERE reported IS NOT NULL AND is_connector))
    ORDER BY b.id
    FOR UPDATE
), locked AS (
    SELECT * FROM agent_locked UNION ALL SELECT * FROM connector_locked
), outcome AS (
    -- What decides each finish: the build row as it stands, or, for a folded
    -- report, the reported status, unless the (locked) row is already 'success' or
    -- 'failed' (then it decides, and is left as it is) or missing (failed).
    SELECT i.id, i.attempt, i.token, i.build_id, i.reported IS NOT NULL AS folded,
           CASE WHEN i.reported IS NOT NULL
                THEN (SELECT CASE WHEN l.status IN ('success', 'failed') THEN l.status
                                  ELSE r.reported END
                      FROM report AS r JOIN locked AS l
                           ON l.id = r.build_id AND l.is_connector = r.is_connector
                      WHERE r.build_id = i.build_id AND r.is_connector = i.is_connector)
                WHEN i.is_connector
                THEN (SELECT b.status FROM mcp_connector_builds AS b WHERE b.id = i.build_id)
                ELSE (SELECT b.status::text FROM agent_builds AS b WHERE b.id = i.build_id)
           END AS build_status
    FROM input AS i
    WHERE i.reported IS DISTINCT FROM 'building'
), finished AS (
    UPDATE build_jobs AS j
    SET status = CASE WHEN o.build_status = 'success' THEN 'done' ELSE 'failed' END,
        error_msg = CASE WHEN o.build_status = 'success' THEN NULL ELSE $5 END,
        completed_at = now()
    FROM outcome AS o
    -- A primary-key probe per finished job: the status test is written so that no
    -- index on status matches it, or the plan (generic ones most of all, which
    -- take in_progress for rare) reads every in_progress row of every worker.
    WHERE j.id = ANY ($1::uuid[]) AND j.id = o.id
      AND coalesce(j.status, '') = 'in_progress' AND j.attempt = o.attempt
      AND j.claim_token = o.token
      -- The build rows first, in id order, whichever writer of this statement runs
      -- first (a data-modifying CTE the main query does not read runs at its end, in
      -- no promised order): a one-time filter over `locked`, on every writer.
      AND (SELECT count(*) FROM locked) >= 0
    RETURNING j.id, j.status, o.build_id, o.folded
), folded_agent AS (
    -- A folded report lands with its job's finish, or not at all (claim no
    -- longer current, job gone), and never over a 'success' or 'failed' row.
    UPDATE agent_builds AS b
    SET status = r.reported::build_status
    FROM report AS r
    WHERE b.id = r.build_id AND NOT r.is_connector AND b.status IN ('queued', 'building')
      AND EXISTS (SELECT 1 FROM finished AS f WHERE f.build_id = r.build_id AND f.folded)
      AND (SELECT count(*) FROM locked) >= 0
), folded_connector AS (
    UPDATE mcp_connector_builds AS b
    SET status = r.reported, completed_at = now()
    FROM report AS r
    WHERE b.id = r.build_id AND r.is_connector AND b.status IN ('pending', 'building')
      AND EXISTS (SELECT 1 FROM finished AS f WHERE f.build_id = r.build_id AND f.folded)
      AND (SELECT count(*) FROM locked) >= 0
), started_agent AS (
    -- Start writes: 'building' over 'queued' only, so never over a later outcome;
    -- a row this statement also reports on gets the report alone.
    UPDATE agent_builds AS b
    SET status = 'building'
    FROM input AS i
    WHERE i.reported = 'building' AND NOT i.is_connector AND b.id = i.build_id
      AND b.status = 'queued'
      AND NOT EXISTS (SELECT 1 FROM report AS r
                      WHERE r.build_id = i.build_id AND NOT r.is_connector)
      AND (SELECT count(*) FROM locked) >= 0
), started_connector AS (
    UPDATE mcp_connector_builds AS b
    SET status = 'building'
    FROM input AS i
    WHERE i.reported = 'building' AND i.is_connector AND b.id = i.build_id
      AND b.status = 'pending'
      AND NOT EXISTS (SELECT 1 FROM report AS r WHERE r.build_id = i.build_id AND r.is_connector)
      AND (SELECT count(*) FROM locked) >= 0
), claimed AS (
    -- include job_claim, its $1-$6 as $6-$11
)
SELECT i.id AS finished_id,
       coalesce(f.status, (SELECT c.status FROM build_jobs AS c
                           WHERE c.id = i.id AND c.attempt = i.attempt
                             AND c.claim_token = i.token
                             AND c.status IN ('done', 'failed'))) AS finished_status,
       NULL::uuid AS id, NULL::uuid AS agent_id, NULL::uuid AS connector_id,
       NULL::uuid AS owner_id, NULL::text AS payload, NULL::int AS old_attempt,
       NULL::timestamptz AS created_at, NULL::boolean AS target_soft_deleted
FROM input AS i LEFT JOIN finished AS f ON f.id = i.id
WHERE i.reported IS DISTINCT FROM 'building'
UNION ALL
SELECT NULL, NULL, c.id, c.agent_id, c.connector_id, c.owner_id, c.payload, c.old_attempt,
       c.created_at, c.target_soft_deleted
FROM claimed AS c;

-- name: jobs_finish_reported_and_claim_kinds
-- derived from jobs_finish_reported_and_claim: it includes job_claim_kinds for job_claim.
-- `jobs_finish_reported_and_claim` for a replica that runs only some of the
-- known kinds, as `jobs_finish_many_and_claim_kinds` is.

-- name: jobs_unclaim
-- Give back jobs that were claimed but never started (prefetched, or claimed
-- for a slot that went away): back to pending with the attempt restored, since
-- they never ran ($1 ids, $2 the attempts the claim gave them), and a NOTIFY on
-- $3 (when not NULL) so that an idle replica takes them at once. Returns how
-- many went back; a row the sweep has meanwhile handed on is left alone. $4:
-- the token of each one's claim (a claim is named by its token and its attempt,
-- see jobs_finish_many_and_claim). The give-back restores the attempt, so the
-- next claim of a row has the same attempt number again: a retried give-back
-- whose first try had committed unanswered must not match another claim of it.
WITH given AS (
    UPDATE build_jobs AS j
    SET status = 'pending', picked_at = NULL, attempt = j.attempt - 1, claim_token = NULL,
        claimed_by = NULL
    FROM unnest($1::uuid[], $2::int[], $4::uuid[]) AS b(id, attempt, token)
    WHERE j.id = b.id AND j.status = 'in_progress' AND j.attempt = b.attempt
      AND j.claim_token = b.token
    RETURNING j.id
)
SELECT count(*) AS given_back,
       CASE WHEN count(*) > 0 AND $3::text IS NOT NULL THEN pg_notify($3, '') END AS notified
FROM given;

-- name: jobs_unclaim_lost
-- Undo a claim whose answer was lost ($1, its token): whatever it took goes
-- back to pending with the attempt restored (it never reached an executor),
-- with a NOTIFY on $3 (when not NULL). Run only once the server process that
-- received the claim has gone (`backend_end`), so that the claim is settled.
-- $2 (the stuck threshold, minutes) keeps it off a row that the sweep has since
-- handed to a replica whose claims set no token.
WITH given AS (
    UPDATE build_jobs
    SET status = 'pending', picked_at = NULL, attempt = attempt - 1, claim_token = NULL,
        claimed_by = NULL
    WHERE claim_token = $1 AND status = 'in_progress'
      AND picked_at >= now() - make_interval(mins => $2)
    RETURNING id
)
SELECT count(*) AS given_back,
       CASE WHEN count(*) > 0 AND $3::text IS NOT NULL THEN pg_notify($3, '') END AS notified
FROM given;

-- name: backend_end
-- Make sure a server process has gone: ask it to end and wait up to $2 ms. A
-- statement it received is then settled (committed or rolled back), never still
-- on its way. Warns (does not fail) when there is no such process.
SELECT pg_terminate_backend($1, $2);

-- name: backend_alive
-- Whether a server process is still there (after `backend_end` timed out).
SELECT EXISTS (SELECT 1 FROM pg_stat_activity WHERE pid = $1);

-- name: queue_notify
-- Wake every listening worker (jobs went back to pending outside an enqueue).
SELECT pg_notify($1, '');

-- name: queue_notify_due
-- Tell the workers serving one queue that a job of it falls due later (a
-- retry after its backoff, a job given back for another worker): payload $2
-- names the queue (`engine.listener.due_payload`), so that only its lanes
-- re-read their next due time, and sleep until then instead of until their
-- poll. Sent after the write commits, once per such job: an enqueue's NOTIFY
-- already does this for the jobs it inserts, due or not.
SELECT pg_notify($1, $2);

-- The statements below serve worker registration, heartbeats, leadership and
-- the rescue of a dead worker's jobs (migration 0008).

-- name: worker_register
-- A worker process announces itself: $1 id, $2 host, $3 pid, $4 kinds, $5 its
-- lease in seconds (a rescuer judges each worker by its own), $6 the queues it
-- serves with their concurrency, as a JSON object (migration 0014).
INSERT INTO nasiko_queue_workers (id, host, pid, kinds, lease_secs, queues)
VALUES ($1, $2, $3, $4, $5, $6::jsonb);

-- name: worker_heartbeat
-- Renew worker $1's heartbeat; with a role ($2, not NULL), also hold or take that
-- role for $3 seconds: held while renewed before it expires, taken when it has
-- expired (or was never held). `alive` is false when the row is gone or was
-- declared dead (its jobs were rescued): the worker must stop them and
-- register anew. `leader` says whether it holds the role now; `cancels`, the
-- plain jobs it runs whose cancel was asked for.
WITH beat AS (
    UPDATE nasiko_queue_workers SET heartbeat_at = now()
    WHERE id = $1 AND dead_at IS NULL
    RETURNING id
), lead AS (
    INSERT INTO nasiko_queue_leaders AS l (role, worker_id, expires_at)
    SELECT $2, beat.id, now() + make_interval(secs => $3) FROM beat WHERE $2::text IS NOT NULL
    ON CONFLICT (role) DO UPDATE
    SET worker_id = excluded.worker_id,
        elected_at = CASE WHEN l.worker_id = excluded.worker_id THEN l.elected_at ELSE now() END,
        expires_at = excluded.expires_at
    WHERE l.worker_id = excluded.worker_id OR l.expires_at < now()
    RETURNING l.worker_id
)
SELECT EXISTS (SELECT 1 FROM beat) AS alive, EXISTS (SELECT 1 FROM lead) AS leader,
       -- The plain jobs it runs that were asked to stop (nasiko_queue_jobs_running).
       ARRAY(SELECT j.id FROM nasiko_queue_jobs AS j
             WHERE j.claimed_by = $1 AND j.state = 'running' AND j.cancel_requested)
           AS cancels;

-- name: worker_keep_alive
-- The loop watch's renewal of worker $1 (engine/loop_watch.py), sent from a
-- thread of its own while the worker's event loop is blocked: the row's
-- heartbeat only (the leadership is left to expire: the blocked loop runs no
-- maintenance), and only while the row is alive. Returns true if it renewed.
UPDATE nasiko_queue_workers SET heartbeat_at = now()
WHERE id = $1 AND dead_at IS NULL
RETURNING true;

-- name: worker_deregister
-- A worker stops ($1): any role it held is released at once, and its row goes,
-- unless it still holds jobs (a give-back that failed in an outage): then it is
-- declared dead instead, and the leader's rescue gives them back.
WITH roles AS (
    DELETE FROM nasiko_queue_leaders WHERE worker_id = $1
), held AS (
    SELECT EXISTS (SELECT 1 FROM build_jobs
                   WHERE claimed_by = $1 AND status = 'in_progress')
        OR EXISTS (SELECT 1 FROM nasiko_queue_jobs
                   WHERE claimed_by = $1 AND state = 'running') AS holds
), gone AS (
    DELETE FROM nasiko_queue_workers
    WHERE id = $1 AND NOT (SELECT holds FROM held)
    RETURNING id
)
UPDATE nasiko_queue_workers SET dead_at = now()
WHERE id = $1 AND dead_at IS NULL AND (SELECT holds FROM held);

-- name: worker_retire
-- A worker gives up its identity ($1): cut off from the database for too long, it
-- stopped its jobs; declared dead, they are given back by the leader's rescue.
UPDATE nasiko_queue_workers SET dead_at = now() WHERE id = $1 AND dead_at IS NULL;

-- name: workers_live_kinds
-- The kinds some live worker runs (not declared dead, heartbeat within its own
-- lease): what `nasiko-queue enqueue` checks a kind against.
SELECT DISTINCT unnest(kinds) AS kind FROM nasiko_queue_workers
WHERE dead_at IS NULL AND heartbeat_at >= now() - make_interval(secs => lease_secs);

-- name: workers_expired
-- Live workers whose heartbeat is older than their own lease: presumed dead.
SELECT id, heartbeat_at
FROM nasiko_queue_workers
WHERE dead_at IS NULL AND heartbeat_at < now() - make_interval(secs => lease_secs)
ORDER BY heartbeat_at;

-- name: worker_declare_dead
-- Declare worker $1 dead, if its heartbeat is still the one the rescuer saw ($2):
-- one that came back meanwhile is left alone. From then on its heartbeats say
-- `alive = false`.
UPDATE nasiko_queue_workers
SET dead_at = now()
WHERE id = $1 AND dead_at IS NULL AND heartbeat_at = $2
RETURNING id;

-- name: jobs_held_by_dead_exhausted
-- Jobs that dead workers hold, with no attempts left ($1 = MAX_ATTEMPTS): each is
-- failed and terminalized in a transaction of its own (`job_fail` with the
-- worker). A dead worker's claims are all older than the end of its lease (or
-- its retirement): a later claim naming it was made by someone else (the
-- original's SQL, which never sets `claimed_by`, after its own sweep).
SELECT j.id, j.attempt, j.claim_token, j.agent_id, j.connector_id, j.claimed_by
FROM build_jobs AS j
JOIN nasiko_queue_workers AS w ON w.id = j.claimed_by
WHERE w.dead_at IS NOT NULL AND j.status = 'in_progress' AND j.attempt >= $1
  AND j.picked_at <= least(w.dead_at, w.heartbeat_at + make_interval(secs => w.lease_secs))
ORDER BY j.picked_at, j.id
LIMIT $2;

-- name: jobs_rescue
-- Jobs that dead workers hold, with attempts left ($1 = MAX_ATTEMPTS), back to
-- pending, the attempt counted (as for any crash), with a NOTIFY on $2 (when
-- not NULL). The same choice as `jobs_held_by_dead_exhausted`.
WITH rescued AS (
    UPDATE build_jobs AS j
    SET status = 'pending', picked_at = NULL, claimed_by = NULL, claim_token = NULL
    FROM nasiko_queue_workers AS w
    WHERE w.id = j.claimed_by AND w.dead_at IS NOT NULL
      AND j.status = 'in_progress' AND j.attempt < $1
      AND j.picked_at <= least(w.dead_at, w.heartbeat_at + make_interval(secs => w.lease_secs))
    RETURNING j.id
)
SELECT count(*) AS rescued,
       CASE WHEN count(*) > 0 AND $2::text IS NOT NULL THEN pg_notify($2, '') END AS notified
FROM rescued;

-- name: workers_prune_dead
-- Forget workers declared dead longer ago than $1 seconds (kept meanwhile for
-- `status`) that hold no job any more.
DELETE FROM nasiko_queue_workers AS w
WHERE w.dead_at < now() - make_interval(secs => $1)
  AND NOT EXISTS (SELECT 1 FROM build_jobs AS j
                  WHERE j.claimed_by = w.id AND j.status = 'in_progress')
  AND NOT EXISTS (SELECT 1 FROM nasiko_queue_jobs AS p
                  WHERE p.claimed_by = w.id AND p.state = 'running');

-- name: workers_list
-- `status`: every registered worker, live or dead, and whether it leads.
SELECT w.id, w.host, w.pid, w.kinds, w.started_at, w.heartbeat_at, w.lease_secs,
       w.dead_at, w.queues::text AS queues,
       extract(epoch FROM now() - w.heartbeat_at)::float8 AS heartbeat_age,
       (w.dead_at IS NULL AND w.heartbeat_at >= now() - make_interval(secs => w.lease_secs))
           AS alive,
       coalesce((SELECT array_agg(l.role) FROM nasiko_queue_leaders AS l
                 WHERE l.worker_id = w.id AND l.expires_at >= now()), '{}') AS roles,
       (SELECT count(*) FROM build_jobs AS j
        WHERE j.claimed_by = w.id AND j.status = 'in_progress')
       + (SELECT count(*) FROM nasiko_queue_jobs AS p
          WHERE p.claimed_by = w.id AND p.state = 'running') AS holding
FROM nasiko_queue_workers AS w
ORDER BY w.started_at;

-- name: plain_queue_counts
-- `status`: per queue of plain jobs, how many are due, scheduled for later,
-- running, and ended each way, and how long the oldest due one has waited.
SELECT queue,
       count(*) FILTER (WHERE state = 'available' AND run_at <= now()) AS available,
       count(*) FILTER (WHERE state = 'available' AND run_at > now()) AS scheduled,
       count(*) FILTER (WHERE state = 'running') AS running,
       count(*) FILTER (WHERE state = 'completed') AS completed,
       count(*) FILTER (WHERE state = 'discarded') AS discarded,
       count(*) FILTER (WHERE state = 'cancelled') AS cancelled,
       extract(epoch FROM now() - min(run_at) FILTER (
           WHERE state = 'available' AND run_at <= now() AND isfinite(run_at)))::float8
           AS oldest_available_age
FROM nasiko_queue_jobs
GROUP BY queue
ORDER BY queue;

-- The statements below keep and read the errors of crashed attempts (migration 0009).

-- name: job_error_insert
-- A crashed or timed-out attempt's error: $1 job, $2 attempt, $3 worker (NULL
-- for a tool that heartbeats no worker row), $4 reason, $5 type, $6 message,
-- $7 traceback (bounded and masked by the caller).
INSERT INTO nasiko_queue_job_errors (job_id, attempt, worker_id, reason, error_type, message,
                                     traceback)
VALUES ($1, $2, $3, $4, $5, $6, $7);

-- name: job_errors_of
-- Every kept error of job $1, oldest first.
SELECT attempt, at, worker_id, reason, error_type, message, traceback
FROM nasiko_queue_job_errors
WHERE job_id = $1
ORDER BY at, id;

-- name: job_show
-- One job's row for `nasiko-queue job`, the payload as text (masked by the caller).
SELECT id, payload ->> 'kind' AS kind, status::text AS status, attempt, error_msg, agent_id,
       connector_id, owner_id, created_at, picked_at, completed_at, claimed_by,
       payload::text AS payload
FROM build_jobs
WHERE id = $1;

-- name: job_errors_prune
-- Retention: errors kept longer than $1 (an interval) of jobs that are gone (a
-- job row, or the kept copy of a failed build job deleted with its target, is
-- pruned by its own age first), up to $2 at a time. A job still waiting or
-- running, or ended within $1, keeps every error however old: its history is
-- whole for as long as the job is kept.
DELETE FROM nasiko_queue_job_errors
WHERE id = ANY (ARRAY(
    SELECT e.id FROM nasiko_queue_job_errors AS e
    WHERE e.at < now() - $1::interval
      AND NOT EXISTS (SELECT 1 FROM nasiko_queue_jobs AS j WHERE j.id = e.job_id)
      AND NOT EXISTS (SELECT 1 FROM build_jobs AS b WHERE b.id = e.job_id)
      AND NOT EXISTS (SELECT 1 FROM nasiko_queue_deleted_build_jobs AS d
                      WHERE d.id = e.job_id)
    ORDER BY e.at LIMIT $2));

-- ============================================================================
-- Plain jobs (nasiko_queue_jobs, migration 0010): queues, priorities, schedules,
-- retries with backoff, unique keys, cancellation. build_jobs is not touched.

-- name: plain_insert
-- Enqueue one plain job: $1 id, $2 queue, $3 kind, $4 payload, $5 priority, $6
-- max_attempts, $7 run_at (NULL: $8 seconds from now), $9 unique key (NULL: not
-- unique), $10 the states it is unique within. A unique job that meets one of its
-- key in one of those states inserts nothing and returns no row. "Now" is
-- clock_timestamp(), as in plain_insert_many and nasiko_queue_enqueue: now() is
-- the start of the caller's transaction, which made a delay inside a long one
-- shorter (or none).
INSERT INTO nasiko_queue_jobs (id, queue, kind, payload, priority, max_attempts, run_at,
                               unique_key, unique_states)
VALUES ($1, $2, $3, $4::jsonb, $5, $6,
        coalesce($7::timestamptz,
                 clock_timestamp() + make_interval(secs => $8::double precision)),
        $9, $10::text[])
ON CONFLICT (unique_key) WHERE unique_key IS NOT NULL AND state = ANY (unique_states)
DO NOTHING
RETURNING id;

-- name: plain_insert_notify
-- `plain_insert` and a NOTIFY on channel $11 in one statement (once per transaction).
INSERT INTO nasiko_queue_jobs (id, queue, kind, payload, priority, max_attempts, run_at,
                               unique_key, unique_states)
SELECT $1, $2, $3, $4::jsonb, $5, $6,
       coalesce($7::timestamptz,
                clock_timestamp() + make_interval(secs => $8::double precision)),
       $9, $10::text[]
FROM (SELECT pg_notify($11::text, '')) AS notify
ON CONFLICT (unique_key) WHERE unique_key IS NOT NULL AND state = ANY (unique_states)
DO NOTHING
RETURNING id;

-- name: plain_unique_holder
-- The job that holds unique key $1 now (a unique enqueue that inserted nothing
-- returns its id). Run as a statement of its own, after the insert: its snapshot
-- then sees the row the insert's conflict check waited for.
SELECT id FROM nasiko_queue_jobs
WHERE unique_key = $1 AND state = ANY (unique_states)
LIMIT 1;

-- name: plain_insert_many
-- A batch of plain jobs without unique keys in one statement: $1 ids, $2 queues,
-- $3 kinds, $4 payloads, $5 priorities, $6 max_attempts, $7 run_at (NULL: the
-- clock per row, so that the batch is claimed in the order given, + $8 delays).
INSERT INTO nasiko_queue_jobs (id, queue, kind, payload, priority, max_attempts, run_at)
SELECT i, q, k, p::jsonb, pr, m,
       coalesce(r, clock_timestamp() + make_interval(secs => d))
FROM unnest($1::uuid[], $2::text[], $3::text[], $4::text[], $5::smallint[], $6::int[],
            $7::timestamptz[], $8::double precision[])
     WITH ORDINALITY AS b(i, q, k, p, pr, m, r, d, n)
ORDER BY n;

-- name: plain_insert_many_notify
-- `plain_insert_many` and a NOTIFY on channel $9, in one statement.
INSERT INTO nasiko_queue_jobs (id, queue, kind, payload, priority, max_attempts, run_at)
SELECT i, q, k, p::jsonb, pr, m,
       coalesce(r, clock_timestamp() + make_interval(secs => d))
FROM unnest($1::uuid[], $2::text[], $3::text[], $4::text[], $5::smallint[], $6::int[],
            $7::timestamptz[], $8::double precision[])
     WITH ORDINALITY AS b(i, q, k, p, pr, m, r, d, n),
     (SELECT pg_notify($9::text, '')) AS notify
ORDER BY n;

-- name: plain_insert_many_unique
-- `plain_insert_many` for a batch with unique jobs: $9 their unique keys (NULL: not
-- unique), $10 the states each is unique within, comma-separated. A job that meets
-- its key (held by an earlier job, or by one earlier in the batch) inserts nothing;
-- the answer is the ids inserted, as one array (`enqueue_many` looks up the holder
-- of each key that is missing, as `plain_unique_holder`).
WITH inserted AS (
    INSERT INTO nasiko_queue_jobs (id, queue, kind, payload, priority, max_attempts, run_at,
                                   unique_key, unique_states)
    SELECT i, q, k, p::jsonb, pr, m,
           coalesce(r, clock_timestamp() + make_interval(secs => d)),
           u, string_to_array(us, ',')
    FROM unnest($1::uuid[], $2::text[], $3::text[], $4::text[], $5::smallint[], $6::int[],
                $7::timestamptz[], $8::double precision[], $9::text[], $10::text[])
         WITH ORDINALITY AS b(i, q, k, p, pr, m, r, d, u, us, n)
    ORDER BY n
    ON CONFLICT (unique_key) WHERE unique_key IS NOT NULL AND state = ANY (unique_states)
    DO NOTHING
    RETURNING id
)
SELECT coalesce(array_agg(id), '{}') FROM inserted;

-- name: plain_insert_many_unique_notify
-- `plain_insert_many_unique` and a NOTIFY on channel $11, in one statement.
WITH inserted AS (
    INSERT INTO nasiko_queue_jobs (id, queue, kind, payload, priority, max_attempts, run_at,
                                   unique_key, unique_states)
    SELECT i, q, k, p::jsonb, pr, m,
           coalesce(r, clock_timestamp() + make_interval(secs => d)),
           u, string_to_array(us, ',')
    FROM unnest($1::uuid[], $2::text[], $3::text[], $4::text[], $5::smallint[], $6::int[],
                $7::timestamptz[], $8::double precision[], $9::text[], $10::text[])
         WITH ORDINALITY AS b(i, q, k, p, pr, m, r, d, u, us, n),
         (SELECT pg_notify($11::text, '')) AS notify
    ORDER BY n
    ON CONFLICT (unique_key) WHERE unique_key IS NOT NULL AND state = ANY (unique_states)
    DO NOTHING
    RETURNING id
)
SELECT coalesce(array_agg(id), '{}') FROM inserted;

-- name: plain_claim
-- Take up to $2 available jobs of queue $1 that are due, by priority then due
-- time, marked with claim token $3 and worker $4; none while the queue is paused
-- (a primary-key probe of nasiko_queue_paused_queues, migration 0012). A payload
-- over $5 bytes comes back NULL (fails as invalid, unsent).
--
-- Priority by priority (issue #13): the priorities present among the queue's
-- available jobs, found by a loose scan of nasiko_queue_jobs_claim (one probe
-- each), and for each, in ascending order, its due jobs oldest first, where
-- `run_at <= now()` bounds the index range. One ordered scan of the queue by
-- (priority, run_at) instead read every job scheduled for later at a more
-- urgent priority before reaching the due ones (100,000 of them: 1,100 pages
-- and 9 ms per claim). The nested loop takes the priorities in order and stops
-- at $2 jobs, so no row beyond those it returns is locked; LIMIT $2 in each
-- priority keeps the plan an ordered index scan.
--
-- A LIMITED queue (a row in nasiko_queue_limits, migration 0020: one more
-- primary-key probe for every queue) is claimed by nasiko_queue_limited_pick
-- instead, which serialises the queue's claims across replicas and takes no
-- more than its concurrency and rate limits allow; $6 and $7: the running jobs
-- the same statement completes and their claim tokens. Each frees its slot only
-- while its row still holds that claim, which the pick checks once it holds
-- the queue's lock (migration 0036): a late finish of a job claimed again
-- elsewhere frees none, whatever attempt the new claim counts (after an
-- operator's retry it is the same number). The
-- scalar subquery makes its answer an init plan, computed once, so the id
-- lookup stays an index scan. It is given this statement's snapshot, and picks
-- only jobs this UPDATE can see (0035: a job committed while the pick waited
-- for the queue's lock was picked, its start counted, and not claimed).
-- The attempted_at it replaces is kept for a give-back to restore (0025).
UPDATE nasiko_queue_jobs AS j
SET state = 'running', attempt = j.attempt + 1, attempted_at = now(),
    previous_attempted_at = j.attempted_at, claim_token = $3, claimed_by = $4
WHERE j.id = ANY (CASE WHEN EXISTS (SELECT 1 FROM nasiko_queue_limits WHERE queue = $1)
                       THEN (SELECT nasiko_queue_limited_pick($1, $2::integer, $6::uuid[],
                                                                $7::uuid[],
                                                                pg_current_snapshot()))
                       ELSE ARRAY(
    WITH RECURSIVE priorities AS (
        (SELECT priority FROM nasiko_queue_jobs
         WHERE state = 'available' AND queue = $1
         ORDER BY priority LIMIT 1)
        UNION ALL
        SELECT (SELECT n.priority FROM nasiko_queue_jobs AS n
                WHERE n.state = 'available' AND n.queue = $1 AND n.priority > p.priority
                ORDER BY n.priority LIMIT 1)
        FROM priorities AS p WHERE p.priority IS NOT NULL
    )
    SELECT due.id
    FROM priorities CROSS JOIN LATERAL (
        SELECT id FROM nasiko_queue_jobs
        WHERE state = 'available' AND queue = $1 AND priority = priorities.priority
          AND run_at <= now()
        ORDER BY run_at, id
        LIMIT $2
        FOR UPDATE SKIP LOCKED) AS due
    WHERE NOT EXISTS (SELECT 1 FROM nasiko_queue_paused_queues WHERE queue = $1)
    LIMIT $2) END)
RETURNING j.id, j.kind,
          CASE WHEN octet_length(j.payload::text) <= $5 THEN j.payload::text END AS payload,
          j.attempt - 1 AS old_attempt, j.max_attempts, j.priority, j.run_at AS created_at;

-- name: plain_finish_many_and_claim
-- Complete the jobs whose executors returned ($1 ids, $2 their claim tokens:
-- each guarded by its claim) and claim as `plain_claim` ($3 queue, $4 limit, $5
-- token, $6 worker, $7 payload bound), in one round trip; a paused queue claims
-- nothing, but its finishes still complete. $10: what each executor returned
-- (JSON text; NULL: nothing), written as its result with the completion
-- (migration 0017; the trigger there wakes whoever waits for it). Rows with
-- finished_id report a finish ('completed', or NULL when no longer ours); rows
-- with id are claims. $8 and $9: $1 and $2 again (`plain_claim`'s $6 and $7: a
-- limited queue's claim counts those still holding their claim as ended).
--
-- The claim token, not the attempt, names the claim (as in every write a worker
-- makes to its claimed plain job: plain_retry, plain_defer, plain_end,
-- plain_reset, plain_unclaim): each claim sets a token of its own, and the
-- rescue, the sweep, a give-back and the dead-letter retry clear it, whereas the
-- retry starts the attempts from 0 again, so that a frozen worker's run (id, 1)
-- and the run after an operator's retry (id, 1) share an attempt. A completion
-- keeps its token, so that a retried batch reports what its first try wrote.
WITH finished AS (
    UPDATE nasiko_queue_jobs AS j
    SET state = 'completed', finished_at = now(), error_msg = NULL, result = i.result::jsonb
    FROM unnest($1::uuid[], $2::uuid[], $10::text[]) AS i(id, token, result)
    -- By primary key: a state test an index of running jobs matches would read
    -- every running job of every worker (as in jobs_finish_many_and_claim).
    WHERE j.id = ANY ($1::uuid[]) AND j.id = i.id AND coalesce(j.state, '') = 'running'
      AND j.claim_token = i.token
    RETURNING j.id, j.state
), claimed AS (
    -- The loader (`statements.py`) writes in `plain_claim`, so that the claim is spelled once.
    -- include plain_claim, its $1-$7 as $3-$9
)
SELECT i.id AS finished_id,
       coalesce(f.state, (SELECT c.state FROM nasiko_queue_jobs AS c
                          WHERE c.id = i.id AND c.claim_token = i.token
                            AND c.state = 'completed')) AS finished_status,
       NULL::uuid AS id, NULL::text AS kind, NULL::text AS payload, NULL::int AS old_attempt,
       NULL::int AS max_attempts, NULL::smallint AS priority, NULL::timestamptz AS created_at
FROM unnest($1::uuid[], $2::uuid[]) AS i(id, token) LEFT JOIN finished AS f ON f.id = i.id
UNION ALL
SELECT NULL, NULL, c.id, c.kind, c.payload, c.old_attempt, c.max_attempts, c.priority,
       c.created_at
FROM claimed AS c;

-- name: plain_retry
-- The run of job $1 that claim $2 (its token) started crashed (raised, timed
-- out, or no executor here): available again in $3 seconds, or discarded when it
-- was the last attempt, or cancelled when a cancel was asked for meanwhile (as
-- the rescue does); $4 the error, one line. Which of the three is
-- nasiko_queue_run_end's rule (migration 0013), decided once on the row this
-- statement updates. Returns the state written (no row: no longer ours: the
-- token, not the attempt, says so; see plain_finish_many_and_claim).
UPDATE nasiko_queue_jobs
SET (state, run_at, finished_at, claimed_by) = (
        SELECT e.state,
               CASE WHEN e.state <> 'available' THEN run_at
                    ELSE now() + make_interval(secs => $3::double precision) END,
               CASE WHEN e.state <> 'available' THEN now() END,
               CASE WHEN e.state <> 'available' THEN claimed_by END
        FROM nasiko_queue_run_end(cancel_requested, attempt >= max_attempts) AS e(state)),
    claim_token = NULL,
    error_msg = $4
WHERE id = $1 AND claim_token = $2 AND state = 'running'
RETURNING state;

-- name: plain_defer
-- The run of job $1 that claim $2 (its token) took never started: this worker
-- has no executor for its kind (a rolling deploy). Available again in $3 seconds
-- with its attempt restored, and with it attempted_at (as plain_unclaim), so
-- that a job is never discarded for that alone, whatever its max_attempts; $4
-- the error, one line. Cancelled instead when a cancel was asked for
-- (nasiko_queue_run_end's rule). Returns the state written (no row: no longer
-- ours). The restored attempt is why the claim is named by its token: the next
-- claim counts the same attempt again.
UPDATE nasiko_queue_jobs
SET (state, run_at, finished_at, error_msg) = (
        SELECT e.state,
               CASE WHEN e.state <> 'available' THEN run_at
                    ELSE now() + make_interval(secs => $3::double precision) END,
               CASE WHEN e.state <> 'available' THEN now() END,
               CASE WHEN e.state = 'cancelled' THEN 'cancelled' ELSE $4 END
        FROM nasiko_queue_run_end(cancel_requested, false) AS e(state)),
    attempt = attempt - 1, attempted_at = previous_attempted_at,
    claimed_by = NULL, claim_token = NULL
WHERE id = $1 AND claim_token = $2 AND state = 'running'
RETURNING state;

-- name: plain_end
-- The run of job $1 that claim $2 (its token) started ends for good in state $3
-- ('discarded': its payload is not one, it is past its attempts, or its outcome
-- cannot be recorded; 'cancelled': stopped at a cancel's request), with error
-- $4. A discard of a job whose cancel was asked for meanwhile ends it
-- `cancelled` (error 'cancelled') instead: a run that does not complete ends by
-- nasiko_queue_run_end's rule (migration 0013), where a cancel wins, as in
-- plain_retry and the rescue. Returns the state written (no row: no longer
-- ours).
UPDATE nasiko_queue_jobs
SET (state, error_msg) = (
        SELECT e.state, CASE WHEN e.state = 'cancelled' THEN 'cancelled' ELSE $4 END
        FROM nasiko_queue_run_end(cancel_requested OR $3 = 'cancelled', true) AS e(state)),
    finished_at = now(), claim_token = NULL
WHERE id = $1 AND claim_token = $2 AND state = 'running'
RETURNING state;

-- name: plain_reset
-- A hard stop or the fence cut the run of job $1 that claim $2 (its token)
-- started: available again at once, the attempt counted; or cancelled, when a
-- cancel was asked for meanwhile
-- (nasiko_queue_run_end's rule; a cut run is never its attempt's last word, so
-- never discarded here: the claim after the last attempt discards it).
UPDATE nasiko_queue_jobs
SET (state, finished_at, error_msg, claimed_by) = (
        SELECT e.state,
               CASE WHEN e.state <> 'available' THEN now() END,
               CASE WHEN e.state = 'cancelled' THEN 'cancelled' ELSE error_msg END,
               CASE WHEN e.state <> 'available' THEN claimed_by END
        FROM nasiko_queue_run_end(cancel_requested, false) AS e(state)),
    claim_token = NULL
WHERE id = $1 AND claim_token = $2 AND state = 'running';

-- name: plain_unclaim
-- Claimed jobs that never started ($1 ids, $2 the token of each one's claim):
-- the attempt restored, and with it attempted_at (the claim kept the value it
-- replaced, migration 0025); available again, or cancelled when a cancel was
-- asked for while the job waited (nasiko_queue_run_end's rule: it ends without
-- starting, not run by the next claim). Named by the token, not the attempt:
-- the give-back restores the attempt, so the next claim of the row counts the
-- same attempt again, and a retried give-back whose first try committed
-- unanswered must not match it (a worker that registered anew after the fence
-- still names its old claims).
UPDATE nasiko_queue_jobs AS j
SET (state, finished_at, error_msg) = (
        SELECT e.state,
               CASE WHEN e.state <> 'available' THEN now() END,
               CASE WHEN e.state = 'cancelled' THEN 'cancelled' ELSE j.error_msg END
        FROM nasiko_queue_run_end(j.cancel_requested, false) AS e(state)),
    attempt = j.attempt - 1, attempted_at = j.previous_attempted_at,
    claimed_by = NULL, claim_token = NULL
FROM unnest($1::uuid[], $2::uuid[]) AS i(id, token)
WHERE j.id = i.id AND j.state = 'running' AND j.claim_token = i.token;

-- name: plain_unclaim_lost
-- What a claim whose answer was lost took (token $1): the attempt and
-- attempted_at restored, available again or cancelled (as in plain_unclaim).
-- Returns how many.
WITH given AS (
    UPDATE nasiko_queue_jobs
    SET (state, finished_at, error_msg) = (
            SELECT e.state,
                   CASE WHEN e.state <> 'available' THEN now() END,
                   CASE WHEN e.state = 'cancelled' THEN 'cancelled' ELSE error_msg END
            FROM nasiko_queue_run_end(cancel_requested, false) AS e(state)),
        attempt = attempt - 1, attempted_at = previous_attempted_at,
        claimed_by = NULL, claim_token = NULL
    WHERE claim_token = $1 AND state = 'running'
    RETURNING id
)
SELECT count(*) FROM given;

-- name: plain_next_due
-- Seconds until the next scheduled job of queue $1 is due (NULL: none); for a
-- limited queue (migration 0020), sooner if its limits hold back a due job:
-- until its rate window lets one start, or $2 seconds while its concurrency
-- is full (`nasiko_queue_limit_wait`). Unlimited queues: one primary-key probe.
--
-- Read from nasiko_queue_jobs_claim the way the claim reads it (migration 0023):
-- the priorities present, by a loose scan, and for each the first run_at after
-- now(); a backlog of due jobs, or of jobs scheduled later, is not walked.
SELECT least(
    (WITH RECURSIVE present AS (
        (SELECT priority FROM nasiko_queue_jobs
         WHERE state = 'available' AND queue = $1
         ORDER BY priority LIMIT 1)
        UNION ALL
        SELECT (SELECT n.priority FROM nasiko_queue_jobs AS n
                WHERE n.state = 'available' AND n.queue = $1 AND n.priority > p.priority
                ORDER BY n.priority LIMIT 1)
        FROM present AS p WHERE p.priority IS NOT NULL
     )
     SELECT extract(epoch FROM min(
                (SELECT j.run_at FROM nasiko_queue_jobs AS j
                 WHERE j.state = 'available' AND j.queue = $1 AND j.priority = p.priority
                   AND j.run_at > now() AND j.run_at < 'infinity'
                 ORDER BY j.run_at LIMIT 1)) - now())::double precision
     FROM present AS p WHERE p.priority IS NOT NULL),
    CASE WHEN EXISTS (SELECT 1 FROM nasiko_queue_limits WHERE queue = $1)
         THEN nasiko_queue_limit_wait($1, $2::double precision) END);

-- name: plain_cancel
-- Cancel job $1 (the rule is nasiko_queue_cancel, migration 0013: a locked read,
-- then a decision on the state the row holds once no claim or run's end is in
-- flight): a waiting job ends `cancelled` now; a running one is asked to stop
-- (its worker sees the flag at its next heartbeat). Returns 'cancelled',
-- 'cancelling', or 'already <state>' for a job that had already ended (nothing
-- changes); NULL: no such plain job.
SELECT nasiko_queue.nasiko_queue_cancel($1);

-- name: plain_cancels_held
-- The running jobs worker $1 holds that were asked to stop: (id, attempt).
SELECT id, attempt FROM nasiko_queue_jobs
WHERE claimed_by = $1 AND state = 'running' AND cancel_requested;

-- name: plain_rescue
-- Running jobs held by dead workers, claimed before the worker's lease ended:
-- available again (the attempt counted), or discarded when that was their last
-- attempt, or cancelled when a cancel was asked for (nasiko_queue_run_end's
-- rule, decided on the row each update writes). NOTIFY on $1 (not NULL).
WITH rescued AS (
    UPDATE nasiko_queue_jobs AS j
    SET (state, finished_at, error_msg, claimed_by) = (
            SELECT e.state,
                   CASE WHEN e.state <> 'available' THEN now() END,
                   CASE WHEN e.state = 'cancelled' THEN 'cancelled'
                        ELSE 'the worker running it died' END,
                   CASE WHEN e.state <> 'available' THEN j.claimed_by END
            FROM nasiko_queue_run_end(j.cancel_requested, j.attempt >= j.max_attempts)
                 AS e(state)),
        claim_token = NULL
    FROM nasiko_queue_workers AS w
    WHERE w.id = j.claimed_by AND w.dead_at IS NOT NULL AND j.state = 'running'
      AND j.attempted_at <= least(w.dead_at,
                                  w.heartbeat_at + make_interval(secs => w.lease_secs))
    RETURNING j.state
)
SELECT count(*) FILTER (WHERE state = 'available') AS rescued,
       count(*) FILTER (WHERE state <> 'available') AS ended,
       CASE WHEN count(*) FILTER (WHERE state = 'available') > 0 AND $1::text IS NOT NULL
            THEN pg_notify($1, '') END AS notified
FROM rescued;

-- name: plain_sweep_stuck
-- The stuck-row rule of plain jobs (the recovery sweep, as `jobs_reset_stuck`
-- for build jobs): running jobs claimed more than $1 minutes ago that no live
-- worker holds (`claimed_by` NULL, naming no worker row, or a worker declared
-- dead; the rescue's rule leaves out claims sent after a worker's death, as by
-- a worker resumed from a pause) go back to available (the attempt counted), or
-- are discarded when that was their last attempt, or cancelled when a cancel
-- was asked for. A live worker's jobs run as long as it lives. Rows another
-- session holds are skipped (the outcome is nasiko_queue_run_end's rule, as for
-- the rescue). NOTIFY on $2 (not NULL) if any went back.
WITH stuck AS (
    SELECT id
    FROM nasiko_queue_jobs AS j
    WHERE state = 'running'
      AND attempted_at < now() - make_interval(mins => $1)
      AND NOT EXISTS (SELECT 1 FROM nasiko_queue_workers AS w
                      WHERE w.id = j.claimed_by AND w.dead_at IS NULL)
    ORDER BY id
    FOR UPDATE SKIP LOCKED
), swept AS (
    UPDATE nasiko_queue_jobs AS j
    SET (state, finished_at, error_msg, claimed_by) = (
            SELECT e.state,
                   CASE WHEN e.state <> 'available' THEN now() END,
                   CASE WHEN e.state = 'cancelled' THEN 'cancelled'
                        ELSE 'stuck: running past the stuck-job limit with no live worker'
                   END,
                   CASE WHEN e.state <> 'available' THEN j.claimed_by END
            FROM nasiko_queue_run_end(j.cancel_requested, j.attempt >= j.max_attempts)
                 AS e(state)),
        claim_token = NULL
    FROM stuck
    WHERE j.id = stuck.id AND j.state = 'running'
    RETURNING j.state
)
SELECT count(*) FILTER (WHERE state = 'available') AS reset,
       count(*) FILTER (WHERE state <> 'available') AS ended,
       CASE WHEN count(*) FILTER (WHERE state = 'available') > 0 AND $2::text IS NOT NULL
            THEN pg_notify($2, '') END AS notified
FROM swept;

-- name: plain_prune
-- Retention: delete up to $2 plain jobs that ended (completed, discarded,
-- cancelled) more than $1 (an interval) ago. Their kept errors go by age with
-- the build jobs' (`job_errors_prune`).
DELETE FROM nasiko_queue_jobs
WHERE id = ANY (ARRAY(
    SELECT id FROM nasiko_queue_jobs
    WHERE state IN ('completed', 'discarded', 'cancelled')
      AND finished_at < now() - $1::interval
    LIMIT $2
    FOR UPDATE SKIP LOCKED));

-- name: plain_get
-- One plain job, for tools and tests.
SELECT id, queue, kind, payload::text AS payload, state, priority, attempt, max_attempts,
       run_at, created_at, attempted_at, finished_at, claimed_by, cancel_requested,
       error_msg, unique_key, result::text AS result, workflow_run
FROM nasiko_queue_jobs WHERE id = $1;

-- ============================================================================
-- Results (issue #22, migration 0017).
-- ============================================================================

-- name: plain_result
-- What `Queue.result` reads of job $1: its state, result and last error.
SELECT state, result::text AS result, error_msg FROM nasiko_queue_jobs WHERE id = $1;

-- name: result_wait_and_read
-- Waiter $2 waits for job $1, then reads it as `plain_result`, FOR SHARE: a run's
-- end whose trigger ran before this wait existed still holds the row, so the read
-- waits for its commit and sees the end (the trigger could not have notified).
-- The wait is recorded only for a job that has not ended, as the row reads once
-- locked: a wait for no job, or for one already ended, would be removed by
-- nothing but its waiter, and a waiter that died left it for good. Locked first:
-- a condition read in the statement's snapshot missed an end in flight (the
-- trigger had deleted the waits before this one existed), so a waiter killed
-- after its read left a wait no end would remove.
--
-- The row lock hides a job that is due from every claim meanwhile (FOR UPDATE
-- SKIP LOCKED passes it by), and a claim that comes back short ends its
-- worker's drain: a job waited for as soon as it was enqueued (the read and
-- the claim its NOTIFY woke meet) then waited for the worker's poll, and
-- again at the next read, whose interval is the poll's (issue #45). So a read
-- that finds the job due and unclaimed NOTIFYs channel $3 (when not NULL),
-- naming its queue as `engine.listener.due_payload` does ('queue:' || name):
-- sent at commit, once the lock is gone, it makes that queue's lanes claim
-- again. Only jobs somebody waits for, not yet started, pay for it.
WITH job AS (
    SELECT state, result, error_msg, run_at, queue FROM nasiko_queue.nasiko_queue_jobs
    WHERE id = $1
    FOR SHARE
), waits AS (
    INSERT INTO nasiko_queue.nasiko_queue_result_waits (job_id, waiter)
    SELECT $1, $2 FROM job WHERE job.state NOT IN ('completed', 'discarded', 'cancelled')
    ON CONFLICT DO NOTHING
)
SELECT state, result::text AS result, error_msg,
       CASE WHEN state = 'available' AND run_at <= now() AND $3::text IS NOT NULL
            THEN pg_notify($3, 'queue:' || queue) END AS woke
FROM job;

-- name: result_wait_remove
-- Waiter $2 no longer waits for job $1 (it got its answer, or gave up).
DELETE FROM nasiko_queue.nasiko_queue_result_waits WHERE job_id = $1 AND waiter = $2;

-- ============================================================================
-- Dead-letter queue and job listings (the `jobs` API and CLI).
--
-- A job is listed with one vocabulary whichever table holds it: plain jobs as
-- they are; build jobs in the queue "builds", their kind from the payload and
-- their status mapped (pending: available, in_progress: running, done:
-- completed, failed: discarded); copies of failed build jobs deleted with their
-- target as discarded, flagged target_deleted. A job's "at" is when it ended, or
-- when it was created while it has not.

-- name: jobs_list
-- One page of jobs, newest "at" first, across the three tables: $1 queue, $2
-- kind, $3 state (the listing's names), $4 older than (an interval), each NULL
-- for any; $5, $6 the (at, id) of the last job of the previous page (NULL: the
-- first page); $7 the page size. Filters are parameters, never spliced in.
-- Each table is read in the listing's order (the *_listing indexes, migration
-- 0016) from the page's start, and stops after a page of matches: the bound
-- is a row comparison with no OR, an index condition in any plan (a first page
-- among 1,000,000 finished jobs: about 1 ms instead of 355 ms; measured by
-- benchmarks/dashboard_scale.py).
SELECT * FROM (
    (SELECT 'plain'::text AS source, id, queue, kind, state, attempt, max_attempts,
            error_msg, created_at, finished_at, coalesce(finished_at, created_at) AS at,
            false AS target_deleted, NULL::uuid AS agent_id, NULL::uuid AS connector_id,
            run_at, priority::int AS priority, attempted_at, claimed_by
     FROM nasiko_queue_jobs
     WHERE ($1::text IS NULL OR queue = $1) AND ($2::text IS NULL OR kind = $2)
       AND ($3::text IS NULL OR state = $3)
       AND ($4::interval IS NULL OR coalesce(finished_at, created_at) < now() - $4::interval)
       AND (coalesce(finished_at, created_at), id)
           < (least(coalesce($5::timestamptz, 'infinity'),
                    coalesce(now() - $4::interval, 'infinity')),
              coalesce($6::uuid, 'ffffffff-ffff-ffff-ffff-ffffffffffff'))
     ORDER BY coalesce(finished_at, created_at) DESC, id DESC
     LIMIT $7)
    UNION ALL
    (SELECT 'build', id, 'builds', payload ->> 'kind',
            CASE status WHEN 'pending' THEN 'available' WHEN 'in_progress' THEN 'running'
                        WHEN 'done' THEN 'completed' ELSE 'discarded' END,
            attempt, NULL::int, error_msg, created_at, completed_at,
            coalesce(completed_at, created_at), false, agent_id, connector_id,
            NULL::timestamptz, NULL::int, picked_at, claimed_by
     FROM build_jobs
     WHERE ($1::text IS NULL OR $1 = 'builds') AND ($2::text IS NULL OR payload ->> 'kind' = $2)
       AND ($3::text IS NULL
            OR status = CASE $3 WHEN 'available' THEN 'pending' WHEN 'running' THEN 'in_progress'
                                WHEN 'completed' THEN 'done' WHEN 'discarded' THEN 'failed' END)
       AND ($4::interval IS NULL OR coalesce(completed_at, created_at) < now() - $4::interval)
       AND (coalesce(completed_at, created_at), id)
           < (least(coalesce($5::timestamptz, 'infinity'),
                    coalesce(now() - $4::interval, 'infinity')),
              coalesce($6::uuid, 'ffffffff-ffff-ffff-ffff-ffffffffffff'))
     ORDER BY coalesce(completed_at, created_at) DESC, id DESC
     LIMIT $7)
    UNION ALL
    (SELECT 'deleted_build', id, 'builds', payload ->> 'kind', 'discarded', attempt, NULL::int,
            error_msg, created_at, completed_at, coalesce(completed_at, deleted_at), true,
            agent_id, connector_id, NULL::timestamptz, NULL::int, picked_at, NULL::uuid
     FROM nasiko_queue_deleted_build_jobs
     WHERE ($1::text IS NULL OR $1 = 'builds') AND ($2::text IS NULL OR payload ->> 'kind' = $2)
       AND ($3::text IS NULL OR $3 = 'discarded')
       AND ($4::interval IS NULL OR coalesce(completed_at, deleted_at) < now() - $4::interval)
       AND (coalesce(completed_at, deleted_at), id)
           < (least(coalesce($5::timestamptz, 'infinity'),
                    coalesce(now() - $4::interval, 'infinity')),
              coalesce($6::uuid, 'ffffffff-ffff-ffff-ffff-ffffffffffff'))
     ORDER BY coalesce(completed_at, deleted_at) DESC, id DESC
     LIMIT $7)
) AS j
ORDER BY j.at DESC, j.id DESC
LIMIT $7;

-- name: jobs_count
-- How many jobs `jobs_list` would list over every page: $1 queue, $2 kind, $3
-- state, $4 older than, as there. Build jobs count only when the queue is NULL or
-- "builds".
SELECT (SELECT count(*) FROM nasiko_queue_jobs
        WHERE ($1::text IS NULL OR queue = $1) AND ($2::text IS NULL OR kind = $2)
          AND ($3::text IS NULL OR state = $3)
          AND ($4::interval IS NULL OR coalesce(finished_at, created_at) < now() - $4))
     + (SELECT count(*) FROM build_jobs
        WHERE ($1::text IS NULL OR $1 = 'builds')
          AND ($2::text IS NULL OR payload ->> 'kind' = $2)
          AND ($3::text IS NULL
               OR status = CASE $3 WHEN 'available' THEN 'pending'
                                   WHEN 'running' THEN 'in_progress'
                                   WHEN 'completed' THEN 'done'
                                   WHEN 'discarded' THEN 'failed' END)
          AND ($4::interval IS NULL OR coalesce(completed_at, created_at) < now() - $4))
     + (SELECT count(*) FROM nasiko_queue_deleted_build_jobs
        WHERE ($1::text IS NULL OR $1 = 'builds')
          AND ($2::text IS NULL OR payload ->> 'kind' = $2)
          AND ($3::text IS NULL OR $3 = 'discarded')
          AND ($4::interval IS NULL OR coalesce(completed_at, deleted_at) < now() - $4));

-- name: plain_lock
-- A plain job's state and unique key, its row locked until the retry or discard
-- that reads it commits (so that a worker or another operator cannot change it
-- in between). No row: no such plain job.
SELECT state, unique_key FROM nasiko_queue_jobs WHERE id = $1 FOR UPDATE;

-- name: plain_requeue
-- Retry a dead plain job (discarded or cancelled): available now, as if just
-- enqueued: attempts from 0, never attempted, no error, not finished, no claim,
-- no cancel asked. Its kept errors stay (they are its history, with their times).
-- A unique key held by another job in one of this job's unique states raises
-- unique_violation.
UPDATE nasiko_queue_jobs
SET state = 'available', attempt = 0, run_at = now(), error_msg = NULL, finished_at = NULL,
    attempted_at = NULL, claimed_by = NULL, claim_token = NULL,
    cancel_requested = false, result = NULL
WHERE id = $1 AND state IN ('discarded', 'cancelled');

-- name: plain_delete_finished
-- Discard a finished plain job (completed, discarded, cancelled) for good.
DELETE FROM nasiko_queue_jobs
WHERE id = $1 AND state IN ('completed', 'discarded', 'cancelled');

-- name: build_job_peek
-- A build job's status, target and payload, unlocked: a retry locks the target
-- first (`agent_lock` / `connector_lock`, the lock order of docs/rules.md §6)
-- and only then the job (`build_job_lock`).
SELECT status, agent_id, connector_id, payload::text AS payload
FROM build_jobs WHERE id = $1;

-- name: build_job_lock
-- A build job's status and target, its row locked (after its target's, when the
-- caller retries it). No row: no such build job (or it was deleted meanwhile).
SELECT status, agent_id, connector_id FROM build_jobs WHERE id = $1 FOR UPDATE;

-- name: build_job_requeue
-- Retry a failed build job: pending with attempt 0 and no error, as the
-- original's enqueue writes a job, so that either side's worker runs it.
-- picked_at, completed_at and the claim are cleared (they described the run
-- that failed).
UPDATE build_jobs
SET status = 'pending', attempt = 0, error_msg = NULL, picked_at = NULL,
    completed_at = NULL, claimed_by = NULL, claim_token = NULL
WHERE id = $1 AND status = 'failed';

-- name: agent_soft_deleted
-- Whether agent $1 is soft-deleted (a job for it would fail `target deleted`).
SELECT deleted_at IS NOT NULL FROM agents WHERE id = $1;

-- name: agent_build_requeue
-- A retried job's own build row $1 (of agent $2), if it failed, is queued again,
-- as the enqueue point left it.
UPDATE agent_builds SET status = 'queued' WHERE id = $1 AND agent_id = $2 AND status = 'failed';

-- name: agent_redeploy
-- A retried job's agent, if it had failed, is deploying again (what the
-- enqueue point writes; terminalization fails only a deploying agent, so a
-- second failure for good ends it `failed` again). Any other status is left.
UPDATE agents SET status = 'deploying' WHERE id = $1 AND status = 'failed';

-- name: connector_build_requeue
-- As `agent_build_requeue`, for a connector's build row: pending again.
UPDATE mcp_connector_builds SET status = 'pending', completed_at = NULL
WHERE id = $1 AND connector_id = $2 AND status = 'failed';

-- name: connector_redeploy
-- As `agent_redeploy`, for a connector: a failed one is pending again.
UPDATE mcp_connectors SET build_status = 'pending' WHERE id = $1 AND build_status = 'failed';

-- name: build_job_delete_finished
-- Discard a finished build job (done or failed) for good. The flag (local to
-- the transaction) tells the trigger of 0010 not to copy a failed row aside:
-- the operator means it gone, as retention does.
DELETE FROM build_jobs
WHERE id = $1 AND status IN ('done', 'failed')
  AND (SELECT set_config('nasiko_queue.pruning', 'on', true)) = 'on';

-- name: deleted_build_job_get
-- The kept copy of a failed build job deleted with its target (for `job` and
-- the refusal of its retry).
SELECT id, payload ->> 'kind' AS kind, attempt, error_msg, agent_id, connector_id, owner_id,
       created_at, picked_at, completed_at, deleted_at, payload::text AS payload
FROM nasiko_queue_deleted_build_jobs WHERE id = $1;

-- name: deleted_build_job_delete
-- Discard the kept copy of a failed build job deleted with its target.
DELETE FROM nasiko_queue_deleted_build_jobs WHERE id = $1;

-- name: job_errors_delete
-- A discarded job's kept errors go with it.
DELETE FROM nasiko_queue_job_errors WHERE job_id = $1;


-- ============================================================================
-- Cron schedules (nasiko_queue_schedules, migration 0010).

-- name: schedule_advance
-- Move schedule $1's last tick forward to $2, if it is behind it, and record
-- the expression $3 and zone $4 that tick belongs to; returns a row only then,
-- with `changed` true when the row held another expression or zone (a deploy
-- changed the schedule: a late tick is then recorded, not caught up). The one
-- transaction that moves it enqueues that tick's job (in the same
-- transaction), so each tick is enqueued once: a concurrent scheduler waits
-- for the row lock (`old`'s FOR UPDATE, which then reads the committed row),
-- finds last_tick = $2, and updates nothing. A scheduler whose clock lags
-- moves nothing either. A paused schedule's tick is moved over all the same
-- (paused_at set: the caller enqueues nothing), so that a resume does not
-- replay the pause. NULL columns (rows from before 0029) count as unchanged.
WITH old AS (SELECT name, cron, timezone FROM nasiko_queue_schedules WHERE name = $1 FOR UPDATE)
UPDATE nasiko_queue_schedules s SET last_tick = $2, cron = $3, timezone = $4,
       updated_at = now()
FROM old
WHERE s.name = old.name AND s.last_tick < $2
RETURNING s.last_tick, s.paused_at,
          (old.cron IS NOT NULL AND (old.cron, old.timezone) IS DISTINCT FROM ($3, $4))
              AS changed;

-- name: schedule_first_sight
-- Record schedule $1 at tick $2 of expression $3 in zone $4 the first time any
-- scheduler sees it; returns a row only to the one that inserted it. Run when
-- `schedule_advance` moved nothing: no row yet, or a row already at or past
-- $2. Schedulers racing on a new schedule wait on the same key; one inserts,
-- the others insert nothing.
INSERT INTO nasiko_queue_schedules (name, last_tick, cron, timezone) VALUES ($1, $2, $3, $4)
ON CONFLICT (name) DO NOTHING
RETURNING last_tick;

-- name: schedule_list
-- Every schedule's last tick enqueued (or recorded), for tools and tests.
SELECT name, last_tick, updated_at, paused_at, cron, timezone FROM nasiko_queue_schedules
ORDER BY name;


-- ============================================================================
-- Health and metrics (nasiko_queue.web).

-- name: health_ping
-- `/health/ready`: the database answers.
SELECT 1;

-- name: metrics_jobs
-- `/metrics`, one statement per scrape: jobs by queue, kind and state (build
-- jobs as queue 'builds', kind from the payload), with the age in seconds of
-- the oldest claimable job of each group (pending build jobs since created_at,
-- available plain jobs that are due since run_at; NULL for the other groups).
SELECT 'builds' AS queue, coalesce(payload ->> 'kind', '') AS kind, status AS state,
       count(*) AS n,
       extract(epoch FROM now() - min(created_at) FILTER (WHERE status = 'pending'))::float8
           AS oldest
FROM build_jobs
GROUP BY status, payload ->> 'kind'
UNION ALL
SELECT queue, kind, state, count(*) AS n,
       extract(epoch FROM now() - min(run_at) FILTER (
           WHERE state = 'available' AND run_at <= now() AND isfinite(run_at)))::float8
           AS oldest
FROM nasiko_queue_jobs
GROUP BY queue, kind, state;
-- Dashboard (nasiko_queue.web.dashboard).

-- name: queue_pause
-- Pause queue $1 (idempotent: a paused queue keeps its first paused_at).
INSERT INTO nasiko_queue_paused_queues (queue) VALUES ($1)
ON CONFLICT (queue) DO NOTHING;

-- name: queue_resume
-- Resume queue $1; returns its row when it was paused.
DELETE FROM nasiko_queue_paused_queues WHERE queue = $1 RETURNING queue;

-- name: queues_paused
-- Every paused queue, with since when.
SELECT queue, paused_at FROM nasiko_queue_paused_queues ORDER BY queue;

-- name: throughput_buckets
-- Jobs that ended in the last hour, per 5-minute bucket (0 = the oldest, 11 =
-- the current one) and per outcome ('completed' or 'failed'), across plain jobs
-- (finished_at) and build jobs (completed_at). Reads the finished indexes.
SELECT b.bucket::int AS bucket, b.outcome, count(*)::int AS n FROM (
    SELECT floor(extract(epoch FROM finished_at - (now() - interval '1 hour')) / 300)
               AS bucket,
           CASE WHEN state = 'completed' THEN 'completed' ELSE 'failed' END AS outcome
    FROM nasiko_queue_jobs
    WHERE state IN ('completed', 'discarded', 'cancelled')
      AND finished_at > now() - interval '1 hour'
    UNION ALL
    SELECT floor(extract(epoch FROM completed_at - (now() - interval '1 hour')) / 300),
           CASE WHEN status = 'done' THEN 'completed' ELSE 'failed' END
    FROM build_jobs
    WHERE status IN ('done', 'failed') AND completed_at > now() - interval '1 hour'
) AS b
WHERE b.bucket BETWEEN 0 AND 11
GROUP BY b.bucket, b.outcome
ORDER BY b.bucket;

-- name: build_queue_counts
-- The build jobs as the dashboard's queue "builds": counts in the listing's
-- states (pending due now: available), and the kept copies as discarded.
SELECT count(*) FILTER (WHERE status = 'pending')::int AS available,
       count(*) FILTER (WHERE status = 'in_progress')::int AS running,
       count(*) FILTER (WHERE status = 'done')::int AS completed,
       (count(*) FILTER (WHERE status = 'failed')
        + (SELECT count(*) FROM nasiko_queue_deleted_build_jobs))::int AS discarded
FROM build_jobs;


-- ============================================================================
-- The operator's views (issue #21): throughput, unserved queues, running and
-- scheduled jobs, run now, search, the actions of a job's timeline, schedule
-- pause, and the planner's estimates.

-- name: queue_throughput
-- Per queue (build jobs as "builds"), the jobs completed in the last minute and
-- the last 5 minutes. Reads the finished indexes (nasiko_queue_jobs_finished,
-- build_jobs_finished_completed_at) over those 5 minutes only.
SELECT queue, count(*) FILTER (WHERE finished_at > now() - interval '1 minute')::int
           AS completed_1m,
       count(*)::int AS completed_5m
FROM nasiko_queue_jobs
WHERE state IN ('completed', 'discarded', 'cancelled') AND state = 'completed'
  AND finished_at > now() - interval '5 minutes'
GROUP BY queue
UNION ALL
SELECT 'builds', count(*) FILTER (WHERE completed_at > now() - interval '1 minute')::int,
       count(*)::int
FROM build_jobs
WHERE status IN ('done', 'failed') AND status = 'done'
  AND completed_at > now() - interval '5 minutes'
HAVING count(*) > 0;

-- name: queues_unserved
-- Waiting jobs no live worker will run: queues that hold waiting jobs
-- (available, due or scheduled; build jobs pending, as "builds") but that no live
-- worker serves (kind NULL), and, in a queue some live worker serves, each kind
-- of plain job that none of those workers runs (a typo in a kind, or a worker not
-- deployed yet: such a job is given back every 15 s for ever). A live worker is
-- one whose row is alive (not declared dead, heartbeat within its lease); it
-- serves the queues named in its `queues` (migration 0014: NULL, by an older
-- version, is taken to serve every queue) and runs its `kinds`. Reads only the
-- waiting rows; `oldest_age` is the seconds the oldest due job has waited (NULL:
-- none is due yet).
WITH live AS (
    SELECT k.queues, k.kinds FROM nasiko_queue_workers AS k
    WHERE k.dead_at IS NULL
      AND k.heartbeat_at >= now() - make_interval(secs => k.lease_secs)
), waiting AS (
    SELECT queue, kind, count(*)::int AS waiting,
           extract(epoch FROM now() - min(run_at) FILTER (
               WHERE run_at <= now() AND isfinite(run_at)))::float8 AS oldest_age
    FROM nasiko_queue_jobs WHERE state = 'available'
    GROUP BY queue, kind
    UNION ALL
    SELECT 'builds', NULL, count(*)::int, extract(epoch FROM now() - min(created_at))::float8
    FROM build_jobs WHERE status = 'pending'
    HAVING count(*) > 0
), by_queue AS (
    SELECT queue, sum(waiting)::int AS waiting, max(oldest_age) AS oldest_age
    FROM waiting GROUP BY queue
)
SELECT q.queue, NULL::text AS kind, q.waiting, q.oldest_age
FROM by_queue AS q
WHERE NOT EXISTS (SELECT 1 FROM live AS k WHERE k.queues IS NULL OR k.queues ? q.queue)
UNION ALL
SELECT w.queue, w.kind, w.waiting, w.oldest_age
FROM waiting AS w
WHERE w.kind IS NOT NULL
  AND EXISTS (SELECT 1 FROM live AS k WHERE k.queues IS NULL OR k.queues ? w.queue)
  AND NOT EXISTS (SELECT 1 FROM live AS k
                  WHERE (k.queues IS NULL OR k.queues ? w.queue) AND w.kind = ANY (k.kinds))
ORDER BY 1, 2 NULLS FIRST;

-- name: jobs_running
-- The running jobs, longest-running first (plain jobs since attempted_at, build
-- jobs since picked_at), with the worker that holds each (NULL: a claim that
-- names no registered worker, e.g. the original's); $1 the page size.
SELECT * FROM (
    SELECT 'plain'::text AS source, j.id, j.queue, j.kind, j.attempt, j.max_attempts,
           j.attempted_at AS started_at, j.cancel_requested, j.claimed_by,
           w.host, w.pid, (w.dead_at IS NULL
               AND w.heartbeat_at >= now() - make_interval(secs => w.lease_secs))
               AS worker_alive
    FROM nasiko_queue_jobs AS j
    LEFT JOIN nasiko_queue_workers AS w ON w.id = j.claimed_by
    WHERE j.state = 'running'
    UNION ALL
    SELECT 'build', j.id, 'builds', j.payload ->> 'kind', j.attempt, NULL::int, j.picked_at,
           false, j.claimed_by, w.host, w.pid,
           (w.dead_at IS NULL AND w.heartbeat_at >= now() - make_interval(secs => w.lease_secs))
    FROM build_jobs AS j
    LEFT JOIN nasiko_queue_workers AS w ON w.id = j.claimed_by
    WHERE j.status = 'in_progress'
) AS r
ORDER BY r.started_at NULLS LAST, r.id
LIMIT $1;

-- name: jobs_scheduled
-- Plain jobs waiting for their run_at (available, run_at in the future), soonest
-- first: $1 queue (NULL: any), $2 the page size. Reads nasiko_queue_jobs_claim:
-- each (queue, priority) present, by a loose scan from queue $1 on (each step an
-- index range, also on a generic plan; it stops past $1); the first $2 scheduled
-- jobs of each, from the index alone; of those the soonest $2, read by primary
-- key. However many jobs wait, due or scheduled.
WITH RECURSIVE lanes AS (
    (SELECT queue, priority FROM nasiko_queue_jobs
     WHERE state = 'available' AND queue >= coalesce($1::text, '')
     ORDER BY queue, priority LIMIT 1)
    UNION ALL
    SELECT n.queue, n.priority
    FROM lanes AS l CROSS JOIN LATERAL (
        SELECT j.queue, j.priority FROM nasiko_queue_jobs AS j
        WHERE j.state = 'available' AND (j.queue, j.priority) > (l.queue, l.priority)
        ORDER BY j.queue, j.priority LIMIT 1) AS n
    WHERE $1::text IS NULL OR l.queue = $1
), page AS (
    SELECT s.id, s.run_at
    FROM lanes AS l CROSS JOIN LATERAL (
        SELECT j.id, j.run_at FROM nasiko_queue_jobs AS j
        WHERE j.state = 'available' AND j.queue = l.queue AND j.priority = l.priority
          AND j.run_at > now()
        ORDER BY j.run_at, j.id
        LIMIT $2) AS s
    WHERE $1::text IS NULL OR l.queue = $1
    ORDER BY s.run_at, s.id
    LIMIT $2
)
SELECT j.id, j.queue, j.kind, j.priority, j.attempt, j.max_attempts, j.run_at, j.created_at
FROM nasiko_queue_jobs AS j
WHERE j.id = ANY (ARRAY(SELECT id FROM page))
ORDER BY j.run_at, j.id;

-- name: plain_run_now
-- "Run now": an available plain job ($1) due at once (its run_at moved to now,
-- if it was later); returns its queue, no row when it is not available. The
-- caller NOTIFYs in the same transaction.
UPDATE nasiko_queue_jobs SET run_at = least(run_at, now())
WHERE id = $1 AND state = 'available'
RETURNING queue, run_at;

-- name: job_event_insert
-- An operator's action on job $1 (migration 0015): $2 the action ("retried",
-- "cancelled", "discarded", "run now"), $3 who ("dashboard", "cli", "api"), $4
-- a detail (NULL: none).
INSERT INTO nasiko_queue_job_events (job_id, action, actor, detail)
VALUES ($1, $2, $3, $4);

-- name: job_events_prune
-- Retention: operator actions recorded longer than $1 (an interval) ago, of
-- jobs that are gone, up to $2 at a time (as job_errors_prune).
DELETE FROM nasiko_queue_job_events
WHERE id = ANY (ARRAY(
    SELECT e.id FROM nasiko_queue_job_events AS e
    WHERE e.at < now() - $1::interval
      AND NOT EXISTS (SELECT 1 FROM nasiko_queue_jobs AS j WHERE j.id = e.job_id)
      AND NOT EXISTS (SELECT 1 FROM build_jobs AS b WHERE b.id = e.job_id)
      AND NOT EXISTS (SELECT 1 FROM nasiko_queue_deleted_build_jobs AS d
                      WHERE d.id = e.job_id)
    ORDER BY e.at LIMIT $2));

-- name: job_events_of
-- Every recorded operator action on job $1, oldest first.
SELECT at, action, actor, detail FROM nasiko_queue_job_events
WHERE job_id = $1 ORDER BY at, id;

-- name: jobs_search
-- Search jobs by kind and by their arguments: $1 kind (NULL: any), $2 a JSON
-- document the job's payload must contain (jsonb containment, `@>`; NULL: any),
-- $3 state (the listing's names; NULL: any), $4 queue (NULL: any), $5, $6 the
-- (at, id) of the last job of the previous page (NULL: the first page), $7 the
-- page size. Newest first, as `jobs_list`. Plain and build jobs (not the kept
-- copies). Each table is read in the listing's order (the *_listing indexes,
-- migration 0016) from the page's start, and stops after a page of matches:
-- the keyset bound is a row comparison with no OR, an index condition in any
-- plan, generic or custom.
SELECT * FROM (
    (SELECT 'plain'::text AS source, id, queue, kind, state, attempt, max_attempts,
            error_msg, created_at, finished_at, run_at,
            coalesce(finished_at, created_at) AS at
     FROM nasiko_queue_jobs
     WHERE ($1::text IS NULL OR kind = $1) AND ($2::jsonb IS NULL OR payload @> $2::jsonb)
       AND ($3::text IS NULL OR state = $3) AND ($4::text IS NULL OR queue = $4)
       AND (coalesce(finished_at, created_at), id)
           < (coalesce($5::timestamptz, 'infinity'),
              coalesce($6::uuid, 'ffffffff-ffff-ffff-ffff-ffffffffffff'))
     ORDER BY coalesce(finished_at, created_at) DESC, id DESC
     LIMIT $7)
    UNION ALL
    (SELECT 'build', id, 'builds', payload ->> 'kind',
            CASE status WHEN 'pending' THEN 'available' WHEN 'in_progress' THEN 'running'
                        WHEN 'done' THEN 'completed' ELSE 'discarded' END,
            attempt, NULL::int, error_msg, created_at, completed_at, created_at,
            coalesce(completed_at, created_at)
     FROM build_jobs
     WHERE ($1::text IS NULL OR payload ->> 'kind' = $1)
       AND ($2::jsonb IS NULL OR payload @> $2::jsonb)
       AND ($3::text IS NULL
            OR status = CASE $3 WHEN 'available' THEN 'pending' WHEN 'running' THEN 'in_progress'
                                WHEN 'completed' THEN 'done' WHEN 'discarded' THEN 'failed' END)
       AND ($4::text IS NULL OR $4 = 'builds')
       AND (coalesce(completed_at, created_at), id)
           < (coalesce($5::timestamptz, 'infinity'),
              coalesce($6::uuid, 'ffffffff-ffff-ffff-ffff-ffffffffffff'))
     ORDER BY coalesce(completed_at, created_at) DESC, id DESC
     LIMIT $7)
) AS j
ORDER BY j.at DESC, j.id DESC
LIMIT $7;

-- name: schedule_pause
-- Pause schedule $1 (idempotent: keeps its first paused_at); no row: no
-- scheduler has recorded it yet.
UPDATE nasiko_queue_schedules SET paused_at = coalesce(paused_at, now())
WHERE name = $1
RETURNING paused_at;

-- name: schedule_resume
-- Resume schedule $1; returns a row when it was paused.
UPDATE nasiko_queue_schedules SET paused_at = NULL
WHERE name = $1 AND paused_at IS NOT NULL
RETURNING name;

-- name: table_estimates
-- The planner's row estimates of the job tables (pg_class.reltuples, as of the
-- last VACUUM or ANALYZE; -1 or 0 before the first): counts that do not scan.
SELECT c.relname AS name, greatest(c.reltuples, 0)::bigint AS rows
FROM pg_class AS c
WHERE c.oid IN (to_regclass('nasiko_queue_jobs'), to_regclass('build_jobs'));

-- name: plain_queue_live_counts
-- The overview: per queue of plain jobs, the jobs due, scheduled and running,
-- and how long the oldest due one has waited; reads only unfinished rows, each
-- state through its own partial index (nasiko_queue_jobs_claim,
-- nasiko_queue_jobs_running_queue), however long the history.
SELECT queue, sum(available)::int AS available, sum(scheduled)::int AS scheduled,
       sum(running)::int AS running, max(oldest) AS oldest_available_age
FROM (
    SELECT queue, count(*) FILTER (WHERE run_at <= now()) AS available,
           count(*) FILTER (WHERE run_at > now()) AS scheduled, 0 AS running,
           extract(epoch FROM now() - min(run_at) FILTER (
               WHERE run_at <= now() AND isfinite(run_at)))::float8 AS oldest
    FROM nasiko_queue_jobs WHERE state = 'available'
    GROUP BY queue
    UNION ALL
    SELECT queue, 0, 0, count(*), NULL FROM nasiko_queue_jobs WHERE state = 'running'
    GROUP BY queue
) AS live
GROUP BY queue;

-- name: plain_queue_finished_counts
-- The overview on a small table: exact counts of the ended jobs per queue and
-- state (a scan of the history; `plain_queue_finished_estimates` instead on a
-- big one).
SELECT queue, state, count(*)::bigint AS n
FROM nasiko_queue_jobs
WHERE state IN ('completed', 'discarded', 'cancelled')
GROUP BY queue, state;

-- name: plain_queue_finished_estimates
-- The overview on a big table: the planner's estimate of the ended jobs per
-- queue and state, without a scan: rows (pg_class.reltuples) x the queue's
-- share x the state's share (pg_stats, as of the last ANALYZE; a value outside
-- the most common ones gets the rest spread evenly, as the planner assumes).
-- For the most common queues and the queues in $1. No row: never analyzed.
WITH t AS (
    SELECT greatest(reltuples, 0) AS n FROM pg_class
    WHERE oid = to_regclass('nasiko_queue_jobs')
), stats AS (
    SELECT s.attname, s.most_common_vals::text::text[] AS vals,
           s.most_common_freqs AS freqs,
           CASE WHEN s.n_distinct >= 0 THEN s.n_distinct
                ELSE -s.n_distinct * (SELECT n FROM t) END AS distinct_n
    FROM pg_stats AS s
    JOIN pg_class AS c ON c.oid = to_regclass('nasiko_queue_jobs')
    JOIN pg_namespace AS n ON n.oid = c.relnamespace
    WHERE s.schemaname = n.nspname AND s.tablename = 'nasiko_queue_jobs'
      AND s.attname IN ('queue', 'state')
), share AS (
    SELECT st.attname, v.value,
           coalesce(st.freqs[array_position(st.vals, v.value)],
                    greatest(1 - coalesce((SELECT sum(f) FROM unnest(st.freqs) AS f), 0), 0)
                    / greatest(st.distinct_n - coalesce(cardinality(st.vals), 0), 1))
               AS freq
    FROM stats AS st
    CROSS JOIN LATERAL unnest(CASE st.attname
        WHEN 'queue' THEN ARRAY(SELECT DISTINCT x FROM unnest(
                                    coalesce(st.vals, '{}') || $1::text[]) AS x)
        ELSE ARRAY['completed', 'discarded', 'cancelled'] END) AS v(value)
)
SELECT q.value AS queue, s.value AS state, round((SELECT n FROM t) * q.freq * s.freq)::bigint AS n
FROM share AS q JOIN share AS s ON q.attname = 'queue' AND s.attname = 'state'
WHERE s.value IN ('completed', 'discarded', 'cancelled');

-- name: build_queue_live_counts
-- The overview's "builds" row: pending and in-progress build jobs (the partial
-- index build_jobs_work_queue), and the kept copies of deleted ones.
SELECT count(*) FILTER (WHERE status = 'pending')::int AS available,
       count(*) FILTER (WHERE status = 'in_progress')::int AS running,
       (SELECT count(*) FROM nasiko_queue_deleted_build_jobs)::int AS deleted
FROM build_jobs
WHERE status IN ('pending', 'in_progress');

-- name: build_finished_counts
-- Exact done and failed build jobs (a scan; on a small table only).
SELECT count(*) FILTER (WHERE status = 'done')::bigint AS done,
       count(*) FILTER (WHERE status = 'failed')::bigint AS failed
FROM build_jobs
WHERE status IN ('done', 'failed');

-- name: build_finished_estimates
-- The planner's estimate of done and failed build jobs (reltuples x the
-- status's share in pg_stats); no row: never analyzed.
SELECT round(greatest(c.reltuples, 0) * coalesce(
           s.most_common_freqs[array_position(s.most_common_vals::text::text[], 'done')], 0)
       )::bigint AS done,
       round(greatest(c.reltuples, 0) * coalesce(
           s.most_common_freqs[array_position(s.most_common_vals::text::text[], 'failed')], 0)
       )::bigint AS failed
FROM pg_class AS c
JOIN pg_namespace AS n ON n.oid = c.relnamespace
JOIN pg_stats AS s ON s.schemaname = n.nspname AND s.tablename = 'build_jobs'
                  AND s.attname = 'status'
WHERE c.oid = to_regclass('build_jobs');

-- =====================================================================
-- Enqueue from any application (issue #26): the SQL functions of migration 0019,
-- called by the asyncio client (nasiko_queue.aio) and the DB-API one
-- (nasiko_queue.sync, which turns $n into the driver's %s).

-- name: enqueue_function
-- One plain job: $1 kind, $2 its payload (the codec's JSON, kind included), $3
-- queue, $4 priority, $5 run_at, $6 max_attempts, $7 unique key, $8 its states,
-- $9 delay in seconds; NULL takes the default. Returns its id, or the id of the
-- job that holds the unique key.
SELECT nasiko_queue.nasiko_queue_enqueue($1, $2::jsonb, $3, $4, $5::timestamptz, $6, $7, $8::text[],
                            $9::double precision);

-- name: enqueue_function_many
-- A batch: $1 a JSON array of jobs (see nasiko_queue_enqueue_many); the ids in order.
SELECT nasiko_queue.nasiko_queue_enqueue_many($1::jsonb);

-- name: enqueue_function_many_text
-- `enqueue_function_many`, its ids as text[]: for any DB-API driver (`sync`).
-- psycopg2 reads uuid[] as one string ('{a,b}') unless the application has
-- registered its uuid type; it reads text[] as a list everywhere.
SELECT nasiko_queue.nasiko_queue_enqueue_many($1::jsonb)::text[];

-- ============================================================================
-- Workflows (issue #22, migration 0018).

-- name: workflow_start
-- Start a run (migration 0018's nasiko_queue_workflow_start): $1 id, $2
-- workflow, $3 definition (JSON text), $4 input (JSON text), $5 unique key.
-- Returns the run's id: $1, or the run holding the key.
SELECT nasiko_queue_workflow_start($1, $2, $3::jsonb, $4::jsonb, $5, NULL, NULL);

-- name: workflow_cancel
SELECT nasiko_queue_workflow_cancel($1);

-- name: workflow_retry
SELECT nasiko_queue_workflow_retry($1);

-- name: workflow_signal
-- $1 run, $2 signal name, $3 payload (JSON text).
SELECT nasiko_queue_workflow_signal($1, $2, $3::jsonb);

-- name: workflow_signal_timeout
-- $1 run, $2 step, $3 the timer job's id.
SELECT nasiko_queue_workflow_signal_timeout($1, $2, $3);

-- name: workflow_await_run_end
-- Return once no end of run $1 (a cancel, a failure stopping its steps) is in
-- flight (migration 0034): a step's executor runs it before workflow_step_inputs,
-- whose snapshot then sees that end. Its own statement: a wait inside the read
-- would come after the read's snapshot was taken.
SELECT nasiko_queue_wf_await_run_end($1);

-- name: workflow_apply_due
-- One piece of the workflow transitions that are due (migration 0033), $1 due
-- job ends or fan-out items at most, in one transaction; how many due rows it
-- took (0: nothing due that it could take).
SELECT nasiko_queue_wf_apply_due($1::integer);

-- name: workflow_step_inputs
-- What a step's executor reads: $1 run, $2 step, $3 idx, $4 the job's id ($5:
-- see `results`). The
-- run's state, whether this job is still the step's live job, the run's input,
-- the step's dependencies' results (an object by step name; a mapped step's
-- results are the list of its items' results, in item order), and for a mapped
-- step's item, its item of the list it maps over; whether the step is mapped,
-- by the run's own definition (a deploy that changes the step never reshapes a
-- run in flight). JSON as text.
WITH d AS (
    SELECT r.id, r.state, r.input, nasiko_queue_wf_step_def(r.definition, $2) AS sdef
    FROM nasiko_queue_workflow_runs AS r WHERE r.id = $1
)
SELECT d.state,
       EXISTS (SELECT 1 FROM nasiko_queue_workflow_steps AS s
               WHERE s.run_id = d.id AND s.step = $2 AND s.idx = $3 AND s.job_id = $4
                 AND s.state = 'enqueued') AS live,
       d.input::text AS input,
       -- $5: dependencies whose results the worker holds parsed already (a
       -- fan-out's items would each read the whole list they map over).
       coalesce((SELECT jsonb_object_agg(a, nasiko_queue_wf_step_result(d.id, a))
                 FROM jsonb_array_elements_text(d.sdef -> 'after') AS a
                 WHERE a <> ALL (coalesce($5::text[], '{}'))), '{}')::text
           AS results,
       -- The dependencies' names, by the run's definition: of the results the
       -- worker holds, the step is given these only.
       coalesce(d.sdef -> 'after', '[]')::text AS after,
       -- Its own element, kept on its row (0033); a fan-out started before
       -- that reads it from the list.
       CASE WHEN d.sdef ->> 'map_over' IS NOT NULL
            THEN coalesce(
                (SELECT s.item FROM nasiko_queue_workflow_steps AS s
                 WHERE s.run_id = d.id AND s.step = $2 AND s.idx = $3),
                nasiko_queue_wf_step_result(d.id, d.sdef ->> 'map_over') -> $3::int)::text
       END AS item,
       d.sdef ->> 'map_over' IS NOT NULL AS mapped
FROM d;

-- name: workflow_get
SELECT id, workflow, state, input::text AS input, result::text AS result, failed_step, error,
       unique_key, parent_run, parent_step, created_at, finished_at
FROM nasiko_queue_workflow_runs WHERE id = $1;

-- name: workflow_get_steps
-- A run's step rows, in definition order, then item order (a mapped step's
-- head, idx -1, first).
SELECT s.step, s.idx, s.state, s.job_id, s.child_run, s.result::text AS result, s.error
FROM nasiko_queue_workflow_runs AS r
CROSS JOIN LATERAL jsonb_array_elements(r.definition -> 'steps') WITH ORDINALITY AS d(def, n)
JOIN nasiko_queue_workflow_steps AS s ON s.run_id = r.id AND s.step = d.def ->> 'name'
WHERE r.id = $1
ORDER BY d.n, s.idx;

-- name: workflow_result
-- What `Queue.run_result` reads of run $1: its state, result, failed step and error.
SELECT state, result::text AS result, failed_step, error
FROM nasiko_queue_workflow_runs WHERE id = $1;

-- name: workflow_result_wait_and_read
-- Waiter $2 waits for run $1, then reads it as `workflow_result`, FOR SHARE (as
-- `result_wait_and_read`: a run's end in flight is waited for, not missed, and
-- the wait recorded only if the locked row has not ended).
WITH run AS (
    SELECT state, result, failed_step, error FROM nasiko_queue_workflow_runs WHERE id = $1
    FOR SHARE
), waits AS (
    INSERT INTO nasiko_queue_result_waits (job_id, waiter)
    SELECT $1, $2 FROM run WHERE run.state NOT IN ('completed', 'failed', 'cancelled')
    ON CONFLICT DO NOTHING
)
SELECT state, result::text AS result, failed_step, error FROM run;

-- name: workflow_stuck_runs
-- Runs that are `running` with nothing left to run: no step waits (for a
-- signal or a child run) and no step's job is waiting or running. The rules of
-- migration 0018 keep this empty; tests check it, and an operator's view may.
SELECT r.id, r.workflow FROM nasiko_queue_workflow_runs AS r
WHERE r.state = 'running'
  AND NOT EXISTS (
      SELECT 1 FROM nasiko_queue_workflow_steps AS s
      LEFT JOIN nasiko_queue_jobs AS j ON j.id = s.job_id
      WHERE s.run_id = r.id
        AND (s.state = 'waiting'
             OR (s.state = 'enqueued' AND j.state IN ('available', 'running'))))
  -- A transition due (migration 0033) is yet to be applied: not stuck.
  AND NOT EXISTS (SELECT 1 FROM nasiko_queue_workflow_due AS d WHERE d.run_id = r.id);

-- ============================================================================
-- Run views (issue #22, "see and steer runs"; nasiko_queue.admin.runs).

-- name: workflow_runs_list
-- One page of runs, newest started first: $1 workflow, $2 state, each NULL for
-- any; $3, $4 the (created_at, id) of the last run of the previous page (NULL:
-- the first page); $5 the page size. Each run with how many of its steps there
-- are and how many completed (a mapped step counts once, by its head row).
-- Read in the order of the index of migration 0021 (a row comparison with no
-- OR), stopping after a page of matches.
SELECT r.id, r.workflow, r.state, r.failed_step, r.error, r.parent_run, r.parent_step,
       r.created_at, r.finished_at, c.steps, c.completed
FROM nasiko_queue_workflow_runs AS r
CROSS JOIN LATERAL (
    SELECT count(*)::int AS steps,
           (count(*) FILTER (WHERE h.state = 'completed'))::int AS completed
    FROM (SELECT DISTINCT ON (s.step) s.state FROM nasiko_queue_workflow_steps AS s
          WHERE s.run_id = r.id ORDER BY s.step, s.idx) AS h
) AS c
WHERE ($1::text IS NULL OR r.workflow = $1) AND ($2::text IS NULL OR r.state = $2)
  AND (r.created_at, r.id)
      < (coalesce($3::timestamptz, 'infinity'),
         coalesce($4::uuid, 'ffffffff-ffff-ffff-ffff-ffffffffffff'))
ORDER BY r.created_at DESC, r.id DESC
LIMIT $5;

-- name: workflow_show
-- Run $1 for its view: its row, and its steps' definitions (JSON text) for
-- their kinds and dependencies.
SELECT id, workflow, state, input::text AS input, result::text AS result, failed_step, error,
       unique_key, parent_run, parent_step, created_at, finished_at,
       (definition -> 'steps')::text AS steps
FROM nasiko_queue_workflow_runs WHERE id = $1;

-- name: workflow_step_heads
-- Run $1's steps for its view, in definition order, one row each: the step's
-- head (a mapped step's idx -1 row, any other step's idx 0 row; none yet for a
-- blocked step of a run started before it existed). A mapped step's result is
-- left out: its head holds every item's result, as large as the fan-out; the
-- view shows the results of its items on the page instead.
SELECT d.def ->> 'name' AS step, h.idx, h.state, h.job_id, h.child_run,
       CASE WHEN d.def ->> 'map_over' IS NULL THEN h.result::text END AS result, h.error
FROM nasiko_queue_workflow_runs AS r
CROSS JOIN LATERAL jsonb_array_elements(r.definition -> 'steps') WITH ORDINALITY AS d(def, n)
CROSS JOIN LATERAL (
    SELECT s.idx, s.state, s.job_id, s.child_run, s.result, s.error
    FROM nasiko_queue_workflow_steps AS s
    WHERE s.run_id = r.id AND s.step = d.def ->> 'name'
    ORDER BY s.idx LIMIT 1) AS h
WHERE r.id = $1
ORDER BY d.n;

-- name: workflow_run_counts
-- Run $1's exact counts for its view, whatever page it shows: its step jobs
-- ('job') by step and state, with their attempts, first claim and last end;
-- its mapped steps' items ('item', idx >= 0; a step that is not mapped has
-- one such row too, which the caller ignores) by step and state. Reads every
-- job and item row of the run (a 20,000-item fan-out: about 25 ms; see
-- benchmarks/run_views_scale.py), never sends them.
SELECT 'job' AS kind, payload ->> 'step' AS step, state, count(*)::int AS n,
       sum(attempt)::int AS attempts, min(attempted_at) AS first_attempted_at,
       max(finished_at) AS last_finished_at
FROM nasiko_queue_jobs
WHERE workflow_run = $1
GROUP BY payload ->> 'step', state
UNION ALL
SELECT 'item', step, state, count(*)::int, NULL, NULL, NULL
FROM nasiko_queue_workflow_steps
WHERE run_id = $1 AND idx >= 0
GROUP BY step, state;

-- name: workflow_run_jobs_page
-- One page of the step jobs run $1 ever had (a run's retry gives a step a new
-- job; the old one stays), oldest first, a fan-out's in item order: $2, $3, $4
-- the (created_at, idx, id) of the previous page's last job (NULL: the first
-- page), $5 the page size. Each job with its step row when it is that row's
-- live job (a mapped step's item; for any other step, the caller ignores it),
-- joined to the page only. A 20,000-item fan-out's view sent every job in one
-- answer; a page is sent now, read from the run's jobs by migration 0021's
-- index and sorted (a top-N sort: it reads the run's rows, as its exact counts
-- do, tens of ms for 20,000; an index on the page's order would read a page
-- alone). The signal timers are not step jobs.
SELECT j.id, j.step, j.idx, j.queue, j.state, j.attempt, j.max_attempts, j.error_msg,
       j.created_at, j.run_at, j.attempted_at, j.finished_at, j.claimed_by,
       j.result::text AS result,
       i.state AS item_state, i.result::text AS item_result, i.error AS item_error
FROM (
    SELECT j.id, j.payload ->> 'step' AS step,
           coalesce((j.payload ->> 'idx')::integer, 0) AS idx, j.queue, j.state, j.attempt,
           j.max_attempts, j.error_msg, j.created_at, j.run_at, j.attempted_at,
           j.finished_at, j.claimed_by, j.result
    FROM nasiko_queue_jobs AS j
    WHERE j.workflow_run = $1
      AND (j.created_at, coalesce((j.payload ->> 'idx')::integer, 0), j.id)
          > (coalesce($2::timestamptz, '-infinity'), coalesce($3::integer, -2147483648),
             coalesce($4::uuid, '00000000-0000-0000-0000-000000000000'))
    ORDER BY j.created_at, coalesce((j.payload ->> 'idx')::integer, 0), j.id
    LIMIT $5
) AS j
LEFT JOIN nasiko_queue_workflow_steps AS i
       ON i.run_id = $1 AND i.step = j.step AND i.idx = j.idx AND i.idx >= 0
      AND i.job_id = j.id
ORDER BY j.created_at, j.idx, j.id;

-- name: job_errors_last_of_many
-- The last $2 kept errors of each of the jobs $1 (an array of ids): a page of
-- a run's view shows each job's latest errors, its own page all of them (a
-- job retried 25 times keeps 25). By the index on (job_id, attempt).
SELECT j.id AS job_id, e.attempt, e.at, e.worker_id, e.reason, e.error_type, e.message,
       e.traceback
FROM unnest($1::uuid[]) AS j(id)
CROSS JOIN LATERAL (
    SELECT attempt, at, worker_id, reason, error_type, message, traceback
    FROM nasiko_queue_job_errors AS x
    WHERE x.job_id = j.id
    ORDER BY x.attempt DESC, x.id DESC
    LIMIT $2) AS e;

-- name: metrics_workflow_runs
-- `/metrics`: runs by workflow and state. Exact: a scan of the runs (about
-- 150 ms for 200,000 runs on 2 busy cores; benchmarks/run_views_scale.py).
SELECT workflow, state, count(*) AS n
FROM nasiko_queue_workflow_runs
GROUP BY workflow, state;

-- ============================================================================
-- Limits across replicas (issue #23; Queue.set_limit, nasiko-queue limit).

-- name: limit_set
-- Limits of queue $1 (migration 0020): concurrency $2, rate $3 per $4 seconds,
-- partition key $5 (a job arg), partition mode $6. Replaces the queue's row.
INSERT INTO nasiko_queue_limits AS l
    (queue, concurrency, rate_limit, rate_period, partition_by, partition_mode)
VALUES ($1, $2, $3, make_interval(secs => $4::double precision), $5, $6)
ON CONFLICT (queue) DO UPDATE
SET concurrency = EXCLUDED.concurrency, rate_limit = EXCLUDED.rate_limit,
    rate_period = EXCLUDED.rate_period, partition_by = EXCLUDED.partition_by,
    partition_mode = EXCLUDED.partition_mode, updated_at = now();

-- name: limit_clear
-- Queue $1 unlimited again; returns its row when it had limits. Its starts
-- ledger and its keys' turns go with it.
WITH cleared AS (DELETE FROM nasiko_queue_limits WHERE queue = $1 RETURNING queue),
     starts AS (DELETE FROM nasiko_queue_limit_starts WHERE queue = $1),
     turns AS (DELETE FROM nasiko_queue_limit_turns WHERE queue = $1)
SELECT queue FROM cleared;

-- name: limits_list
-- Every limited queue, its limits and what they hold now: running jobs, and
-- starts in the current rate window.
SELECT l.queue, l.concurrency, l.rate_limit,
       extract(epoch FROM l.rate_period)::double precision AS rate_period,
       l.partition_by, l.partition_mode, l.updated_at,
       (SELECT count(*) FROM nasiko_queue_jobs AS j
        WHERE j.queue = l.queue AND j.state = 'running') AS running,
       (SELECT count(*) FROM nasiko_queue_limit_starts AS s
        WHERE s.queue = l.queue AND s.started_at > now() - l.rate_period) AS window_starts
FROM nasiko_queue_limits AS l
ORDER BY l.queue;
