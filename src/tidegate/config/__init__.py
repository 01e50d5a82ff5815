"""Gateway configuration: YAML in, validated, resolved into frozen values the gateway uses.

- ``loading``: reading the file and the three stages (YAML, shape, meaning);
- ``schema``: what a file may say (strict pydantic models);
- ``diagnostics``: pydantic errors as ConfigErrors naming the dotted key and the fix;
- ``resolve``: cross-field checks and defaults;
- ``values``: the resolved, frozen configuration and the core types built from it;
- ``render``: the resolved config as YAML.
"""

from tidegate.config.loading import check_config, load_config, parse_config
from tidegate.config.render import render_config
from tidegate.config.values import (
    DEFAULT_HOLDBACK,
    DEFAULT_LEVELS,
    DEFAULT_POOL,
    EMBEDDED_SOURCE,
    FIFO_LEVEL,
    BatchingSpec,
    GatewaySettings,
    KeySpec,
    ModelSpec,
    PoolConfig,
    QueueSpec,
    RateLimitSpec,
    TidegateConfig,
    UpstreamKey,
)

__all__ = [
    "DEFAULT_HOLDBACK",
    "DEFAULT_LEVELS",
    "DEFAULT_POOL",
    "EMBEDDED_SOURCE",
    "FIFO_LEVEL",
    "BatchingSpec",
    "GatewaySettings",
    "KeySpec",
    "ModelSpec",
    "PoolConfig",
    "QueueSpec",
    "RateLimitSpec",
    "TidegateConfig",
    "UpstreamKey",
    "check_config",
    "load_config",
    "parse_config",
    "render_config",
]
