"""Resolved configuration: frozen values, every default filled in, and the core types
the gateway builds from them."""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import TYPE_CHECKING

from tidegate.core.autoscale import AutoscaleConfig
from tidegate.core.batching import BatchConfig
from tidegate.core.fairness import FairnessConfig
from tidegate.core.outliers import OutlierConfig
from tidegate.core.placement import Device
from tidegate.core.prefix import (
    DEFAULT_BLOCK_CHARS,
    DEFAULT_NUM_BLOCKS,
    PrefixAffinity,
    text_key,
)
from tidegate.core.queue import AgingConfig, LevelSpec, QueueConfig
from tidegate.core.quota import BucketSpec, QuotaSpec
from tidegate.core.routing import PoolSpec

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
# A tenant name (a trusted header's value, or a key's name): what /stats and metrics show.
TENANT_RE = re.compile(r"^[A-Za-z0-9._:@-]{1,64}$")
_LOOPBACK_HOSTS = ("localhost", "::1")

# ----------------------------------------------------------------------------- resolved values


@dataclass(frozen=True, slots=True)
class GatewaySettings:
    host: str = "127.0.0.1"
    port: int = 8000
    policy: str = "priority"  # "priority" or "fifo"
    shutdown_timeout_s: float = 10.0
    max_request_bytes: int = 4 * 1024 * 1024
    header_timeout_s: float = 10.0  # connection (or a request's first byte) to end of headers
    body_timeout_s: float = 30.0  # end of headers to end of body
    metrics_auth: str = "open"  # who may read /metrics: "open", "key" (any key) or "admin"
    # passive ejection of replicas that keep failing (core.outliers)
    outlier_detection: OutlierConfig = field(default_factory=OutlierConfig)


@dataclass(frozen=True, slots=True)
class TenancySettings:
    """Who a request is for: the trusted header's value, else its API key's name, else ""."""

    header: str | None = None  # lower-case; None: a client-sent tenant header is ignored
    fair_sharing: bool = False  # VTC inside a level (core.fairness); False: FIFO in a level
    fairness: FairnessConfig = field(default_factory=FairnessConfig)


@dataclass(frozen=True, slots=True)
class ControllerSettings:
    orchestrator: str = "local"  # "local" (child processes) or "ray" (actors on a cluster)
    ray_address: str | None = None  # None: a local Ray, or the cluster in RAY_ADDRESS
    defrag_window: tuple[int, int] | None = None  # local minutes [from, to); None: on request
    defrag_timezone: str = "UTC"
    defrag_move_timeout_s: float = 300.0


@dataclass(frozen=True, slots=True)
class PoolConfig:
    name: str
    priorities: tuple[str, ...]  # level names it serves, in level order
    # "auto", "cpu", "cuda:N", or declared ids; "auto" is resolved at start-up (NVML), or at
    # load time to the declared ids no other pool lists when `devices:` is declared
    devices: tuple[str, ...]
    placement: str = "binpack"  # "binpack" or "spread" (core.placement.STRATEGIES)


@dataclass(frozen=True, slots=True)
class BatchingSpec:
    max_batch_size: int = 32
    batch_window_ms: float = 5.0
    max_batch_tokens: int | None = None
    max_num_seqs: int = 16
    # generate, own workers: a sequence joins the engine only while the prompts of those
    # admitted and not yet at their first token stay within this many tokens; 0: no bound
    max_prefill_tokens: int = 0
    # adaptive batching: per level index (the config's priorities), None: batch_window_ms
    level_windows_ms: tuple[float | None, ...] = ()
    load_aware_window: bool = False
    length_candidates: int = 0
    max_padding_ratio: float = 1.25
    batch_overhead_tokens: float | None = None  # length-aware on cost instead of the ratio
    target_p99_ms: float | None = None
    min_batch_size: int = 1


