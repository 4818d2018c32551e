-- nasiko-queue 0003: MCP connectors, their builds, and connector jobs.
--
-- Numbered as in the original (0002 belongs to a part of the original schema the
-- queue does not touch). A build_jobs row now targets exactly one of an agent or
-- a connector.

CREATE TABLE mcp_connectors (
    id                  uuid PRIMARY KEY DEFAULT gen_random_uuid(),
    owner_id            uuid,
    name                text NOT NULL,
    build_status        text CHECK (build_status IN ('pending', 'building', 'running', 'failed')
                                    OR build_status IS NULL),
    url                 text,
    is_active           boolean DEFAULT true,
    container_image_tag text,
    created_at          timestamptz NOT NULL DEFAULT now(),
    updated_at          timestamptz NOT NULL DEFAULT now(),
    -- A connector may be running only once it has somewhere to be reached.
    CONSTRAINT chk_connectors_running_has_url CHECK (build_status IS DISTINCT FROM 'running'
                                                     OR url IS NOT NULL)
);
CREATE TRIGGER trg_mcp_connectors_updated_at BEFORE UPDATE ON mcp_connectors
    FOR EACH ROW EXECUTE FUNCTION nasiko_set_updated_at();

CREATE TABLE mcp_connector_builds (
    id           uuid PRIMARY KEY DEFAULT gen_random_uuid(),
    connector_id uuid NOT NULL REFERENCES mcp_connectors (id) ON DELETE CASCADE,
    owner_id     uuid NOT NULL,
    version_tag  text NOT NULL,
    status       text NOT NULL DEFAULT 'pending'
                 CHECK (status IN ('pending', 'building', 'success', 'failed')),
    error_msg    text,
    image_tag    text,
    completed_at timestamptz,
    created_at   timestamptz NOT NULL DEFAULT now(),
    updated_at   timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX idx_mcp_connector_builds_connector ON mcp_connector_builds (connector_id, created_at DESC);
CREATE TRIGGER trg_mcp_connector_builds_updated_at BEFORE UPDATE ON mcp_connector_builds
    FOR EACH ROW EXECUTE FUNCTION nasiko_set_updated_at();

ALTER TABLE build_jobs
    ADD COLUMN connector_id uuid NULL REFERENCES mcp_connectors (id) ON DELETE CASCADE;
ALTER TABLE build_jobs ADD CONSTRAINT chk_build_jobs_one_target CHECK (
    (agent_id IS NOT NULL AND connector_id IS NULL)
    OR (agent_id IS NULL AND connector_id IS NOT NULL)
);
CREATE INDEX idx_build_jobs_connector ON build_jobs (connector_id) WHERE connector_id IS NOT NULL;
