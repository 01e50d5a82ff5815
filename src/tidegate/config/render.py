"""The resolved config as YAML (what `tidegate config check` prints)."""

from __future__ import annotations

from typing import Any

import yaml

from tidegate.config.control import render_autoscaling, render_controller
from tidegate.config.values import KeySpec, ModelSpec, TidegateConfig


def render_config(config: TidegateConfig) -> str:
    """The resolved configuration as YAML, every default written out.

    The output is itself a valid configuration that loads to the same values.
    """
    doc: dict[str, Any] = {
        "gateway": {
            "host": config.gateway.host,
            "port": config.gateway.port,
            "policy": config.gateway.policy,
            "shutdown_timeout_s": config.gateway.shutdown_timeout_s,
            "max_request_bytes": config.gateway.max_request_bytes,
            "header_timeout_s": config.gateway.header_timeout_s,
            "body_timeout_s": config.gateway.body_timeout_s,
            "metrics_auth": config.gateway.metrics_auth,
            "outlier_detection": _render_outliers(config),
        },
        "priorities": {
            "levels": list(config.levels),
            "default": config.default_priority,
            "aging": {
                "threshold_s": config.aging.threshold_s,
                "rate_per_s": config.aging.rate_per_s,
            },
        },
        "pools": {
            name: {
                "priorities": list(pool.priorities),
                "devices": list(pool.devices),
                "placement": pool.placement,
            }
            for name, pool in config.pools.items()
        },
        "devices": [  # memory_mb: an int in the file; core.placement keeps a float
            {"id": device.id, "memory_mb": int(device.memory_mb), "node": device.node}
            for device in config.devices
        ],
        "controller": render_controller(config.controller),
        "models": [_render_model(model, config.levels) for model in config.models.values()],
        "keys": [
            {
                "name": key.name,
                "sha256": key.sha256,
                "default_priority": key.default_priority,
                "max_priority": key.max_priority,
                "role": key.role,
                "rate_limit": _render_rate_limit(key),
            }
            for key in config.keys
        ],
        "tenancy": {
            "header": config.tenancy.header,
            "fair_sharing": config.tenancy.fair_sharing,
            "input_weight": config.tenancy.fairness.input_weight,
            "output_weight": config.tenancy.fairness.output_weight,
            "lag_tokens": config.tenancy.fairness.lag_tokens,
            "weights": dict(config.tenancy.fairness.shares),
            "slot_reserve_fraction": config.tenancy.fairness.reserve_fraction,
            "preemption": config.tenancy.fairness.preemption,
        },
    }
    header = [f"# tidegate configuration from {config.source}: valid; defaults filled in."]
    if config.fifo:
        header.append(
            "# policy fifo: each model has one FCFS queue level; no aging, no holdback, "
            "no per-level limits."
        )
    header.extend(f"# note: {note}" for note in config.notes)
    body = yaml.dump(doc, Dumper=_Dumper, sort_keys=False, allow_unicode=True, width=100)
    return "\n".join(header) + "\n" + body


class _Dumper(yaml.SafeDumper):
    """Mappings as blocks, lists of plain values on one line: ``levels: [high, medium, low]``."""


def _represent_list(dumper: yaml.SafeDumper, data: list[Any]) -> yaml.SequenceNode:
    flow = all(not isinstance(item, dict | list) for item in data)
    return dumper.represent_sequence("tag:yaml.org,2002:seq", data, flow_style=flow)


_Dumper.add_representer(list, _represent_list)


def _render_model(model: ModelSpec, levels: tuple[str, ...]) -> dict[str, Any]:
    out: dict[str, Any] = {"name": model.name, "task": model.task, "engine": model.engine}
    if model.engine == "transformers":
        out["model_path"] = model.model_path
    elif model.engine == "simulated":
        out["profile"] = model.profile
    if model.local:
        out["replicas"] = dict(model.replicas)
    else:
        out["upstreams"] = _render_upstreams(model)
        if model.upstream_workers:
            out["upstream_workers"] = True
    out["pools"] = list(model.pools)
    out["slots"] = model.slots
    out["batching"] = {
        "max_batch_size": model.batching.max_batch_size,
        "batch_window_ms": model.batching.batch_window_ms,
        "max_batch_tokens": model.batching.max_batch_tokens,
        "max_num_seqs": model.batching.max_num_seqs,
        "max_prefill_tokens": model.batching.max_prefill_tokens,
        "window_ms_by_priority": {
            name: window
            for name, window in zip(levels, model.batching.level_windows_ms, strict=False)
            if window is not None
        },
        "load_aware_window": model.batching.load_aware_window,
        "length_candidates": model.batching.length_candidates,
        "max_padding_ratio": model.batching.max_padding_ratio,
        "batch_overhead_tokens": model.batching.batch_overhead_tokens,
        "target_p99_ms": model.batching.target_p99_ms,
        "min_batch_size": model.batching.min_batch_size,
    }
    out["queue"] = {
        "max_size": model.queue.max_size,
        "max_size_per_level": dict(model.queue.max_size_per_level),
        "timeout_s": dict(model.queue.timeout_s),
        "holdback": dict(model.queue.holdback),
    }
    if model.task == "generate":
        affinity = model.routing.affinity
        out["routing"] = {"policy": model.routing.policy}
        if affinity is not None:
            out["routing"].update(
                load_factor=affinity.load_factor,
                slack=affinity.slack,
                token_bound=affinity.token_bound,
                block_chars=model.routing.block_chars,
                num_blocks=model.routing.num_blocks,
            )
    out["gpu"] = "exclusive" if model.exclusive else "shared"
    out["memory_mb"] = model.memory_mb
    out["drain_timeout_s"] = model.drain_timeout_s
    out["probe_max_ms"] = model.probe_max_ms
    if model.local and model.task == "embeddings":
        out["engine_process"] = model.engine_process
    if model.local:
        out["engine_threads"] = model.engine_threads
    out["autoscaling"] = (
        None if model.autoscaling is None else render_autoscaling(model.autoscaling)
    )
    return out


def _render_outliers(config: TidegateConfig) -> dict[str, Any]:
    outliers = config.gateway.outlier_detection
    return {
        "consecutive_failures": outliers.consecutive_failures,
        "base_ejection_s": outliers.base_ejection_s,
        "max_ejection_s": outliers.max_ejection_s,
        "max_ejection_percent": outliers.max_ejection_percent,
    }


def _render_rate_limit(key: KeySpec) -> dict[str, Any] | None:
    limit = key.rate_limit
    if limit is None:
        return None
    return {
        "requests_per_s": limit.requests_per_s,
        "burst_requests": limit.burst_requests,
        "tokens_per_min": limit.tokens_per_min,
        "burst_tokens": limit.burst_tokens,
    }


def _render_upstreams(model: ModelSpec) -> list[Any]:
    """URLs; an upstream with a key names its variable, never the key."""
    out: list[Any] = []
    for index, url in enumerate(model.upstreams):
        key = model.upstream_key(index)
        out.append(url if key is None else {"url": url, "api_key_env": key.env})
    return out
