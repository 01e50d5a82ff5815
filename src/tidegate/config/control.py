"""Control-plane configuration: the device inventory, and per model its GPU ask, drain
timeout and autoscaling, resolved into the core's values (``Device``, ``AutoscaleConfig``).

- ``devices:`` declares the inventory (CPU hosts, tests, the simulator; NVML replaces it on
  a GPU host). A pool's ``devices`` then names declared ids, or ``auto``, resolved here to
  every declared id no other pool lists. A device owned by exactly one pool is that pool's
  (``Device.pool``); one listed by several is open to any pool (``pool=None``).
- A model asks for ``memory_mb`` (given, else its profile's, else its task's default
  profile) on a shared device, or a whole device with ``gpu: exclusive``.
- ``autoscaling:`` resolves into ``core.autoscale.AutoscaleConfig``; absent, the model is
  static and its ``replicas`` are all it ever has. Present, ``replicas`` are the starting
  counts, clamped into ``[min_replicas, max_replicas]``.

Invariants: every value handed to the core already satisfies its ``__post_init__`` checks
(each is checked here first, with the file, the key and the fix); a model asks for no more
memory than the largest declared device of its pools; an exclusive model starts no more
replicas than its pools have declared devices.
"""

from __future__ import annotations

import math
import re
import zoneinfo
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, NoReturn

from tidegate.config.diagnostics import _describe, _sub, suggest
from tidegate.config.schema import (
    _AutoscalingIn,
    _ControllerIn,
    _DeviceIn,
    _ModelIn,
    _PanicIn,
    _ScalingRulesIn,
    _ScheduleIn,
)
from tidegate.config.values import ControllerSettings, PoolConfig
from tidegate.core.autoscale import (
    DEFAULT_SCALE_DOWN,
    DEFAULT_SCALE_UP,
    AutoscaleConfig,
    ScalingPolicy,
    ScalingRules,
    Schedule,
)
from tidegate.core.placement import Device
from tidegate.core.scaling_rules import MAX_PERIOD_S, MAX_WINDOW_S
from tidegate.engines.profile import default_profile, load_profile
from tidegate.engines.registry import KNOWN_MODELS
from tidegate.errors import ConfigError

DEFAULT_PANIC_THRESHOLD = 2.0  # Knative: panic above 2x the target per replica
DAY_NAMES = ("mon", "tue", "wed", "thu", "fri", "sat", "sun")
DAY_SETS: Mapping[str, tuple[int, ...]] = {
    "daily": (0, 1, 2, 3, 4, 5, 6),
    "weekdays": (0, 1, 2, 3, 4),
    "weekends": (5, 6),
}
_DECLARED_ID_RE = re.compile(r"^[A-Za-z0-9._:/-]+$")
_TIME_RE = re.compile(r"^([01]?[0-9]|2[0-4]):([0-5][0-9])$")


def _built_in_memory_mb(m: _ModelIn) -> int | None:
    """What a built-in model served by its own weights is known to need, if it says."""
    known = KNOWN_MODELS.get(m.name)
    if known is None or m.engine != "transformers" or m.model_path is not None:
        return None
    return known.memory_mb


def default_memory_mb(task: str) -> int:
    """What a model without ``memory_mb`` or a readable profile asks: its task's default
    profile (300 MB embeddings, 400 MB generate)."""
    return math.ceil(default_profile(task).memory_mb)


@dataclass(frozen=True, slots=True)
class ModelControl:
    """The control-plane part of one model, resolved."""

    memory_mb: int
    exclusive: bool
    drain_timeout_s: float
    autoscaling: AutoscaleConfig | None
    replicas: dict[str, int]  # starting counts, clamped into [min, max] when autoscaled


