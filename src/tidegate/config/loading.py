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

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from tidegate.config.diagnostics import _describe, _from_validation_error
from tidegate.config.render import render_config
from tidegate.config.resolve import _Resolver
from tidegate.config.schema import _ConfigIn
from tidegate.config.values import EMBEDDED_SOURCE, TidegateConfig
from tidegate.errors import ConfigError

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
