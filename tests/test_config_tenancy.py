"""Config: the tenancy section (who a request is for; fair sharing inside a level)."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from tests.test_config import SOURCE, parse
from tidegate.config import parse_config, render_config
from tidegate.core.fairness import FairnessConfig
from tidegate.errors import ConfigError


def test_default_is_no_header_and_fifo_in_a_level() -> None:
    config = parse({})
    assert config.tenancy.header is None
    assert config.fairness is None
    assert config.queue_config(next(iter(config.models))).fairness is None


def test_tenancy_resolved_and_given_to_every_queue() -> None:
    config = parse(
        {
            "tenancy": {
                "header": "X-Tenant",
                "fair_sharing": True,
                "output_weight": 4,
                "lag_tokens": 50,
                "weights": {"acme": 2.0, "team.b": 0.5},
                "slot_reserve_fraction": 0.1,
            }
        }
    )
    assert config.tenancy.header == "x-tenant"  # headers arrive lower-cased
    expected = FairnessConfig(
        input_weight=1.0,
        output_weight=4.0,
        lag_tokens=50.0,
        shares=(("acme", 2.0), ("team.b", 0.5)),
        reserve_fraction=0.1,
    )
    assert config.fairness == expected
    for model in config.models:
        assert config.queue_config(model).fairness == expected
    assert parse_config(yaml.safe_load(render_config(config)), SOURCE) == config


@pytest.mark.parametrize(
    ("tenancy", "key", "problem", "fix"),
    [
        ({"header": "Authorization"}, "tenancy.header", "already gives a meaning", "X-Tenant"),
        ({"header": "X-Priority"}, "tenancy.header", "already gives a meaning", "of your own"),
        ({"header": "X Tenant"}, "tenancy.header", "not a valid name", ""),
        ({"weights": {"a b": 1.0}}, "tenancy.weights.a b", "not a valid tenant", "letters"),
        ({"weights": {"a": 0}}, "tenancy.weights.a", "out of range", "> 0"),
        ({"input_weight": 0, "output_weight": 0}, "tenancy.input_weight", "both 0", "VTC"),
        ({"lag": 5}, "tenancy.lag", "unknown key", "lag_tokens"),
        ({"slot_reserve_fraction": 1}, "tenancy.slot_reserve_fraction", "out of range", "< 1"),
        ({"slot_reserve_fraction": -0.5}, "tenancy.slot_reserve_fraction", "out of range", ">= 0"),
        ({"preemption": True}, "tenancy.preemption", "without fair_sharing", "fair_sharing: true"),
        ({"header": "X-Tidegate-Preempt"}, "tenancy.header", "already gives a meaning", ""),
    ],
)
def test_bad_tenancy_names_file_key_and_fix(
    tenancy: dict[str, Any], key: str, problem: str, fix: str
) -> None:
    with pytest.raises(ConfigError) as info:
        parse({"tenancy": tenancy})
    error = info.value
    assert error.file == SOURCE
    assert error.key == key
    text, _, fix_text = error.message.partition(". Fix: ")
    assert problem in text
    assert fix in fix_text


def test_slot_reserve_defaults_to_a_32nd_of_the_slots() -> None:
    config = parse({"tenancy": {"fair_sharing": True}})
    assert config.fairness is not None
    assert config.fairness.reserve_fraction == FairnessConfig().reserve_fraction == 0.03125


def test_preemption_is_only_for_local_generation_models_and_not_the_workers() -> None:
    """The gateway's queue of a local generation model preempts; an embeddings model's or
    an upstream's does not (nothing there to pause), nor does a worker's own queue (it
    pauses what the gateway names)."""
    config = parse(
        {
            "models": [
                {"name": "chat", "task": "generate", "engine": "simulated"},
                {"name": "embed", "task": "embeddings", "engine": "simulated"},
                {
                    "name": "remote",
                    "task": "generate",
                    "engine": "openai",
                    "upstreams": ["http://127.0.0.1:9"],
                },
            ],
            "tenancy": {"fair_sharing": True, "preemption": True},
        }
    )
    preempts = {
        name: getattr(config.queue_config(name).fairness, "preemption", None)
        for name in config.models
    }
    assert preempts == {"chat": True, "embed": False, "remote": False}
    worker = config.worker_settings("chat", "cpu")
    assert worker.fairness is not None
    assert not worker.fairness.preemption
    assert parse_config(yaml.safe_load(render_config(config)), SOURCE) == config
