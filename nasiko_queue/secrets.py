"""
Secret values in job payloads: a wrapper that will not print, and the box that seals them.

A payload sits in `build_jobs.payload` for as long as the row lives, and rows are read by
people debugging the queue. So the values of a *sealed* payload field (docs/rules.md §2:
the `env` of McpServerUpload, and by default of Upload, Clone and GithubClone) are stored
encrypted, and in memory they travel as `Secret`, whose repr is a row of stars, so that no
log line, traceback or `print(payload)` shows them.

Each owner gets their own key, derived from one master key, so that a value sealed for one
owner cannot be moved into another owner's job and decrypted there. The value is also bound
to its env key name, so that it cannot be moved to another key of the same owner either.
"""

from __future__ import annotations

import base64
import binascii
import hmac
import os
import re
from typing import Final
from uuid import UUID

import attrs
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from .errors import ConfigurationError, InvalidPayload, SecretDecryptError

#: Length of the master key and of every derived key, in bytes (AES-256).
KEY_BYTES: Final = 32
#: HKDF salt; the version in it lets a future scheme derive different keys.
_HKDF_SALT: Final = b"nasiko-queue/secrets/v1"
#: Prefix of a sealed value; names the scheme so that a later one can coexist.
_SEALED_PREFIX: Final = "nq1:"
#: The prefix of any scheme, this one's and later ones'.
_ANY_SCHEME: Final = re.compile(r"nq[0-9]+:")
_NONCE_BYTES: Final = 12
_TAG_BYTES: Final = 16
#: Derived keys kept per box. Deriving is cheap; the cap only bounds memory.
_KEY_CACHE_SIZE: Final = 1024


class Secret:
    """
    A plaintext string that never shows itself.

    `repr()` and `str()` print stars; only `reveal()` gives the value, so each place that
    really needs it says so. Two secrets are equal when their values are (compared in
    constant time), and a secret is hashable, so payloads holding secrets compare normally.
    Not an attrs class: `attrs.asdict` of a payload keeps the `Secret` as it is
    instead of opening it into a dict that holds the plaintext.
    """

    __slots__ = ("_value",)

    def __init__(self, value: str) -> None:
        if not isinstance(value, str):
            raise TypeError(f"a Secret holds a str, got {type(value).__name__}")
        self._value = value

    def __setattr__(self, name: str, value: object) -> None:
        if hasattr(self, "_value"):
            raise attrs.exceptions.FrozenInstanceError  # as it was, an attrs class
        object.__setattr__(self, name, value)

    def __reduce__(self) -> tuple[type[Secret], tuple[str]]:
        return (Secret, (self._value,))

    def reveal(self) -> str:
        """Return the plaintext. Do not log it."""
        return self._value

    def __repr__(self) -> str:
        return "Secret('********')"

    __str__ = __repr__

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Secret):
            return NotImplemented
        return hmac.compare_digest(self._value.encode(), other._value.encode())

    def __hash__(self) -> int:
        return hash((Secret, self._value))


def _check_master_key(_inst: object, _attr: attrs.Attribute[bytes], value: bytes) -> None:
    if not isinstance(value, bytes) or len(value) != KEY_BYTES:
        # Name the length only: the key itself must never reach an error message.
        got = f"{len(value)} bytes" if isinstance(value, bytes) else type(value).__name__
        raise ConfigurationError(f"the secrets master key must be {KEY_BYTES} bytes, got {got}")


