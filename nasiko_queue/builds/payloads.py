"""
Job payloads: what a job asks the executor to do, and its JSON form in `build_jobs.payload`.

The payload is a tagged union (docs/rules.md §2). On the wire it is exactly what the original Rust
worker's serde writes for ``#[serde(tag = "kind")] enum BuildJobPayload``: one JSON object,
``"kind"`` first with the variant name in PascalCase, then the fields in declaration order,
``null`` for an absent optional, hyphenated UUIDs. A row written by either side parses on the
other, so both workers can share one table during a migration.

Each variant is a frozen attrs class deriving from `Payload`. Applications add their own job
types the same way and register them with a `PayloadCodec`; the codec is the one place that
turns payloads into JSON-ready dicts and back, and that seals and opens secret fields.
"""

import abc
import functools
import json
import logging
import re
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, ClassVar, Final, cast, get_args, get_origin
from uuid import UUID

import attrs
import cattrs

try:
    # asyncpg's own UUID, the type of every uuid column it returns: a subclass of
    # uuid.UUID, equal and hashing alike, whose constructor is compiled.
    from asyncpg.pgproto.pgproto import UUID as _FastUUID
except ImportError:  # pragma: no cover - an asyncpg that moved it: the standard one
    _FastUUID = UUID

from ..errors import InvalidPayload, SecretDecryptError, SecretsNotConfigured
from ..plain.args import JobArgs
from ..secrets import Secret, SecretBox, is_sealed_token

__all__ = [
    "BUILTIN_PAYLOAD_TYPES",
    "PLAINTEXT_COMPAT",
    "SEALED",
    "Clone",
    "GithubClone",
    "GithubSource",
    "McpServerUpload",
    "McpSource",
    "Payload",
    "PayloadCodec",
    "Rollback",
    "StandaloneBuild",
    "Target",
    "Update",
    "Upload",
    "ZipSource",
    "converter",
    "raw_build_id",
]

logger = logging.getLogger("nasiko_queue.payloads")

#: The longest `kind` a payload type may have.
MAX_KIND_LENGTH: Final = 100
#: attrs metadata key marking a `Mapping[str, Secret]` field whose values are stored sealed.
SEALED: Final = "sealed"
#: attrs metadata key marking a sealed field that the original worker writes in plaintext
#: (the `env` of Upload, Clone and GithubClone). On decode, a value that is not a sealed
#: token is taken as plaintext; a codec built with ``seal_compat_fields=False`` writes the
#: field in plaintext, for a table shared with replicas running the original's code.
PLAINTEXT_COMPAT: Final = "plaintext_compat"


# --------------------------------------------------------------------------- model


@attrs.frozen
class Target:
    """
    The row a job builds: an agent or an MCP connector, never both (`build_jobs` has one
    column for each and a CHECK that exactly one is set).
    """

    agent_id: UUID | None = None
    connector_id: UUID | None = attrs.field(default=None)

    @connector_id.validator
    def _exactly_one(self, _attr: "attrs.Attribute[UUID | None]", value: UUID | None) -> None:
        if (self.agent_id is None) == (value is None):
            raise ValueError("a Target has exactly one of agent_id and connector_id")


class Payload(abc.ABC):
    """
    Base class of every job payload, built-in or user-defined.

    A payload type is a frozen attrs class (``@attrs.frozen(kw_only=True)``) deriving from
    `Payload`. Its attrs fields are its JSON fields, written in declaration order after the
    tag. It fulfils this contract:

    - ``kind: ClassVar[str]``: the tag, unique within a `PayloadCodec`. It is the value of
      the ``"kind"`` key on the wire, so no field may be called ``kind``.
    - ``build_id: UUID``: the id of the build row this job drives. An attrs field in every
      built-in type except `Rollback`, where it is a read-only property returning
      ``rollback_build_id`` (the original's field name). A property is not a field, so it
      is not written to JSON.
    - ``label() -> str``: a human name for logs.
    - ``target() -> Target``: the agent or connector the job row points at.
    - ``job_owner() -> UUID | None``: the ``build_jobs.owner_id`` of the job row, or None
      when the payload does not know it and the enqueuer must give it.
    - ``secret_owner() -> UUID | None``: whose key seals the secret fields; by default
      ``job_owner()``.

    Secret fields: a field typed ``Mapping[str, Secret]`` and declared with
    ``attrs.field(metadata={"sealed": True})`` is stored with each value sealed by the
    codec's `SecretBox` for ``secret_owner()``, bound to its key. On decode, a value that
    does not open is dropped and logged by key, never by value (in a plain job's
    `JobArgs`, it raises `InvalidPayload` instead: the job is discarded, not run
    without it). Adding
    ``"plaintext_compat": True`` to the metadata also accepts plaintext values on decode
    (rows written before the field was sealed) and lets a codec built with
    ``seal_compat_fields=False`` write the field in plaintext.

    A field added to a type later must have a default, so that older rows still parse.
    """

    __slots__ = ()

    kind: ClassVar[str]

    if TYPE_CHECKING:
        # For type checkers only. Every payload type is an attrs class, so `attrs.fields`
        # and `attrs.evolve` take any Payload; and `build_id` is each subclass's own attrs
        # field or property, which a base-class descriptor at runtime would get in the way of.
        __attrs_attrs__: ClassVar[tuple["attrs.Attribute[Any]", ...]]

        @property
        def build_id(self) -> UUID: ...

    @abc.abstractmethod
    def label(self) -> str:
        """A human name for the job, for logs."""

    @abc.abstractmethod
    def target(self) -> Target:
        """The agent or connector this job builds."""

    @abc.abstractmethod
    def job_owner(self) -> UUID | None:
        """The job row's `owner_id`, or None when the enqueuer must supply it."""

    def secret_owner(self) -> UUID | None:
        """The owner whose key seals this payload's secret fields."""
        return self.job_owner()


