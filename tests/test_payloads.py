"""The payload union: wire compatibility with the original's serde JSON, and validation."""

import copy
import json
import pickle
from collections.abc import Mapping
from typing import Any, ClassVar, get_args, get_origin
from uuid import UUID

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from nasiko_queue.builds.payloads import (
    BUILTIN_PAYLOAD_TYPES,
    Clone,
    GithubSource,
    McpServerUpload,
    McpSource,
    Payload,
    PayloadCodec,
    Rollback,
    Target,
    Update,
    Upload,
    ZipSource,
    _parse_uuid,
    converter,
    raw_build_id,
)
from nasiko_queue.errors import InvalidPayload
from nasiko_queue.plain.args import JobArgs
from nasiko_queue.secrets import Secret, SecretBox, is_sealed_token

B = "0b0b0b0b-0000-4000-8000-000000000001"  # build id
A = "0a0a0a0a-0000-4000-8000-000000000002"  # agent id
OWN = "00000000-0000-4000-8000-0000000000aa"  # owner / caller
R = "0e0e0e0e-0000-4000-8000-000000000003"  # real agent owner
C = "0c0c0c0c-0000-4000-8000-000000000004"  # connector id

SECRETISH = "sk-live-s3cr3t-9b1e"

# Exactly what serde_json::to_string writes: compact, kind first, declaration order, null.
VECTORS: dict[str, str] = {
    "Upload": (
        f'{{"kind":"Upload","build_id":"{B}","agent_id":"{A}","owner_id":"{OWN}",'
        '"upload_id":"up-1","name":"weather","zip_path":"/data/uploads/up-1.zip",'
        '"image_tag":"registry.local/weather:v1","ports":[3000,4000],'
        '"env":{"LOG_LEVEL":"debug"},"writable":true,"writable_path":"/data"}'
    ),
    "Update": (
        f'{{"kind":"Update","build_id":"{B}","agent_id":"{A}","owner_id":"{OWN}",'
        f'"agent_owner_id":"{R}","name":"weather","zip_path":null,'
        '"image_tag":"registry.local/weather:v2","new_version":"v2","prev_version":"v1",'
        '"prev_image":"registry.local/weather:v1","changelog":null,"writable":false,'
        '"writable_path":null}'
    ),
    "Rollback": (
        f'{{"kind":"Rollback","rollback_build_id":"{B}","agent_id":"{A}","caller_id":"{OWN}",'
        f'"agent_owner_id":"{R}","agent_name":"weather","target_version":"v1",'
        '"target_image_tag":"registry.local/weather:v1","reason":"v2 crashes",'
        '"writable":false,"writable_path":null}'
    ),
    "StandaloneBuild": (
        f'{{"kind":"StandaloneBuild","build_id":"{B}","agent_id":"{A}","agent_name":"weather",'
        '"github_url":null,"source_key":"sources/0a0a/v3.zip","version_tag":"v3"}'
    ),
    "Clone": (
        f'{{"kind":"Clone","build_id":"{B}","agent_id":"{A}","owner_id":"{OWN}",'
        '"upload_id":"up-2","name":"legacy","tar_gz_path":"/data/up-2.tar.gz",'
        '"image_tag":"registry.local/legacy:v1","ports":[],"env":{}}'
    ),
    "GithubClone": (
        f'{{"kind":"GithubClone","build_id":"{B}","agent_id":"{A}","owner_id":"{OWN}",'
        '"upload_id":"gh-1","name":"crawler","repo_full_name":"acme/crawler","branch":"main",'
        '"image_tag":"registry.local/crawler:v1","ports":[8080],"env":{"A":"1","B":"2"},'
        '"version_override":"v7","prior_version":null,"prior_image":null,"prior_status":null}'
    ),
    "McpServerUpload": (
        f'{{"kind":"McpServerUpload","build_id":"{B}","connector_id":"{C}","owner_id":"{OWN}",'
        '"name":"files","source":{"Zip":{"zip_path":"/data/mcp/files.zip"}},'
        '"image_tag":"registry.local/mcp-files:v1","env":{}}'
    ),
}