@attrs.frozen(eq=False, repr=False)
class SecretBox:
    """
    Seals and opens payload secrets with keys derived from one master key.

    The key of an owner is HKDF-SHA256(master key, salt "nasiko-queue/secrets/v1",
    info = the owner's UUID bytes). A value is sealed with AES-256-GCM under a random
    12-byte nonce, with the env key name as associated data, and written as
    ``"nq1:" + urlsafe base64 (no padding) of nonce + ciphertext``.

    Build one from configuration with `SecretBox.from_base64(text)`;
    `generate_master_key()` makes a new key.
    """

    _master_key: bytes = attrs.field(validator=_check_master_key)
    # Derived ciphers by owner. A frozen box may still fill its own cache.
    _ciphers: dict[UUID, AESGCM] = attrs.field(factory=dict, init=False)
    # -- enqueue (issue #13) --
    # HKDF's extract step, HMAC-SHA256(salt, master key): the same for every owner,
    # so computed once (set after the validator has checked the key).
    _prk: bytes = attrs.field(default=b"", init=False)

    def __attrs_post_init__(self) -> None:
        object.__setattr__(self, "_prk", hmac.digest(_HKDF_SALT, self._master_key, "sha256"))

    @classmethod
    def from_base64(cls, text: str) -> SecretBox:
        """
        Build a box from a base64 master key (urlsafe or standard alphabet, padding optional).

        Raises `ConfigurationError` (a `ValueError`) when the text is not base64 of
        exactly 32 bytes; the message never repeats the text.
        """
        if not isinstance(text, str):
            raise ConfigurationError("the secrets master key must be a base64 string")
        key = _b64decode(text.strip())
        if key is None:
            raise ConfigurationError("the secrets master key is not valid base64")
        return cls(key)

    def __repr__(self) -> str:
        return "SecretBox(<master key hidden>)"

    def _cipher(self, owner_id: UUID) -> AESGCM:
        cipher = self._ciphers.get(owner_id)
        if cipher is None:
            # -- enqueue (issue #13) --
            # HKDF-SHA256 (RFC 5869) with a 32-byte output is its expand step's first
            # block, HMAC-SHA256(PRK, info || 0x01): the key the `HKDF` class derives
            # (tests/test_secrets.py checks they agree), at a third of its cost, which
            # counts when a batch seals for thousands of owners.
            key = hmac.digest(self._prk, owner_id.bytes + b"\x01", "sha256")
            cipher = AESGCM(key)
            if len(self._ciphers) >= _KEY_CACHE_SIZE:
                self._ciphers.clear()
            self._ciphers[owner_id] = cipher
        return cipher

    def seal(self, owner_id: UUID, name: str, plaintext: str) -> str:
        """Encrypt `plaintext` for `owner_id`, bound to the env key `name`."""
        bad: str | None = None
        try:
            data = plaintext.encode()
        except UnicodeEncodeError as exc:
            # Not raised from it, nor inside its handler (which would chain it as
            # __context__): its `object` attribute is the whole plaintext.
            bad = f"secret {name!r} has no UTF-8 form ({exc.reason} at position {exc.start})"
        if bad is not None:
            raise InvalidPayload(bad)
        nonce = os.urandom(_NONCE_BYTES)
        sealed = self._cipher(owner_id).encrypt(nonce, data, name.encode())
        return _SEALED_PREFIX + base64.urlsafe_b64encode(nonce + sealed).decode().rstrip("=")

    def open(self, owner_id: UUID, name: str, token: str) -> str:
        """
        Decrypt a value made by `seal` with the same owner and key name.

        Raises `SecretDecryptError` for anything else: another scheme, broken text, another
        owner, another key name, another master key, or a modified value.
        """
        if not isinstance(token, str) or not token.startswith(_SEALED_PREFIX):
            raise SecretDecryptError("sealed value has an unknown format")
        raw = _b64decode(token[len(_SEALED_PREFIX) :])
        if raw is None or len(raw) < _NONCE_BYTES + _TAG_BYTES:
            raise SecretDecryptError("sealed value is damaged")
        nonce, sealed = raw[:_NONCE_BYTES], raw[_NONCE_BYTES:]
        try:
            plain = self._cipher(owner_id).decrypt(nonce, sealed, name.encode())
            return plain.decode()
        except (InvalidTag, UnicodeDecodeError):
            raise SecretDecryptError() from None


def is_sealed_token(value: str) -> bool:
    """
    Whether a stored value is in the form `SecretBox.seal` writes (its scheme prefix).

    Any scheme's prefix counts (``nq1:``, and the ``nq<n>:`` of a later one), so that a
    release that does not know a newer scheme drops its values rather than take them for
    plaintext. It says nothing of whether the value opens. Fields that the original worker
    wrote in plaintext use it to tell a sealed value from a plaintext one.
    """
    return _ANY_SCHEME.match(value) is not None


def generate_master_key() -> str:
    """Return a new random master key, urlsafe base64, for `SecretBox.from_base64`."""
    return base64.urlsafe_b64encode(os.urandom(KEY_BYTES)).decode()


_URLSAFE_TO_STANDARD: Final = str.maketrans("-_", "+/")


def _b64decode(text: str) -> bytes | None:
    """Strict base64 of either alphabet, padding optional; None when it is not base64."""
    text = text.rstrip("=").translate(_URLSAFE_TO_STANDARD)
    try:
        return base64.b64decode(text + "=" * (-len(text) % 4), validate=True)
    except (binascii.Error, ValueError):
        return None
