"""Gateway configuration: YAML in, validated, resolved into frozen values the gateway uses.

Three stages, each with its own kind of mistake:

1. reading: the file exists and is YAML whose top level is a mapping (syntax errors carry
   the line; a key written twice in one mapping is an error, not a silent override);
2. shape: pydantic models, strict and with ``extra="forbid"``, so a typo in a key is an
   error that suggests the nearest valid key;
3. meaning: cross-field checks (level, pool and model names, keys, upstreams, holdback).

Every problem is a ``ConfigError`` that names the file, the dotted key
(``models[1].queue.holdback.lowest``) and the fix. The result, ``TidegateConfig``, holds only
resolved values: every default filled in, names checked, and helpers that build the core
types (``QueueConfig``, ``BatchConfig``, ``PoolSpec``, ``WorkerSettings``).
docs/config.md is the reference of the keys.
"""

from __future__ import annotations

import difflib
import hashlib
import hmac
import re
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Annotated, Any, Literal, NoReturn
from urllib.parse import urlsplit, urlunsplit

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tidegate.core.batching import BatchConfig
from tidegate.core.queue import AgingConfig, LevelSpec, QueueConfig
from tidegate.core.routing import PoolSpec
from tidegate.engines.registry import KNOWN_MODELS
from tidegate.errors import ConfigError

if TYPE_CHECKING:
    from tidegate.worker.runtime import WorkerSettings

EMBEDDED_SOURCE = "<embedded default>"
DEFAULT_LEVELS = ("high", "medium", "low")
DEFAULT_HOLDBACK: Mapping[str, float] = MappingProxyType({"medium": 0.9, "low": 0.7})
DEFAULT_POOL = "shared"
FIFO_LEVEL = "fifo"  # name of the single queue level under the fifo policy

_NAME_RE = re.compile(r"^[A-Za-z0-9._-]+$")
_DEVICE_RE = re.compile(r"^(auto|cpu|cuda:[0-9]+)$")
_SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
_LOOPBACK_HOSTS = ("localhost", "::1")

# ----------------------------------------------------------------------------- raw schema
# What the YAML may say. Sections given as null (``gateway:`` with nothing under it) mean
# "all defaults". Checks that involve more than one field live in _Resolver.

