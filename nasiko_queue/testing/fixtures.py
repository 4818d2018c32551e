"""
Helpers for tests and demos that play the application's part around the queue.

The queue never creates agents, connectors or build rows: the application does,
in the same transaction as the job (the original's enqueue points). These
helpers do the same with the fewest columns, so that tests, the demo and users'
own test suites can set up realistic jobs in a line or two.

.. versionadded:: 0.1.0
"""

from __future__ import annotations

import uuid
from typing import Any, Protocol
from uuid import UUID

import attrs

from ..builds.payloads import (
    Clone,
    GithubClone,
    GithubSource,
    McpServerUpload,
    Payload,
    Rollback,
    StandaloneBuild,
    Update,
    Upload,
    ZipSource,
)
from ..db.statements import Q
from ..queue import Queue

#: The seven built-in kinds, in the original's order.
KINDS = ("Upload", "Update", "Rollback", "StandaloneBuild", "Clone", "GithubClone",
         "McpServerUpload")


class Sql(Protocol):
    """A `Database` or a `Transaction`: anything that runs a statement."""

    async def execute(self, query: str, *args: Any) -> str: ...

    async def fetchval(self, query: str, *args: Any) -> Any: ...


async def insert_agent(
    sql: Sql,
    *,
    owner_id: UUID,
    name: str | None = None,
    status: str = "deploying",
    deleted: bool = False,
) -> UUID:
    """An agent row (soft-deleted when `deleted`)."""
    agent_id: UUID = await sql.fetchval(
        Q.agent_insert, owner_id, name or f"agent-{uuid.uuid4().hex[:8]}", status, deleted
    )
    return agent_id


async def insert_agent_build(
    sql: Sql, agent_id: UUID, *, status: str = "queued", version_tag: str = "v1"
) -> UUID:
    build_id: UUID = await sql.fetchval(Q.agent_build_insert, agent_id, version_tag, status)
    return build_id


async def insert_connector(sql: Sql, *, owner_id: UUID, name: str | None = None) -> UUID:
    connector_id: UUID = await sql.fetchval(
        Q.connector_insert, owner_id, name or f"mcp-{uuid.uuid4().hex[:8]}"
    )
    return connector_id


async def insert_connector_build(
    sql: Sql, connector_id: UUID, *, owner_id: UUID, status: str = "pending",
    version_tag: str = "v1",
) -> UUID:
    build_id: UUID = await sql.fetchval(
        Q.connector_build_insert, connector_id, owner_id, version_tag, status
    )
    return build_id


async def set_build_status(sql: Sql, payload: Payload, status: str) -> None:
    """What an executor does to report: write its build row (the worker reads it)."""
    if payload.target().connector_id is not None:
        await sql.execute(Q.connector_build_set_status, payload.build_id, status)
    else:
        await sql.execute(Q.agent_build_set_status, payload.build_id, status)


def make_payload(
    kind: str,
    *,
    target_id: UUID,
    build_id: UUID,
    owner_id: UUID,
    name: str = "demo",
    env: dict[str, str] | None = None,
) -> Payload:
    """
    A valid payload of a built-in `kind` for the given target and build row.

    `env` goes to the kinds that have one (Upload, Clone, GithubClone, McpServerUpload),
    whose values are sealed at enqueue: a non-empty one needs a `Queue` with a master key
    (or, for all but McpServerUpload, `QueueConfig(seal_agent_env=False)`).
    """
    common_env = dict(env or {})
    if kind == "Upload":
        return Upload(build_id=build_id, agent_id=target_id, owner_id=owner_id,
                      upload_id=str(build_id), name=name, zip_path=f"/srv/uploads/{name}.zip",
                      image_tag=f"{name}:v1", ports=(8000,), env=common_env, writable=False)
    if kind == "Update":
        return Update(build_id=build_id, agent_id=target_id, owner_id=owner_id,
                      agent_owner_id=owner_id, name=name, image_tag=f"{name}:v2",
                      new_version="v2", prev_version="v1", writable=False)
    if kind == "Rollback":
        return Rollback(rollback_build_id=build_id, agent_id=target_id, caller_id=owner_id,
                        agent_owner_id=owner_id, agent_name=name, target_version="v1",
                        target_image_tag=f"{name}:v1", writable=False)
    if kind == "StandaloneBuild":
        return StandaloneBuild(build_id=build_id, agent_id=target_id, agent_name=name,
                               github_url=f"https://github.com/example/{name}",
                               version_tag="v1")
    if kind == "Clone":
        return Clone(build_id=build_id, agent_id=target_id, owner_id=owner_id,
                     upload_id=str(build_id), name=name, tar_gz_path=f"/srv/uploads/{name}.tar.gz",
                     image_tag=f"{name}:v1", ports=(8000,), env=common_env)
    if kind == "GithubClone":
        return GithubClone(build_id=build_id, agent_id=target_id, owner_id=owner_id,
                           upload_id=str(build_id), name=name,
                           repo_full_name=f"example/{name}", branch="main",
                           image_tag=f"{name}:v1", ports=(8000,), env=common_env)
    if kind == "McpServerUpload":
        source = (GithubSource(url=f"https://github.com/example/{name}") if len(name) % 2
                  else ZipSource(zip_path=f"/srv/uploads/{name}.zip"))
        return McpServerUpload(build_id=build_id, connector_id=target_id, owner_id=owner_id,
                               name=name, source=source, image_tag=f"{name}:v1",
                               env=common_env)
    raise ValueError(f"unknown built-in kind {kind!r}; expected one of {', '.join(KINDS)}")


@attrs.frozen(kw_only=True)
class Enqueued:
    """What `enqueue_with_target` created."""

    job_id: UUID
    payload: Payload
    owner_id: UUID
    #: The agent id, or the connector id for McpServerUpload.
    target_id: UUID
    build_id: UUID

    @property
    def is_connector(self) -> bool:
        return self.payload.kind == "McpServerUpload"


async def enqueue_with_target(
    queue: Queue,
    kind: str,
    *,
    name: str | None = None,
    owner_id: UUID | None = None,
    agent_status: str = "deploying",
    prior_success: bool = False,
    deleted: bool = False,
    env: dict[str, str] | None = None,
) -> Enqueued:
    """
    Do what an enqueue point of the original does, in one transaction.

    Creates the target (a 'deploying' agent, or a pending connector for
    McpServerUpload), optionally an earlier successful build, the job's own
    build row ('queued' / 'pending') and the job, then wakes local workers
    after commit.
    """
    owner = owner_id or uuid.uuid4()
    label = name or f"{kind.lower()}-{uuid.uuid4().hex[:6]}"
    async with queue.db.transaction() as tx:
        if kind == "McpServerUpload":
            target = await insert_connector(tx, owner_id=owner, name=label)
            if prior_success:
                await insert_connector_build(tx, target, owner_id=owner, status="success",
                                             version_tag="v0")
            build = await insert_connector_build(tx, target, owner_id=owner)
        else:
            target = await insert_agent(tx, owner_id=owner, name=label, status=agent_status,
                                        deleted=deleted)
            if prior_success:
                await insert_agent_build(tx, target, status="success", version_tag="v0")
            build = await insert_agent_build(tx, target)
        payload = make_payload(kind, target_id=target, build_id=build, owner_id=owner,
                               name=label, env=env)
        job_id = await queue.enqueue(payload, tx=tx, owner_id=owner)
    return Enqueued(job_id=job_id, payload=payload, owner_id=owner, target_id=target,
                    build_id=build)
