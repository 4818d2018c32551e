"""Secret, SecretBox, and sealed payload fields."""

import base64
import json
import logging
from collections.abc import Mapping
from typing import ClassVar
from uuid import UUID

import attrs
import pytest

from nasiko_queue.errors import SecretDecryptError, SecretsNotConfigured
from nasiko_queue.payloads import (
    GithubSource,
    McpServerUpload,
    Payload,
    PayloadCodec,
    Target,
    ZipSource,
)
from nasiko_queue.secrets import Secret, SecretBox, generate_master_key

OWNER = UUID("11111111-1111-4111-8111-111111111111")
OTHER = UUID("22222222-2222-4222-8222-222222222222")
PLAINTEXT = "sk-live-DO-NOT-LEAK-4f1c9a"
KEY = bytes(range(32))


@pytest.fixture
def box() -> SecretBox:
    return SecretBox(KEY)


def mcp(env: Mapping[str, str | Secret]) -> McpServerUpload:
    return McpServerUpload(
        build_id=UUID("33333333-3333-4333-8333-333333333333"),
        connector_id=UUID("44444444-4444-4444-8444-444444444444"),
        owner_id=OWNER,
        name="weather",
        source=ZipSource("/srv/uploads/weather.zip"),
        image_tag="registry/mcp:1",
        env=env,
    )


class TestSecret:
    def test_hides_value(self) -> None:
        """repr and str show stars, never the value."""
        secret = Secret(PLAINTEXT)
        assert PLAINTEXT not in repr(secret)
        assert PLAINTEXT not in str(secret)
        assert repr(secret) == "Secret('********')"
        assert PLAINTEXT not in repr(mcp({"K": secret}))

    def test_reveal_eq_hash(self) -> None:
        """Secrets compare and hash by value."""
        assert Secret("a").reveal() == "a"
        assert Secret("a") == Secret("a")
        assert Secret("a") != Secret("b")
        assert Secret("a") != "a"
        assert len({Secret("a"), Secret("a"), Secret("b")}) == 2

    def test_frozen(self) -> None:
        with pytest.raises(attrs.exceptions.FrozenInstanceError):
            Secret("a")._value = "b"  # type: ignore[misc]


