"""Control-plane configuration: devices, placement, GPU asks, drain and autoscaling keys.

Good configs resolve to the core's values; every bad one names the file, the key and the fix.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from tidegate.config import TidegateConfig, check_config, load_config, parse_config, render_config
from tidegate.config.control import default_memory_mb
from tidegate.control.local import worker_command
from tidegate.core.autoscale import (
    DEFAULT_SCALE_DOWN,
    DEFAULT_SCALE_UP,
    AutoscaleConfig,
    ScalingPolicy,
    ScalingRules,
    Schedule,
)
from tidegate.core.placement import Device
from tidegate.errors import ConfigError

SOURCE = "ctl.yaml"
EXAMPLE = Path(__file__).parent.parent / "examples" / "autoscaling.yaml"
SIM = {"name": "sim", "task": "embeddings", "engine": "simulated"}
GEN = {"name": "gen", "task": "generate", "engine": "simulated"}
UPSTREAM = {
    "name": "big",
    "task": "generate",
    "engine": "openai",
    "upstreams": ["http://127.0.0.1:8001"],
}
SCALED = {"max_replicas": 4, "target_per_replica": 8}
INVENTORY = [
    {"id": "a/gpu-0", "memory_mb": 24576, "node": "a"},
    {"id": "a/gpu-1", "memory_mb": 24576, "node": "a"},
    {"id": "b/gpu-0", "memory_mb": 81920, "node": "b"},
]


def parse(data: dict[str, Any]) -> TidegateConfig:
    return parse_config(data, SOURCE)


def model(**keys: Any) -> dict[str, Any]:
    return {"models": [{**SIM, **keys}]}


def scaled(**keys: Any) -> dict[str, Any]:
    return model(autoscaling={**SCALED, **keys})


# ----------------------------------------------------------------------------- good configs


@dataclass(frozen=True)
class Good:
    name: str
    data: dict[str, Any]
    check: Callable[[TidegateConfig], object]  # asserts on the resolved config


def autoscaling(config: TidegateConfig, name: str = "sim") -> AutoscaleConfig:
    resolved = config.model(name).autoscaling
    assert resolved is not None
    return resolved


def _defaults(config: TidegateConfig) -> None:
    sim = config.model("sim")
    assert sim.autoscaling is None
    assert (sim.exclusive, sim.drain_timeout_s) == (False, 30.0)
    assert sim.memory_mb == default_memory_mb("embeddings") == 300
    assert config.devices == ()
    assert [pool.placement for pool in config.pools.values()] == ["binpack"]


def _autoscaling_defaults(config: TidegateConfig) -> None:
    assert autoscaling(config) == AutoscaleConfig(min_replicas=1, max_replicas=4)
    assert autoscaling(config).scale_up == DEFAULT_SCALE_UP
    assert autoscaling(config).scale_down == DEFAULT_SCALE_DOWN


def _every_key(config: TidegateConfig) -> None:
    assert autoscaling(config) == AutoscaleConfig(
        min_replicas=2,
        max_replicas=10,
        target_per_replica=6.5,
        tolerance=0.05,
        interval_s=10.0,
        stable_window_s=30.0,
        scale_up=ScalingRules(30.0, (ScalingPolicy("pods", 2, 20.0),), "min", 0.2),
        scale_down=ScalingRules(120.0, (ScalingPolicy("percent", 50, 60.0),), "disabled"),
        panic_threshold=3.0,
        panic_window_s=6.0,
        schedules=(
            Schedule((0, 1, 2, 3, 4), 510, 1140, 4),
            Schedule((5, 6), 1320, 120, 3),
            Schedule((2,), 0, 1440, 2),
        ),
        timezone="Europe/Paris",
        cold_start_s=90.0,
        scale_to_zero=True,
    )


def _partial_rules_keep_the_rest(config: TidegateConfig) -> None:
    rules = autoscaling(config).scale_down
    assert rules == dataclasses.replace(DEFAULT_SCALE_DOWN, stabilization_window_s=60.0)


def _replicas_clamped_up(config: TidegateConfig) -> None:
    assert dict(config.model("sim").replicas) == {"shared": 3}
    assert any("moved into [min_replicas, max_replicas]" in note for note in config.notes)


def _replicas_clamped_down(config: TidegateConfig) -> None:
    assert dict(config.model("sim").replicas) == {"a": 2, "b": 0}


def _inventory(config: TidegateConfig) -> None:
    assert config.devices == (
        Device("a/gpu-0", 24576, "a", "dedicated"),
        Device("a/gpu-1", 24576, "a", "shared"),
        Device("b/gpu-0", 81920, "b", "shared"),
    )
    assert config.pools["dedicated"].placement == "spread"
    assert config.model("sim").exclusive


def _device_in_two_pools_is_open(config: TidegateConfig) -> None:
    assert [d.pool for d in config.devices] == [None, "b", "b"]


def _memory_from_profile(config: TidegateConfig) -> None:
    assert config.model("sim").memory_mb == 1234  # 1233.2 rounded up


GOOD = [
    Good("absent_keys_are_static_defaults", model(), _defaults),
    Good("autoscaling_defaults", scaled(), _autoscaling_defaults),
    Good(
        "every_autoscaling_key",
        scaled(
            min_replicas=2,
            max_replicas=10,
            target_per_replica=6.5,
            tolerance=0.05,
            interval_s=10,
            stable_window_s=30,
            scale_up={
                "stabilization_window_s": 30,
                "select_policy": "min",
                "tolerance": 0.2,
                "policies": [{"type": "pods", "value": 2, "period_s": 20}],
            },
            scale_down={
                "stabilization_window_s": 120,
                "select_policy": "disabled",
                "policies": [{"type": "percent", "value": 50, "period_s": 60}],
            },
            panic={"threshold": 3, "window_s": 6},
            schedules=[
                {"days": "weekdays", "from": "08:30", "to": "19:00", "min_replicas": 4},
                {"days": ["sat", "sun"], "from": "22:00", "to": "02:00", "min_replicas": 3},
                {"days": ["wed"], "from": "00:00", "to": "24:00", "min_replicas": 2},
            ],
            timezone="Europe/Paris",
            cold_start_s=90,
            scale_to_zero=True,
        ),
        _every_key,
    ),
    Good(
        "panic_block_alone_takes_knative_defaults",
        scaled(panic={}),
        lambda c: (
            (autoscaling(c).panic_threshold, autoscaling(c).panic_window_s) == (2.0, 15.0)
            or pytest.fail("panic defaults")
        ),
    ),
    Good(
        "a_rate_target_sizes_on_arrivals",
        scaled(target_rate_per_replica=250),
        lambda c: autoscaling(c).target_rate_per_replica == 250.0 or pytest.fail("rate target"),
    ),
    Good(
        "partial_scaling_rules_keep_the_rest",
        scaled(scale_down={"stabilization_window_s": 60}),
        _partial_rules_keep_the_rest,
    ),
    Good(
        "starting_replicas_below_min_are_raised",
        {"models": [{**SIM, "replicas": 1, "autoscaling": {**SCALED, "min_replicas": 3}}]},
        _replicas_clamped_up,
    ),
    Good(
        "starting_replicas_above_max_are_lowered_from_the_last_pool",
        {
            "pools": {"a": None, "b": None},
            "models": [
                {**SIM, "replicas": {"a": 2, "b": 3}, "autoscaling": {**SCALED, "max_replicas": 2}}
            ],
        },
        _replicas_clamped_down,
    ),
    Good(
        "declared_inventory_owned_by_pools",
        {
            "devices": INVENTORY,
            "pools": {
                "dedicated": {
                    "priorities": ["high"],
                    "devices": ["a/gpu-0"],
                    "placement": "spread",
                },
                "shared": {"devices": ["auto"]},
            },
            "models": [{**SIM, "gpu": "exclusive", "memory_mb": 20000, "pools": ["dedicated"]}],
        },
        _inventory,
    ),
    Good(
        "device_listed_by_two_pools_is_open_to_any",
        {
            "devices": INVENTORY,
            "pools": {
                "a": {"devices": ["a/gpu-0"]},
                "b": {"devices": ["a/gpu-0", "a/gpu-1", "b/gpu-0"]},
            },
            "models": [SIM],
        },
        _device_in_two_pools_is_open,
    ),
]


@pytest.mark.parametrize("case", GOOD, ids=lambda case: case.name)
def test_good_config_resolves(case: Good) -> None:
    config = parse(case.data)
    case.check(config)
    again = parse_config(yaml.safe_load(render_config(config)), SOURCE)
    # What `config check` prints loads back to the same values (notes were about the input).
    assert again == dataclasses.replace(config, notes=again.notes)


def test_memory_mb_comes_from_the_profile(tmp_path: Path) -> None:
    profile = tmp_path / "p.json"
    profile.write_text(
        json.dumps(
            {
                "version": 1,
                "task": "embeddings",
                "memory_mb": 1233.2,
                "embeddings": {"points": [{"batch_size": 1, "latency_ms": 5}]},
            }
        )
    )
    config = parse_config(model(profile="p.json"), SOURCE, base_dir=tmp_path)
    _memory_from_profile(config)


def test_unreadable_profile_is_not_opened_at_check_time() -> None:
    # The workers may run elsewhere: a missing profile falls back to the task's default.
    config = parse(model(profile="/nowhere/profile.json"))
    assert config.model("sim").memory_mb == default_memory_mb("embeddings")


def test_example_resolves_with_schedules_and_two_pools() -> None:
    config = load_config(EXAMPLE)
    assert set(config.pools) == {"dedicated", "shared"}
    assert len(config.devices) == 8
    assert {d.pool for d in config.devices} == {"dedicated", "shared"}
    chat, embed = autoscaling(config, "chat"), autoscaling(config, "embed")
    assert chat.schedules
    assert embed.schedules
    assert chat.timezone == embed.timezone == "Europe/Paris"
    assert embed.scale_to_zero
    assert config.model("chat").exclusive
    assert config.model("summarize").autoscaling is None


def test_config_check_prints_the_new_sections() -> None:
    code, text = check_config(EXAMPLE)
    assert code == 0, text
    doc = yaml.safe_load(text)
    assert doc["devices"][0] == {"id": "node-a/gpu-0", "memory_mb": 81920, "node": "node-a"}
    assert doc["pools"]["dedicated"]["placement"] == "spread"
    chat = doc["models"][0]
    assert (chat["gpu"], chat["memory_mb"], chat["drain_timeout_s"]) == ("exclusive", 40000, 60.0)
    assert chat["autoscaling"]["scale_down"]["select_policy"] == "min"
    assert chat["autoscaling"]["schedules"][0] == {
        "days": "weekdays",
        "from": "08:30",
        "to": "19:00",
        "min_replicas": 3,
    }
    assert doc["models"][2]["autoscaling"] is None


# ----------------------------------------------------------------------------- bad configs


@dataclass(frozen=True)
class Bad:
    name: str
    data: dict[str, Any]
    key: str  # the dotted key the error must name
    problem: str  # a fragment of the problem
    fix: str  # a fragment of the fix


AS = "models[0].autoscaling"

BAD = [
    Bad(
        "min_above_max",
        scaled(min_replicas=5),
        f"{AS}.min_replicas",
        "above max_replicas 4",
        "lower min_replicas",
    ),
    Bad(
        "min_zero_without_scale_to_zero",
        scaled(min_replicas=0),
        f"{AS}.min_replicas",
        "scale_to_zero is false",
        "scale_to_zero: true",
    ),
    Bad(
        "max_required",
        model(autoscaling={"target_per_replica": 8}),
        f"{AS}.max_replicas",
        "missing",
        "add 'max_replicas: ...'",
    ),
    Bad(
        "target_required",
        model(autoscaling={"max_replicas": 3}),
        f"{AS}.target_per_replica",
        "missing",
        "add 'target_per_replica",
    ),
    Bad(
        "target_positive",
        scaled(target_per_replica=0),
        f"{AS}.target_per_replica",
        "out of range",
        "> 0",
    ),
    Bad(
        "rate_target_positive",
        scaled(target_rate_per_replica=-5),
        f"{AS}.target_rate_per_replica",
        "out of range",
        "> 0",
    ),
    Bad("tolerance_below_one", scaled(tolerance=1.0), f"{AS}.tolerance", "out of range", "< 1"),
    Bad("interval_positive", scaled(interval_s=0), f"{AS}.interval_s", "out of range", "> 0"),
    Bad(
        "select_policy_value",
        scaled(scale_up={"select_policy": "maximum"}),
        f"{AS}.scale_up.select_policy",
        "'maximum' is not allowed",
        "did you mean 'max'?",
    ),
    Bad(
        "policy_type",
        scaled(scale_down={"policies": [{"type": "pod", "value": 1, "period_s": 60}]}),
        f"{AS}.scale_down.policies[0].type",
        "'pod' is not allowed",
        "did you mean 'pods'?",
    ),
    Bad(
        "policy_period_positive",
        scaled(scale_down={"policies": [{"type": "pods", "value": 1, "period_s": 0}]}),
        f"{AS}.scale_down.policies[0].period_s",
        "out of range",
        "> 0",
    ),
    Bad(
        "policy_period_hpa_limit",
        scaled(scale_up={"policies": [{"type": "pods", "value": 1, "period_s": 3600}]}),
        f"{AS}.scale_up.policies[0].period_s",
        "longer than 1800",
        "HPA's limit",
    ),
    Bad(
        "policy_value_positive",
        scaled(scale_up={"policies": [{"type": "percent", "value": 0, "period_s": 15}]}),
        f"{AS}.scale_up.policies[0].value",
        "out of range",
        ">= 1",
    ),
    Bad(
        "policies_not_empty",
        scaled(scale_up={"policies": []}),
        f"{AS}.scale_up.policies",
        "is empty",
        "at least 1",
    ),
    Bad(
        "window_hpa_limit",
        scaled(scale_down={"stabilization_window_s": 7200}),
        f"{AS}.scale_down.stabilization_window_s",
        "longer than 3600",
        "at most 3600",
    ),
    Bad(
        "window_not_negative",
        scaled(scale_down={"stabilization_window_s": -1}),
        f"{AS}.scale_down.stabilization_window_s",
        "out of range",
        ">= 0",
    ),
    Bad(
        "policy_key_typo",
        scaled(scale_up={"policies": [{"type": "pods", "value": 1, "period": 15}]}),
        f"{AS}.scale_up.policies[0].period",
        "unknown key",
        "did you mean 'period_s'?",
    ),
    Bad(
        "panic_threshold_above_one",
        scaled(panic={"threshold": 1}),
        f"{AS}.panic.threshold",
        "at or below the target",
        "above 1",
    ),
    Bad(
        "unknown_timezone",
        scaled(timezone="Europe/Pariss"),
        f"{AS}.timezone",
        "unknown time zone 'Europe/Pariss'",
        "did you mean 'Europe/Paris'?",
    ),
    Bad(
        "schedule_time_format",
        scaled(schedules=[{"days": "daily", "from": "8am", "to": "18:00", "min_replicas": 2}]),
        f"{AS}.schedules[0].from",
        "is not a time of day",
        '"HH:MM"',
    ),
    Bad(
        "schedule_time_unquoted",
        scaled(schedules=[{"days": "daily", "from": 1110, "to": "20:00", "min_replicas": 2}]),
        f"{AS}.schedules[0].from",
        "unquoted time as the number 1110",
        'quote it: "18:30"',
    ),
    Bad(
        "schedule_from_is_not_24",
        scaled(schedules=[{"days": "daily", "from": "24:00", "to": "02:00", "min_replicas": 2}]),
        f"{AS}.schedules[0].from",
        "not a time of day",
        "00:00..23:59",
    ),
    Bad(
        "schedule_minutes_range",
        scaled(schedules=[{"days": "daily", "from": "08:60", "to": "09:00", "min_replicas": 2}]),
        f"{AS}.schedules[0].from",
        "not a time of day",
        '"HH:MM"',
    ),
    Bad(
        "schedule_empty_window",
        scaled(schedules=[{"days": "daily", "from": "08:00", "to": "08:00", "min_replicas": 2}]),
        f"{AS}.schedules[0].to",
        "the same time",
        '"24:00"',
    ),
    Bad(
        "schedule_day_name",
        scaled(
            schedules=[{"days": ["mon", "tues"], "from": "08:00", "to": "09:00", "min_replicas": 2}]
        ),
        f"{AS}.schedules[0].days[1]",
        "'tues' is not a day",
        "did you mean 'tue'?",
    ),
    Bad(
        "schedule_day_set",
        scaled(schedules=[{"days": "workdays", "from": "08:00", "to": "09:00", "min_replicas": 2}]),
        f"{AS}.schedules[0].days",
        "'workdays' is not a day",
        "did you mean 'weekdays'?",
    ),
    Bad(
        "schedule_day_twice",
        scaled(
            schedules=[{"days": ["mon", "mon"], "from": "08:00", "to": "09:00", "min_replicas": 2}]
        ),
        f"{AS}.schedules[0].days[1]",
        "listed twice",
        "once",
    ),
    Bad(
        "schedule_days_empty",
        scaled(schedules=[{"days": [], "from": "08:00", "to": "09:00", "min_replicas": 2}]),
        f"{AS}.schedules[0].days",
        "is empty",
        "weekdays",
    ),
    Bad(
        "schedule_above_max",
        scaled(schedules=[{"days": "daily", "from": "08:00", "to": "09:00", "min_replicas": 9}]),
        f"{AS}.schedules[0].min_replicas",
        "above max_replicas 4",
        "raise autoscaling.max_replicas",
    ),
    Bad(
        "schedule_key_typo",
        scaled(schedules=[{"days": "daily", "form": "08:00", "to": "09:00", "min_replicas": 1}]),
        f"{AS}.schedules[0].form",
        "unknown key",
        "did you mean 'from'?",
    ),
    Bad(
        "autoscaling_an_upstream",
        {"models": [{**UPSTREAM, "autoscaling": SCALED}]},
        f"{AS}",
        "nothing to scale",
        "remove autoscaling",
    ),
    Bad(
        "gpu_value",
        model(gpu="whole"),
        "models[0].gpu",
        "'whole' is not allowed",
        "exclusive, shared",
    ),
    Bad("memory_positive", model(memory_mb=0), "models[0].memory_mb", "out of range", ">= 1"),
    Bad(
        "drain_not_negative",
        model(drain_timeout_s=-5),
        "models[0].drain_timeout_s",
        "out of range",
        ">= 0",
    ),
    Bad(
        "placement_value",
        {"pools": {"shared": {"placement": "pack"}}},
        "pools.shared.placement",
        "'pack' is not allowed",
        "binpack, spread",
    ),
    Bad(
        "device_id_twice",
        {"devices": [INVENTORY[0], INVENTORY[0]]},
        "devices[1].id",
        "already declared at devices[0]",
        "unique id",
    ),
    Bad(
        "device_id_auto",
        {"devices": [{**INVENTORY[0], "id": "auto"}]},
        "devices[0].id",
        "not a valid device id",
        "not 'auto'",
    ),
    Bad(
        "device_memory_positive",
        {"devices": [{**INVENTORY[0], "memory_mb": 0}]},
        "devices[0].memory_mb",
        "out of range",
        ">= 1",
    ),
    Bad(
        "device_memory_required",
        {"devices": [{"id": "x"}]},
        "devices[0].memory_mb",
        "missing",
        "add 'memory_mb",
    ),
    Bad(
        "pool_names_an_undeclared_device",
        {"devices": INVENTORY, "pools": {"shared": {"devices": ["a/gpu-2"]}}},
        "pools.shared.devices[0]",
        "not declared under devices",
        "did you mean 'a/gpu-",
    ),
    Bad(
        "pool_names_cuda_beside_an_inventory",
        {"devices": INVENTORY, "pools": {"shared": {"devices": ["cuda:0"]}}},
        "pools.shared.devices[0]",
        "not declared",
        "list its ids",
    ),
    Bad(
        "exclusive_larger_than_every_device",
        {"devices": INVENTORY, "models": [{**SIM, "gpu": "exclusive", "memory_mb": 90000}]},
        "models[0].memory_mb",
        "needs an exclusive device of 90000 MB, more than the largest device",
        "lower memory_mb, or declare a larger device",
    ),
    Bad(
        "shared_larger_than_the_devices_of_its_pools",
        {
            "devices": INVENTORY,
            "pools": {
                "small": {"devices": ["a/gpu-0", "a/gpu-1"]},
                "big": {"devices": ["b/gpu-0"]},
            },
            "models": [{**SIM, "memory_mb": 30000, "pools": ["small"]}],
        },
        "models[0].memory_mb",
        "small): a/gpu-0 with 24576 MB",
        "declare a larger device",
    ),
    Bad(
        "more_exclusive_replicas_than_devices",
        {"devices": INVENTORY, "models": [{**SIM, "gpu": "exclusive", "replicas": 4}]},
        "models[0].replicas",
        "4 exclusive replicas need 4 devices",
        "start fewer replicas",
    ),
    Bad(
        "auto_finds_no_device",
        {
            "devices": INVENTORY[:1],
            "pools": {"a": {"devices": ["a/gpu-0"]}, "b": None},
            "models": [SIM],
        },
        "pools.b.devices",
        "auto finds no declared device",
        "list this pool's devices by id",
    ),
]


@pytest.mark.parametrize("case", BAD, ids=lambda case: case.name)
def test_error_names_file_key_and_fix(case: Bad) -> None:
    with pytest.raises(ConfigError) as info:
        parse(case.data)
    error = info.value
    assert (error.file, error.key) == (SOURCE, case.key)
    problem, _, fix = error.message.partition(". Fix: ")
    assert problem.startswith(f"{SOURCE}: {case.key}: ")
    assert case.problem in problem
    assert case.fix in fix


def test_error_rows_have_unique_names() -> None:
    names = [case.name for case in [*BAD, *GOOD]]
    assert len(names) == len(set(names))


def test_unquoted_time_in_a_file_is_caught_with_the_quoted_fix(tmp_path: Path) -> None:
    path = tmp_path / "t.yaml"
    path.write_text(
        "models:\n  - name: sim\n    task: embeddings\n    engine: simulated\n"
        "    autoscaling:\n      max_replicas: 2\n      target_per_replica: 4\n"
        "      schedules:\n        - {days: daily, from: 18:30, to: '20:00', min_replicas: 1}\n"
    )
    with pytest.raises(ConfigError, match='quote it: "18:30"'):
        load_config(path)


def test_starting_replicas_in_no_pool_start_in_the_first() -> None:
    config = parse(
        {"models": [{**SIM, "replicas": {}, "autoscaling": {**SCALED, "min_replicas": 2}}]}
    )
    assert dict(config.model("sim").replicas) == {"shared": 2}


def test_controller_block_resolves_and_renders_back() -> None:
    config = parse(
        {
            **model(probe_max_ms=250),
            "controller": {
                "orchestrator": "ray",
                "ray_address": "127.0.0.1:6379",
                "defrag": {"window": {"from": "23:00", "to": "05:00"}, "timezone": "Europe/Paris"},
            },
        }
    )
    controller = config.controller
    assert (controller.orchestrator, controller.ray_address) == ("ray", "127.0.0.1:6379")
    assert controller.defrag_window == (23 * 60, 5 * 60)  # across midnight
    assert controller.defrag_timezone == "Europe/Paris"
    assert config.model("sim").probe_max_ms == 250
    assert config.worker_settings("sim").probe_max_ms == 250
    again = parse(yaml.safe_load(render_config(config)))
    assert again.controller == controller
    assert again.model("sim").probe_max_ms == 250


def test_forecast_is_off_unless_asked() -> None:
    assert parse(scaled()).model("sim").autoscaling.forecast is False  # type: ignore[union-attr]
    assert parse(scaled(forecast=True)).model("sim").autoscaling.forecast is True  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("defrag", "key", "fix"),
    [
        ({"window": {"from": "25:00", "to": "05:00"}}, "controller.defrag.window.from", "HH:MM"),
        ({"window": {"from": "02:00", "to": "02:00"}}, "controller.defrag.window", "02:00"),
        (
            {"window": {"from": "02:00", "to": "05:00"}, "timezone": "Mars/Olympus"},
            "controller.defrag.timezone",
            "IANA",
        ),
    ],
)
def test_bad_defrag_window_names_the_key_and_fix(
    defrag: dict[str, Any], key: str, fix: str
) -> None:
    with pytest.raises(ConfigError) as caught:
        parse({**model(), "controller": {"defrag": defrag}})
    assert caught.value.key == key
    assert fix in str(caught.value).split("Fix: ")[1]


def test_engine_process_goes_to_the_workers_and_renders_back() -> None:
    config = parse(model(engine_process=True))
    settings = config.worker_settings("sim")
    assert settings.engine_process is True
    assert "--engine-process" in worker_command(settings)
    assert parse(yaml.safe_load(render_config(config))).model("sim").engine_process is True
    default = parse(model()).worker_settings("sim")
    assert default.engine_process is None  # the engine's own default
    assert not {"--engine-process", "--no-engine-process"} & set(worker_command(default))


def test_engine_threads_go_to_the_workers_and_render_back() -> None:
    config = parse({"models": [{**GEN, "engine_threads": 1}]})
    settings = config.worker_settings("gen")
    assert settings.engine_threads == 1
    command = worker_command(settings)
    assert command[command.index("--engine-threads") + 1] == "1"
    assert parse(yaml.safe_load(render_config(config))).model("gen").engine_threads == 1
    default = parse(model()).worker_settings("sim")
    assert default.engine_threads is None  # the engine's own default: every core
    assert "--engine-threads" not in worker_command(default)


def test_upstream_workers_render_back_and_is_only_for_openai_models() -> None:
    config = parse({"models": [{**UPSTREAM, "upstream_workers": True}]})
    spec = config.model(UPSTREAM["name"])
    assert spec.upstream_workers
    assert spec.tidegate_workers
    again = parse(yaml.safe_load(render_config(config))).model(UPSTREAM["name"])
    assert again.upstream_workers
    assert not parse({"models": [UPSTREAM]}).model(UPSTREAM["name"]).tidegate_workers
    assert parse({"models": [GEN]}).model("gen").tidegate_workers  # started here
    with pytest.raises(ConfigError) as caught:
        parse({"models": [{**GEN, "upstream_workers": True}]})
    assert caught.value.key == "models[0].upstream_workers"
    assert "remove upstream_workers" in str(caught.value).split("Fix: ")[1]


@pytest.mark.parametrize(
    ("entry", "fix"),
    [
        ({**SIM, "engine_threads": 0}, "models[0].engine_threads"),
        ({**UPSTREAM, "engine_threads": 2}, "upstream server's own thread option"),
    ],
)
def test_bad_engine_threads_name_the_key_and_fix(entry: dict[str, Any], fix: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse({"models": [entry]})
    assert "engine_threads" in caught.value.key
    assert fix in str(caught.value)


def test_engine_process_on_a_generation_model_names_the_key_and_fix() -> None:
    with pytest.raises(ConfigError) as caught:
        parse({"models": [{**GEN, "engine_process": False}]})
    assert caught.value.key == "models[0].engine_process"
    assert "remove engine_process" in str(caught.value).split("Fix: ")[1]
