"""Secret, SecretBox, and sealed payload fields: in the codec, at rest, and in a worker."""

import base64
import copy
import json
import logging
import pickle
import uuid
from collections.abc import Mapping
from typing import Any, ClassVar
from uuid import UUID

import attrs
import pytest

from nasiko_queue import Database, JobContext, Queue
from nasiko_queue.builds.payloads import (
    Clone,
    GithubClone,
    GithubSource,
    McpServerUpload,
    Payload,
    PayloadCodec,
    Target,
    Upload,
    ZipSource,
)
from nasiko_queue.errors import InvalidPayload, SecretDecryptError, SecretsNotConfigured
from nasiko_queue.secrets import Secret, SecretBox, generate_master_key, is_sealed_token
from nasiko_queue.testing import enqueue_with_target, insert_agent, insert_agent_build

from .conftest import FAST, MASTER_KEY
from .helpers import executors_for_all, job_row, running, succeed

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
        with pytest.raises(TypeError, match="holds a str"):
            Secret(b"bytes")  # type: ignore[arg-type]

    def test_asdict_of_a_payload_keeps_the_secret_closed(self) -> None:
        """
        Secret was an attrs class, so `attrs.asdict` of a payload (what an
        application might log) opened it into {'_value': <plaintext>}.
        """
        opened = attrs.asdict(mcp({"K": Secret(PLAINTEXT)}))
        assert PLAINTEXT not in repr(opened)
        assert opened["env"] == {"K": Secret(PLAINTEXT)}
        assert copy.deepcopy(Secret("a")) == Secret("a")
        assert pickle.loads(pickle.dumps(Secret("a"))) == Secret("a")  # noqa: S301 (our own bytes)


class TestSecretBox:
    def test_a_value_with_no_utf8_form_is_refused_without_itself(self, box: SecretBox) -> None:
        """The encoder's own error kept the whole plaintext in its `object`."""
        with pytest.raises(InvalidPayload, match="'API_KEY' has no UTF-8 form") as caught:
            box.seal(OWNER, "API_KEY", PLAINTEXT + "\ud800")
        assert caught.value.__context__ is None
        assert caught.value.__cause__ is None
        assert PLAINTEXT not in str(caught.value)

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
        from nasiko_queue.builds.payloads import converter

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


# -------------------------------------------- the env of Upload, Clone and GithubClone

#: The three agent kinds whose `env` the original wrote in plaintext (SPEC §2 [decision]).
AGENT_ENV_KINDS = ["Upload", "Clone", "GithubClone"]
AGENT_ENV_TYPES: dict[str, type[Upload | Clone | GithubClone]] = {
    "Upload": Upload, "Clone": Clone, "GithubClone": GithubClone,
}


def agent_payload(kind: str, env: Mapping[str, str | Secret], owner: UUID = OWNER) -> Payload:
    common: dict[str, Any] = {
        "build_id": UUID(int=1), "agent_id": UUID(int=2), "owner_id": owner,
        "upload_id": "up-1", "name": "weather", "image_tag": "registry/weather:1",
        "ports": (8000,), "env": env,
    }
    if kind == "Upload":
        return Upload(**common, zip_path="/srv/up-1.zip", writable=False)
    if kind == "Clone":
        return Clone(**common, tar_gz_path="/srv/up-1.tar.gz")
    return GithubClone(**common, repo_full_name="acme/weather", branch="main")


