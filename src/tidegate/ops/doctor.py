"""``tidegate doctor``: read a window of metrics, print ranked findings with config fixes.

Three sources, one set of rules (``tidegate.core.diagnose``):
- a running gateway (``--url``): ``/admin/doctor`` for its running config, ``/admin/replicas``
  for its workers, then ``/metrics`` of the gateway and of every worker twice, ``--window``
  apart;
- a Prometheus server (``--prometheus URL``): the same series at two instants ``--range``
  apart (``--config`` gives the config the findings diff against);
- a ``tidegate simulate`` report (``--report report.json``): each run diagnosed.

Exit status: 2 when any finding is critical, 0 otherwise, 1 when the source could not be
read (the message says why and what fixes it).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

from tidegate.core.diagnose import Diagnosis, Snapshot, Thresholds, diagnose
from tidegate.ops.snapshot import (
    QUERY,
    Samples,
    build_snapshot,
    parse_exposition,
    prometheus_samples,
    report_snapshot,
)

KEY_OPTION = "--key"
KEY_VARIABLE = "TIDEGATE_ADMIN_KEY"
HTTP_TIMEOUT_S = 30.0
_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


class DoctorError(Exception):
    """The source could not be read: one line with the reason and the fix (exit 1)."""


@dataclass(frozen=True)
class DoctorOptions:
    url: str = "http://127.0.0.1:8000"
    key: str | None = None
    window_s: float = 60.0
    prometheus: str | None = None
    range_s: float = 6 * 3600.0
    report: Path | None = None
    config: Path | None = None
    as_json: bool = False
    verbose: bool = False
    thresholds: Thresholds = field(default_factory=Thresholds)


def parse_duration(text: str) -> float:
    """``60s``, ``5m``, ``6h``, ``1d`` or plain seconds."""
    text = text.strip()
    unit = _UNITS.get(text[-1:].lower()) if text else None
    number = text[:-1] if unit is not None else text
    try:
        value = float(number) * (unit or 1.0)
    except ValueError:
        raise ValueError(f"{text!r} is not a duration: write e.g. 60s, 5m, 6h or 1d") from None
    if value <= 0:
        raise ValueError(f"{text!r}: a duration must be positive")
    return value


# ----------------------------------------------------------------------------- sources


def _config_of_file(path: Path | None) -> dict[str, Any]:
    """The resolved config as ``tidegate config check`` renders it; {} without a file."""
    if path is None:
        return {}
    from tidegate.config import load_config, render_config
    from tidegate.errors import ConfigError

    try:
        rendered = render_config(load_config(path, {}))
    except ConfigError as exc:
        raise DoctorError(str(exc)) from None
    return public_config(yaml.safe_load(rendered))


def public_config(doc: Mapping[str, Any]) -> dict[str, Any]:
    """The config without what identifies keys (their digests)."""
    return {k: v for k, v in doc.items() if k != "keys"}


class _Gateway:
    def __init__(self, client: httpx.Client, url: str, key: str | None) -> None:
        self.client = client
        self.url = url.rstrip("/")
        self.headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.key_given = bool(key)

    def get(self, path: str) -> httpx.Response:
        where = f"{self.url}{path}"
        try:
            response = self.client.get(where, headers=self.headers)
        except httpx.HTTPError as exc:
            raise DoctorError(f"cannot ask {where}: {exc}") from None
        if response.status_code == 401:
            raise DoctorError(
                f"{where} refused the API key given: pass an admin key with {KEY_OPTION} KEY "
                f"or {KEY_VARIABLE}=KEY"
                if self.key_given
                else f"{where} needs an admin key (the gateway has keys): pass {KEY_OPTION} "
                f"KEY or set {KEY_VARIABLE}=KEY"
            )
        if response.status_code == 403:
            raise DoctorError(f"{where}: the key is not an admin key; doctor needs role admin")
        if response.status_code >= 400:
            raise DoctorError(f"{where} answered {response.status_code} {response.reason_phrase}")
        return response

    def replicas(self) -> dict[str, dict[str, dict[str, str]]]:
        """model -> replica id -> {pool, url} of every replica that has an address."""
        listed = self.get("/admin/replicas").json()
        return {
            model: {
                r["id"]: {"pool": str(r["pool"]), "url": str(r["url"])}
                for r in entry["replicas"]
                if r.get("url") and r.get("state") in ("ready", "draining", "warming")
            }
            for model, entry in listed.items()
        }

    def samples(self, replicas: Mapping[str, Mapping[str, Mapping[str, str]]]) -> Samples:
        """The gateway's /metrics and its workers' (a worker that does not answer is left
        out: it may have just stopped)."""
        out = parse_exposition(self.get("/metrics").text)
        for model, members in replicas.items():
            for replica, info in members.items():
                try:
                    response = self.client.get(f"{info['url'].rstrip('/')}/metrics")
                except httpx.HTTPError:
                    continue
                if response.status_code != 200:
                    continue
                labels = {"model": model, "replica": replica, "pool": info["pool"]}
                out.update(parse_exposition(response.text, labels))
        return out


def gateway_snapshot(
    url: str, key: str | None, window_s: float, wait: Callable[[float], None] = time.sleep
) -> Snapshot:
    """Two scrapes of the gateway and its workers ``window_s`` apart."""
    with httpx.Client(timeout=HTTP_TIMEOUT_S) as client:
        gateway = _Gateway(client, url, key)
        config = gateway.get("/admin/doctor").json().get("config") or {}
        replicas = gateway.replicas()
        before = gateway.samples(replicas)
        started = time.monotonic()
        wait(window_s)
        replicas = {m: {**replicas.get(m, {}), **r} for m, r in gateway.replicas().items()}
        after = gateway.samples(replicas)
        measured_s = time.monotonic() - started
    return build_snapshot(before, after, measured_s, config, gateway.url, replicas)


def prometheus_snapshot(url: str, range_s: float, config: Mapping[str, Any]) -> Snapshot:
    """The series at now - range and at now, from a Prometheus server's HTTP API."""
    base = url.rstrip("/")
    end = time.time()
    ends: list[Samples] = []
    with httpx.Client(timeout=HTTP_TIMEOUT_S) as client:
        for at in (end - range_s, end):
            where = f"{base}/api/v1/query"
            try:
                response = client.get(where, params={"query": QUERY, "time": f"{at:.3f}"})
                body = response.json()
            except (httpx.HTTPError, ValueError) as exc:
                raise DoctorError(f"cannot ask {where}: {exc}") from None
            if body.get("status") != "success":
                raise DoctorError(f"{where}: {body.get('error') or response.status_code}")
            ends.append(prometheus_samples(body["data"]["result"]))
    # Rates over the part of the range the processes were up: a gateway started ten
    # minutes ago has no older samples, and its storm is not spread over six hours.
    started = [v for (name, _), v in ends[1].items() if name == "process_start_time_seconds"]
    window_s = min(range_s, end - min(started)) if started else range_s
    replicas: dict[str, dict[str, dict[str, str]]] = {}
    for (name, labels), _ in ends[1].items():
        if name == "tidegate_replica_info":
            d = dict(labels)
            replicas.setdefault(d.get("model", ""), {})[d.get("replica", "")] = {
                "pool": d.get("pool", ""),
                "url": d.get("url", ""),
            }
    return build_snapshot(ends[0], ends[1], max(window_s, 1.0), config, base, replicas)