def _check_ports(_inst: object, _attr: "attrs.Attribute[tuple[int, ...]]", value: Any) -> None:
    # A loop, not all() over a generator: this runs for every job a worker decodes.
    for port in value:
        if type(port) is not int or not 0 <= port <= 65535:
            raise InvalidPayload("field 'ports': each port must be an integer in 0..65535")


def _ports(value: Iterable[int]) -> tuple[int, ...]:
    return tuple(value)


def _check_secrets(
    _inst: object, attr: "attrs.Attribute[Mapping[str, Secret]]", value: Any
) -> None:
    # `_to_secrets` made it a dict, unless it was no Mapping: test that first, as
    # the ABC's isinstance costs more than the rest on the worker's path.
    if type(value) is dict or isinstance(value, Mapping):
        for k, v in value.items():
            if type(k) is not str or not isinstance(v, Secret):
                break
        else:
            return
    raise InvalidPayload(f"field '{attr.name}': keys must be strings and values Secrets or strings")


# The converter's argument type is what mypy's attrs plugin gives __init__, so that
# ``env={"K": "v"}`` type-checks for a field typed Mapping[str, Secret].
def _to_secrets(value: Mapping[str, str | Secret]) -> dict[str, Secret]:
    """
    Copy a sealed field's map, wrapping plain `str` values into `Secret`, so that
    ``env={"LOG_LEVEL": "info"}`` builds a payload as readily as ``Secret("info")`` does.
    Anything else is left for the validator to refuse.
    """
    raw: object = value
    if type(raw) is not dict and not isinstance(raw, Mapping):
        return cast(dict[str, Secret], raw)
    return {k: Secret(v) if isinstance(v, str) else v for k, v in raw.items()}


def _ports_field() -> Any:
    return attrs.field(converter=_ports, validator=_check_ports)


@attrs.frozen(kw_only=True)
class Upload(Payload):
    """
    Build and deploy a newly uploaded agent from a zip on disk. `env` values are sealed at
    rest unless the codec is told otherwise; plaintext rows (the original's) still parse.
    """

    kind: ClassVar[str] = "Upload"

    build_id: UUID
    agent_id: UUID
    owner_id: UUID
    upload_id: str
    name: str
    zip_path: str
    image_tag: str
    ports: tuple[int, ...] = _ports_field()
    # Written inline, not by a helper, so that mypy's attrs plugin sees the converter. A dict
    # in a frozen class: copied on the way in, compared by eq, left out of the hash.
    env: Mapping[str, Secret] = attrs.field(
        converter=_to_secrets, validator=_check_secrets, hash=False,
        metadata={SEALED: True, PLAINTEXT_COMPAT: True},
    )  # fmt: skip
    writable: bool
    writable_path: str | None = None

    def label(self) -> str:
        return self.name

    def target(self) -> Target:
        return Target(agent_id=self.agent_id)

    def job_owner(self) -> UUID | None:
        return self.owner_id