class TestSecretBox:
    def test_round_trip(self, box: SecretBox) -> None:
        """A sealed value opens for the same owner and name."""
        token = box.seal(OWNER, "API_KEY", PLAINTEXT)
        assert token.startswith("nq1:")
        assert PLAINTEXT not in token
        assert "=" not in token
        assert box.open(OWNER, "API_KEY", token) == PLAINTEXT

    def test_unicode_and_empty(self, box: SecretBox) -> None:
        for value in ["", "pässwörd ✓", "x" * 10_000]:
            assert box.open(OWNER, "K", box.seal(OWNER, "K", value)) == value

    def test_nonce_is_random(self, box: SecretBox) -> None:
        assert box.seal(OWNER, "K", "v") != box.seal(OWNER, "K", "v")

    def test_other_owner_fails(self, box: SecretBox) -> None:
        token = box.seal(OWNER, "API_KEY", PLAINTEXT)
        with pytest.raises(SecretDecryptError):
            box.open(OTHER, "API_KEY", token)

    def test_other_name_fails(self, box: SecretBox) -> None:
        """The key name is associated data: a value cannot move to another key."""
        token = box.seal(OWNER, "API_KEY", PLAINTEXT)
        with pytest.raises(SecretDecryptError):
            box.open(OWNER, "OTHER_KEY", token)

    def test_other_master_key_fails(self, box: SecretBox) -> None:
        token = box.seal(OWNER, "API_KEY", PLAINTEXT)
        with pytest.raises(SecretDecryptError):
            SecretBox.from_base64(generate_master_key()).open(OWNER, "API_KEY", token)

    @pytest.mark.parametrize(
        "mangle",
        [
            lambda t: t[:-2] + ("A" if t[-2] != "A" else "B") + t[-1],  # flipped ciphertext
            lambda t: t[:6] + ("A" if t[6] != "A" else "B") + t[7:],  # flipped nonce
            lambda t: t[:-4],  # truncated
            lambda t: "nq2:" + t[4:],  # unknown scheme
            lambda t: t[4:],  # no prefix
            lambda t: "nq1:***not base64***",
            lambda t: "nq1:",
            lambda t: "",
        ],
    )
    def test_tampered_fails(self, box: SecretBox, mangle: object) -> None:
        token = box.seal(OWNER, "API_KEY", PLAINTEXT)
        bad = mangle(token)  # type: ignore[operator]
        assert bad != token
        with pytest.raises(SecretDecryptError):
            box.open(OWNER, "API_KEY", bad)

    def test_from_base64_alphabets(self) -> None:
        """Urlsafe and standard base64, with or without padding, give the same box."""
        key = bytes([0xFB, 0xFF] * 16)  # encodes to '+' and '/' (or '-' and '_')
        token = SecretBox(key).seal(OWNER, "K", "v")
        std = base64.b64encode(key).decode()
        url = base64.urlsafe_b64encode(key).decode()
        for text in [std, url, std.rstrip("="), url.rstrip("="), f"  {url}\n"]:
            assert SecretBox.from_base64(text).open(OWNER, "K", token) == "v"

    @pytest.mark.parametrize(
        "text",
        [
            base64.b64encode(b"k" * 31).decode(),
            base64.b64encode(b"k" * 33).decode(),
            "",
            "not base64 at all!!",
            "c2VjcmV0LW1hc3Rlci1rZXk*",
        ],
    )
    def test_from_base64_rejects(self, text: str) -> None:
        with pytest.raises(ValueError, match="master key") as info:
            SecretBox.from_base64(text)
        if text:
            assert text not in str(info.value)

    def test_wrong_length_bytes(self) -> None:
        with pytest.raises(ValueError, match="32 bytes"):
            SecretBox(b"short")

    def test_generate_master_key(self) -> None:
        key = generate_master_key()
        assert len(base64.urlsafe_b64decode(key)) == 32
        assert key != generate_master_key()
        SecretBox.from_base64(key)

    def test_repr_hides_key(self) -> None:
        text = generate_master_key()
        box = SecretBox.from_base64(text)
        raw = base64.urlsafe_b64decode(text)
        for shown in (repr(box), str(box), repr(PayloadCodec(secrets=box))):
            assert text not in shown
            assert text.rstrip("=") not in shown
            assert repr(raw) not in shown
            assert raw.hex() not in shown