def report_snapshots(path: Path, config: Mapping[str, Any]) -> list[Snapshot]:
    try:
        report = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise DoctorError(f"cannot read the simulator report {path}: {exc}") from None
    if not isinstance(report, dict) or not str(report.get("schema", "")).startswith(
        "tidegate.simulate/"
    ):
        raise DoctorError(f"{path} is not a tidegate simulate report.json")
    return report_snapshot(report, config, str(path))


def collect(options: DoctorOptions) -> list[Snapshot]:
    if options.report is not None:
        return report_snapshots(options.report, _config_of_file(options.config))
    if options.prometheus is not None:
        return [
            prometheus_snapshot(
                options.prometheus, options.range_s, _config_of_file(options.config)
            )
        ]
    return [gateway_snapshot(options.url, options.key, options.window_s)]


# ----------------------------------------------------------------------------- output


def as_json(results: list[tuple[Snapshot, Diagnosis]]) -> str:
    findings = [{**f.to_dict(), "source": s.source} for s, d in results for f in d.findings]
    return json.dumps(
        {
            "findings": findings,
            "window_s": max((s.window_s for s, _ in results), default=0.0),
            "at": time.time(),
            "sources": [s.source for s, _ in results],
            "not_measured": [n for _, d in results for n in d.not_measured],
        },
        indent=2,
    )


def as_text(results: list[tuple[Snapshot, Diagnosis]], verbose: bool) -> str:
    lines: list[str] = []
    for snapshot, diagnosis in results:
        critical = sum(f.severity == "critical" for f in diagnosis.findings)
        lines.append(
            f"tidegate doctor: {snapshot.source}, window {snapshot.window_s:.0f}s, "
            f"{len(snapshot.models)} model(s): {len(diagnosis.findings)} finding(s)"
            + (f", {critical} critical" if critical else "")
        )
        if not diagnosis.findings:
            lines.append("  healthy: no rule found a symptom")
        for rank, f in enumerate(diagnosis.findings, 1):
            numbers = ", ".join(f"{k}={v:g}" for k, v in f.numbers.items())
            lines += [
                "",
                f"{rank}. {f.severity.upper()} {f.rule} ({f.model})",
                f"   symptom: {f.symptom}",
                f"   numbers: {numbers}",
                f"   cause:   {f.cause}",
                f"   fix:     {f.fix}",
            ]
            if f.changes:
                lines.append("   config diff:")
                lines += [f"     {line}" for line in f.config_diff.splitlines()]
        if verbose and diagnosis.not_measured:
            lines += ["", "not measured (these rules stayed silent):"]
            lines += [f"  {n}" for n in diagnosis.not_measured]
        lines.append("")
    return "\n".join(lines)


def run_doctor(
    options: DoctorOptions, echo: Callable[[str], None], warn: Callable[[str], None]
) -> int:
    """Collect, diagnose, print; the exit status (module docstring)."""
    try:
        snapshots = collect(options)
    except DoctorError as exc:
        warn(f"error: {exc}")
        return 1
    results = [(s, diagnose(s, options.thresholds)) for s in snapshots]
    echo(as_json(results) if options.as_json else as_text(results, options.verbose))
    return max((d.exit_status for _, d in results), default=0)
