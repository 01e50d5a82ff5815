"""Replicas as the gateway sees them: where they are, whether they are ready, how busy.

A replica is one OpenAI-compatible server of one model: a local ``tidegate worker``
process or a static upstream (vLLM, SGLang, TGI, another tidegate). It gets traffic only
while READY. ``in_flight`` is counted by the gateway itself (requests it sent and not yet
finished), ``slots`` is what the replica can batch soon (from its /stats or the config).
``outlier`` is its passive failure record (core.outliers): a READY replica that keeps
failing is ejected from routing for a while. ``coming`` says whether one that is not ready
is expected to become so without anyone acting (starting, warming, or being restarted).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from tidegate.core.outliers import OutlierState
from tidegate.core.routing import ReplicaView


class ReplicaState(enum.Enum):
    STARTING = "starting"
    WARMING = "warming"
    READY = "ready"
    DRAINING = "draining"
    STOPPED = "stopped"  # terminal for this replica id
    FAILED = "failed"  # not answering its health check; may recover (upstreams) or restart


@dataclass(eq=False)
class Replica:
    id: str
    model: str
    pool: str
    kind: str  # "local" or "upstream"
    url: str | None = None  # base URL without /v1; None until a local worker has bound
    state: ReplicaState = ReplicaState.STARTING
    slots: int = 1
    in_flight: int = 0
    tokens: int = 0  # cost_tokens of its requests in flight (prefix affinity's bound)
    restarts: int = 0
    pid: int | None = None  # local workers: the process (and process group) id
    detail: str = ""  # why it is in its state, for /admin/replicas and logs
    on_change: Callable[[Replica], None] | None = field(default=None, repr=False)
    outlier: OutlierState = field(default_factory=OutlierState)  # the dispatcher's record
    startup_s: float | None = None  # measured from its last launch to READY (local workers)
    # sent with every request and health check (an upstream's API key); never shown
    auth_headers: Mapping[str, str] = field(default_factory=dict, repr=False)

    @property
    def ready(self) -> bool:
        return self.state is ReplicaState.READY

    @property
    def coming(self) -> bool:
        """Not ready, but expected to be: starting, warming, or failed and restarted by its
        orchestrator. A failed upstream is not: nothing here restarts it."""
        if self.state in (ReplicaState.STARTING, ReplicaState.WARMING):
            return True
        return self.state is ReplicaState.FAILED and self.kind != "upstream"

    def set_state(self, state: ReplicaState, detail: str = "") -> None:
        """Change state and tell the dispatcher (a replica became ready, or went away)."""
        changed = state is not self.state
        if changed and state is ReplicaState.READY:
            # A new life (restarted, or its health check passes again): judged afresh, as
            # Envoy un-ejects a host that passes its active health check.
            self.outlier = OutlierState()
        self.state = state
        self.detail = detail
        if changed and self.on_change is not None:
            self.on_change(self)

    def view(self) -> ReplicaView:
        return ReplicaView(self.id, self.pool, self.ready, self.in_flight, self.slots, self.tokens)

    def describe(self) -> dict[str, object]:
        return {
            "id": self.id,
            "model": self.model,
            "pool": self.pool,
            "kind": self.kind,
            "url": self.url,
            "state": self.state.value,
            "slots": self.slots,
            "in_flight": self.in_flight,
            "tokens_in_flight": self.tokens,
            "restarts": self.restarts,
            "pid": self.pid,
            "detail": self.detail,
        }