@attrs.frozen(kw_only=True)
class Update(Payload):
    """
    Build a new version of an existing agent. `owner_id` is the caller, `agent_owner_id`
    the agent's real owner; no `zip_path` means redeploy from GitHub.
    """

    kind: ClassVar[str] = "Update"

    build_id: UUID
    agent_id: UUID
    owner_id: UUID
    agent_owner_id: UUID
    name: str
    zip_path: str | None = None
    image_tag: str
    new_version: str
    prev_version: str
    prev_image: str | None = None
    changelog: str | None = None
    writable: bool
    writable_path: str | None = None

    def label(self) -> str:
        return self.name

    def target(self) -> Target:
        return Target(agent_id=self.agent_id)

    def job_owner(self) -> UUID | None:
        return self.owner_id


@attrs.frozen(kw_only=True)
class Rollback(Payload):
    """Redeploy an earlier image of an agent. Its build row is `rollback_build_id`."""

    kind: ClassVar[str] = "Rollback"

    rollback_build_id: UUID
    agent_id: UUID
    caller_id: UUID
    agent_owner_id: UUID
    agent_name: str
    target_version: str
    target_image_tag: str
    reason: str | None = None
    writable: bool
    writable_path: str | None = None

    @property
    def build_id(self) -> UUID:
        """`rollback_build_id`: the original names the field differently for this variant."""
        return self.rollback_build_id

    def label(self) -> str:
        return self.agent_name

    def target(self) -> Target:
        return Target(agent_id=self.agent_id)

    def job_owner(self) -> UUID | None:
        return self.caller_id


@attrs.frozen(kw_only=True)
class StandaloneBuild(Payload):
    """
    Build an image without deploying it, from GitHub or an uploaded source. The payload
    names no owner, so the enqueuer supplies the job row's `owner_id`.
    """

    kind: ClassVar[str] = "StandaloneBuild"

    build_id: UUID
    agent_id: UUID
    agent_name: str
    github_url: str | None = None
    source_key: str | None = None
    version_tag: str

    def label(self) -> str:
        return self.agent_name

    def target(self) -> Target:
        return Target(agent_id=self.agent_id)

    def job_owner(self) -> UUID | None:
        return None


@attrs.frozen(kw_only=True)
class Clone(Payload):
    """Legacy: build from a tarball. Nothing enqueues it any more; old rows still run."""

    kind: ClassVar[str] = "Clone"

    build_id: UUID
    agent_id: UUID
    owner_id: UUID
    upload_id: str
    name: str
    tar_gz_path: str
    image_tag: str
    ports: tuple[int, ...] = _ports_field()
    # Written inline, not by a helper, so that mypy's attrs plugin sees the converter. A dict
    # in a frozen class: copied on the way in, compared by eq, left out of the hash.
    env: Mapping[str, Secret] = attrs.field(
        converter=_to_secrets, validator=_check_secrets, hash=False,
        metadata={SEALED: True, PLAINTEXT_COMPAT: True},
    )  # fmt: skip

    def label(self) -> str:
        return self.name

    def target(self) -> Target:
        return Target(agent_id=self.agent_id)

    def job_owner(self) -> UUID | None:
        return self.owner_id


@attrs.frozen(kw_only=True)
class GithubClone(Payload):
    """
    Build and deploy an agent from a GitHub repository. The four `prior_*`/override fields
    come from the original's PR #290 (lost in its later merge); they are optional, so rows
    with or without them parse.
    """

    kind: ClassVar[str] = "GithubClone"

    build_id: UUID
    agent_id: UUID
    owner_id: UUID
    upload_id: str
    name: str
    repo_full_name: str
    branch: str
    image_tag: str
    ports: tuple[int, ...] = _ports_field()
    # Written inline, not by a helper, so that mypy's attrs plugin sees the converter. A dict
    # in a frozen class: copied on the way in, compared by eq, left out of the hash.
    env: Mapping[str, Secret] = attrs.field(
        converter=_to_secrets, validator=_check_secrets, hash=False,
        metadata={SEALED: True, PLAINTEXT_COMPAT: True},
    )  # fmt: skip
    version_override: str | None = None
    prior_version: str | None = None
    prior_image: str | None = None
    prior_status: str | None = None

    def label(self) -> str:
        return self.name

    def target(self) -> Target:
        return Target(agent_id=self.agent_id)

    def job_owner(self) -> UUID | None:
        return self.owner_id


@attrs.frozen
class ZipSource:
    """An MCP server's source as a zip on disk. Wire: ``{"Zip": {"zip_path": ...}}``."""

    zip_path: str


@attrs.frozen
class GithubSource:
    """An MCP server's source on GitHub. Wire: ``{"Github": {"url": ...}}``."""

    url: str


