-- nasiko-queue 0001: agents, their builds, and the build_jobs queue.
--
-- Of the original's `agents` and `agent_builds` this keeps the columns the queue
-- touches, with the original's types, defaults and cascades. There is no `users`
-- table here, so the owner columns carry no foreign key.

CREATE OR REPLACE FUNCTION nasiko_set_updated_at() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    NEW.updated_at := now();
    RETURN NEW;
END;
$$;

CREATE TABLE agents (
    id            uuid PRIMARY KEY DEFAULT gen_random_uuid(),
    owner_id      uuid NOT NULL,
    name          text NOT NULL,
    -- Free text on purpose (no CHECK): registered, deploying, running, failed, stopped.
    status        text NOT NULL DEFAULT 'registered',
    version       text NOT NULL DEFAULT '1.0.0',
    image         text,
    url           text,
    writable      boolean NOT NULL DEFAULT false,
    writable_path text,
    deleted_at    timestamptz,
    created_at    timestamptz NOT NULL DEFAULT now(),
    updated_at    timestamptz NOT NULL DEFAULT now()
);
CREATE UNIQUE INDEX agents_owner_name_active_uniq ON agents (owner_id, name) WHERE deleted_at IS NULL;
CREATE TRIGGER trg_agents_updated_at BEFORE UPDATE ON agents
    FOR EACH ROW EXECUTE FUNCTION nasiko_set_updated_at();

CREATE TYPE build_status AS ENUM ('queued', 'building', 'success', 'failed');

CREATE TABLE agent_builds (
    id              uuid PRIMARY KEY DEFAULT gen_random_uuid(),
    agent_id        uuid NOT NULL REFERENCES agents (id) ON DELETE CASCADE,
    version_tag     text NOT NULL,
    image_reference text NOT NULL,
    status          build_status NOT NULL DEFAULT 'queued',
    triggered_by    uuid,
    created_at      timestamptz NOT NULL DEFAULT now(),
    updated_at      timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX idx_builds_agent ON agent_builds (agent_id);
CREATE INDEX idx_agent_builds_status ON agent_builds (status);
CREATE TRIGGER trg_agent_builds_updated_at BEFORE UPDATE ON agent_builds
    FOR EACH ROW EXECUTE FUNCTION nasiko_set_updated_at();

CREATE TABLE build_jobs (
    id           uuid PRIMARY KEY DEFAULT gen_random_uuid(),
    agent_id     uuid NULL REFERENCES agents (id) ON DELETE CASCADE,
    -- The user who caused the job (the caller for updates and rollbacks); no FK.
    owner_id     uuid NOT NULL,
    payload      jsonb NOT NULL,
    -- TEXT + CHECK rather than an enum: adding a state later is a plain migration.
    status       text NOT NULL DEFAULT 'pending'
                 CHECK (status IN ('pending', 'in_progress', 'done', 'failed')),
    attempt      integer NOT NULL DEFAULT 0,
    error_msg    text,
    created_at   timestamptz NOT NULL DEFAULT now(),
    picked_at    timestamptz,
    completed_at timestamptz
);
-- The claim and the sweeps only ever look at live rows; finished history stays
-- out of this index, so the claim costs the same with a year of history.
CREATE INDEX build_jobs_work_queue ON build_jobs (status, created_at)
    WHERE status IN ('pending', 'in_progress');