class TestAgentEnvCodec:
    @pytest.mark.parametrize("kind", AGENT_ENV_KINDS)
    def test_sealed_by_default(self, box: SecretBox, kind: str) -> None:
        """The values are Secrets in memory and sealed for the owner, bound to their key."""
        payload = agent_payload(kind, {"GATEWAY_TOKEN": PLAINTEXT, "LOG_LEVEL": "info"})
        assert isinstance(payload, AGENT_ENV_TYPES[kind])
        assert payload.env["GATEWAY_TOKEN"] == Secret(PLAINTEXT)
        assert PLAINTEXT not in repr(payload)
        codec = PayloadCodec(secrets=box)
        encoded = codec.encode(payload)
        assert PLAINTEXT not in json.dumps(encoded)
        assert box.open(OWNER, "GATEWAY_TOKEN", encoded["env"]["GATEWAY_TOKEN"]) == PLAINTEXT
        assert box.open(OWNER, "LOG_LEVEL", encoded["env"]["LOG_LEVEL"]) == "info"
        assert codec.decode(json.loads(json.dumps(encoded))) == payload

    @pytest.mark.parametrize("kind", AGENT_ENV_KINDS)
    def test_without_a_key_encoding_says_what_to_do(self, kind: str) -> None:
        with pytest.raises(SecretsNotConfigured) as info:
            PayloadCodec().encode(agent_payload(kind, {"GATEWAY_TOKEN": PLAINTEXT}))
        message = str(info.value)
        assert f"{kind} payload's 'env'" in message
        assert "secrets=SecretBox.from_base64(key)" in message
        assert "NASIKO_QUEUE_MASTER_KEY" in message
        assert "QueueConfig(seal_agent_env=False)" in message
        assert PLAINTEXT not in message
        assert PayloadCodec().encode(agent_payload(kind, {}))["env"] == {}  # nothing to seal

    def test_mcp_message_offers_no_plaintext(self) -> None:
        """McpServerUpload's env is always sealed: its error names the key, nothing else."""
        with pytest.raises(SecretsNotConfigured) as info:
            PayloadCodec().encode(mcp({"API_KEY": PLAINTEXT}))
        assert "secrets=SecretBox.from_base64(key)" in str(info.value)
        assert "seal_agent_env" not in str(info.value)

    @pytest.mark.parametrize("kind", AGENT_ENV_KINDS)
    def test_compat_codec_writes_plaintext(self, kind: str) -> None:
        """`seal_compat_fields=False` writes the agent kinds' env as the original does; it
        needs no key for them, and McpServerUpload stays sealed."""
        codec = PayloadCodec(seal_compat_fields=False)
        payload = agent_payload(kind, {"GATEWAY_TOKEN": PLAINTEXT})
        encoded = codec.encode(payload)
        assert encoded["env"] == {"GATEWAY_TOKEN": PLAINTEXT}
        assert codec.decode(encoded) == payload
        with pytest.raises(SecretsNotConfigured):
            codec.encode(mcp({"API_KEY": PLAINTEXT}))
        sealed = PayloadCodec(secrets=SecretBox(KEY), seal_compat_fields=False).encode(
            mcp({"API_KEY": PLAINTEXT}))
        assert sealed["env"]["API_KEY"].startswith("nq1:")

    def test_compat_codec_refuses_a_value_that_would_read_back_as_sealed(self) -> None:
        """In plaintext, a value starting like a token would be dropped when read: refused,
        naming the key and not the value."""
        value = "nq1:" + PLAINTEXT
        with pytest.raises(InvalidPayload, match="GATEWAY_TOKEN") as info:
            PayloadCodec(seal_compat_fields=False).encode(
                agent_payload("Upload", {"GATEWAY_TOKEN": value}))
        assert PLAINTEXT not in str(info.value)
        # Sealed, the same value is fine.
        codec = PayloadCodec(secrets=SecretBox(KEY))
        payload = agent_payload("Upload", {"GATEWAY_TOKEN": value})
        assert codec.decode(codec.encode(payload)) == payload

    @pytest.mark.parametrize("kind", AGENT_ENV_KINDS)
    def test_plaintext_and_sealed_values_both_read(
        self, box: SecretBox, kind: str, caplog: pytest.LogCaptureFixture
    ) -> None:
        """Per value: not a sealed token is plaintext (the original's rows); a token opens,
        or is dropped and logged by key when it does not (another owner's, another
        scheme's: never taken for plaintext)."""
        encoded = PayloadCodec(seal_compat_fields=False).encode(agent_payload(kind, {}))
        encoded["env"] = {
            "PLAIN": "info",
            "LOOKS_LIKE": "token-nq1:x",  # a prefix only counts at the start
            "SEALED": box.seal(OWNER, "SEALED", PLAINTEXT),
            "MOVED": box.seal(OTHER, "MOVED", "moved-" + PLAINTEXT),
            "FUTURE": "nq2:" + PLAINTEXT,
        }
        with caplog.at_level(logging.WARNING, logger="nasiko_queue.payloads"):
            decoded = PayloadCodec(secrets=box).decode(encoded)
        assert dict(decoded.env) == {  # type: ignore[attr-defined]
            "PLAIN": Secret("info"), "LOOKS_LIKE": Secret("token-nq1:x"),
            "SEALED": Secret(PLAINTEXT),
        }
        messages = [r.getMessage() for r in caplog.records]
        assert len(messages) == 2
        assert any("env.MOVED" in m and kind in m for m in messages)
        assert any("env.FUTURE" in m for m in messages)
        assert PLAINTEXT not in caplog.text
        assert encoded["env"]["MOVED"] not in caplog.text

    def test_without_a_key_plaintext_still_reads(
        self, box: SecretBox, caplog: pytest.LogCaptureFixture
    ) -> None:
        encoded = PayloadCodec(seal_compat_fields=False).encode(
            agent_payload("Upload", {"PLAIN": "info"}))
        encoded["env"]["SEALED"] = box.seal(OWNER, "SEALED", PLAINTEXT)
        with caplog.at_level(logging.WARNING, logger="nasiko_queue.payloads"):
            decoded = PayloadCodec().decode(encoded)
        assert dict(decoded.env) == {"PLAIN": Secret("info")}  # type: ignore[attr-defined]
        assert "env.SEALED" in caplog.text
        assert "no secrets master key" in caplog.text

    def test_is_sealed_token(self, box: SecretBox) -> None:
        assert is_sealed_token(box.seal(OWNER, "K", "v"))
        assert is_sealed_token("nq1:")
        assert is_sealed_token("nq12:anything")
        for plain in ["", "nq1", "nq:", "NQ1:x", " nq1:x", "x-nq1:y", "nqa:x"]:
            assert not is_sealed_token(plain)


