"""The admin API: replicas, the autoscaler's decisions, defragmentation, doctor.

Every route needs a key with role ``admin`` whenever keys are configured (auth).

``DoctorWatch`` evaluates doctor's rules (core.diagnose) on the gateway's own registry
every ``interval_s`` over the last ``window_s``, off the request path: it sets
``tidegate_doctor_findings{rule,severity}`` (0 once a finding clears) and keeps the
latest diagnosis for ``GET /admin/doctor``, which also carries the running config so that
``tidegate doctor`` can diff its fixes against it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import AsyncIterator
from typing import Any

import yaml
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from tidegate.config import render_config
from tidegate.core.diagnose import RULE_NAMES, Diagnosis, diagnose
from tidegate.errors import InvalidRequest
from tidegate.gateway.auth import authorize_admin
from tidegate.gateway.state import Gateway
from tidegate.ops.doctor import public_config
from tidegate.ops.snapshot import Samples, build_snapshot, registry_samples


class DoctorWatch:
    """Doctor's rules over the gateway's own metrics, every few seconds (module docstring)."""

    def __init__(self, gateway: Gateway, interval_s: float = 5.0, window_s: float = 60.0):
        self.gateway = gateway
        self.interval_s = interval_s
        self.window_s = window_s
        self.config = public_config(yaml.safe_load(render_config(gateway.config)))
        self.history: deque[tuple[float, Samples]] = deque()  # (monotonic s, samples)
        self.latest: Diagnosis | None = None
        self.latest_at = 0.0  # wall-clock seconds of the latest evaluation
        self._counted: set[tuple[str, str]] = set()

    def evaluate(self) -> Diagnosis:
        """Sample the registry now and diagnose the window since the oldest kept sample."""
        metrics = self.gateway.metrics
        self.gateway.refresh_gauges()  # as /metrics does
        now = time.monotonic()
        self.history.append((now, registry_samples(metrics.registry)))
        while len(self.history) > 2 and now - self.history[1][0] >= self.window_s:
            self.history.popleft()
        (start, before), (_, after) = self.history[0], self.history[-1]
        snapshot = build_snapshot(before, after, now - start, self.config, "gateway")
        diagnosis = diagnose(snapshot)
        self._set_gauge(diagnosis)
        self.latest, self.latest_at = diagnosis, time.time()
        return diagnosis

    def _set_gauge(self, diagnosis: Diagnosis) -> None:
        counts: dict[tuple[str, str], int] = {}
        for finding in diagnosis.findings:
            key = (finding.rule, finding.severity)
            counts[key] = counts.get(key, 0) + 1
        gauge = self.gateway.metrics.doctor_findings
        for key in self._counted - set(counts):
            gauge.labels(*key).set(0)
        for key, count in counts.items():
            gauge.labels(*key).set(count)
        self._counted |= set(counts)

    async def run(self) -> None:
        while True:
            self.evaluate()
            await asyncio.sleep(self.interval_s)

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        task = asyncio.create_task(self.run(), name="doctor")
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def describe(self) -> dict[str, Any]:
        diagnosis = self.latest or self.evaluate()
        window_s = self.history[-1][0] - self.history[0][0] if self.history else 0.0
        return {
            "findings": [f.to_dict() for f in diagnosis.findings],
            "window_s": round(window_s, 3),
            "at": self.latest_at,
            "rules": list(RULE_NAMES),
            "not_measured": list(diagnosis.not_measured),
            "config": self.config,
        }


def add_admin_routes(app: FastAPI, gateway: Gateway) -> None:
    config = gateway.config
    doctor = app.state.doctor = DoctorWatch(gateway)

    @app.get("/admin/doctor")
    async def admin_doctor(request: Request) -> dict[str, Any]:
        """Doctor's latest findings over the gateway's own metrics, ranked by impact."""
        authorize_admin(config, request)
        return doctor.describe()

    @app.get("/admin/replicas")
    async def admin_replicas(request: Request) -> dict[str, Any]:
        authorize_admin(config, request)
        return {
            model: {
                "queued": len(gateway.dispatchers[model].queue),
                "tenants": gateway.dispatchers[model].describe_tenants(),
                "replicas": [
                    gateway.dispatchers[model].describe_replica(replica) for replica in replicas
                ],
            }
            for model, replicas in gateway.replicas.items()
        }

    @app.get("/admin/autoscaler")
    async def admin_autoscaler(request: Request) -> dict[str, Any]:
        authorize_admin(config, request)
        controller = gateway.controller
        if controller is None:
            return {"models": {}, "note": "no model is autoscaled in this configuration"}
        return {"models": controller.describe()}

    @app.get("/admin/defrag")
    async def admin_defrag_plan(request: Request) -> dict[str, Any]:
        authorize_admin(config, request)
        controller = _controller(gateway)
        plan = controller.plan_defrag()
        return {
            "moves": [
                {"replica": m.replica_id, "from": m.from_device, "to": m.to_device}
                for m in plan.moves
            ],
            "frees": list(plan.freed_devices),
            "in_offpeak_window": controller.in_offpeak_window(),
        }

    @app.post("/admin/defrag")
    async def admin_defrag(request: Request, force: bool = False) -> JSONResponse:
        authorize_admin(config, request)
        controller = _controller(gateway)
        if not force and not controller.in_offpeak_window():
            return JSONResponse(
                {
                    "status": "refused",
                    "reason": "outside the off-peak window (force=true overrides)",
                },
                409,
            )
        return JSONResponse(await controller.run_defrag())


def _controller(gateway: Gateway) -> Any:
    if gateway.controller is None:
        raise InvalidRequest("no model is autoscaled or placed by the controller here")
    return gateway.controller