#: Where an MCP server's source comes from; externally tagged on the wire (serde's default).
McpSource = ZipSource | GithubSource
_SOURCE_TAGS: Final[dict[str, type[ZipSource | GithubSource]]] = {
    "Zip": ZipSource,
    "Github": GithubSource,
}


@attrs.frozen(kw_only=True)
class McpServerUpload(Payload):
    """Build and run an MCP server for a connector. `env` values are sealed at rest."""

    kind: ClassVar[str] = "McpServerUpload"

    build_id: UUID
    connector_id: UUID
    owner_id: UUID
    name: str
    source: McpSource
    image_tag: str
    env: Mapping[str, Secret] = attrs.field(
        converter=_to_secrets, validator=_check_secrets, hash=False, metadata={SEALED: True}
    )

    def label(self) -> str:
        return self.name

    def target(self) -> Target:
        return Target(connector_id=self.connector_id)

    def job_owner(self) -> UUID | None:
        return self.owner_id


#: The seven variants of the original, in its order.
BUILTIN_PAYLOAD_TYPES: Final[tuple[type[Payload], ...]] = (
    Upload,
    Update,
    Rollback,
    StandaloneBuild,
    Clone,
    GithubClone,
    McpServerUpload,
)


# --------------------------------------------------------------------------- wire format


class _WireError(TypeError):
    """A JSON value of the wrong shape. Its message names the expected shape, never the value."""


_UUID_RE: Final = re.compile(r"[0-9a-fA-F]{8}-(?:[0-9a-fA-F]{4}-){3}[0-9a-fA-F]{12}")


def _parse_uuid(value: object) -> UUID | None:
    """
    The UUID a payload's string holds, in the hyphenated form only (serde's), or None.

    Built as asyncpg's UUID (`_FastUUID`), the type the job rows' own ids already
    come as: ``uuid.UUID(text)`` took 0.80 µs, a third of decoding an `Upload`
    with its three ids; this takes 0.09 µs. It is a `uuid.UUID` to every caller
    (isinstance, ==, hash, str), and the regex above decides what is accepted.
    """
    if isinstance(value, str) and _UUID_RE.fullmatch(value):
        return cast(UUID, _FastUUID(value))
    return None


def _structure_uuid(value: object, _t: object) -> UUID:
    uuid = _parse_uuid(value)
    if uuid is None:
        raise _WireError("expected a hyphenated UUID string")
    return uuid


def _structure_str(value: object, _t: object) -> str:
    if not isinstance(value, str):
        raise _WireError("expected a string")
    return value


def _structure_int(value: object, _t: object) -> int:
    # bool is an int subclass in Python but not in JSON; a float is never an integer here.
    if not isinstance(value, int) or isinstance(value, bool):
        raise _WireError("expected an integer")
    return value


def _structure_bool(value: object, _t: object) -> bool:
    if not isinstance(value, bool):
        raise _WireError("expected true or false")
    return value


def _structure_secret(_value: object, _t: object) -> Secret:
    raise _WireError("a Secret field is read only by PayloadCodec, from a sealed field")


def _unstructure_secret(_value: Secret) -> object:
    raise TypeError("a Secret is written only by PayloadCodec, sealed")


def _is_homogeneous_tuple(t: Any) -> bool:
    args = get_args(t)
    return get_origin(t) is tuple and len(args) == 2 and args[1] is Ellipsis


def _structure_tuple_factory(t: Any) -> Callable[[object, object], tuple[Any, ...]]:
    item_type = get_args(t)[0]
    # Looked up once, not dispatched per item (as `converter.structure` would).
    structure_item = converter.get_structure_hook(item_type)

    def structure(value: object, _t: object) -> tuple[Any, ...]:
        # Only a JSON array: cattrs alone would also take a string or an object's keys.
        if not isinstance(value, list | tuple):
            raise _WireError("expected an array")
        items = []
        for index, item in enumerate(value):
            try:
                items.append(structure_item(item, item_type))
            except _WireError as exc:
                raise _WireError(f"item {index}: {exc}") from None
        return tuple(items)

    return structure


def _structure_source(value: object, _t: object) -> ZipSource | GithubSource:
    if not isinstance(value, dict) or len(value) != 1:
        raise _WireError('expected an object with exactly one of "Zip" or "Github"')
    ((tag, body),) = value.items()
    source_type = _SOURCE_TAGS.get(tag)
    if source_type is None:
        raise _WireError('expected "Zip" or "Github"')
    if not isinstance(body, dict):
        raise _WireError(f"{tag}: expected an object")
    return converter.structure(body, source_type)