class ControlResolver:
    """Resolves ``devices:`` and the control keys of each model, for ``_Resolver``."""

    def __init__(self, source: str, notes: list[str]) -> None:
        self.source = source
        self.notes = notes
        self.declared: dict[str, _DeviceIn] = {}

    def fail(self, key: str, problem: str, fix: str) -> NoReturn:
        raise ConfigError(self.source, key, problem, fix)

    # --------------------------------------------------------------- devices
    def declare(self, raw: list[_DeviceIn] | None) -> None:
        """Check the declared ids (before the pools, whose ``devices`` may name them)."""
        for index, device in enumerate(raw or []):
            key = f"devices[{index}].id"
            if device.id == "auto" or not _DECLARED_ID_RE.match(device.id):
                self.fail(
                    key,
                    f"{device.id!r} is not a valid device id",
                    "use letters, digits, '.', '_', '-', ':' and '/' (not 'auto'), "
                    "e.g. cuda:0 or node-a/gpu-1",
                )
            if device.id in self.declared:
                first = list(self.declared).index(device.id)
                self.fail(
                    key,
                    f"device {device.id!r} is already declared at devices[{first}]",
                    "give each device a unique id (prefix it with its node: node-a/cuda:0)",
                )
            self.declared[device.id] = device

    def pool_device(self, device: str, key: str) -> bool:
        """Whether ``device`` (in a pool's list) names a declared device. With an inventory
        declared, a pool may only name its ids (or auto)."""
        if not self.declared:
            return False
        if device == "auto" or device in self.declared:
            return True
        ids = list(self.declared)
        self.fail(
            key,
            f"device {device!r} is not declared under devices",
            f"{suggest(device, ids)}with a declared inventory, list its ids "
            f"({', '.join(ids)}) or auto",
        )

    def devices(
        self, pools: Mapping[str, PoolConfig]
    ) -> tuple[dict[str, PoolConfig], tuple[Device, ...]]:
        """The pools with ``auto`` replaced by the declared ids no other pool lists, and the
        declared devices, each owned by the one pool listing it, else open to any pool."""
        if not self.declared:
            return dict(pools), ()
        named = {d for pool in pools.values() for d in pool.devices if d in self.declared}
        resolved: dict[str, PoolConfig] = {}
        for name, pool in pools.items():
            if pool.devices == ("auto",):
                ids = tuple(d for d in self.declared if d not in named)
                if not ids:
                    self.fail(
                        f"{_sub('pools', name)}.devices",
                        "auto finds no declared device: other pools list every one",
                        "list this pool's devices by id (a device may be in two pools)",
                    )
                pool = replace(pool, devices=ids)
            resolved[name] = pool
        devices: list[Device] = []
        for device_id, raw in self.declared.items():
            owning = [name for name, pool in resolved.items() if device_id in pool.devices]
            if not owning:
                self.notes.append(f"device {device_id} is in no pool: nothing runs on it")
            owner = owning[0] if len(owning) == 1 else None
            devices.append(Device(device_id, raw.memory_mb, raw.node, owner))
        return resolved, tuple(devices)

    # ---------------------------------------------------------------- models
    def model(
        self,
        m: _ModelIn,
        key: str,
        task: str,
        profile: str | None,
        replicas: dict[str, int],
        first_pool: str,
    ) -> ModelControl:
        autoscaling = None
        if m.autoscaling is not None:
            if m.engine == "openai":
                self.fail(
                    f"{key}.autoscaling",
                    "an openai model is served by its upstreams; tidegate starts no replica "
                    "of it, so there is nothing to scale",
                    "remove autoscaling (scale the upstream servers themselves)",
                )
            autoscaling = self.autoscaling(m.autoscaling, f"{key}.autoscaling")
            replicas = self._clamp(
                replicas or {first_pool: 0}, autoscaling, f"{key}.replicas", m.name
            )
        return ModelControl(
            memory_mb=self._memory_mb(m, key, task, profile),
            exclusive=m.gpu == "exclusive",
            drain_timeout_s=float(m.drain_timeout_s),
            autoscaling=autoscaling,
            replicas=replicas,
        )

    def _memory_mb(self, m: _ModelIn, key: str, task: str, profile: str | None) -> int:
        if m.memory_mb is not None:
            return m.memory_mb
        if profile is None or not Path(profile).is_file():
            return _built_in_memory_mb(m) or default_memory_mb(task)
        try:
            measured = load_profile(profile).memory_mb
        except ConfigError as exc:
            self.fail(
                f"{key}.profile",
                f"cannot take memory_mb from it: {exc.message}",
                "fix the profile, or give memory_mb explicitly",
            )
        if measured <= 0:
            self.notes.append(
                f"model {m.name}: its profile measured no memory_mb; asking "
                f"{default_memory_mb(task)} MB (the {task} default)"
            )
            return default_memory_mb(task)
        return math.ceil(measured)

    def _clamp(
        self, replicas: dict[str, int], config: AutoscaleConfig, key: str, name: str
    ) -> dict[str, int]:
        """Starting counts moved into [min, max]: added to the first pool, taken from the last."""
        total = sum(replicas.values())
        low = config.min_replicas
        wanted = min(max(total, low), config.max_replicas)
        if wanted == total:
            return replicas
        clamped = dict(replicas)
        pools = list(clamped)
        if wanted > total:
            clamped[pools[0]] += wanted - total
        else:
            excess = total - wanted
            for pool in reversed(pools):
                taken = min(excess, clamped[pool])
                clamped[pool] -= taken
                excess -= taken
        self.notes.append(
            f"model {name}: {key} {total} moved into [min_replicas, max_replicas] = "
            f"[{low}, {config.max_replicas}]: starts {wanted}"
        )
        return clamped

    # ----------------------------------------------------------- controller
    def controller(self, raw: _ControllerIn | None) -> ControllerSettings:
        if raw is None:
            return ControllerSettings()
        settings = ControllerSettings(orchestrator=raw.orchestrator, ray_address=raw.ray_address)
        if raw.defrag is None:
            return settings
        key = "controller.defrag"
        window = (
            self._time(raw.defrag.window.from_, f"{key}.window.from", allow_end=False),
            self._time(raw.defrag.window.to, f"{key}.window.to", allow_end=True),
        )
        if window[0] == window[1]:
            self.fail(
                f"{key}.window",
                "the off-peak window is empty (from equals to)",
                'give a window such as {from: "02:00", to: "05:00"}',
            )
        return replace(
            settings,
            defrag_window=window,
            defrag_timezone=self._timezone(raw.defrag.timezone, f"{key}.timezone"),
            defrag_move_timeout_s=raw.defrag.move_timeout_s,
        )

    # ----------------------------------------------------------- autoscaling
    def autoscaling(self, a: _AutoscalingIn, key: str) -> AutoscaleConfig:
        if a.min_replicas > a.max_replicas:
            self.fail(
                f"{key}.min_replicas",
                f"min_replicas {a.min_replicas} is above max_replicas {a.max_replicas}",
                "lower min_replicas or raise max_replicas",
            )
        if a.min_replicas == 0 and not a.scale_to_zero:
            self.fail(
                f"{key}.min_replicas",
                "min_replicas 0 lets the model scale to zero, but scale_to_zero is false",
                "set scale_to_zero: true (requests then wait while a replica cold-starts), "
                "or min_replicas: 1",
            )
        schedules = tuple(
            self._schedule(s, f"{key}.schedules[{i}]", a.max_replicas)
            for i, s in enumerate(a.schedules)
        )
        defaults = AutoscaleConfig()
        threshold, panic_window_s = self._panic(a.panic, f"{key}.panic", defaults)
        return AutoscaleConfig(
            min_replicas=a.min_replicas,
            max_replicas=a.max_replicas,
            target_per_replica=float(a.target_per_replica),
            target_rate_per_replica=None
            if a.target_rate_per_replica is None
            else float(a.target_rate_per_replica),
            tolerance=float(defaults.tolerance if a.tolerance is None else a.tolerance),
            interval_s=float(defaults.interval_s if a.interval_s is None else a.interval_s),
            scale_up=self._rules(a.scale_up, f"{key}.scale_up", DEFAULT_SCALE_UP),
            scale_down=self._rules(a.scale_down, f"{key}.scale_down", DEFAULT_SCALE_DOWN),
            panic_threshold=threshold,
            panic_window_s=panic_window_s,
            stable_window_s=float(
                defaults.stable_window_s if a.stable_window_s is None else a.stable_window_s
            ),
            schedules=schedules,
            timezone=self._timezone(a.timezone, f"{key}.timezone"),
            cold_start_s=float(defaults.cold_start_s if a.cold_start_s is None else a.cold_start_s),
            scale_to_zero=a.scale_to_zero,
            forecast=a.forecast,
        )

    def _rules(self, raw: _ScalingRulesIn | None, key: str, default: ScalingRules) -> ScalingRules:
        if raw is None:
            return default
        window_s = default.stabilization_window_s
        if raw.stabilization_window_s is not None:
            window_s = float(raw.stabilization_window_s)
        if window_s > MAX_WINDOW_S:
            self.fail(
                f"{key}.stabilization_window_s",
                f"{window_s:g} s is longer than {MAX_WINDOW_S:g} s",
                f"use at most {MAX_WINDOW_S:g} (the HPA's limit: the Kubernetes rendering "
                "must mean the same)",
            )
        policies = default.policies
        if raw.policies is not None:
            policies = tuple(
                self._policy(p.type, p.value, p.period_s, f"{key}.policies[{i}]")
                for i, p in enumerate(raw.policies)
            )
        select = default.select_policy if raw.select_policy is None else raw.select_policy
        return ScalingRules(window_s, policies, select, raw.tolerance)

    def _policy(self, kind: str, value: int, period_s: float, key: str) -> ScalingPolicy:
        if period_s > MAX_PERIOD_S:
            self.fail(
                f"{key}.period_s",
                f"{period_s:g} s is longer than {MAX_PERIOD_S:g} s",
                f"use at most {MAX_PERIOD_S:g} (the HPA's limit: the Kubernetes rendering "
                "must mean the same)",
            )
        return ScalingPolicy(kind, value, float(period_s))

    def _panic(
        self, raw: _PanicIn | None, key: str, defaults: AutoscaleConfig
    ) -> tuple[float | None, float]:
        if raw is None:
            return None, defaults.panic_window_s
        threshold = DEFAULT_PANIC_THRESHOLD if raw.threshold is None else float(raw.threshold)
        if threshold <= 1:
            self.fail(
                f"{key}.threshold",
                f"threshold {threshold:g} would panic at or below the target itself",
                "give a multiple of target_per_replica above 1, e.g. 2 (Knative's default)",
            )
        window_s = defaults.panic_window_s if raw.window_s is None else float(raw.window_s)
        return threshold, window_s

    def _schedule(self, s: _ScheduleIn, key: str, max_replicas: int) -> Schedule:
        days = self._days(s.days, f"{key}.days")
        from_minute = self._time(s.from_, f"{key}.from", allow_end=False)
        to_minute = self._time(s.to, f"{key}.to", allow_end=True)
        if from_minute == to_minute:
            self.fail(
                f"{key}.to",
                "from and to are the same time: an empty (or endless) window",
                'for a whole day write from: "00:00" and to: "24:00"',
            )
        if s.min_replicas > max_replicas:
            self.fail(
                f"{key}.min_replicas",
                f"min_replicas {s.min_replicas} is above max_replicas {max_replicas}",
                "lower it, or raise autoscaling.max_replicas",
            )
        return Schedule(days, from_minute, to_minute, s.min_replicas)

    def _days(self, raw: str | list[str], key: str) -> tuple[int, ...]:
        options = [*DAY_NAMES, *DAY_SETS]
        if isinstance(raw, str):
            if raw in DAY_SETS:
                return DAY_SETS[raw]
            self._bad_day(raw, key, options)
        if not raw:
            self.fail(key, "is empty", "list days (mon..sun), or write daily or weekdays")
        days: list[int] = []
        for index, name in enumerate(raw):
            if name not in DAY_NAMES:
                self._bad_day(name, f"{key}[{index}]", list(DAY_NAMES))
            if DAY_NAMES.index(name) in days:
                self.fail(f"{key}[{index}]", f"{name} is listed twice", "list each day once")
            days.append(DAY_NAMES.index(name))
        return tuple(sorted(days))

    def _bad_day(self, name: str, key: str, options: list[str]) -> NoReturn:
        hint = suggest(name.lower(), options, cutoff=0.5)
        self.fail(key, f"{name!r} is not a day", f"{hint}use one of: {', '.join(options)}")

    def _time(self, raw: Any, key: str, *, allow_end: bool) -> int:
        if isinstance(raw, int) and not isinstance(raw, bool) and 0 <= raw <= 1440:
            # YAML 1.1 reads an unquoted 18:30 as sexagesimal: 18 * 60 + 30 = 1110.
            self.fail(
                key,
                f"YAML read an unquoted time as the number {raw}",
                f'quote it: "{raw // 60:02d}:{raw % 60:02d}"',
            )
        match = _TIME_RE.match(raw) if isinstance(raw, str) else None
        minute = int(match.group(1)) * 60 + int(match.group(2)) if match else -1
        last = 1440 if allow_end else 1439
        if not 0 <= minute <= last:
            shown = _describe(raw)
            self.fail(
                key,
                f"{shown} is not a time of day",
                'write "HH:MM" in quotes, 00:00..23:59' + (' or "24:00"' if allow_end else ""),
            )
        return minute

    def _timezone(self, name: str, key: str) -> str:
        try:
            zoneinfo.ZoneInfo(name)
        except (zoneinfo.ZoneInfoNotFoundError, ValueError):
            hint = suggest(name, sorted(zoneinfo.available_timezones()))
            self.fail(
                key,
                f"unknown time zone {name!r}",
                f"{hint}give an IANA name such as UTC, Europe/Paris or America/New_York",
            )
        return name

    # -------------------------------------------------------------- cross-checks
    def check_fit(
        self,
        key: str,
        control: ModelControl,
        model_pools: tuple[str, ...],
        pools: Mapping[str, PoolConfig],
        devices: tuple[Device, ...],
    ) -> None:
        """A model fits the largest declared device of its pools; exclusive replicas have one
        device each. Nothing to check without a declared inventory (NVML decides then)."""
        if not devices:
            return
        ids = {device_id for name in model_pools for device_id in pools[name].devices}
        usable = [d for d in devices if d.id in ids]  # never empty: a pool has >= 1 device
        pools_text = ", ".join(model_pools)
        largest = max(usable, key=lambda d: d.memory_mb)
        if control.memory_mb > largest.memory_mb:
            ask = "an exclusive device of " if control.exclusive else ""
            self.fail(
                f"{key}.memory_mb",
                f"needs {ask}{control.memory_mb} MB, more than the largest device of its "
                f"pools ({pools_text}): {largest.id} with {largest.memory_mb:g} MB",
                "lower memory_mb, or declare a larger device in one of its pools",
            )
        starting = sum(control.replicas.values())
        if control.exclusive and starting > len(usable):
            self.fail(
                f"{key}.replicas",
                f"{starting} exclusive replicas need {starting} devices; its pools ({pools_text}) "
                f"have {len(usable)}",
                "start fewer replicas, use gpu: shared, or declare more devices",
            )
        ceiling = control.autoscaling.max_replicas if control.autoscaling else 0
        if control.exclusive and ceiling > len(usable):
            self.notes.append(
                f"{_sub(key, 'autoscaling')}.max_replicas {ceiling} exceeds the "
                f"{len(usable)} devices of its pools: an exclusive model stops growing there"
            )


