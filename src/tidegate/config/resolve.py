"""Cross-field checks: names of levels, pools, models and keys; upstreams; holdback."""

from __future__ import annotations

import math
import os
import re
from pathlib import Path
from types import MappingProxyType
from typing import Any, NoReturn
from urllib.parse import urlsplit, urlunsplit

from tidegate.config.control import ControlResolver
from tidegate.config.diagnostics import _describe, _sub, suggest, unserved_level_notes
from tidegate.config.schema import (
    _AgingIn,
    _BatchingIn,
    _ConfigIn,
    _GatewayIn,
    _KeyIn,
    _ModelIn,
    _OutlierIn,
    _PoolIn,
    _PrioritiesIn,
    _QueueIn,
    _RateLimitIn,
    _RoutingIn,
    _TenancyIn,
)
from tidegate.config.values import (
    _DEVICE_RE,
    _LOOPBACK_HOSTS,
    _NAME_RE,
    _SHA256_RE,
    DEFAULT_HOLDBACK,
    DEFAULT_LEVELS,
    DEFAULT_POOL,
    TENANT_RE,
    BatchingSpec,
    GatewaySettings,
    KeySpec,
    ModelSpec,
    PoolConfig,
    QueueSpec,
    RateLimitSpec,
    RoutingSpec,
    TenancySettings,
    TidegateConfig,
    UpstreamKey,
)
from tidegate.core.fairness import FairnessConfig
from tidegate.core.outliers import OutlierConfig
from tidegate.core.placement import Device
from tidegate.core.prefix import PrefixAffinity
from tidegate.core.queue import AgingConfig
from tidegate.engines import smollm2
from tidegate.engines.registry import KNOWN_MODELS
from tidegate.errors import ConfigError

# ----------------------------------------------------------------------------- cross-field

_ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_UPSTREAM_FIELDS = ("url", "api_key_env")


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


# Headers whose meaning is fixed: a tenant header must be another one.
_RESERVED_HEADERS = frozenset(
    {
        "authorization",
        "content-type",
        "content-length",
        "host",
        "x-priority",
        "x-request-id",
        "x-tidegate-priority",
        "x-tidegate-tenant",
        "x-tidegate-preempt",
        "transfer-encoding",
        "connection",
    }
)


