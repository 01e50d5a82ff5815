"""What a config file may say: strict pydantic models (shape, not meaning)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from tidegate.config.values import _NAME_RE, DEFAULT_LEVELS

# ----------------------------------------------------------------------------- raw schema
# What the YAML may say. Sections given as null (``gateway:`` with nothing under it) mean
# "all defaults". Checks that involve more than one field live in _Resolver.

Name = Annotated[str, Field(pattern=_NAME_RE.pattern)]
PositiveInt = Annotated[int, Field(ge=1)]
NonNegativeFloat = Annotated[float, Field(ge=0)]
NonNegativeInt = Annotated[int, Field(ge=0)]
PositiveFloat = Annotated[float, Field(gt=0)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class _OutlierIn(_Strict):
    """Passive failure detection of replicas (core.outliers)."""

    consecutive_failures: PositiveInt = 5
    base_ejection_s: PositiveFloat = 30.0
    max_ejection_s: PositiveFloat = 300.0
    max_ejection_percent: Annotated[float, Field(ge=0, le=100)] = 50.0


class _GatewayIn(_Strict):
    host: Annotated[str, Field(min_length=1)] = "127.0.0.1"
    port: Annotated[int, Field(ge=0, le=65535)] = 8000
    policy: Literal["priority", "fifo"] = "priority"
    shutdown_timeout_s: NonNegativeFloat = 10.0
    max_request_bytes: PositiveInt = 4 * 1024 * 1024
    header_timeout_s: PositiveFloat = 10.0
    body_timeout_s: PositiveFloat = 30.0
    metrics_auth: Literal["open", "key", "admin"] = "open"
    outlier_detection: _OutlierIn | None = None


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
    placement: Literal["binpack", "spread"] = "binpack"


class _DeviceIn(_Strict):
    """One declared device (``devices:``): the inventory when NVML is not used."""

    id: Annotated[str, Field(min_length=1)]
    memory_mb: PositiveInt
    node: Name = "local"


# ------------------------------------------------------------------ autoscaling (control.py)


class _PolicyIn(_Strict):
    type: Literal["pods", "percent"]
    value: PositiveInt
    period_s: PositiveFloat


class _ScalingRulesIn(_Strict):
    stabilization_window_s: NonNegativeFloat | None = None  # None: the direction's default
    select_policy: Literal["max", "min", "disabled"] | None = None  # None: the default's
    policies: Annotated[list[_PolicyIn], Field(min_length=1)] | None = None
    tolerance: Annotated[float, Field(ge=0, lt=1)] | None = None  # None: autoscaling's


class _PanicIn(_Strict):
    threshold: float | None = None  # a multiple of target_per_replica; checked in control.py
    window_s: PositiveFloat | None = None


class _WindowIn(_Strict):
    from_: Any = Field(alias="from")  # "HH:MM": checked in control.py
    to: Any


class _DefragIn(_Strict):
    window: _WindowIn
    timezone: Annotated[str, Field(min_length=1)] = "UTC"
    move_timeout_s: PositiveFloat = 300.0


class _ControllerIn(_Strict):
    orchestrator: Literal["local", "ray"] = "local"
    ray_address: str | None = None  # None: start a local Ray (or join RAY_ADDRESS)
    defrag: _DefragIn | None = None


class _ScheduleIn(_Strict):
    days: str | list[str]  # names or "daily"/"weekdays"/"weekends": checked in control.py
    from_: Any = Field(alias="from")  # "HH:MM"; an int is what YAML made of unquoted 18:30
    to: Any
    min_replicas: Annotated[int, Field(ge=0)]


class _AutoscalingIn(_Strict):
    min_replicas: Annotated[int, Field(ge=0)] = 1
    max_replicas: PositiveInt
    target_per_replica: PositiveFloat
    target_rate_per_replica: PositiveFloat | None = None
    # None below: AutoscaleConfig's default (control.py fills it in)
    tolerance: Annotated[float, Field(ge=0, lt=1)] | None = None
    interval_s: PositiveFloat | None = None
    stable_window_s: NonNegativeFloat | None = None
    scale_up: _ScalingRulesIn | None = None
    scale_down: _ScalingRulesIn | None = None
    panic: _PanicIn | None = None
    schedules: list[_ScheduleIn] = Field(default_factory=list)
    timezone: Annotated[str, Field(min_length=1)] = "UTC"
    cold_start_s: NonNegativeFloat | None = None
    scale_to_zero: bool = False
    forecast: bool = False


class _BatchingIn(_Strict):
    max_batch_size: PositiveInt = 32
    batch_window_ms: NonNegativeFloat = 5.0
    max_batch_tokens: PositiveInt | None = None
    max_num_seqs: PositiveInt = 16
    max_prefill_tokens: NonNegativeInt = 0  # generate: prompts joining before a 1st token
    # adaptive batching (core.batching, core.batch_adapt); docs/config.md
    # None: the most urgent level's window is 0 (resolve.py); {}: every level waits the window
    window_ms_by_priority: dict[str, NonNegativeFloat] | None = None
    load_aware_window: bool = False
    length_candidates: NonNegativeInt = 0
    max_padding_ratio: Annotated[float, Field(ge=1, allow_inf_nan=False)] = 1.25
    batch_overhead_tokens: Annotated[float, Field(ge=0, allow_inf_nan=False)] | None = None
    target_p99_ms: PositiveFloat | None = None
    min_batch_size: PositiveInt = 1


class _QueueIn(_Strict):
    max_size: PositiveInt = 1000
    max_size_per_level: dict[str, PositiveInt] = Field(default_factory=dict)
    timeout_s: dict[str, PositiveFloat] = Field(default_factory=dict)
    holdback: dict[str, float | None] | None = None  # None: DEFAULT_HOLDBACK


class _RoutingIn(_Strict):
    """How the gateway picks a replica (core.routing, core.prefix)."""

    policy: Literal["least_loaded", "prefix_affinity"] = "least_loaded"
    load_factor: Annotated[float, Field(ge=1, allow_inf_nan=False)] = 1.25
    slack: Annotated[float, Field(ge=0, allow_inf_nan=False)] = 1.0
    token_bound: bool = True
    block_chars: PositiveInt = 2048
    num_blocks: PositiveInt = 2


class _ModelIn(_Strict):
    name: Name
    task: Literal["embeddings", "generate"] | None = None
    engine: Literal["transformers", "simulated", "openai"] = "transformers"
    model_path: str | None = None
    profile: str | None = None
    replicas: Any = None  # a count or {pool: count}: checked by _Resolver for a clear message
    pools: Annotated[list[str], Field(min_length=1)] | None = None
    # URLs, or {url, api_key_env} mappings: checked by _Resolver for a clear message
    upstreams: list[Any] = Field(default_factory=list)
    upstream_workers: bool = False  # openai: the upstreams are `tidegate worker`s
    slots: PositiveInt | None = None
    batching: _BatchingIn | None = None
    queue: _QueueIn | None = None
    routing: _RoutingIn | None = None
    gpu: Literal["exclusive", "shared"] = "shared"
    memory_mb: PositiveInt | None = None  # None: from the profile, else the task's default
    drain_timeout_s: NonNegativeFloat = 30.0
    probe_max_ms: PositiveFloat | None = None  # ready only once a probe after warm-up is this fast
    engine_process: bool | None = None  # embeddings: the model in a process of its own
    engine_threads: PositiveInt | None = None  # CPU: torch's intra-op threads; None: all cores
    autoscaling: _AutoscalingIn | None = None


class _RateLimitIn(_Strict):
    """A key's quotas (core.quota); a rate left out (or null) is unlimited."""

    requests_per_s: Annotated[float, Field(gt=0, allow_inf_nan=False)] | None = None
    burst_requests: PositiveInt | None = None  # None: one second's worth, at least 1
    tokens_per_min: PositiveInt | None = None  # estimated tokens: prompt + most output
    burst_tokens: PositiveInt | None = None  # None: one minute's worth