def _unstructure_source(value: ZipSource | GithubSource) -> dict[str, Any]:
    tag = "Zip" if isinstance(value, ZipSource) else "Github"
    return {tag: converter.unstructure(value)}


def _make_converter() -> cattrs.Converter:
    conv = cattrs.Converter(forbid_extra_keys=False, detailed_validation=True)
    conv.register_structure_hook(str, _structure_str)
    conv.register_structure_hook(int, _structure_int)
    conv.register_structure_hook(bool, _structure_bool)
    conv.register_structure_hook(UUID, _structure_uuid)
    conv.register_unstructure_hook(UUID, str)
    conv.register_structure_hook(Secret, _structure_secret)
    conv.register_unstructure_hook(Secret, _unstructure_secret)
    conv.register_structure_hook_factory(_is_homogeneous_tuple, _structure_tuple_factory)
    conv.register_structure_hook_func(lambda t: t == McpSource, _structure_source)
    conv.register_unstructure_hook_func(lambda t: t == McpSource, _unstructure_source)
    return conv


#: The wire-format converter: strict JSON types (no coercion of "80" to 80 or of 1 to
#: True), hyphenated UUIDs, unknown keys ignored, externally tagged `McpSource`. It does
#: not read or write the tag, nor `Secret` values: `PayloadCodec` does those.
converter: Final = _make_converter()


def _format_error(exc: BaseException, _type: object) -> str:
    if isinstance(exc, _WireError | InvalidPayload):
        return str(exc)
    if isinstance(exc, KeyError):
        return "required field missing"
    if isinstance(exc, AttributeError):
        return "expected an object"
    # Anything else may quote the value: say only that the value was refused.
    return "invalid value"


def describe_structure_error(exc: Exception) -> str:
    """A value-free description of a structuring failure, naming the field(s)."""
    return _describe(exc)


def _describe(exc: Exception) -> str:
    """A value-free description of a structuring failure, naming the field(s)."""
    if isinstance(exc, cattrs.BaseValidationError):
        problems = cattrs.transform_error(exc, path="$", format_exception=_format_error)
    else:
        problems = [_format_error(exc, None)]
    return "; ".join(_field_message(problem) for problem in problems)


def _field_message(problem: str) -> str:
    message, _, path = problem.rpartition(" @ ")
    path = path.removeprefix("$").removeprefix(".")
    return f"field '{path}': {message}" if path else message


@functools.cache  # a class's fields never change; decoding asks once per job
def _attrs_fields(cls: type) -> tuple["attrs.Attribute[Any]", ...]:
    return tuple(attrs.fields(cls))


@functools.cache
def _sealed_fields(cls: type) -> tuple["attrs.Attribute[Any]", ...]:
    return tuple(f for f in _attrs_fields(cls) if f.metadata.get(SEALED))


#: A build payload or a plain job's arguments: what a codec encodes and decodes.
AnyPayload = Payload | JobArgs


# -- enqueue (issue #13) --
#: The compact JSON of `PayloadCodec.dumps`, built once (json.dumps with options
#: builds an encoder on every call).
_JSON: Final = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False, allow_nan=False)


@functools.cache
def _encode_plan(
    cls: type[AnyPayload],
) -> tuple[tuple[str, Callable[[Any], Any] | None, "attrs.Attribute[Any] | None"], ...]:
    """
    How `PayloadCodec.encode` writes each field of `cls`: its name, its cattrs
    unstructure hook (the one `converter.unstructure(value, unstructure_as=type)`
    dispatches to), and the field itself when it is sealed. Checked and looked up
    once per class, not once per payload (they were half of an encode); so a hook
    registered on `converter` after a class's first encode does not apply to it.
    """
    _check_type(cls)
    plan = []
    for f in _attrs_fields(cls):
        if not f.init:
            continue
        hook = converter.get_unstructure_hook(f.type)
        sealed = f if f.metadata.get(SEALED) else None
        # None: the value is its own JSON (str, int, bool: cattrs' identity hook).
        plan.append((f.name, None if hook is _IDENTITY and sealed is None else hook, sealed))
    return tuple(plan)


#: cattrs' unstructure hook of the types that are their own JSON.
_IDENTITY: Final = converter.get_unstructure_hook(str)


def _no_utf8(text: str) -> bool:
    """Whether `text` holds a lone surrogate, which has no UTF-8 form."""
    if text.isascii():
        return False
    try:
        text.encode()
    except UnicodeEncodeError:
        return True
    return False