# Rows written before a field existed, or without optional keys (serde reads absent as None).
OLDER_ROWS: list[tuple[str, dict[str, Any]]] = [
    (
        f'{{"kind":"Upload","build_id":"{B}","agent_id":"{A}","owner_id":"{OWN}",'
        '"upload_id":"u","name":"n","zip_path":"/z","image_tag":"t","ports":[80],'
        '"env":{},"writable":false}',
        {"writable_path": None},
    ),
    (
        f'{{"kind":"Update","build_id":"{B}","agent_id":"{A}","owner_id":"{OWN}",'
        f'"agent_owner_id":"{R}","name":"n","image_tag":"t","new_version":"v2",'
        '"prev_version":"v1","writable":true}',
        {"zip_path": None, "prev_image": None, "changelog": None, "writable_path": None},
    ),
    (
        f'{{"kind":"Rollback","rollback_build_id":"{B}","agent_id":"{A}","caller_id":"{OWN}",'
        f'"agent_owner_id":"{R}","agent_name":"n","target_version":"v1",'
        '"target_image_tag":"t","writable":false}',
        {"reason": None, "writable_path": None},
    ),
    (
        f'{{"kind":"StandaloneBuild","build_id":"{B}","agent_id":"{A}","agent_name":"n",'
        '"version_tag":"v1"}',
        {"github_url": None, "source_key": None},
    ),
    (  # GithubClone as the original's HEAD writes it, without the four PR #290 fields
        f'{{"kind":"GithubClone","build_id":"{B}","agent_id":"{A}","owner_id":"{OWN}",'
        '"upload_id":"u","name":"n","repo_full_name":"o/r","branch":"main",'
        '"image_tag":"t","ports":[],"env":{}}',
        {"version_override": None, "prior_version": None, "prior_status": None},
    ),
]


def dumps(data: object) -> str:
    return json.dumps(data, separators=(",", ":"), ensure_ascii=False)


@pytest.fixture(scope="module")
def codec() -> PayloadCodec:
    """Writes what the original writes: the agent kinds' `env` in plaintext."""
    return PayloadCodec(seal_compat_fields=False)


def decoded(kind: str) -> Payload:
    return PayloadCodec().decode(json.loads(VECTORS[kind]))