class TestSealedFields:
    def test_encode_stores_no_plaintext(self, box: SecretBox) -> None:
        codec = PayloadCodec(secrets=box)
        payload = mcp({"API_KEY": Secret(PLAINTEXT), "OTHER": Secret("second-value-xyz")})
        encoded = codec.encode(payload)
        text = json.dumps(encoded)
        assert PLAINTEXT not in text
        assert "second-value-xyz" not in text
        assert set(encoded["env"]) == {"API_KEY", "OTHER"}
        assert box.open(OWNER, "API_KEY", encoded["env"]["API_KEY"]) == PLAINTEXT
        assert codec.decode(json.loads(text)) == payload

    def test_plain_strings_are_wrapped_into_secrets(self, box: SecretBox) -> None:
        """A sealed field takes plain `str` values too (typed so for mypy) and holds them as
        Secrets: hidden by repr, sealed by the codec, equal to the payload built with Secrets."""
        payload = mcp({"API_KEY": PLAINTEXT, "OTHER": Secret("second")})
        assert dict(payload.env) == {"API_KEY": Secret(PLAINTEXT), "OTHER": Secret("second")}
        assert all(type(v) is Secret for v in payload.env.values())
        assert payload == mcp({"API_KEY": Secret(PLAINTEXT), "OTHER": Secret("second")})
        assert PLAINTEXT not in repr(payload)
        codec = PayloadCodec(secrets=box)
        encoded = codec.encode(payload)
        assert PLAINTEXT not in json.dumps(encoded)
        assert codec.decode(encoded) == payload

    def test_encode_without_box_raises(self) -> None:
        with pytest.raises(SecretsNotConfigured):
            PayloadCodec().encode(mcp({"API_KEY": Secret(PLAINTEXT)}))

    def test_empty_env_needs_no_box(self) -> None:
        codec = PayloadCodec()
        encoded = codec.encode(mcp({}))
        assert encoded["env"] == {}
        assert codec.decode(encoded) == mcp({})

    def test_converter_alone_never_writes_a_secret(self) -> None:
        from nasiko_queue.payloads import converter

        with pytest.raises(Exception, match="sealed"):
            converter.unstructure(mcp({"API_KEY": Secret(PLAINTEXT)}))

    def test_bad_value_is_dropped_and_logged_by_key(
        self, box: SecretBox, caplog: pytest.LogCaptureFixture
    ) -> None:
        codec = PayloadCodec(secrets=box)
        encoded = codec.encode(mcp({"GOOD": Secret("fine"), "BAD_KEY": Secret(PLAINTEXT)}))
        # A value sealed under another owner's key, as if moved from another job.
        encoded["env"]["BAD_KEY"] = box.seal(OTHER, "BAD_KEY", PLAINTEXT)
        encoded["env"]["GARBAGE"] = PLAINTEXT
        with caplog.at_level(logging.WARNING, logger="nasiko_queue.payloads"):
            decoded = codec.decode(encoded)
        assert isinstance(decoded, McpServerUpload)
        assert dict(decoded.env) == {"GOOD": Secret("fine")}
        messages = [r.getMessage() for r in caplog.records]
        assert len(messages) == 2
        assert any("BAD_KEY" in m for m in messages)
        assert any("GARBAGE" in m for m in messages)
        for record in caplog.records:
            assert record.name == "nasiko_queue.payloads"
            assert "McpServerUpload" in record.getMessage()
        assert PLAINTEXT not in caplog.text
        assert encoded["env"]["BAD_KEY"] not in caplog.text

    def test_decode_without_box_drops_all(
        self, box: SecretBox, caplog: pytest.LogCaptureFixture
    ) -> None:
        encoded = PayloadCodec(secrets=box).encode(mcp({"API_KEY": Secret(PLAINTEXT)}))
        with caplog.at_level(logging.WARNING, logger="nasiko_queue.payloads"):
            decoded = PayloadCodec().decode(encoded)
        assert isinstance(decoded, McpServerUpload)
        assert decoded.env == {}
        assert "API_KEY" in caplog.text
        assert encoded["env"]["API_KEY"] not in caplog.text

    def test_other_master_key_drops(self, box: SecretBox) -> None:
        encoded = PayloadCodec(secrets=box).encode(mcp({"API_KEY": Secret(PLAINTEXT)}))
        other = PayloadCodec(secrets=SecretBox.from_base64(generate_master_key()))
        decoded = other.decode(encoded)
        assert isinstance(decoded, McpServerUpload)
        assert decoded.env == {}

    def test_user_defined_sealed_field(self, box: SecretBox) -> None:
        """Any payload type may mark a Mapping[str, Secret] field as sealed."""

        @attrs.frozen(kw_only=True)
        class Deploy(Payload):
            kind: ClassVar[str] = "Deploy"

            build_id: UUID
            agent_id: UUID
            team_id: UUID
            name: str
            tokens: Mapping[str, Secret] = attrs.field(
                factory=dict, metadata={"sealed": True}, hash=False
            )
            note: str | None = None

            def label(self) -> str:
                return self.name

            def target(self) -> Target:
                return Target(agent_id=self.agent_id)

            def job_owner(self) -> UUID | None:
                return OWNER

            def secret_owner(self) -> UUID | None:
                return self.team_id  # sealed for the team, not the job's owner

        payload = Deploy(
            build_id=UUID(int=1),
            agent_id=UUID(int=2),
            team_id=OTHER,
            name="d",
            tokens={"GH_TOKEN": Secret(PLAINTEXT)},
        )
        codec = PayloadCodec([Deploy], secrets=box)
        encoded = codec.encode(payload)
        fields = ["kind", "build_id", "agent_id", "team_id", "name", "tokens", "note"]
        assert list(encoded) == fields
        assert PLAINTEXT not in json.dumps(encoded)
        assert box.open(OTHER, "GH_TOKEN", encoded["tokens"]["GH_TOKEN"]) == PLAINTEXT
        assert codec.decode(json.loads(json.dumps(encoded))) == payload
        # Older rows without the field parse with the default.
        del encoded["tokens"]
        assert codec.decode(encoded) == attrs.evolve(payload, tokens={})

    def test_github_source_round_trip(self, box: SecretBox) -> None:
        codec = PayloadCodec(secrets=box)
        payload = attrs.evolve(mcp({"K": Secret("v")}), source=GithubSource("https://gh/x/y"))
        assert codec.decode(json.loads(json.dumps(codec.encode(payload)))) == payload
