"""Pydantic errors turned into ConfigErrors that name the dotted key and the fix; notes on
levels that a model's pools do not serve."""

from __future__ import annotations

import difflib
import re
import types
import typing
from collections.abc import Iterable
from typing import Annotated, Any

from pydantic import BaseModel, ValidationError

from tidegate.config.schema import _ConfigIn
from tidegate.core.queue import AgingConfig, reaches_level_at, unreachable_levels
from tidegate.errors import ConfigError

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
    "finite_number": ("a finite number", "write a number such as 0.5 (not .inf or .nan)"),
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
    """The first pydantic error as a ConfigError with a dotted key and a fix.

    An unknown key goes first: a typo (``period`` for ``period_s``) also makes the real key
    missing, and "did you mean" is the better answer.
    """
    errors = exc.errors()
    error = next((e for e in errors if e["type"] == "extra_forbidden"), errors[0])
    loc = tuple(part for part in error["loc"] if part != "[key]")
    key = _dotted(loc) or "(top level)"
    kind = error["type"]
    ctx = error.get("ctx") or {}
    value = error.get("input")
    if kind == "extra_forbidden":
        name = str(loc[-1]) if loc else "?"
        valid = _fields_at(loc[:-1])
        where = _dotted(loc[:-1]) or "the top level"
        hint = suggest(name, valid) or "remove it; "
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
        hint = suggest(str(value), options, cutoff=0.5)
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


def suggest(word: str, options: Iterable[str], cutoff: float = 0.6) -> str:
    """``"did you mean 'x'? "`` for the option nearest to ``word``, else ``""``."""
    match = difflib.get_close_matches(word, list(options), n=1, cutoff=cutoff)
    return f"did you mean {match[0]!r}? " if match else ""


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
            fields = _by_key(tp)
            if not isinstance(part, str) or part not in fields:
                return []
            tp = fields[part]
        elif typing.get_origin(tp) is list:
            tp = typing.get_args(tp)[0]
        elif typing.get_origin(tp) is dict:
            tp = typing.get_args(tp)[1]
        else:
            return []
    tp = _unwrap(tp)
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return list(_by_key(tp))
    return []


def _by_key(model: type[BaseModel]) -> dict[str, Any]:
    """The annotation of each field under the key a file writes (its alias: ``from``)."""
    return {field.alias or name: field.annotation for name, field in model.model_fields.items()}


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


# ----------------------------------------------------------------------------- pool coverage


def unserved_level_notes(
    model: str,
    model_pools: Iterable[str],
    served_names: Iterable[str],
    levels: tuple[str, ...],
    aging: AgingConfig,
) -> list[str]:
    """Notes for the levels no pool of a model serves: how long they wait before they may
    run (aged into a served level), and a warning for those that can only wait.

    A request runs in a pool serving its level or a more urgent one it has aged to; aging
    never makes it less urgent, so a level more urgent than every served one, or any
    unserved level with aging off, never runs.
    """
    served = {levels.index(name) for name in served_names}
    unserved = [level for level in range(len(levels)) if level not in served]
    if not unserved:
        return []
    never = set(unreachable_levels(served, len(levels), aging))
    pools_text = ", ".join(model_pools)
    notes = []
    waits = []
    for level in unserved:
        if level in never:
            continue
        target = max(s for s in served if s < level)
        at = reaches_level_at(level, target, 0.0, aging)
        waits.append(f"{levels[level]} after {at:g} s (as {levels[target]})")
    if waits:
        names = ", ".join(levels[level] for level in unserved if level not in never)
        notes.append(
            f"model {model}: no pool of its pools ({pools_text}) serves {names}; such requests "
            f"run only once aged into a served level: {', '.join(waits)} of waiting "
            "(priorities.aging)"
        )
    if never:
        names = ", ".join(levels[level] for level in sorted(never))
        if aging.rate_per_s <= 0:
            why = "aging is off (priorities.aging.rate_per_s: 0)"
            fix = f"add {names} to the priorities of one of these pools, or turn aging on"
        else:
            served_text = ", ".join(levels[level] for level in sorted(served))
            why = (
                f"aging cannot bring them there (it only makes a request more urgent, and "
                f"these pools serve only {served_text})"
            )
            fix = f"add {names} to the priorities of one of these pools"
        notes.append(
            f"warning: model {model}: {names} requests can only wait, never run: no pool of "
            f"its pools ({pools_text}) serves them and {why}; they stay queued until their "
            f"queue timeout or the client gives up. Fix: {fix}"
        )
    return notes