class TestWireVectors:
    def test_covers_every_kind(self) -> None:
        assert set(VECTORS) == {cls.kind for cls in BUILTIN_PAYLOAD_TYPES}
        assert PayloadCodec().kinds == frozenset(VECTORS)

    @pytest.mark.parametrize("kind", list(VECTORS))
    def test_reencodes_identically(self, codec: PayloadCodec, kind: str) -> None:
        """A serde-written row parses and is written back byte for byte (with the agent
        kinds' `env` in plaintext, as `QueueConfig(seal_agent_env=False)` writes it)."""
        payload = codec.decode(json.loads(VECTORS[kind]))
        assert type(payload).kind == kind
        assert dumps(codec.encode(payload)) == VECTORS[kind]

    @pytest.mark.parametrize("kind", ["Upload", "GithubClone"])
    def test_sealed_row_keeps_the_serde_shape(self, kind: str) -> None:
        """Sealed by default, the agent kinds' `env` is still an object of strings under the
        same keys, in the same place: only its values differ from the serde row."""
        box = SecretBox(bytes(32))
        payload = PayloadCodec().decode(json.loads(VECTORS[kind]))
        encoded = PayloadCodec(secrets=box).encode(payload)
        plain = json.loads(VECTORS[kind])
        assert list(encoded) == list(plain)
        assert {k: v for k, v in encoded.items() if k != "env"} == {
            k: v for k, v in plain.items() if k != "env"
        }
        assert list(encoded["env"]) == list(plain["env"])
        for key, value in plain["env"].items():
            assert encoded["env"][key].startswith("nq1:")
            assert box.open(UUID(OWN), key, encoded["env"][key]) == value
        assert PayloadCodec(secrets=box).decode(json.loads(dumps(encoded))) == payload

    def test_github_source_vector(self, codec: PayloadCodec) -> None:
        text = VECTORS["McpServerUpload"].replace(
            '{"Zip":{"zip_path":"/data/mcp/files.zip"}}', '{"Github":{"url":"https://gh/a/b"}}'
        )
        payload = codec.decode(json.loads(text))
        assert isinstance(payload, McpServerUpload)
        assert payload.source == GithubSource("https://gh/a/b")
        assert dumps(codec.encode(payload)) == text

    def test_non_ascii_is_written_raw(self, codec: PayloadCodec) -> None:
        text = VECTORS["Clone"].replace('"legacy"', '"météo ☂"')
        assert dumps(codec.encode(codec.decode(json.loads(text)))) == text

    @pytest.mark.parametrize(("text", "nones"), OLDER_ROWS)
    def test_absent_optionals_are_none(
        self, codec: PayloadCodec, text: str, nones: dict[str, Any]
    ) -> None:
        payload = codec.decode(json.loads(text))
        for name, value in nones.items():
            assert getattr(payload, name) == value
        # Written back with explicit nulls, and that parses to the same value.
        assert codec.decode(json.loads(dumps(codec.encode(payload)))) == payload

    @pytest.mark.parametrize("kind", list(VECTORS))
    def test_unknown_keys_ignored(self, codec: PayloadCodec, kind: str) -> None:
        data = json.loads(VECTORS[kind])
        data.update(added_later="x", nested={"a": [1, 2]}, Kind="Upload")
        assert codec.decode(data) == decoded(kind)

    def test_values(self) -> None:
        payload = decoded("Upload")
        assert payload == Upload(
            build_id=UUID(B),
            agent_id=UUID(A),
            owner_id=UUID(OWN),
            upload_id="up-1",
            name="weather",
            zip_path="/data/uploads/up-1.zip",
            image_tag="registry.local/weather:v1",
            ports=(3000, 4000),
            env={"LOG_LEVEL": "debug"},
            writable=True,
            writable_path="/data",
        )
        assert hash(payload) == hash(decoded("Upload"))
        # The plaintext env of the original's row is read into Secrets, as a sealed one is.
        assert isinstance(payload, Upload)
        assert payload.env == {"LOG_LEVEL": Secret("debug")}
        assert all(type(v) is Secret for v in payload.env.values())

    def test_uppercase_uuid_accepted(self, codec: PayloadCodec) -> None:
        data = json.loads(VECTORS["Upload"])
        data["build_id"] = B.upper()
        assert codec.decode(data).build_id == UUID(B)


    def test_decoded_ids_are_uuids_to_every_caller(self, codec: PayloadCodec) -> None:
        """The ids are parsed by asyncpg's compiled UUID (a subclass of uuid.UUID, the
        type of the job rows' own ids): whatever an executor does with one, it does
        with a standard UUID of the same text."""
        payload = codec.decode(json.loads(VECTORS["Upload"]))
        assert isinstance(payload, Upload)
        for value, text in ((payload.build_id, B), (payload.agent_id, A),
                            (payload.owner_id, OWN)):
            std = UUID(text)
            assert isinstance(value, UUID)
            assert value == std
            assert std == value
            assert hash(value) == hash(std)
            assert {std: 1}[value] == 1
            assert str(value) == text
            assert value.hex == std.hex
            assert value.int == std.int
            assert value.version == std.version
        assert pickle.loads(pickle.dumps(payload)) == payload  # noqa: S301 - bytes made here
        assert copy.deepcopy(payload) == payload


@given(st.one_of(
    st.uuids().map(str),
    st.uuids().map(lambda u: str(u).upper()),
    st.uuids().map(lambda u: u.hex),
    st.uuids().map(lambda u: f"{{{u}}}"),
    st.text(alphabet="0123456789abcdefABCDEFxg-{}\u0661 ", min_size=30, max_size=40),
    st.uuids().map(str).flatmap(
        lambda t: st.integers(0, 35).map(lambda i: t[:i] + "\u0661" + t[i + 1:])),
    st.uuids().map(str).flatmap(
        lambda t: st.integers(0, 35).map(lambda i: t[:i] + "-" + t[i + 1:])),
))
def test_an_id_parses_as_the_standard_uuid_does_in_the_hyphenated_form(text: str) -> None:
    """`_parse_uuid` accepts exactly the hyphenated form (any case) and gives the value
    `uuid.UUID` gives; anything else is None."""
    parsed = _parse_uuid(text)
    hyphenated = len(text) == 36 and all(
        (c == "-") if i in (8, 13, 18, 23) else c in "0123456789abcdefABCDEF"
        for i, c in enumerate(text))
    if hyphenated:
        assert parsed == UUID(text)
        assert isinstance(parsed, UUID)
    else:
        assert parsed is None