class _KeyIn(_Strict):
    name: Name
    sha256: str
    default_priority: str | None = None
    max_priority: str | None = None
    role: Literal["admin", "user"] = "user"
    rate_limit: _RateLimitIn | None = None


class _TenancyIn(_Strict):
    """Who a request is for (fair sharing inside a level, core.fairness)."""

    header: Annotated[str, Field(pattern=r"^[A-Za-z0-9-]+$", max_length=64)] | None = None
    fair_sharing: bool = False
    input_weight: NonNegativeFloat = 1.0
    output_weight: NonNegativeFloat = 2.0
    lag_tokens: NonNegativeFloat = 1000.0
    weights: dict[str, PositiveFloat] = Field(default_factory=dict)  # tenant -> share
    # of a model's slots, the last free ones held for a tenant under its slot share
    slot_reserve_fraction: Annotated[float, Field(ge=0, lt=1)] = 0.03125
    # with no slot free, a tenant under its slot share may pause one of a tenant over its own
    preemption: bool = False


class _ConfigIn(_Strict):
    gateway: _GatewayIn | None = None
    priorities: _PrioritiesIn | None = None
    pools: Annotated[dict[str, _PoolIn | None], Field(min_length=1)] | None = None
    devices: list[_DeviceIn] | None = None
    controller: _ControllerIn | None = None
    models: Annotated[list[_ModelIn], Field(min_length=1)] | None = None
    keys: list[_KeyIn] | None = None
    tenancy: _TenancyIn | None = None