Name = Annotated[str, Field(pattern=_NAME_RE.pattern)]
PositiveInt = Annotated[int, Field(ge=1)]
NonNegativeFloat = Annotated[float, Field(ge=0)]
PositiveFloat = Annotated[float, Field(gt=0)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class _GatewayIn(_Strict):
    host: Annotated[str, Field(min_length=1)] = "127.0.0.1"
    port: Annotated[int, Field(ge=0, le=65535)] = 8000
    policy: Literal["priority", "fifo"] = "priority"
    shutdown_timeout_s: NonNegativeFloat = 10.0
    max_request_bytes: PositiveInt = 4 * 1024 * 1024


class _AgingIn(_Strict):
    threshold_s: NonNegativeFloat = 30.0
    rate_per_s: NonNegativeFloat = 0.5


class _PrioritiesIn(_Strict):
    levels: Annotated[list[Name], Field(min_length=1)] = Field(
        default_factory=lambda: list(DEFAULT_LEVELS)
    )
    default: str | None = None
    aging: _AgingIn | None = None


class _PoolIn(_Strict):
    priorities: Annotated[list[str], Field(min_length=1)] | None = None
    devices: Annotated[list[str], Field(min_length=1)] = Field(default_factory=lambda: ["auto"])


class _BatchingIn(_Strict):
    max_batch_size: PositiveInt = 32
    batch_window_ms: NonNegativeFloat = 5.0
    max_batch_tokens: PositiveInt | None = None
    max_num_seqs: PositiveInt = 16


class _QueueIn(_Strict):
    max_size: PositiveInt = 1000
    max_size_per_level: dict[str, PositiveInt] = Field(default_factory=dict)
    timeout_s: dict[str, PositiveFloat] = Field(default_factory=dict)
    holdback: dict[str, float | None] | None = None  # None: DEFAULT_HOLDBACK


class _ModelIn(_Strict):
    name: Name
    task: Literal["embeddings", "generate"] | None = None
    engine: Literal["transformers", "simulated", "openai"] = "transformers"
    model_path: str | None = None
    profile: str | None = None
    replicas: Any = None  # a count or {pool: count}: checked by _Resolver for a clear message
    pools: Annotated[list[str], Field(min_length=1)] | None = None
    upstreams: list[str] = Field(default_factory=list)
    slots: PositiveInt | None = None
    batching: _BatchingIn | None = None
    queue: _QueueIn | None = None


class _KeyIn(_Strict):
    name: Name
    sha256: str
    default_priority: str | None = None
    max_priority: str | None = None


class _ConfigIn(_Strict):
    gateway: _GatewayIn | None = None
    priorities: _PrioritiesIn | None = None
    pools: Annotated[dict[str, _PoolIn | None], Field(min_length=1)] | None = None
    models: Annotated[list[_ModelIn], Field(min_length=1)] | None = None
    keys: list[_KeyIn] | None = None


# ----------------------------------------------------------------------------- resolved values


@dataclass(frozen=True, slots=True)
class GatewaySettings:
    host: str = "127.0.0.1"
    port: int = 8000
    policy: str = "priority"  # "priority" or "fifo"
    shutdown_timeout_s: float = 10.0
    max_request_bytes: int = 4 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class PoolConfig:
    name: str
    priorities: tuple[str, ...]  # level names it serves, in level order
    devices: tuple[str, ...]  # "auto", "cpu" or "cuda:N"; "auto" is resolved at start-up


@dataclass(frozen=True, slots=True)
class BatchingSpec:
    max_batch_size: int = 32
    batch_window_ms: float = 5.0
    max_batch_tokens: int | None = None
    max_num_seqs: int = 16


@dataclass(frozen=True, slots=True)
class QueueSpec:
    max_size: int
    max_size_per_level: Mapping[str, int]
    timeout_s: Mapping[str, float]
    holdback: Mapping[str, float]  # levels absent here are never held back


@dataclass(frozen=True, slots=True)
class ModelSpec:
    name: str
    task: str  # "embeddings" or "generate"
    engine: str  # "transformers", "simulated" or "openai"
    model_path: str | None
    profile: str | None
    replicas: Mapping[str, int]  # pool -> replicas started there; empty for openai
    pools: tuple[str, ...]  # pools its replicas may be placed in
    upstreams: tuple[str, ...]  # root URLs (no trailing /v1) of OpenAI-compatible servers
    slots: int | None  # in-flight requests per replica; None: ask the worker's /stats
    batching: BatchingSpec
    queue: QueueSpec

    @property
    def local(self) -> bool:
        """Its replicas are worker processes tidegate starts (not static upstreams)."""
        return self.engine != "openai"

    @property
    def upstream_pool(self) -> str:
        """The pool that upstream replicas count as members of: the model's first pool."""
        return self.pools[0]


@dataclass(frozen=True, slots=True)
class KeySpec:
    name: str
    sha256: str  # lower-case hex digest of the key
    default_priority: str
    max_priority: str  # the most urgent level the key may ask for
    default_level: int  # level indices as the queue sees them (all 0 under fifo)
    max_level: int


@dataclass(frozen=True, slots=True)
class TidegateConfig:
    source: str  # the file it came from, or EMBEDDED_SOURCE
    gateway: GatewaySettings
    levels: tuple[str, ...]  # configured level names, most urgent first
    default_priority: str  # level of requests that name none (without a key's own default)
    aging: AgingConfig
    pools: Mapping[str, PoolConfig]
    models: Mapping[str, ModelSpec]
    keys: tuple[KeySpec, ...]  # empty: open service
    notes: tuple[str, ...] = ()  # things worth knowing that are not errors

    # ------------------------------------------------------------ priorities
    @property
    def policy(self) -> str:
        return self.gateway.policy

    @property
    def fifo(self) -> bool:
        return self.gateway.policy == "fifo"

    @property
    def open_service(self) -> bool:
        return not self.keys

    @property
    def level_names(self) -> tuple[str, ...]:
        """Names of the queue levels, index = level: the configured ones, or one under fifo."""
        return (FIFO_LEVEL,) if self.fifo else self.levels

    def level_index(self, name: str) -> int:
        """The queue level of a configured level name (0 for every name under fifo).

        ValueError names the valid ones.
        """
        for index, level in enumerate(self.levels):
            if level == name:
                return 0 if self.fifo else index
        if self.fifo and name == FIFO_LEVEL:
            return 0
        raise ValueError(f"unknown priority {name!r}; expected one of: {', '.join(self.levels)}")

    @property
    def default_level(self) -> int:
        return self.level_index(self.default_priority)

    def parse_priority(self, value: str | int) -> int:
        """A requested priority (``X-Priority`` or the body's ``priority``) as a queue level.

        Accepts a level name (exact, else case-insensitive) or an integer index into
        ``levels`` (0 = most urgent). ValueError says what is accepted. Capping by the key's
        ``max_level`` is the caller's job (403 above the cap).
        """
        if isinstance(value, bool):
            raise ValueError("priority must be a level name or an integer, not a boolean")
        if isinstance(value, int) or (isinstance(value, str) and value.strip().isdigit()):
            index = int(value)
            if not 0 <= index < len(self.levels):
                raise ValueError(
                    f"priority {index} is out of range; expected 0..{len(self.levels) - 1} "
                    f"or one of: {', '.join(self.levels)}"
                )
            return 0 if self.fifo else index
        name = value.strip()
        if name not in self.levels:
            folded = [level for level in self.levels if level.lower() == name.lower()]
            if len(folded) == 1:
                name = folded[0]
        return self.level_index(name)

    # ---------------------------------------------------------------- models
    def model(self, name: str) -> ModelSpec:
        try:
            return self.models[name]
        except KeyError:
            known = ", ".join(self.models)
            raise KeyError(f"unknown model {name!r}; configured: {known}") from None

    def queue_config(self, model_name: str) -> QueueConfig:
        """The gateway's wait queue of a model: levels with their limits, aging, total size.

        Under fifo: one level, no aging, no holdback, no per-level limit or timeout.
        """
        queue = self.model(model_name).queue
        if self.fifo:
            return QueueConfig(
                levels=(LevelSpec(FIFO_LEVEL),),
                max_size=queue.max_size,
                aging=AgingConfig(threshold_s=self.aging.threshold_s, rate_per_s=0.0),
            )
        levels = tuple(
            LevelSpec(
                name,
                max_size=queue.max_size_per_level.get(name),
                timeout_s=queue.timeout_s.get(name),
                holdback_above=queue.holdback.get(name),
            )
            for name in self.levels
        )
        return QueueConfig(levels=levels, max_size=queue.max_size, aging=self.aging)

    def batch_config(self, model_name: str) -> BatchConfig:
        batching = self.model(model_name).batching
        return BatchConfig(
            max_batch_size=batching.max_batch_size,
            max_batch_tokens=batching.max_batch_tokens,
            batch_window_ms=batching.batch_window_ms,
        )

    def pool_specs(self) -> dict[str, PoolSpec]:
        """Pools as the router sees them: the level indices each serves (all {0} under fifo)."""
        return {
            name: PoolSpec(name, frozenset(self.level_index(level) for level in pool.priorities))
            for name, pool in self.pools.items()
        }

    def worker_settings(self, model_name: str, device: str = "cpu") -> WorkerSettings:
        """Settings of one local replica of a model on ``device`` (cpu or cuda:N, not auto)."""
        from tidegate.worker.runtime import WorkerSettings

        model = self.model(model_name)
        if not model.local:
            raise ValueError(
                f"model {model.name!r} is served by upstreams (engine openai): no local replicas"
            )
        if device == "auto" or not _DEVICE_RE.match(device):
            raise ValueError(f"device must be cpu or cuda:N, got {device!r}")
        return WorkerSettings(
            model=model.name,
            engine=model.engine,
            model_path=model.model_path,
            task=model.task,
            device=device,
            max_batch_size=model.batching.max_batch_size,
            batch_window_ms=model.batching.batch_window_ms,
            max_batch_tokens=model.batching.max_batch_tokens,
            max_num_seqs=model.batching.max_num_seqs,
            profile=model.profile,
        )

    # ------------------------------------------------------------------ keys
    def key_for(self, api_key: str) -> KeySpec | None:
        """The key whose digest matches ``api_key``, or None.

        Compares digests with ``hmac.compare_digest`` and visits every key whatever
        matches, so the time taken does not depend on which key (if any) matched.
        """
        digest = hashlib.sha256(api_key.encode("utf-8")).hexdigest()
        found: KeySpec | None = None
        for key in self.keys:
            if hmac.compare_digest(digest, key.sha256):
                found = key
        return found


# ----------------------------------------------------------------------------- entry points


def load_config(
    path: str | Path | None, gateway_overrides: Mapping[str, Any] | None = None
) -> TidegateConfig:
    """Read, validate and resolve a configuration file; None: the embedded default.

    ``gateway_overrides`` (command-line flags such as ``--port``) replace keys of the
    ``gateway`` section before validation. Raises ConfigError naming the file, the key
    and the fix.
    """
    if path is None:
        return parse_config(_with_gateway({}, gateway_overrides), EMBEDDED_SOURCE)
    file = Path(path)
    source = str(path)
    try:
        text = file.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(
            source,
            "(file)",
            "no such file",
            f"check the path (relative paths start at {Path.cwd()}), or give no file "
            "to use the embedded default",
        ) from None
    except IsADirectoryError:
        raise ConfigError(
            source, "(file)", "is a directory", "give the path of a YAML file"
        ) from None
    except UnicodeDecodeError as exc:
        raise ConfigError(
            source, "(file)", f"not UTF-8 text ({exc.reason})", "save the file as UTF-8"
        ) from None
    except OSError as exc:
        raise ConfigError(
            source, "(file)", f"cannot read it: {exc.strerror}", "check its permissions"
        ) from None
    data = _read_yaml(text, source)
    if data is None:  # an empty file (or only comments): every default
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(
            source,
            "(top level)",
            f"the document is {_describe(data)}, not a mapping",
            "write top-level keys such as 'gateway:', 'priorities:', 'pools:', 'models:', "
            "'keys:' (see docs/config.md)",
        )
    data = _with_gateway(data, gateway_overrides)
    return parse_config(data, source, base_dir=file.absolute().parent)


def _with_gateway(data: dict[str, Any], overrides: Mapping[str, Any] | None) -> dict[str, Any]:
    if not overrides:
        return data
    gateway = data.get("gateway") or {}
    if not isinstance(gateway, dict):
        return data  # validation reports the malformed section
    return {**data, "gateway": {**gateway, **overrides}}


def parse_config(
    data: Mapping[str, Any], source: str, *, base_dir: Path | None = None
) -> TidegateConfig:
    """Validate and resolve already-parsed YAML; ``source`` names it in errors.

    Relative ``model_path`` and ``profile`` are resolved against ``base_dir`` when given
    (load_config passes the config file's folder).
    """
    if not isinstance(data, Mapping):
        raise ConfigError(
            source,
            "(top level)",
            f"the document is {_describe(data)}, not a mapping",
            "write top-level keys such as 'gateway:' and 'models:'",
        )
    try:
        raw = _ConfigIn.model_validate(dict(data))
    except ValidationError as exc:
        raise _from_validation_error(exc, source) from None
    return _Resolver(source, base_dir).resolve(raw)


def check_config(path: str | Path | None) -> tuple[int, str]:
    """For ``tidegate config check FILE``: (exit code, text to print).

    0 and the resolved configuration as YAML when valid; 1 and the error otherwise.
    """
    try:
        config = load_config(path)
    except ConfigError as exc:
        return 1, f"error: {exc.message}"
    return 0, render_config(config)


def render_config(config: TidegateConfig) -> str:
    """The resolved configuration as YAML, every default written out.

    The output is itself a valid configuration that loads to the same values.
    """
    doc: dict[str, Any] = {
        "gateway": {
            "host": config.gateway.host,
            "port": config.gateway.port,
            "policy": config.gateway.policy,
            "shutdown_timeout_s": config.gateway.shutdown_timeout_s,
            "max_request_bytes": config.gateway.max_request_bytes,
        },
        "priorities": {
            "levels": list(config.levels),
            "default": config.default_priority,
            "aging": {
                "threshold_s": config.aging.threshold_s,
                "rate_per_s": config.aging.rate_per_s,
            },
        },
        "pools": {
            name: {"priorities": list(pool.priorities), "devices": list(pool.devices)}
            for name, pool in config.pools.items()
        },
        "models": [_render_model(model) for model in config.models.values()],
        "keys": [
            {
                "name": key.name,
                "sha256": key.sha256,
                "default_priority": key.default_priority,
                "max_priority": key.max_priority,
            }
            for key in config.keys
        ],
    }
    header = [f"# tidegate configuration from {config.source}: valid; defaults filled in."]
    if config.fifo:
        header.append(
            "# policy fifo: each model has one FCFS queue level; no aging, no holdback, "
            "no per-level limits."
        )
    header.extend(f"# note: {note}" for note in config.notes)
    body = yaml.dump(doc, Dumper=_Dumper, sort_keys=False, allow_unicode=True, width=100)
    return "\n".join(header) + "\n" + body


class _Dumper(yaml.SafeDumper):
    """Mappings as blocks, lists of plain values on one line: ``levels: [high, medium, low]``."""


def _represent_list(dumper: yaml.SafeDumper, data: list[Any]) -> yaml.SequenceNode:
    flow = all(not isinstance(item, dict | list) for item in data)
    return dumper.represent_sequence("tag:yaml.org,2002:seq", data, flow_style=flow)


_Dumper.add_representer(list, _represent_list)


def _render_model(model: ModelSpec) -> dict[str, Any]:
    out: dict[str, Any] = {"name": model.name, "task": model.task, "engine": model.engine}
    if model.engine == "transformers":
        out["model_path"] = model.model_path
    elif model.engine == "simulated":
        out["profile"] = model.profile
    if model.local:
        out["replicas"] = dict(model.replicas)
    else:
        out["upstreams"] = list(model.upstreams)
    out["pools"] = list(model.pools)
    out["slots"] = model.slots
    out["batching"] = {
        "max_batch_size": model.batching.max_batch_size,
        "batch_window_ms": model.batching.batch_window_ms,
        "max_batch_tokens": model.batching.max_batch_tokens,
        "max_num_seqs": model.batching.max_num_seqs,
    }
    out["queue"] = {
        "max_size": model.queue.max_size,
        "max_size_per_level": dict(model.queue.max_size_per_level),
        "timeout_s": dict(model.queue.timeout_s),
        "holdback": dict(model.queue.holdback),
    }
    return out


# ----------------------------------------------------------------------------- reading YAML


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key written twice in one mapping (merge keys may override)."""


def _construct_mapping(loader: yaml.SafeLoader, node: yaml.MappingNode) -> dict[Any, Any]:
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge" or not isinstance(key_node, yaml.ScalarNode):
            continue
        key = loader.construct_object(key_node)
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None,
                None,
                f"key {key!r} appears twice in this mapping (first at line {seen[key]})",
                key_node.start_mark,
            )
        seen[key] = key_node.start_mark.line + 1
    return loader.construct_mapping(node)


_UniqueKeyLoader.add_constructor(
    yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG,
    _construct_mapping,
)


def _read_yaml(text: str, source: str) -> Any:
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)  # a SafeLoader: safe
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        problem = exc.problem or "not valid YAML"
        if exc.context:
            problem = f"{exc.context}, {problem}"
        if mark is None:
            raise ConfigError(
                source, "(file)", f"YAML syntax error: {problem}", _YAML_FIX
            ) from None
        fix = _YAML_FIX
        if "\\t" in problem or "\t" in problem:
            fix = "indent with spaces: YAML does not allow tabs"
        elif "appears twice" in problem:
            fix = "keep one of the two: a YAML mapping holds each key once"
        raise ConfigError(
            source,
            f"line {mark.line + 1}",
            f"YAML syntax error at line {mark.line + 1}, column {mark.column + 1}: {problem}",
            fix,
        ) from None
    except yaml.YAMLError as exc:
        raise ConfigError(source, "(file)", f"YAML error: {exc}", _YAML_FIX) from None


_YAML_FIX = (
    "check the indentation and quoting at or just before that line; quote values that "
    "contain ': ', ' #' or start with a special character"
)

# ----------------------------------------------------------------------------- pydantic errors

_TYPE_HINTS: dict[str, tuple[str, str]] = {
    # error type: (what was expected, the fix)
    "int_type": ("an integer", "write a whole number without quotes, e.g. 8"),
    "int_parsing": ("an integer", "write a whole number without quotes, e.g. 8"),
    "int_from_float": ("an integer", "write a whole number, without a fraction"),
    "float_type": ("a number", "write a number without quotes, e.g. 0.5"),
    "float_parsing": ("a number", "write a number without quotes, e.g. 0.5"),
    "string_type": (
        "a text value",
        "quote it: YAML reads unquoted yes/no/on/off as booleans and digits as numbers",
    ),
    "bool_type": ("true or false", "write true or false"),
    "list_type": ("a list", "write [a, b] or one '- item' line per item"),
    "dict_type": ("a mapping", "write 'key: value' lines indented under this key"),
    "model_type": ("a mapping", "write 'key: value' lines indented under this key"),
    "model_attributes_type": ("a mapping", "write 'key: value' lines indented under this key"),
}

_BOUNDS = {
    "greater_than_equal": ">=",
    "greater_than": ">",
    "less_than_equal": "<=",
    "less_than": "<",
}


def _from_validation_error(exc: ValidationError, source: str) -> ConfigError:
    """The first pydantic error as a ConfigError with a dotted key and a fix."""
    error = exc.errors()[0]
    loc = tuple(part for part in error["loc"] if part != "[key]")
    key = _dotted(loc) or "(top level)"
    kind = error["type"]
    ctx = error.get("ctx") or {}
    value = error.get("input")
    if kind == "extra_forbidden":
        name = str(loc[-1]) if loc else "?"
        valid = _fields_at(loc[:-1])
        where = _dotted(loc[:-1]) or "the top level"
        match = difflib.get_close_matches(name, valid, n=1, cutoff=0.6)
        hint = f"did you mean {match[0]!r}? " if match else "remove it; "
        return ConfigError(
            source, key, f"unknown key {name!r}", f"{hint}{where} accepts: {', '.join(valid)}"
        )
    if kind == "missing":
        name = str(loc[-1]) if loc else "?"
        return ConfigError(source, key, f"required key {name!r} is missing", f"add '{name}: ...'")
    if kind in _TYPE_HINTS:
        expected, fix = _TYPE_HINTS[kind]
        return ConfigError(source, key, f"expected {expected}, got {_describe(value)}", fix)
    if kind == "literal_error":
        options = re.findall(r"'([^']*)'", str(ctx.get("expected", "")))
        match = difflib.get_close_matches(str(value), options, n=1, cutoff=0.5)
        hint = f"did you mean {match[0]!r}? " if match else ""
        return ConfigError(
            source,
            key,
            f"{_describe(value)} is not allowed",
            f"{hint}use one of: {', '.join(options)}",
        )
    if kind in _BOUNDS:
        op = _BOUNDS[kind]
        limit = next(iter(ctx.values()), "?")
        return ConfigError(
            source, key, f"{_describe(value)} is out of range", f"use a value {op} {limit}"
        )
    if kind == "too_short":
        minimum = ctx.get("min_length", 1)
        return ConfigError(
            source, key, "is empty", f"give at least {minimum} item(s), or remove the key"
        )
    if kind == "string_too_short":
        return ConfigError(source, key, "is empty", "give a non-empty value")
    if kind == "string_pattern_mismatch":
        return ConfigError(
            source,
            key,
            f"{_describe(value)} is not a valid name",
            "use only letters, digits, '.', '_' and '-'",
        )
    return ConfigError(source, key, error["msg"], "see docs/config.md for what this key accepts")


def _dotted(loc: tuple[int | str, ...]) -> str:
    """('models', 1, 'queue', 'holdback', 'low') -> 'models[1].queue.holdback.low'."""
    out = ""
    for part in loc:
        out = _sub(out, part)
    return out


def _sub(key: str, part: int | str) -> str:
    """``key`` extended by a list index or a mapping key (quoted when not a plain word)."""
    if isinstance(part, int):
        return f"{key}[{part}]"
    if re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_-]*", part):
        return f"{key}.{part}" if key else part
    return f"{key}[{part!r}]"


def _unwrap(tp: Any) -> Any:
    """Strip Annotated and Optional until a plain type remains."""
    while True:
        origin = typing.get_origin(tp)
        if origin is Annotated:
            tp = typing.get_args(tp)[0]
        elif origin in (typing.Union, types.UnionType):
            members = [arg for arg in typing.get_args(tp) if arg is not type(None)]
            if len(members) != 1:
                return tp
            tp = members[0]
        else:
            return tp


def _fields_at(loc: tuple[int | str, ...]) -> list[str]:
    """The keys the schema accepts at ``loc`` (for suggestions); [] when not a section."""
    tp: Any = _ConfigIn
    for part in loc:
        tp = _unwrap(tp)
        if isinstance(tp, type) and issubclass(tp, BaseModel):
            if not isinstance(part, str) or part not in tp.model_fields:
                return []
            tp = tp.model_fields[part].annotation
        elif typing.get_origin(tp) is list:
            tp = typing.get_args(tp)[0]
        elif typing.get_origin(tp) is dict:
            tp = typing.get_args(tp)[1]
        else:
            return []
    tp = _unwrap(tp)
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return list(tp.model_fields)
    return []


def _describe(value: Any) -> str:
    if value is None:
        return "nothing (null)"
    if isinstance(value, bool):
        return f"the boolean {str(value).lower()}"
    if isinstance(value, str):
        shown = value if len(value) <= 40 else value[:37] + "..."
        return f"the text {shown!r}"
    if isinstance(value, int | float):
        return f"the number {value!r}"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "a mapping"
    return f"a {type(value).__name__}"


# ----------------------------------------------------------------------------- cross-field


def _suggest(word: str, options: list[str] | tuple[str, ...]) -> str:
    match = difflib.get_close_matches(word, list(options), n=1, cutoff=0.6)
    return f"did you mean {match[0]!r}? " if match else ""


def _url_root(url: str) -> str | None:
    """The URL without a trailing '/' or '/v1', or None when it is not a usable http(s) URL."""
    try:
        parts = urlsplit(url.strip())
        port = parts.port  # ValueError on a bad port
    except ValueError:
        return None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return None
    if parts.query or parts.fragment or parts.username or parts.password:
        return None
    if port == 0:
        return None
    path = parts.path.rstrip("/")
    if path.endswith("/v1"):
        path = path[: -len("/v1")]
    return urlunsplit((parts.scheme, parts.netloc, path, "", ""))


class _Resolver:
    """Checks what spans fields, fills in defaults, and builds the frozen values."""

    def __init__(self, source: str, base_dir: Path | None) -> None:
        self.source = source
        self.base_dir = base_dir
        self.levels: tuple[str, ...] = DEFAULT_LEVELS
        self.fifo = False
        self.notes: list[str] = []

    def fail(self, key: str, problem: str, fix: str) -> NoReturn:
        raise ConfigError(self.source, key, problem, fix)

    def level(self, name: str, key: str) -> str:
        if name not in self.levels:
            self.fail(
                key,
                f"unknown priority level {name!r}",
                f"{_suggest(name, self.levels)}use one of priorities.levels: "
                f"{', '.join(self.levels)}",
            )
        return name

    def resolve(self, raw: _ConfigIn) -> TidegateConfig:
        gateway_in = raw.gateway or _GatewayIn()
        gateway = GatewaySettings(
            host=gateway_in.host,
            port=gateway_in.port,
            policy=gateway_in.policy,
            shutdown_timeout_s=gateway_in.shutdown_timeout_s,
            max_request_bytes=gateway_in.max_request_bytes,
        )
        self.fifo = gateway.policy == "fifo"
        priorities = raw.priorities or _PrioritiesIn()
        self.levels = self._levels(priorities.levels)
        if priorities.default is not None:
            default = self.level(priorities.default, "priorities.default")
        else:
            default = "medium" if "medium" in self.levels else self.levels[-1]
        aging_in = priorities.aging or _AgingIn()
        aging = AgingConfig(threshold_s=aging_in.threshold_s, rate_per_s=aging_in.rate_per_s)
        pools = self._pools(raw.pools)
        models = self._models(raw.models, pools)
        keys = self._keys(raw.keys or [], default)
        self._gateway_notes(gateway, keys, models)
        return TidegateConfig(
            source=self.source,
            gateway=gateway,
            levels=self.levels,
            default_priority=default,
            aging=aging,
            pools=MappingProxyType(pools),
            models=MappingProxyType(models),
            keys=keys,
            notes=tuple(self.notes),
        )

    # ------------------------------------------------------------ priorities
    def _levels(self, names: list[str]) -> tuple[str, ...]:
        seen: dict[str, int] = {}
        for index, name in enumerate(names):
            key = f"priorities.levels[{index}]"
            if name.isdigit():
                self.fail(
                    key,
                    f"level name {name!r} is a number",
                    "use a word: a number in X-Priority means a level index",
                )
            if name.lower() in seen:
                self.fail(
                    key,
                    f"level {name!r} is listed twice "
                    f"(also priorities.levels[{seen[name.lower()]}])",
                    "give each level a different name (names are compared ignoring case)",
                )
            seen[name.lower()] = index
        return tuple(names)

    # ----------------------------------------------------------------- pools
    def _pools(self, raw: dict[str, _PoolIn | None] | None) -> dict[str, PoolConfig]:
        if raw is None:
            raw = {DEFAULT_POOL: None}
        pools: dict[str, PoolConfig] = {}
        for name, pool_in in raw.items():
            key = _sub("pools", name)
            if not _NAME_RE.match(name):
                self.fail(
                    key,
                    f"{name!r} is not a valid pool name",
                    "use only letters, digits, '.', '_' and '-'",
                )
            pool_in = pool_in or _PoolIn()
            served = list(self.levels)
            if pool_in.priorities is not None:
                for index, level in enumerate(pool_in.priorities):
                    self.level(level, f"{key}.priorities[{index}]")
                    if pool_in.priorities.index(level) != index:
                        self.fail(
                            f"{key}.priorities[{index}]",
                            f"level {level!r} is listed twice",
                            "list each level once",
                        )
                served = [level for level in self.levels if level in pool_in.priorities]
            devices = self._devices(pool_in.devices, key)
            pools[name] = PoolConfig(name, tuple(served), devices)
        served_any = {level for pool in pools.values() for level in pool.priorities}
        for level in self.levels:
            if level not in served_any:
                first = next(iter(pools))
                self.fail(
                    "pools",
                    f"no pool serves level {level!r}: its requests could never run",
                    f"add {level!r} to the priorities of a pool, e.g. "
                    f"{_sub('pools', first)}.priorities",
                )
        return pools

    def _devices(self, devices: list[str], pool_key: str) -> tuple[str, ...]:
        for index, device in enumerate(devices):
            key = f"{pool_key}.devices[{index}]"
            if not _DEVICE_RE.match(device):
                self.fail(
                    key,
                    f"unknown device {device!r}",
                    "use auto (the GPUs NVML finds, else cpu), cpu, or cuda:N (e.g. cuda:0)",
                )
            if devices.index(device) != index:
                self.fail(key, f"device {device!r} is listed twice", "list each device once")
        if "auto" in devices and len(devices) > 1:
            self.fail(
                f"{pool_key}.devices",
                "auto cannot be combined with other devices",
                "give [auto] alone, or list the devices explicitly",
            )
        return tuple(devices)

    # ---------------------------------------------------------------- models
    def _models(
        self, raw: list[_ModelIn] | None, pools: dict[str, PoolConfig]
    ) -> dict[str, ModelSpec]:
        if raw is None:
            raw = [_ModelIn(name="minilm"), _ModelIn(name="tiny-llama")]
        models: dict[str, ModelSpec] = {}
        first_index: dict[str, int] = {}
        for index, model_in in enumerate(raw):
            key = f"models[{index}]"
            if model_in.name in first_index:
                self.fail(
                    f"{key}.name",
                    f"model {model_in.name!r} is already defined at "
                    f"models[{first_index[model_in.name]}]",
                    "give each model a unique name, or merge the two entries",
                )
            first_index[model_in.name] = index
            models[model_in.name] = self._model(model_in, key, pools)
        return models

    def _model(self, m: _ModelIn, key: str, pools: dict[str, PoolConfig]) -> ModelSpec:
        known = KNOWN_MODELS.get(m.name)
        built_in = ", ".join(KNOWN_MODELS)
        task = m.task or (known.task if known else None)
        if task is None:
            self.fail(
                f"{key}.task",
                f"model {m.name!r} is not built in ({built_in}), so its task is unknown",
                "add 'task: embeddings' or 'task: generate'",
            )
        self._engine_fields(m, key, known is not None)
        if m.engine == "transformers" and m.model_path is None and known and task != known.task:
            self.fail(
                f"{key}.task",
                f"built-in model {m.name!r} does {known.task}, not {task}",
                f"remove task (or set it to {known.task}), or give model_path for another model",
            )
        model_pools = self._model_pools(m, key, pools)
        if m.engine == "openai":
            upstreams = self._upstreams(m, key)
            replicas: dict[str, int] = {}
        else:
            if m.upstreams:
                self.fail(
                    f"{key}.upstreams",
                    f"upstreams are only for engine openai (this model's engine is {m.engine})",
                    "remove upstreams, or set engine: openai",
                )
            upstreams = ()
            replicas = self._replicas(m.replicas, key, model_pools)
            if sum(replicas.values()) == 0:
                self.notes.append(f"model {m.name} starts with no replica")
        batching_in = m.batching or _BatchingIn()
        batching = BatchingSpec(
            max_batch_size=batching_in.max_batch_size,
            batch_window_ms=batching_in.batch_window_ms,
            max_batch_tokens=batching_in.max_batch_tokens,
            max_num_seqs=batching_in.max_num_seqs,
        )
        served = {level for name in model_pools for level in pools[name].priorities}
        unserved = [level for level in self.levels if level not in served]
        if unserved and not self.fifo:
            self.notes.append(
                f"model {m.name}: no pool of its pools ({', '.join(model_pools)}) serves "
                f"{', '.join(unserved)}; such requests can only run once aged into a served level"
            )
        return ModelSpec(
            name=m.name,
            task=task,
            engine=m.engine,
            model_path=self._path(m.model_path),
            profile=self._path(m.profile),
            replicas=MappingProxyType(replicas),
            pools=model_pools,
            upstreams=upstreams,
            slots=m.slots,
            batching=batching,
            queue=self._queue(m.queue or _QueueIn(), f"{key}.queue"),
        )

    def _engine_fields(self, m: _ModelIn, key: str, built_in: bool) -> None:
        if m.profile is not None and m.engine != "simulated":
            self.fail(
                f"{key}.profile",
                f"profile is only for engine simulated (this model's engine is {m.engine})",
                "remove profile, or set engine: simulated",
            )
        if m.model_path is not None and m.engine != "transformers":
            self.fail(
                f"{key}.model_path",
                f"model_path is only for engine transformers (this model's engine is {m.engine})",
                "remove model_path, or set engine: transformers",
            )
        if m.engine == "transformers" and m.model_path is None and not built_in:
            self.fail(
                f"{key}.model_path",
                f"model {m.name!r} is not built in ({', '.join(KNOWN_MODELS)})",
                "give model_path: a local Hugging Face model folder "
                "(or use engine simulated or openai)",
            )

    def _model_pools(self, m: _ModelIn, key: str, pools: dict[str, PoolConfig]) -> tuple[str, ...]:
        if m.pools is None:
            return tuple(pools)
        for index, name in enumerate(m.pools):
            if name not in pools:
                self.fail(
                    f"{key}.pools[{index}]",
                    f"unknown pool {name!r}",
                    f"{_suggest(name, list(pools))}use a pool defined under pools: "
                    f"{', '.join(pools)}",
                )
            if m.pools.index(name) != index:
                self.fail(
                    f"{key}.pools[{index}]", f"pool {name!r} is listed twice", "list each once"
                )
        return tuple(m.pools)

    def _replicas(self, raw: Any, key: str, model_pools: tuple[str, ...]) -> dict[str, int]:
        key = f"{key}.replicas"
        fix = "give a count (e.g. 2, placed in the model's first pool) or {pool: count}"
        if raw is None:
            return {model_pools[0]: 1}
        if isinstance(raw, int) and not isinstance(raw, bool):
            if raw < 0:
                self.fail(key, f"{raw} replicas", "give 0 or more")
            return {model_pools[0]: raw}
        if not isinstance(raw, dict):
            self.fail(key, f"expected a count or a mapping, got {_describe(raw)}", fix)
        replicas: dict[str, int] = {}
        for pool, count in raw.items():
            pool_key = _sub(key, str(pool))
            if pool not in model_pools:
                self.fail(
                    pool_key,
                    f"pool {pool!r} is not one of this model's pools ({', '.join(model_pools)})",
                    f"{_suggest(str(pool), model_pools)}use one of them, or add it to the "
                    "model's pools",
                )
            if not isinstance(count, int) or isinstance(count, bool) or count < 0:
                self.fail(pool_key, f"expected a count, got {_describe(count)}", "give 0 or more")
            replicas[pool] = count
        return replicas

    def _upstreams(self, m: _ModelIn, key: str) -> tuple[str, ...]:
        if not m.upstreams:
            self.fail(
                f"{key}.upstreams",
                "engine openai needs at least one upstream URL",
                "add upstreams: [http://127.0.0.1:8001/v1] (OpenAI-compatible servers)",
            )
        raw = m.replicas
        zero = raw is None or (raw == 0 and not isinstance(raw, bool))
        if isinstance(raw, dict) and all(count == 0 for count in raw.values()):
            zero = True
        if not zero:
            self.fail(
                f"{key}.replicas",
                "an openai model is served by its upstreams; tidegate starts no replica of it",
                "remove replicas (or set it to 0)",
            )
        roots: list[str] = []
        for index, url in enumerate(m.upstreams):
            root = _url_root(url)
            if root is None:
                self.fail(
                    f"{key}.upstreams[{index}]",
                    f"{url!r} is not an http(s) URL with a host",
                    "write it like http://127.0.0.1:8001/v1 (no query, fragment or credentials)",
                )
            if root in roots:
                self.fail(
                    f"{key}.upstreams[{index}]",
                    f"{url!r} is the same server as upstreams[{roots.index(root)}]",
                    "list each server once",
                )
            roots.append(root)
        return tuple(roots)

    def _queue(self, q: _QueueIn, key: str) -> QueueSpec:
        for index_key, mapping in (
            ("max_size_per_level", q.max_size_per_level),
            ("timeout_s", q.timeout_s),
        ):
            for level in mapping:
                self.level(level, _sub(f"{key}.{index_key}", level))
        if q.holdback is None:
            holdback = {level: v for level, v in DEFAULT_HOLDBACK.items() if level in self.levels}
        else:
            holdback = {}
            for level, value in q.holdback.items():
                level_key = _sub(f"{key}.holdback", level)
                self.level(level, level_key)
                if value is None:
                    continue
                if not 0.0 <= value <= 1.0:
                    self.fail(
                        level_key,
                        f"holdback {value!r} is outside 0..1",
                        f"give the saturation (0..1, e.g. 0.9) above which new {level} "
                        "requests are refused, or null for never",
                    )
                holdback[level] = float(value)
        ordered = {level: holdback[level] for level in self.levels if level in holdback}
        return QueueSpec(
            max_size=q.max_size,
            max_size_per_level=MappingProxyType(
                {lv: q.max_size_per_level[lv] for lv in self.levels if lv in q.max_size_per_level}
            ),
            timeout_s=MappingProxyType(
                {lv: float(q.timeout_s[lv]) for lv in self.levels if lv in q.timeout_s}
            ),
            holdback=MappingProxyType(ordered),
        )

    def _path(self, value: str | None) -> str | None:
        if value is None:
            return None
        path = Path(value).expanduser()
        if self.base_dir is not None and not path.is_absolute():
            path = self.base_dir / path
        return str(path)

    # ------------------------------------------------------------------ keys
    def _keys(self, raw: list[_KeyIn], default: str) -> tuple[KeySpec, ...]:
        keys: list[KeySpec] = []
        names: dict[str, int] = {}
        digests: dict[str, int] = {}
        for index, key_in in enumerate(raw):
            key = f"keys[{index}]"
            if key_in.name in names:
                self.fail(
                    f"{key}.name",
                    f"key name {key_in.name!r} is already used by keys[{names[key_in.name]}]",
                    "give each key a unique name",
                )
            names[key_in.name] = index
            digest = key_in.sha256.strip().lower()
            if not _SHA256_RE.match(digest):
                self.fail(
                    f"{key}.sha256",
                    f"not a sha256 hex digest ({len(digest)} characters; 64 hex digits expected)",
                    'put the digest, not the key: printf %s "$KEY" | sha256sum '
                    "(the 64 hex characters before the '-')",
                )
            if digest in digests:
                self.fail(
                    f"{key}.sha256",
                    f"same digest as keys[{digests[digest]}]: both would be the same key",
                    "give each key its own secret",
                )
            digests[digest] = index
            max_priority = self.levels[0]
            if key_in.max_priority is not None:
                max_priority = self.level(key_in.max_priority, f"{key}.max_priority")
            cap = self.levels.index(max_priority)
            if key_in.default_priority is not None:
                key_default = self.level(key_in.default_priority, f"{key}.default_priority")
            else:  # the global default, lowered to the key's cap
                key_default = self.levels[max(cap, self.levels.index(default))]
            if self.levels.index(key_default) < cap:
                self.fail(
                    f"{key}.default_priority",
                    f"default_priority {key_default!r} is more urgent than max_priority "
                    f"{max_priority!r}",
                    f"set default_priority to {max_priority!r} or a less urgent level, "
                    "or raise max_priority",
                )
            keys.append(
                KeySpec(
                    name=key_in.name,
                    sha256=digest,
                    default_priority=key_default,
                    max_priority=max_priority,
                    default_level=0 if self.fifo else self.levels.index(key_default),
                    max_level=0 if self.fifo else cap,
                )
            )
        return tuple(keys)

    def _gateway_notes(
        self, gateway: GatewaySettings, keys: tuple[KeySpec, ...], models: dict[str, ModelSpec]
    ) -> None:
        host = gateway.host
        if not keys and not (host.startswith("127.") or host in _LOOPBACK_HOSTS):
            self.notes.append(
                f"no keys: an open service on {host}, reachable from the network; "
                "add keys or bind 127.0.0.1"
            )
        if self.fifo:
            default_holdback = {lv: v for lv, v in DEFAULT_HOLDBACK.items() if lv in self.levels}
            per_level = [
                name
                for name, model in models.items()
                if model.queue.max_size_per_level
                or model.queue.timeout_s
                or dict(model.queue.holdback) != default_holdback
            ]
            if per_level:
                self.notes.append(
                    "policy fifo ignores the per-level queue settings (max_size_per_level, "
                    f"timeout_s, holdback) of: {', '.join(per_level)}"
                )
