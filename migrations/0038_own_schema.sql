-- The queue moves into a schema of its own (issue #46).
--
-- Up to 0037 the migrator created the queue's objects in the migrating
-- session's schema, usually `public`. From now on they live in the queue's
-- schema (`nasiko_queue`, or what NASIKO_QUEUE_SCHEMA names; the migrator has
-- created it and names it in the setting `nasiko_queue.schema`). On a database
-- migrated before, this moves every table, view, sequence, function and type
-- whose name begins with `nasiko_queue_` into it, the migrator's own
-- bookkeeping table included. ALTER ... SET SCHEMA keeps each object's rows,
-- indexes, constraints, triggers, grants and OID, so the jobs waiting, running
-- and ended stay as they are (their workers must be stopped first: a
-- connection of the old version names the objects where they were).
--
-- The build jobs' tables (agents, agent_builds, build_jobs, mcp_connectors,
-- mcp_connector_builds), the build_status type and nasiko_set_updated_at stay
-- where they are: in a database the original control plane created they are
-- that application's, and its Rust worker names them there.
--
-- On a new database there is nothing to move: the files before this one
-- already ran in the queue's schema. After this file the migrator gives every
-- moved function its search path (migrations_functions_unpathed).
DO $$
DECLARE
    target text := coalesce(nullif(current_setting('nasiko_queue.schema', true), ''),
                            'nasiko_queue');
    source text;
    clash text;
    r record;
BEGIN
    SELECT n.nspname INTO source
    FROM pg_class AS c JOIN pg_namespace AS n ON n.oid = c.relnamespace
    WHERE c.relname = 'nasiko_queue_migrations' AND c.relkind = 'r' AND n.nspname <> target
    ORDER BY n.nspname LIMIT 1;
    IF source IS NULL THEN
        RETURN;
    END IF;
    EXECUTE format('CREATE SCHEMA IF NOT EXISTS %I', target);
    -- A name in both (a replica of the old version migrated again after the
    -- new one had created the schema): nothing is moved, and the operator
    -- decides which copy to keep.
    SELECT string_agg(c.relname, ', ' ORDER BY c.relname) INTO clash
    FROM pg_class AS c JOIN pg_namespace AS n ON n.oid = c.relnamespace
    WHERE n.nspname = source AND c.relname LIKE 'nasiko\_queue\_%'
      AND c.relkind IN ('r', 'p', 'v', 'm', 'S')
      AND to_regclass(format('%I.%I', target, c.relname)) IS NOT NULL;
    IF clash IS NOT NULL THEN
        RAISE EXCEPTION 'the queue''s tables are in schema % and in schema % (%): keep one copy, drop the other, then migrate again',
            source, target, clash;
    END IF;

    -- Tables first: their indexes, constraints, triggers, row types and owned
    -- sequences go with them.
    FOR r IN
        SELECT c.relname, c.relkind
        FROM pg_class AS c JOIN pg_namespace AS n ON n.oid = c.relnamespace
        WHERE n.nspname = source AND c.relname LIKE 'nasiko\_queue\_%'
          AND c.relkind IN ('r', 'p', 'v', 'm')
        ORDER BY c.relkind, c.relname
    LOOP
        EXECUTE format('ALTER %s %I.%I SET SCHEMA %I',
                       CASE r.relkind WHEN 'v' THEN 'VIEW'
                                      WHEN 'm' THEN 'MATERIALIZED VIEW'
                                      ELSE 'TABLE' END,
                       source, r.relname, target);
    END LOOP;
    -- Sequences that no moved table owned.
    FOR r IN
        SELECT c.relname
        FROM pg_class AS c JOIN pg_namespace AS n ON n.oid = c.relnamespace
        WHERE n.nspname = source AND c.relname LIKE 'nasiko\_queue\_%' AND c.relkind = 'S'
    LOOP
        EXECUTE format('ALTER SEQUENCE %I.%I SET SCHEMA %I', source, r.relname, target);
    END LOOP;
    -- Functions (trigger functions included; a trigger names its function by OID).
    FOR r IN
        SELECT p.oid::regprocedure AS fn
        FROM pg_proc AS p JOIN pg_namespace AS n ON n.oid = p.pronamespace
        WHERE n.nspname = source AND p.proname LIKE 'nasiko\_queue\_%'
    LOOP
        EXECUTE format('ALTER ROUTINE %s SET SCHEMA %I', r.fn, target);
    END LOOP;
    -- Types of their own (enums, domains, composite types); a table's row type
    -- and the array types went with their element.
    FOR r IN
        SELECT t.typname
        FROM pg_type AS t JOIN pg_namespace AS n ON n.oid = t.typnamespace
        WHERE n.nspname = source AND t.typname LIKE 'nasiko\_queue\_%'
          AND t.typtype IN ('e', 'd', 'c', 'r', 'm')
          AND NOT EXISTS (SELECT 1 FROM pg_type AS e WHERE e.typarray = t.oid)
          AND (t.typrelid = 0
               OR (SELECT c.relkind FROM pg_class AS c WHERE c.oid = t.typrelid) = 'c')
    LOOP
        EXECUTE format('ALTER TYPE %I.%I SET SCHEMA %I', source, r.typname, target);
    END LOOP;
END
$$;