# ------------------------------------------------ at rest and in a worker (real PostgreSQL)


async def stored_env(db: Database, job_id: UUID) -> tuple[str, dict[str, str]]:
    """The job row's payload as text, and its `env` object, read by SQL."""
    row = await db.fetchrow(
        "SELECT payload::text AS text, payload->'env' AS env FROM build_jobs WHERE id = $1",
        job_id)
    assert row is not None
    return row["text"], json.loads(row["env"])


class Received:
    """An executor that records what each run got in `env`, revealed, and succeeds."""

    def __init__(self) -> None:
        self.runs: list[dict[str, str]] = []
        self.types: set[type] = set()

    async def __call__(self, ctx: JobContext[Any]) -> None:
        self.types.update(type(v) for v in ctx.payload.env.values())
        self.runs.append({k: v.reveal() for k, v in ctx.payload.env.items()})
        await succeed(ctx)


@pytest.mark.parametrize("kind", AGENT_ENV_KINDS)
async def test_agent_env_is_sealed_at_rest_and_plain_for_the_executor(
    queue: Queue, kind: str
) -> None:
    """SPEC §2 [decision]: the env of the agent kinds is sealed by default. The row holds
    the same keys with tokens (no plaintext anywhere in it); the executor gets the values."""
    token = "gw-" + uuid.uuid4().hex
    env = {"GATEWAY_TOKEN": token, "LOG_LEVEL": "info-" + uuid.uuid4().hex[:6]}
    job = await enqueue_with_target(queue, kind, env=env)
    text, at_rest = await stored_env(queue.db, job.job_id)
    assert set(at_rest) == set(env)
    for key, value in env.items():
        assert value not in text
        assert at_rest[key].startswith("nq1:")
        assert MASTER_KEY.open(job.owner_id, key, at_rest[key]) == value
    received = Received()
    async with running(queue, executors_for_all(received)) as worker:
        await worker.drain_once()
    assert received.runs == [env]
    assert received.types == {Secret}
    assert (await job_row(queue.db, job.job_id) or {})["status"] == "done"


def serde_row(kind: str, *, build: UUID, agent: UUID, owner: UUID,
              env: dict[str, str]) -> str:
    """The payload as the original's serde_json writes it (env in plaintext)."""
    b, a, o = str(build), str(agent), str(owner)
    fields: dict[str, Any] = {"build_id": b, "agent_id": a, "owner_id": o,
                              "upload_id": f"up-{b[:8]}", "name": "legacy"}
    if kind == "Upload":
        fields |= {"zip_path": f"/data/uploads/{b}.zip", "image_tag": "registry.local/x:v1",
                   "ports": [8000], "env": env, "writable": False, "writable_path": None}
    elif kind == "Clone":
        fields |= {"tar_gz_path": f"/data/{b}.tar.gz", "image_tag": "registry.local/x:v1",
                   "ports": [], "env": env}
    else:
        fields |= {"repo_full_name": "acme/crawler", "branch": "main",
                   "image_tag": "registry.local/x:v1", "ports": [8080], "env": env,
                   "version_override": None, "prior_version": None, "prior_image": None,
                   "prior_status": None}
    return json.dumps({"kind": kind, **fields}, separators=(",", ":"))


