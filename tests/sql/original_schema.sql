-- The Nasiko control plane's own schema, as its migrations leave it (the build
-- jobs' tables and what they reference), written from the reference's description
-- of the original (tables 2.1-2.6): the database `migrate` must adopt. Test SQL:
-- the application's, never the engine's. Columns the queue never touches are kept
-- (a sample of them) so that adoption is seen to leave them alone.

CREATE TABLE users (
    id         uuid PRIMARY KEY DEFAULT gen_random_uuid(),
    email      text NOT NULL UNIQUE,
    created_at timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE llm_configs (
    id   uuid PRIMARY KEY DEFAULT gen_random_uuid(),
    name text NOT NULL
);

CREATE FUNCTION update_updated_at_column() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    NEW.updated_at = now();
    RETURN NEW;
END $$;

CREATE TABLE agents (
    id             uuid PRIMARY KEY DEFAULT gen_random_uuid(),
    name           text NOT NULL,
    owner_id       uuid NOT NULL REFERENCES users(id),
    url            text,
    version        text NOT NULL DEFAULT '1.0.0',
    image          text,
    status         text NOT NULL DEFAULT 'registered',
    writable       boolean NOT NULL DEFAULT false,
    writable_path  text,
    deleted_at     timestamptz,
    display_name   text,
    description    text,
    skills         jsonb NOT NULL DEFAULT '[]',
    tags           text[] NOT NULL DEFAULT '{}',
    llm_config_id  uuid REFERENCES llm_configs(id),
    inbound_format text NOT NULL DEFAULT 'openai'
                   CHECK (inbound_format IN ('openai', 'anthropic', 'gemini')),
    pinned_model   text,
    created_at     timestamptz NOT NULL DEFAULT now(),
    updated_at     timestamptz NOT NULL DEFAULT now()
);
CREATE UNIQUE INDEX agents_owner_name_active_uniq ON agents (owner_id, name)
    WHERE deleted_at IS NULL;
CREATE TRIGGER trg_agents_updated_at BEFORE UPDATE ON agents
    FOR EACH ROW EXECUTE FUNCTION update_updated_at_column();

CREATE TABLE agent_versions (
    id       uuid PRIMARY KEY DEFAULT gen_random_uuid(),
    agent_id uuid NOT NULL REFERENCES agents(id) ON DELETE CASCADE,
    tag      text NOT NULL
);

CREATE TYPE build_status AS ENUM ('queued', 'building', 'success', 'failed');

CREATE TABLE agent_builds (
    id              uuid PRIMARY KEY DEFAULT gen_random_uuid(),
    agent_id        uuid NOT NULL REFERENCES agents(id) ON DELETE CASCADE,
    github_url      text,
    commit_hash     text,
    version_tag     text NOT NULL,
    image_reference text NOT NULL,
    status          build_status NOT NULL DEFAULT 'queued',
    logs_url        text,
    logs            text,
    k8s_job_name    varchar(255),
    triggered_by    uuid REFERENCES users(id) ON DELETE SET NULL,
    created_at      timestamptz NOT NULL DEFAULT now(),
    updated_at      timestamptz NOT NULL DEFAULT now(),
    version_id      uuid REFERENCES agent_versions(id) ON DELETE SET NULL
);
CREATE INDEX idx_builds_agent ON agent_builds (agent_id);
CREATE INDEX idx_agent_builds_status ON agent_builds (status);
CREATE INDEX idx_agent_builds_queued ON agent_builds (status) WHERE status = 'queued';
CREATE INDEX idx_agent_builds_recent ON agent_builds (agent_id, created_at DESC);
CREATE TRIGGER trg_agent_builds_updated_at BEFORE UPDATE ON agent_builds
    FOR EACH ROW EXECUTE FUNCTION update_updated_at_column();

CREATE TYPE mcp_connector_source_kind AS ENUM ('external_url', 'uploaded_build');

CREATE TABLE mcp_connectors (
    id                     uuid PRIMARY KEY DEFAULT gen_random_uuid(),
    provider_type          text NOT NULL CHECK (provider_type IN ('composio', 'mcp_server')),
    owner_id               uuid REFERENCES users(id) ON DELETE RESTRICT,
    name                   text NOT NULL,
    display_name           text,
    auth_config_id         text,
    url                    text,
    transport              text DEFAULT 'streamable_http',
    is_active              boolean DEFAULT true,
    source_kind            mcp_connector_source_kind NOT NULL DEFAULT 'external_url',
    build_status           text CHECK (build_status IN ('pending', 'building', 'running',
                                                        'failed') OR build_status IS NULL),
    build_secrets_env      jsonb NOT NULL DEFAULT '{}',
    container_image_tag    text,
    setup_status           text CHECK (setup_status IN ('pending', 'active', 'failed')),
    created_at             timestamptz NOT NULL DEFAULT now(),
    updated_at             timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT chk_connectors_provider_fields CHECK (
        source_kind <> 'uploaded_build' OR (auth_config_id IS NULL AND (
            build_status IN ('pending', 'building', 'failed')
            OR (build_status = 'running' AND url IS NOT NULL))))
);
CREATE UNIQUE INDEX uq_mcp_connectors_name_owner ON mcp_connectors (name, owner_id)
    WHERE owner_id IS NOT NULL;
CREATE TRIGGER trg_mcp_connectors_updated_at BEFORE UPDATE ON mcp_connectors
    FOR EACH ROW EXECUTE FUNCTION update_updated_at_column();

CREATE TABLE mcp_connector_builds (
    id               uuid PRIMARY KEY DEFAULT gen_random_uuid(),
    connector_id     uuid NOT NULL REFERENCES mcp_connectors(id) ON DELETE CASCADE,
    owner_id         uuid NOT NULL REFERENCES users(id) ON DELETE RESTRICT,
    version_tag      text NOT NULL,
    github_url       text,
    source_key       text,
    image_tag        text,
    detected_runtime text,
    status           text NOT NULL DEFAULT 'pending'
                     CHECK (status IN ('pending', 'building', 'success', 'failed')),
    error_msg        text,
    created_at       timestamptz NOT NULL DEFAULT now(),
    updated_at       timestamptz NOT NULL DEFAULT now(),
    completed_at     timestamptz
);
CREATE INDEX idx_mcp_connector_builds_connector
    ON mcp_connector_builds (connector_id, created_at DESC);

CREATE TABLE build_jobs (
    id           uuid PRIMARY KEY DEFAULT gen_random_uuid(),
    agent_id     uuid NULL REFERENCES agents(id) ON DELETE CASCADE,
    owner_id     uuid NOT NULL,
    payload      jsonb NOT NULL,
    status       text NOT NULL DEFAULT 'pending'
                 CHECK (status IN ('pending', 'in_progress', 'done', 'failed')),
    attempt      integer NOT NULL DEFAULT 0,
    error_msg    text,
    created_at   timestamptz NOT NULL DEFAULT now(),
    picked_at    timestamptz,
    completed_at timestamptz,
    connector_id uuid NULL REFERENCES mcp_connectors(id) ON DELETE CASCADE,
    CONSTRAINT chk_build_jobs_one_target CHECK (
        (agent_id IS NOT NULL AND connector_id IS NULL)
        OR (agent_id IS NULL AND connector_id IS NOT NULL))
);
CREATE INDEX build_jobs_work_queue ON build_jobs (status, created_at)
    WHERE status IN ('pending', 'in_progress');
CREATE INDEX idx_build_jobs_connector ON build_jobs (connector_id)
    WHERE connector_id IS NOT NULL;