# ----------------------------------------------------------------------------- rendering


def render_autoscaling(config: AutoscaleConfig) -> dict[str, Any]:
    """An ``autoscaling:`` block that resolves back to ``config`` (for ``config check``)."""
    out: dict[str, Any] = {
        "min_replicas": config.min_replicas,
        "max_replicas": config.max_replicas,
        "target_per_replica": config.target_per_replica,
        "target_rate_per_replica": config.target_rate_per_replica,
        "tolerance": config.tolerance,
        "interval_s": config.interval_s,
        "stable_window_s": config.stable_window_s,
        "scale_up": _render_rules(config.scale_up),
        "scale_down": _render_rules(config.scale_down),
        "panic": None,
        "schedules": [_render_schedule(s) for s in config.schedules],
        "timezone": config.timezone,
        "cold_start_s": config.cold_start_s,
        "scale_to_zero": config.scale_to_zero,
        "forecast": config.forecast,
    }
    if config.panic_threshold is not None:
        out["panic"] = {"threshold": config.panic_threshold, "window_s": config.panic_window_s}
    return out


def render_controller(settings: ControllerSettings) -> dict[str, Any]:
    """A ``controller:`` block that resolves back to ``settings``."""
    out: dict[str, Any] = {
        "orchestrator": settings.orchestrator,
        "ray_address": settings.ray_address,
        "defrag": None,
    }
    if settings.defrag_window is not None:
        start, end = settings.defrag_window
        out["defrag"] = {
            "window": {"from": _clock(start), "to": _clock(end)},
            "timezone": settings.defrag_timezone,
            "move_timeout_s": settings.defrag_move_timeout_s,
        }
    return out


def _render_rules(rules: ScalingRules) -> dict[str, Any]:
    out: dict[str, Any] = {
        "stabilization_window_s": rules.stabilization_window_s,
        "select_policy": rules.select_policy,
        "policies": [
            {"type": p.kind, "value": p.value, "period_s": p.period_s} for p in rules.policies
        ],
    }
    if rules.tolerance is not None:
        out["tolerance"] = rules.tolerance
    return out


def _render_schedule(schedule: Schedule) -> dict[str, Any]:
    named = [name for name, days in DAY_SETS.items() if days == schedule.days]
    return {
        "days": named[0] if named else [DAY_NAMES[day] for day in schedule.days],
        "from": _clock(schedule.from_minute),
        "to": _clock(schedule.to_minute),
        "min_replicas": schedule.min_replicas,
    }


def _clock(minute: int) -> str:
    return f"{minute // 60:02d}:{minute % 60:02d}"
