"""Replicas as the gateway sees them: where they are, whether they are ready, how busy.

A replica is one OpenAI-compatible server of one model: a local ``tidegate worker``
process or a static upstream (vLLM, SGLang, TGI, another tidegate). It gets traffic only
while READY. ``in_flight`` is counted by the gateway itself (requests it sent and not yet
finished), ``slots`` is what the replica can batch soon (from its /stats or the config).
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field

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
    restarts: int = 0
    pid: int | None = None  # local workers: the process (and process group) id
    detail: str = ""  # why it is in its state, for /admin/replicas and logs
    on_change: Callable[[Replica], None] | None = field(default=None, repr=False)

    @property
    def ready(self) -> bool:
        return self.state is ReplicaState.READY

    def set_state(self, state: ReplicaState, detail: str = "") -> None:
        """Change state and tell the dispatcher (a replica became ready, or went away)."""
        changed = state is not self.state
        self.state = state
        self.detail = detail
        if changed and self.on_change is not None:
            self.on_change(self)

    def view(self) -> ReplicaView:
        return ReplicaView(self.id, self.pool, self.ready, self.in_flight, self.slots)

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
            "restarts": self.restarts,
            "pid": self.pid,
            "detail": self.detail,
        }