@pytest.mark.parametrize("kind", AGENT_ENV_KINDS)
async def test_plaintext_row_of_the_original_runs_with_its_values(
    queue: Queue, kind: str
) -> None:
    """A row a Rust replica inserted by SQL, env in plaintext, parses; the executor gets
    its values as Secrets, and a sealed value beside them opens."""
    owner = uuid.uuid4()
    agent = await insert_agent(queue.db, owner_id=owner)
    build = await insert_agent_build(queue.db, agent)
    env = {"GATEWAY_TOKEN": "gw-" + uuid.uuid4().hex, "EMPTY": "", "URL": "https://x/nq1:y"}
    data = json.loads(serde_row(kind, build=build, agent=agent, owner=owner, env=env))
    data["env"]["SEALED"] = MASTER_KEY.seal(owner, "SEALED", "sealed-value")
    job_id = await queue.db.fetchval(
        "INSERT INTO build_jobs (agent_id, owner_id, payload) VALUES ($1, $2, $3::jsonb) "
        "RETURNING id", agent, owner, json.dumps(data))
    received = Received()
    async with running(queue, executors_for_all(received)) as worker:
        await worker.drain_once()
    assert received.runs == [{**env, "SEALED": "sealed-value"}]
    assert received.types == {Secret}
    assert (await job_row(queue.db, job_id) or {})["status"] == "done"


