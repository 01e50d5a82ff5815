"""What ``tidegate explain MODEL`` and ``tidegate defrag --dry-run`` print.

``explain`` asks a running gateway (``GET /admin/autoscaler``) and prints the autoscaler's
recent decisions for one model with the rule and the numbers behind each; when the gateway
refuses, one line says why and which option or variable fixes it. ``defrag`` works
from a config file alone: it places the configured replicas on the declared devices the way
``tidegate serve`` does and prints the fewest moves (core ``plan_defrag``) that free whole
devices.
"""

from __future__ import annotations

from typing import Any

import httpx

from tidegate.config import TidegateConfig
from tidegate.control.inventory import initial_placement
from tidegate.core.placement import DefragPlan, plan_defrag

KEY_OPTION = "--key"
KEY_VARIABLE = "TIDEGATE_ADMIN_KEY"  # what --key reads when it is not given


def fetch_autoscaler(url: str, key: str | None) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    response = httpx.get(f"{url.rstrip('/')}/admin/autoscaler", headers=headers, timeout=10)
    response.raise_for_status()
    return dict(response.json())


def fetch_tenants(url: str, key: str | None) -> dict[str, Any]:
    """Per model, fair sharing's state (``GET /admin/replicas``): on, and per tenant its
    virtual token counter, queued requests and share."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    response = httpx.get(f"{url.rstrip('/')}/admin/replicas", headers=headers, timeout=10)
    response.raise_for_status()
    return {model: view.get("tenants", {}) for model, view in response.json().items()}


def format_tenants(model: str, described: dict[str, Any]) -> str:
    """Why the next request of a level goes to whom: each tenant's counter, least first."""
    if not described.get("fair_sharing"):
        return f"{model}: fair sharing off: first come, first served inside each level"
    tenants = described.get("tenants", {})
    if not tenants:
        return f"{model}: fair sharing on; no tenant served yet"
    slots = described.get("slots", 0)
    lines = [
        f"{model}: fair sharing on: inside a level, the backlogged tenant with the least "
        "virtual tokens served goes next"
    ]
    if slots:
        lines.append(
            f"  a freed slot (of {slots}) goes first to a waiting tenant holding fewer than "
            "its slot share"
        )
    reserve = described.get("reserve_slots", 0)
    if slots and reserve:
        lines.append(
            f"  the last {reserve} free slots are held for a tenant under its slot share "
            f"(shares divide the other {slots - reserve}): one at or over it waits, even "
            "when nobody else does"
        )
    if described.get("preemption"):
        lines.append(
            "  with no slot free, a tenant under its slot share pauses a decoding sequence of "
            f"the one most over its own: {described.get('preemptions', 0)} so far"
        )
    ordered = sorted(tenants.items(), key=lambda item: (item[1]["counter"], item[0]))
    for tenant, state in ordered:
        share = f", share {state['share']:g}" if state.get("share", 1.0) != 1.0 else ""
        held = ""
        if slots and "in_flight" in state:
            held = f", {state['in_flight']} in flight of a slot share of {state['slot_share']:g}"
        lines.append(
            f"  {tenant or '(anonymous)'}: {state['counter']:,.1f} virtual tokens, "
            f"{state['queued']} queued{held}{share}"
        )
    return "\n".join(lines)


def fetch_batching(url: str, key: str | None, model: str) -> list[tuple[str, dict[str, Any]]]:
    """Each ready replica of ``model``: its id and the ``batching`` section of its /stats
    (the adaptive cap and windows now, why its batches left). A replica that does not answer
    is listed with ``{"error": ...}``; one with no batching section (a vLLM upstream) is
    left out."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    response = httpx.get(f"{url.rstrip('/')}/admin/replicas", headers=headers, timeout=10)
    response.raise_for_status()
    found: list[tuple[str, dict[str, Any]]] = []
    for replica in response.json().get(model, {}).get("replicas", []):
        if replica.get("state") != "ready" or not replica.get("url"):
            continue
        try:
            stats = httpx.get(f"{replica['url'].rstrip('/')}/stats", timeout=5).json()
        except (httpx.HTTPError, ValueError) as exc:
            found.append((str(replica.get("id")), {"error": f"/stats: {exc}"}))
            continue
        if isinstance(stats, dict) and isinstance(stats.get("batching"), dict):
            found.append((str(replica.get("id")), stats["batching"]))
    return found


def format_batching(model: str, replicas: list[tuple[str, dict[str, Any]]]) -> str:
    """Why each replica's batches left, and its adaptive cap and windows now."""
    lines = [f"{model}: batching per replica (worker /stats)"]
    for replica_id, batching in replicas:
        if "error" in batching:
            lines.append(f"  {replica_id}: {batching['error']}")
            continue
        if batching.get("kind") == "sequences":
            lines += _sequence_lines(replica_id, batching)
            continue
        reasons = ", ".join(f"{k} {v}" for k, v in batching.get("releases_by_reason", {}).items())
        windows = "/".join(f"{w:g}" for w in batching.get("window_ms_by_level", []))
        line = (
            f"  {replica_id}: cap {batching.get('max_batch_size')} of "
            f"{batching.get('configured_max_batch_size')}, windows {windows} ms by level"
        )
        if batching.get("load_aware"):
            line += f", load-aware (rate {batching.get('arrival_rate_per_s')}/s)"
        if batching.get("length_candidates"):
            line += f", length-aware among {batching['length_candidates']}"
            if batching.get("length_rule"):
                line += f" ({batching['length_rule']})"
        lines.append(line)
        lines.append(
            f"    last batch left by {batching.get('last_release_reason')}; "
            f"releases: {reasons or 'none yet'}"
        )
        cap = batching.get("adaptive_cap")
        if cap:
            # decisions: grow_backlog / hold_backlog (a cap's worth left waiting behind most
            # batches), increase_queueing / hold_queueing (late from waiting), decrease
            # (late from the batch's own run), increase, hold (core.batch_adapt)
            decisions = ", ".join(f"{k} {v}" for k, v in cap.get("decisions", {}).items())
            lines.append(
                f"    AIMD cap: last {cap.get('last_decision')} at high P99 "
                f"{cap.get('last_p99_ms')} ms against {cap.get('target_p99_ms')} ms, "
                f"bounds {cap.get('bounds')}; decisions: {decisions or 'none yet'}"
            )
    return "\n".join(lines)


