"""Who is asking, and at which priority: API keys (class, cap, role) and the asked level.

A request may lower its own priority, never raise it above its key's cap. ``/admin/*``
needs a key with role ``admin`` (403 for another key); ``/metrics`` needs what
``gateway.metrics_auth`` says. Without a key, or with an unknown one: 401 with
``WWW-Authenticate: Bearer``. With no keys configured the service is open (it binds
127.0.0.1 by default), admin API included. Keys are matched in constant time
(``TidegateConfig.key_for``).

Tenant (fair sharing inside a level): the value of the header ``tenancy.header`` names when
the operator configured one and the request carries it (1-64 characters of letters, digits
and ``. _ : @ -``, else 400), else the key's name, else "" (one anonymous tenant). A tenant
header the config does not name is ignored: a client cannot pick its own tenant.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fastapi import Request

from tidegate.config import KeySpec, TidegateConfig
from tidegate.config.values import TENANT_RE
from tidegate.errors import Forbidden, InvalidRequest, PriorityForbidden, Unauthorized


def authenticate(config: TidegateConfig, headers: Mapping[str, str]) -> KeySpec | None:
    """The key of a request with these (lower-case) headers; None on an open service."""
    if config.open_service:
        return None
    header = headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise Unauthorized("an API key is required: Authorization: Bearer <key>")
    key = config.key_for(token.strip())
    if key is None:
        raise Unauthorized("invalid API key")
    return key


def authorize_admin(config: TidegateConfig, request: Request) -> KeySpec | None:
    """The admin key of ``request`` (None on an open service); 401 or 403 otherwise."""
    key = authenticate(config, request.headers)
    if key is not None and not key.admin:
        raise Forbidden(
            f"key {key.name} has role {key.role}; {request.url.path} needs a key with role admin"
        )
    return key


def authorize_metrics(config: TidegateConfig, request: Request) -> None:
    """``/metrics`` per ``gateway.metrics_auth``: open, any valid key, or an admin key."""
    mode = config.gateway.metrics_auth
    if mode == "key":
        authenticate(config, request.headers)
    elif mode == "admin":
        authorize_admin(config, request)


def request_tenant(config: TidegateConfig, key: KeySpec | None, headers: Mapping[str, str]) -> str:
    """Who the request is for (module docstring); InvalidRequest on a bad header value."""
    header = config.tenancy.header
    if header is not None:
        value = headers.get(header)
        if value is not None:
            if not TENANT_RE.fullmatch(value):
                raise InvalidRequest(
                    f"header {header} must be 1-64 characters of letters, digits and . _ : @ -",
                    param=header,
                    code="invalid_tenant",
                )
            return value
    return key.name if key is not None else ""


def requested_level(
    config: TidegateConfig, key: KeySpec | None, headers: Mapping[str, str], payload: dict[str, Any]
) -> int:
    asked: Any = headers.get("x-priority")
    if asked is None:
        asked = payload.get("priority")
    default = key.default_level if key else config.default_level
    if asked is None:
        return default
    if isinstance(asked, bool) or not isinstance(asked, str | int):
        raise InvalidRequest("priority must be a level name or index", param="priority")
    try:
        level = config.parse_priority(asked)
    except ValueError as exc:
        raise InvalidRequest(str(exc), param="priority") from None
    if key is not None and level < key.max_level:
        raise PriorityForbidden(
            f"key {key.name} may ask for {key.max_priority} at most, not {asked}",
            param="priority",
        )
    return level
