"""Static upstreams (vLLM, SGLang, TGI, another tidegate): one Replica each, health-checked.

For every model with ``engine: openai``, one ``Replica`` per upstream URL (``kind="upstream"``,
in the model's first pool, ids like ``vllm-0``). Every ``interval_s`` a check asks, in turn
until one does not answer 404:

* ``/readyz`` (a tidegate worker or gateway),
* ``/health`` (vLLM, SGLang, TGI),
* ``/v1/models`` (any OpenAI-compatible server).

200: READY. Any other answer, a timeout or no connection: FAILED with the reason; the next
check that gets a 200 makes it READY again. The path that answered is asked first next time.
An upstream's ``slots`` is the model's ``slots``, else ``DEFAULT_UPSTREAM_SLOTS``.

An upstream started with ``--api-key`` (``api_key_env`` in the config) gets the key as
``Authorization: Bearer`` on every check and every forwarded request (``auth_headers``);
it is never logged nor shown.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import httpx

from tidegate.config import TidegateConfig, UpstreamKey
from tidegate.gateway.replicas import Replica, ReplicaState

log = logging.getLogger("tidegate.control")

# In-flight requests the gateway sends one upstream when the config does not say: vLLM and
# its kin batch continuously, so a handful at once keeps them busy without queueing there.
DEFAULT_UPSTREAM_SLOTS = 8
PROBE_PATHS = ("/readyz", "/health", "/v1/models")
DETAIL_MAX_CHARS = 300


class UpstreamHealth:
    """Health checks of the configured upstreams, reported through their replicas' state."""

    def __init__(
        self,
        config: TidegateConfig,
        *,
        on_change: Callable[[Replica], None],
        interval_s: float = 2.0,
        timeout_s: float = 2.0,
        transport: httpx.AsyncBaseTransport | None = None,  # tests: a mock transport
    ) -> None:
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self._transport = transport
        self.replicas: list[Replica] = []
        for model in config.models.values():
            if model.local:
                continue
            for index, url in enumerate(model.upstreams):
                self.replicas.append(
                    Replica(
                        id=f"{model.name}-{index}",
                        model=model.name,
                        pool=model.upstream_pool,
                        kind="upstream",
                        url=url,
                        slots=model.slots or DEFAULT_UPSTREAM_SLOTS,
                        detail="not checked yet",
                        on_change=on_change,
                        auth_headers=_auth_headers(model.upstream_key(index)),
                    )
                )
        self._paths: dict[str, str] = {}  # replica id -> the probe path that answered last
        self._client: httpx.AsyncClient | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._started = False

    async def start(self) -> None:
        """Start one checking task per upstream; the first checks run at once."""
        if self._started:
            raise RuntimeError("UpstreamHealth.start() was already called")
        self._started = True
        self._client = httpx.AsyncClient(
            timeout=httpx.Timeout(self.timeout_s), transport=self._transport
        )
        self._tasks = [
            asyncio.create_task(self._watch(replica), name=f"health-{replica.id}")
            for replica in self.replicas
        ]

    async def stop(self) -> None:
        """Stop checking; every upstream replica becomes STOPPED. Idempotent."""
        for task in self._tasks:
            task.cancel()
        if self._tasks:
            await asyncio.wait(self._tasks)
        for task in self._tasks:
            if not task.cancelled() and (exc := task.exception()) is not None:
                log.error("health check %s crashed", task.get_name(), exc_info=exc)
        self._tasks = []
        if self._client is not None:
            await self._client.aclose()
            self._client = None
        for replica in self.replicas:
            replica.set_state(ReplicaState.STOPPED, "stopped")

    async def check(self, replica: Replica) -> None:
        """Check one upstream now and set its state (the checking tasks call this)."""
        assert self._client is not None, "start() first"
        assert replica.url is not None
        last = self._paths.get(replica.id)
        paths = [last, *(p for p in PROBE_PATHS if p != last)] if last else list(PROBE_PATHS)
        for path in paths:
            try:
                response = await self._client.get(
                    f"{replica.url}{path}", headers=dict(replica.auth_headers)
                )
            except httpx.HTTPError as exc:
                self._set(replica, ReplicaState.FAILED, f"{path}: {type(exc).__name__}: {exc}")
                return
            if response.status_code == 404:
                continue
            self._paths[replica.id] = path
            if response.status_code == 200:
                self._set(replica, ReplicaState.READY, f"{path} answers 200")
            else:
                self._set(
                    replica,
                    ReplicaState.FAILED,
                    f"{path} answers {response.status_code}{_status(response)}",
                )
            return
        self._paths.pop(replica.id, None)
        self._set(
            replica, ReplicaState.FAILED, f"no health endpoint: {', '.join(PROBE_PATHS)} are 404"
        )

    async def _watch(self, replica: Replica) -> None:
        while True:
            await self.check(replica)
            await asyncio.sleep(self.interval_s)

    @staticmethod
    def _set(replica: Replica, state: ReplicaState, detail: str) -> None:
        if len(detail) > DETAIL_MAX_CHARS:
            detail = detail[: DETAIL_MAX_CHARS - 3] + "..."
        if state is not replica.state:
            level = logging.INFO if state is ReplicaState.READY else logging.WARNING
            log.log(
                level, "upstream %s (%s) is %s: %s", replica.id, replica.url, state.value, detail
            )
        replica.set_state(state, detail)


def _auth_headers(key: UpstreamKey | None) -> dict[str, str]:
    return {} if key is None else key.headers()


def _status(response: httpx.Response) -> str:
    """``: warming`` when the body says its status (a tidegate /readyz does)."""
    try:
        body = response.json()
    except ValueError:
        return ""
    if isinstance(body, dict) and isinstance(body.get("status"), str):
        return f": {body['status']}"
    return ""
