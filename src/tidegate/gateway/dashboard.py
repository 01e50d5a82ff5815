"""The live dashboard: ``GET /dashboard``, its assets, and ``GET /dashboard/data``.

One page (``dashboard_assets/``: HTML, plain JS, CSS, shipped in the package; nothing from a
CDN, so it works offline) polls ``/dashboard/data`` every few seconds and draws it itself
with SVG. A snapshot holds what ``/metrics`` holds at one instant, as samples
``[name, labels, value]``: counters and histogram buckets stay cumulative. Rates and
quantiles are the page's, from the difference between two snapshots, as Prometheus'
``rate()`` and ``histogram_quantile()`` compute them from two scrapes.

Per replica, the gateway reads the replica's own ``/metrics`` server-side (every replica at
once, each bounded by ``REPLICA_METRICS_TIMEOUT_S``) and keeps the series the page shows:
process CPU and memory, DCGM-compatible GPU series, batch sizes, start-up phases. A local
worker that exports no process metrics is measured with psutil on its pid (and its
children). What a replica does not export is absent, and the page shows "n/a".

Doctor's findings come from ``GET /admin/doctor`` of this same app, called in-process with
the caller's key; a 404 there means no doctor in this build ("doctor not available").

Access: the admin role whenever keys are configured (``auth.authorize_admin``). A browser
cannot send a Bearer header when it opens a page, so the key may also come as HTTP Basic
credentials (any user name, the key as password); a 401 here offers both schemes, Basic
first, and the browser asks for the key once and sends it with every poll.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import logging
import math
import time
from collections.abc import Awaitable, Callable, Iterable
from importlib import resources
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families
from starlette.exceptions import HTTPException

from tidegate.asgi import error_response
from tidegate.errors import Unauthorized
from tidegate.gateway.auth import authorize_admin
from tidegate.gateway.replicas import Replica, ReplicaState
from tidegate.gateway.state import Gateway

log = logging.getLogger("tidegate.gateway")

POLL_INTERVAL_S = 2.0  # how often the page asks for a snapshot
WINDOW_S = 10.0  # rates and quantiles: the newest snapshot against one this much older
HISTORY_S = 600.0  # how far back the page's charts reach
REPLICA_METRICS_TIMEOUT_S = 1.5  # one replica's /metrics; a slow one is "n/a" this poll
DOCTOR_TIMEOUT_S = 3.0
DOCTOR_FIELDS = ("findings", "window_s", "at", "not_measured")
ASSETS = resources.files("tidegate.gateway") / "dashboard_assets"
CONTENT_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
}
BASIC_CHALLENGE = 'Basic realm="tidegate dashboard", charset="UTF-8"'
# What the page reads from a replica's /metrics (name prefixes; the rest is not sent).
REPLICA_SERIES = (
    "process_cpu_seconds_total",
    "process_resident_memory_bytes",
    "DCGM_FI_DEV_",
    "tidegate_batch_size",
    "tidegate_worker_startup_seconds",
    "tidegate_worker_inflight",
    "tidegate_engine_memory_bytes",
    "tidegate_tokenize_seconds",
)
_LIVE = (ReplicaState.STARTING, ReplicaState.WARMING, ReplicaState.READY, ReplicaState.DRAINING)

Sample = tuple[str, dict[str, str], float | None]


def add_dashboard_routes(app: FastAPI, gateway: Gateway) -> None:
    config = gateway.config

    async def as_admin(
        request: Request, answer: Callable[[str | None], Awaitable[Response]]
    ) -> Response:
        try:
            bearer, token = _as_bearer(request)
            authorize_admin(config, bearer)
        except Unauthorized as exc:
            return _challenge(exc)
        return await answer(token)

    async def page(_token: str | None) -> Response:
        return HTMLResponse(_read_asset("index.html"), headers={"Cache-Control": "no-store"})

    @app.get("/dashboard", include_in_schema=False)
    async def dashboard(request: Request) -> Response:
        return await as_admin(request, page)

    @app.get("/dashboard/assets/{name}", include_in_schema=False)
    async def dashboard_asset(request: Request, name: str) -> Response:
        async def asset(_token: str | None) -> Response:
            suffix = name[name.rfind(".") :] if "." in name else ""
            if suffix not in CONTENT_TYPES or name not in _asset_names():
                raise HTTPException(404, f"no dashboard asset {name!r}")
            return Response(_read_asset(name), media_type=CONTENT_TYPES[suffix])

        return await as_admin(request, asset)

    @app.get("/dashboard/data", include_in_schema=False)
    async def dashboard_data(request: Request) -> Response:
        async def data(token: str | None) -> Response:
            found = await snapshot(gateway, app, token)
            return JSONResponse(found, headers={"Cache-Control": "no-store"})

        return await as_admin(request, data)


async def snapshot(gateway: Gateway, app: FastAPI, token: str | None) -> dict[str, Any]:
    """What the page draws from: the gateway's series now, each replica's, doctor's."""
    # One instant, no await in between: the same numbers /metrics would show now.
    gateway.refresh_gauges()
    at = time.time()
    samples = registry_samples(gateway.metrics.registry)
    replicas = [r for rs in gateway.replicas.values() for r in rs]
    describe = {r.id: gateway.dispatchers[r.model].describe_replica(r) for r in replicas}
    views, doctor = await asyncio.gather(
        asyncio.gather(*(replica_view(gateway, r, describe[r.id]) for r in replicas)),
        doctor_findings(app, token),
    )
    config = gateway.config
    return {
        "at": at,
        "poll_interval_s": POLL_INTERVAL_S,
        "window_s": WINDOW_S,
        "history_s": HISTORY_S,
        "levels": list(config.levels),
        "models": {
            name: {
                "task": config.model(name).task,
                "pools": list(config.model(name).pools),
                "tenants": gateway.dispatchers[name].describe_tenants(),
            }
            for name in config.models
        },
        "samples": samples,
        "replicas": list(views),
        "scale_events": scale_events(gateway, at),
        "doctor": doctor,
    }


