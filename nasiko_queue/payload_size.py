"""
A payload's size as the claim counts it, known before it is sent.

The claim (and the SQL function `nasiko_queue_enqueue`, migration 0019) counts
`octet_length(payload::text)`: the bytes of the text PostgreSQL prints for the
stored jsonb, which is not the compact JSON the codec writes. jsonb prints a
space after each `,` and `:`, and a number as plain digits (`1e-07` is
`0.0000001`). Counting the compact text at enqueue accepted payloads that the
claim then discarded as over the limit (an `items` list of 480 ones: 984 bytes
compact, 1,466 stored).

Without a number in exponent notation, the stored text is never longer than
twice the compact one (each separator gains one space), so such a payload under
half the limit (the usual case: the default limit is 1 MiB) is accepted on its
compact length alone. Any other (`1e+100` prints as 101 digits) is parsed and
counted as jsonb prints it.
"""

from __future__ import annotations

import json
import re
from decimal import Decimal
from typing import Any

#: A number with an exponent, such as 1e+100, where compact JSON puts a value:
#: after `:`, `[` or `,` and before `,`, `]` or `}`. A string that happens to
#: hold the like only sends the text to the exact count; a hex id ("3e4f...")
#: does not.
_EXPONENT = re.compile(r"(?<=[:\[,])-?[0-9]+(?:\.[0-9]+)?[eE][+-]?[0-9]+(?=[,\]}])")


def compact_size(text: str) -> int:
    """The UTF-8 bytes of `text` (ASCII text, the usual, without a copy)."""
    return len(text) if text.isascii() else len(text.encode("utf-8"))


def stored_size(text: str, *, limit: int) -> int:
    """
    `octet_length(text::jsonb::text)` for a JSON text the codec wrote, or its
    compact size when that is at most half of `limit` and no number has an
    exponent (the stored size is then within `limit` too, all the caller asks).
    """
    size = compact_size(text)
    if 2 * size <= limit and _EXPONENT.search(text) is None:
        return size
    return _printed(json.loads(text, parse_float=Decimal))


def _printed(value: Any) -> int:
    """Bytes of `value` as jsonb prints it (PostgreSQL's JsonbToCString)."""
    if isinstance(value, str):
        return _string(value)
    if isinstance(value, dict):
        items = sum(_string(k) + 2 + _printed(v) for k, v in value.items())
        return 2 + items + 2 * max(len(value) - 1, 0)
    if isinstance(value, list):
        return 2 + sum(_printed(v) for v in value) + 2 * max(len(value) - 1, 0)
    if value is True or value is None:
        return 4
    if value is False:
        return 5
    if isinstance(value, Decimal):
        # numeric prints plain notation, keeping the digits given after the
        # point ('1.50' stays, '1e-07' is '0.0000001'); -0.0 prints as 0.0, one
        # byte less: counted as the larger, which only ever refuses early.
        return len(format(value, "f"))
    return len(str(value))  # an int (JSON's integers print as written)


def _string(value: str) -> int:
    # jsonb escapes what json.dumps escapes without ensure_ascii: the quote, the
    # backslash and control characters; everything else is UTF-8 as it is.
    return compact_size(json.dumps(value, ensure_ascii=False))