class TestAccessors:
    @pytest.mark.parametrize(
        ("kind", "label", "target", "owner"),
        [
            ("Upload", "weather", Target(agent_id=UUID(A)), UUID(OWN)),
            ("Update", "weather", Target(agent_id=UUID(A)), UUID(OWN)),
            ("Rollback", "weather", Target(agent_id=UUID(A)), UUID(OWN)),
            ("StandaloneBuild", "weather", Target(agent_id=UUID(A)), None),
            ("Clone", "legacy", Target(agent_id=UUID(A)), UUID(OWN)),
            ("GithubClone", "crawler", Target(agent_id=UUID(A)), UUID(OWN)),
            ("McpServerUpload", "files", Target(connector_id=UUID(C)), UUID(OWN)),
        ],
    )
    def test_accessors(self, kind: str, label: str, target: Target, owner: UUID | None) -> None:
        payload = decoded(kind)
        assert payload.build_id == UUID(B)
        assert payload.label() == label
        assert payload.target() == target
        assert payload.job_owner() == owner
        assert payload.secret_owner() == owner

    def test_rollback_build_id_is_not_a_field(self, codec: PayloadCodec) -> None:
        payload = decoded("Rollback")
        assert isinstance(payload, Rollback)
        assert payload.build_id == payload.rollback_build_id
        assert "build_id" not in attrs.fields_dict(Rollback)
        assert "build_id" not in codec.encode(payload)

    def test_update_owner_is_caller(self) -> None:
        payload = decoded("Update")
        assert isinstance(payload, Update)
        assert payload.job_owner() == UUID(OWN)
        assert payload.agent_owner_id == UUID(R)

    @pytest.mark.parametrize("ids", [{}, {"agent_id": UUID(A), "connector_id": UUID(C)}])
    def test_target_needs_exactly_one(self, ids: dict[str, UUID]) -> None:
        with pytest.raises(ValueError, match="exactly one"):
            Target(**ids)


def upload_with(**changes: Any) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(VECTORS["Upload"])
    data.update(changes)
    return data


def mcp_with(**changes: Any) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(VECTORS["McpServerUpload"])
    data.update(changes)
    return data


def without(data: dict[str, Any], key: str) -> dict[str, Any]:
    return {k: v for k, v in data.items() if k != key}


INVALID: list[tuple[object, str]] = [
    (without(upload_with(), "kind"), "kind"),
    (upload_with(kind="Upgrade"), "unknown payload kind 'Upgrade'"),
    (upload_with(kind="upload"), "unknown payload kind 'upload'"),
    (upload_with(kind=0), "'kind' must be a string"),
    (upload_with(kind=None), "'kind' must be a string"),
    ([json.loads(VECTORS["Upload"])], "JSON object"),
    (VECTORS["Upload"], "JSON object"),
    (None, "JSON object"),
    (without(upload_with(), "writable"), "field 'writable': required field missing"),
    (without(upload_with(), "build_id"), "field 'build_id': required field missing"),
    (without(mcp_with(), "source"), "field 'source': required field missing"),
    (upload_with(ports=[80, 70000]), "field 'ports'"),
    (upload_with(ports=[-1]), "field 'ports'"),
    (upload_with(ports=["80"]), "field 'ports'"),
    (upload_with(ports=[True]), "field 'ports'"),
    (upload_with(ports=[80.0]), "field 'ports'"),
    (upload_with(ports="80"), "field 'ports'"),
    (upload_with(ports={"80": 80}), "field 'ports'"),
    (upload_with(ports=None), "field 'ports'"),
    (upload_with(writable="true"), "field 'writable'"),
    (upload_with(writable=1), "field 'writable'"),
    (upload_with(build_id="not-a-uuid"), "field 'build_id'"),
    (upload_with(build_id=5), "field 'build_id'"),
    (upload_with(build_id=B.replace("-", "")), "field 'build_id'"),
    (upload_with(build_id=f"{{{B}}}"), "field 'build_id'"),
    (upload_with(agent_id=None), "field 'agent_id'"),
    (upload_with(env={"A": 5}), "field 'env"),
    (upload_with(env={"A": None}), "field 'env"),
    (upload_with(env=["A"]), "field 'env'"),
    (upload_with(name=None), "field 'name'"),
    (upload_with(name=5), "field 'name'"),
    (upload_with(writable_path=5), "field 'writable_path'"),
    (mcp_with(source={"Svn": {"url": "x"}}), "field 'source'"),
    (mcp_with(source={"Zip": {"zip_path": "x"}, "Github": {"url": "y"}}), "field 'source'"),
    (mcp_with(source={}), "field 'source'"),
    (mcp_with(source="Zip"), "field 'source'"),
    (mcp_with(source={"Zip": "x"}), "field 'source'"),
    (mcp_with(source={"Zip": {}}), "field 'source.zip_path'"),
    (mcp_with(source={"zip": {"zip_path": "x"}}), "field 'source'"),
    (mcp_with(env=[]), "field 'env'"),
    (mcp_with(env={"K": 5}), "field 'env'"),
]


