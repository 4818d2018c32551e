"""
Claim statements' plumbing shared by every store: sending a claim on an
engine connection (`fetch_claiming`), its variant that does not wait for the
WAL flush, and ending the server process of a claim whose answer was lost.
"""

from __future__ import annotations

from uuid import UUID

import asyncpg

from ..engine.contracts import ClaimOutcomeUnknown, LostClaim
from ..errors import OutcomeUnknown
from .database import Database
from .statements import Q


async def fetch_claiming(db: Database, sql: str, args: tuple[object, ...], *,
                         token: UUID, claims: bool, bound: float) -> list[asyncpg.Record]:
    """
    Run a statement that claims jobs (when `claims`) with token `token`, bounded
    on both sides of the bridge and on a generic plan. A lost answer raises
    `ClaimOutcomeUnknown` naming the token (plain `OutcomeUnknown` when the
    statement claims nothing: it is safe to send again).
    """
    try:
        rows: list[asyncpg.Record] = await db.run_bounded(
            lambda conn: conn.fetch(sql, *args), bound=bound, generic=True)
    except OutcomeUnknown as exc:
        if claims:
            raise ClaimOutcomeUnknown(LostClaim(token, exc.backend_pid), exc) from exc
        raise
    return rows


def without_flush_wait(claim_sql: str) -> str:
    """
    A claim statement whose commit does not wait for the WAL flush
    (`QueueConfig.claim_synchronous_commit` off): the same statement as a
    data-modifying CTE, beside a `set_config` that turns `synchronous_commit`
    off for this statement's own transaction only (the server applies the
    setting at commit, which is why it works for a single statement). Built
    from the statement rather than written out a second time, so the two
    cannot drift apart; same arguments, same rows.
    """
    return ("WITH claimed AS (\n" + claim_sql + "\n)\n"
            "SELECT claimed.* FROM claimed,\n"
            "     (SELECT set_config('synchronous_commit', 'off', true)) AS no_flush_wait")


async def end_claims_backend(conn: asyncpg.Connection, claim: LostClaim, bound: float) -> None:
    """
    End the server process that received a claim whose answer was lost, and
    make sure it is gone: only then is the claim settled (committed or rolled
    back, not still on its way), and what it took can be given back.
    """
    if claim.backend_pid is None or claim.backend_pid == conn.get_server_pid():
        return
    wait_ms = max(1, int(bound * 1000 / 2))
    await conn.fetchval(Q.backend_end, claim.backend_pid, wait_ms, timeout=bound)
    if await conn.fetchval(Q.backend_alive, claim.backend_pid, timeout=bound):
        raise TimeoutError(f"server process {claim.backend_pid} has not ended yet")