class _Resolver:
    """Checks what spans fields, fills in defaults, and builds the frozen values."""

    def __init__(self, source: str, base_dir: Path | None) -> None:
        self.source = source
        self.base_dir = base_dir
        self.levels: tuple[str, ...] = DEFAULT_LEVELS
        self.fifo = False
        self.aging = AgingConfig()
        self.notes: list[str] = []
        self.control = ControlResolver(source, self.notes)  # devices, GPU asks, autoscaling
        self.inventory: tuple[Device, ...] = ()

    def _batching(self, b: _BatchingIn, key: str, task: str, engine: str) -> BatchingSpec:
        """The batching section; adaptive keys checked against the levels and the window."""
        if b.max_prefill_tokens and (task != "generate" or engine == "openai"):
            self.fail(
                f"{key}.max_prefill_tokens",
                "max_prefill_tokens bounds the prompts that join the running batch of "
                "tidegate's own generation workers before their first token "
                f"(this model: task {task}, engine {engine})",
                "remove max_prefill_tokens (an embeddings model has no prefill to bound; an "
                "openai upstream schedules its own)",
            )
        windows: list[float | None] = [None] * len(self.levels)
        level_windows = b.window_ms_by_priority
        if level_windows is None:
            level_windows = self._default_level_windows(task, engine)
        for name, window in level_windows.items():
            self.level(name, f"{key}.window_ms_by_priority")
            if window > b.batch_window_ms:
                self.fail(
                    f"{key}.window_ms_by_priority.{name}",
                    f"{window:g} ms is over batch_window_ms ({b.batch_window_ms:g} ms): "
                    "a level window only shortens the wait",
                    f"set it to at most {b.batch_window_ms:g}, or raise batch_window_ms",
                )
            windows[self.levels.index(name)] = window
        if b.min_batch_size > b.max_batch_size:
            self.fail(
                f"{key}.min_batch_size",
                f"{b.min_batch_size} is over max_batch_size ({b.max_batch_size})",
                "set min_batch_size <= max_batch_size",
            )
        return BatchingSpec(
            max_batch_size=b.max_batch_size,
            batch_window_ms=b.batch_window_ms,
            max_batch_tokens=b.max_batch_tokens,
            max_num_seqs=b.max_num_seqs,
            max_prefill_tokens=b.max_prefill_tokens,
            level_windows_ms=tuple(windows) if level_windows else (),
            load_aware_window=b.load_aware_window,
            length_candidates=b.length_candidates,
            max_padding_ratio=b.max_padding_ratio,
            batch_overhead_tokens=b.batch_overhead_tokens,
            target_p99_ms=b.target_p99_ms,
            min_batch_size=b.min_batch_size,
        )

    def _default_level_windows(self, task: str, engine: str) -> dict[str, float]:
        """``window_ms_by_priority`` left out: the most urgent level never waits for
        companions (bench_batching: the high p50 better by the window at low load; at the
        knee and past it throughput the same, p99 within the real runs' noise). None where
        it cannot apply: a generation model (continuous batching has no window), an openai
        upstream (it batches itself), and fifo (one level: a window of 0 there would end
        batching for everyone)."""
        if self.fifo or task != "embeddings" or engine == "openai":
            return {}
        return {self.levels[0]: 0.0}

    def fail(self, key: str, problem: str, fix: str) -> NoReturn:
        raise ConfigError(self.source, key, problem, fix)

    def level(self, name: str, key: str) -> str:
        if name not in self.levels:
            self.fail(
                key,
                f"unknown priority level {name!r}",
                f"{suggest(name, self.levels)}use one of priorities.levels: "
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
            header_timeout_s=gateway_in.header_timeout_s,
            body_timeout_s=gateway_in.body_timeout_s,
            metrics_auth=gateway_in.metrics_auth,
            outlier_detection=self._outliers(gateway_in.outlier_detection),
        )
        self.fifo = gateway.policy == "fifo"
        priorities = raw.priorities or _PrioritiesIn()
        self.levels = self._levels(priorities.levels)
        if priorities.default is not None:
            default = self.level(priorities.default, "priorities.default")
        else:
            default = "medium" if "medium" in self.levels else self.levels[-1]
        aging_in = priorities.aging or _AgingIn()
        aging = self.aging = AgingConfig(aging_in.threshold_s, aging_in.rate_per_s)
        self.control.declare(raw.devices)
        pools = self._pools(raw.pools)
        pools, self.inventory = self.control.devices(pools)
        models = self._models(raw.models, pools)
        keys = self._keys(raw.keys or [], default)
        self._access(gateway, keys)
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
            devices=self.inventory,
            controller=self.control.controller(raw.controller),
            tenancy=self._tenancy(raw.tenancy),
        )

    def _tenancy(self, raw: _TenancyIn | None) -> TenancySettings:
        """The trusted tenant header (not one tidegate reads for itself) and VTC's weights."""
        raw = raw or _TenancyIn()
        header = None if raw.header is None else raw.header.lower()
        if header in _RESERVED_HEADERS:
            self.fail(
                "tenancy.header",
                f"{raw.header} is a header tidegate or HTTP already gives a meaning",
                "name a header of your own for the tenant, e.g. X-Tenant",
            )
        for tenant in raw.weights:
            if not TENANT_RE.fullmatch(tenant):
                self.fail(
                    f"tenancy.weights.{tenant}",
                    f"tenant {tenant!r} is not a valid tenant name",
                    "use 1-64 characters of letters, digits and . _ : @ -",
                )
        if raw.preemption and not raw.fair_sharing:
            self.fail(
                "tenancy.preemption",
                "preemption is fair sharing's: without fair_sharing no tenant has a share",
                "set tenancy.fair_sharing: true as well, or remove preemption",
            )
        if raw.input_weight == 0 and raw.output_weight == 0:
            self.fail(
                "tenancy.input_weight",
                "input_weight and output_weight are both 0: no service would count",
                "give input_weight or output_weight a positive value (VTC uses 1 and 2)",
            )
        return TenancySettings(
            header=header,
            fair_sharing=raw.fair_sharing,
            fairness=FairnessConfig(
                input_weight=raw.input_weight,
                output_weight=raw.output_weight,
                lag_tokens=raw.lag_tokens,
                shares=tuple(sorted(raw.weights.items())),
                reserve_fraction=raw.slot_reserve_fraction,
                preemption=raw.preemption,
            ),
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
            pools[name] = PoolConfig(name, tuple(served), devices, pool_in.placement)
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
            if not self.control.pool_device(device, key) and not _DEVICE_RE.match(device):
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
            raw = [_ModelIn(name="minilm"), _ModelIn(name="smollm2")]
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

    def _check_weights(self, m: _ModelIn) -> None:
        """A note, not an error: the workers may run on another machine (Kubernetes)."""
        if m.name != smollm2.NAME or m.engine != "transformers" or m.model_path is not None:
            return
        try:
            smollm2.gguf_path()
        except ConfigError as exc:
            self.notes.append(
                f"model {m.name}: its weights are not installed here, so its local workers "
                f"will fail to start. Fix: {exc.message.split('Fix: ', 1)[-1]}"
            )

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
        self._engine_fields(m, key, known is not None, task)
        if m.engine == "transformers" and m.model_path is None and known and task != known.task:
            self.fail(
                f"{key}.task",
                f"built-in model {m.name!r} does {known.task}, not {task}",
                f"remove task (or set it to {known.task}), or give model_path for another model",
            )
        model_pools = self._model_pools(m, key, pools)
        upstream_keys: tuple[UpstreamKey | None, ...] = ()
        if m.engine == "openai":
            upstreams, upstream_keys = self._upstreams(m, key)
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
        control = self.control.model(m, key, task, self._path(m.profile), replicas, model_pools[0])
        if m.engine != "openai":
            self.control.check_fit(key, control, model_pools, pools, self.inventory)
            if sum(control.replicas.values()) == 0:
                self.notes.append(f"model {m.name} starts with no replica")
            self._check_weights(m)
        batching = self._batching(m.batching or _BatchingIn(), f"{key}.batching", task, m.engine)
        if not self.fifo:  # fifo: every pool serves its one level
            served = {level for name in model_pools for level in pools[name].priorities}
            self.notes += unserved_level_notes(m.name, model_pools, served, self.levels, self.aging)
        return ModelSpec(
            name=m.name,
            task=task,
            engine=m.engine,
            model_path=self._path(m.model_path),
            profile=self._path(m.profile),
            replicas=MappingProxyType(control.replicas),
            pools=model_pools,
            upstreams=upstreams,
            slots=m.slots,
            batching=batching,
            queue=self._queue(m.queue or _QueueIn(), f"{key}.queue"),
            memory_mb=control.memory_mb,
            exclusive=control.exclusive,
            drain_timeout_s=control.drain_timeout_s,
            autoscaling=control.autoscaling,
            probe_max_ms=m.probe_max_ms,
            engine_process=m.engine_process,
            engine_threads=m.engine_threads,
            upstream_workers=m.upstream_workers,
            upstream_keys=upstream_keys if any(upstream_keys) else (),
            routing=self._routing(m.routing, f"{key}.routing", task),
        )

    def _routing(self, r: _RoutingIn | None, key: str, task: str) -> RoutingSpec:
        if r is None or r.policy == "least_loaded":
            return RoutingSpec()
        if task != "generate":
            self.fail(
                f"{key}.policy",
                "prefix_affinity routing is for generate models: it keeps prompts that share "
                f"a prefix on the replica whose prefix cache holds it (this model: task {task})",
                "remove routing, or set policy: least_loaded",
            )
        return RoutingSpec(
            affinity=PrefixAffinity(
                load_factor=r.load_factor, slack=r.slack, token_bound=r.token_bound
            ),
            num_blocks=r.num_blocks,
            block_chars=r.block_chars,
        )

    def _engine_fields(self, m: _ModelIn, key: str, built_in: bool, task: str) -> None:
        if m.engine_process is not None and (m.engine == "openai" or task != "embeddings"):
            self.fail(
                f"{key}.engine_process",
                "engine_process is only for embedding models served by tidegate's own workers "
                f"(this model: task {task}, engine {m.engine})",
                "remove engine_process",
            )
        if m.upstream_workers and m.engine != "openai":
            self.fail(
                f"{key}.upstream_workers",
                "upstream_workers says an openai model's upstreams are tidegate workers; "
                f"this model's engine is {m.engine}, its workers are tidegate's already",
                "remove upstream_workers",
            )
        if m.engine_threads is not None and m.engine == "openai":
            self.fail(
                f"{key}.engine_threads",
                "engine_threads sets the threads of tidegate's own workers' engines; an "
                "openai upstream runs its own engine",
                "remove engine_threads (set the upstream server's own thread option)",
            )
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
                    f"{suggest(name, list(pools))}use a pool defined under pools: "
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
                    f"{suggest(str(pool), model_pools)}use one of them, or add it to the "
                    "model's pools",
                )
            if not isinstance(count, int) or isinstance(count, bool) or count < 0:
                self.fail(pool_key, f"expected a count, got {_describe(count)}", "give 0 or more")
            replicas[pool] = count
        return replicas

    def _upstreams(
        self, m: _ModelIn, key: str
    ) -> tuple[tuple[str, ...], tuple[UpstreamKey | None, ...]]:
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
        keys: list[UpstreamKey | None] = []
        for index, entry in enumerate(m.upstreams):
            url, api_key = self._upstream_entry(entry, f"{key}.upstreams[{index}]")
            root = _url_root(url)
            if root is None:
                self.fail(
                    f"{key}.upstreams[{index}]" + ("" if isinstance(entry, str) else ".url"),
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
            keys.append(api_key)
        return tuple(roots), tuple(keys)

    def _upstream_entry(self, entry: Any, key: str) -> tuple[str, UpstreamKey | None]:
        """A URL, or ``{url, api_key_env}``: the URL and the key read from the environment."""
        if isinstance(entry, str):
            return entry, None
        if not isinstance(entry, dict):
            self.fail(
                key,
                f"expected a URL or a mapping, got {_describe(entry)}",
                "write the URL (http://127.0.0.1:8001/v1), or {url: ..., api_key_env: NAME} "
                "for a server started with --api-key",
            )
        for name in entry:
            if name not in _UPSTREAM_FIELDS:
                self.fail(
                    _sub(key, str(name)),
                    f"unknown key {name!r}",
                    f"{suggest(str(name), _UPSTREAM_FIELDS) or 'remove it; '}"
                    f"an upstream accepts: {', '.join(_UPSTREAM_FIELDS)}",
                )
        url = entry.get("url")
        if not isinstance(url, str):
            missing = url is None
            self.fail(
                f"{key}.url",
                "required key 'url' is missing"
                if missing
                else f"expected a URL, not {_describe(url)}",
                "add 'url: http://127.0.0.1:8001/v1'",
            )
        env = entry.get("api_key_env")
        if env is None:
            return url, None
        env_key = f"{key}.api_key_env"
        if not isinstance(env, str) or not _ENV_NAME_RE.match(env):
            self.fail(
                env_key,
                f"{_describe(env)} is not the name of an environment variable",
                "give the variable's name (e.g. VLLM_API_KEY), not the key: the key itself "
                "never goes in the file",
            )
        value = os.environ.get(env, "")
        if not value.strip():
            self.fail(
                env_key,
                f"environment variable {env} is {'empty' if env in os.environ else 'not set'}",
                f"export {env}=<the key the server was started with (--api-key)> before "
                "starting tidegate, or remove api_key_env if the server needs no key",
            )
        return url, UpstreamKey(env, value.strip())

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
                    role=key_in.role,
                    rate_limit=self._rate_limit(key_in.rate_limit, f"{key}.rate_limit"),
                )
            )
        return tuple(keys)

    def _rate_limit(self, raw: _RateLimitIn | None, key: str) -> RateLimitSpec | None:
        """A key's quotas with their bursts filled in; None when it sets no rate."""
        if raw is None:
            return None
        for rate, burst in (
            ("requests_per_s", "burst_requests"),
            ("tokens_per_min", "burst_tokens"),
        ):
            if getattr(raw, burst) is not None and getattr(raw, rate) is None:
                self.fail(
                    f"{key}.{burst}",
                    f"{burst} without {rate}: a burst needs the rate that refills it",
                    f"add {rate}, or remove {burst}",
                )
        if raw.requests_per_s is None and raw.tokens_per_min is None:
            return None  # an empty rate_limit: unlimited, as with none
        burst_requests = raw.burst_requests
        if raw.requests_per_s is not None and burst_requests is None:
            burst_requests = max(1, math.ceil(raw.requests_per_s))  # one second's worth
        burst_tokens = raw.burst_tokens
        if raw.tokens_per_min is not None and burst_tokens is None:
            burst_tokens = raw.tokens_per_min  # one minute's worth
        return RateLimitSpec(
            requests_per_s=raw.requests_per_s,
            burst_requests=burst_requests,
            tokens_per_min=raw.tokens_per_min,
            burst_tokens=burst_tokens,
        )

    # ---------------------------------------------------------------- access
    def _outliers(self, raw: _OutlierIn | None) -> OutlierConfig:
        raw = raw or _OutlierIn()
        if raw.max_ejection_s < raw.base_ejection_s:
            self.fail(
                "gateway.outlier_detection.max_ejection_s",
                f"max_ejection_s {raw.max_ejection_s:g} is shorter than base_ejection_s "
                f"{raw.base_ejection_s:g}",
                f"raise max_ejection_s to {raw.base_ejection_s:g} or more (it caps "
                "base_ejection_s x the times ejected), or lower base_ejection_s",
            )
        return OutlierConfig(
            consecutive_failures=raw.consecutive_failures,
            base_ejection_s=raw.base_ejection_s,
            max_ejection_s=raw.max_ejection_s,
            max_ejection_percent=raw.max_ejection_percent,
        )

    def _access(self, gateway: GatewaySettings, keys: tuple[KeySpec, ...]) -> None:
        """metrics_auth needs keys (and an admin key for ``admin``); say when none is admin."""
        mode = gateway.metrics_auth
        admins = [key for key in keys if key.admin]
        if mode != "open" and not keys:
            self.fail(
                "gateway.metrics_auth",
                f"metrics_auth {mode} needs keys, and none is configured (an open service)",
                "add keys (see docs/config.md#keys), or set metrics_auth: open",
            )
        if mode == "admin" and not admins:
            self.fail(
                "gateway.metrics_auth",
                "metrics_auth admin, but no key has role admin: nobody could read /metrics",
                "give a key 'role: admin', or set metrics_auth: key",
            )
        if keys and not admins:
            self.notes.append(
                "no key has role admin: /admin/* (replicas, autoscaler, defrag) answers 403 "
                "to every key"
            )

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
