-- nasiko-queue 0004: index the job rows of an agent.
--
-- Deleting an agent (terminalization, or the application's own delete) cascades
-- to build_jobs by agent_id. Without an index that cascade reads the whole job
-- history, inside the transaction that terminalizes the target. Connectors
-- have had theirs since 0003.
CREATE INDEX idx_build_jobs_agent ON build_jobs (agent_id) WHERE agent_id IS NOT NULL;