@dataclass(frozen=True, slots=True)
class RoutingSpec:
    """How the gateway picks a replica: the least loaded, or by prompt prefix (bounded)."""

    affinity: PrefixAffinity | None = None  # None: least loaded
    num_blocks: int = DEFAULT_NUM_BLOCKS  # leading blocks of the prompt in a prefix key
    block_chars: int = DEFAULT_BLOCK_CHARS

    @property
    def policy(self) -> str:
        return "least_loaded" if self.affinity is None else "prefix_affinity"

    def prefix_key(self, prompt: str) -> int | None:
        """The prompt's prefix key when routing by prefix (None: not, or too short)."""
        if self.affinity is None:
            return None
        return text_key(prompt, self.num_blocks, self.block_chars)


@dataclass(frozen=True, slots=True)
class QueueSpec:
    max_size: int
    max_size_per_level: Mapping[str, int]
    timeout_s: Mapping[str, float]
    holdback: Mapping[str, float]  # levels absent here are never held back


@dataclass(frozen=True, slots=True)
class UpstreamKey:
    """An upstream's API key, read from the environment at load; sent as a Bearer token.

    The value never appears in a repr, a log line, /admin output or the rendered config
    (which names the variable instead).
    """

    env: str  # the environment variable it was read from
    value: str = field(repr=False)

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.value}"}


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
    memory_mb: int = 0  # what one replica asks of a shared device (config.control)
    exclusive: bool = False  # gpu: exclusive: a whole device per replica
    drain_timeout_s: float = 30.0  # scale-in: in-flight requests may finish this long
    autoscaling: AutoscaleConfig | None = None  # None: static, ``replicas`` is all it has
    probe_max_ms: float | None = None  # ready only once a probe after warm-up is this fast
    # embeddings: the model in a process of its own (engines/process.py); None: the default
    engine_process: bool | None = None
    # CPU threads of the engine's operators (torch.set_num_threads); None: the engine's
    # default, every core of the host
    engine_threads: int | None = None
    # per upstream (same order as ``upstreams``): its API key, or None; () when none has one
    upstream_keys: tuple[UpstreamKey | None, ...] = ()
    routing: RoutingSpec = RoutingSpec()
    # engine openai: its upstreams are `tidegate worker`s (as `tidegate k8s render` wires a
    # gateway to its workers' Service): they are sent the tenant like tidegate's own workers
    upstream_workers: bool = False

    def upstream_key(self, index: int) -> UpstreamKey | None:
        """The API key of ``upstreams[index]``, or None when it needs none."""
        return self.upstream_keys[index] if index < len(self.upstream_keys) else None

    @property
    def local(self) -> bool:
        """Its replicas are worker processes tidegate starts (not static upstreams)."""
        return self.engine != "openai"

    @property
    def tidegate_workers(self) -> bool:
        """Its replicas are ``tidegate worker``s: started here, or upstreams said to be."""
        return self.local or self.upstream_workers

    @property
    def upstream_pool(self) -> str:
        """The pool that upstream replicas count as members of: the model's first pool."""
        return self.pools[0]


@dataclass(frozen=True, slots=True)
class RateLimitSpec:
    """A key's quotas as configured, bursts filled in; a rate of None is unlimited."""

    requests_per_s: float | None = None
    burst_requests: int | None = None  # set whenever requests_per_s is
    tokens_per_min: int | None = None  # estimated tokens (forward.estimate_tokens)
    burst_tokens: int | None = None  # set whenever tokens_per_min is

    def quota(self) -> QuotaSpec:
        """The buckets core.quota takes from."""
        requests = tokens = None
        if self.requests_per_s is not None and self.burst_requests is not None:
            requests = BucketSpec(self.requests_per_s, self.burst_requests)
        if self.tokens_per_min is not None and self.burst_tokens is not None:
            tokens = BucketSpec(self.tokens_per_min / 60.0, self.burst_tokens)
        return QuotaSpec(requests=requests, tokens=tokens)