def _bad_field(data: dict[str, Any]) -> str | None:
    """The first field of encoded `data` holding a NUL character, a lone surrogate or
    a non-finite float."""

    def bad(value: object) -> bool:
        if isinstance(value, str):
            return "\x00" in value or _no_utf8(value)
        if isinstance(value, float):
            return value != value or value in (float("inf"), float("-inf"))
        if isinstance(value, dict):
            return any(bad(k) or bad(v) for k, v in value.items())
        if isinstance(value, list | tuple):
            return any(bad(v) for v in value)
        return False

    return next((name for name, value in data.items() if bad(value)), None)


def _check_type(cls: type[AnyPayload]) -> None:
    """Refuse, when registering, a type that cannot be encoded."""
    if not (isinstance(cls, type) and issubclass(cls, Payload | JobArgs) and attrs.has(cls)):
        raise TypeError(f"{cls!r} is not an attrs class deriving from Payload or JobArgs")
    kind = getattr(cls, "kind", None)
    if not isinstance(kind, str) or not kind:
        raise TypeError(f"{cls.__name__} has no `kind: ClassVar[str]`")
    if len(kind) > MAX_KIND_LENGTH:
        # build_jobs_pending_kind (0011) indexes a kind by its first 100 characters.
        raise TypeError(f"{cls.__name__}.kind is {len(kind)} characters; at most "
                        f"{MAX_KIND_LENGTH}")
    attrs.resolve_types(cls)
    fields = attrs.fields_dict(cls)
    if "kind" in fields:
        raise TypeError(f"{cls.__name__} has a field named 'kind', which is the tag")
    if issubclass(cls, Payload) and "build_id" not in fields and not hasattr(cls, "build_id"):
        raise TypeError(f"{cls.__name__} has no build_id")
    for field in _sealed_fields(cls):
        args = get_args(field.type)
        if not (issubclass(get_origin(field.type) or object, Mapping) and args[1:] == (Secret,)):
            raise TypeError(f"{cls.__name__}.{field.name} is sealed but not a Mapping[str, Secret]")