def _sequence_lines(replica_id: str, batching: dict[str, Any]) -> list[str]:
    """A generation replica: its bounds now, and what held the sequences that waited."""
    budget = batching.get("max_prefill_tokens") or 0
    line = (
        f"  {replica_id}: {batching.get('running')} of {batching.get('max_num_seqs')} "
        f"sequences running"
    )
    if budget:
        line += (
            f", prefill budget {budget} tokens ({batching.get('prefilling_tokens')} "
            "admitted, not yet prefilled)"
        )
    if batching.get("fair_sharing"):
        line += ", fair queue by tenant"
    held = ", ".join(f"{k} {v}" for k, v in batching.get("held_by", {}).items())
    lines = [
        line,
        f"    sequences that waited, by what held them: {held or 'none yet'}; last: "
        f"{batching.get('last_held_by') or 'none'}",
    ]
    if batching.get("preempted"):
        lines.append(
            f"    paused for another tenant's (preemption): {batching['preempted']}, "
            f"{batching.get('recomputed_tokens', 0)} tokens recomputed on resuming"
        )
    return lines


def fetch_failure(url: str, exc: httpx.HTTPError, key_given: bool) -> str:
    """One line on why the gateway did not answer, and what to do about it."""
    where = f"{url.rstrip('/')}/admin/autoscaler"
    if isinstance(exc, httpx.HTTPStatusError) and exc.response.status_code == 401:
        if key_given:
            return (
                f"{where} refused the API key given: pass one of the gateway's keys with "
                f"{KEY_OPTION} KEY or {KEY_VARIABLE}=KEY"
            )
        return (
            f"{where} needs an API key (the gateway has keys): pass {KEY_OPTION} KEY or set "
            f"{KEY_VARIABLE}=KEY"
        )
    if isinstance(exc, httpx.HTTPStatusError):
        return f"{where} answered {exc.response.status_code} {exc.response.reason_phrase}"
    return f"cannot ask {where}: {exc}"


def format_decisions(model: str, state: dict[str, Any], last: int, changes_only: bool) -> str:
    """The model's autoscaler state and its last ``last`` decisions, newest last."""
    config = state["config"]
    lines = [
        f"{model}: {state['replicas']} replicas ({state['ready_replicas']} ready), "
        f"desired {state['desired_replicas']}, pool {state['pool']}",
        f"  target {config['target_per_replica']:g} per ready replica, "
        f"[{config['min_replicas']}, {config['max_replicas']}], every {config['interval_s']:g}s, "
        f"scale-down window {config['scale_down_window_s']:g}s"
        + (", scale to zero" if config["scale_to_zero"] else ""),
    ]
    if state.get("draining"):
        lines.append(f"  draining: {', '.join(state['draining'])}")
    if state.get("refused"):
        lines.append(f"  could not place: {state['refused']}")
    if state.get("panicking"):
        lines.append("  panic mode: scaling on the short window, not down")
    decisions = [d for d in state["decisions"] if not changes_only or d["direction"] != "none"][
        -last:
    ]
    if not decisions:
        lines.append("  no decision yet" if not changes_only else "  no change yet")
    newest = state["decisions"][-1]["at"] if state["decisions"] else 0.0
    for d in decisions:
        lines.append(f"  {d['at'] - newest:+8.1f}s  {d['explain']}")
    return "\n".join(lines)


def plan_config_defrag(config: TidegateConfig) -> tuple[list[str], DefragPlan | None]:
    """The configured placement (lines) and the moves that would free devices."""
    if not config.devices:
        return ["no devices declared: nothing to defragment (declare devices: [...])"], None
    placement, refused = initial_placement(config)
    lines = []
    for device in config.devices:
        asks = placement.on_device(device.id)
        used = placement.used_mb(device.id)
        names = ", ".join(a.replica_id + (" (exclusive)" if a.exclusive else "") for a in asks)
        lines.append(
            f"{device.id:<16} {device.node:<10} {used:>8.0f}/{device.memory_mb:.0f} MB  "
            f"{names or '-'}"
        )
    lines.extend(f"refused {r.ask.replica_id}: {r.message}" for r in refused)
    return lines, plan_defrag(placement, config.devices)
