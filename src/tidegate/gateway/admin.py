"""The admin API: replicas, the autoscaler's decisions, defragmentation.

Every route needs a key with role ``admin`` whenever keys are configured (auth).
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from tidegate.errors import InvalidRequest
from tidegate.gateway.auth import authorize_admin
from tidegate.gateway.state import Gateway


def add_admin_routes(app: FastAPI, gateway: Gateway) -> None:
    config = gateway.config

    @app.get("/admin/replicas")
    async def admin_replicas(request: Request) -> dict[str, Any]:
        authorize_admin(config, request)
        return {
            model: {
                "queued": len(gateway.dispatchers[model].queue),
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