def registry_samples(registry: CollectorRegistry) -> list[Sample]:
    """Every sample of ``registry`` as /metrics writes it (``_created`` left out)."""
    return _keep(
        (sample.name, dict(sample.labels), sample.value)
        for family in registry.collect()
        for sample in family.samples
    )


def text_samples(text: str, prefixes: tuple[str, ...] = ()) -> list[Sample]:
    """The samples of a /metrics text whose names start with one of ``prefixes`` (all
    when none are given)."""
    return _keep(
        (
            (sample.name, dict(sample.labels), sample.value)
            for family in text_string_to_metric_families(text)
            for sample in family.samples
        ),
        prefixes,
    )


def _keep(
    samples: Iterable[tuple[str, dict[str, str], float]], prefixes: tuple[str, ...] = ()
) -> list[Sample]:
    # JSON has no NaN: a gauge that is NaN (nothing measured yet) travels as null.
    return [
        (name, labels, value if math.isfinite(value) else None)
        for name, labels, value in samples
        if not name.endswith("_created") and (not prefixes or name.startswith(prefixes))
    ]


async def replica_view(
    gateway: Gateway, replica: Replica, described: dict[str, object]
) -> dict[str, Any]:
    """One replica: what the gateway knows, its own series, its process's CPU and memory."""
    view: dict[str, Any] = {
        key: described.get(key)
        for key in ("id", "model", "pool", "kind", "url", "state", "slots", "in_flight")
    }
    view.update(
        restarts=described.get("restarts"),
        pid=replica.pid,
        startup_s=described.get("startup_s"),
        samples=None,
        metrics_error=None,
        process=None,
    )
    if replica.url is None or replica.state not in _LIVE:
        view["metrics_error"] = f"not running ({replica.state.value})"
        return view
    try:
        view["samples"] = await fetch_replica_samples(gateway, replica)
    except (httpx.HTTPError, TimeoutError, ValueError) as exc:
        # A slow or broken replica costs its own cells this poll, not the page.
        log.debug("dashboard: replica %s /metrics: %r", replica.id, exc)
        view["metrics_error"] = _reason(exc)
    view["process"] = process_usage(view["samples"] or [], replica)
    return view


async def fetch_replica_samples(gateway: Gateway, replica: Replica) -> list[Sample]:
    if gateway.client is None:
        raise httpx.ConnectError("the gateway is not started")
    answer = await asyncio.wait_for(  # the whole read, not each phase of it
        gateway.client.get(
            f"{replica.url}/metrics",
            headers={**replica.auth_headers, "Accept-Encoding": "identity"},
        ),
        REPLICA_METRICS_TIMEOUT_S,
    )
    if answer.status_code != 200:
        raise ValueError(f"/metrics answered {answer.status_code}")
    return text_samples(answer.text, REPLICA_SERIES)