class TestInvalid:
    @pytest.mark.parametrize(("data", "message"), INVALID)
    def test_rejected(self, codec: PayloadCodec, data: object, message: str) -> None:
        with pytest.raises(InvalidPayload) as info:
            codec.decode(data)
        assert message in str(info.value)
        # The traceback a worker logs must not carry the raw cattrs/attrs error either.
        assert info.value.__suppress_context__ or info.value.__context__ is None

    @pytest.mark.parametrize(
        "changes",
        [
            {"name": [SECRETISH]},
            {"env": {"API_KEY": [SECRETISH]}},
            {"env": {"API_KEY": {"v": SECRETISH}}},
            {"ports": [SECRETISH]},
            {"build_id": SECRETISH},
            {"writable": SECRETISH},
            {"writable_path": {SECRETISH: 1}},
            {"ports": SECRETISH},
        ],
    )
    def test_message_never_quotes_values(self, codec: PayloadCodec, changes: Any) -> None:
        with pytest.raises(InvalidPayload) as info:
            codec.decode(upload_with(**changes))
        assert SECRETISH not in str(info.value)
        assert SECRETISH not in repr(info.value)

    def test_source_message_never_quotes_values(self, codec: PayloadCodec) -> None:
        for source in [{SECRETISH: {}}, {"Zip": {"zip_path": [SECRETISH]}}, SECRETISH]:
            with pytest.raises(InvalidPayload) as info:
                codec.decode(mcp_with(source=source))
            assert SECRETISH not in str(info.value)

    def test_hand_built_ports_checked(self) -> None:
        data = decoded("Clone")
        assert isinstance(data, Clone)
        with pytest.raises(InvalidPayload, match="ports"):
            attrs.evolve(data, ports=(65536,))
        with pytest.raises(InvalidPayload, match="ports"):
            attrs.evolve(data, ports=(True,))
        # Any iterable is accepted by hand and stored as a tuple.
        assert attrs.evolve(data, ports=[0, 65535]).ports == (0, 65535)  # type: ignore[arg-type]

    def test_hand_built_env_checked(self) -> None:
        data = decoded("Clone")
        assert isinstance(data, Clone)
        with pytest.raises(InvalidPayload, match="env"):
            attrs.evolve(data, env={"A": 1})  # type: ignore[dict-item]
        for bad in ({"K": 5}, {"K": None}, {5: "v"}, ["K"]):
            with pytest.raises(InvalidPayload, match="env"):
                McpServerUpload(
                    build_id=UUID(B), connector_id=UUID(C), owner_id=UUID(OWN), name="n",
                    source=ZipSource("z"), image_tag="t", env=bad,  # type: ignore[arg-type]
                )  # fmt: skip