class PayloadCodec:
    """
    Turns payloads into JSON-ready dicts and back, for a set of payload types.

    `encode` writes ``{"kind": ..., <fields in declaration order>}``, so that
    ``json.dumps(d, separators=(",", ":"), ensure_ascii=False)`` is byte for byte what
    serde_json writes. `decode` takes parsed JSON and raises `InvalidPayload`, whose message
    names the field at fault and never its value.

    With a `SecretBox`, sealed fields are encrypted on encode and decrypted on decode.
    Without one, encoding a non-empty sealed field raises `SecretsNotConfigured` (a secret
    is never stored in clear), and decoding drops sealed values with a warning.

    Fields marked ``plaintext_compat`` (the `env` of Upload, Clone and GithubClone) are
    sealed too, unless `seal_compat_fields` is False: then they are written in plaintext,
    as the original worker writes and reads them (`QueueConfig.seal_agent_env`). Either
    way, decoding takes a value of theirs that is not a sealed token as plaintext.
    """

    def __init__(
        self,
        types: Iterable[type[AnyPayload]] = BUILTIN_PAYLOAD_TYPES,
        secrets: SecretBox | None = None,
        *,
        seal_compat_fields: bool = True,
    ) -> None:
        self._types: dict[str, type[AnyPayload]] = {}
        for cls in types:
            _check_type(cls)
            if cls.kind in self._types:
                raise ValueError(f"two payload types have kind {cls.kind!r}")
            self._types[cls.kind] = cls
        self._secrets = secrets
        self._seal_compat = seal_compat_fields

    def __repr__(self) -> str:
        return (
            f"PayloadCodec(kinds={sorted(self._types)!r}, secrets={self._secrets!r}, "
            f"seal_compat_fields={self._seal_compat!r})"
        )

    @property
    def kinds(self) -> frozenset[str]:
        """The tags this codec decodes."""
        return frozenset(self._types)

    def encode(self, payload: AnyPayload) -> dict[str, Any]:
        """Return the wire dict of any `Payload` or `JobArgs`, registered or not, sealing
        secret fields."""
        cls = type(payload)
        out: dict[str, Any] = {"kind": cls.kind}
        for name, unstructure, sealed in _encode_plan(cls):
            value = getattr(payload, name)
            if unstructure is None:
                out[name] = value
            elif sealed is None:
                out[name] = unstructure(value)
            elif sealed.metadata.get(PLAINTEXT_COMPAT) and not self._seal_compat:
                out[name] = _plain(payload, name, value)
            else:
                out[name] = self._seal(payload, sealed, value)
        return out

    # -- enqueue (issue #13) --
    def dumps(self, payload: AnyPayload) -> str:
        """
        The payload's JSON text as enqueue writes it: `encode`, compact.

        One function for the queue and for anything that must write the very same
        bytes (the benchmarks' bare-asyncpg ceilings insert it). Non-ASCII text is
        written as UTF-8, as serde_json writes it (PostgreSQL stores the same jsonb
        either way; the size check then counts the bytes the row holds).

        Raises `InvalidPayload` for a value the worker's decoding would refuse (a
        wrong type: ``Mail(to=5)``), and for what jsonb would refuse, naming the field: a
        NUL character (jsonb has no way to store one), a lone surrogate (no UTF-8
        form: the client could not even send it), a NaN or infinite float (not
        JSON); so that `enqueue_many` can say which payload it was instead of the
        server or the driver failing the whole statement.
        """
        data = self.encode(payload)
        self._check_types(payload, data)
        try:
            text = _JSON.encode(data)
        except ValueError:  # allow_nan=False: no NaN or Infinity tokens
            raise InvalidPayload(f"{payload.kind} payload: field '{_bad_field(data)}': a "
                                 "float that JSON cannot hold (NaN or infinite)") from None
        if "\\u0000" in text and (field := _bad_field(data)) is not None:
            raise InvalidPayload(f"{payload.kind} payload: field '{field}': a NUL character "
                                 "(\\u0000), which PostgreSQL's jsonb cannot store")
        if _no_utf8(text):
            raise InvalidPayload(f"{payload.kind} payload: field '{_bad_field(data)}': a "
                                 "lone surrogate, which has no UTF-8 form (text to store "
                                 "must be valid Unicode)")
        return text

    @staticmethod
    def _check_types(payload: AnyPayload, data: dict[str, Any]) -> None:
        """
        Refuse at enqueue, naming the field, what the worker would refuse at its
        claim: a value of the wrong type (attrs does not check annotations, so
        ``Mail(to=5)`` constructs). The worker's own decoding, on the wire dict:
        the same converter, sealed fields left out (they were sealed from
        `Secret` values, which `encode` checked).
        """
        cls = type(payload)
        body = data
        if sealed := _sealed_fields(cls):
            body = dict(data)
            for field in sealed:
                body[field.name] = {}
        try:
            converter.structure(body, cls)
        except Exception as exc:
            raise InvalidPayload(f"invalid {payload.kind} payload: {_describe(exc)}") from None

    def _seal(
        self, payload: AnyPayload, field: "attrs.Attribute[Any]", values: Mapping[str, Secret]
    ) -> dict[str, str]:
        if not values:
            return {}
        if self._secrets is None:
            raise SecretsNotConfigured(_no_key_message(payload, field))
        owner = payload.secret_owner()
        if owner is None:
            raise InvalidPayload(
                f"{payload.kind} payload: field '{field.name}' needs a secret_owner()"
            )
        return {
            key: self._secrets.seal(owner, key, value.reveal()) for key, value in values.items()
        }

    def decode(self, data: object) -> Payload:
        """
        Parse a payload from its JSON value (as `json.loads` returns it).

        Raises `InvalidPayload` for a non-object, a missing or unknown ``kind``, a missing
        required field or a value of the wrong type. Unknown keys are ignored.
        """
        payload = self._decode(data)
        if not isinstance(payload, Payload):
            raise InvalidPayload(f"{payload.kind} is a plain job, not a build payload")
        return payload

    def decode_args(self, data: object) -> JobArgs:
        """`decode` for a plain job's arguments."""
        args = self._decode(data)
        if not isinstance(args, JobArgs):
            raise InvalidPayload(f"{args.kind} is a build payload, not a plain job")
        return args

    def _decode(self, data: object) -> AnyPayload:
        if not isinstance(data, dict):
            raise InvalidPayload(f"job payload must be a JSON object, not {_json_type(data)}")
        if "kind" not in data:
            raise InvalidPayload("job payload has no 'kind'")
        kind = data["kind"]
        if not isinstance(kind, str):
            raise InvalidPayload(f"job payload 'kind' must be a string, not {_json_type(kind)}")
        cls = self._types.get(kind)
        if cls is None:
            shown = kind if len(kind) <= 40 else kind[:40] + "…"
            raise InvalidPayload(f"unknown payload kind {shown!r}")

        # Sealed fields are structured empty and filled in once the owner is known.
        body = dict(data)
        sealed: list[tuple[attrs.Attribute[Any], dict[str, str]]] = []
        for field in _sealed_fields(cls):
            raw = body.get(field.name)
            if raw is None or raw == {}:
                continue
            if not (isinstance(raw, dict) and all(isinstance(v, str) for v in raw.values())):
                shape = "strings" if field.metadata.get(PLAINTEXT_COMPAT) else "sealed strings"
                raise InvalidPayload(
                    f"invalid {kind} payload: field '{field.name}': expected an object of {shape}"
                )
            sealed.append((field, raw))
            body[field.name] = {}

        try:
            payload: AnyPayload = converter.structure(body, cls)
        except Exception as exc:
            raise InvalidPayload(f"invalid {kind} payload: {_describe(exc)}") from None
        if sealed:
            opened = {
                field.alias or field.name: self._open(payload, field, raw)
                for field, raw in sealed
            }
            payload = attrs.evolve(cast(Any, payload), **opened)
        return payload

    def _open(
        self, payload: AnyPayload, field: "attrs.Attribute[Any]", raw: Mapping[str, str]
    ) -> dict[str, Secret]:
        owner = payload.secret_owner()
        plaintext_ok = bool(field.metadata.get(PLAINTEXT_COMPAT))
        values: dict[str, Secret] = {}
        for key, token in raw.items():
            if plaintext_ok and not is_sealed_token(token):
                values[key] = Secret(token)  # written in plaintext, by the original
                continue
            if self._secrets is None:
                reason = "no secrets master key is configured"
            elif owner is None:
                reason = "the payload names no secret owner"
            else:
                try:
                    values[key] = Secret(self._secrets.open(owner, key, token))
                    continue
                except SecretDecryptError:
                    reason = "it does not decrypt"
            if not isinstance(payload, Payload):
                # A plain job's secret: the job fails, saying why, rather than run
                # without its credential (the build kinds keep the original's
                # rule: dropped, logged by key name). A dead job can be retried
                # once the worker has the right key.
                if not is_sealed_token(token):
                    reason = ("it was stored in plaintext (enqueue_json, the CLI and the "
                              "SQL function seal nothing)")
                elif reason == "it does not decrypt":
                    reason += " (a worker with another master key than the enqueuer's?)"
                raise InvalidPayload(f"invalid {payload.kind} payload: secret "
                                     f"{field.name}[{key!r}] does not open: {reason}")
            logger.warning(
                "dropped secret %s.%s of %s payload (build %s): %s",
                field.name, key, payload.kind, getattr(payload, "build_id", None), reason,
            )  # fmt: skip
        return values