def _reason(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError):
        return f"/metrics took over {REPLICA_METRICS_TIMEOUT_S:g} s"
    if isinstance(exc, ValueError):
        return str(exc)
    return "/metrics unreachable"


def process_usage(samples: list[Sample], replica: Replica) -> dict[str, Any] | None:
    """CPU seconds and resident bytes: the replica's own process metrics, else psutil on a
    local worker's pid (with its children: an engine may run in a process of its own)."""
    found = {name: v for name, _, v in samples if name.startswith("process_") and v is not None}
    cpu = found.get("process_cpu_seconds_total")
    rss = found.get("process_resident_memory_bytes")
    if cpu is not None or rss is not None:
        return {"cpu_seconds": cpu, "rss_bytes": rss, "source": "metrics"}
    if replica.kind != "local" or replica.pid is None:
        return None
    return _psutil_usage(replica.pid)


def _psutil_usage(pid: int) -> dict[str, Any] | None:
    try:
        import psutil  # the engine extra has it; without it: n/a
    except ImportError:
        return None
    try:
        root = psutil.Process(pid)
        processes = [root, *root.children(recursive=True)]
        cpu = rss = 0.0
        for process in processes:
            with process.oneshot():
                times = process.cpu_times()
                cpu += times.user + times.system
                rss += process.memory_info().rss
    except psutil.Error:  # it exited between the poll and now
        return None
    return {"cpu_seconds": cpu, "rss_bytes": rss, "source": "psutil"}


def scale_events(gateway: Gateway, at: float) -> list[dict[str, Any]]:
    """The controller's recent replica count changes, on the wall clock of ``at``."""
    controller = gateway.controller
    if controller is None:
        return []
    offset = at - controller.clock.now()  # controller time -> wall time
    return [
        {
            "at": decision.decided_at + offset,
            "model": model,
            "direction": decision.direction.value,
            "reason": decision.reason.value,
            "from": decision.current_replicas,
            "to": decision.desired_replicas,
        }
        for model, decision in list(controller.scale_events)
    ]


async def doctor_findings(app: FastAPI, token: str | None) -> dict[str, Any]:
    """``GET /admin/doctor`` of this app, in-process, as the caller."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    # A doctor that fails answers 500 here, not an exception in the dashboard's poll.
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as client:
            answer = await asyncio.wait_for(
                client.get("/admin/doctor", headers=headers), DOCTOR_TIMEOUT_S
            )
    except TimeoutError:
        return {"available": False, "reason": f"doctor did not answer in {DOCTOR_TIMEOUT_S:g} s"}
    if answer.status_code == 404:
        return {"available": False, "reason": "doctor not available"}
    if answer.status_code != 200:
        return {"available": False, "reason": f"doctor answered {answer.status_code}"}
    found = answer.json()
    if not isinstance(found, dict):
        return {"available": False, "reason": "doctor answered something else than an object"}
    # What the panel shows; the running config doctor also returns stays out of every poll.
    return {"available": True, **{k: found[k] for k in DOCTOR_FIELDS if k in found}}


def _as_bearer(request: Request) -> tuple[Request, str | None]:
    """``request`` with Basic credentials turned into the Bearer key auth.py reads, and
    the key itself (None when none was sent)."""
    scheme, _, value = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() == "bearer":
        return request, value.strip() or None
    if scheme.lower() != "basic":
        return request, None
    try:
        decoded = base64.b64decode(value.strip(), validate=True).decode()
    except (binascii.Error, UnicodeDecodeError):
        raise Unauthorized("malformed Basic credentials: base64 of user:key") from None
    key = decoded.partition(":")[2]
    headers = [(k, v) for k, v in request.scope["headers"] if k != b"authorization"]
    headers.append((b"authorization", f"Bearer {key}".encode()))
    return Request({**request.scope, "headers": headers}), key


def _challenge(exc: Unauthorized) -> Response:
    """A 401 that a browser answers with its own key prompt (Basic), Bearer still offered."""
    response = error_response(exc)
    bearer = response.headers["WWW-Authenticate"]
    response.headers["WWW-Authenticate"] = BASIC_CHALLENGE
    response.headers.append("WWW-Authenticate", bearer)
    return response


def _asset_names() -> set[str]:
    return {entry.name for entry in ASSETS.iterdir() if entry.is_file()}


def _read_asset(name: str) -> bytes:
    return (ASSETS / name).read_bytes()