class TestRawBuildId:
    @pytest.mark.parametrize(
        ("data", "expected"),
        [
            ({"kind": "Upload", "build_id": B}, UUID(B)),
            ({"build_id": B, "ports": "broken"}, UUID(B)),
            ({"kind": "Rollback", "rollback_build_id": B}, UUID(B)),
            ({"rollback_build_id": B}, UUID(B)),
            ({"kind": "Rollback", "rollback_build_id": "bad", "build_id": A}, UUID(A)),
            ({"kind": "Rollback", "rollback_build_id": B, "build_id": A}, UUID(B)),
            ({"build_id": "not-a-uuid"}, None),
            ({"build_id": 5}, None),
            ({}, None),
            ([B], None),
            (B, None),
            (None, None),
        ],
    )
    def test_raw_build_id(self, data: object, expected: UUID | None) -> None:
        assert raw_build_id(data) == expected


class TestCodecTypes:
    def test_duplicate_kind(self) -> None:
        with pytest.raises(ValueError, match="Upload"):
            PayloadCodec([Upload, Upload])

    def test_subset_of_kinds(self) -> None:
        codec = PayloadCodec([Upload])
        assert codec.kinds == frozenset({"Upload"})
        with pytest.raises(InvalidPayload, match="unknown payload kind 'Clone'"):
            codec.decode(json.loads(VECTORS["Clone"]))

    def test_encode_unregistered(self) -> None:
        """encode takes any Payload, registered or not."""
        payload = decoded("Clone")
        assert dumps(PayloadCodec([Upload]).encode(payload)) == VECTORS["Clone"]

    def test_field_named_kind_rejected(self) -> None:
        @attrs.frozen(kw_only=True)
        class Bad(Payload):
            kind: ClassVar[str] = "Bad"
            build_id: UUID

            def label(self) -> str:
                return ""

            def target(self) -> Target:
                return Target(agent_id=self.build_id)

            def job_owner(self) -> UUID | None:
                return None

        @attrs.frozen(kw_only=True)
        class Tagless(Payload):
            build_id: UUID

            def label(self) -> str:
                return ""

            def target(self) -> Target:
                return Target(agent_id=self.build_id)

            def job_owner(self) -> UUID | None:
                return None

        PayloadCodec([Bad])
        with pytest.raises(TypeError, match="kind"):
            PayloadCodec([Tagless])


# --------------------------------------------------------------------- property tests

_text = st.text(max_size=20)
_optional_text = st.none() | _text
_BASE: dict[object, st.SearchStrategy[Any]] = {
    UUID: st.uuids(),
    str: _text,
    str | None: _optional_text,
    bool: st.booleans(),
    tuple[int, ...]: st.lists(st.integers(0, 65535), max_size=5).map(tuple),
    Mapping[str, str]: st.dictionaries(_text, _text, max_size=4),
    Mapping[str, Secret]: st.dictionaries(_text, _text.map(Secret), max_size=3),
    McpSource: st.builds(ZipSource, _text) | st.builds(GithubSource, _text),
}


def _strategy_for(cls: type[Payload]) -> st.SearchStrategy[Payload]:
    fields = {f.alias: _BASE[f.type] for f in attrs.fields(cls)}
    return st.builds(cls, **fields)


payloads = st.one_of([_strategy_for(cls) for cls in BUILTIN_PAYLOAD_TYPES])
BOX = SecretBox(bytes(32))


def test_strategies_cover_every_field_type() -> None:
    for cls in BUILTIN_PAYLOAD_TYPES:
        for field in attrs.fields(cls):
            assert field.type in _BASE, (cls, field.name)
            assert get_origin(field.type) is not dict or get_args(field.type)


@given(payloads)
def test_round_trip(payload: Payload) -> None:
    """Every valid payload survives encode -> JSON text -> decode unchanged."""
    codec = PayloadCodec(secrets=BOX)
    encoded = codec.encode(payload)
    assert next(iter(encoded)) == "kind"
    text = dumps(encoded)
    again = codec.decode(json.loads(text))
    assert again == payload
    assert type(again) is type(payload)
    assert again.build_id == payload.build_id
    if not getattr(payload, "env", None):  # sealed values get a fresh nonce each time
        assert dumps(codec.encode(again)) == text
    # The agent kinds' env may be written in plaintext too (but not a value that would read
    # back as a sealed one: the codec refuses those).
    compat = PayloadCodec(secrets=BOX, seal_compat_fields=False)
    env = getattr(payload, "env", {})
    if not isinstance(payload, McpServerUpload) and not any(
        is_sealed_token(v.reveal()) for v in env.values()
    ):
        assert compat.decode(json.loads(dumps(compat.encode(payload)))) == payload