@dataclass(frozen=True, slots=True)
class KeySpec:
    name: str
    sha256: str  # lower-case hex digest of the key
    default_priority: str
    max_priority: str  # the most urgent level the key may ask for
    default_level: int  # level indices as the queue sees them (all 0 under fifo)
    max_level: int
    role: str = "user"  # "admin": may call /admin/* (and /metrics when restricted to admins)
    rate_limit: RateLimitSpec | None = None  # None: no quota

    @property
    def admin(self) -> bool:
        return self.role == "admin"


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
    devices: tuple[Device, ...] = ()  # the declared inventory; empty: NVML (or cpu) decides
    controller: ControllerSettings = ControllerSettings()
    tenancy: TenancySettings = TenancySettings()

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
        # ASCII digits only: str.isdigit() also takes "²" and "٣", which int() refuses.
        digits = isinstance(value, str) and value.strip().isascii() and value.strip().isdigit()
        if isinstance(value, int) or digits:
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
        model = self.model(model_name)
        queue = model.queue
        fairness = self.fairness
        if (
            fairness is not None
            and fairness.preemption
            and not (model.local and model.task == "generate")
        ):
            # Only tidegate's own generation workers pause a sequence for another; an
            # embeddings batch or an upstream server has nothing to pause.
            fairness = replace(fairness, preemption=False)
        if self.fifo:
            return QueueConfig(
                levels=(LevelSpec(FIFO_LEVEL),),
                max_size=queue.max_size,
                aging=AgingConfig(threshold_s=self.aging.threshold_s, rate_per_s=0.0),
                fairness=fairness,
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
        return QueueConfig(
            levels=levels, max_size=queue.max_size, aging=self.aging, fairness=fairness
        )

    @property
    def fairness(self) -> FairnessConfig | None:
        """The queues' fair sharing between tenants inside a level; None: FIFO in a level."""
        return self.tenancy.fairness if self.tenancy.fair_sharing else None

    def batch_config(self, model_name: str) -> BatchConfig:
        batching = self.model(model_name).batching
        return BatchConfig(
            max_batch_size=batching.max_batch_size,
            max_batch_tokens=batching.max_batch_tokens,
            batch_window_ms=batching.batch_window_ms,
            level_windows_ms=batching.level_windows_ms,
            load_aware=batching.load_aware_window,
            length_candidates=batching.length_candidates,
            max_padding_ratio=batching.max_padding_ratio,
            batch_overhead_tokens=batching.batch_overhead_tokens,
            target_p99_ms=batching.target_p99_ms,
            min_batch_size=batching.min_batch_size,
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
        # Fair sharing orders the tenants of the worker's sequence queue too; slot shares
        # are the gateway's (the model's slots), so none are held back in a worker, and the
        # gateway decides preemptions (a worker pauses the sequence the request names).
        fairness = self.fairness and replace(self.fairness, reserve_fraction=0.0, preemption=False)
        return WorkerSettings(
            model=model.name,
            engine=model.engine,
            model_path=model.model_path,
            task=model.task,
            device=device,
            max_batch_size=model.batching.max_batch_size,
            batch_window_ms=model.batching.batch_window_ms,
            max_batch_tokens=model.batching.max_batch_tokens,
            level_windows_ms=model.batching.level_windows_ms,
            load_aware_window=model.batching.load_aware_window,
            length_candidates=model.batching.length_candidates,
            max_padding_ratio=model.batching.max_padding_ratio,
            batch_overhead_tokens=model.batching.batch_overhead_tokens,
            target_p99_ms=model.batching.target_p99_ms,
            min_batch_size=model.batching.min_batch_size,
            max_num_seqs=model.batching.max_num_seqs,
            max_prefill_tokens=model.batching.max_prefill_tokens,
            fairness=fairness,
            profile=model.profile,
            probe_max_ms=model.probe_max_ms,
            engine_process=model.engine_process,
            engine_threads=model.engine_threads,
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