@pytest.mark.parametrize("kind", AGENT_ENV_KINDS)
async def test_agent_env_sealed_for_another_owner_is_dropped_and_logged_by_key(
    queue: Queue, kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A value moved from another owner's job does not open: the executor runs without it,
    and the log names the key, never the value or the token."""
    caplog.set_level(logging.DEBUG)
    good, moved = "good-" + uuid.uuid4().hex, "moved-" + uuid.uuid4().hex
    job = await enqueue_with_target(queue, kind, env={"GOOD": good, "MOVED": "placeholder"})
    token = MASTER_KEY.seal(uuid.uuid4(), "MOVED", moved)
    await queue.db.execute(
        "UPDATE build_jobs SET payload = jsonb_set(payload, '{env,MOVED}', to_jsonb($2::text)) "
        "WHERE id = $1", job.job_id, token)
    received = Received()
    async with running(queue, executors_for_all(received)) as worker:
        await worker.drain_once()
    assert received.runs == [{"GOOD": good}]
    dropped = [r.getMessage() for r in caplog.records if "dropped secret" in r.getMessage()]
    assert len(dropped) == 1
    assert "env.MOVED" in dropped[0]
    assert kind in dropped[0]
    for shown in (moved, token, good):
        assert shown not in caplog.text
    assert (await job_row(queue.db, job.job_id) or {})["status"] == "done"


@pytest.mark.parametrize("kind", AGENT_ENV_KINDS)
async def test_seal_agent_env_off_writes_plaintext_as_the_original(
    db: Database, kind: str
) -> None:
    """QueueConfig(seal_agent_env=False): for a table shared with the original's replicas.
    The env is written in plaintext, exactly as serde writes it, without a master key;
    the executor gets the values."""
    queue = Queue(db, config=attrs.evolve(FAST, seal_agent_env=False))
    env = {"GATEWAY_TOKEN": "gw-" + uuid.uuid4().hex}
    job = await enqueue_with_target(queue, kind, env=env)
    text, at_rest = await stored_env(db, job.job_id)
    assert at_rest == env
    expected = PayloadCodec(seal_compat_fields=False).encode(job.payload)
    assert json.loads(text) == expected
    received = Received()
    async with running(queue, executors_for_all(received)) as worker:
        await worker.drain_once()
    assert received.runs == [env]


async def test_seal_agent_env_off_leaves_mcp_env_sealed(db: Database) -> None:
    """The setting is about the agent kinds only: McpServerUpload's env is sealed still,
    and needs a key still."""
    config = attrs.evolve(FAST, seal_agent_env=False)
    with pytest.raises(SecretsNotConfigured):
        await enqueue_with_target(Queue(db, config=config), "McpServerUpload",
                                  env={"API_KEY": PLAINTEXT})
    queue = Queue(db, config=config, secrets=MASTER_KEY)
    job = await enqueue_with_target(queue, "McpServerUpload", env={"API_KEY": PLAINTEXT})
    text, at_rest = await stored_env(db, job.job_id)
    assert PLAINTEXT not in text
    assert at_rest["API_KEY"].startswith("nq1:")


@pytest.mark.parametrize("kind", AGENT_ENV_KINDS)
async def test_agent_env_without_a_key_is_refused_and_says_what_to_do(
    db: Database, kind: str
) -> None:
    """Sealing is on by default, so a queue without a master key refuses a non-empty env
    (nothing is stored in plaintext); the error names both ways out. Its transaction rolls
    back with it. An empty env needs no key."""
    queue = Queue(db, config=FAST)
    with pytest.raises(SecretsNotConfigured) as info:
        await enqueue_with_target(queue, kind, name="refused", env={"GATEWAY_TOKEN": PLAINTEXT})
    assert "secrets=SecretBox.from_base64(key)" in str(info.value)
    assert "QueueConfig(seal_agent_env=False)" in str(info.value)
    assert PLAINTEXT not in str(info.value)
    assert await db.fetchval("SELECT count(*) FROM agents WHERE name = 'refused'") == 0
    assert await db.fetchval("SELECT count(*) FROM build_jobs") == 0
    await enqueue_with_target(queue, kind)
    assert await db.fetchval("SELECT count(*) FROM build_jobs") == 1


async def test_agent_env_reaches_no_log_and_no_repr(
    queue: Queue, caplog: pytest.LogCaptureFixture
) -> None:
    """Enqueue and a worker run of an Upload with env, everything logged at DEBUG
    (an executor that logs its payload included): no value shows, nor in a repr."""
    caplog.set_level(logging.DEBUG)
    app_log = logging.getLogger("tests.app")
    secret = "gw-" + uuid.uuid4().hex
    seen: list[str] = []

    async def run(ctx: JobContext[Upload]) -> None:
        app_log.debug("running %r with env %s", ctx.payload, ctx.payload.env)
        seen.append(ctx.payload.env["GATEWAY_TOKEN"].reveal())
        await succeed(ctx)

    job = await enqueue_with_target(queue, "Upload", env={"GATEWAY_TOKEN": secret})
    async with running(queue, executors_for_all(run)) as worker:
        await worker.drain_once()
    assert seen == [secret]
    assert any(r.name == "tests.app" for r in caplog.records)
    assert secret not in caplog.text
    assert secret not in repr(job.payload)
    assert secret not in str(job.payload)


# -- enqueue (issue #13) ----------------------------------------------------------------


@pytest.mark.parametrize("owner", [OWNER, OTHER, UUID(int=0), uuid.UUID(int=2**128 - 1)])
def test_the_derived_key_is_rfc_5869_hkdf(owner: UUID) -> None:
    """The box derives each owner's key with two HMACs (the extract step once per
    box); the key must be HKDF-SHA256's, as `cryptography` computes it: a value it
    seals opens with a cipher under that key, and the other way round."""
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM
    from cryptography.hazmat.primitives.kdf.hkdf import HKDF

    box = SecretBox(KEY)
    key = HKDF(algorithm=hashes.SHA256(), length=32, salt=b"nasiko-queue/secrets/v1",
               info=owner.bytes).derive(KEY)
    raw = base64.urlsafe_b64decode(box.seal(owner, "TOKEN", PLAINTEXT)[4:] + "==")
    assert AESGCM(key).decrypt(raw[:12], raw[12:], b"TOKEN").decode() == PLAINTEXT
    nonce = bytes(12)
    theirs = "nq1:" + base64.urlsafe_b64encode(
        nonce + AESGCM(key).encrypt(nonce, PLAINTEXT.encode(), b"TOKEN")).decode().rstrip("=")
    assert box.open(owner, "TOKEN", theirs) == PLAINTEXT


#: `SecretBox(KEY).seal(OWNER, "TOKEN", PLAINTEXT)` as sealed before issue #13, whose
#: derivation called cryptography's HKDF class (commit 7092b3e).
OLD_TOKEN = "nq1:M0FjEdJ3cf5t2_L4ss_jHZIaRQKgV1OxJaSG0hJHftg94RYsd50QJlkBlqkYNEVyCb0gw0wX"


def test_a_value_sealed_before_the_faster_derivation_still_opens() -> None:
    assert SecretBox(KEY).open(OWNER, "TOKEN", OLD_TOKEN) == PLAINTEXT
    with pytest.raises(SecretDecryptError):
        SecretBox(KEY).open(OTHER, "TOKEN", OLD_TOKEN)