def test_a_kind_is_at_most_100_characters() -> None:
    """build_jobs_pending_kind (0011) indexes a kind by its first 100 characters."""
    from nasiko_queue import JobArgs, PayloadCodec

    @attrs.frozen
    class Long(JobArgs):
        kind: ClassVar[str] = "k" * 101

    with pytest.raises(TypeError, match="at most 100"):
        PayloadCodec(types=[Long])


# -- enqueue (issue #13): the text enqueue writes --------------------------------------


@pytest.mark.parametrize("kind", list(VECTORS))
def test_dumps_writes_the_serde_bytes(codec: PayloadCodec, kind: str) -> None:
    """`PayloadCodec.dumps`, the text enqueue sends, is byte for byte the serde row."""
    assert codec.dumps(codec.decode(json.loads(VECTORS[kind]))) == VECTORS[kind]


def test_dumps_writes_non_ascii_raw_as_serde_does(codec: PayloadCodec) -> None:
    text = VECTORS["Clone"].replace('"legacy"', '"météo ☂ 𝄞"')
    assert codec.dumps(codec.decode(json.loads(text))) == text


def _reference_encode(payload: Payload) -> dict[str, Any]:
    """`encode` as written before its per-class plan: cattrs dispatch on each field."""
    out: dict[str, Any] = {"kind": payload.kind}
    for field in attrs.fields(type(payload)):
        out[field.name] = converter.unstructure(getattr(payload, field.name),
                                                unstructure_as=field.type)
    return out


def _strings(value: object) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [t for k, v in value.items() for t in _strings(k) + _strings(v)]
    if isinstance(value, list | tuple):
        return [t for v in value for t in _strings(v)]
    return []


@given(payloads)
def test_the_per_class_plan_writes_what_cattrs_dispatch_writes(payload: Payload) -> None:
    codec = PayloadCodec(secrets=BOX)
    encoded = codec.encode(payload)
    reference = _reference_encode(attrs.evolve(payload, env={}) if hasattr(payload, "env")
                                  else payload)
    sealed = {f.name for f in attrs.fields(type(payload)) if f.metadata.get("sealed")}
    assert list(encoded) == list(reference)
    assert {k: v for k, v in encoded.items() if k not in sealed} == {
        k: v for k, v in reference.items() if k not in sealed}
    if any("\x00" in text for text in _strings(encoded)):  # jsonb cannot store U+0000
        with pytest.raises(InvalidPayload, match="a NUL character"):
            codec.dumps(payload)
    else:
        written = json.loads(codec.dumps(payload))
        assert list(written) == list(encoded)
        assert {k: v for k, v in written.items() if k not in sealed} == {
            k: v for k, v in encoded.items() if k not in sealed}


def test_a_nul_character_is_refused_naming_the_field(codec: PayloadCodec) -> None:
    """jsonb cannot store U+0000: refused before anything is sent, by field, not value."""
    payload = attrs.evolve(codec.decode(json.loads(VECTORS["Update"])), changelog="a\x00b")
    with pytest.raises(InvalidPayload, match="field 'changelog': a NUL character") as caught:
        codec.dumps(payload)
    assert "a\x00b" not in str(caught.value)
    # An escaped backslash before "u0000" is no NUL.
    ok = attrs.evolve(payload, changelog="C:\\u0000")
    assert json.loads(codec.dumps(ok))["changelog"] == "C:\\u0000"


@attrs.frozen(kw_only=True)
class _Measure(JobArgs):
    kind: ClassVar[str] = "measure"
    value: float


def test_a_nan_is_refused_naming_the_field() -> None:
    codec = PayloadCodec([_Measure])
    assert codec.dumps(_Measure(value=1.5)) == '{"kind":"measure","value":1.5}'
    for bad in (float("nan"), float("inf")):
        with pytest.raises(InvalidPayload, match="field 'value': a float that JSON"):
            codec.dumps(_Measure(value=bad))
