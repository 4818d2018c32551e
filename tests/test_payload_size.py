"""
A payload's size is counted once, as the claim counts it: the bytes of the
stored jsonb's text (`octet_length(payload::text)`), which prints a space after
each `,` and `:` and numbers in plain notation. The enqueue counted the compact
JSON instead, so a payload it accepted could be discarded by the claim as over
the limit ("invalid payload"), and a build job's target terminalized with it.
"""

from __future__ import annotations

import json
from typing import Any

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nasiko_queue import Database, PayloadTooLarge, Queue
from nasiko_queue.payload_size import stored_size
from nasiko_queue.plain.store import PlainJobStore

LIMIT = 1000


def _limited(queue: Queue) -> Queue:
    return Queue(queue.db, config=attrs.evolve(queue.config, max_payload_bytes=LIMIT))


async def test_a_payload_over_the_limit_as_stored_is_refused_at_enqueue(queue: Queue) -> None:
    """480 ones: 984 bytes compact, 1,466 as stored. Refused at enqueue (it
    used to be accepted, then discarded by the claim as over the limit)."""
    limited = _limited(queue)
    items = {"items": [1] * 480}
    assert len(json.dumps({"kind": "tally", "args": items}, separators=(",", ":"))) < LIMIT
    with pytest.raises(PayloadTooLarge, match=r"tally payload is 1\d{3} bytes; the limit is 1000"):
        await limited.enqueue_json("tally", items)
    assert await queue.db.fetchval("SELECT count(*) FROM nasiko_queue_jobs") == 0


async def test_a_payload_the_enqueue_accepts_is_sent_by_the_claim(queue: Queue) -> None:
    """The largest list of ones the enqueue takes under the limit: its stored
    size is within the limit, and the claim sends it (not None, "too large")."""
    limited = _limited(queue)
    n = 0
    while True:  # grow until refused; the last accepted is at the edge
        try:
            await limited.enqueue_json("tally", {"items": [1] * (n + 1)})
        except PayloadTooLarge:
            break
        n += 1
    assert 300 < n < 480
    sizes = await queue.db.fetch(
        "SELECT octet_length(payload::text) AS size FROM nasiko_queue_jobs")
    assert max(r["size"] for r in sizes) <= LIMIT
    assert max(r["size"] for r in sizes) > LIMIT - 5  # the edge, not far below it
    store = PlainJobStore(queue.db, limited.config, "default", lambda: None)
    claimed = await store.claim(1000)
    assert len(claimed) == n
    assert all(job.payload is not None for job in claimed)


#: JSON values as the codec may write them (no NUL: jsonb refuses it in text).
_TEXT = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"),
                max_size=8)
_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | _TEXT
    | st.floats(allow_nan=False, allow_infinity=False),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_TEXT, inner, max_size=4),
    max_leaves=12,
)


async def test_the_count_matches_the_servers(db: Database) -> None:
    """For any JSON the codec may write (compact, its non-ASCII escaped or not),
    the count on the exact path (limit 0) is what the server counts; or more by
    a byte per -0.0, which numeric prints as 0.0: never less. Hypothesis draws
    the texts (its examples cannot await), the server counts them in one query."""
    texts: list[str] = []

    @settings(max_examples=400, deadline=None, database=None)
    @given(value=_JSON, ascii_only=st.booleans())
    def draw(value: Any, ascii_only: bool) -> None:
        texts.append(json.dumps(value, separators=(",", ":"), ensure_ascii=ascii_only))

    draw()
    assert len(texts) > 300
    counts = await db.fetch(
        "SELECT octet_length(t::jsonb::text) AS n FROM unnest($1::text[]) WITH ORDINALITY "
        "AS u(t, i) ORDER BY i", texts)
    wrong = [(t, row["n"], stored_size(t, limit=0)) for t, row in zip(texts, counts, strict=True)
             if not row["n"] <= stored_size(t, limit=0) <= row["n"] + t.count("-0.0")]
    assert not wrong, f"(text, server, counted), shortest first: {sorted(wrong, key=len)[:5]}"


async def test_a_payload_under_half_the_limit_is_counted_compact(db: Database) -> None:
    """The fast path: nothing is parsed while even twice the compact size fits
    and no number has an exponent; else the exact count. 1e+100 is 6 bytes
    compact and 101 stored: never on the fast path."""
    plain = json.dumps({"items": [0.25] * 10}, separators=(",", ":"))
    assert stored_size(plain, limit=2 * len(plain)) == len(plain)
    assert stored_size(plain, limit=2 * len(plain) - 1) == await db.fetchval(
        "SELECT octet_length($1::jsonb::text)", plain)
    huge = json.dumps({"items": [1e100] * 10}, separators=(",", ":"))
    server = await db.fetchval("SELECT octet_length($1::jsonb::text)", huge)
    assert server > 10 * len(huge)
    assert stored_size(huge, limit=10 * len(huge)) == server


def test_ids_in_strings_keep_the_fast_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """Hex ids ("3e4f...", a digit then an e) are not numbers: such a payload under
    half the limit is counted without parsing (found by review: most payloads
    with a uuid took the slow path, 5 times slower at 9 KB)."""
    import uuid

    import nasiko_queue.payload_size as payload_size

    def no_parse(*_args: Any, **_kwargs: Any) -> Any:
        raise AssertionError("parsed on the fast path")

    ids = [str(uuid.UUID(int=0x3E4F << 112 | n)) for n in range(50)]
    text = json.dumps({"ids": ids, "n": 1.5, "when": "2026-12-06T20:00:00e"},
                      separators=(",", ":"))
    monkeypatch.setattr(payload_size.json, "loads", no_parse)
    assert stored_size(text, limit=2 * len(text)) == len(text)