def _plain(payload: AnyPayload, field: str, values: Mapping[str, Secret]) -> dict[str, str]:
    """A compat field written in plaintext, as the original worker writes it."""
    out = {key: value.reveal() for key, value in values.items()}
    for key, text in out.items():
        if is_sealed_token(text):
            # It would read back as a sealed value that does not open, and be dropped.
            raise InvalidPayload(
                f"{payload.kind} payload: the value of {field}[{key!r}] starts like a sealed "
                "value ('nq1:'), so it cannot be stored in plaintext; seal it "
                "(QueueConfig.seal_agent_env=True, with a master key)"
            )
    return out


def _no_key_message(payload: AnyPayload, field: "attrs.Attribute[Any]") -> str:
    """What to do when a payload with secrets is encoded and no master key is configured."""
    message = (
        f"the {payload.kind} payload's '{field.name}' values are sealed at rest and no "
        "secrets master key is configured: give Queue(db, secrets=SecretBox.from_base64(key)) "
        "(`nasiko-queue keygen` prints a key; the CLI reads NASIKO_QUEUE_MASTER_KEY)"
    )
    if field.metadata.get(PLAINTEXT_COMPAT):
        message += (
            ". Only for a table shared with replicas running the original worker, which read "
            "these values as plaintext: QueueConfig(seal_agent_env=False) stores them in "
            "plaintext instead (docs/reference/configuration.md)"
        )
    return message


def _json_type(value: object) -> str:
    """The JSON name of a value's type, to describe it without quoting it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list | tuple):
        return "an array"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


def raw_build_id(data: object) -> UUID | None:
    """
    The build id of a payload that may not parse, or None.

    The worker fails an invalid job's build row too, so that its target does not stay
    non-terminal (docs/rules.md §6); this digs the id out of whatever the row holds.
    """
    if not isinstance(data, dict):
        return None
    keys = ("rollback_build_id", "build_id")
    if data.get("kind") != "Rollback":
        keys = keys[::-1]
    for key in keys:
        uuid = _parse_uuid(data.get(key))
        if uuid is not None:
            return uuid
    return None
