"""The one exception tree of tidegate; each class maps to one HTTP status and OpenAI body.

::

    TidegateError                      500 internal_error
    ├── InvalidRequest                 400 invalid_request_error
    │   └── PromptTooLong              413 invalid_request_error / context_length_exceeded
    ├── Unauthorized                   401 authentication_error (+ WWW-Authenticate)
    ├── Forbidden                      403 permission_error (a key without the admin role)
    │   └── PriorityForbidden          403 permission_error / priority_above_cap
    ├── ModelNotFound                  404 invalid_request_error / model_not_found
    ├── Overloaded                     429 rate_limit_error (+ Retry-After)
    ├── ReplicaFailed                  502 upstream_error
    ├── NotReady                       503 service_unavailable (+ Retry-After)
    ├── QueueTimeout                   504 timeout
    └── ConfigError                    raised at start-up: names the file, the key and the fix

Expected scheduling outcomes are values in ``tidegate.core``; these exceptions are for the
shells (HTTP, processes, config) where an outcome must become a response.
"""

from __future__ import annotations

from typing import Any, ClassVar


class TidegateError(Exception):
    status: ClassVar[int] = 500
    error_type: ClassVar[str] = "internal_error"
    default_code: ClassVar[str | None] = None

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code if code is not None else self.default_code
        self.retry_after_s = retry_after_s

    def body(self) -> dict[str, Any]:
        """The OpenAI-shaped error body."""
        return {
            "error": {
                "message": self.message,
                "type": self.error_type,
                "param": self.param,
                "code": self.code,
            }
        }

    def headers(self) -> dict[str, str]:
        if self.retry_after_s is None:
            return {}
        # Retry-After is whole seconds; never 0, or clients retry in a tight loop.
        return {"Retry-After": str(max(1, round(self.retry_after_s + 0.499)))}


class InvalidRequest(TidegateError):
    status = 400
    error_type = "invalid_request_error"


class PromptTooLong(InvalidRequest):
    status = 413
    default_code = "context_length_exceeded"


class Unauthorized(TidegateError):
    status = 401
    error_type = "authentication_error"
    default_code = "invalid_api_key"

    def headers(self) -> dict[str, str]:
        # RFC 9110: a 401 says how to authenticate (RFC 6750: a Bearer token).
        return {**super().headers(), "WWW-Authenticate": 'Bearer realm="tidegate"'}


class Forbidden(TidegateError):
    status = 403
    error_type = "permission_error"
    default_code = "admin_required"


class PriorityForbidden(Forbidden):
    default_code = "priority_above_cap"


class ModelNotFound(TidegateError):
    status = 404
    error_type = "invalid_request_error"
    default_code = "model_not_found"


class Overloaded(TidegateError):
    status = 429
    error_type = "rate_limit_error"


class ReplicaFailed(TidegateError):
    status = 502
    error_type = "upstream_error"
    default_code = "replica_failed"


class NotReady(TidegateError):
    status = 503
    error_type = "service_unavailable"


class QueueTimeout(TidegateError):
    status = 504
    error_type = "timeout"
    default_code = "queue_timeout"


class ConfigError(TidegateError):
    """A configuration problem, reported before anything starts."""

    def __init__(self, file: str, key: str, problem: str, fix: str) -> None:
        super().__init__(f"{file}: {key}: {problem}. Fix: {fix}", param=key, code="bad_config")
        self.file = file
        self.key = key
